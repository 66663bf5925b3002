"""Shared by the store tests: a master in this process, storage nodes as processes, and
buffers whose addresses the store can use."""

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np

from pagewire import StoreMaster

HERE = Path(__file__).resolve().parent


class Node:
    """A storage node process (store_node.py)."""

    def __init__(self, master: str, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "store_node.py"), master, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), f"storage node did not start: {line!r}"
        self.endpoint = line.split()[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """A master here and ``nodes`` storage node processes of ``segment`` bytes each."""

    def __init__(self, nodes: int = 1, segment: int = 64 << 20, lease_ttl: float = 10.0) -> None:
        self.master = StoreMaster("127.0.0.1:0", lease_ttl=lease_ttl)
        self.address = self.master.address
        self.nodes = [Node(self.address, segment) for _ in range(nodes)]

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        self.master.shutdown()


def buffer(nbytes: int, fill: int = 0) -> np.ndarray:
    """Page-aligned memory (a numpy array) of ``nbytes``."""
    a = np.full(nbytes + 4096, fill, dtype=np.uint8)
    off = (-a.ctypes.data) % 4096
    return a[off : off + nbytes]


def addr(a: np.ndarray) -> int:
    return a.ctypes.data


def read(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)
