"""The calls of the store's differential test, run against one implementation per
process: ``python store_diff_cases.py mooncake|pagewire [basic|capacity]``. Prints one JSON object: case
name -> what callers branch on (return codes, and whether the bytes read are right).

``mooncake`` starts the wheel's ``mooncake_master`` on a free 127.0.0.1 port and uses
``mooncake.store.MooncakeDistributedStore``; ``pagewire`` starts a pagewire master in this
process and uses ``pagewire.mooncake_compat.MooncakeDistributedStore``. Both clients
contribute a 16 MiB segment and talk TCP.
"""

import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

MIB = 1 << 20


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"master on port {port} did not start")


def start(impl: str):
    """(store class, config class, master address, cleanup)."""
    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        port = free_port()
        exe = Path(sys.executable).parent / "mooncake_master"
        proc = subprocess.Popen(
            [str(exe), f"-rpc_port={port}", f"-metrics_port={free_port()}",
             "-rpc_address=127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(port)
        return MooncakeDistributedStore, ReplicateConfig, f"127.0.0.1:{port}", proc.kill
    from pagewire import StoreMaster
    from pagewire.mooncake_compat import MooncakeDistributedStore, ReplicateConfig

    m = StoreMaster("127.0.0.1:0")
    return MooncakeDistributedStore, ReplicateConfig, m.address, m.shutdown


def basic(Store, Config, master: str, out: dict) -> None:
    s = Store()
    out["setup"] = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master)
    buf = np.zeros(40 * MIB, dtype=np.uint8)
    p = buf.ctypes.data
    buf[: 8 * MIB] = np.random.default_rng(7).integers(0, 256, 8 * MIB, dtype=np.uint8)
    dst = buf[8 * MIB : 16 * MIB]
    d = dst.ctypes.data

    out["register_ok"] = s.register_buffer(p, buf.nbytes)
    out["register_twice"] = s.register_buffer(p, buf.nbytes)
    stray = np.zeros(8192, dtype=np.uint8)
    out["register_zero"] = s.register_buffer(stray.ctypes.data, 0)
    out["unregister_unknown"] = s.unregister_buffer(stray.ctypes.data)

    out["put_batch"] = s.batch_put_from(["a", "b", "c"], [p, p + 4096, p + 8192], [4096, 4096, 4096])
    out["put_existing"] = s.batch_put_from(["a"], [p + 65536], [4096])
    r = s.batch_get_into(["a"], [d], [4096])
    out["existing_keeps_first"] = [r, bytes(dst[:4096]) == bytes(buf[:4096])]
    out["put_mismatched"] = s.batch_put_from(["m1", "m2"], [p], [4096, 4096])
    out["put_empty"] = s.batch_put_from([], [], [])
    out["put_size_zero"] = s.batch_put_from(["z"], [p], [0])
    out["put_unregistered"] = s.batch_put_from(["u"], [stray.ctypes.data], [4096])

    dst[:] = 0
    r = s.batch_get_into(["b", "c", "missing"], [d, d + 4096, d + 8192], [4096, 4096, 4096])
    out["get_batch"] = [r, bytes(dst[:8192]) == bytes(buf[4096:12288])]
    out["get_small_buffer"] = s.batch_get_into(["b"], [d], [4095])
    out["get_larger_buffer"] = s.batch_get_into(["b"], [d], [65536])
    out["get_mismatched"] = s.batch_get_into(["b", "c"], [d], [4096, 4096])
    out["get_into"] = s.get_into("c", d, 4096)

    out["multi_put"] = s.batch_put_from_multi_buffers(["mb"], [[p + MIB, p + 2 * MIB]], [[4096, 4096]])
    dst[:] = 0
    r = s.batch_get_into_multi_buffers(["mb"], [[d, d + 100000]], [[4096, 4096]])
    ok = bytes(dst[:4096]) == bytes(buf[MIB : MIB + 4096]) and bytes(
        dst[100000:104096]
    ) == bytes(buf[2 * MIB : 2 * MIB + 4096])
    out["multi_get"] = [r, ok]

    out["exist"] = [s.batch_is_exist(["a", "missing"]), s.is_exist("a"), s.is_exist("missing"), s.batch_is_exist([])]
    out["warm_put"] = s.put("warm", b"w" * 4096)
    out["warm_get"] = s.get("warm") == b"w" * 4096
    out["warm_size"] = s.get_size("warm")
    out["get_missing"] = [s.get("missing").decode(), s.get_size("missing")]

    s.batch_put_from(["e1"], [p], [4096])
    out["exist_leases"] = [s.is_exist("e1"), s.remove("e1")]
    out["remove_leased"] = [s.remove("a"), s.remove("a", True), s.remove("a")]
    out["batch_remove"] = s.batch_remove(["warm", "missing"], True)

    cfg = Config()
    cfg.replica_num = 2
    out["replicas_best_effort"] = s.batch_put_from(["r2"], [p], [4096], cfg)
    cfg = Config()
    cfg.with_hard_pin = True
    out["hard_pin"] = s.batch_put_from(["hp"], [p], [4096], cfg)
    cfg = Config()
    cfg.prefer_alloc_in_same_node = True
    out["same_node"] = s.batch_put_from(["sn1", "sn2"], [p, p], [4096, 4096], cfg)
    out["config_fields"] = sorted(a for a in dir(Config()) if not a.startswith("_"))

    out["remove_all"] = s.remove_all(True) > 0
    out["health"] = s.health_check()
    out["close"] = s.close()
    out["health_after_close"] = s.health_check()


def capacity(s, Config, out: dict) -> None:
    """Room and eviction, on a fresh store (nothing leased or held from earlier calls)."""
    buf = np.zeros(48 * MIB, dtype=np.uint8)
    p = buf.ctypes.data
    out["cap_register"] = s.register_buffer(p, buf.nbytes)
    out["object_larger_than_segment"] = s.batch_put_from(["huge"], [p], [32 * MIB])
    # One batch fills the segment: its own objects cannot make room for each other.
    keys = [f"h{i}" for i in range(20)]
    out["one_batch_overfills"] = s.batch_put_from(keys, [p + (i % 8) * MIB for i in range(20)], [MIB] * 20)
    # Full, nothing leased: a later put waits for nobody in pagewire (it evicts now);
    # Mooncake refuses and evicts in the background.
    out["full_then_put"] = s.batch_put_from([f"x{i}" for i in range(4)], [p + i * MIB for i in range(4)], [MIB] * 4)
    out["cap_remove_all"] = s.remove_all(True) > 0
    # 14 MiB leased, then 4 MiB asked for in one batch: 2 MiB fit, the rest has no room.
    keys = [f"f{i}" for i in range(7)]
    out["fill"] = s.batch_put_from(keys, [p + 2 * i * MIB for i in range(7)], [2 * MIB] * 7)
    got = s.batch_get_into(keys, [p + (16 + 2 * i) * MIB for i in range(7)], [2 * MIB] * 7)
    out["lease_all"] = got
    out["no_space_when_leased"] = s.batch_put_from(["g0", "g1"], [p, p + 2 * MIB], [2 * MIB] * 2)
    out["cap_close"] = s.close()


def _catch(f):
    """``f()``, or the name of the exception it raised (and its message for the
    RuntimeErrors whose text callers see)."""
    try:
        return f()
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    except Exception as e:  # noqa: BLE001 - the type is the result
        return type(e).__name__


def surface(Store, Config, master: str, out: dict) -> None:
    """The calls beyond the zero-copy core (issue 28 item 2), on a fresh store."""
    import importlib

    mod = importlib.import_module(Store.__module__.replace("_mooncake_store", "mooncake_store"))
    setup = ["127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master]
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
           "protocol": "tcp", "master_server_addr": master}  # fmt: skip
    spare = []
    for sizes in (("16MB", "16 mb"), ("16777216", 16 * MIB), ("16XB", "16MB"), ("0.5GB", "1k")):
        t = Store()
        spare.append(t)
        out[f"setup_sizes_{sizes[0]}"] = t.setup({**cfg, "global_segment_size": sizes[0], "local_buffer_size": sizes[1]})
    out["setup_positional_string"] = _catch(lambda: Store().setup(*setup[:2], "16MB", *setup[3:]))
    t = Store()
    spare.append(t)
    t.setup("localhost", *setup[1:])
    host, _, port = t.get_hostname().rpartition(":")
    out["get_hostname_form"] = [host, 12300 <= int(port) < 14300]
    for t in spare:
        t.close()

    s = Store()
    out["surface_setup"] = s.setup(*setup)
    buf = np.zeros(8 * MIB, dtype=np.uint8)
    p = buf.ctypes.data
    buf[:MIB] = np.random.default_rng(11).integers(0, 256, MIB, dtype=np.uint8)
    out["surface_register"] = s.register_buffer(p, buf.nbytes)

    # copying batch calls
    out["put_batch_values"] = s.put_batch(["pb1", "pb2"], [b"one", bytearray(b"two!")])
    out["put_batch_existing"] = [s.put_batch(["pb1", "pb3"], [b"XXX", b"three"]), s.get("pb1").decode()]
    out["put_batch_errors"] = [s.put_batch(["e1"], [b"1", b"2"]), s.put_batch([], []), s.put_batch(["e2"], [b""])]
    out["get_batch"] = [v.decode() for v in s.get_batch(["pb1", "pb2", "pb3", "missing"])]
    out["get_batch_empty"] = [v.decode() for v in s.get_batch([])]
    h = s.get_buffer("pb2")
    out["get_buffer"] = [h.ptr() != 0, h.size(), bytes(memoryview(h)).decode(), s.get_buffer("missing")]
    hs = s.batch_get_buffer(["pb1", "missing"])
    out["batch_get_buffer"] = [bytes(memoryview(hs[0])).decode(), hs[1], s.batch_get_buffer([])]
    out["put_parts"] = [s.put_parts("pp", b"ab", bytearray(b"cd"), memoryview(b"ef")), s.get("pp").decode()]
    out["put_parts_none"] = [s.put_parts("pq"), s.is_exist("pq")]
    buf[MIB : MIB + 64] = 7
    r = s.put_from_with_metadata("pm", p, p + MIB, 4096, 64)
    out["put_from_with_metadata"] = [r, s.get("pm") == bytes(buf[MIB : MIB + 64]) + bytes(buf[:4096])]
    out["put_from_with_metadata_empty"] = [s.put_from_with_metadata("pm0", p, p + MIB, 0, 64), s.is_exist("pm0")]

    # upserts replace, leased or not
    out["upsert"] = [s.upsert("u", b"one"), s.upsert("u", b"twotwo"), s.get("u").decode()]
    out["upsert_leased"] = [s.get("pb1").decode(), s.upsert("pb1", b"new"), s.get("pb1").decode()]
    out["upsert_batch"] = [s.upsert_batch(["u", "u2"], [b"x", b"yy"]), [v.decode() for v in s.get_batch(["u", "u2"])]]
    out["upsert_parts"] = [s.upsert_parts("u", b"p1", b"p2"), s.get("u").decode()]
    out["upsert_from"] = [s.upsert_from("uf", p, 4096), s.upsert_from("uf", p + 1, 100), s.get_size("uf")]
    out["batch_upsert_from"] = [s.batch_upsert_from(["uf", "ug"], [p, p], [200, 300]), s.get_size("uf"), s.get_size("ug")]
    out["upsert_errors"] = [s.upsert("ue", b""), s.upsert_batch(["ue"], [b"1", b"2"])]

    # replica queries
    reps = s.get_replica_desc("pb2")
    d = reps[0].get_memory_descriptor().buffer_descriptor
    out["get_replica_desc"] = [
        len(reps), reps[0].is_memory_replica(), reps[0].is_disk_replica(),
        reps[0].is_local_disk_replica(), int(reps[0].status), d.size,
        d.transport_endpoint.startswith("127.0.0.1:"), d.buffer_address != 0,
        _catch(reps[0].get_disk_descriptor),
    ]  # fmt: skip
    out["get_replica_desc_missing"] = s.get_replica_desc("missing")
    out["batch_get_replica_desc"] = sorted(s.batch_get_replica_desc(["pb2", "pm", "missing"]))

    # replica clear: written, never read (so not leased)
    s.put_batch(["x", "y", "y2"], [b"xx", b"yy", b"zz"])
    out["batch_replica_clear"] = [
        s.batch_replica_clear(["x", "missing"]),
        s.batch_replica_clear(["y"], s.get_hostname()),
        s.batch_replica_clear(["y2"], "127.0.0.1:1"),
        s.batch_is_exist(["x", "y", "y2"]),
        s.batch_replica_clear([]),
    ]
    s.put_batch(["rx1", "rx2", "rxz"], [b"1", b"2", b"3"])
    out["remove_by_regex_bad"] = s.remove_by_regex("((")
    out["remove_by_regex"] = [s.remove_by_regex("^rx[0-9]$"), s.batch_is_exist(["rx1", "rx2", "rxz"])]

    # ranged reads into registered memory
    s.put_from("r1", p, 1000)
    dst = p + 2 * MIB
    r = s.get_into_ranges([dst, p + 3 * MIB], [["r1", "missing"], ["r1"]], [[[0, 10], [0]], [[5]]],
                          [[[0, 100], [0]], [[999]]], [[[10, 20], [5]], [[1]]])  # fmt: skip
    ok = bytes(buf[2 * MIB : 2 * MIB + 30]) == bytes(buf[0:10]) + bytes(buf[100:120]) and buf[3 * MIB + 5] == buf[999]
    out["get_into_ranges"] = [r, bool(ok)]
    out["get_into_ranges_errors"] = [
        s.get_into_ranges([dst], [["r1"]], [[[0]]], [[[990]]], [[[20]]]),
        s.get_into_ranges([dst], [["r1"]], [[[0, 1]]], [[[990]]], [[[20]]]),
        s.get_into_ranges([dst, p], [["r1"]], [[[0]]], [[[0]]], [[[20]]]),
        s.get_into_ranges([p + 8 * MIB - 10], [["r1"]], [[[0]]], [[[0]]], [[[20]]]),
        s.get_into_ranges([np.zeros(64, np.uint8).ctypes.data], [["r1"]], [[[0]]], [[[0]]], [[[20]]]),
        s.get_into_ranges([dst], [["r1"]], [[[0]]], [[[0]]], [[[0]]]),
        s.get_into_ranges([], [], [], [], []),
    ]

    # put and get sessions
    out["put_session_start"] = [s.batch_put_session_start(["S1", "S2", "r1"], [100, 50, 10]), s.is_exist("S1")]
    out["put_session_ranges"] = [
        s.batch_put_from_multi_buffer_ranges(["S1", "S2"], [[p, p + 500]], [[60, 40]], [[0, 60]]),
        s.batch_put_from_multi_buffer_ranges(["S1", "S2"], [[p, p + 500], [p]], [[60, 40], [60]], [[0, 60], [0]]),
        s.batch_put_from_multi_buffer_ranges(["nosession"], [[p]], [[6]], [[0]]),
    ]
    out["put_session_end"] = [
        s.batch_put_session_end(["S1", "S2", "nosession"]),
        s.get("S1") == bytes(buf[0:60]) + bytes(buf[500:540]),
        s.get_size("S2"),
        s.batch_put_session_end(["S1"]),
    ]
    out["put_session_refusals"] = [s.batch_put_session_start(["S1"], [100]), s.batch_put_session_start(["S0"], [0])]
    out["put_session_revoke"] = [
        s.batch_put_session_start(["S3"], [10]), s.batch_put_session_revoke(["S3"]),
        s.is_exist("S3"), s.batch_put_session_revoke(["S3"]),
    ]  # fmt: skip
    out["get_session"] = [
        s.batch_get_session_start(["S1", "missing"]),
        s.batch_get_into_multi_buffer_ranges(["S1", "missing"], [[p + 4 * MIB, p + 4 * MIB + 100], [p]],
                                             [[10, 20], [5]], [[0, 50], [0]]),  # fmt: skip
        bytes(buf[4 * MIB : 4 * MIB + 10]) == bytes(buf[0:10])
        and bytes(buf[4 * MIB + 100 : 4 * MIB + 120]) == bytes(buf[50:60]) + bytes(buf[500:510]),
        s.batch_get_session_end(["S1", "missing"]),
        s.batch_get_into_multi_buffer_ranges(["S1"], [[p + 4 * MIB]], [[10]], [[0]]),
    ]

    # what needs another build, a task manager or a standalone client
    out["tasks"] = [s.create_copy_task("pb1", ["127.0.0.1:1"]), s.create_move_task("pb1", s.get_hostname(), "127.0.0.1:1"),
                    s.query_task((0, 0))]  # fmt: skip
    out["segments"] = [
        s.mount_segment("/nonexistent/segment", MIB), s.unmount_segment(["none"]),
        s.unmount_and_free_segment(["none"]), s.unmount_local_disk_segment(),
        s.get_offload_rpc_read_count(), s.alloc_from_mem_pool(4096), s.init_all("tcp", "", MIB),
    ]  # fmt: skip
    out["allocate_and_mount_segment"] = s.allocate_and_mount_segment(MIB)["ret"]
    out["setup_dummy_nobody"] = Store().setup_dummy(MIB, MIB, f"127.0.0.1:{free_port()}")
    nof = mod.MooncakeDistributedNoFRegister()
    out["nof_register"] = [nof.real_register("a", 1, "b", 2, 3, 4, "c"), nof.real_unregister_by_endpoint("a", 1, "b", 2, "c")]
    tensor_args = {"key": "pb1", "keys": ["pb1"], "base_keys": ["pb1"], "tensor": np.zeros(4, np.float32),
                   "tensors_list": [np.zeros(4, np.float32)], "buffer_ptr": p, "size": 4096,
                   "buffer_ptrs": [p], "sizes": [4096]}  # fmt: skip
    import re

    tensors = {}
    for name in sorted(n for n in dir(Store) if "tensor" in n and "safetensor" not in n and not n.startswith("_")):
        doc = getattr(mod.MooncakeDistributedStore, name).__doc__ or ""
        if "(self" in doc:  # Mooncake's: parameter names from its docstring
            params = re.findall(r"(\w+):", doc.split("(self", 1)[1].split(") ->")[0])
        else:
            params = list(inspect.signature(getattr(Store, name)).parameters)[1:]
        args = [tensor_args[q] for q in params if q in tensor_args]
        tensors[name] = _catch(lambda: getattr(s, name)(*args))
    out["tensor_calls"] = tensors
    out["safetensor"] = [s.save_tensor_to_safetensor("pb1", "/nonexistent/x.safetensors"),
                         s.load_tensor_from_safetensor(None, "/nonexistent/x.safetensors")]  # fmt: skip

    # module-level helpers and classes
    a = mod.MooncakeHostMemAllocator()
    addr = a.alloc(4096)
    out["host_allocator"] = [addr != 0, a.free(addr), a.free(12345)]
    out["alloc_func_addrs"] = [mod.get_alloc_func_addr() != 0, mod.get_free_func_addr() != 0]
    out["bind_to_numa_node_missing"] = mod.bind_to_numa_node(4095)
    c = Config()
    out["soft_pin_ttl_ms"] = [c.soft_pin_ttl_ms, _catch(lambda: setattr(c, "soft_pin_ttl_ms", -1)),
                              _catch(lambda: setattr(c, "soft_pin_ttl_ms", 5)), c.soft_pin_ttl_ms]  # fmt: skip
    out["pool_uninitialised"] = _catch(lambda: mod.BufferPool(Store()))
    pool = mod.BufferPool(s, max_bytes=64 * MIB)
    lease = pool.acquire(1000)
    lease.buffer[:4] = b"pool"
    out["pool_lease"] = [type(lease).__name__, lease.size, len(lease.buffer), s.put_from("lp", lease.ptr, 1000),
                         s.get("lp")[:4].decode(), type(pool.buffer(100)).__name__]  # fmt: skip
    lease.release()
    out["pool_release"] = [_catch(lambda: lease.ptr), lease.release()]
    with pool.acquire(10) as held:
        out["pool_with"] = held.size
    out["pool_errors"] = [_catch(lambda: pool.acquire(100 * MIB, False)), pool.prewarm(4096, 2), pool.close(),
                          _catch(lambda: pool.acquire(10))]  # fmt: skip
    # Mooncake's accounting: at least the local buffer (16 MiB here) is lent at a time.
    pool = mod.BufferPool(s, max_bytes=4 * MIB, min_size_class=MIB)
    first, second = pool.acquire(8 * MIB), pool.acquire(8 * MIB)
    out["pool_exhaustion"] = [
        _catch(lambda: pool.acquire(MIB, False)), _catch(lambda: pool.acquire(MIB, True, 0.2)),
        _catch(lambda: pool.acquire(MIB, True, -1)), _catch(lambda: pool.acquire(17 * MIB)),
        _catch(lambda: pool.acquire(-1)),
    ]  # fmt: skip
    threading.Timer(0.2, first.release).start()
    out["pool_waits_for_release"] = [pool.acquire(4 * MIB, True, 10).size, second.size]
    second.release()
    out["pool_zero"] = pool.acquire(0).size
    pool.close()
    out["descriptor_defaults"] = [
        [getattr(mod.Descriptor(), f) for f in ("buffer_address", "size", "transport_endpoint")],
        [getattr(mod.ParallelAxis(), f) for f in ("kind", "rank", "size", "split_dim", "expert_id", "stage_id")],
        mod.TensorParallelism().axes,
        [mod.ReadTarget().mode, mod.ReadTarget().parallelism],
        [mod.EngramStoreConfig().embedding_dim, mod.EngramStoreConfig().table_vocab_sizes],
        [int(mod.QueryTaskResponse().type), int(mod.QueryTaskResponse().status), mod.QueryTaskResponse().message],
    ]
    out["surface_close"] = s.close()


def run(impl: str, phase: str) -> None:
    Store, Config, master, cleanup = start(impl)
    out: dict = {}
    try:
        if phase == "basic":
            basic(Store, Config, master, out)
        elif phase == "surface":
            surface(Store, Config, master, out)
        else:
            s = Store()
            out["cap_setup"] = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master)
            capacity(s, Config, out)
    finally:
        cleanup()
    print(json.dumps(out))


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "basic")
