"""A transfer engine in a child process, driven over stdin/stdout, for tests that need
two processes (and for checking bytes on the receiving side, in the receiver).

``python peer_proc.py IMPL PROTOCOL SIZE`` starts an engine (``IMPL``: ``pagewire`` for
pagewire.mooncake_compat, ``mooncake`` for the real Mooncake wheel), registers a
``SIZE``-byte buffer filled with zeros, and prints one JSON line ``{"sid", "addr",
"len", "backend"}``. Then it answers one JSON line per command line:

* ``fill SEED`` - fills its buffer with the pattern ``pattern(SEED, len)``;
* ``digest OFF LEN`` - the SHA-256 of those bytes;
* ``bytes OFF LEN`` - those bytes as hex;
* ``notifies`` - the notifications received so far, ``[[name, msg], ...]``;
* ``waitnote TIMEOUT OFF LEN`` - polls ``get_notifies`` until one arrives (or TIMEOUT
  seconds), then at once the SHA-256 of those bytes: ``{"notifies", "sha256"}``;
* ``write SID PEER_ADDR OFF LEN`` - ``transfer_sync_write`` from its buffer;
* ``quit``.
"""

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time


def pattern(seed: int, n: int) -> bytes:
    """Position- and seed-dependent bytes (a misplaced byte is caught)."""
    out = bytearray()
    block = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{block}".encode()).digest()
        block += 1
    return bytes(out[:n])


class Buf:
    """A ctypes buffer and its address, optionally filled with ``pattern(seed, n)``."""

    def __init__(self, n, seed=None):
        self.n = n
        self.raw = ctypes.create_string_buffer(n)
        self.addr = ctypes.addressof(self.raw)
        if seed is not None:
            ctypes.memmove(self.addr, pattern(seed, n), n)

    def bytes(self, off=0, n=None):
        return ctypes.string_at(self.addr + off, self.n - off if n is None else n)


def _serve(impl: str, protocol: str, size: int) -> None:
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from pagewire.mooncake_compat import TransferEngine
    te = TransferEngine()
    # PEER_METADATA / PEER_NAME: a metadata server (etcd://...) and the segment name there.
    meta = os.environ.get("PEER_METADATA", "P2PHANDSHAKE")
    name = os.environ.get("PEER_NAME", "127.0.0.1")
    rc = te.initialize(name, meta, protocol, os.environ.get("RDMA_DEVICE", ""))
    if rc != 0:
        print(json.dumps({"error": f"initialize returned {rc}"}), flush=True)
        return
    buf = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(buf)
    rc = te.register_memory(addr, size)
    if rc != 0:
        print(json.dumps({"error": f"register_memory returned {rc}"}), flush=True)
        return
    sid = f"127.0.0.1:{te.get_rpc_port()}" if meta == "P2PHANDSHAKE" else name
    backend = getattr(te, "backend", "mooncake")
    print(json.dumps({"sid": sid, "addr": addr, "len": size, "backend": backend}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] == "fill":
            ctypes.memmove(addr, pattern(int(cmd[1]), size), size)
            out = {"ok": True}
        elif cmd[0] == "digest":
            off, n = int(cmd[1]), int(cmd[2])
            out = {"sha256": hashlib.sha256(ctypes.string_at(addr + off, n)).hexdigest()}
        elif cmd[0] == "bytes":
            off, n = int(cmd[1]), int(cmd[2])
            out = {"hex": ctypes.string_at(addr + off, n).hex()}
        elif cmd[0] == "notifies":
            out = {"notifies": [[n.name, n.msg] for n in te.get_notifies()]}
        elif cmd[0] == "waitnote":
            until = time.monotonic() + float(cmd[1])
            off, n = int(cmd[2]), int(cmd[3])
            notes = []
            while not notes and time.monotonic() < until:
                notes = te.get_notifies()
            digest = hashlib.sha256(ctypes.string_at(addr + off, n)).hexdigest()
            out = {"notifies": [[x.name, x.msg] for x in notes], "sha256": digest}
        elif cmd[0] == "write":
            sid_, peer, off, n = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
            out = {"rc": te.transfer_sync_write(sid_, addr + off, peer, n)}
        else:
            out = {"error": f"unknown command {cmd[0]}"}
        print(json.dumps(out), flush=True)


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOPs `pid` and waits until every one of its threads is stopped (the signal is
    asynchronous: a thread may still answer for a moment after `kill` returns)."""
    import signal

    os.kill(pid, signal.SIGSTOP)
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise RuntimeError(f"process {pid} did not stop")


class PeerProcess:
    """The client side: starts ``peer_proc.py`` and sends it commands."""

    def __init__(self, impl: str = "pagewire", protocol: str = "tcp", size: int = 1 << 20, env=None):
        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), impl, protocol, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=e,
        )
        hello = json.loads(self.proc.stdout.readline() or '{"error": "peer exited"}')
        if "error" in hello:
            self.close()
            raise RuntimeError(f"peer process: {hello['error']}")
        self.sid, self.addr, self.len, self.backend = (
            hello["sid"],
            hello["addr"],
            hello["len"],
            hello["backend"],
        )

    def cmd(self, *words) -> dict:
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("peer process exited")
        return json.loads(line)

    def digest(self, off: int, n: int) -> str:
        return self.cmd("digest", off, n)["sha256"]

    def bytes(self, off: int, n: int) -> bytes:
        return bytes.fromhex(self.cmd("bytes", off, n)["hex"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
