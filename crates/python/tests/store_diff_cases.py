"""The calls of the store's differential test, run against one implementation per
process: ``python store_diff_cases.py mooncake|pagewire [basic|capacity]``. Prints one JSON object: case
name -> what callers branch on (return codes, and whether the bytes read are right).

``mooncake`` starts the wheel's ``mooncake_master`` on a free 127.0.0.1 port and uses
``mooncake.store.MooncakeDistributedStore``; ``pagewire`` starts a pagewire master in this
process and uses ``pagewire.mooncake_compat.MooncakeDistributedStore``. Both clients
contribute a 16 MiB segment and talk TCP.
"""

import json
import socket
import subprocess
import sys
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


def run(impl: str, phase: str) -> None:
    Store, Config, master, cleanup = start(impl)
    out: dict = {}
    try:
        if phase == "basic":
            basic(Store, Config, master, out)
        else:
            s = Store()
            out["cap_setup"] = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MIB, 16 * MIB, "tcp", "", master)
            capacity(s, Config, out)
    finally:
        cleanup()
    print(json.dumps(out))


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "basic")
