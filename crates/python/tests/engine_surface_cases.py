"""The cases of test_mooncake_engine_diff.py: the parts of ``mooncake.engine`` beyond the
transfer calls (managed buffers and byte helpers, ``RpcInterface``, ``SharedSegment``,
``TransferOpcode``), run against one implementation per process.

``python engine_surface_cases.py IMPL`` (``mooncake``: the real wheel; ``pagewire``:
pagewire.mooncake_compat) prints one JSON object ``{case: result}`` as its last stdout
line. The RPC cases talk to a server in a second process of the same implementation
(``--rpc-server``), which prints one JSON line per callback; the shared-segment case maps
the owner's segment in a second process (``--shm-peer``). Only 127.0.0.1 is used.
"""

import ctypes
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 1 << 20


def load(impl):
    if impl == "mooncake":
        import mooncake.engine as m
    else:
        import pagewire.mooncake_compat as m
    return m


def rc_of(fn):
    """The return value, or the exception's class name."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the class is the result
        return type(e).__name__


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(b):
    return {"len": len(b), "sha": hashlib.sha256(bytes(b)).hexdigest()[:16]}


class Tensor:
    """A host tensor as Mooncake's send_tensor duck-types it (no torch needed)."""

    def __init__(self, raw, shape, dtype):
        self.raw, self.shape, self.dtype = raw, shape, dtype

    def data_ptr(self):
        return ctypes.addressof(self.raw)

    def numel(self):
        return len(self.raw) // 4

    def element_size(self):
        return 4


# ------------------------------------------------------------------ managed buffers


def managed_cases(m):
    out = {}
    te = m.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    sid = f"127.0.0.1:{te.get_rpc_port()}"
    a, b, c, d = (te.allocate_managed_buffer(n) for n in (100, 8192, 8193, 0))
    base = te.get_first_buffer_address(sid)
    out["managed_offsets"] = {
        "nonzero": all(x != 0 for x in (a, b, c, d, base)),
        "offsets": [x - base for x in (a, b, c, d)],
    }
    w = [
        te.write_bytes_to_buffer(a, "hello", 5),
        te.write_bytes_to_buffer(a + 8, b"HEL\x00LO", 6),
        te.write_bytes_to_buffer(a + 16, bytearray(b"xy"), 2),
        te.write_bytes_to_buffer(a + 24, "\u00e9", 2),
        te.write_bytes_to_buffer(a + 32, "abc", 2),
    ]
    out["write_read_bytes"] = {"rc": w, "bytes": te.read_bytes_from_buffer(a, 40).hex()}
    out["read_zero_length"] = {"rc": rc_of(lambda: te.read_bytes_from_buffer(a, 0))}
    out["write_bytes_none"] = {"rc": rc_of(lambda: te.write_bytes_to_buffer(a, None, 0))}
    out["write_bytes_bad_type"] = {"rc": rc_of(lambda: te.write_bytes_to_buffer(a, 5, 1))}
    out["allocate_negative"] = {"rc": rc_of(lambda: te.allocate_managed_buffer(-1))}
    out["managed_free_and_reuse"] = {
        "rc": [te.free_managed_buffer(a, 100), te.free_managed_buffer(b, 8192)],
        "reuses_last_freed": te.allocate_managed_buffer(50) == b,
    }
    big = te.allocate_managed_buffer(300 * MB)
    out["managed_large"] = {"nonzero": big != 0, "free": te.free_managed_buffer(big, 300 * MB)}
    # A managed buffer is registered: a peer engine writes into it.
    peer = m.TransferEngine()
    assert peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = ctypes.create_string_buffer(b"\x5a" * 4096, 4096)
    assert peer.register_memory(ctypes.addressof(src), 4096) == 0
    rc = peer.transfer_sync_write(sid, ctypes.addressof(src), c, 4096)
    out["managed_is_registered"] = {"rc": rc, "bytes": digest(te.read_bytes_from_buffer(c, 4096))}
    # Where Mooncake trusts the caller (run last: Mooncake's allocator keeps the bogus
    # address on its free list).
    stray = ctypes.create_string_buffer(64)
    out["write_bytes_unregistered"] = {
        "rc": rc_of(lambda: te.write_bytes_to_buffer(ctypes.addressof(stray), "abc", 3)),
        "written": stray.raw[:3] == b"abc",
    }
    out["read_bytes_unregistered"] = {
        "rc": rc_of(lambda: type(te.read_bytes_from_buffer(ctypes.addressof(stray), 3)).__name__)
    }
    out["free_unknown_address"] = {"rc": te.free_managed_buffer(ctypes.addressof(stray), 100)}
    return out


def free_wrong_length(m):
    """A block freed as a large buffer: Mooncake frees a pointer malloc never returned
    (its process aborts); run alone (``--one``)."""
    te = m.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    d = te.allocate_managed_buffer(0)
    return te.free_managed_buffer(d, 300 * MB)


#: Calls that crash Mooncake's process: each runs in its own (``--one NAME``).
ISOLATED = {"free_wrong_length": free_wrong_length}


# ------------------------------------------------------------------ TransferOpcode


def opcode_cases(m):
    T = m.TransferOpcode
    R, W = T.Read, T.Write
    return {
        "opcode_basics": {
            "rc": [R.name, R.value, W.name, W.value, int(W), repr(R), str(W), hash(R),
                   list(T.__members__), m.TransferEngine.TransferOpcode is T, m.Read == R],
        },
        "opcode_equality": {
            "rc": [R == 0, R == T.Read, R == W, R != 1, T(0) == R, T(1) is W, R < W,
                   {R: 1}.get(T(0)), T(0).name],
        },
        "opcode_errors": {
            "rc": [rc_of(lambda: T("Read")), rc_of(lambda: R + 1), rc_of(lambda: list(T)),
                   repr(T(5))],
        },
    }


# ------------------------------------------------------------------ RpcInterface


def rpc_server(impl, port):
    """The receiving process: prints one JSON line per callback, until stdin closes."""
    m = load(impl)
    s = m.RpcInterface()
    assert s.initialize_server(f"127.0.0.1:{port}", 2, 5)

    def on_data(d):
        if d["data"] == b"raise":
            raise ValueError("the callback raised")
        line = {"cb": "data", "type": type(d).__name__, "keys": sorted(d),
                "source": d["source"], "data": digest(d["data"])}
        print(json.dumps(line), flush=True)

    def on_tensor(t):
        line = {"cb": "tensor", "type": type(t).__name__, "source": t.source_address,
                "dtype": t.dtype, "total_bytes": t.total_bytes, "size": t.get_data_size(),
                "bytes": digest(t.get_data_as_bytes()),
                "view": digest(t.get_memory_view()),
                "shape": rc_of(lambda: list(t.shape))}
        print(json.dumps(line), flush=True)

    s.set_data_receive_callback(on_data)
    s.set_tensor_receive_callback(on_tensor)
    print(json.dumps({"started": s.start_server_async(), "again": s.start_server_async()}),
          flush=True)
    sys.stdin.read()
    s.stop_server()


def rpc_cases(impl, m):
    out = {}
    port = free_port()
    srv = subprocess.Popen([sys.executable, __file__, impl, "--rpc-server", str(port)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE)
    first = json.loads(srv.stdout.readline())
    out["rpc_server_start_twice"] = {"rc": [first["started"], first["again"]]}
    target = f"127.0.0.1:{port}"
    c = m.create_rpc_client()
    tensor_head = struct.pack("<II4q", 2, 2, 3, 4, 0, 0) + bytes(32)
    floats = ctypes.create_string_buffer(struct.pack("<6f", 1.5, 2, 3, 4, 5, 6), 24)
    sends = [
        ("rpc_send_small", lambda: c.send_data(target, b"hello\x00world")),
        ("rpc_send_empty", lambda: c.send_data(target, b"")),
        ("rpc_send_tensor_header", lambda: c.send_data(target, tensor_head + b"abcd")),
        ("rpc_callback_raises", lambda: c.send_data(target, b"raise")),
        ("rpc_send_tensor_duck", lambda: c.send_tensor(target, Tensor(floats, (2, 3), "f32"))),
        # Last: Mooncake's server hands a later small message the previous large one's
        # attachment (seen with this wheel), so nothing follows it on this connection.
        ("rpc_send_2mib", lambda: c.send_data(target, bytes(range(256)) * (8 * 1024))),
    ]
    for name, fn in sends:
        out[name] = {"rc": rc_of(fn)}
    # The server prints its callbacks in order; "raise" prints none.
    for name in ("rpc_send_small", "rpc_send_empty", "rpc_send_tensor_header",
                 "rpc_send_tensor_duck", "rpc_send_2mib"):
        out[name]["received"] = json.loads(srv.stdout.readline())
    out["rpc_send_str"] = {"rc": rc_of(lambda: c.send_data(target, "text"))}
    out["rpc_send_bytearray"] = {"rc": rc_of(lambda: c.send_data(target, bytearray(b"x")))}
    out["rpc_send_tensor_not_a_tensor"] = {"rc": rc_of(lambda: c.send_tensor(target, b"x"))}
    out["rpc_send_tensor_async_not_a_tensor"] = {
        "rc": rc_of(lambda: c.send_tensor_async(target, b"x", None))
    }
    out["rpc_send_no_listener"] = {"rc": c.send_data(f"127.0.0.1:{free_port()}", b"x")}
    out["rpc_send_bad_address"] = {"rc": c.send_data("nonsense", b"x")}
    import asyncio

    async def send_async():
        return await asyncio.wait_for(
            c.send_data_async(target, b"async", asyncio.get_running_loop()), 10)

    out["rpc_send_data_async"] = {"rc": rc_of(lambda: asyncio.run(send_async()))}
    if out["rpc_send_data_async"]["rc"] == 0:
        out["rpc_send_data_async"]["received"] = json.loads(srv.stdout.readline())
    srv.stdin.close()
    srv.wait(timeout=20)

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    in_use = m.RpcInterface()
    in_use.initialize_server(f"127.0.0.1:{blocker.getsockname()[1]}")
    garbage = m.RpcInterface()
    out["rpc_start_errors"] = {
        "rc": [rc_of(in_use.start_server_async), garbage.initialize_server("garbage"),
               rc_of(garbage.start_server_async), m.RpcInterface().start_server(),
               m.RpcInterface().start_server_async(), m.RpcInterface().initialize(),
               rc_of(lambda: m.RpcInterface().initialize_client(-1))],
    }
    blocker.close()
    out["rpc_types"] = {
        "rc": [m.CoroRPCInterface is m.RpcInterface, type(m.create_rpc_server()).__name__,
               type(c).__name__, rc_of(m.ReceivedData), rc_of(m.ReceivedTensor)],
    }
    return out


# ------------------------------------------------------------------ SharedSegment


def shm_peer(impl, owner_blob_hex):
    m = load(impl)
    seg, blob = m.SharedSegment.create("kv|a", 8192, 2, 1)
    seg.complete([bytes.fromhex(owner_blob_hex), blob])
    seen = ctypes.string_at(seg.base_addr(), 11)
    ctypes.memmove(seg.base_addr() + 100, b"peer", 4)
    print(json.dumps({"ready": seg.ready(), "seen": seen.decode(), "size": seg.size()}))


def shm_cases(impl, m):
    S = m.SharedSegment
    out = {"shm_supported": {"rc": [S.supported(), S.supported(True, True),
                                    S.supported(False), S.supported(mmap=False)]}}
    owner, blob = S.create("kv|a", 8192, 2, 0)
    local, lblob = S.create("kv|a", 8192, 2, 1)
    out["shm_before_complete"] = {
        "rc": [owner.ready(), owner.base_addr() != 0, owner.size(), owner.device_addr(),
               local.ready(), local.size()],
    }
    out["shm_peer_base_before_complete"] = {"rc": local.base_addr() != 0}
    ctypes.memmove(owner.base_addr(), b"owner-wrote", 11)
    child = subprocess.run([sys.executable, __file__, impl, "--shm-peer", blob.hex()],
                           capture_output=True, text=True, timeout=60, cwd=HERE)
    owner.complete([blob, lblob])
    out["shm_two_processes"] = {
        "peer": json.loads(child.stdout.strip().splitlines()[-1]),
        "owner_sees": ctypes.string_at(owner.base_addr() + 100, 4).decode(),
        "owner_ready": owner.ready(),
    }

    def err(fn):
        try:
            fn()
            return "ok"
        except RuntimeError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__

    other, oblob = S.create("kv|b", 8192, 2, 1)
    out["shm_errors"] = {
        "rc": [
            err(lambda: S.create("z", 0, 1, 0)),
            err(lambda: S.create("z", 4096, 0, 0)),
            err(lambda: S.create("z", 4096, 1, 1)),
            err(lambda: S.create("z", 4096, 2, 0, 2)),
            err(lambda: S.create("z", 4096, 1, 0, host_register=True)),
            err(lambda: S.create("z", 4096, 1, 0, mmap=False)),
            err(lambda: local.complete([blob])),
            err(lambda: local.complete([b"xx", lblob])),
            err(lambda: other.complete([blob, oblob])),
            err(lambda: owner.complete([blob, lblob])),
            err(lambda: S()),
        ],
    }
    one, oneblob = S.create("z", 5000, 1, 0)
    one.complete([oneblob])
    out["shm_odd_size"] = {"rc": [one.size(), one.ready()]}
    return out


def run_all(impl):
    m = load(impl)
    out = {}
    out.update(managed_cases(m))
    out.update(opcode_cases(m))
    out.update(rpc_cases(impl, m))
    out.update(shm_cases(impl, m))
    print(json.dumps(out, default=repr))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[2] == "--rpc-server":
        rpc_server(sys.argv[1], int(sys.argv[3]))
    elif len(sys.argv) > 3 and sys.argv[2] == "--one":
        print(json.dumps({"rc": rc_of(lambda: ISOLATED[sys.argv[3]](load(sys.argv[1])))}))
    elif len(sys.argv) > 3 and sys.argv[2] == "--shm-peer":
        shm_peer(sys.argv[1], sys.argv[3])
    else:
        run_all(sys.argv[1])
