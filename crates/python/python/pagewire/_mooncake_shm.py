"""Mooncake's ``SharedSegment``: host memory one rank allocates and every rank of a group
maps (POSIX shared memory, ``/dev/shm``).

Two phases, as in Mooncake: every rank calls ``SharedSegment.create(name, size,
world_size, rank_id, owner_rank)`` and gets ``(segment, blob)``; the caller all-gathers
the blobs and every rank calls ``segment.complete(blobs)`` (indexed by rank). The owner
creates the memory in ``create``; the others map it in ``complete``, after checking that
every rank declared the same name, size, world size and owner. The memory lives until
the owner's segment is collected (the name is unlinked then) and the last mapping goes.

The blob is pagewire's own (not Mooncake's bytes): ``PWSS``, a version, the rank, a
fingerprint of the declaration, and (the owner's) the shared memory's name. A blob from
another process is checked before it is used: length, magic, rank, fingerprint, and a
name of pagewire's own form (no other file is opened).

Only the ``mmap=True`` host path exists in this build, as in the non-CUDA wheel:
``mmap=False`` (a VMM fabric) and ``host_register=True`` (Ascend) raise
``RuntimeError``. ``device_addr()`` is 0. Differences: a non-owner's ``base_addr()`` is
0 until ``complete`` (Mooncake reserves the address range in ``create``).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap as _mmap
import os
import re
import secrets
import struct
from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["SharedSegment"]

_MAGIC = b"PWSS"
_VERSION = 1
_NAME_LEN = 48
#: magic, version, rank, world size, owner rank, size, fingerprint, shm name.
_BLOB = struct.Struct(f"<4sHIIIQ8s{_NAME_LEN}s")
_NAME_RE = re.compile(rb"/pwss_[0-9]+_[0-9a-f]{16}")
_MAX_SIZE = 1 << 46
_SHM_DIR = "/dev/shm"


def _err(kind: str, msg: str) -> RuntimeError:
    return RuntimeError(f"{kind}: {msg}")


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(f"SharedSegment.create(): {what} must be a non-negative int")
    return v


class SharedSegment:
    """See the module documentation."""

    __slots__ = ("_name", "_size", "_world", "_rank", "_owner", "_fp", "_shm", "_map",
                 "_view", "_ready", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("mooncake.engine.SharedSegment: No constructor defined!")

    @staticmethod
    def supported(mmap: bool = True, host_register: bool = False) -> bool:
        """Whether this build can share memory across processes: the mmap path without
        HostRegister only."""
        return bool(mmap) and not host_register

    @staticmethod
    def create(name: str, size: int, world_size: int, rank_id: int, owner_rank: int = 0,
               device_id: int = 0, mmap: bool = True,
               host_register: bool = False) -> Tuple["SharedSegment", bytes]:
        """Phase one; returns (segment, blob)."""
        if not isinstance(name, str):
            raise TypeError("SharedSegment.create(): name must be str")
        size, world_size = _int(size, "size"), _int(world_size, "world_size")
        rank_id, owner_rank = _int(rank_id, "rank_id"), _int(owner_rank, "owner_rank")
        if not (0 < size <= _MAX_SIZE):
            raise _err("InvalidArgument", f"Shared segment size must be in (0, {_MAX_SIZE}]")
        if world_size == 0:
            raise _err("InvalidArgument", "Shared segment world_size must not be zero")
        if rank_id >= world_size or owner_rank >= world_size:
            raise _err("InvalidArgument",
                       "Shared segment rank_id and owner_rank must be below world_size")
        if not mmap:
            raise _err("NotImplemented", "This build has no VMM backend for shared segments")
        if host_register:
            raise _err("NotImplemented", "Shared segment mmap needs Ascend for HostRegister")
        seg = object.__new__(SharedSegment)
        seg._name, seg._size, seg._world = name, size, world_size
        seg._rank, seg._owner = rank_id, owner_rank
        seg._fp = hashlib.blake2b(f"{name}\0{size}\0{world_size}\0{owner_rank}".encode(),
                                  digest_size=8).digest()
        seg._shm, seg._map, seg._view, seg._ready = b"", None, None, False
        if rank_id == owner_rank:
            seg._shm = f"/pwss_{os.getpid()}_{secrets.token_hex(8)}".encode()
            path = _SHM_DIR + seg._shm.decode()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)  # sparse: no page is touched here
                seg._attach(fd)
            except OSError as e:
                os.unlink(path)
                raise _err("InternalError", f"Shared segment {name}: {e}") from e
            finally:
                os.close(fd)
        blob = _BLOB.pack(_MAGIC, _VERSION, rank_id, world_size, owner_rank, size, seg._fp,
                          seg._shm)
        return seg, blob

    def _attach(self, fd: int) -> None:
        self._map = _mmap.mmap(fd, self._size, _mmap.MAP_SHARED,
                               _mmap.PROT_READ | _mmap.PROT_WRITE)
        # Its address; the ctypes object lives as long as the mapping.
        self._view = ctypes.c_char.from_buffer(self._map)

    def complete(self, blobs: Sequence[Any]) -> None:
        """Phase two; blobs are indexed by rank."""
        if self._ready:
            raise _err("InvalidArgument", "SharedSegment::Complete has already been called")
        blobs = list(blobs)
        if len(blobs) != self._world:
            raise _err("InvalidArgument",
                       f"Shared segment expects one blob per rank, got {len(blobs)}")
        owner_shm: Optional[bytes] = None
        for i, b in enumerate(blobs):
            if isinstance(b, str):
                b = b.encode()
            if not isinstance(b, (bytes, bytearray)):
                raise TypeError("SharedSegment.complete(): blobs must be bytes or str")
            if len(b) != _BLOB.size:
                raise _err("InvalidArgument", "Shared segment blob has an unexpected length")
            magic, version, rank, world, owner, size, fp, shm = _BLOB.unpack(bytes(b))
            if magic != _MAGIC or version != _VERSION or rank != i:
                raise _err("InvalidArgument", f"Shared segment blob of rank {i} is malformed")
            if fp != self._fp or (world, owner, size) != (self._world, self._owner, self._size):
                raise _err("InvalidArgument",
                           f"Shared segment declaration of rank {i} differs from the local one")
            if i == self._owner:
                owner_shm = shm.rstrip(b"\0")
        if self._rank != self._owner:
            if owner_shm is None or not _NAME_RE.fullmatch(owner_shm):
                raise _err("InvalidArgument",
                           f"Shared segment blob of rank {self._owner} names no segment")
            try:
                fd = os.open(_SHM_DIR + owner_shm.decode(), os.O_RDWR | os.O_NOFOLLOW)
            except OSError as e:
                raise _err("InternalError", f"Shared segment {self._name}: {e}") from e
            try:
                if os.fstat(fd).st_size < self._size:
                    raise _err("InvalidArgument",
                               f"Shared segment {self._name}: the owner's memory is too small")
                self._attach(fd)
            finally:
                os.close(fd)
        self._ready = True

    def ready(self) -> bool:
        return self._ready

    def base_addr(self) -> int:
        """The address of the memory in this process (0 on a non-owner before
        ``complete``)."""
        return 0 if self._view is None else ctypes.addressof(self._view)

    def device_addr(self) -> int:
        """0: this build maps no device memory."""
        return 0

    def size(self) -> int:
        return self._size

    def __del__(self) -> None:
        try:
            if self._rank == self._owner and self._shm:
                os.unlink(_SHM_DIR + self._shm.decode())
        except (OSError, AttributeError):
            pass


# Named where callers import them from (reprs, pickling, the hook's mooncake.engine).
for _o in (SharedSegment,):
    _o.__module__ = "pagewire.mooncake_compat"
