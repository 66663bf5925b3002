"""The cases of the differential test, run against one implementation per process.

``python diff_cases.py IMPL`` (``IMPL``: ``mooncake`` for the real wheel, ``pagewire`` for
pagewire.mooncake_compat) runs every case of :data:`CASES` over TCP on 127.0.0.1 with
the same calls and prints one JSON object ``{case: result}`` as its last stdout line. A
result is ``{"rc": <return value or exception class name>, ...}`` plus what the case
observed on the receiving side (``"written"``: whether any byte of the target changed).

``python diff_cases.py IMPL --one NAME`` runs one of :data:`ISOLATED` (calls that crash
Mooncake's process) and prints ``{"rc": ...}``; the caller reads the exit status.

The expectations live in test_mooncake_diff.py; this file only performs the calls.
"""

import ctypes
import json
import os
import socket
import sys
import threading
import time

MB = 1 << 20


def load(impl):
    if impl == "mooncake":
        import mooncake.engine as m
    else:
        import pagewire.mooncake_compat as m
    return m


# Every buffer lives to the end of the run: the engines are shared by all cases, and a
# freed buffer that stays registered would make a later allocation at the same address
# overlap it.
KEEP = []


class Buf:
    def __init__(self, n, fill=0):
        self.n = n
        self.raw = ctypes.create_string_buffer(bytes([fill]) * n, n)
        self.addr = ctypes.addressof(self.raw)
        KEEP.append(self)

    def bytes(self):
        return ctypes.string_at(self.addr, self.n)


def rc_of(fn):
    """The return value, or the exception's class name (TypeError...)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the class is the result
        return type(e).__name__


class World:
    """Two initialized engines (a: initiator, b: target) of one implementation."""

    def __init__(self, m):
        self.m = m
        self.a, self.b = m.TransferEngine(), m.TransferEngine()
        assert self.a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert self.b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.sid = f"127.0.0.1:{self.b.get_rpc_port()}"

    def bufs(self, n=MB):
        """A registered source (bytes 0x5a) on a and a registered target (zeros) on b."""
        src, dst = Buf(n, 0x5A), Buf(n)
        assert self.a.register_memory(src.addr, n) == 0
        assert self.b.register_memory(dst.addr, n) == 0
        return src, dst

    def settle(self):
        # Mooncake may keep writing after a failed call returned (its async tasks); give
        # a slice of time before looking at the target.
        time.sleep(0.2)


def serve(behaviour):
    """A TCP server that accepts and closes, or answers garbage."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def run():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            if behaviour == "garbage":
                try:
                    c.sendall(b"\xff" * 64 + b"garbage" * 100)
                except OSError:
                    pass
            c.close()

    threading.Thread(target=run, daemon=True).start()
    return srv


CASES = {}
FRESH = set()


def case(fn=None, *, fresh=False):
    """Registers a case; `fresh=True` gives it its own engines (it depends on what the
    engines hold, or changes them)."""

    def add(f):
        CASES[f.__name__] = f
        if fresh:
            FRESH.add(f.__name__)
        return f

    return add(fn) if fn is not None else add


# ------------------------------------------------------------------ registration


@case
def register_ok(w):
    b = Buf(64 << 10)
    return {"rc": w.a.register_memory(b.addr, b.n)}


@case
def register_same_twice(w):
    b = Buf(64 << 10)
    w.a.register_memory(b.addr, b.n)
    return {"rc": w.a.register_memory(b.addr, b.n)}


@case
def register_inner_overlap(w):
    b = Buf(64 << 10)
    w.a.register_memory(b.addr, b.n)
    return {"rc": w.a.register_memory(b.addr + 4096, 4096)}


@case
def register_zero_length(w):
    b = Buf(4096)
    return {"rc": w.a.register_memory(b.addr, 0)}


@case
def unregister_ok(w):
    b = Buf(4096)
    w.a.register_memory(b.addr, b.n)
    return {"rc": w.a.unregister_memory(b.addr)}


@case
def unregister_unknown(w):
    b = Buf(4096)
    return {"rc": w.a.unregister_memory(b.addr)}


@case
def batch_register_ok(w):
    p, q = Buf(8192), Buf(8192)
    rc = w.a.batch_register_memory([p.addr, q.addr], [p.n, q.n])
    return {"rc": rc, "unregister": w.a.batch_unregister_memory([p.addr, q.addr])}


@case
def batch_register_overlap_inside(w):
    p = Buf(8192)
    return {"rc": w.a.batch_register_memory([p.addr, p.addr + 4096], [8192, 4096])}


@case
def batch_register_zero_length(w):
    p, q = Buf(8192), Buf(8192)
    return {"rc": w.a.batch_register_memory([p.addr, q.addr], [8192, 0])}


# ------------------------------------------------------------------ transfers


@case
def sync_write_ok(w):
    src, dst = w.bufs()
    rc = w.a.transfer_sync_write(w.sid, src.addr, dst.addr, 4096)
    return {"rc": rc, "written": dst.bytes()[:4096] == src.bytes()[:4096]}


@case
def sync_read_ok(w):
    src, dst = w.bufs()
    ctypes.memset(dst.addr, 0x33, 4096)
    rc = w.a.transfer_sync_read(w.sid, src.addr, dst.addr, 4096)
    return {"rc": rc, "read": src.bytes()[:4096] == b"\x33" * 4096}


@case
def batch_write_32_pages(w):
    src, dst = w.bufs(2 * MB)
    page = 64 << 10
    rc = w.a.batch_transfer_sync_write(
        w.sid, [src.addr + i * page for i in range(32)], [dst.addr + i * page for i in range(32)], [page] * 32
    )
    return {"rc": rc, "written": dst.bytes() == src.bytes()}


@case
def batch_tuples(w):
    src, dst = w.bufs()
    rc = w.a.batch_transfer_sync_write(w.sid, (src.addr,), (dst.addr,), (4096,))
    return {"rc": rc}


@case
def batch_empty(w):
    w.bufs()
    return {"rc": w.a.batch_transfer_sync_write(w.sid, [], [], [])}


@case
def batch_unequal_lists(w):
    src, dst = w.bufs()
    rc = w.a.batch_transfer_sync_write(w.sid, [src.addr, src.addr], [dst.addr], [16, 16])
    w.settle()
    return {"rc": rc, "written": dst.bytes() != bytes(dst.n)}


@case
def sync_write_zero_length(w):
    src, dst = w.bufs()
    return {"rc": w.a.transfer_sync_write(w.sid, src.addr, dst.addr, 0)}


@case
def remote_outside_every_buffer(w):
    src, dst = w.bufs()
    rc = w.a.transfer_sync_write(w.sid, src.addr, dst.addr + 64 * MB, 4096)
    w.settle()
    return {"rc": rc, "written": dst.bytes() != bytes(dst.n)}


@case
def remote_straddles_end(w):
    src, dst = w.bufs()
    rc = w.a.transfer_sync_write(w.sid, src.addr, dst.addr + dst.n - 100, 4096)
    w.settle()
    return {"rc": rc, "written": dst.bytes() != bytes(dst.n)}


@case
def batch_one_good_one_bad(w):
    src, dst = w.bufs()
    rc = w.a.batch_transfer_sync_write(
        w.sid, [src.addr, src.addr + 4096], [dst.addr, dst.addr + dst.n - 10], [4096, 4096]
    )
    w.settle()
    return {"rc": rc, "written": dst.bytes() != bytes(dst.n)}


@case
def local_source_not_registered(w):
    _, dst = w.bufs()
    loose = Buf(4096, 0x77)
    rc = w.a.transfer_sync_write(w.sid, loose.addr, dst.addr, 4096)
    w.settle()
    return {"rc": rc, "written": dst.bytes() != bytes(dst.n)}


@case
def local_source_straddles_end(w):
    src, dst = w.bufs()
    rc = w.a.transfer_sync_write(w.sid, src.addr + src.n - 100, dst.addr, 4096)
    w.settle()
    return {"rc": rc, "written": dst.bytes() != bytes(dst.n)}


@case
def sid_nothing_listening(w):
    src, _ = w.bufs()
    return {"rc": w.a.transfer_sync_write("127.0.0.1:1", src.addr, 0x1000, 16)}


@case
def sid_unresolvable_host(w):
    src, _ = w.bufs()
    return {"rc": w.a.transfer_sync_write("no-such-host.invalid:15000", src.addr, 0x1000, 16)}


@case
def sid_without_port(w):
    src, _ = w.bufs()
    return {"rc": w.a.transfer_sync_write("127.0.0.1", src.addr, 0x1000, 16)}


@case
def peer_accepts_and_closes(w):
    src, _ = w.bufs()
    srv = serve("close")
    try:
        return {"rc": w.a.transfer_sync_write(f"127.0.0.1:{srv.getsockname()[1]}", src.addr, 0x1000, 16)}
    finally:
        srv.close()


@case
def peer_sends_garbage(w):
    src, _ = w.bufs()
    srv = serve("garbage")
    try:
        return {"rc": w.a.transfer_sync_write(f"127.0.0.1:{srv.getsockname()[1]}", src.addr, 0x1000, 16)}
    finally:
        srv.close()


@case
def submit_write_no_listener(w):
    src, _ = w.bufs()
    return {"rc": w.a.transfer_submit_write("127.0.0.1:1", src.addr, 0x1000, 16)}


@case
def async_write_ok(w):
    src, dst = w.bufs()
    bid = w.a.batch_transfer_async_write(w.sid, [src.addr], [dst.addr], [4096])
    st = 0
    deadline = time.time() + 10
    while bid and st == 0 and time.time() < deadline:
        st = w.a.transfer_check_status(bid)
    return {"rc": bid != 0, "status": st, "written": dst.bytes()[:4096] == src.bytes()[:4096]}


@case
def async_wait_all_ok(w):
    src, dst = w.bufs()
    ids = [w.a.batch_transfer_async_write(w.sid, [src.addr + i * 4096], [dst.addr + i * 4096], [4096]) for i in range(4)]
    return {"rc": w.a.get_batch_transfer_status(ids), "nonzero_ids": all(ids)}


@case
def async_bad_remote(w):
    src, dst = w.bufs()
    bid = w.a.batch_transfer_async_write(w.sid, [src.addr], [dst.addr + 64 * MB], [4096])
    st = None
    if bid:
        deadline = time.time() + 10
        st = 0
        while st == 0 and time.time() < deadline:
            st = w.a.transfer_check_status(bid)
    return {"rc": bid != 0, "status": st}


@case
def async_bad_remote_wait_all(w):
    src, dst = w.bufs()
    bid = w.a.batch_transfer_async_write(w.sid, [src.addr], [dst.addr + 64 * MB], [4096])
    return {"rc": bid != 0, "status": w.a.get_batch_transfer_status([bid]) if bid else None}


@case
def type_negative_address(w):
    src, dst = w.bufs()
    return {"rc": rc_of(lambda: w.a.transfer_sync_write(w.sid, -1, dst.addr, 16))}


@case
def type_none_address(w):
    src, dst = w.bufs()
    return {"rc": rc_of(lambda: w.a.transfer_sync_write(w.sid, None, dst.addr, 16))}


@case
def type_float_length(w):
    src, dst = w.bufs()
    return {"rc": rc_of(lambda: w.a.transfer_sync_write(w.sid, src.addr, dst.addr, 16.0))}


@case
def type_length_2_64(w):
    src, dst = w.bufs()
    return {"rc": rc_of(lambda: w.a.transfer_sync_write(w.sid, src.addr, dst.addr, 1 << 64))}


@case
def type_negative_in_list(w):
    src, dst = w.bufs()
    return {"rc": rc_of(lambda: w.a.batch_transfer_sync_write(w.sid, [src.addr], [dst.addr], [-1]))}


@case
def initialize_twice(w):
    te = w.m.TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    return {"rc": te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")}


@case(fresh=True)
def initialize_twice_then_write(w):
    src, dst = w.bufs()
    first = w.a.transfer_sync_write(w.sid, src.addr, dst.addr, 4096)
    again = w.a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    ctypes.memset(src.addr, 0x66, 4096)
    rc = w.a.transfer_sync_write(w.sid, src.addr, dst.addr, 4096)
    return {"first": first, "again": again, "rc": rc, "written": dst.bytes()[:4096] == b"\x66" * 4096}


@case
def initialize_unknown_protocol(w):
    te = w.m.TransferEngine()
    return {"rc": te.initialize("127.0.0.1", "P2PHANDSHAKE", "nosuch", "")}


@case
def initialize_rdma_without_hca(w):
    te = w.m.TransferEngine()
    return {"rc": te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")}


@case
def initialize_http_metadata_unreachable(w):
    te = w.m.TransferEngine()
    return {"rc": te.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "")}


@case
def rpc_port_in_range(w):
    return {"rc": 15000 <= w.a.get_rpc_port() <= 17000}


@case
def probe_live_peer(w):
    return {"rc": w.a.send_probe(w.sid)}


@case
def probe_no_listener(w):
    return {"rc": w.a.send_probe("127.0.0.1:1")}


@case(fresh=True)
def notify_delivered_once(w):
    src, dst = w.bufs()
    note = w.m.TransferNotify("prefill-0", "req-42 done")
    rc = w.a.transfer_sync(w.sid, src.addr, dst.addr, 4096, w.m.TransferOpcode.Write, note)
    got = []
    deadline = time.time() + 5
    while not got and time.time() < deadline:
        got = [(n.name, n.msg) for n in w.b.get_notifies()]
        time.sleep(0.01)
    time.sleep(0.2)
    again = [(n.name, n.msg) for n in w.b.get_notifies()]
    return {"rc": rc, "notifies": got, "again": again}


@case(fresh=True)
def first_buffer_address(w):
    _, dst = w.bufs()
    return {"rc": w.a.get_first_buffer_address(w.sid) == dst.addr}


def run_all(impl):
    m = load(impl)
    out = {}
    # One pair of engines for every case (each case uses fresh buffers): Mooncake takes
    # about a second per engine to start and to stop.
    world = World(m)
    for name, fn in CASES.items():
        w = World(m) if name in FRESH else world
        t = time.time()
        try:
            r = fn(w)
        except Exception as e:  # noqa: BLE001
            r = {"rc": f"raised {type(e).__name__}: {e}"}
        r["seconds"] = round(time.time() - t, 3)
        out[name] = r
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip engine destructors: Mooncake's can stall at exit


# Calls that crash Mooncake's process; each runs alone and reports through the exit status.
ISOLATED = {
    "get_rpc_port_before_initialize": lambda m: m.TransferEngine().get_rpc_port(),
    "register_before_initialize": lambda m: m.TransferEngine().register_memory(Buf(4096).addr, 4096),
    "initialize_unknown_scheme": lambda m: m.TransferEngine().initialize("127.0.0.1", "bogus://x", "tcp", ""),
}


def run_one(impl, name):
    m = load(impl)
    rc = ISOLATED[name](m)
    print(json.dumps({"rc": rc}), flush=True)
    os._exit(0)


def run_stopped(impl):
    """A peer process of the same implementation is SIGSTOPped, then killed: how long a
    sync write and a probe take to give up. The probe runs on a thread that is abandoned
    after 7 s (Mooncake's blocks for about 60 s)."""
    import signal

    from peer_proc import PeerProcess, stop_process

    m = load(impl)
    a = m.TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = Buf(MB, 0x11)
    assert a.register_memory(src.addr, src.n) == 0
    out = {}
    peer = PeerProcess(impl, "tcp", MB)
    out["warm_write"] = a.transfer_sync_write(peer.sid, src.addr, peer.addr, 4096)
    stop_process(peer.proc.pid)
    t = time.time()
    out["stopped_write"] = a.transfer_sync_write(peer.sid, src.addr, peer.addr, MB)
    out["stopped_write_s"] = round(time.time() - t, 2)
    res = {}
    t = time.time()
    th = threading.Thread(target=lambda: res.update(rc=a.send_probe(peer.sid)), daemon=True)
    th.start()
    th.join(7.0)
    out["stopped_probe"] = res.get("rc", "blocked")
    out["stopped_probe_s"] = round(time.time() - t, 2)
    os.kill(peer.proc.pid, signal.SIGCONT)
    peer.proc.kill()
    peer.proc.wait()
    th.join(5.0)  # the killed peer's sockets close: a blocked probe returns now
    if th.is_alive():
        out["killed_write"] = "skipped (probe thread still blocked)"
    else:
        t = time.time()
        out["killed_write"] = a.transfer_sync_write(peer.sid, src.addr, peer.addr, 4096)
        out["killed_write_s"] = round(time.time() - t, 2)
    print(json.dumps(out), flush=True)
    os._exit(0)


def signatures(impl):
    """Each public method's signature line: pybind11's docstring (Mooncake) or
    inspect's (pagewire), printed as JSON."""
    import inspect

    m = load(impl)
    out = {}
    for name in dir(m.TransferEngine):
        if name.startswith("_"):
            continue
        attr = getattr(m.TransferEngine, name)
        if not callable(attr) or isinstance(attr, type):
            continue
        if impl == "mooncake":
            out[name] = (attr.__doc__ or "").strip().splitlines()[0]
        else:
            out[name] = str(inspect.signature(attr))
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[2] == "--one":
        run_one(sys.argv[1], sys.argv[3])
    elif len(sys.argv) > 2 and sys.argv[2] == "--stopped":
        run_stopped(sys.argv[1])
    elif len(sys.argv) > 2 and sys.argv[2] == "--signatures":
        signatures(sys.argv[1])
    else:
        run_all(sys.argv[1])
