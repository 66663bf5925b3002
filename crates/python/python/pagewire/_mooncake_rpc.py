"""Mooncake's ``RpcInterface`` (``CoroRPCInterface``): byte messages between processes.

A server (``initialize_server(address)`` + ``start_server_async()``) hands every message
it receives to a Python callback; a client (``create_rpc_client()``) sends ``bytes`` to
``"host:port"`` and gets 0 once the server has run its callback, -1 otherwise. This is
Mooncake's meaning, with pagewire's own wire format (API-compatible, not
wire-compatible: a pagewire client talks to a pagewire server).

What the data callback gets, as in Mooncake: a ``dict`` ``{"source": "", "data": bytes}``.
A message of at least 72 bytes whose first two little-endian ``u32`` look like a tensor
header (dtype 1..9, ndim <= 4) goes to the tensor callback instead, as a
``ReceivedTensor`` (shape from the header's ``int64`` dims, data = the whole message).
``send_tensor`` sends the tensor's bytes only, as Mooncake does. Messages are delivered
only once a data callback is set (Mooncake drops them otherwise, tensors included).

Limits (pagewire's, Mooncake has none): a message is at most ``PAGEWIRE_RPC_MAX_BYTES``
(default 1 GiB), and a server's memory grows with the bytes that arrive, not with what a
header announces; a server serves at most 64 connections at once and closes the rest on
accept; an idle connection is closed after ``timeout_seconds``; a send has one deadline,
``timeout_seconds`` plus 1 ns per byte; at most 256 ``*_async`` sends are in flight per
interface. With ``PAGEWIRE_TOKEN`` set, both sides present it (compared in constant
time); a server refuses a client with another token or none.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from pagewire import _native

__all__ = [
    "RpcInterface",
    "CoroRPCInterface",
    "ReceivedData",
    "ReceivedTensor",
    "create_rpc_client",
    "create_rpc_server",
]

log = logging.getLogger("pagewire.mooncake_compat")

#: ``magic | version | token length (u16) | payload length (u64)``, then token, payload.
_MAGIC = b"PWRP"
_VERSION = 1
_HEAD = struct.Struct("<4sBHQ")
#: Replies: one byte.
_OK, _BAD_TOKEN, _TOO_BIG = 0, 1, 2
_MAX_TOKEN = 256
_MAX_CONNECTIONS = 64
_MAX_ASYNC = 256
#: Mooncake's tensor header: dtype u32, ndim u32, 8 x int64 dims.
_TENSOR_HEADER = 72
_DTYPE_NAMES = {
    1: "float16", 2: "float32", 3: "float64", 4: "int8", 5: "int16",
    6: "int32", 7: "int64", 8: "uint8", 9: "bool",
}


def _max_bytes() -> int:
    try:
        return max(1, int(os.environ.get("PAGEWIRE_RPC_MAX_BYTES", str(1 << 30))))
    except ValueError:
        return 1 << 30


def _token() -> bytes:
    return os.environ.get("PAGEWIRE_TOKEN", "").encode()[:_MAX_TOKEN]


def _split(address: str) -> Optional[Tuple[str, int]]:
    """``"host:port"`` (``[v6]:port``) or ``None``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _check_target(target: Any) -> None:
    if not isinstance(target, str):
        raise TypeError("target_address must be str")


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> Optional[bytearray]:
    """``n`` bytes before ``deadline``, or ``None`` (closed, timed out)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except OSError:
            return None
        if k == 0:
            return None
        got += k
    return buf


def _recv_payload(sock: socket.socket, n: int, deadline: float) -> Optional[bytes]:
    """``n`` bytes before ``deadline``, read in pieces: memory grows only with the bytes
    that arrive, never with what a header announces."""
    parts: List[bytes] = []
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            piece = sock.recv(min(n - got, 1 << 20))
        except OSError:
            return None
        if not piece:
            return None
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def _deadline(timeout_s: float, nbytes: int) -> float:
    # Mooncake's transfer rule: the timeout plus 1 ns per byte.
    return time.monotonic() + timeout_s + nbytes * 1e-9


class ReceivedData:
    """A received message (Mooncake's type; its data callback gets a ``dict``)."""

    __slots__ = ("_source", "_data")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("mooncake.engine.ReceivedData: No constructor defined!")

    @classmethod
    def _new(cls, source: str, data: bytes) -> "ReceivedData":
        self = object.__new__(cls)
        self._source, self._data = source, data
        return self

    @property
    def source_address(self) -> str:
        return self._source

    @property
    def data_size(self) -> int:
        return len(self._data)

    def get_bytes(self) -> bytes:
        return self._data

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)


class ReceivedTensor:
    """What the tensor callback gets: the whole message, with the header's shape and
    dtype name. ``total_bytes`` is 0, as Mooncake leaves it."""

    __slots__ = ("_source", "_data", "_shape", "_dtype")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("mooncake.engine.ReceivedTensor: No constructor defined!")

    @classmethod
    def _new(cls, source: str, data: bytes, shape: List[int], dtype: str) -> "ReceivedTensor":
        self = object.__new__(cls)
        self._source, self._data, self._shape, self._dtype = source, data, shape, dtype
        return self

    @property
    def source_address(self) -> str:
        return self._source

    @property
    def shape(self) -> List[int]:
        return list(self._shape)

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def total_bytes(self) -> int:
        return 0

    def get_data_size(self) -> int:
        return len(self._data)

    def get_data_as_bytes(self) -> bytes:
        return self._data

    def get_memory_view(self) -> memoryview:
        return memoryview(self._data)


def _as_tensor(data: bytes) -> Optional[Tuple[List[int], str]]:
    """Mooncake's receive-side test: does the message start like a tensor header?"""
    if len(data) < _TENSOR_HEADER:
        return None
    dtype, ndim = struct.unpack_from("<II", data, 0)
    if not (0 < dtype <= 9 and ndim <= 4):
        return None
    dims = struct.unpack_from("<4q", data, 8)[:ndim]
    return [d for d in dims if d > 0], _DTYPE_NAMES[dtype]


def _tensor_bytes(tensor: Any) -> Optional[bytes]:
    """The bytes of a host tensor (duck-typed as Mooncake: data_ptr, numel,
    element_size, shape, dtype), or ``None``. Only memory that is mapped read-write in
    this process is read."""
    if not all(hasattr(tensor, a) for a in ("data_ptr", "numel", "element_size", "shape", "dtype")):
        log.error("send_tensor: input is not a valid tensor object (missing required attributes)")
        return None
    device = getattr(tensor, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        log.error("send_tensor: %s memory is not supported by this build", device)
        return None
    ptr, n = int(tensor.data_ptr()), int(tensor.numel()) * int(tensor.element_size())
    if n == 0:
        return b""
    if not _native._host_rw(ptr, n):
        log.error("send_tensor: [%#x, +%d) is not readable memory of this process", ptr, n)
        return None
    import ctypes

    return ctypes.string_at(ptr, n)


class _Server:
    """The listening side: one accept thread, one thread per connection (at most
    ``_MAX_CONNECTIONS``), callbacks run on the connection's thread."""

    def __init__(self, owner: "RpcInterface", sock: socket.socket, idle_s: float) -> None:
        self.owner, self.sock, self.idle_s = owner, sock, idle_s
        self.stop = threading.Event()
        self.conns: Dict[int, socket.socket] = {}
        self.lock = threading.Lock()
        self.refusals = 0
        self.thread = threading.Thread(target=self._accept, name="pagewire-rpc-accept", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.2)
                if not ready:
                    continue
                conn, _ = self.sock.accept()
            except OSError:
                if self.stop.is_set():
                    return
                continue
            with self.lock:
                full = len(self.conns) >= _MAX_CONNECTIONS
                if not full:
                    self.conns[id(conn)] = conn
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="pagewire-rpc-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        token = _token()
        limit = _max_bytes()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self.stop.is_set():
                head = _recv_exact(conn, _HEAD.size, time.monotonic() + self.idle_s)
                if head is None:
                    return
                magic, version, tlen, n = _HEAD.unpack(head)
                if magic != _MAGIC or version != _VERSION or tlen > _MAX_TOKEN:
                    return  # not a pagewire RPC client: close without a word
                got = _recv_exact(conn, tlen, _deadline(self.idle_s, 0)) if tlen else bytearray()
                if got is None:
                    return
                if token and not hmac.compare_digest(bytes(got), token):
                    self._refuse(conn, _BAD_TOKEN, "token mismatch")
                    return
                if n > limit:
                    self._refuse(conn, _TOO_BIG, f"message of {n} bytes exceeds {limit}")
                    return
                data = _recv_payload(conn, n, _deadline(self.idle_s, n))
                if data is None:
                    return
                self.owner._deliver(data)
                conn.sendall(bytes([_OK]))
        except OSError:
            pass
        finally:
            with self.lock:
                self.conns.pop(id(conn), None)
            conn.close()

    def _refuse(self, conn: socket.socket, code: int, why: str) -> None:
        self.refusals += 1
        # Logged at 1, 2, 4, 8...: a stranger cannot flood the log.
        if self.refusals & (self.refusals - 1) == 0:
            log.warning("rpc server: refused a client (%s; %d refusals)", why, self.refusals)
        try:
            conn.sendall(bytes([code]))
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join(timeout=1.0)


class RpcInterface:
    """Mooncake's ``RpcInterface``: see the module's documentation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._config: Optional[Tuple[str, int, int, int]] = None
        self._server: Optional[_Server] = None
        self._stopped = threading.Event()
        self._data_cb: Optional[Callable[..., Any]] = None
        self._tensor_cb: Optional[Callable[..., Any]] = None
        self._pool: Dict[Tuple[str, int], List[socket.socket]] = {}
        self._async = threading.BoundedSemaphore(_MAX_ASYNC)

    # ------------------------------------------------------------------ set-up

    def initialize(self, listen_address: str = "", thread_count: int = 0,
                   timeout_seconds: int = 30, pool_size: int = 100) -> bool:
        """Stores the configuration (the address is parsed by ``start_server*``); True."""
        for name, v in (("thread_count", thread_count), ("timeout_seconds", timeout_seconds),
                        ("pool_size", pool_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TypeError(f"initialize(): {name} must be a non-negative int")
        if not isinstance(listen_address, str):
            raise TypeError("initialize(): listen_address must be str")
        self.stop_server()
        with self._lock:
            self._config = (listen_address, thread_count, timeout_seconds, pool_size)
            self._drop_pool()
        return True

    def initialize_client(self, pool_size: int = 100, timeout_seconds: int = 30) -> bool:
        return self.initialize("", 0, timeout_seconds, pool_size)

    def initialize_server(self, listen_address: str, thread_count: int = 8,
                          timeout_seconds: int = 30) -> bool:
        return self.initialize(listen_address, thread_count, timeout_seconds, 4)

    def start_server_async(self) -> bool:
        """Binds and listens; False without a listen address, when it does not parse or
        bind, or when the server already runs."""
        with self._lock:
            if self._config is None or not self._config[0] or self._server is not None:
                return False
            address, _, timeout_s, _ = self._config
            parsed = _split(address)
            if parsed is None:
                log.error("start_server: cannot parse listen address %r", address)
                return False
            try:
                infos = socket.getaddrinfo(parsed[0], parsed[1], type=socket.SOCK_STREAM)
                family, _, _, _, sockaddr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    # A restarted server binds past its old connections' TIME_WAIT.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(sockaddr)
                    sock.listen(128)
                except OSError:
                    sock.close()
                    raise
            except OSError as e:
                log.error("start_server: %s: %s", address, e)
                return False
            self._stopped.clear()
            self._server = _Server(self, sock, float(max(timeout_s, 1)))
            return True

    def start_server(self) -> bool:
        """Starts the server and blocks until ``stop_server`` (the GIL is released
        meanwhile; Mooncake's holds it). False if it cannot start."""
        if not self.start_server_async():
            return False
        self._stopped.wait()
        return True

    def stop_server(self) -> None:
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
        self._stopped.set()

    def set_data_receive_callback(self, callback: Callable[..., Any], /) -> None:
        if not callable(callback):
            raise TypeError("set_data_receive_callback(): the argument must be callable")
        self._data_cb = callback

    def set_tensor_receive_callback(self, callback: Callable[..., Any], /) -> None:
        if not callable(callback):
            raise TypeError("set_tensor_receive_callback(): the argument must be callable")
        self._tensor_cb = callback

    # ------------------------------------------------------------------ receiving

    def _deliver(self, data: bytes) -> None:
        data_cb, tensor_cb = self._data_cb, self._tensor_cb
        if data_cb is None:
            return  # as Mooncake: nothing is delivered before a data callback is set
        tensor = _as_tensor(data)
        try:
            if tensor is None:
                data_cb({"source": "", "data": data})
            elif tensor_cb is not None:
                tensor_cb(ReceivedTensor._new("", data, tensor[0], tensor[1]))
            else:
                log.warning("rpc server: a tensor arrived and no tensor callback is set")
        except Exception as e:  # noqa: BLE001 - Mooncake logs a raising callback
            log.error("rpc server: error in receive callback: %r", e)

    # ------------------------------------------------------------------ sending

    def send_data(self, target_address: str, data: bytes) -> int:
        """Sends ``data`` (``bytes`` only); 0 once the server ran its callback, -1 on
        any failure (not initialized, unreachable, refused, past the deadline)."""
        _check_target(target_address)
        if not isinstance(data, bytes):
            raise TypeError(f"Object of type '{type(data).__name__}' is not an instance of 'bytes'")
        return self._send(target_address, data)

    def send_tensor(self, target_address: str, tensor: Any) -> int:
        """Sends a host tensor's bytes (see the module documentation); -1 for an object
        that is not a tensor or not in host memory."""
        _check_target(target_address)
        data = _tensor_bytes(tensor)
        return -1 if data is None else self._send(target_address, data)

    def send_data_async(self, target_address: str, data: Any, loop: Any) -> Any:
        """``send_data`` in a thread: a future of ``loop`` that gets 0, or a
        ``RuntimeError``."""
        _check_target(target_address)
        if not isinstance(data, bytes):
            data = bytes(data)
        return self._in_thread(loop, lambda: self._send(str(target_address), data), "Send data failed")

    def send_tensor_async(self, target_address: str, tensor: Any, loop: Any) -> Any:
        _check_target(target_address)
        # As Mooncake: the tensor's attributes are read now (AttributeError if absent).
        for a in ("data_ptr", "numel", "element_size", "shape", "dtype"):
            getattr(tensor, a)
        data = _tensor_bytes(tensor)

        def run() -> int:
            return -1 if data is None else self._send(str(target_address), data)

        return self._in_thread(loop, run, "Send tensor failed")

    def _in_thread(self, loop: Any, fn: Callable[[], int], failed: str) -> Any:
        fut = loop.create_future()

        def settle(rc: int) -> None:
            if fut.done():
                return
            if rc >= 0:
                fut.set_result(rc)
            else:
                fut.set_exception(RuntimeError(failed))

        if not self._async.acquire(blocking=False):
            fut.set_exception(RuntimeError(f"{failed}: {_MAX_ASYNC} sends already in flight"))
            return fut

        def run() -> None:
            try:
                rc = fn()
            except Exception:  # noqa: BLE001 - a failed send
                rc = -1
            finally:
                self._async.release()
            try:
                loop.call_soon_threadsafe(settle, rc)
            except RuntimeError:
                pass  # the loop is closed: nobody waits

        threading.Thread(target=run, name="pagewire-rpc-send", daemon=True).start()
        return fut

    def _send(self, target: str, data: bytes) -> int:
        with self._lock:
            config = self._config
        if config is None:
            log.error("send_data: the interface is not initialized")
            return -1
        timeout_s, pool_size = float(max(config[2], 1)), config[3]
        parsed = _split(target)
        if parsed is None:
            log.error("send_data: cannot parse target address %r", target)
            return -1
        deadline = _deadline(timeout_s, len(data))
        sock = self._take(parsed)
        try:
            if sock is None:
                sock = socket.create_connection(parsed, timeout=max(deadline - time.monotonic(), 0.001))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            token = _token()
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(_HEAD.pack(_MAGIC, _VERSION, len(token), len(data)) + token)
            if data:
                sock.sendall(data)
            reply = _recv_exact(sock, 1, deadline)
        except OSError as e:
            log.error("send_data to %s: %s", target, e)
            if sock is not None:
                sock.close()
            return -1
        if reply is None or reply[0] != _OK:
            why = {None: "no reply", _BAD_TOKEN: "token mismatch", _TOO_BIG: "message too large"}
            log.error("send_data to %s: %s", target, why.get(None if reply is None else reply[0], "refused"))
            sock.close()
            return -1
        self._give_back(parsed, sock, pool_size)
        return 0

    # A small pool of idle connections per target (Mooncake's client pool).

    def _take(self, key: Tuple[str, int]) -> Optional[socket.socket]:
        while True:
            with self._lock:
                idle = self._pool.get(key)
                sock = idle.pop() if idle else None
            if sock is None:
                return None
            # A pooled connection the server closed meanwhile is readable (EOF): drop it.
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return sock
            sock.close()

    def _give_back(self, key: Tuple[str, int], sock: socket.socket, pool_size: int) -> None:
        with self._lock:
            idle = self._pool.setdefault(key, [])
            if len(idle) < max(pool_size, 1) and len(self._pool) <= 1024:
                idle.append(sock)
                return
        sock.close()

    def _drop_pool(self) -> None:
        for idle in self._pool.values():
            for s in idle:
                s.close()
        self._pool.clear()

    def __del__(self) -> None:
        try:
            self.stop_server()
            with self._lock:
                self._drop_pool()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


#: Mooncake's name for the same class.
CoroRPCInterface = RpcInterface


def create_rpc_client(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """An initialized client (Mooncake's defaults: timeout 30 s, pool of 10)."""
    r = RpcInterface()
    r.initialize("", 0, 30, 10)
    return r


def create_rpc_server(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    """An interface initialized to listen on ``0.0.0.0:8080`` (Mooncake's default);
    call ``initialize_server`` with your own address before ``start_server*``."""
    r = RpcInterface()
    r.initialize("0.0.0.0:8080", 0, 30, 10)
    return r


# Named where callers import them from (reprs, pickling, the hook's mooncake.engine).
for _o in (RpcInterface, ReceivedData, ReceivedTensor, create_rpc_client, create_rpc_server):
    _o.__module__ = "pagewire.mooncake_compat"
