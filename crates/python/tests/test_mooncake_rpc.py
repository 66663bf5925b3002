"""pagewire's RpcInterface under hostile or broken peers (what the differential test
cannot ask of Mooncake): bad bytes, oversized messages, a wrong token, a flood of
connections, a silent client, a stopped server; every call ends within its deadline.
"""

import asyncio
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from pagewire import _mooncake_rpc as rpc
from pagewire.mooncake_compat import RpcInterface, create_rpc_client


@pytest.fixture
def server(monkeypatch):
    monkeypatch.delenv("PAGEWIRE_TOKEN", raising=False)
    got = []
    s = RpcInterface()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert s.initialize_server(f"127.0.0.1:{port}", 2, 2)
    s.set_data_receive_callback(lambda d: got.append(d["data"]))
    assert s.start_server_async()
    yield s, f"127.0.0.1:{port}", port, got
    s.stop_server()


def raw(port, payload, read=True):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(payload)
        if not read:
            return None
        try:
            return c.recv(16)
        except OSError:
            return b""  # reset: closed too


def test_garbage_and_truncated_frames_are_dropped(server):
    s, target, port, got = server
    assert raw(port, b"GET / HTTP/1.0\r\n\r\n") == b""  # closed without a word
    assert raw(port, rpc._HEAD.pack(b"PWRP", 99, 0, 1) + b"x") == b""  # unknown version
    assert raw(port, rpc._HEAD.pack(b"PWRP", 1, 0, 10) + b"short") == b""  # idle 2 s: closed
    assert got == []
    c = create_rpc_client()
    assert c.send_data(target, b"still serving") == 0 and got == [b"still serving"]


def test_oversized_message_is_refused_before_it_is_read(server, monkeypatch):
    s, target, port, got = server
    monkeypatch.setenv("PAGEWIRE_RPC_MAX_BYTES", "1024")
    # A header that announces 2**60 bytes: refused at once, nothing allocated.
    assert raw(port, rpc._HEAD.pack(b"PWRP", 1, 0, 1 << 60)) == bytes([rpc._TOO_BIG])
    c = create_rpc_client()
    assert c.send_data(target, b"x" * 1025) == -1
    assert c.send_data(target, b"x" * 1024) == 0
    assert got == [b"x" * 1024]


def test_token(server, monkeypatch):
    s, target, port, got = server
    c = create_rpc_client()
    monkeypatch.setenv("PAGEWIRE_TOKEN", "secret")
    # Both sides read the token per connection: the server now refuses a client with
    # another token or none.
    assert c.send_data(target, b"with token") == 0
    assert raw(port, rpc._HEAD.pack(b"PWRP", 1, 5, 1) + b"wrong" + b"x") == bytes([rpc._BAD_TOKEN])
    assert raw(port, rpc._HEAD.pack(b"PWRP", 1, 0, 1) + b"x") == bytes([rpc._BAD_TOKEN])
    assert got == [b"with token"]
    # Across processes: a client with another token gets -1.
    code = (
        "from pagewire.mooncake_compat import create_rpc_client;"
        f"print(create_rpc_client().send_data('{target}', b'x'))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PAGEWIRE_TOKEN": "other"}, timeout=30)
    assert p.stdout.strip() == "-1"
    assert got == [b"with token"]


def test_connection_flood_is_bounded(server):
    s, target, port, got = server
    socks = []
    try:
        for _ in range(rpc._MAX_CONNECTIONS + 20):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)
        with s._server.lock:
            assert len(s._server.conns) <= rpc._MAX_CONNECTIONS
    finally:
        for k in socks:
            k.close()
    # Silent connections are closed after the idle timeout (2 s); the server serves again.
    deadline = time.time() + 10
    c = create_rpc_client()
    while c.send_data(target, b"after flood") != 0:
        assert time.time() < deadline
        time.sleep(0.2)
    assert got[-1] == b"after flood"


def test_silent_server_hits_the_deadline():
    # A listener that accepts and never answers: the send returns -1 within its deadline.
    with socket.socket() as l:
        l.bind(("127.0.0.1", 0))
        l.listen()
        c = RpcInterface()
        c.initialize_client(4, 1)
        t = time.monotonic()
        assert c.send_data(f"127.0.0.1:{l.getsockname()[1]}", b"x") == -1
        assert time.monotonic() - t < 3


def test_pooled_connection_after_server_restart(server):
    s, target, port, got = server
    c = create_rpc_client()
    assert c.send_data(target, b"one") == 0
    s.stop_server()
    assert c.send_data(target, b"lost") == -1  # Mooncake's wheel answers 0 here
    assert s.start_server_async()
    assert c.send_data(target, b"two") == 0
    assert got == [b"one", b"two"]


def test_start_server_blocks_until_stopped(server):
    s, target, port, got = server
    s.stop_server()
    result = []
    th = threading.Thread(target=lambda: result.append(s.start_server()))
    th.start()
    deadline = time.time() + 5
    while s._server is None:
        assert time.time() < deadline
        time.sleep(0.01)
    assert create_rpc_client().send_data(target, b"while blocked") == 0
    assert th.is_alive()
    s.stop_server()
    th.join(5)
    assert result == [True] and got == [b"while blocked"]


def test_async_sends_are_bounded_and_fail_as_exceptions(server):
    s, target, port, got = server
    c = create_rpc_client()

    async def main():
        loop = asyncio.get_running_loop()
        ok = await asyncio.gather(*[c.send_data_async(target, b"a%d" % i, loop) for i in range(20)])
        bad = c.send_data_async("127.0.0.1:1", b"x", loop)
        with pytest.raises(RuntimeError, match="Send data failed"):
            await bad
        return ok

    assert asyncio.run(main()) == [0] * 20
    assert sorted(got) == sorted(b"a%d" % i for i in range(20))


def test_tensor_outside_this_process_memory_is_not_read(server):
    s, target, port, got = server

    class Bogus:
        shape, dtype = (4,), "float32"

        def data_ptr(self):
            return 8  # not mapped

        def numel(self):
            return 4

        def element_size(self):
            return 4

    assert create_rpc_client().send_tensor(target, Bogus()) == -1
    assert got == []


def test_header_layout():
    assert rpc._HEAD.size == struct.calcsize("<4sBHQ") == 15


def test_announced_size_allocates_nothing(server):
    """A header that announces 900 MiB (under the limit) and sends nothing more costs
    no memory: the server reads what arrives."""
    s, target, port, got = server

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) // 1024

    before = rss_mb()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        for k in socks:
            k.sendall(rpc._HEAD.pack(b"PWRP", 1, 0, 900 << 20) + b"partial")
        time.sleep(0.5)
        assert rss_mb() - before < 100
    finally:
        for k in socks:
            k.close()
    assert got == []
