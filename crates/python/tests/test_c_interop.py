"""The C ABI (libtransfer_engine.so) and the Python compat engine talk to each other: an
engine created through Mooncake's C header and a pagewire.mooncake_compat.TransferEngine,
in one process over TCP on 127.0.0.1, write, read and notify in both directions, bytes
checked on the receiving side.

Both bindings are separate builds of the same engine (two copies of it in one process);
this checks that they agree on the wire (handshake, segment descriptions, notifications),
which the per-binding suites cannot. The library is the one cargo builds
(``cargo build -p pagewire-capi``): ``scripts/python-test.sh`` builds it and names it in
PAGEWIRE_CAPI_LIB, and then a missing library fails the test; a bare ``pytest`` run
without the variable skips when the library is not built."""

import ctypes
import os
import time
from pathlib import Path

import pytest

from pagewire.mooncake_compat import TransferEngine, TransferNotify, TransferOpcode
from peer_proc import Buf, pattern

ROOT = Path(__file__).resolve().parents[3]
OPCODE_READ, OPCODE_WRITE = 0, 1
STATUS_COMPLETED, STATUS_FAILED = 4, 6
INVALID_BATCH = (1 << 64) - 1


def find_lib():
    if os.environ.get("PAGEWIRE_CAPI_LIB"):
        return Path(os.environ["PAGEWIRE_CAPI_LIB"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for profile in ("debug", "release"):
        lib = target / profile / "libtransfer_engine.so"
        if lib.exists():
            return lib
    return None


class Request(ctypes.Structure):
    _fields_ = [
        ("opcode", ctypes.c_int),
        ("source", ctypes.c_void_p),
        ("target_id", ctypes.c_int32),
        ("target_offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
    ]


class Status(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("transferred_bytes", ctypes.c_uint64)]


class NotifyMsg(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("msg", ctypes.c_char_p)]


def load():
    path = find_lib()
    if os.environ.get("PAGEWIRE_CAPI_LIB"):
        assert path.exists(), f"PAGEWIRE_CAPI_LIB={path} does not exist"
    if path is None:
        pytest.skip("libtransfer_engine.so not built: run `cargo build -p pagewire-capi` first")
    lib = ctypes.CDLL(str(path))
    vp, u64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32
    sigs = {
        "createTransferEngine": (vp, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, u64, ctypes.c_int]),
        "getLocalIpAndPort": (ctypes.c_int, [vp, ctypes.c_char_p, ctypes.c_size_t]),
        "registerLocalMemory": (ctypes.c_int, [vp, vp, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int]),
        "openSegment": (i32, [vp, ctypes.c_char_p]),
        "allocateBatchID": (u64, [vp, ctypes.c_size_t]),
        "submitTransfer": (ctypes.c_int, [vp, u64, ctypes.POINTER(Request), ctypes.c_size_t]),
        "submitTransferWithNotify": (
            ctypes.c_int,
            [vp, u64, ctypes.POINTER(Request), ctypes.c_size_t, NotifyMsg],
        ),
        "getTransferStatus": (ctypes.c_int, [vp, u64, ctypes.c_size_t, ctypes.POINTER(Status)]),
        "freeBatchID": (ctypes.c_int, [vp, u64]),
        "getNotifsFromEngine": (ctypes.POINTER(NotifyMsg), [vp, ctypes.POINTER(ctypes.c_int)]),
        "freeNotifsMsgBuf": (ctypes.c_int, [ctypes.POINTER(NotifyMsg), ctypes.c_int]),
        "destroyTransferEngine": (None, [vp]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


@pytest.fixture
def engines(monkeypatch):
    """A C engine and a Python engine, each with a registered 1 MiB buffer."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    for v in ("MC_FORCE_TCP", "PAGEWIRE_TRANSPORT", "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        monkeypatch.delenv(v, raising=False)
    lib = load()
    c = lib.createTransferEngine(b"P2PHANDSHAKE", b"127.0.0.1", b"", 0, 1)
    assert c, "createTransferEngine failed"
    py = TransferEngine()
    assert py.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    cbuf, pybuf = Buf(1 << 20), Buf(1 << 20)
    assert lib.registerLocalMemory(c, cbuf.addr, cbuf.n, b"cpu:0", 1) == 0
    assert py.register_memory(pybuf.addr, pybuf.n) == 0
    name = ctypes.create_string_buffer(128)
    assert lib.getLocalIpAndPort(c, name, 128) == 0
    yield lib, c, py, cbuf, pybuf, name.value.decode()
    py.close()
    lib.destroyTransferEngine(c)


def c_batch(lib, c, reqs, notify=None, deadline_s=10):
    """Submits `reqs` in one batch from the C engine and waits for every task."""
    arr = (Request * len(reqs))(*reqs)
    bid = lib.allocateBatchID(c, len(reqs))
    assert bid != INVALID_BATCH
    if notify is None:
        assert lib.submitTransfer(c, bid, arr, len(reqs)) == 0
    else:
        msg = NotifyMsg(notify[0].encode(), notify[1].encode())
        assert lib.submitTransferWithNotify(c, bid, arr, len(reqs), msg) == 0
    st = Status()
    end = time.time() + deadline_s
    for t in range(len(reqs)):
        while True:
            assert lib.getTransferStatus(c, bid, t, ctypes.byref(st)) == 0
            if st.status in (STATUS_COMPLETED, STATUS_FAILED) or time.time() > end:
                break
            time.sleep(0.0005)
        assert st.status == STATUS_COMPLETED, f"task {t}: status {st.status}"
        assert st.transferred_bytes == reqs[t].length
    assert lib.freeBatchID(c, bid) == 0


def c_notifies(lib, c):
    n = ctypes.c_int(0)
    p = lib.getNotifsFromEngine(c, ctypes.byref(n))
    out = [(p[i].name.decode(), p[i].msg.decode()) for i in range(n.value)] if p else []
    if p:
        assert lib.freeNotifsMsgBuf(p, n.value) == 0
    return out


def test_python_writes_and_reads_a_c_engine(engines):
    lib, c, py, cbuf, pybuf, c_name = engines
    ctypes.memmove(pybuf.addr, pattern(7, pybuf.n), pybuf.n)
    assert py.transfer_sync_write(c_name, pybuf.addr, cbuf.addr, 256 << 10) == 0
    assert cbuf.bytes(0, 256 << 10) == pybuf.bytes(0, 256 << 10)
    # Scattered pages in one batch, with a notification the C side receives after them.
    srcs = [pybuf.addr + i * 8192 for i in range(16)]
    dsts = [cbuf.addr + (512 << 10) + i * 4096 for i in range(16)]
    note = TransferNotify("prefill-0", "pages 0..16")
    assert py.batch_transfer_sync(c_name, srcs, dsts, [4096] * 16, TransferOpcode.Write, note) == 0
    for i in range(16):
        assert cbuf.bytes((512 << 10) + i * 4096, 4096) == pybuf.bytes(i * 8192, 4096)
    got, end = [], time.time() + 5
    while not got and time.time() < end:
        got = c_notifies(lib, c)
        time.sleep(0.001)
    assert [m for _, m in got] == ["pages 0..16"]
    assert c_notifies(lib, c) == []
    # READ back from the C engine into another part of the Python buffer.
    ctypes.memmove(cbuf.addr, pattern(9, 64 << 10), 64 << 10)
    assert py.transfer_sync_read(c_name, pybuf.addr + (768 << 10), cbuf.addr, 64 << 10) == 0
    assert pybuf.bytes(768 << 10, 64 << 10) == cbuf.bytes(0, 64 << 10)
    # Out of the C engine's registered range: refused, nothing written.
    before = cbuf.bytes()
    assert py.transfer_sync_write(c_name, pybuf.addr, cbuf.addr + cbuf.n - 100, 4096) == -1
    assert cbuf.bytes() == before


def test_c_engine_writes_and_reads_a_python_engine(engines):
    lib, c, py, cbuf, pybuf, _ = engines
    seg = lib.openSegment(c, py.session_id.encode())
    assert seg >= 0, f"openSegment({py.session_id}) = {seg}"
    ctypes.memmove(cbuf.addr, pattern(3, cbuf.n), cbuf.n)
    sizes = [1, 7, 4096, 65536, 300 << 10]
    reqs, off = [], 0
    for s in sizes:
        reqs.append(Request(OPCODE_WRITE, cbuf.addr + off, seg, pybuf.addr + off, s))
        off += s + 123
    c_batch(lib, c, reqs, notify=("decode", "landed"))
    for r in reqs:
        d = r.target_offset - pybuf.addr
        assert pybuf.bytes(d, r.length) == cbuf.bytes(r.source - cbuf.addr, r.length)
    got, end = [], time.time() + 5
    while not got and time.time() < end:
        got = py.get_notifies()
        time.sleep(0.001)
    assert [n.msg for n in got] == ["landed"]
    # READ from the Python engine's memory into the C engine's.
    ctypes.memmove(pybuf.addr, pattern(5, 128 << 10), 128 << 10)
    c_batch(lib, c, [Request(OPCODE_READ, cbuf.addr + (900 << 10), seg, pybuf.addr, 100 << 10)])
    assert cbuf.bytes(900 << 10, 100 << 10) == pybuf.bytes(0, 100 << 10)
