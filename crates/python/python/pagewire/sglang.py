"""SGLang HiCache host pools on pagewire's layout code.

SGLang's host KV pools (``MHATokenToKVPoolHost``, ``AsymmetricMHATokenToKVPoolHost``,
``MLATokenToKVPoolHost``) turn host token slots into ``(ptr, len)`` lists with
``get_page_buffer_meta`` and ``get_split_heads_page_buffer_meta``; the L3 storage
backends (Mooncake store, SiMM, UMBP, ...) hand those lists to their transfer engines.
For models with ``head_dim != v_head_dim`` SGLang answers only in ``page_first`` and
``page_first_direct`` and never splits heads. This module reads a host pool object by
SGLang's attribute names (nothing is imported from SGLang, no torch needed) and answers
both methods with :class:`pagewire.Pool` in every layout:

>>> import pagewire.sglang
>>> class Buffer:                      # stands in for a torch tensor
...     def __init__(self, ptr): self.ptr = ptr
...     def data_ptr(self): return self.ptr
>>> class Dtype: itemsize = 2
>>> class HostPool:                    # an AsymmetricMHATokenToKVPoolHost, head_dim 3, v 2
...     layout, layer_num, page_size, size = "layer_first", 2, 4, 32
...     head_num, head_dim, v_head_dim, dtype = 2, 3, 2, Dtype()
...     k_buffer, v_buffer = Buffer(0x1000), Buffer(0x9000)
>>> host = HostPool()
>>> pool = pagewire.sglang.patch_host_pool(host)
>>> ptrs, sizes = host.get_page_buffer_meta(list(range(8, 12)))
>>> [hex(p) for p in ptrs], sizes
(['0x1060', '0x9040', '0x11e0', '0x9140'], [48, 32, 48, 32])
"""

from __future__ import annotations

from typing import Any, Optional

from pagewire._native import Geometry, LayoutError, Pool

__all__ = [
    "LAYOUTS",
    "geometry_of",
    "pool_of",
    "patch_host_pool",
    "unpatch_host_pool",
]

#: The host-pool layouts pagewire models (SGLang's ``--hicache-mem-layout`` names).
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

# Element sizes by dtype name, for dtype objects without ``itemsize`` (torch < 2.1).
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "uint8": 1,
    "int8": 1,
}

_PATCHED = ("get_page_buffer_meta", "get_split_heads_page_buffer_meta")


def _error(message: str) -> LayoutError:
    err = LayoutError(message)
    err.code = "host_pool"
    return err


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error(
            f"{type(obj).__name__} has no attribute {name!r}; "
            "is it an SGLang host KV pool?"
        ) from None


def _int(obj: Any, name: str) -> int:
    value = _attr(obj, name)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _error(f"{type(obj).__name__}.{name} is not an int: {value!r}") from None


def _data_ptr(buffer: Any, what: str) -> int:
    if buffer is None or not hasattr(buffer, "data_ptr"):
        raise _error(f"{what} has no data_ptr() (got {type(buffer).__name__})")
    return int(buffer.data_ptr())


def _nbytes(buffer: Any) -> Optional[int]:
    """A buffer's byte size when it says (torch: ``nbytes``, or numel * element_size)."""
    nbytes = getattr(buffer, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    numel = getattr(buffer, "numel", None)
    element_size = getattr(buffer, "element_size", None)
    if callable(numel) and callable(element_size):
        return int(numel()) * int(element_size())
    return None


def _itemsize(host_pool: Any) -> int:
    """``dtype.itemsize``; else the buffer's ``element_size()``; else by dtype name."""
    dtype = _attr(host_pool, "dtype")
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    buffer = getattr(host_pool, "kv_buffer", None)
    if isinstance(buffer, (tuple, list)) and buffer:
        buffer = buffer[0]
    element_size = getattr(buffer, "element_size", None)
    if callable(element_size):
        return int(element_size())
    name = str(dtype).rsplit(".", 1)[-1]
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    raise _error(f"cannot tell the element size of dtype {dtype!r}")


def _k_v_buffers(host_pool: Any) -> tuple[Any, Any]:
    """The K and V buffers: ``k_buffer``/``v_buffer``, else ``kv_buffer[0]``/``[1]``."""
    k = getattr(host_pool, "k_buffer", None)
    v = getattr(host_pool, "v_buffer", None)
    if k is None or v is None:
        kv = _attr(host_pool, "kv_buffer")
        k, v = kv[0], kv[1]
    return k, v


def _is_mla(host_pool: Any) -> bool:
    return hasattr(host_pool, "kv_lora_rank") or (
        hasattr(host_pool, "kv_cache_dim") and not hasattr(host_pool, "head_num")
    )


def _check_common(host_pool: Any) -> str:
    layout = _attr(host_pool, "layout")
    if layout not in LAYOUTS:
        raise _error(
            f"host pool layout {layout!r} is not one pagewire models "
            f"(expected one of {', '.join(LAYOUTS)})"
        )
    dcp = int(getattr(host_pool, "dcp_size", 1) or 1)
    if dcp != 1:
        raise _error(
            f"decode context parallelism (dcp_size={dcp}) maps logical to physical "
            "pages; pagewire models dcp_size=1 only"
        )
    return layout


def geometry_of(host_pool: Any) -> Geometry:
    """The :class:`pagewire.Geometry` of an SGLang host KV pool object.

    Read by SGLang's attribute names: ``layer_num``, ``page_size``, ``size`` (capacity in
    token slots), ``dtype`` (its ``itemsize``), and ``head_num``, ``head_dim``,
    ``v_head_dim`` for MHA or ``kv_cache_dim`` (else ``kv_lora_rank +
    qk_rope_head_dim``) for MLA. ``head_dim != v_head_dim`` gives an ``"mha-split"``
    geometry (SGLang's asymmetric pool, separate K and V buffers).

    Raises :class:`pagewire.LayoutError` when an attribute is missing or the sizes are
    invalid.
    """
    common = dict(
        layers=_int(host_pool, "layer_num"),
        page_size=_int(host_pool, "page_size"),
        capacity=_int(host_pool, "size"),
    )
    if _is_mla(host_pool):
        kv_dim = getattr(host_pool, "kv_cache_dim", None)
        if kv_dim is None:
            kv_dim = _int(host_pool, "kv_lora_rank") + _int(host_pool, "qk_rope_head_dim")
        return Geometry("mla", kv_dim=int(kv_dim), dtype_bytes=_itemsize(host_pool), **common)
    head_dim = _int(host_pool, "head_dim")
    v_head_dim = getattr(host_pool, "v_head_dim", None)
    v_head_dim = head_dim if v_head_dim is None else int(v_head_dim)
    kind = "mha" if v_head_dim == head_dim else "mha-split"
    return Geometry(
        kind,
        heads=_int(host_pool, "head_num"),
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype_bytes=_itemsize(host_pool),
        **common,
    )


def pool_of(host_pool: Any, *, checks: str = "sglang") -> Pool:
    """A :class:`pagewire.Pool` with the geometry, layout and buffer addresses of an SGLang
    host KV pool object.

    Addresses come from ``data_ptr()``: ``kv_buffer`` for the symmetric MHA and the MLA
    pools (V at SGLang's ``V_OFF`` past K), ``k_buffer`` and ``v_buffer`` (or
    ``kv_buffer[0]``/``[1]``) for ``head_dim != v_head_dim``. When the buffers report their
    size (``nbytes``, or ``numel() * element_size()``) or a symmetric pool's
    ``v_buffer`` its address, they are checked against the geometry, so that a geometry
    read wrong cannot produce pointers outside the buffers.

    ``checks`` is the pool's index checking: ``"sglang"`` (the default here) reads what
    SGLang reads, the first slot of each page, and still keeps every page inside the pool;
    ``"strict"`` also checks that each page's slots are consecutive and page-aligned.
    """
    layout = _check_common(host_pool)
    geometry = geometry_of(host_pool)
    if geometry.kind == "mla":
        buffer = _attr(host_pool, "kv_buffer")
        pool = Pool(geometry, layout, _data_ptr(buffer, "kv_buffer"), checks=checks)
        _check_size(buffer, geometry.buffer_bytes("kv"), "kv_buffer")
        return pool
    if geometry.kind == "mha":
        kv = _attr(host_pool, "kv_buffer")
        pool = Pool(geometry, layout, _data_ptr(kv, "kv_buffer"), checks=checks)
        _check_size(kv, 2 * geometry.buffer_bytes("k"), "kv_buffer")
        v = getattr(host_pool, "v_buffer", None)
        if v is not None and hasattr(v, "data_ptr") and int(v.data_ptr()) != pool.v_base:
            raise _error(
                f"v_buffer.data_ptr() = {int(v.data_ptr()):#x}, but the geometry puts V at "
                f"{pool.v_base:#x} (kv_buffer + V_OFF): {geometry!r} does not match the buffers"
            )
        return pool
    k, v = _k_v_buffers(host_pool)
    pool = Pool(
        geometry,
        layout,
        _data_ptr(k, "k_buffer"),
        _data_ptr(v, "v_buffer"),
        checks=checks,
    )
    _check_size(k, geometry.buffer_bytes("k"), "k_buffer")
    _check_size(v, geometry.buffer_bytes("v"), "v_buffer")
    return pool


def _check_size(buffer: Any, expected: int, what: str) -> None:
    nbytes = _nbytes(buffer)
    if nbytes is not None and nbytes != expected:
        raise _error(
            f"{what} holds {nbytes} bytes, but the pool's geometry needs {expected}: "
            "layer_num, size, head_num, head_dim/v_head_dim or dtype were read wrong"
        )


def patch_host_pool(host_pool: Any, *, checks: str = "sglang") -> Pool:
    """Make an SGLang host KV pool object answer ``get_page_buffer_meta`` and (MHA pools)
    ``get_split_heads_page_buffer_meta`` with pagewire.

    The two methods are replaced on this object only (instance attributes; the class is
    untouched). They take the same arguments and return the same types as SGLang's:
    ``(ptr_list, element_size_list)``, two lists of ints. Where SGLang answers the lists
    are identical, entry for entry; where it raises (``head_dim != v_head_dim`` in
    ``layer_first`` or ``page_head``, split heads for it) they are the correct ones.
    Split heads need ``page_head`` for every pool (head groups are contiguous only there);
    elsewhere :class:`pagewire.LayoutError` is raised.

    ``checks`` defaults to ``"sglang"`` because SGLang itself calls
    ``get_page_buffer_meta(torch.zeros(page_size))`` to learn an entry's size; pass
    ``"strict"`` to also reject pages whose slots are not consecutive and page-aligned.
    Pages must lie inside the pool either way, and bad input raises
    :class:`pagewire.LayoutError` (a ``ValueError``), never a wrong pointer.

    Returns the :class:`pagewire.Pool` used. :func:`unpatch_host_pool` restores
    SGLang's methods.
    """
    pool = pool_of(host_pool, checks=checks)

    def get_page_buffer_meta(indices):
        return pool.page_meta(indices, as_lists=True)

    def get_split_heads_page_buffer_meta(indices, split_factor):
        return pool.split_heads_meta(indices, split_factor, as_lists=True)

    get_page_buffer_meta.__doc__ = "pagewire: " + (Pool.page_meta.__doc__ or "")
    get_split_heads_page_buffer_meta.__doc__ = "pagewire: " + (
        Pool.split_heads_meta.__doc__ or ""
    )
    host_pool.get_page_buffer_meta = get_page_buffer_meta
    if pool.geometry.kind != "mla":  # SGLang's MLA pool has no split-heads method
        host_pool.get_split_heads_page_buffer_meta = get_split_heads_page_buffer_meta
    host_pool._pagewire_pool = pool
    return pool


def unpatch_host_pool(host_pool: Any) -> None:
    """Undo :func:`patch_host_pool`: the object answers with its class's methods again."""
    for name in (*_PATCHED, "_pagewire_pool"):
        host_pool.__dict__.pop(name, None)


# --- store: PagewireStore, an SGLang HiCache L3 backend on the pagewire store ----------
from pagewire._hicache import PagewireStore  # noqa: E402

__all__ += ["PagewireStore"]
# --- end store -------------------------------------------------------------------------
