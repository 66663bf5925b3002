"""pagewire.mooncake_compat.TransferEngine: Mooncake's return codes over loopback and TCP,
in one process and across two, bytes checked on the receiving side; every kind of bad
input of the integration notes (section 1.3) gets its code and writes nothing."""

import ctypes
import logging
import os
import signal
import socket
import threading
import time

import pytest

from pagewire import mooncake_compat as mc
from pagewire.mooncake_compat import TransferEngine, TransferNotify, TransferOpcode
from peer_proc import Buf, PeerProcess, pattern, stop_process

MB = 1 << 20


@pytest.fixture
def env(monkeypatch):
    """A 5 s transfer timeout (as in the measurements) and no inherited overrides."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    for v in ("MC_FORCE_TCP", "PAGEWIRE_TRANSPORT", "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def engine(protocol="tcp"):
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    return te


@pytest.fixture(params=["loopback", "tcp"])
def pair(request, env):
    """Initiator `a` and target `b`, each with a registered 4 MiB buffer; `a`'s holds a
    pattern, `b`'s zeros."""
    if request.param == "loopback":
        env.setenv("PAGEWIRE_TRANSPORT", "loopback")
    a, b = engine(), engine()
    assert a.backend == b.backend == request.param
    src, dst = Buf(4 * MB, seed=1), Buf(4 * MB)
    assert a.register_memory(src.addr, src.n) == 0
    assert b.register_memory(dst.addr, dst.n) == 0
    sid = f"127.0.0.1:{b.get_rpc_port()}"
    yield a, b, src, dst, sid
    a.close()
    b.close()


# ------------------------------------------------------------------ happy paths


def test_session_id_and_port_range(env):
    te = engine()
    port = te.get_rpc_port()
    assert 15000 <= port <= 17000
    assert te.session_id == f"127.0.0.1:{port}"
    te.close()
    env.setenv("MC_MIN_RPC_PORT", "16100")
    env.setenv("MC_MAX_RPC_PORT", "16120")
    te = engine()
    assert 16100 <= te.get_rpc_port() <= 16120
    te.close()
    env.setenv("MC_MIN_RPC_PORT", "40000")  # ephemeral range: Mooncake falls back to the default
    te = engine()
    assert 15000 <= te.get_rpc_port() <= 17000
    te.close()


def test_sync_write_and_read(pair):
    a, b, src, dst, sid = pair
    assert a.transfer_sync_write(sid, src.addr, dst.addr, 4096) == 0
    assert dst.bytes(0, 4096) == src.bytes(0, 4096)
    # read back into another part of a's buffer
    assert a.transfer_sync_read(sid, src.addr + MB, dst.addr, 4096) == 0
    assert src.bytes(MB, 4096) == src.bytes(0, 4096)


def test_batch_write_pages_and_read(pair):
    a, b, src, dst, sid = pair
    # 32 pages of 64 KiB to scattered destinations, as SGLang's PD send does
    page = 64 << 10
    order = [(i * 7) % 32 for i in range(32)]
    srcs = [src.addr + i * page for i in range(32)]
    dsts = [dst.addr + order[i] * page for i in range(32)]
    assert a.batch_transfer_sync_write(sid, srcs, dsts, [page] * 32) == 0
    for i in range(32):
        assert dst.bytes(order[i] * page, page) == src.bytes(i * page, page)
    # tuples and numpy arrays are accepted too
    np = pytest.importorskip("numpy")
    back = Buf(2 * page)
    assert a.register_memory(back.addr, back.n) == 0
    rc = a.batch_transfer_sync_read(sid, (back.addr, back.addr + page), np.array(dsts[:2], dtype=np.uint64), [page, page])
    assert rc == 0
    assert back.bytes() == dst.bytes(order[0] * page, page) + dst.bytes(order[1] * page, page)


def test_generic_transfer_with_opcode(pair):
    a, b, src, dst, sid = pair
    assert a.transfer_sync(sid, src.addr, dst.addr, 100, TransferOpcode.Write) == 0
    assert a.transfer_sync(sid, src.addr + 200, dst.addr, 100, mc.Read) == 0
    assert src.bytes(200, 100) == src.bytes(0, 100)
    assert a.batch_transfer_sync(sid, [src.addr], [dst.addr + 300], [50], 1) == 0
    assert dst.bytes(300, 50) == src.bytes(0, 50)
    with pytest.raises(TypeError):
        a.transfer_sync(sid, src.addr, dst.addr, 100, 7)


def test_notifications_once_and_after_data(pair):
    a, b, src, dst, sid = pair
    assert b.get_notifies() == []
    for i in range(5):
        note = TransferNotify(f"prefill-{i}", "x" * (i * 2000))  # up to a full 8 KiB slot
        assert a.transfer_sync(sid, src.addr, dst.addr + i, 1000, TransferOpcode.Write, note) == 0
    assert a.batch_transfer_sync(sid, [], [], [], TransferOpcode.Write, TransferNotify("only", "tag")) == 0
    got = []
    deadline = time.time() + 10
    while len(got) < 6 and time.time() < deadline:
        got += b.get_notifies()
        time.sleep(0.01)
    assert [(n.name, len(n.msg)) for n in got] == [(f"prefill-{i}", i * 2000) for i in range(5)] + [("only", 3)]
    time.sleep(0.2)
    assert b.get_notifies() == []  # each delivered once
    # many more than the outbox holds at once: slots are recycled on the receiver's ACK
    for i in range(300):
        assert a.transfer_sync(sid, src.addr, dst.addr, 8, TransferOpcode.Write, TransferNotify("n", str(i))) == 0
    got = []
    deadline = time.time() + 20
    while len(got) < 300 and time.time() < deadline:
        got += b.get_notifies()
        time.sleep(0.01)
    assert [n.msg for n in got] == [str(i) for i in range(300)]
    with pytest.raises(ValueError):
        a.transfer_sync(sid, src.addr, dst.addr, 8, 1, TransferNotify("big", "x" * 8174))  # 8177 > 8176


def test_unread_notifications_stop_the_sender(pair, env):
    """A receiver that never calls get_notifies reads at most 4096; its sender then runs
    out of outbox slots (the call fails, -1) instead of either side growing; once the
    receiver drains, notifications flow again."""
    a, b, src, dst, sid = pair
    env.setenv("MC_TRANSFER_TIMEOUT", "5")
    sent = 0
    t = time.time()
    while sent < 4096 + 256 + 10 and time.time() - t < 120:
        if a.transfer_sync(sid, src.addr, dst.addr, 8, 1, TransferNotify("n", str(sent))) != 0:
            break
        sent += 1
    assert 4096 <= sent <= 4096 + 256, sent
    got = b.get_notifies()
    assert [n.msg for n in got] == [str(i) for i in range(len(got))] and len(got) == 4096
    assert a.transfer_sync(sid, src.addr, dst.addr, 8, 1, TransferNotify("n", "after")) == 0


def test_async_batches_and_stale_ids(pair):
    a, b, src, dst, sid = pair
    bid = a.batch_transfer_async_write(sid, [src.addr], [dst.addr], [MB])
    assert bid > 0
    deadline = time.time() + 10
    while (st := a.transfer_check_status(bid)) == 0 and time.time() < deadline:
        time.sleep(0.001)
    assert st == 1
    assert dst.bytes(0, MB) == src.bytes(0, MB)
    assert a.transfer_check_status(bid) == -1  # collected: stale, never a crash
    ids = [a.transfer_submit_write(sid, src.addr + i * 4096, dst.addr + i * 4096, 4096) for i in range(4)]
    ids.append(a.batch_transfer_async_read(sid, [src.addr + 2 * MB], [dst.addr], [4096]))
    ids.append(a.batch_transfer_async(sid, [src.addr], [dst.addr], [0], TransferOpcode.Write))
    assert all(i > 0 for i in ids) and len(set(ids)) == len(ids)
    assert a.get_batch_transfer_status(ids) == 0
    assert a.get_batch_transfer_status(ids) == -1  # stale
    assert a.transfer_check_status(123456789) == -1
    assert a.get_batch_transfer_status([]) == 0


def test_registration_codes(pair):
    a, b, src, dst, sid = pair
    extra = Buf(64 << 10)
    assert a.register_memory(extra.addr, extra.n) == 0
    assert a.register_memory(extra.addr, extra.n) == -7  # the same region twice
    assert a.register_memory(extra.addr + 4096, 4096) == -7  # inside
    assert a.register_memory(extra.addr - 10, 20) == -7  # straddling the start
    assert a.register_memory(extra.addr, 0) == -1
    assert a.register_memory(8, 4096) == -1  # not memory of this process
    assert a.register_memory(extra.addr, extra.n, "cuda:0") == -1  # no GPU support here
    assert a.unregister_memory(extra.addr) == 0
    assert a.unregister_memory(extra.addr) == -3
    assert a.unregister_memory(12345) == -3
    p, q = Buf(8192), Buf(8192)
    assert a.batch_register_memory([p.addr, q.addr], [8192]) == -1  # lengths differ
    assert a.batch_register_memory([p.addr, p.addr + 4096], [8192, 4096]) == -7
    assert a.batch_register_memory([p.addr, q.addr], [8192, 0]) == -1
    assert a.batch_register_memory([p.addr, 8], [8192, 4096]) == -1
    assert a.register_memory(p.addr, 8192) == 0  # the failed batches left nothing behind
    assert a.unregister_memory(p.addr) == 0
    assert a.batch_register_memory([p.addr, q.addr], [8192, 8192]) == 0
    assert a.batch_unregister_memory([p.addr, q.addr]) == 0
    assert a.batch_unregister_memory([p.addr]) == -3


# ------------------------------------------------------------------ bad input (1.3)


def test_bad_ranges_write_nothing(pair):
    a, b, src, dst, sid = pair
    n = dst.n
    unreg = Buf(8192, seed=9)
    cases = {
        "remote outside every buffer": ([src.addr], [dst.addr + 2 * n], [4096]),
        "remote straddles the end": ([src.addr], [dst.addr + n - 100], [4096]),
        "one good, one bad": ([src.addr, src.addr + 4096], [dst.addr, dst.addr + n - 10], [4096, 4096]),
        "local source not registered": ([unreg.addr], [dst.addr], [4096]),
        "local source straddles its end": ([src.addr + src.n - 10], [dst.addr], [4096]),
        "local source before its start": ([src.addr - 4096], [dst.addr], [8192]),
    }
    for name, (s, d, l) in cases.items():
        assert a.batch_transfer_sync_write(sid, s, d, l) == -1, name
        assert dst.bytes() == bytes(n), f"{name}: bytes were written"
    assert a.transfer_sync_write(sid, unreg.addr, dst.addr, 4096) == -1
    assert a.transfer_sync_read(sid, unreg.addr, dst.addr, 4096) == -1
    assert unreg.bytes() == pattern(9, 8192)
    assert dst.bytes() == bytes(n)


def test_degenerate_batches(pair):
    a, b, src, dst, sid = pair
    assert a.batch_transfer_sync_write(sid, [], [], []) == 0
    assert a.batch_transfer_sync_write(sid, [src.addr], [dst.addr], []) == -1
    assert a.batch_transfer_sync_write(sid, [src.addr], [dst.addr, dst.addr], [1]) == -1
    assert a.transfer_sync_write(sid, src.addr, dst.addr, 0) == 0
    assert a.transfer_sync_write(sid, src.addr, dst.addr + 10 * dst.n, 0) == 0  # nothing to move
    assert dst.bytes() == bytes(dst.n)
    assert a.batch_transfer_sync_write(sid, (src.addr,), (dst.addr,), (16,)) == 0


@pytest.mark.parametrize(
    "value", [-1, None, 1.5, 1 << 64, "0x10"], ids=["negative", "None", "float", "2**64", "str"]
)
def test_bad_argument_types_raise_type_error(pair, value):
    a, b, src, dst, sid = pair
    with pytest.raises(TypeError):
        a.transfer_sync_write(sid, value, dst.addr, 16)
    with pytest.raises(TypeError):
        a.transfer_sync_write(sid, src.addr, dst.addr, value)
    with pytest.raises(TypeError):
        a.batch_transfer_sync_write(sid, [value], [dst.addr], [16])
    with pytest.raises(TypeError):
        a.register_memory(value, 16)
    assert dst.bytes() == bytes(dst.n)


def test_unreachable_and_malformed_sessions(env):
    a = engine()
    src = Buf(8192, seed=2)
    assert a.register_memory(src.addr, src.n) == 0
    for sid in ["127.0.0.1:1", "no-such-host.invalid:15000", "127.0.0.1", "::1:15000", "", "127.0.0.1:0", "127.0.0.1:99999"]:
        t = time.time()
        assert a.transfer_sync_write(sid, src.addr, 0x1000, 16) == -1, sid
        assert a.batch_transfer_sync_write(sid, [src.addr], [0x1000], [16]) == -1, sid
        assert a.transfer_submit_write(sid, src.addr, 0x1000, 16) == 0, sid
        assert a.batch_transfer_async_write(sid, [src.addr], [0x1000], [16]) == 0, sid
        assert time.time() - t < 5, sid
    a.close()


def _bad_server(behaviour):
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
                    c.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + os.urandom(4096))
                except OSError:
                    pass
            c.close()

    threading.Thread(target=run, daemon=True).start()
    return srv


@pytest.mark.parametrize("behaviour", ["close", "garbage"])
def test_hostile_peers(env, behaviour):
    a = engine()
    src = Buf(4096)
    assert a.register_memory(src.addr, src.n) == 0
    srv = _bad_server(behaviour)
    sid = f"127.0.0.1:{srv.getsockname()[1]}"
    t = time.time()
    assert a.transfer_sync_write(sid, src.addr, 0x1000, 16) == -1
    assert a.send_probe(sid) != 0
    assert time.time() - t < 5
    srv.close()
    a.close()


def test_methods_before_initialize_return_minus_one(env):
    te = TransferEngine()
    assert te.get_rpc_port() == -1
    assert te.register_memory(Buf(16).addr, 16) == -1
    assert te.unregister_memory(1) == -1
    assert te.batch_register_memory([1], [1]) == -1
    assert te.batch_unregister_memory([1]) == -1
    assert te.transfer_sync_write("127.0.0.1:1", 1, 1, 1) == -1
    assert te.batch_transfer_sync_write("127.0.0.1:1", [1], [1], [1]) == -1
    assert te.batch_transfer_async_write("127.0.0.1:1", [1], [1], [1]) == 0
    assert te.transfer_submit_write("127.0.0.1:1", 1, 1, 1) == 0
    assert te.transfer_check_status(1) == -1
    assert te.get_batch_transfer_status([1]) == -1
    assert te.send_probe("127.0.0.1:1") == -1
    assert te.get_first_buffer_address("127.0.0.1:1") == 0
    assert te.get_notifies() == []
    assert te.get_engine() is None
    assert te.session_id is None and te.backend is None


def test_initialize_variants(env, caplog):
    caplog.set_level(logging.INFO, logger="pagewire.mooncake_compat")
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "bogus://x", "tcp", "") == -1  # never an abort
    assert te.initialize("127.0.0.1", "etcd://127.0.0.1:1", "tcp", "") == -1
    assert te.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "") == -1
    assert te.initialize("127.0.0.1", "127.0.0.1:2379", "tcp", "") == -1  # bare = etcd
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "xgmi", "") == -1
    assert te.get_rpc_port() == -1
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "nosuch", "") == 0
    assert te.backend == "tcp"
    port = te.get_rpc_port()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0  # twice: no-op
    assert te.get_rpc_port() == port
    te.close()
    caplog.clear()
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0  # no HCA here
    assert te.backend == "tcp"
    assert any("using TCP" in r.getMessage() for r in caplog.records)
    te.close()
    env.setenv("MC_FORCE_TCP", "1")
    caplog.clear()
    te = TransferEngine()
    assert te.initialize("127.0.0.1:12345", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    assert te.backend == "tcp" and te.session_id.startswith("127.0.0.1:")
    assert any("MC_FORCE_TCP" in r.getMessage() for r in caplog.records)
    te.close()
    with pytest.raises(TypeError):
        te.initialize(local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="")


def test_transfer_timeout_from_env(env):
    env.setenv("MC_TRANSFER_TIMEOUT", "1")
    assert TransferEngine()._transfer_timeout == 5  # Mooncake's floor
    env.setenv("MC_TRANSFER_TIMEOUT", "12")
    assert TransferEngine()._transfer_timeout == 12
    env.setenv("MC_TRANSFER_TIMEOUT", "junk")
    assert TransferEngine()._transfer_timeout == 5
    env.delenv("MC_TRANSFER_TIMEOUT")
    assert TransferEngine()._transfer_timeout == 30


def test_ipv6_session_ids(env):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this sandbox")
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
        s.close()
    except OSError:
        pytest.skip("no ::1 in this sandbox")
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("::1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("::1", "P2PHANDSHAKE", "tcp", "") == 0
    sid = f"[::1]:{b.get_rpc_port()}"
    assert b.session_id == sid
    src, dst = Buf(4096, seed=3), Buf(4096)
    assert a.register_memory(src.addr, src.n) == 0 and b.register_memory(dst.addr, dst.n) == 0
    assert a.transfer_sync_write(sid, src.addr, dst.addr, 4096) == 0
    assert dst.bytes() == src.bytes()
    a.close()
    b.close()


def test_cuda_only_methods_raise(env):
    """Mooncake's CUDA builds only (the non-CUDA wheel lacks them): present, and they
    raise NotImplementedError."""
    te = engine()
    for name, args in [
        ("transfer_write_on_cuda", ("127.0.0.1:1", 1, 1, 1)),
        ("transfer_read_on_cuda", ("127.0.0.1:1", 1, 1, 1)),
        ("batch_transfer_write_on_cuda", ("127.0.0.1:1", [1], [1], [1])),
        ("batch_transfer_read_on_cuda", ("127.0.0.1:1", [1], [1], [1])),
    ]:
        with pytest.raises(NotImplementedError):
            getattr(te, name)(*args)
    assert te.warmup_efa_segment("x") == 0
    assert te.get_engine() is not None and te.get_engine_ptr() != 0
    assert "cpu:0" in te.get_local_topology()
    te.close()


def test_managed_buffers(env):
    """Before initialize each call fails (Mooncake crashes); after close too. A block
    lives in registered memory until the engine goes; a large buffer is unregistered
    by free."""
    te = TransferEngine()
    assert te.allocate_managed_buffer(4096) == 0
    assert te.free_managed_buffer(1, 4096) == -1
    assert te.write_bytes_to_buffer(1, "x", 1) == -1
    with pytest.raises(ValueError):
        te.read_bytes_from_buffer(1, 1)
    te = engine()

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) // 1024

    before, t = rss_mb(), time.monotonic()
    a = te.allocate_managed_buffer(4096)
    # The 2 GiB chunk is mapped lazily: no page is touched by the allocation.
    assert rss_mb() - before < 100 and time.monotonic() - t < 1.0
    assert a != 0 and te.read_bytes_from_buffer(a, 8192) == bytes(8192)  # zeroed
    assert te.write_bytes_to_buffer(a, b"abc", 3) == 0
    # The first block is the chunk's last 8 KiB: 3 bytes at +8190 cross the registration.
    assert te.write_bytes_to_buffer(a + 8190, b"abc", 3) == -1
    assert te.write_bytes_to_buffer(a, "ab", 3) == -1  # src shorter than length
    assert te.free_managed_buffer(a, 4096) == 0
    assert te.free_managed_buffer(a, 4096) == -1  # twice
    big = te.allocate_managed_buffer(257 << 20)
    assert big != 0 and te.write_bytes_to_buffer(big + (257 << 20) - 1, b"z", 1) == 0
    assert te.free_managed_buffer(big, 257 << 20) == 0
    assert te.write_bytes_to_buffer(big, b"z", 1) == -1  # unregistered and freed
    te.close()
    assert te.allocate_managed_buffer(4096) == 0


def test_module_attributes():
    for a in ["SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_MUSA", "SUPPORT_INTRA_NVLINK"]:
        assert getattr(mc, a) is False
    assert (int(mc.Read), int(mc.Write)) == (0, 1)
    assert TransferEngine.TransferOpcode is TransferOpcode
    n = TransferNotify()
    assert (n.name, n.msg) == ("", "")
    n.name, n.msg = "a", "b"
    assert TransferNotify(name="a", msg="b") == n


def test_get_first_buffer_address(pair):
    a, b, src, dst, sid = pair
    assert a.get_first_buffer_address(sid) == dst.addr


def test_peer_registers_after_connect(pair):
    a, b, src, dst, sid = pair
    assert a.transfer_sync_write(sid, src.addr, dst.addr, 16) == 0  # session open
    late = Buf(8192)
    assert b.register_memory(late.addr, late.n) == 0
    assert a.transfer_sync_write(sid, src.addr, late.addr, 8192) == 0
    assert late.bytes() == src.bytes(0, 8192)


# ------------------------------------------------------------------ two processes


def test_two_processes_pages_notifications_and_reads(env):
    a = engine()
    src = Buf(4 * MB, seed=5)
    assert a.register_memory(src.addr, src.n) == 0
    with PeerProcess("pagewire", "tcp", 4 * MB) as b:
        assert b.backend == "tcp"
        page = 64 << 10
        srcs = [src.addr + i * page for i in range(32)]
        dsts = [b.addr + (31 - i) * page for i in range(32)]
        assert a.batch_transfer_sync_write(b.sid, srcs, dsts, [page] * 32) == 0
        want = b"".join(src.bytes((31 - i) * page, page) for i in range(32))
        import hashlib

        assert b.digest(0, 32 * page) == hashlib.sha256(want).hexdigest()
        # the receiver sees each notification once, and only with its data in place
        for round_ in range(3):
            ctypes.memmove(src.addr, pattern(100 + round_, MB), MB)
            result = {}
            t = threading.Thread(target=lambda: result.update(b.cmd("waitnote", 10, 0, MB)))
            t.start()
            time.sleep(0.05)
            note = TransferNotify("prefill", f"round {round_}")
            assert a.batch_transfer_sync(b.sid, [src.addr], [b.addr], [MB], TransferOpcode.Write, note) == 0
            t.join(15)
            assert result["notifies"] == [["prefill", f"round {round_}"]]
            assert result["sha256"] == hashlib.sha256(pattern(100 + round_, MB)).hexdigest()
        assert b.cmd("notifies")["notifies"] == []
        # reads from the other process
        b.cmd("fill", 7)
        assert a.transfer_sync_read(b.sid, src.addr + MB, b.addr + 4096, 8192) == 0
        assert src.bytes(MB, 8192) == pattern(7, 4 * MB)[4096 : 4096 + 8192]
        # bad input across processes: nothing lands on the other side
        before = b.digest(0, b.len)
        assert a.batch_transfer_sync_write(b.sid, [src.addr, src.addr], [b.addr, b.addr + b.len - 1], [16, 16]) == -1
        assert b.digest(0, b.len) == before
        # the other process writes to us
        mine = f"127.0.0.1:{a.get_rpc_port()}"
        assert b.cmd("write", mine, src.addr + 2 * MB, 0, 4096)["rc"] == 0
        assert src.bytes(2 * MB, 4096) == pattern(7, 4 * MB)[:4096]
    a.close()


def test_stopped_and_killed_peers(env):
    a = engine()
    src = Buf(MB, seed=6)
    assert a.register_memory(src.addr, src.n) == 0
    with PeerProcess("pagewire", "tcp", MB) as b:
        assert a.transfer_sync_write(b.sid, src.addr, b.addr, 4096) == 0
        stop_process(b.proc.pid)
        try:
            t = time.time()
            assert a.transfer_sync_write(b.sid, src.addr, b.addr, MB) == -1
            took = time.time() - t
            assert 4.5 < took < 8, took  # MC_TRANSFER_TIMEOUT=5
            t = time.time()
            assert a.send_probe(b.sid) != 0
            assert time.time() - t < 5  # Mooncake: ~60 s
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        # the peer is back: the engine reconnects on its own
        assert a.send_probe(b.sid) == 0
        assert a.transfer_sync_write(b.sid, src.addr, b.addr, 4096) == 0
        b.proc.kill()
        b.proc.wait()
        t = time.time()
        assert a.transfer_sync_write(b.sid, src.addr, b.addr, 4096) == -1
        assert a.send_probe(b.sid) == -102
        assert time.time() - t < 5
    a.close()


def test_shared_segment_blob_is_checked():
    """A blob is another process's bytes: a name pagewire did not make is never opened,
    a wrong rank or declaration is refused, and the owner's name goes with it."""
    from pagewire._mooncake_shm import _BLOB, SharedSegment

    owner, blob = SharedSegment.create("kv", 4096, 2, 0)
    peer, pblob = SharedSegment.create("kv", 4096, 2, 1)
    fields = list(_BLOB.unpack(blob))
    for name in (b"/../../etc/passwd", b"/pwss_1_zzzz", b""):
        fields[-1] = name
        with pytest.raises(RuntimeError, match="names no segment"):
            peer.complete([_BLOB.pack(*fields), pblob])
    with pytest.raises(RuntimeError, match="malformed"):
        peer.complete([pblob, pblob])  # rank 1's blob in rank 0's place
    assert not peer.ready() and peer.base_addr() == 0
    peer.complete([blob, pblob])
    ctypes.memmove(owner.base_addr(), b"shared", 6)
    assert ctypes.string_at(peer.base_addr(), 6) == b"shared"
    path = "/dev/shm" + _BLOB.unpack(blob)[-1].rstrip(b"\0").decode()
    assert os.path.exists(path)
    del owner
    assert not os.path.exists(path)  # unlinked with the owner; the peer keeps its mapping
    assert ctypes.string_at(peer.base_addr(), 6) == b"shared"
