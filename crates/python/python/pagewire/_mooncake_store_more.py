"""``MooncakeDistributedStore``'s calls beyond the zero-copy core: the copying batch
calls, upserts, ranged reads and put/get sessions, replica queries, the tensor calls
(their bodies are in :mod:`pagewire._mooncake_tensor`), and the calls that need a
Mooncake build pagewire is not (CUDA IPC reads, file and disk segments, replica tasks),
which answer as the non-CUDA wheel does. A mixin of :class:`pagewire._mooncake_store.
MooncakeDistributedStore`; return codes are Mooncake's (types.h's ``ErrorCode``).

The copying calls go through the store's registered local buffer (``local_buffer_size``
bytes; a larger object gets a registered buffer of its own for the call).
"""

from __future__ import annotations

import ast
import bisect
import ctypes
import inspect
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from pagewire._mooncake_store_types import (
    BufferHandle,
    Descriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaStatus,
)
from pagewire._mooncake_tensor import _StoreTensor
from pagewire._native import StoreError

_log = logging.getLogger("pagewire.mooncake_compat")

_OK = 0
_INTERNAL_ERROR = -1
_INVALID_PARAMS = -600
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_NOT_SUPPORTED = -1012
_FILE_NOT_FOUND = -1100
_TASK_NOT_FOUND = -1400

_NO_TASK = (0, 0)


def _bytes_of(value: Any) -> memoryview:
    return memoryview(value).cast("B")


class _StoreMore(_StoreTensor):
    """The mixin; needs ``_client``, ``_staging``, ``_lock``, ``_put`` and ``_get`` of the
    store class."""

    _client: Any
    _staging: Any

    # ------------------------------------------------------------------ registrations

    def _regions(self) -> Dict[int, int]:
        r = self.__dict__.get("_region_map")
        if r is None:
            r = self.__dict__["_region_map"] = {}
        return r

    def _note_registered(self, ptr: int, size: int) -> None:
        self._regions()[int(ptr)] = int(size)

    def _note_unregistered(self, ptr: int) -> None:
        self._regions().pop(int(ptr), None)

    def _room_at(self, ptr: int) -> int:
        """Bytes from ``ptr`` to the end of the buffer registered around it; 0 outside."""
        regions = self._regions()
        starts = sorted(regions)
        i = bisect.bisect_right(starts, int(ptr)) - 1
        if i < 0:
            return 0
        end = starts[i] + regions[starts[i]]
        return max(end - int(ptr), 0)

    # ------------------------------------------------------------------ copying helpers

    def _fetch(self, keys: List[str]) -> List[Union[bytes, int]]:
        """Each object's bytes, or its negative code (through the local buffer)."""
        from pagewire._mooncake_store import _Staging

        out: List[Union[bytes, int]] = []
        for key in keys:
            try:
                q = self._client.query([key])[0]
            except StoreError as e:
                out.append(e.code)
                continue
            if not isinstance(q, tuple):
                out.append(q)
                continue
            size = q[0]
            with self._lock:
                st, tmp = self._staging, None
                if size > st.size:
                    tmp = st = _Staging(self._client, size)
                try:
                    r = self._get([key], [[st.addr]], [[max(size, 1)]])[0]
                    out.append(bytes(st.mem[:r]) if r >= 0 else r)
                finally:
                    if tmp is not None:
                        tmp.close()
        return out

    def _store_bytes(self, keys: List[str], values: List[Any], config: Any) -> List[int]:
        """Puts each value (bytes-like, or a list of parts concatenated) through the local
        buffer; per key ``0`` or a negative code."""
        from pagewire._mooncake_store import _Staging

        out = []
        for key, value in zip(keys, values):
            parts = value if isinstance(value, list) else [value]
            views = [_bytes_of(p) for p in parts]
            n = sum(len(v) for v in views)
            if n == 0:
                out.append(_INVALID_PARAMS)
                continue
            with self._lock:
                st, tmp = self._staging, None
                if n > st.size:
                    tmp = st = _Staging(self._client, n)
                try:
                    at = 0
                    for v in views:
                        st.mem[at : at + len(v)] = v
                        at += len(v)
                    out.append(self._put([key], [[st.addr]], [[n]], config)[0])
                finally:
                    if tmp is not None:
                        tmp.close()
        return out

    def _drop(self, keys: List[str]) -> None:
        """Removes ``keys`` whatever their leases (for the upserts); missing is fine."""
        try:
            self._client.remove(keys, True)
        except StoreError as e:
            _log.debug("upsert: remove: %s", e)

    # ------------------------------------------------------------------ copying calls

    def get_batch(self, arg0: List[str], /) -> List[bytes]:
        """Each object's bytes, ``b""`` for a missing one. An empty list gives ``[b""]``,
        as Mooncake's does."""
        keys = list(arg0)
        if not keys:
            return [b""]
        if self._client is None:
            return [b""] * len(keys)
        return [r if isinstance(r, bytes) else b"" for r in self._fetch(keys)]

    def get_buffer(self, arg0: str, /) -> Optional[BufferHandle]:
        """The object's bytes as a :class:`BufferHandle`, or ``None`` when it is missing."""
        return self.batch_get_buffer([arg0])[0]

    def batch_get_buffer(self, arg0: List[str], /) -> List[Optional[BufferHandle]]:
        """Per key a :class:`BufferHandle` or ``None``."""
        keys = list(arg0)
        if self._client is None:
            return [None] * len(keys)
        if not keys:
            return []
        return [BufferHandle(r) if isinstance(r, bytes) else None for r in self._fetch(keys)]

    def put_batch(self, keys: List[str], values: List[Any], config: Any = None) -> int:
        """Stores bytes-like values: ``0``, or the first failing key's code; ``-600`` for
        lists of unequal length or an empty value; ``0`` for no keys."""
        keys, values = list(keys), list(values)
        if self._client is None:
            return _INTERNAL_ERROR
        if len(keys) != len(values):
            return _INVALID_PARAMS
        if any(len(_bytes_of(v)) == 0 for v in values):
            return _INVALID_PARAMS
        return next((c for c in self._store_bytes(keys, values, config) if c != _OK), _OK)

    def put_parts(self, key: str, *args: Any, config: Any = None) -> int:
        """Stores the concatenation of the bytes-like ``args``; no parts stores nothing and
        gives ``0`` (as Mooncake's)."""
        if self._client is None:
            return _INTERNAL_ERROR
        if not args:
            return _OK
        return self._store_bytes([key], [list(args)], config)[0]

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: Any = None,
    ) -> int:
        """Stores ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size``
        bytes at ``buffer_ptr`` as one object; ``size`` 0 stores nothing and gives ``0``."""
        if self._client is None:
            return _INTERNAL_ERROR
        if int(size) == 0:
            return _OK
        ptrs, sizes = [int(buffer_ptr)], [int(size)]
        if int(metadata_size):
            ptrs, sizes = [int(metadata_buffer_ptr), *ptrs], [int(metadata_size), *sizes]
        return self._put([key], [ptrs], [sizes], config)[0]

    # ------------------------------------------------------------------ upserts

    def upsert(self, key: str, value: Any, config: Any = None) -> int:
        """Like :meth:`put`, but replaces an existing object (leased or not)."""
        return self.upsert_batch([key], [value], config)

    def upsert_batch(self, keys: List[str], values: List[Any], config: Any = None) -> int:
        """Like :meth:`put_batch`, replacing existing objects."""
        keys, values = list(keys), list(values)
        if self._client is None:
            return _INTERNAL_ERROR
        if len(keys) != len(values) or any(len(_bytes_of(v)) == 0 for v in values):
            return _INVALID_PARAMS
        if not keys:
            return _OK
        self._drop(keys)
        return self.put_batch(keys, values, config)

    def upsert_parts(self, key: str, *args: Any, config: Any = None) -> int:
        """Like :meth:`put_parts`, replacing an existing object."""
        if self._client is None:
            return _INTERNAL_ERROR
        if not args:
            return _OK
        self._drop([key])
        return self.put_parts(key, *args, config=config)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Like :meth:`put_from`, replacing an existing object."""
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(
        self, keys: List[str], buffer_ptrs: List[int], sizes: List[int], config: Any = None
    ) -> List[int]:
        """Like :meth:`batch_put_from`, replacing existing objects."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        if len(keys) == len(buffer_ptrs) == len(sizes) and keys:
            self._drop(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes, config)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ replicas

    def _replicas(self, keys: List[str]) -> List[Optional[List[ReplicaDescriptor]]]:
        out: List[Optional[List[ReplicaDescriptor]]] = []
        try:
            rows = self._client.query(keys)
        except StoreError:
            return [None] * len(keys)
        for row in rows:
            if not isinstance(row, tuple):
                out.append(None)
                continue
            size, reps = row
            descs = []
            for _segment, endpoint, addr in reps:
                d = Descriptor()
                d.size, d.buffer_address, d.transport_endpoint = size, addr, endpoint
                descs.append(ReplicaDescriptor(MemoryDescriptor(d), ReplicaStatus.COMPLETE))
            out.append(descs)
        return out

    def get_replica_desc(self, key: str) -> List[ReplicaDescriptor]:
        """The object's replicas (all in memory and complete), ``[]`` when it is missing."""
        if self._client is None:
            return []
        return self._replicas([key])[0] or []

    def batch_get_replica_desc(self, keys: List[str]) -> Dict[str, List[ReplicaDescriptor]]:
        """Key -> replicas, for the keys that exist."""
        keys = list(keys)
        if self._client is None or not keys:
            return {}
        return {k: r for k, r in zip(keys, self._replicas(keys)) if r}

    def batch_replica_clear(self, keys: List[str], segment_name: str = "") -> List[str]:
        """Removes the keys that are complete and not leased, and returns them. With a
        ``segment_name`` (a client's ``get_hostname()``), only keys whose every replica
        lies in that segment are cleared (pagewire removes whole objects, not single
        replicas)."""
        keys = [k for k in keys if k]
        if self._client is None or not keys:
            return []
        if segment_name:
            segment_name = self._endpoint_of(segment_name)  # type: ignore[attr-defined]
            try:
                rows = self._client.query(keys)
            except StoreError:
                return []
            keys = [
                k
                for k, row in zip(keys, rows)
                if isinstance(row, tuple) and row[1] and all(r[1] == segment_name for r in row[1])
            ]
            if not keys:
                return []
        try:
            codes = self._client.remove(keys, False)
        except StoreError:
            return []
        return [k for k, c in zip(keys, codes) if c == _OK]

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many complete objects whose key matches ``regex_pattern`` (searched anywhere
        in the key) were removed; leased ones stay unless ``force``. ``-600`` for a
        pattern that does not compile. The master matches with Rust's ``regex`` syntax
        (Mooncake: ECMAScript); they agree except on look-around and back-references,
        which pagewire refuses (``-600``)."""
        if self._client is None:
            return _INTERNAL_ERROR
        try:
            return self._client.remove_matching(str(regex_pattern), bool(force))
        except StoreError as e:
            return e.code

    # ------------------------------------------------------------------ ranged reads

    def get_into_ranges(
        self,
        buffer_ptrs: List[int],
        all_keys: List[List[str]],
        all_dst_offsets: List[List[List[int]]],
        all_src_offsets: List[List[List[int]]],
        all_sizes: List[List[List[int]]],
    ) -> List[List[List[int]]]:
        """Copies byte ranges of objects into registered buffers: for buffer ``i``, key
        ``j`` and range ``k``, ``all_sizes[i][j][k]`` bytes from the object's offset
        ``all_src_offsets[i][j][k]`` to the buffer's ``all_dst_offsets[i][j][k]``. Per range
        the bytes copied, ``-704`` for a missing key, ``-600`` for a range outside the
        object or the registered buffer, lists of unequal length, or a buffer not
        registered."""
        ptrs = [int(p) for p in buffer_ptrs]
        results = [
            [[_INVALID_PARAMS] * len(r) for r in (all_dst_offsets[i] if i < len(all_dst_offsets) else [[0]])]
            for i in range(len(ptrs))
        ]
        if self._client is None or not (
            len(ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes)
        ):
            return results
        wanted = sorted({k for i, ks in enumerate(all_keys) if self._room_at(ptrs[i]) for k in ks})
        objects = dict(zip(wanted, self._fetch(wanted))) if wanted else {}
        for i, ptr in enumerate(ptrs):
            room = self._room_at(ptr)
            keys, dsts, srcs, sizes = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            if not room or not (len(keys) == len(dsts) == len(srcs) == len(sizes)):
                continue
            for j, key in enumerate(keys):
                if not (len(dsts[j]) == len(srcs[j]) == len(sizes[j])):
                    continue
                obj = objects.get(key, _OBJECT_NOT_FOUND)
                for k, (dst, src, n) in enumerate(zip(dsts[j], srcs[j], sizes[j])):
                    if not isinstance(obj, bytes):
                        results[i][j][k] = obj
                    elif dst + n > room or src + n > len(obj) or min(dst, src, n) < 0:
                        results[i][j][k] = _INVALID_PARAMS
                    else:
                        ctypes.memmove(ptr + dst, obj[src : src + n], n)
                        results[i][j][k] = n
        return results

    # ------------------------------------------------------------------ sessions

    def _session_ranges(self, lists: Sequence[Any], i: int, object_size: int) -> Optional[list]:
        """Key ``i``'s ``(pointer, size, object offset)`` ranges of a session call, or
        ``None`` when its lists differ in length or a range leaves the object or the
        registered memory."""
        ptrs, sizes, offs = (list(x[i]) for x in lists)
        if not (len(ptrs) == len(sizes) == len(offs)):
            return None
        ranges = list(zip(ptrs, sizes, offs))
        if any(o < 0 or n < 0 or o + n > object_size or self._room_at(p) < n for p, n, o in ranges):
            return None
        return ranges

    def _sessions(self, name: str) -> dict:
        s = self.__dict__.get(name)
        if s is None:
            s = self.__dict__[name] = {}
        return s

    def batch_put_session_start(self, keys: List[str], sizes: List[int], config: Any = None) -> List[int]:
        """Opens a put session per key for an object of ``sizes[i]`` bytes, written with
        :meth:`batch_put_from_multi_buffer_ranges` and stored by
        :meth:`batch_put_session_end`: ``0``, ``-705`` for a key that exists or has a
        session, ``-600`` for size 0 or lists of unequal length. The object is staged in
        this process until the end."""
        keys, sizes = list(keys), [int(s) for s in sizes]
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        if len(keys) != len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        sessions = self._sessions("_put_sessions")
        exists = self.batch_is_exist(keys) if keys else []  # type: ignore[attr-defined]
        out = []
        for key, size, ex in zip(keys, sizes, exists):
            if size <= 0:
                out.append(_INVALID_PARAMS)
            elif ex == 1 or key in sessions:
                out.append(_OBJECT_ALREADY_EXISTS)
            elif ex < 0:
                out.append(ex)
            else:
                sessions[key] = (bytearray(size), config)
                out.append(_OK)
        return out

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        all_dst_offsets: List[List[int]],
    ) -> List[int]:
        """Writes into open put sessions: key ``i`` gets ``all_sizes[i][j]`` bytes from
        ``all_buffer_ptrs[i][j]`` at its offset ``all_dst_offsets[i][j]``. Per key the bytes
        written, or ``-600`` (no session, a range past the object's size, a source outside
        registered memory, lists of unequal length)."""
        keys = list(keys)
        out = [_INVALID_PARAMS] * len(keys)
        if self._client is None or not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets)):
            return out
        sessions = self._sessions("_put_sessions")
        lists = (all_buffer_ptrs, all_sizes, all_dst_offsets)
        for i, key in enumerate(keys):
            data = sessions[key][0] if key in sessions else None
            ranges = self._session_ranges(lists, i, len(data)) if data is not None else None
            if ranges is None:
                continue
            for p, n, o in ranges:
                data[o : o + n] = ctypes.string_at(p, n)
            out[i] = sum(n for _, n, _ in ranges)
        return out

    def batch_put_session_end(self, keys: List[str]) -> List[int]:
        """Stores each session's object: ``0`` or its put's code; ``-600`` without a
        session."""
        keys = list(keys)
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        sessions = self._sessions("_put_sessions")
        out = []
        for key in keys:
            entry = sessions.pop(key, None)
            if entry is None:
                out.append(_INVALID_PARAMS)
                continue
            out.append(self._store_bytes([key], [entry[0]], entry[1])[0])
        return out

    def batch_put_session_revoke(self, keys: List[str]) -> List[int]:
        """Drops sessions without storing: ``0``, or ``-600`` without a session."""
        sessions = self._sessions("_put_sessions")
        return [_OK if sessions.pop(k, None) is not None else _INVALID_PARAMS for k in keys]

    def batch_get_session_start(self, keys: List[str]) -> List[int]:
        """Opens a get session per key, read with
        :meth:`batch_get_into_multi_buffer_ranges`: ``0``, or ``-704`` for a missing key.
        The session holds the object's bytes as they were at the start."""
        keys = list(keys)
        if self._client is None:
            return [_INTERNAL_ERROR] * len(keys)
        sessions = self._sessions("_get_sessions")
        out = []
        for key, r in zip(keys, self._fetch(keys) if keys else []):
            if isinstance(r, bytes):
                sessions[key] = r
                out.append(_OK)
            else:
                out.append(r)
        return out

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        all_src_offsets: List[List[int]],
    ) -> List[int]:
        """Reads from open get sessions: key ``i`` gives ``all_sizes[i][j]`` bytes from
        its offset ``all_src_offsets[i][j]`` into ``all_buffer_ptrs[i][j]``. Per key the
        bytes read, or ``-600`` (no session, a range past the object, a destination
        outside registered memory, lists of unequal length)."""
        keys = list(keys)
        out = [_INVALID_PARAMS] * len(keys)
        if self._client is None or not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets)):
            return out
        sessions = self._sessions("_get_sessions")
        lists = (all_buffer_ptrs, all_sizes, all_src_offsets)
        for i, key in enumerate(keys):
            data = sessions.get(key)
            ranges = self._session_ranges(lists, i, len(data)) if data is not None else None
            if ranges is None:
                continue
            for p, n, o in ranges:
                ctypes.memmove(p, data[o : o + n], n)
            out[i] = sum(n for _, n, _ in ranges)
        return out

    def batch_get_session_end(self, keys: List[str]) -> int:
        """Closes get sessions (keys without one are ignored): ``0``."""
        sessions = self._sessions("_get_sessions")
        for k in keys:
            sessions.pop(k, None)
        return _OK

    # ------------------------------------------------------------------ segments, tasks

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = "") -> dict:
        """File-backed segments need Mooncake's CXL/file build: ``{'ret': -1, ...}``."""
        return {"ret": _INTERNAL_ERROR, "segment_ids": []}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> dict:
        """A second segment per client is not supported by pagewire's store:
        ``{'ret': -1012, 'segment_ids': []}`` (Mooncake mounts one)."""
        return {"ret": _NOT_SUPPORTED, "segment_ids": []}

    def unmount_segment(self, segment_ids: List[str], grace_period_seconds: int = 0) -> int:
        """No extra segment is ever mounted: ``-1``."""
        return _INTERNAL_ERROR

    def unmount_and_free_segment(self, segment_ids: List[str], grace_period_seconds: int = 0) -> int:
        """No extra segment is ever mounted: ``-1``."""
        return _INTERNAL_ERROR

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """No disk segment: nothing to do, ``0``."""
        return _OK

    def get_offload_rpc_read_count(self) -> int:
        """No SSD offload: ``0``."""
        return 0

    def init_all(self, arg0: str, arg1: str, arg2: int, /) -> int:
        """Mooncake's legacy initialiser, refused by the wheel too: ``-600``."""
        return _INVALID_PARAMS

    def create_copy_task(self, key: str, targets: List[str]) -> Tuple[Tuple[int, int], int]:
        """Replica tasks need Mooncake's task manager: ``((0, 0), -600)`` for targets that
        are not segments, ``((0, 0), -1012)`` otherwise."""
        return _NO_TASK, self._task_refusal(targets)

    def create_move_task(self, key: str, source: str, target: str) -> Tuple[Tuple[int, int], int]:
        """As :meth:`create_copy_task`."""
        return _NO_TASK, self._task_refusal([source, target])

    def _task_refusal(self, segments: Sequence[str]) -> int:
        mine = self.get_hostname() if self._client is not None else ""  # type: ignore[attr-defined]
        return _NOT_SUPPORTED if segments and all(s == mine for s in segments) else _INVALID_PARAMS

    def query_task(self, task_id: Tuple[int, int]) -> tuple:
        """No task exists: ``(None, -1400)``."""
        return None, _TASK_NOT_FOUND

    # ------------------------------------------------------------------ tensors
    # The tensor calls are generated below from _TENSOR_METHODS (Mooncake's signatures);
    # those with a body in _StoreTensor (pagewire._mooncake_tensor) store Mooncake's
    # on-store format, the others answer as the wheel does without torch.

    def save_tensor_to_safetensor(self, key: str, file_name: object = None) -> int:
        """``-1100``, as the wheel without torch."""
        return _FILE_NOT_FOUND

    def load_tensor_from_safetensor(self, key: object = None, file_name: str = "") -> object:
        """``None``, as the wheel without torch."""
        return None


def _tensor_stub(name: str, params: str, result: str) -> Any:
    """A tensor method with Mooncake's signature (``params``: ``"key, size=0"``). It runs
    ``_t_<name>`` of :class:`_StoreTensor` where there is one; otherwise it gives the
    wheel's torch-less answer: ``result`` is ``int`` (-600), ``list`` (-600 per key),
    ``none`` or ``nones`` (``None`` per key)."""
    fields = [p.strip().partition("=") for p in params.split(",")]
    sig = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [
            inspect.Parameter(
                n,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=ast.literal_eval(d) if eq else inspect.Parameter.empty,
            )
            for n, eq, d in fields
        ]
    )
    body = getattr(_StoreTensor, f"_t_{name}", None)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        if body is not None:
            bound.apply_defaults()
            return body(*bound.args)
        if result in ("list", "nones"):
            n = len(list(list(bound.arguments.values())[1]))
            return [_INVALID_PARAMS if result == "list" else None] * n
        return _INVALID_PARAMS if result == "int" else None

    method.__name__ = name
    method.__qualname__ = f"MooncakeDistributedStore.{name}"
    method.__signature__ = sig  # type: ignore[attr-defined]
    method.__doc__ = (
        "Mooncake's call, in Mooncake's on-store tensor format (see pagewire._mooncake_tensor)."
        if body is not None
        else "Needs a setup_dummy client and CUDA IPC: -600, as the non-CUDA wheel gives."
    )
    return method


_C = "config=None"
_TP = "tp_rank=0, tp_size=1"
_TENSOR_METHODS = {
    "put_tensor": ("key, tensor", "int"),
    "put_tensor_from": ("key, buffer_ptr, size", "int"),
    "pub_tensor": (f"key, tensor, {_C}", "int"),
    "upsert_tensor": ("key, tensor", "int"),
    "upsert_tensor_from": ("key, buffer_ptr, size", "int"),
    "upsert_pub_tensor": (f"key, tensor, {_C}", "int"),
    "get_tensor": ("key", "none"),
    "get_tensor_into": ("key, buffer_ptr, size", "none"),
    "get_tensor_into_cuda": ("key, tensor", "int"),
    "put_tensor_with_tp": (f"key, tensor, {_TP}, split_dim=0", "int"),
    "put_tensor_with_tp_from": (f"key, buffer_ptr, size, {_TP}, split_dim=0", "int"),
    "pub_tensor_with_tp": (f"key, tensor, {_C}, {_TP}, split_dim=0", "int"),
    "get_tensor_with_tp": (f"key, {_TP}, split_dim=0", "none"),
    "get_tensor_with_tp_into": (f"key, buffer_ptr, size, {_TP}, split_dim=0", "none"),
    "put_tensor_with_parallelism": (f"key, tensor, parallelism=None, {_C}, writer_partition=None", "int"),
    "put_tensor_with_parallelism_from": (
        f"key, buffer_ptr, size, parallelism=None, {_C}, writer_partition=None", "int"),
    "upsert_tensor_with_parallelism": (f"key, tensor, parallelism=None, {_C}, writer_partition=None", "int"),
    "upsert_tensor_with_parallelism_from": (
        f"key, buffer_ptr, size, parallelism=None, {_C}, writer_partition=None", "int"),
    "get_tensor_with_parallelism": ("key, target=None", "none"),
    "get_tensor_with_parallelism_into": ("key, buffer_ptr, size, target=None", "none"),
    "batch_put_tensor": ("keys, tensors_list", "list"),
    "batch_put_tensor_from": ("keys, buffer_ptrs, sizes", "list"),
    "batch_pub_tensor": (f"keys, tensors_list, {_C}", "list"),
    "batch_upsert_tensor": ("keys, tensors_list", "list"),
    "batch_upsert_tensor_from": ("keys, buffer_ptrs, sizes", "list"),
    "batch_upsert_pub_tensor": (f"keys, tensors_list, {_C}", "list"),
    "batch_get_tensor": ("keys", "nones"),
    "batch_get_tensor_into": ("keys, buffer_ptrs, sizes", "nones"),
    "batch_get_tensor_into_cuda": ("keys, tensors_list", "list"),
    "batch_put_tensor_with_tp": (f"base_keys, tensors_list, {_TP}, split_dim=0", "list"),
    "batch_put_tensor_with_tp_from": (f"base_keys, buffer_ptrs, sizes, {_TP}, split_dim=0", "list"),
    "batch_pub_tensor_with_tp": (f"base_keys, tensors_list, {_C}, {_TP}, split_dim=0", "list"),
    "batch_get_tensor_with_tp": (f"base_keys, {_TP}", "nones"),
    "batch_get_tensor_with_tp_into": (f"base_keys, buffer_ptrs, sizes, {_TP}", "nones"),
    "batch_put_tensor_with_parallelism": (
        f"keys, tensors_list, parallelisms=None, {_C}, writer_partitions=None", "list"),
    "batch_put_tensor_with_parallelism_from": (
        f"keys, buffer_ptrs, sizes, parallelisms=None, {_C}, writer_partitions=None", "list"),
    "batch_upsert_tensor_with_parallelism": (
        f"keys, tensors_list, parallelisms=None, {_C}, writer_partitions=None", "list"),
    "batch_upsert_tensor_with_parallelism_from": (
        f"keys, buffer_ptrs, sizes, parallelisms=None, {_C}, writer_partitions=None", "list"),
    "batch_get_tensor_with_parallelism": ("keys, targets=None", "nones"),
    "batch_get_tensor_with_parallelism_into": ("keys, buffer_ptrs, sizes, targets=None", "nones"),
}  # fmt: skip

for _name, (_params, _result) in _TENSOR_METHODS.items():
    setattr(_StoreMore, _name, _tensor_stub(_name, _params, _result))
