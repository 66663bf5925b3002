"""``MooncakeDistributedStore``'s tensor calls, in Mooncake's on-store tensor format, so
that a tensor one client stores is readable by the other, byte for byte.

An object is a 304-byte little-endian header, then the tensor's bytes (C order):

* ``u32`` magic ``0x4d4f4f4e``, ``u16`` version 1, ``u16`` header size (304), ``i32``
  dtype (the index in :data:`DTYPES`), ``i32`` ndim (at most 8), ``u32`` layout kind
  (0 full tensor, 1 shard), ``u32`` flags (0), ``u64`` data offset (304), ``u64`` data
  bytes;
* the global and the local shape, 8 ``i64`` each (unused dims ``-1``; equal for a full
  tensor), ``u32`` axis count, ``u32`` 0;
* 4 axes of 32 bytes: ``i32`` kind (1 = tensor parallel), ``i32`` index, ``i32`` rank,
  ``i32`` count, ``i32`` split dim, ``i32`` 0, ``i64`` the shard's extent along the split
  dim; unused axes are zero.

Tensor parallelism (``*_with_tp``, ``tp_size`` > 1) splits the tensor into ``tp_size``
equal slices along ``split_dim`` (a dim it divides, else ``-600``) and stores slice ``r``
as a shard object under ``f"{key}_tp_{r}"``, every rank's slice whatever ``tp_rank``; a
read with ``tp_rank`` reads that rank's key. ``tp_size`` <= 1 is the plain call.

The ``*_with_parallelism*`` calls are the plain calls without a spec; a writer partition
stores one writer's slice and a manifest (see :func:`pack_manifest`), and a
``ReadTarget`` of mode ``"full"`` joins the slices. A parallelism spec (see
:func:`parse_spec`) stores one shard under a key naming its axes (:func:`spec_key`), and
a read re-cuts the stored slices when its ``tp`` size differs (a resharding read).

Only CPU tensors of the dtypes in :data:`DTYPES` are stored; a non-contiguous tensor is
stored as its contiguous copy; anything else gives ``-600`` (``None`` for reads). Without
torch every call answers as Mooncake's wheel does without it. Reads give a new tensor
(``get_tensor``) or one that shares the caller's buffer (``*_into``); as Mooncake's, a
0-d tensor comes back with shape ``(1,)``.

>>> head = pack_header(0, [2, 3], [2, 3], 24)  # float32, shape (2, 3)
>>> len(head), head[:4]
(304, b'NOOM')
>>> p = parse_header(head + bytes(24))
>>> p.dtype, p.shape, p.offset, p.nbytes
(0, [2, 3], 304, 24)
>>> parse_header(head + bytes(23)) is None  # the length must match the header
True
"""

from __future__ import annotations

import ctypes
import logging
import struct
from typing import Any, List, Optional, Sequence, Tuple

_log = logging.getLogger("pagewire.mooncake_compat")

_INVALID_PARAMS = -600

#: Mooncake's dtype codes: a dtype's code is its index (torch attribute names).
DTYPES = (
    "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
    "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
_ELEMENT = (4, 8, 1, 1, 2, 2, 4, 4, 8, 8, 1, 2, 2, 1, 1)

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
FULL, SHARD = 0, 1
AXIS_TP = 1
_AXIS_KINDS = 5  # DP, TP, EP, PP, reserved

_HEAD = struct.Struct("<IHHiiIIQQ")
_SHAPES = struct.Struct(f"<{MAX_DIMS}q{MAX_DIMS}qII")
_AXIS = struct.Struct("<6iq")
#: Header bytes before the tensor's data.
HEADER_SIZE = _HEAD.size + _SHAPES.size + MAX_AXES * _AXIS.size

_Axis = Tuple[int, int, int, int, int, int, int]


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _dims(shape: Sequence[int]) -> List[int]:
    return list(shape) + [-1] * (MAX_DIMS - len(shape))


def pack_header(
    dtype: int,
    global_shape: Sequence[int],
    local_shape: Sequence[int],
    data_bytes: int,
    axes: Sequence[_Axis] = (),
) -> bytes:
    """The header of a tensor object (a shard when ``axes`` are given)."""
    kind = SHARD if axes else FULL
    head = _HEAD.pack(MAGIC, VERSION, HEADER_SIZE, dtype, len(global_shape), kind, 0, HEADER_SIZE, data_bytes)
    shapes = _SHAPES.pack(*_dims(global_shape), *_dims(local_shape), len(axes), 0)
    padded = list(axes) + [(0,) * 7] * (MAX_AXES - len(axes))
    return head + shapes + b"".join(_AXIS.pack(*a) for a in padded)


class Parsed:
    """A validated header: dtype code, local shape, where the data is and how long."""

    __slots__ = ("dtype", "shape", "offset", "nbytes")

    def __init__(self, dtype: int, shape: List[int], offset: int, nbytes: int) -> None:
        self.dtype, self.shape, self.offset, self.nbytes = dtype, shape, offset, nbytes


def parse_header(obj: Any) -> Optional[Parsed]:
    """Validates a whole object (bytes-like, its full length) as Mooncake does before
    it reads one: ``None`` unless every field is consistent with the length."""
    mem = memoryview(obj).cast("B")
    if len(mem) < HEADER_SIZE:
        return None
    magic, version, hsize, dtype, ndim, kind, _flags, offset, nbytes = _HEAD.unpack_from(mem)
    if magic != MAGIC or version != VERSION or hsize != HEADER_SIZE:
        return None
    if not 0 <= dtype < len(DTYPES) or not 0 <= ndim <= MAX_DIMS or kind > SHARD:
        return None
    fields = _SHAPES.unpack_from(mem, _HEAD.size)
    global_shape, local_shape, naxes = fields[:MAX_DIMS], fields[MAX_DIMS : 2 * MAX_DIMS], fields[16]
    if naxes > MAX_AXES or not HEADER_SIZE <= offset <= len(mem) or nbytes != len(mem) - offset:
        return None
    if any(d < 0 for d in global_shape[:ndim] + local_shape[:ndim]):
        return None
    if any(d != -1 for d in global_shape[ndim:] + local_shape[ndim:]):
        return None
    numel = 1
    for d in local_shape[:ndim]:
        numel *= d
    if numel * _ELEMENT[dtype] != nbytes:
        return None
    for i in range(naxes):
        at = _HEAD.size + _SHAPES.size + i * _AXIS.size
        kind_i, _index, rank, count, split, _r0, _r1 = _AXIS.unpack_from(mem, at)
        if not 0 <= kind_i < _AXIS_KINDS or count <= 0 or not 0 <= rank < count or not -1 <= split < ndim:
            return None
    return Parsed(dtype, list(local_shape[:ndim]), offset, nbytes)


def _global_shape(obj: Any) -> List[int]:
    """The global shape a valid object's header names."""
    mem = memoryview(obj).cast("B")
    return list(_SHAPES.unpack_from(mem, _HEAD.size)[: _HEAD.unpack_from(mem)[4]])


def _shard_axis(obj: Any) -> Optional[Tuple[int, int, int]]:
    """``(rank, count, split dim)`` of a valid shard object's first (tensor-parallel) axis."""
    mem = memoryview(obj).cast("B")
    kind = _HEAD.unpack_from(mem)[5]
    naxes = _SHAPES.unpack_from(mem, _HEAD.size)[16]
    if kind != SHARD or naxes < 1:
        return None
    axis_kind, _index, rank, count, split, _r0, _r1 = _AXIS.unpack_from(mem, _HEAD.size + _SHAPES.size)
    return (rank, count, split) if axis_kind == AXIS_TP else None


def _dtype_code(torch: Any, dtype: Any) -> int:
    for code, name in enumerate(DTYPES):
        if dtype == getattr(torch, name, None):
            return code
    return -1


class _Info:
    """A tensor ready to store: header, data (a view of the tensor's memory), and the
    tensor that owns that memory."""

    __slots__ = ("header", "data", "owner")

    def __init__(self, header: bytes, data: Any, owner: Any) -> None:
        self.header, self.data, self.owner = header, data, owner


def _host_view(ptr: int, n: int) -> memoryview:
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def tensor_info(tensor: Any, key: str = "", global_shape: Any = None, axes: Sequence[_Axis] = ()) -> Optional[_Info]:
    """``tensor``'s header and bytes, or ``None`` (logged) when it cannot be stored."""
    torch = _torch()
    if torch is None or "Tensor" not in type(tensor).__name__:
        _log.error("tensor for %r is not a PyTorch tensor", key)
        return None
    try:
        t = tensor.contiguous()
        if t.device.type != "cpu":
            _log.error("tensor for %r is on %s: pagewire stores host tensors only", key, t.device)
            return None
        code = _dtype_code(torch, t.dtype)
        if code < 0:
            _log.error("unsupported tensor dtype %s for %r", t.dtype, key)
            return None
        shape = [int(d) for d in t.shape]
        if len(shape) > MAX_DIMS:
            _log.error("tensor for %r has more than %d dimensions", key, MAX_DIMS)
            return None
        n = int(t.numel()) * int(t.element_size())
        whole = shape if global_shape is None else [int(d) for d in global_shape]
        return _Info(pack_header(code, whole, shape, n, axes), _host_view(int(t.data_ptr()), n), t)
    except Exception as e:  # a tensor-named object without torch's methods
        _log.error("tensor for %r: %s", key, e)
        return None


def to_tensor(obj: Any) -> Any:
    """The tensor a whole object holds (sharing ``obj``'s memory, which must be writable),
    or ``None`` for an object that is not a valid tensor."""
    torch = _torch()
    parsed = parse_header(obj) if torch is not None else None
    if parsed is None:
        _log.error("invalid tensor metadata")
        return None
    dtype = getattr(torch, DTYPES[parsed.dtype], None)
    if dtype is None:
        return None
    try:
        if parsed.nbytes == 0:
            return torch.empty(tuple(parsed.shape), dtype=dtype)
        raw = torch.frombuffer(obj, dtype=torch.uint8, count=parsed.nbytes, offset=parsed.offset)
        t = raw.view(dtype)
        # A 0-d tensor stays 1-d, as Mooncake's reader gives it.
        return t.reshape(tuple(parsed.shape)) if parsed.shape else t
    except (RuntimeError, ValueError, OverflowError) as e:  # a shape torch cannot hold
        _log.error("tensor of shape %s: %s", parsed.shape, e)
        return None


def host_object(ptr: int, n: int) -> Any:
    """The ``n`` bytes at ``ptr`` as a writable buffer (no copy)."""
    return (ctypes.c_char * n).from_address(ptr) if n > 0 else bytearray()


def tp_key(base: str, rank: int) -> str:
    return f"{base}_tp_{rank}"


# A writer partition: each writer stores its own slice of a tensor under
# f"{key}__writer_{rank}of{size}_sd{split_dim}" (a shard object as above) and a manifest
# under f"{key}__writer_manifest": u32 magic 0x574d414e, u16 version 1, u16 size (96),
# i32 dtype, ndim, split dim, shard count, 0, 4 bytes of padding, then the global shape
# (8 i64, unused -1). A read with ReadTarget mode "full" joins the slices.
MANIFEST_MAGIC = 0x574D414E
_MANIFEST_HEAD = struct.Struct("<IHHiiiii4x")
_MANIFEST_SHAPE = struct.Struct(f"<{MAX_DIMS}q")
MANIFEST_SIZE = _MANIFEST_HEAD.size + _MANIFEST_SHAPE.size


def writer_key(base: str, rank: int, size: int, split_dim: int) -> str:
    return f"{base}__writer_{rank}of{size}_sd{split_dim}"


def manifest_key(base: str) -> str:
    return f"{base}__writer_manifest"


def pack_manifest(dtype: int, shape: Sequence[int], split_dim: int, shards: int) -> bytes:
    head = _MANIFEST_HEAD.pack(MANIFEST_MAGIC, VERSION, MANIFEST_SIZE, dtype, len(shape), split_dim, shards, 0)
    return head + _MANIFEST_SHAPE.pack(*_dims(shape))


def parse_manifest(obj: Any) -> Optional[Tuple[int, List[int], int, int]]:
    """``(dtype, global shape, split dim, shard count)`` of a valid manifest, else ``None``."""
    mem = memoryview(obj).cast("B")
    if len(mem) < MANIFEST_SIZE:
        return None
    magic, version, size, dtype, ndim, split, shards, _ = _MANIFEST_HEAD.unpack_from(mem)
    if magic != MANIFEST_MAGIC or version != VERSION or size != MANIFEST_SIZE or not 0 <= ndim <= MAX_DIMS:
        return None
    if shards <= 0 or not 0 <= split < ndim:
        return None
    shape = list(_MANIFEST_SHAPE.unpack_from(mem, _MANIFEST_HEAD.size)[:ndim])
    if any(d < 0 for d in shape):
        return None
    return dtype, shape, split, shards


def parallelism_manifest_key(base: str) -> str:
    return f"{base}__parallelism_manifest"


#: Axis kinds in their header code order (DP 0, TP 1, EP 2, PP 3), which is also the
#: canonical order of the axes in a shard's key.
_AXIS_NAMES = ("dp", "tp", "ep", "pp")
_AXIS_EP, _AXIS_PP = 2, 3


class Axis:
    """One validated axis of a parallelism spec: ``kind`` (its code), ``rank``, ``size``,
    ``split`` (``None`` unless a ``tp`` axis), ``tag`` (an ``ep`` axis's expert id or a
    ``pp`` axis's stage id, else ``None``)."""

    __slots__ = ("kind", "rank", "size", "split", "tag")

    def __init__(self, kind: int, rank: int, size: int, split: Optional[int], tag: Optional[int]) -> None:
        self.kind, self.rank, self.size, self.split, self.tag = kind, rank, size, split, tag

    def ident(self) -> Tuple[int, int, int, Optional[int], Optional[int]]:
        return self.kind, self.rank, self.size, self.split, self.tag

    def with_tp(self, rank: int, size: Optional[int] = None) -> "Axis":
        return Axis(self.kind, rank, self.size if size is None else size, self.split, self.tag)


def _opt_int(obj: Any, name: str) -> Optional[int]:
    value = getattr(obj, name, None)
    return None if value is None else int(value)


def parse_spec(obj: Any) -> Optional[List[Axis]]:
    """The axes of a parallelism spec (``TensorParallelism``) in the caller's order, or
    ``None`` (logged) when it is not valid as Mooncake checks it: 1 to 4 axes of distinct
    kinds, ``0 <= rank < size``; a ``tp`` axis has a ``split_dim``, the others none; an
    ``ep`` axis has an ``expert_id``, a ``pp`` axis a ``stage_id``."""
    try:
        axes = []
        for a in list(obj.axes):
            kind = str(a.kind).lower()
            if kind not in _AXIS_NAMES:
                _log.error("unsupported parallel axis kind %r", a.kind)
                return None
            code = _AXIS_NAMES.index(kind)
            tag_name = {_AXIS_EP: "expert_id", _AXIS_PP: "stage_id"}.get(code)
            tag = _opt_int(a, tag_name) if tag_name else None
            axes.append(Axis(code, int(a.rank), int(a.size), _opt_int(a, "split_dim"), tag))
    except (AttributeError, TypeError, ValueError):
        _log.error("parallelism must be a TensorParallelism")
        return None
    if not 0 < len(axes) <= MAX_AXES or len({a.kind for a in axes}) != len(axes):
        _log.error("invalid parallelism spec: 1 to %d axes of distinct kinds", MAX_AXES)
        return None
    for a in axes:
        needs_tag = a.kind in (_AXIS_EP, _AXIS_PP)
        if a.size <= 0 or not 0 <= a.rank < a.size or (a.split is None) == (a.kind == AXIS_TP):
            _log.error("invalid parallel axis %s", _AXIS_NAMES[a.kind])
            return None
        if needs_tag and a.tag is None:
            _log.error("a %s axis needs its id", _AXIS_NAMES[a.kind])
            return None
    return axes


def tp_index(axes: Sequence[Axis]) -> Optional[int]:
    return next((i for i, a in enumerate(axes) if a.kind == AXIS_TP), None)


def canonical(axes: Sequence[Axis]) -> List[Axis]:
    return sorted(axes, key=lambda a: a.kind)


def spec_key(base: str, axes: Sequence[Axis]) -> str:
    """Where the shard of ``axes`` is stored: ``f"{base}_tp_{rank}"`` for one ``tp`` axis,
    else one ``__`` suffix per axis in canonical order (dp, tp, ep, pp), such as
    ``key__dp_1of2__tp_0of2_sd1``, ``_eid``/``_sid`` closing an ``ep``/``pp`` axis."""
    if len(axes) == 1 and axes[0].kind == AXIS_TP:
        return tp_key(base, axes[0].rank)
    out = base
    for a in canonical(axes):
        out += f"__{_AXIS_NAMES[a.kind]}_{a.rank}of{a.size}"
        if a.split is not None:
            out += f"_sd{a.split}"
        if a.tag is not None:
            out += ("_eid" if a.kind == _AXIS_EP else "_sid") + str(a.tag)
    return out


def header_axes(axes: Sequence[Axis], local_shape: Sequence[int]) -> List[_Axis]:
    """The header's axis records, in the caller's order: the split dim ``-1`` and the
    extent 0 for an axis that splits nothing, the expert or stage id in the sixth field."""
    out = []
    for i, a in enumerate(axes):
        split = -1 if a.split is None else a.split
        extent = 0 if a.split is None else int(local_shape[a.split])
        out.append((a.kind, i, a.rank, a.size, split, a.tag or 0, extent))
    return out


def stored_axes(obj: Any) -> Optional[List[Axis]]:
    """The axes a valid shard object's header names (canonical order), else ``None``."""
    mem = memoryview(obj).cast("B")
    if _HEAD.unpack_from(mem)[5] != SHARD:
        return None
    out = []
    for i in range(_SHAPES.unpack_from(mem, _HEAD.size)[16]):
        at = _HEAD.size + _SHAPES.size + i * _AXIS.size
        kind, _index, rank, count, split, tag, _extent = _AXIS.unpack_from(mem, at)
        if kind >= len(_AXIS_NAMES):
            return None
        out.append(Axis(kind, rank, count, None if split < 0 else split, tag if kind in (_AXIS_EP, _AXIS_PP) else None))
    return canonical(out)


def _sans_tp_rank(axes: Sequence[Axis]) -> List[Tuple[Any, ...]]:
    """The axes' identities (canonical order) without the ``tp`` axis's rank."""
    return [(a.kind, None if a.kind == AXIS_TP else a.rank) + a.ident()[2:] for a in canonical(axes)]


def writer_spec(obj: Any) -> Optional[Tuple[int, int, int]]:
    """``(rank, size, split_dim)`` of a writer partition (any object with those
    attributes), or ``None`` when it is not a valid one."""
    try:
        rank, size, split = int(obj.rank), int(obj.size), int(obj.split_dim)
    except (AttributeError, TypeError, ValueError):
        _log.error("writer_partition must provide rank, size, and split_dim")
        return None
    if size <= 0 or not 0 <= rank < size or split < 0:
        _log.error("invalid writer partition")
        return None
    return rank, size, split


def tp_shards(
    tensor: Any, key: str, tp_size: int, split_dim: int, ranks: Optional[Sequence[int]] = None
) -> Optional[List[_Info]]:
    """The ``tp_size`` equal slices of ``tensor`` along ``split_dim`` (those of ``ranks``,
    default all) as shard objects, or ``None`` when the split is not uniform or the tensor
    cannot be stored."""
    torch = _torch()
    try:
        if torch is None or _dtype_code(torch, tensor.dtype) < 0:
            return None
        shape = [int(d) for d in tensor.shape]
    except Exception as e:
        _log.error("put with tp for %r: %s", key, e)
        return None
    if not 0 <= split_dim < len(shape) or tp_size <= 0 or shape[split_dim] % tp_size:
        _log.error("put with tp for %r: only uniform sharding along an existing dim", key)
        return None
    step = shape[split_dim] // tp_size
    out = []
    for rank in range(tp_size) if ranks is None else ranks:
        chunk = tensor.narrow(split_dim, rank * step, step).contiguous()
        axis = (AXIS_TP, 0, rank, tp_size, split_dim, 0, step)
        info = tensor_info(chunk, tp_key(key, rank), shape, [axis])
        if info is None:
            return None
        out.append(info)
    return out


def _join(parts: Optional[List[Any]], split: int) -> Any:
    """The tensors ``parts`` concatenated along ``split``, or ``None``."""
    torch = _torch()
    if not parts or torch is None or any(p is None for p in parts):
        return None
    try:
        return torch.cat(parts, dim=split)
    except (RuntimeError, ValueError) as e:
        _log.error("tensor slices do not join: %s", e)
        return None


def _first_failure(codes: Sequence[int]) -> int:
    return next((c for c in codes if c != 0), 0)


class _StoreTensor:
    """The tensor calls' bodies, ``_t_<name>`` with the public call's parameters (the
    public methods, with Mooncake's signatures, are generated in
    :mod:`pagewire._mooncake_store_more`). A mixin of the store class."""

    _client: Any

    # ------------------------------------------------------------------ writes

    def _write_infos(self, keys: List[str], infos: List[Optional[_Info]], config: Any, upsert: bool) -> List[int]:
        """Per key ``0`` or a negative code; an invalid tensor is ``-600`` and the
        others are still written."""
        out = [_INVALID_PARAMS] * len(keys)
        idx = [i for i, info in enumerate(infos) if info is not None]
        if not idx:
            return out
        todo = [keys[i] for i in idx]
        if upsert:
            self._drop(todo)  # type: ignore[attr-defined]
        values = [[infos[i].header, infos[i].data] for i in idx]  # type: ignore[union-attr]
        for i, code in zip(idx, self._store_bytes(todo, values, config)):  # type: ignore[attr-defined]
            out[i] = code
        return out

    def _write_one(self, key: str, tensor: Any, config: Any, upsert: bool) -> int:
        if self._client is None:
            return _INVALID_PARAMS
        return self._write_infos([key], [tensor_info(tensor, key)], config, upsert)[0]

    def _write_batch(self, keys: Any, tensors: Any, config: Any, upsert: bool) -> List[int]:
        keys, tensors = list(keys), list(tensors)
        if self._client is None or not keys or len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        infos = [tensor_info(t, k) for k, t in zip(keys, tensors)]
        return self._write_infos(keys, infos, config, upsert)

    def _t_put_tensor(self, key: str, tensor: Any) -> int:
        return self._write_one(key, tensor, None, False)

    def _t_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        return self._write_one(key, tensor, config, False)

    def _t_upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._write_one(key, tensor, None, True)

    def _t_upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        return self._write_one(key, tensor, config, True)

    def _t_batch_put_tensor(self, keys: Any, tensors_list: Any) -> List[int]:
        return self._write_batch(keys, tensors_list, None, False)

    def _t_batch_pub_tensor(self, keys: Any, tensors_list: Any, config: Any = None) -> List[int]:
        return self._write_batch(keys, tensors_list, config, False)

    def _t_batch_upsert_tensor(self, keys: Any, tensors_list: Any) -> List[int]:
        return self._write_batch(keys, tensors_list, None, True)

    def _t_batch_upsert_pub_tensor(self, keys: Any, tensors_list: Any, config: Any = None) -> List[int]:
        return self._write_batch(keys, tensors_list, config, True)

    # ------------------------------------------------------------------ writes from buffers

    def _valid_source(self, ptr: int, size: int) -> bool:
        """A caller's serialized tensor: inside a registered buffer (pagewire reads no
        other memory of the caller) and a valid object of ``size`` bytes."""
        ptr, size = int(ptr), int(size)
        if ptr == 0 or size < HEADER_SIZE or self._room_at(ptr) < size:  # type: ignore[attr-defined]
            return False
        return parse_header(host_object(ptr, size)) is not None

    def _write_from(self, keys: Any, ptrs: Any, sizes: Any, upsert: bool, config: Any = None) -> List[int]:
        keys, ptrs, sizes = list(keys), list(ptrs), list(sizes)
        if self._client is None:
            return [_INVALID_PARAMS] * len(keys)
        if not keys:
            return []
        if not (len(keys) == len(ptrs) == len(sizes)) or not all(map(self._valid_source, ptrs, sizes)):
            return [_INVALID_PARAMS] * len(keys)
        call = self.batch_upsert_from if upsert else self.batch_put_from  # type: ignore[attr-defined]
        return call(keys, ptrs, sizes, config)

    def _t_put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        if self._client is None or not self._valid_source(buffer_ptr, size):
            return _INVALID_PARAMS
        return self._write_from([key], [buffer_ptr], [size], False)[0]

    def _t_upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        if self._client is None or not self._valid_source(buffer_ptr, size):
            return _INVALID_PARAMS
        return self._write_from([key], [buffer_ptr], [size], True)[0]

    def _t_batch_put_tensor_from(self, keys: Any, buffer_ptrs: Any, sizes: Any) -> List[int]:
        return self._write_from(keys, buffer_ptrs, sizes, False)

    def _t_batch_upsert_tensor_from(self, keys: Any, buffer_ptrs: Any, sizes: Any) -> List[int]:
        return self._write_from(keys, buffer_ptrs, sizes, True)

    # ------------------------------------------------------------------ reads

    def _t_get_tensor(self, key: str) -> Any:
        return self._t_batch_get_tensor([key])[0]

    def _t_batch_get_tensor(self, keys: Any) -> List[Any]:
        keys = list(keys)
        if self._client is None or not keys:
            return [None] * len(keys)
        out = []
        for r in self._fetch(keys):  # type: ignore[attr-defined]
            out.append(to_tensor(bytearray(r)) if isinstance(r, bytes) else None)
        return out

    def _t_get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        if self._client is None or int(buffer_ptr) == 0:
            return None
        n = self.get_into(key, buffer_ptr, size)  # type: ignore[attr-defined]
        return to_tensor(host_object(int(buffer_ptr), n)) if n > 0 else None

    def _t_batch_get_tensor_into(self, keys: Any, buffer_ptrs: Any, sizes: Any) -> List[Any]:
        keys, ptrs, sizes = list(keys), [int(p) for p in buffer_ptrs], list(sizes)
        if self._client is None or not (len(keys) == len(ptrs) == len(sizes)) or 0 in ptrs:
            return [_INVALID_PARAMS] * len(keys)
        codes = self.batch_get_into(keys, ptrs, sizes)  # type: ignore[attr-defined]
        return [to_tensor(host_object(p, n)) if n > 0 else None for p, n in zip(ptrs, codes)]

    # ------------------------------------------------------------------ tensor parallelism

    def _write_tp(
        self, keys: List[str], tensors: List[Any], config: Any, tp_size: int, split_dim: int, upsert: bool = False
    ) -> List[int]:
        """Per base key ``0`` or the first failing shard's code."""
        out = [_INVALID_PARAMS] * len(keys)
        all_keys: List[str] = []
        all_infos: List[Optional[_Info]] = []
        done = []
        for i, (key, tensor) in enumerate(zip(keys, tensors)):
            shards = tp_shards(tensor, key, tp_size, split_dim) if tensor is not None else None
            if shards is None:
                continue
            done.append(i)
            all_keys += [tp_key(key, r) for r in range(tp_size)]
            all_infos += shards
        codes = self._write_infos(all_keys, all_infos, config, upsert)
        for j, i in enumerate(done):
            out[i] = _first_failure(codes[j * tp_size : (j + 1) * tp_size])
        return out

    def _t_put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self._t_pub_tensor_with_tp(key, tensor, None, tp_rank, tp_size, split_dim)

    def _t_pub_tensor_with_tp(
        self, key: str, tensor: Any, config: Any = None, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        if self._client is None:
            return _INVALID_PARAMS
        if tp_size <= 1:
            return self._write_one(key, tensor, config, False)
        return self._write_tp([key], [tensor], config, tp_size, split_dim)[0]

    def _t_batch_put_tensor_with_tp(
        self, base_keys: Any, tensors_list: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> List[int]:
        return self._t_batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size, split_dim)

    def _t_batch_pub_tensor_with_tp(
        self,
        base_keys: Any,
        tensors_list: Any,
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> List[int]:
        keys, tensors = list(base_keys), list(tensors_list)
        if tp_size <= 1:
            return self._write_batch(keys, tensors, config, False)
        if self._client is None or not keys or len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        return self._write_tp(keys, tensors, config, tp_size, split_dim)

    def _t_put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        return self._t_batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank, tp_size, split_dim)[0]

    def _t_batch_put_tensor_with_tp_from(
        self,
        base_keys: Any,
        buffer_ptrs: Any,
        sizes: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> List[int]:
        keys, ptrs, sizes = list(base_keys), list(buffer_ptrs), list(sizes)
        if tp_size <= 1 or self._client is None:
            return self._write_from(keys, ptrs, sizes, False)
        if not keys or not (len(keys) == len(ptrs) == len(sizes)):
            return [_INVALID_PARAMS] * len(keys)
        # Each buffer is a whole tensor object; its slices are stored as shards.
        tensors = [
            to_tensor(host_object(int(p), int(n))) if self._valid_source(p, n) else None for p, n in zip(ptrs, sizes)
        ]
        return self._write_tp(keys, tensors, None, tp_size, split_dim)

    def _t_get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        return self._t_get_tensor(key if tp_size <= 1 else tp_key(key, tp_rank))

    def _t_batch_get_tensor_with_tp(self, base_keys: Any, tp_rank: int = 0, tp_size: int = 1) -> List[Any]:
        keys = list(base_keys)
        return self._t_batch_get_tensor(keys if tp_size <= 1 else [tp_key(k, tp_rank) for k in keys])

    def _t_get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        return self._t_get_tensor_into(key if tp_size <= 1 else tp_key(key, tp_rank), buffer_ptr, size)

    def _t_batch_get_tensor_with_tp_into(
        self, base_keys: Any, buffer_ptrs: Any, sizes: Any, tp_rank: int = 0, tp_size: int = 1
    ) -> List[Any]:
        keys = list(base_keys)
        if self._client is None:
            return [None] * len(keys)
        keys = keys if tp_size <= 1 else [tp_key(k, tp_rank) for k in keys]
        return self._t_batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # ------------------------------------------------------------------ parallelism specs
    # Without a parallelism spec, writer partition or read target these are the plain
    # calls (as in Mooncake); a writer partition or a parallelism spec stores one shard
    # (and a manifest), a read target joins or re-cuts the stored shards.

    def _par_write(
        self, key: str, tensor: Any, parallelism: Any, config: Any, writer_partition: Any, upsert: bool
    ) -> int:
        if parallelism is not None and writer_partition is not None:
            return _INVALID_PARAMS
        if parallelism is not None:
            return self._write_spec_shard(key, tensor, parallelism, config, upsert)
        if writer_partition is not None:
            return self._write_writer_shard(key, tensor, writer_partition, config, upsert)
        return self._write_one(key, tensor, config, upsert)

    def _write_spec_shard(self, key: str, tensor: Any, parallelism: Any, config: Any, upsert: bool) -> int:
        """The caller's part of a tensor under a parallelism spec (see :func:`parse_spec`).

        One ``tp`` axis: ``tensor`` is this rank's slice, stored under
        ``f"{key}_tp_{rank}"`` with the global shape ``size`` times larger along the split
        dim. Several axes with a ``tp`` one: ``tensor`` is the whole tensor and slice
        ``rank`` of ``size`` is stored. Both write the manifest under
        ``f"{key}__parallelism_manifest"``. No ``tp`` axis: ``tensor`` is stored whole as a
        shard object naming the axes, without a manifest."""
        axes = parse_spec(parallelism)
        torch = _torch()
        if axes is None or self._client is None or torch is None or "Tensor" not in type(tensor).__name__:
            return _INVALID_PARAMS
        try:
            shape, dtype = [int(d) for d in tensor.shape], _dtype_code(torch, tensor.dtype)
        except (AttributeError, TypeError, ValueError):
            return _INVALID_PARAMS
        t = tp_index(axes)
        if t is None:
            info = tensor_info(tensor, key, None, header_axes(axes, shape))
            return self._write_infos([spec_key(key, axes)], [info], config, upsert)[0]
        tp = axes[t]
        split = int(tp.split)  # type: ignore[arg-type]
        if dtype < 0 or not 0 <= split < len(shape):
            return _INVALID_PARAMS
        whole, shard = list(shape), tensor
        if len(axes) == 1:
            whole[split] *= tp.size
        elif shape[split] % tp.size:
            _log.error("put with parallelism for %r: only uniform sharding is supported", key)
            return _INVALID_PARAMS
        else:
            step = shape[split] // tp.size
            shard = tensor.narrow(split, tp.rank * step, step)
        info = tensor_info(shard, key, whole, header_axes(axes, [int(d) for d in shard.shape]))
        code = self._write_infos([spec_key(key, axes)], [info], config, upsert)[0]
        if code != 0:
            return code
        manifest = pack_manifest(dtype, whole, split, tp.size)
        return self._write_manifest(parallelism_manifest_key(key), manifest, config, upsert)

    def _write_spec_from(self, key: str, obj: Any, tensor: Any, parallelism: Any, config: Any, upsert: bool) -> int:
        """A serialized tensor ``obj`` under a spec: with a ``tp`` axis every rank's slice
        (the key and header of that rank, no manifest), as ``put_tensor_with_tp_from``;
        without one the object's data as a shard naming the axes, its shapes kept."""
        axes = parse_spec(parallelism)
        if axes is None:
            return _INVALID_PARAMS
        t = tp_index(axes)
        if t is None:
            # The object's own shapes and data (a 0-d tensor keeps its 0 dims).
            p, whole = parse_header(obj), _global_shape(obj)
            head = pack_header(p.dtype, whole, p.shape, p.nbytes, header_axes(axes, p.shape))  # type: ignore[union-attr]
            data = memoryview(obj).cast("B")[p.offset :]  # type: ignore[union-attr]
            return self._write_infos([spec_key(key, axes)], [_Info(head, data, obj)], config, upsert)[0]
        tp = axes[t]
        shards = tp_shards(tensor, key, tp.size, int(tp.split))  # type: ignore[arg-type]
        if shards is None:
            return _INVALID_PARAMS
        shape = [int(d) for d in tensor.shape]
        local = list(shape)
        local[int(tp.split)] //= tp.size  # type: ignore[arg-type]
        dtype = _dtype_code(_torch(), tensor.dtype)
        keys = []
        for rank, info in enumerate(shards):
            ranked = [a.with_tp(rank) if i == t else a for i, a in enumerate(axes)]
            info.header = pack_header(dtype, shape, local, len(info.data), header_axes(ranked, local))
            keys.append(spec_key(key, ranked))
        return _first_failure(self._write_infos(keys, list(shards), config, upsert))

    def _write_manifest(self, mkey: str, manifest: bytes, config: Any, upsert: bool) -> int:
        if upsert:
            self._drop([mkey])  # type: ignore[attr-defined]
        return self._store_bytes([mkey], [manifest], config)[0]  # type: ignore[attr-defined]

    def _write_writer_shard(self, key: str, tensor: Any, writer_partition: Any, config: Any, upsert: bool) -> int:
        """This writer's slice and the manifest (see :func:`writer_spec`)."""
        spec = writer_spec(writer_partition)
        if spec is None or self._client is None:
            return _INVALID_PARAMS
        rank, size, split = spec
        shards = tp_shards(tensor, key, size, split, [rank]) if tensor is not None else None
        if shards is None:
            return _INVALID_PARAMS
        code = self._write_infos([writer_key(key, rank, size, split)], shards, config, upsert)[0]
        if code != 0:
            return code
        shape, dtype = [int(d) for d in tensor.shape], _dtype_code(_torch(), tensor.dtype)
        return self._write_manifest(manifest_key(key), pack_manifest(dtype, shape, split, size), config, upsert)

    def _par_write_batch(
        self, keys: Any, values: int, parallelisms: Any, writer_partitions: Any
    ) -> Optional[List[int]]:
        """The answer for a batch with specs or of unequal length; ``None`` for the plain
        call and for writer partitions (one per key)."""
        n = len(keys)
        if values != n or (parallelisms is not None and writer_partitions is not None):
            return [_INVALID_PARAMS] * n
        if parallelisms is not None and len(list(parallelisms)) != n:
            _log.error("keys and parallelisms must have the same length")
            return [_INVALID_PARAMS] * n
        if writer_partitions is not None and len(list(writer_partitions)) != n:
            _log.error("keys and writer_partitions must have the same length")
            return [_INVALID_PARAMS] * n
        return None

    def _par_write_from(
        self, key: str, buffer_ptr: int, size: int, parallelism: Any, config: Any, writer_partition: Any, upsert: bool
    ) -> int:
        if parallelism is not None and writer_partition is not None:
            return _INVALID_PARAMS
        if self._client is None or not self._valid_source(buffer_ptr, size):
            return _INVALID_PARAMS
        if parallelism is not None or writer_partition is not None:
            obj = host_object(int(buffer_ptr), int(size))
            tensor = to_tensor(obj)
            if tensor is None:
                return _INVALID_PARAMS
            if parallelism is not None:
                return self._write_spec_from(key, obj, tensor, parallelism, config, upsert)
            return self._write_writer_shard(key, tensor, writer_partition, config, upsert)
        return self._write_from([key], [buffer_ptr], [size], upsert, config)[0]

    def _t_put_tensor_with_parallelism(
        self, key: str, tensor: Any, parallelism: Any = None, config: Any = None, writer_partition: Any = None
    ) -> int:
        return self._par_write(key, tensor, parallelism, config, writer_partition, False)

    def _t_upsert_tensor_with_parallelism(
        self, key: str, tensor: Any, parallelism: Any = None, config: Any = None, writer_partition: Any = None
    ) -> int:
        return self._par_write(key, tensor, parallelism, config, writer_partition, True)

    def _t_put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        return self._par_write_from(key, buffer_ptr, size, parallelism, config, writer_partition, False)

    def _t_upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        return self._par_write_from(key, buffer_ptr, size, parallelism, config, writer_partition, True)

    def _par_batch(
        self, keys: Any, tensors_list: Any, parallelisms: Any, config: Any, writer_partitions: Any, upsert: bool
    ) -> List[int]:
        keys, tensors = list(keys), list(tensors_list)
        refused = self._par_write_batch(keys, len(tensors), parallelisms, writer_partitions)
        if refused is not None:
            return refused
        if parallelisms is not None:
            return [
                self._write_spec_shard(k, t, q, config, upsert) for k, t, q in zip(keys, tensors, list(parallelisms))
            ]
        if writer_partitions is not None:
            return [
                self._write_writer_shard(k, t, w, config, upsert)
                for k, t, w in zip(keys, tensors, list(writer_partitions))
            ]
        if self._client is None:
            return [_INVALID_PARAMS] * len(keys)
        infos = [tensor_info(t, k) for k, t in zip(keys, tensors)]
        return self._write_infos(keys, infos, config, upsert)

    def _t_batch_put_tensor_with_parallelism(
        self, keys: Any, tensors_list: Any, parallelisms: Any = None, config: Any = None, writer_partitions: Any = None
    ) -> List[int]:
        return self._par_batch(keys, tensors_list, parallelisms, config, writer_partitions, False)

    def _t_batch_upsert_tensor_with_parallelism(
        self, keys: Any, tensors_list: Any, parallelisms: Any = None, config: Any = None, writer_partitions: Any = None
    ) -> List[int]:
        return self._par_batch(keys, tensors_list, parallelisms, config, writer_partitions, True)

    def _par_batch_from(
        self,
        keys: Any,
        buffer_ptrs: Any,
        sizes: Any,
        parallelisms: Any,
        config: Any,
        writer_partitions: Any,
        upsert: bool,
    ) -> List[int]:
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        refused = self._par_write_batch(keys, len(ptrs), parallelisms, writer_partitions)
        if refused is not None:
            return refused
        if parallelisms is not None or writer_partitions is not None:
            qs = list(parallelisms) if parallelisms is not None else [None] * len(keys)
            ws = list(writer_partitions) if writer_partitions is not None else [None] * len(keys)
            return [
                self._par_write_from(k, p, n, q, config, w, upsert) for k, p, n, q, w in zip(keys, ptrs, sizes, qs, ws)
            ]
        return self._write_from(keys, ptrs, sizes, upsert, config)

    def _t_batch_put_tensor_with_parallelism_from(
        self,
        keys: Any,
        buffer_ptrs: Any,
        sizes: Any,
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> List[int]:
        return self._par_batch_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, False)

    def _t_batch_upsert_tensor_with_parallelism_from(
        self,
        keys: Any,
        buffer_ptrs: Any,
        sizes: Any,
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> List[int]:
        return self._par_batch_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, True)

    def _read_target(self, key: str, target: Any, into: bool = False) -> Tuple[bool, Any, Optional[bytes]]:
        """``(done, tensor, header)`` for the targets beyond as-stored; ``done`` False: read
        ``key`` as stored; ``header``: the one an ``_into`` read writes before the data (the
        stored shard's, or a re-cut shard's naming the request's axes; ``None``: a whole
        tensor's). An unknown mode raises as Mooncake's.

        Without a spec mode ``"full"`` joins writer slices. With a valid spec (else
        ``None``): mode ``"shard"`` reads the shard stored under the spec's key when its
        header names the same axes (for one ``tp`` axis also a writer slice of that
        partition), else cuts the requested slice out of the joined tensor (a resharding
        read, see :meth:`_join_spec`), else, for one ``tp`` axis and not into a buffer,
        reads ``f"{key}_tp_{rank}"`` as stored; mode ``"full"`` (a ``tp`` axis needed)
        joins the slices; mode ``"as_stored"`` gives ``None``."""
        if target is None:
            return False, None, None
        mode = str(getattr(target, "mode", "as_stored")).upper()
        if mode not in ("AS_STORED", "SHARD", "FULL"):
            raise RuntimeError("Unsupported ReadTarget mode")
        parallelism = getattr(target, "parallelism", None)
        if parallelism is None:
            if mode == "FULL":
                full = self._writer_full(key) if self._client is not None else None
                return full is not None, full, None
            if mode == "SHARD":
                _log.error("a shard read target needs a parallelism spec")
            return mode == "SHARD", None, None
        axes = parse_spec(parallelism)
        if axes is None or mode == "AS_STORED" or self._client is None:
            return True, None, None
        t = tp_index(axes)
        if mode == "FULL":
            return True, self._join_spec(key, axes) if t is not None else None, None
        shard, obj = self._stored_shard(key, axes)
        if shard is not None or t is None:
            return True, shard, bytes(obj[:HEADER_SIZE]) if obj is not None else None
        full, tp = self._join_spec(key, axes), axes[t]
        if full is not None:
            split = int(tp.split)  # type: ignore[arg-type]
            step = int(full.shape[split]) // tp.size
            part = full.narrow(split, tp.rank * step, step).contiguous()
            whole, local = [int(d) for d in full.shape], [int(d) for d in part.shape]
            nbytes = int(part.numel()) * int(part.element_size())
            head = pack_header(_dtype_code(_torch(), part.dtype), whole, local, nbytes, header_axes(axes, local))
            return True, part, head
        if len(axes) == 1 and not into:
            return True, self._t_get_tensor(self._tp_read_key(key, tp.rank, tp.size)), None
        return True, None, None

    @staticmethod
    def _tp_read_key(key: str, rank: int, size: int) -> str:
        return tp_key(key, rank) if size > 1 else key

    def _shard_object(self, skey: str) -> Tuple[Any, Optional[List[Axis]]]:
        """The valid tensor object under ``skey`` and its shard axes (``None`` for a whole
        tensor), or ``(None, None)``."""
        raw = self._fetch([skey])[0]  # type: ignore[attr-defined]
        obj = bytearray(raw) if isinstance(raw, bytes) else None
        if obj is None or parse_header(obj) is None:
            return None, None
        return obj, stored_axes(obj)

    def _stored_shard(self, key: str, axes: List[Axis]) -> Tuple[Any, Any]:
        """The shard stored for exactly ``axes`` (its key, or a writer slice's for one
        ``tp`` axis) and its object, else ``(None, None)``."""
        want = [a.ident() for a in canonical(axes)]
        keys = [spec_key(key, axes)]
        if len(axes) == 1 and axes[0].kind == AXIS_TP:
            keys.append(writer_key(key, axes[0].rank, axes[0].size, int(axes[0].split)))  # type: ignore[arg-type]
        for skey in keys:
            obj, have = self._shard_object(skey)
            if have is not None and [a.ident() for a in have] == want:
                return to_tensor(obj), obj
        return None, None

    def _join_spec(self, key: str, axes: List[Axis]) -> Any:
        """The whole tensor the stored slices of ``axes``'s shard family join into, whatever
        ``tp`` size they were written with, else ``None``.

        With a valid manifest the slices are the manifest's count, keyed by ``axes`` with
        that ``tp`` rank and size; the request's split dim must be the manifest's and the
        request's ``tp`` size must divide the split extent. Without one, or when those
        slices do not join: for one ``tp`` axis the ``f"{key}_tp_{r}"`` objects, as many
        as slice 0 names, else the request's ``tp`` size of slices; each slice must name
        the request's other axes."""
        t = tp_index(axes)
        tp = axes[t]  # type: ignore[index]
        raw = self._fetch([parallelism_manifest_key(key)])[0]  # type: ignore[attr-defined]
        manifest = parse_manifest(raw) if isinstance(raw, bytes) else None
        full = self._join_by_manifest(key, axes, tp, manifest) if manifest is not None else None
        if full is not None:
            return full
        if len(axes) == 1:
            _obj, first = self._shard_object(self._tp_read_key(key, 0, tp.size))
            stored = next((a for a in first or () if a.kind == AXIS_TP), None)
            if stored is None or stored.split != tp.split:
                return None
            keys = [self._tp_read_key(key, r, stored.size) for r in range(stored.size)]
            full = self._join_slices(keys, None, int(tp.split), stored.size)  # type: ignore[arg-type]
        else:
            keys = [spec_key(key, [a.with_tp(r) if a is tp else a for a in axes]) for r in range(tp.size)]
            full = self._join_slices(keys, axes, int(tp.split))  # type: ignore[arg-type]
        if full is None or int(full.shape[tp.split]) % tp.size:
            return None
        return full

    def _join_by_manifest(self, key: str, axes: List[Axis], tp: Axis, manifest: Tuple[int, List[int], int, int]) -> Any:
        dtype, shape, split, count = manifest
        if split != tp.split or shape[split] % tp.size or shape[split] % count:
            return None
        keys = [spec_key(key, [a.with_tp(r, count) if a is tp else a for a in axes]) for r in range(count)]
        full = self._join_slices(keys, [a.with_tp(0, count) if a is tp else a for a in axes], split)
        if full is None or [int(d) for d in full.shape] != shape or _dtype_code(_torch(), full.dtype) != dtype:
            return None
        return full

    def _join_slices(self, keys: List[str], axes: Optional[List[Axis]], split: int, count: int = 0) -> Any:
        """The slices under ``keys`` (slice ``r`` at ``keys[r]``) joined along ``split``.
        Each must be a shard whose axes are ``axes`` but for the ``tp`` rank (``axes``
        ``None``: whose ``tp`` axis is rank ``r`` of ``count`` along ``split``), all of one
        dtype and global shape, the slices filling it."""
        want = _sans_tp_rank(axes) if axes is not None else None
        parts, heads = [], set()
        for rank, skey in enumerate(keys):
            obj, have = self._shard_object(skey)
            if have is None:
                _log.error("tensor slice %r is missing or not a shard", skey)
                return None
            tp = next((a for a in have if a.kind == AXIS_TP), None)
            if want is not None and _sans_tp_rank(have) != want:
                _log.error("tensor slice %r does not match the requested layout", skey)
                return None
            if want is None and (tp is None or (tp.rank, tp.size, tp.split) != (rank, count, split)):
                _log.error("tensor slice %r is not tensor-parallel rank %d of %d", skey, rank, count)
                return None
            heads.add((_HEAD.unpack_from(memoryview(obj).cast("B"))[3], tuple(_global_shape(obj))))
            parts.append(to_tensor(obj))
        full = _join(parts, split)
        if full is None or len(heads) != 1 or tuple(int(d) for d in full.shape) != next(iter(heads))[1]:
            return None
        return full

    def _writer_full(self, key: str) -> Any:
        """The tensor a complete set of writer slices of ``key`` joins into, else ``None``."""
        torch = _torch()
        raw = self._fetch([manifest_key(key)])[0]  # type: ignore[attr-defined]
        manifest = parse_manifest(raw) if isinstance(raw, bytes) and torch is not None else None
        if manifest is None:
            return None
        dtype, shape, split, count = manifest
        parts = []
        for rank, r in enumerate(self._fetch([writer_key(key, i, count, split) for i in range(count)])):  # type: ignore
            obj = bytearray(r) if isinstance(r, bytes) else None
            parsed = parse_header(obj) if obj is not None else None
            if parsed is None or parsed.dtype != dtype or _shard_axis(obj) != (rank, count, split):
                _log.error("writer slice %d of %r is missing or does not match the manifest", rank, key)
                return None
            parts.append(to_tensor(obj))
        full = _join(parts, split)
        return full if full is not None and list(full.shape) == shape else None

    def _t_get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        done, tensor, _header = self._read_target(key, target)
        return tensor if done else self._t_get_tensor(key)

    def _t_get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int, target: Any = None) -> Any:
        done, full, header = self._read_target(key, target, into=True)
        if done:
            if full is not None:
                # Written as a tensor object into the caller's registered buffer.
                info = tensor_info(full, key)
                total = HEADER_SIZE + len(info.data) if info is not None else 0
                ptr = int(buffer_ptr)
                if info is None or ptr == 0 or int(size) < total or self._room_at(ptr) < total:  # type: ignore
                    return None
                dst = host_object(ptr, total)
                memoryview(dst).cast("B")[:HEADER_SIZE] = info.header if header is None else header
                memoryview(dst).cast("B")[HEADER_SIZE:total] = info.data
                return to_tensor(dst)
            return None
        return self._t_get_tensor_into(key, buffer_ptr, size)

    def _t_batch_get_tensor_with_parallelism(self, keys: Any, targets: Any = None) -> List[Any]:
        keys = list(keys)
        if targets is None:
            return self._t_batch_get_tensor(keys)
        targets = list(targets)
        if len(targets) != len(keys):
            return [None] * len(keys)
        return [self._t_get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def _t_batch_get_tensor_with_parallelism_into(
        self, keys: Any, buffer_ptrs: Any, sizes: Any, targets: Any = None
    ) -> List[Any]:
        keys, ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if targets is None:
            # Unlike batch_get_tensor_into, refusals are None per key here (Mooncake).
            if self._client is None or not (len(keys) == len(ptrs) == len(sizes)) or 0 in ptrs:
                return [None] * len(keys)
            return self._t_batch_get_tensor_into(keys, ptrs, sizes)
        targets = list(targets)
        if not (len(targets) == len(keys) == len(ptrs) == len(sizes)):
            return [None] * len(keys)
        return [self._t_get_tensor_with_parallelism_into(k, p, n, t) for k, p, n, t in zip(keys, ptrs, sizes, targets)]
