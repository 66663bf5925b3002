"""The smaller names of ``mooncake.store`` on pagewire: enums, the replica and task
descriptions, buffer handles and pools, the host allocator and the process helpers.
:mod:`pagewire._mooncake_store` holds the store class; :mod:`pagewire.mooncake_store`
exports both, as ``mooncake.store`` does.

>>> ReplicaStatus.COMPLETE.value, TaskStatus.SUCCESS.value, TaskType.REPLICA_MOVE.value
(3, 3, 1)
>>> parse_size("16MB"), parse_size(" 1.5 k"), parse_size("16XB")
(16777216, 1536, None)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import logging
import mmap
import operator
import os
import threading
import time
from typing import Any, Dict, List, Optional

_log = logging.getLogger("pagewire.mooncake_compat")

_KIB = 1024


class ReplicaStatus(enum.IntEnum):
    """A replica's state on the master (Mooncake's values)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskStatus(enum.IntEnum):
    """A replica task's state (Mooncake's values)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class TaskType(enum.IntEnum):
    """A replica task's kind (Mooncake's values)."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


_UNITS = {
    "": 1, "B": 1,
    "K": _KIB, "KB": _KIB,
    "M": _KIB**2, "MB": _KIB**2,
    "G": _KIB**3, "GB": _KIB**3,
    "T": _KIB**4, "TB": _KIB**4,
}  # fmt: skip


def parse_size(value: Any) -> Optional[int]:
    """A size as ``setup``'s config dict takes it: an int, or a string with an optional
    binary unit (``"16MB"``, ``"1.5 GB"``, ``"4096"``, case-insensitive); ``None`` when it
    is neither (Mooncake's rule, so the same dicts pass and fail)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    s = str(value).strip()
    i = 0
    while i < len(s) and (s[i].isdigit() or s[i] == "."):
        i += 1
    try:
        number = float(s[:i])
    except ValueError:
        return None
    mult = _UNITS.get(s[i:].strip().upper())
    if mult is None or number < 0:
        return None
    return int(number * mult)


# ---------------------------------------------------------------------- descriptions


class Descriptor:
    """Where a memory replica lies: ``buffer_address`` in ``transport_endpoint``'s
    segment, ``size`` bytes."""

    __slots__ = ("buffer_address", "size", "transport_endpoint")

    def __init__(self) -> None:
        self.buffer_address = 0
        self.size = 0
        self.transport_endpoint = ""

    def __repr__(self) -> str:
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


class MemoryDescriptor:
    """A memory replica: its ``buffer_descriptor``."""

    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Optional[Descriptor] = None) -> None:
        self.buffer_descriptor = buffer_descriptor if buffer_descriptor is not None else Descriptor()


class DiskDescriptor:
    """A disk replica (pagewire's store has none; the class exists for ``isinstance``)."""

    __slots__ = ("file_path", "object_size")

    def __init__(self) -> None:
        self.file_path = ""
        self.object_size = 0


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` lists them. pagewire's replicas
    are all in memory and complete."""

    __slots__ = ("_memory", "status")

    def __init__(self, memory: MemoryDescriptor, status: ReplicaStatus = ReplicaStatus.COMPLETE) -> None:
        self._memory = memory
        self.status = status

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("Expected DiskDescriptor")


class QueryTaskResponse:
    """A replica task as ``query_task`` describes it (pagewire's master runs no tasks)."""

    __slots__ = ("id", "type", "status", "message", "assigned_client",
                 "created_at_ms_epoch", "last_updated_at_ms_epoch")  # fmt: skip

    def __init__(self) -> None:
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.message = ""
        self.assigned_client = (0, 0)
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0


class ParallelAxis:
    """One axis of a tensor shard's identity (``kind`` is ``"tp"``, ``"dp"``, ``"ep"`` or
    ``"pp"``)."""

    __slots__ = ("kind", "rank", "size", "split_dim", "expert_id", "stage_id")

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: Optional[int] = None
        self.expert_id: Optional[int] = None
        self.stage_id: Optional[int] = None


class TensorParallelism:
    """The ordered ``axes`` that identify a tensor shard."""

    __slots__ = ("axes",)

    def __init__(self) -> None:
        self.axes: List[ParallelAxis] = []


class ReadTarget:
    """What a tensor read materialises: ``mode`` ``"as_stored"``, ``"shard"`` or
    ``"full"``."""

    __slots__ = ("_mode", "parallelism")

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: Optional[TensorParallelism] = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        # As Mooncake's: any case is accepted and kept lower-case; another mode raises.
        mode = str(value).lower()
        if mode not in ("as_stored", "shard", "full"):
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = mode


class EngramStoreConfig:
    """An Engram embedding table's shape (Mooncake's defaults)."""

    __slots__ = ("embedding_dim", "table_vocab_sizes")

    def __init__(self) -> None:
        self.embedding_dim = 64
        self.table_vocab_sizes: List[int] = [1024]


class EngramStore:
    """Mooncake's Engram embedding store: not provided by pagewire (docs/python.md)."""

    def __init__(self, layer_id: int, config: EngramStoreConfig, store: object = None) -> None:
        raise NotImplementedError("pagewire does not provide mooncake.store.EngramStore")

    def get_embedding_dim(self) -> int:  # pragma: no cover - no instance exists
        raise NotImplementedError

    def get_num_heads(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def get_store_keys(self) -> List[str]:  # pragma: no cover
        raise NotImplementedError

    def get_table_vocab_sizes(self) -> List[int]:  # pragma: no cover
        raise NotImplementedError

    def lookup(self, row_ids: object) -> Any:  # pragma: no cover
        raise NotImplementedError

    def populate(self, embedding_buffers: list) -> None:  # pragma: no cover
        raise NotImplementedError

    def remove_from_store(self, force: bool = False) -> int:  # pragma: no cover
        raise NotImplementedError


class MooncakeDistributedNoFRegister:
    """NVMe-oF segment registration: needs Mooncake's NoF build; as in the non-CUDA
    wheel, both calls return ``-1``."""

    def __init__(self) -> None:
        pass

    def real_register(self, arg0: str, arg1: int, arg2: str, arg3: int, arg4: int, arg5: int, arg6: str, /) -> int:
        return -1

    def real_unregister_by_endpoint(self, arg0: str, arg1: int, arg2: str, arg3: int, arg4: str, /) -> int:
        return -1


# ---------------------------------------------------------------------- buffers


class BufferHandle(bytearray):
    """An object's bytes as ``get_buffer`` returns them: a buffer (``memoryview(h)``,
    ``numpy.asarray(h)``) with ``ptr()`` and ``size()``. pagewire's is a private copy,
    not a slice of the store's buffer, so it stays valid as long as it is referenced."""

    __slots__ = ("_view",)

    def __init__(self, data: Any = b"") -> None:
        super().__init__(data)
        # The export pins the storage: a bytearray with an export cannot be resized, so
        # ptr() stays valid.
        self._view = (ctypes.c_char * max(len(self), 1)).from_buffer(self) if len(self) else None

    def ptr(self) -> int:
        return ctypes.addressof(self._view) if self._view is not None else 0

    def size(self) -> int:
        return len(self)


class _Region:
    """An anonymous mapping registered with a store client."""

    def __init__(self, store: Any, size: int) -> None:
        self.size = size
        self.mem = mmap.mmap(-1, size)
        self.view = (ctypes.c_char * size).from_buffer(self.mem)
        self.addr = ctypes.addressof(self.view)
        self.store = store
        rc = store.register_buffer(self.addr, size)
        if rc != 0:
            del self.view
            self.mem.close()
            raise RuntimeError(f"register_buffer failed ({rc})")

    def close(self) -> None:
        try:
            self.store.unregister_buffer(self.addr)
        except Exception:  # a closed store dropped its registrations already
            pass
        del self.view
        self.mem.close()


class BufferLeaseView:
    """The ``buffer`` side of a lease (Mooncake exposes the type; leases carry it)."""

    __slots__ = ("_lease",)

    def __init__(self, lease: "BufferLease") -> None:
        self._lease = lease

    @property
    def buffer(self) -> memoryview:
        return self._lease.buffer


class BufferLease:
    """A registered buffer of ``size`` bytes at ``ptr`` lent by a :class:`BufferPool`
    until :meth:`release` (or the end of a ``with`` block); ``buffer`` is a writable
    memoryview of it."""

    __slots__ = ("_pool", "_region", "_size")

    def __init__(self, pool: "BufferPool", region: _Region, size: int) -> None:
        self._pool, self._region, self._size = pool, region, size

    def _live(self) -> _Region:
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        return self._region

    @property
    def ptr(self) -> int:
        return self._live().addr

    @property
    def size(self) -> int:
        self._live()
        return self._size

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._live().mem)[: self._size]

    def release(self) -> None:
        region, self._region = self._region, None
        if region is not None:
            self._pool._give_back(region, self._size)

    def __enter__(self) -> "BufferLease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


#: How long an ``acquire`` without a timeout waits for a release (seconds): pagewire
#: bounds every wait (Mooncake's waits without end).
POOL_WAIT = 30.0


class BufferPool:
    """Registered buffers for zero-copy calls, with Mooncake's accounting: the pool lends
    at most ``max_bytes`` at a time (at least the store's ``local_buffer_size``; ``0``:
    twice that), counted by the sizes asked for; a request larger than that raises
    ``RuntimeError`` (``max_size_class`` is accepted: Mooncake only counts larger ones). When it is reached, ``acquire`` waits for
    a release (``block``, default ``block_on_exhaustion``) up to ``timeout`` (default
    ``default_timeout``, else :data:`POOL_WAIT`) or raises ``RuntimeError``. Released
    buffers are kept (up to ``max_bytes`` of them) and reused by power-of-two size class
    from ``min_size_class``; they are page-aligned (``alignment`` is accepted)."""

    def __init__(
        self,
        store: object,
        max_bytes: int = 0,
        min_size_class: int = 65536,
        max_size_class: object = None,
        alignment: int = 8388608,
        block_on_exhaustion: bool = True,
        default_timeout: object = None,
        max_regions: object = None,
        prewarm_size: object = None,
        prewarm_count: int = 0,
    ) -> None:
        if store is None or getattr(store, "_client", None) is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        local = store._staging.size  # type: ignore[attr-defined]
        self._store = store
        self._capacity = max(int(max_bytes), local) if int(max_bytes) else 2 * local
        self._min_class = max(int(min_size_class), mmap.PAGESIZE)
        self._block = bool(block_on_exhaustion)
        self._timeout = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else int(max_regions)
        self._idle: Dict[int, List[_Region]] = {}
        self._idle_bytes = 0
        self._lent_bytes = 0
        self._lent = 0
        self._closed = False
        self._cond = threading.Condition()
        if prewarm_size is not None and prewarm_count:
            self.prewarm(int(prewarm_size), int(prewarm_count))

    def _class_of(self, size: int) -> int:
        c = self._min_class
        while c < size:
            c <<= 1
        return c

    def _fits(self, size: int) -> bool:
        if self._lent_bytes + size > self._capacity:
            return False
        return self._max_regions is None or self._lent < self._max_regions

    def _take(self, size: int, block: Any, timeout: Any) -> _Region:
        size = operator.index(size)
        if size < 0:
            raise TypeError(f"acquire(): size is an unsigned integer, not {size}")
        need = max(size, 1)
        if need > self._capacity:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        block = self._block if block is None else bool(block)
        wait = self._timeout if timeout is None else float(timeout)
        if wait is not None and wait < 0:
            raise RuntimeError("timeout must be non-negative")
        deadline = time.monotonic() + (POOL_WAIT if wait is None else wait)
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                if self._fits(need):
                    break
                if not block:
                    raise RuntimeError("buffer pool is exhausted")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)
            self._lent_bytes += need
            self._lent += 1
            cls = self._class_of(need)
            idle = self._idle.get(cls)
            if idle:
                self._idle_bytes -= cls
                return idle.pop()
        try:
            return _Region(self._store, cls)
        except Exception:
            self._returned(need)
            raise

    def _returned(self, need: int) -> None:
        self._lent_bytes -= need
        self._lent -= 1
        self._cond.notify_all()

    def _give_back(self, region: _Region, size: int) -> None:
        with self._cond:
            self._returned(max(size, 1))
            keep = not self._closed and self._idle_bytes + region.size <= self._capacity
            if keep:
                self._idle.setdefault(region.size, []).append(region)
                self._idle_bytes += region.size
        if not keep:
            region.close()

    def acquire(self, size: int, block: object = None, timeout: object = None) -> BufferLease:
        return BufferLease(self, self._take(size, block, timeout), int(size))

    def buffer(self, size: int, block: object = None, timeout: object = None) -> BufferLease:
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Maps ``count`` buffers for requests of ``size`` bytes ahead of use (as many as
        the pool's limits allow)."""
        leases = []
        try:
            for _ in range(int(count)):
                leases.append(self.acquire(size, False))
        except RuntimeError:
            pass
        for lease in leases:
            lease.release()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = [r for rs in self._idle.values() for r in rs]
            self._idle.clear()
            self._idle_bytes = 0
            self._cond.notify_all()
        for r in idle:
            r.close()


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def get_alloc_func_addr() -> int:
    """The address of a C allocation function for a pluggable allocator (e.g.
    ``torch.cuda.memory.CUDAPluggableAllocator``): libc's ``malloc``. On x86-64 and
    AArch64 the allocator's extra arguments (device, stream) are ignored by the callee."""
    return ctypes.cast(_libc().malloc, ctypes.c_void_p).value or 0


def get_free_func_addr() -> int:
    """The matching free function: libc's ``free`` (its extra arguments are ignored)."""
    return ctypes.cast(_libc().free, ctypes.c_void_p).value or 0


def bind_to_numa_node(node: int) -> None:
    """Binds the calling thread to the CPUs of NUMA node ``node`` (from sysfs); a node
    that does not exist changes nothing (logged), as in Mooncake."""
    path = f"/sys/devices/system/node/node{int(node)}/cpulist"
    try:
        with open(path) as f:
            spec = f.read().strip()
    except OSError:
        _log.warning("bind_to_numa_node: no NUMA node %s", node)
        return None
    cpus = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            _log.warning("bind_to_numa_node(%s): %s", node, e)
    return None
