"""The native API (pagewire.Engine) over loopback and TCP: bytes verified on the
receiving side, errors typed, nothing written when a batch is refused."""

import ctypes
import threading
import time

import numpy as np
import pytest

import pagewire
from pagewire import errors
from peer_proc import pattern

BACKENDS = ["loopback", "tcp"]


@pytest.fixture(params=BACKENDS)
def pair(request):
    """Two engines of one backend. Tests register memory first, then connect (a peer's
    regions are exchanged in the handshake; later ones need `Peer.redescribe`)."""
    a = pagewire.Engine(backend=request.param, timeout=10.0)
    b = pagewire.Engine(backend=request.param, timeout=10.0)
    yield a, b
    a.close()
    b.close()


def test_engine_basics():
    with pagewire.Engine(backend="tcp") as e:
        assert e.backend == "tcp"
        host, port = e.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) == e.port > 0
        assert e.backend_info["kind"] == "tcp"
        assert not e.closed
        assert "tcp" in repr(e)
    assert e.closed
    with pytest.raises(errors.EngineClosed):
        e.register(bytearray(10))
    e.close()  # idempotent


def test_bad_engine_arguments():
    with pytest.raises(ValueError):
        pagewire.Engine(backend="carrier-pigeon")
    with pytest.raises(ValueError):
        pagewire.Engine(listen="not an address")
    with pytest.raises(ValueError):
        pagewire.Engine(timeout=-1)


def test_write_with_plan_object_and_notification(pair):
    a, b = pair
    n = 1 << 20
    src = bytearray(pattern(1, n))
    dst = np.zeros(n, dtype=np.uint8)
    s = a.register(src, access="local")
    d = b.register(dst, access="w")
    peer = a.connect(b.address)

    class Plan:  # any object with .srcs/.dsts/.lens, as pagewire.TransferPlan
        srcs = np.array([s.addr, s.addr + 4096, s.addr + 8192], dtype=np.uint64)
        dsts = np.array([d.addr + 8192, d.addr, d.addr + 4096], dtype=np.uint64)
        lens = [4096, 4096, 4096]

    h = a.submit(peer, Plan(), notify=7)
    stats = h.wait(10.0)
    assert stats["bytes"] == 3 * 4096 and stats["ops"] == 3
    assert h.status() == "done" and h.error is None
    note = b.poll_notification(10.0)
    assert note.tag == 7
    assert note.peer.address  # the sender, as a Peer of b
    got = dst.tobytes()
    assert got[8192:12288] == bytes(src[:4096])
    assert got[:4096] == bytes(src[4096:8192])
    assert got[4096:8192] == bytes(src[8192:12288])
    assert got[12288:] == bytes(n - 12288)


def test_read_with_three_sequences(pair):
    a, b = pair
    local = bytearray(64 << 10)
    remote = bytearray(pattern(2, 64 << 10))
    lr = a.register(local, access="local")
    rr = b.register(remote, access="r")
    peer = a.connect(b.address)
    # Read: data flows remote -> local, so srcs are remote addresses.
    a.submit(peer, (rr.addr,), (lr.addr,), (len(remote),), op="read").wait(10.0)
    assert bytes(local) == bytes(remote)


def test_raw_pointer_registration(pair):
    a, b = pair
    n = 8192
    src = ctypes.create_string_buffer(pattern(3, n), n)
    dst = ctypes.create_string_buffer(n)
    s = a.register(ctypes.addressof(src), n, access="local")
    d = b.register(ctypes.addressof(dst), n)
    peer = a.connect(b.address)
    assert (s.length, d.access) == (n, "rw")
    a.submit(peer, [s.addr], [d.addr], [n]).wait(10.0)
    assert dst.raw == src.raw
    d.deregister()
    assert not d.registered


def test_refused_batches_write_nothing(pair):
    a, b = pair
    n = 16 << 10
    src = bytearray(pattern(4, n))
    dst = bytearray(n)
    s = a.register(src, access="local")
    d = b.register(dst, access="w")
    r = b.register(bytearray(n), access="r")
    peer = a.connect(b.address)
    good = (s.addr, d.addr, 4096)
    cases = [
        # one good op and one whose remote end is past the peer's region
        ((s.addr, s.addr), (d.addr, d.addr + n - 100), (4096, 4096), errors.RemoteOutOfRange),
        # local source not registered
        ((s.addr + n - 10,), (d.addr,), (4096,), errors.NotRegistered),
        # the peer exposes this range read-only
        ((s.addr,), (r.addr,), (4096,), errors.AccessDenied),
        # zero length
        ((s.addr,), (d.addr,), (0,), errors.InvalidRange),
    ]
    for srcs, dsts, lens, exc in cases:
        with pytest.raises(exc) as ei:
            a.submit(peer, list(srcs), list(dsts), list(lens))
        assert isinstance(ei.value, errors.PagewireError)
        assert ei.value.kind
        assert bytes(dst) == bytes(n), f"{exc.__name__}: bytes were written"
    with pytest.raises(errors.EmptyBatch):
        a.submit(peer, [], [], [])
    with pytest.raises(errors.UsageError):
        a.submit(peer, [good[0]], [good[1]], [1, 2])
    with pytest.raises(TypeError):
        a.submit(peer, object())
    with pytest.raises(ValueError):
        a.submit(peer, [-1], [d.addr], [1])
    with pytest.raises(ValueError):
        a.submit(peer, [s.addr], [d.addr], [1], op="sideways")


def test_registration_errors():
    with pagewire.Engine(backend="loopback") as e:
        buf = bytearray(8192)
        r = e.register(buf)
        with pytest.raises(errors.RegionOverlap):
            e.register(ctypes.addressof((ctypes.c_char * 8192).from_buffer(buf)), 4096)
        with pytest.raises(BufferError):
            buf.extend(b"x")  # the engine holds the buffer: it cannot move
        with pytest.raises(TypeError):
            e.register(b"read-only bytes")
        with pytest.raises(TypeError):
            e.register(12345)  # address without a length
        with pytest.raises(errors.RegistrationError):
            e.register(8, 4096)  # not writable memory of this process
        with pytest.raises(errors.InvalidRange):
            e.register(bytearray(0))
        with pytest.raises(ValueError):
            e.register(buf, access="x")
        with pytest.raises(ValueError):
            e.register(bytearray(10), length=11)
        r.deregister()
        buf.extend(b"x")  # released
        r.deregister()  # idempotent


def test_region_context_manager_and_busy():
    with pagewire.Engine(backend="tcp") as a, pagewire.Engine(backend="tcp") as b:
        with a.register(bytearray(4096)) as r:
            assert r.registered
        assert not r.registered
        # deregistering after close is harmless
        r2 = b.register(bytearray(4096))
    r2.deregister()


def test_prepared_batch(pair):
    a, b = pair
    slot = bytearray(64)
    ring = bytearray(64)
    s = a.register(slot, access="local")
    d = b.register(ring, access="w")
    peer = a.connect(b.address)
    p = a.prepare(peer, [s.addr], [d.addr], [64], notify=0, timeout=10.0)
    assert p.bytes == 64
    for seq in range(1, 4):
        slot[:4] = seq.to_bytes(4, "little")
        p.start(tag=seq)
        p.wait(10.0)
        assert p.try_wait()
        note = b.poll_notification(10.0)
        assert note.tag == seq
        assert ring[:4] == seq.to_bytes(4, "little")


def test_notifications_and_accept():
    with pagewire.Engine(backend="tcp") as a, pagewire.Engine(backend="tcp") as b:
        assert b.try_notification() is None
        assert b.poll_notification(0.05) is None
        d = b.register(bytearray(4096), access="w")
        s = a.register(bytearray(4096), access="local")
        peer = a.connect(b.address)
        back = b.accept(5.0)
        assert back is not None and back.alive
        for tag in range(5):
            a.submit(peer, [s.addr], [d.addr], [4096], notify=tag).wait(10.0)
        tags = [b.poll_notification(5.0).tag for _ in range(5)]
        assert tags == list(range(5))
        assert peer.regions == [(d.addr, 4096, "w")]
        assert len(a.peers()) == 1 and a.peers()[0] == peer
        peer.disconnect()
        with pytest.raises(errors.UnknownPeer):
            a.submit(peer, [s.addr], [d.addr], [4096])


def test_redescribe_after_peer_registers_more(pair):
    a, b = pair
    peer = a.connect(b.address)
    s = a.register(bytearray(pattern(5, 4096)), access="local")
    late = bytearray(4096)
    d = b.register(late, access="w")
    with pytest.raises(errors.RemoteOutOfRange):
        a.submit(peer, [s.addr], [d.addr], [4096])
    peer.redescribe()
    a.submit(peer, [s.addr], [d.addr], [4096]).wait(10.0)
    assert bytes(late) == pattern(5, 4096)


def test_connect_errors():
    with pagewire.Engine(backend="tcp", connect_timeout=2.0) as a:
        with pytest.raises(errors.PeerUnreachable) as ei:
            a.connect("127.0.0.1:1")
        assert isinstance(ei.value, ConnectionError)
        with pytest.raises(errors.PeerError):
            a.connect("127.0.0.1:1")


def test_handshake_refused_across_backends():
    with pagewire.Engine(backend="tcp") as a, pagewire.Engine(backend="loopback") as b:
        with pytest.raises(errors.HandshakeError):
            a.connect(b.address)


def test_wait_timeout_and_cancel():
    # A peer that never serves: its process is alive but we stop its engine's data path
    # by closing it after the handshake; the batch fails (PeerGone) or times out.
    with pagewire.Engine(backend="tcp", timeout=1.0) as a:
        b = pagewire.Engine(backend="tcp")
        d = b.register(bytearray(1 << 20), access="w")
        s = a.register(bytearray(1 << 20), access="local")
        peer = a.connect(b.address)
        b.close()
        time.sleep(0.1)
        with pytest.raises((errors.PeerGone, errors.Timeout, errors.PeerError)):
            a.submit(peer, [s.addr], [d.addr], [1 << 20]).wait(5.0)


def test_gil_is_released_while_waiting():
    """A thread blocked in poll_notification must not stop another thread's submit."""
    with pagewire.Engine(backend="tcp") as a, pagewire.Engine(backend="tcp") as b:
        d = b.register(bytearray(4096), access="w")
        s = a.register(bytearray(4096), access="local")
        peer = a.connect(b.address)
        got = []
        t = threading.Thread(target=lambda: got.append(b.poll_notification(10.0)))
        t.start()
        time.sleep(0.2)
        a.submit(peer, [s.addr], [d.addr], [4096], notify=99).wait(5.0)
        t.join(10.0)
        assert got and got[0].tag == 99


def test_handle_error_attribute_and_cancel(pair):
    a, b = pair
    s = a.register(bytearray(4096), access="local")
    d = b.register(bytearray(4096), access="w")
    peer = a.connect(b.address)
    h = a.submit(peer, [s.addr], [d.addr], [4096])
    h.wait(10.0)
    assert not h.cancel()  # already done
    assert h.bytes_done == 4096 and h.id > 0


def test_exception_hierarchy():
    assert issubclass(errors.Timeout, errors.PagewireError)
    assert issubclass(errors.Timeout, TimeoutError)
    assert issubclass(errors.PeerUnreachable, ConnectionError)
    assert issubclass(errors.NotRegistered, errors.OutOfRange)
    assert issubclass(errors.RemoteOutOfRange, errors.OutOfRange)
    assert issubclass(errors.OutOfRange, ValueError)
    assert issubclass(errors.RegionOverlap, errors.RegistrationError)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.PagewireError)
        if name != "PagewireError":
            assert getattr(errors, name).__module__ == "pagewire.errors"
