"""pagewire.sglang on fake SGLang host pools (SGLang's attribute names, no torch).

Each fake mirrors what SGLang's class exposes to ``get_page_buffer_meta``: symmetric MHA
(``MHATokenToKVPoolHost``: one ``kv_buffer`` of shape (2, ...), ``k_buffer``/``v_buffer``
its halves), asymmetric MHA (``AsymmetricMHATokenToKVPoolHost``: ``kv_buffer`` is the
tuple ``(k, v)``), and MLA (``MLATokenToKVPoolHost``: ``kv_lora_rank``,
``qk_rope_head_dim``, ``kv_cache_dim``). The patched methods are checked against SGLang's
formulas (``layout_reference.py``) in every layout, including the ones SGLang refuses.
"""

import doctest

import numpy as np
import pytest

import pagewire
import pagewire.sglang as pws
from pagewire import LayoutError

import layout_reference as ref


class Tensor:
    """What SGLang's code touches on a host tensor: ``data_ptr()``, views, and (when
    ``nbytes`` is given) its size through ``numel()`` and ``element_size()``."""

    def __init__(self, ptr, nbytes=None, halves=None):
        self.ptr, self._halves = ptr, halves
        if nbytes is not None:
            self.numel = lambda: nbytes // 2
            self.element_size = lambda: 2

    def data_ptr(self):
        return self.ptr

    def __getitem__(self, i):  # kv_buffer[0] / [1] of the symmetric pool
        return Tensor(self.ptr + i * self._halves)


class Dtype:
    def __init__(self, itemsize=2, name="torch.bfloat16"):
        self.itemsize, self.name = itemsize, name

    def __repr__(self):
        return self.name


class TorchishIndices:
    """Like the int64 CPU tensor HiCache passes: ``__array__``, ``tolist``, ``len``."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.int64)

    def __array__(self, dtype=None, copy=None):
        return self.values

    def tolist(self):
        return self.values.tolist()

    def __len__(self):
        return len(self.values)


L, P, S, B = 3, 4, 64, 2  # layers, page size, capacity (slots), bytes per element


class MHAHost:
    """MHATokenToKVPoolHost."""

    def __init__(self, layout, H=4, D=8, base=0x7F0000000000):
        self.layout, self.layer_num, self.page_size, self.size = layout, L, P, S
        self.page_num = S // P
        self.head_num, self.head_dim, self.v_head_dim, self.dtype = H, D, D, Dtype()
        half = L * S * H * D * B
        self.kv_buffer = Tensor(base, 2 * half, halves=half)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_page_buffer_meta(self, indices):
        raise AssertionError("SGLang's method must be replaced")

    def get_split_heads_page_buffer_meta(self, indices, split_factor):
        raise AssertionError("SGLang's method must be replaced")


class AsymHost(MHAHost):
    """AsymmetricMHATokenToKVPoolHost (head_dim != v_head_dim, e.g. MiMo-V2's 192/128)."""

    def __init__(self, layout, H=4, D=12, Dv=8):
        super().__init__(layout, H, D)
        self.v_head_dim = Dv
        k = Tensor(0x7F1000000000, L * S * H * D * B)
        v = Tensor(0x7F2000000000, L * S * H * Dv * B)
        self.kv_buffer = (k, v)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]


class MLAHost:
    """MLATokenToKVPoolHost (DeepSeek-style latent cache: 512 + 64, here 10 + 6)."""

    def __init__(self, layout, lora=10, rope=6):
        self.layout, self.layer_num, self.page_size, self.size = layout, L, P, S
        self.kv_lora_rank, self.qk_rope_head_dim = lora, rope
        self.kv_cache_dim = lora + rope
        self.dtype = Dtype()
        self.dcp_size = 1
        self.kv_buffer = Tensor(0x7F3000000000, L * S * self.kv_cache_dim * B)

    def get_page_buffer_meta(self, indices):
        raise AssertionError("SGLang's method must be replaced")


def geo_and_bases(host):
    if isinstance(host, MLAHost):
        g = ref.Geo("mla", L=L, P=P, b=B, S=S, C=host.kv_cache_dim)
        return g, {"kv": host.kv_buffer.data_ptr()}
    kind = "mha-split" if isinstance(host, AsymHost) else "mha"
    g = ref.Geo(kind, L=L, P=P, b=B, S=S, H=host.head_num, D=host.head_dim, Dv=host.v_head_dim)
    k, v = host.k_buffer.data_ptr(), host.v_buffer.data_ptr()
    if kind == "mha":
        assert v == k + L * S * g.H * g.D * B  # SGLang's V_OFF
    return g, {"k": k, "v": v}


HOSTS = [(cls, layout) for cls in (MHAHost, AsymHost, MLAHost) for layout in ref.LAYOUTS if not (cls is MLAHost and layout == "page_head")]
REQUESTS = [[0], [15], [2, 3], [9, 1, 4], list(range(16))]


def slots(pages):
    return [p * P + o for p in pages for o in range(P)]


@pytest.mark.parametrize("cls,layout", HOSTS, ids=lambda x: getattr(x, "__name__", x))
def test_page_meta_matches_sglangs_formulas(cls, layout):
    host = cls(layout)
    pool = pws.patch_host_pool(host)
    assert isinstance(pool, pagewire.Pool) and pool.layout == layout
    g, bases = geo_and_bases(host)
    for pages in REQUESTS:
        idx = slots(pages)
        want = ref.sglang_meta(g, layout, bases, idx)
        for form in (idx, np.array(idx, dtype=np.int64), TorchishIndices(idx)):
            got = host.get_page_buffer_meta(form)
            # SGLang's return type exactly: a tuple of two lists of Python ints.
            assert type(got) is tuple and len(got) == 2
            assert type(got[0]) is list and type(got[1]) is list
            assert all(type(x) is int for x in got[0] + got[1])
            assert got == want


@pytest.mark.parametrize("cls", [MHAHost, AsymHost])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_split_heads_in_page_head(cls, factor):
    host = cls("page_head")
    pws.patch_host_pool(host)
    g, bases = geo_and_bases(host)
    for pages in REQUESTS:
        idx = TorchishIndices(slots(pages))
        got = host.get_split_heads_page_buffer_meta(idx, factor)
        assert type(got) is tuple and all(type(x) is list for x in got)
        assert got == ref.sglang_split_heads(g, bases, slots(pages), factor)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_split_heads_outside_page_head_is_a_layout_error(layout):
    for cls in (MHAHost, AsymHost):
        host = cls(layout)
        pws.patch_host_pool(host)
        with pytest.raises(LayoutError, match="split heads need the page_head layout") as e:
            host.get_split_heads_page_buffer_meta(slots([1]), 2)
        assert e.value.code == "split_heads_layout"
    host = MHAHost("page_head")
    pws.patch_host_pool(host)
    with pytest.raises(LayoutError, match="does not divide"):
        host.get_split_heads_page_buffer_meta(slots([1]), 3)


def test_asymmetric_entries_cover_their_elements():
    """Where SGLang refuses (layer_first, page_head), the pointers are checked against the
    row-major model, not only against our own formula."""
    for layout in ref.LAYOUTS:
        host = AsymHost(layout)
        pws.patch_host_pool(host)
        g, bases = geo_and_bases(host)
        ptrs, sizes = host.get_page_buffer_meta(slots([5, 6]))
        it = iter(zip(ptrs, sizes))
        for page in (5, 6):
            for layers in ([[l] for l in range(L)] if layout == "layer_first" else [None]):
                for name, dim in g.comps():
                    ptr, size = next(it)
                    assert ref.covers_exactly(ref.element_addrs(g, layout, bases[name], dim, page, layers=layers), B, ptr, size)


def test_sglangs_own_size_probe_works():
    # HostKVCache.get_page_buffer_element_size calls get_page_buffer_meta(torch.zeros(page_size)).
    host = AsymHost("page_first_direct")
    pws.patch_host_pool(host)
    assert host.get_page_buffer_meta(TorchishIndices([0] * P))[1] == [L * P * 4 * 12 * B, L * P * 4 * 8 * B]
    # Strict checks refuse it (slot 1 of the page is 0, not 1): that is why "sglang" is the default.
    host = AsymHost("page_first_direct")
    pws.patch_host_pool(host, checks="strict")
    with pytest.raises(LayoutError) as e:
        host.get_page_buffer_meta(TorchishIndices([0] * P))
    assert e.value.code == "non_consecutive"
    assert host.get_page_buffer_meta(slots([2]))[0][0] == host.k_buffer.data_ptr() + 2 * P * L * 4 * 12 * B


def test_bad_indices_raise_layout_errors():
    host = MHAHost("page_first")
    pws.patch_host_pool(host)
    with pytest.raises(LayoutError, match="not a multiple of the page size"):
        host.get_page_buffer_meta([0, 1, 2])
    with pytest.raises(LayoutError, match="beyond the capacity"):
        host.get_page_buffer_meta(slots([16]))
    with pytest.raises(LayoutError, match="negative"):
        host.get_page_buffer_meta(np.array([-4, 0, 0, 0]))
    # A misaligned first slot gives SGLang's (in-bounds) pointer under SGLang's checks...
    g, bases = geo_and_bases(host)
    assert host.get_page_buffer_meta([5, 6, 7, 8]) == ref.sglang_meta(g, "page_first", bases, [5, 6, 7, 8])
    # ...but not in a layout SGLang refuses, where there is no SGLang answer to copy.
    host = AsymHost("page_head")
    pws.patch_host_pool(host)
    with pytest.raises(LayoutError, match="not a multiple of the page size") as e:
        host.get_page_buffer_meta([5, 6, 7, 8])
    assert e.value.code == "misaligned"


def test_geometry_of_reads_sglangs_attributes():
    g = pws.geometry_of(AsymHost("page_first"))
    assert (g.kind, g.layers, g.page_size, g.capacity, g.heads, g.head_dim, g.v_head_dim, g.dtype_bytes) == ("mha-split", L, P, S, 4, 12, 8, 2)
    assert pws.geometry_of(MHAHost("page_first")).kind == "mha"
    m = MLAHost("page_first")
    del m.kv_cache_dim  # older pools: kv_lora_rank + qk_rope_head_dim
    assert pws.geometry_of(m).kv_dim == 16
    h = MHAHost("page_first")
    del h.v_head_dim  # pools that predate v_head_dim
    assert pws.geometry_of(h).kind == "mha"
    h = MHAHost("page_first")
    h.dtype = "torch.float8_e4m3fn"  # a dtype without itemsize: by name
    h.kv_buffer = Tensor(h.kv_buffer.ptr, None, halves=L * S * 4 * 8 * 1)
    assert pws.geometry_of(h).dtype_bytes == 1


def test_host_pool_errors():
    h = MHAHost("page_first_kv_split")
    with pytest.raises(LayoutError, match="not one pagewire models") as e:
        pws.patch_host_pool(h)
    assert e.value.code == "host_pool"
    m = MLAHost("page_first")
    m.dcp_size = 2
    with pytest.raises(LayoutError, match="dcp_size=2"):
        pws.patch_host_pool(m)
    with pytest.raises(LayoutError, match="layout page_head is not possible for a mla pool"):
        pws.patch_host_pool(MLAHost("page_head"))
    h = MHAHost("page_first")
    h.head_num = 8  # read wrong: the buffer holds 4 heads
    with pytest.raises(LayoutError, match="kv_buffer holds .* bytes, but the pool's geometry needs"):
        pws.patch_host_pool(h)
    h = MHAHost("page_first")
    h.kv_buffer = Tensor(h.kv_buffer.ptr, halves=L * S * 4 * 8 * B)  # no size: V's address tells
    h.head_num = 8
    with pytest.raises(LayoutError, match="does not match the buffers"):
        pws.patch_host_pool(h)
    h = AsymHost("page_first")
    h.kv_buffer = (h.kv_buffer[0], Tensor(0x7F2000000000, 6))
    with pytest.raises(LayoutError, match="v_buffer holds 6 bytes"):
        pws.patch_host_pool(h)
    h = MHAHost("page_first")
    del h.layer_num
    with pytest.raises(LayoutError, match="no attribute 'layer_num'"):
        pws.patch_host_pool(h)
    h = MHAHost("page_first")
    h.dtype = object()
    h.kv_buffer = Tensor(0x1000, halves=0x100)
    with pytest.raises(LayoutError, match="element size of dtype"):
        pws.patch_host_pool(h)
    h = AsymHost("page_first")
    h.kv_buffer = (Tensor(0x1000), object())
    with pytest.raises(LayoutError, match="v_buffer has no data_ptr"):
        pws.patch_host_pool(h)


def test_unpatch_restores_the_class_methods():
    h = MHAHost("page_first")
    pool = pws.patch_host_pool(h)
    assert h._pagewire_pool is pool
    pws.unpatch_host_pool(h)
    with pytest.raises(AssertionError, match="must be replaced"):
        h.get_page_buffer_meta([0, 1, 2, 3])
    assert not hasattr(h, "_pagewire_pool")
    assert MHAHost.get_page_buffer_meta is not None  # the class was never touched


def test_mla_gets_no_split_heads_method():
    h = MLAHost("page_first")
    pws.patch_host_pool(h)
    assert "get_page_buffer_meta" in h.__dict__
    assert not hasattr(h, "get_split_heads_page_buffer_meta")


def test_pool_of_does_not_patch():
    h = MHAHost("page_head")
    pool = pws.pool_of(h, checks="strict")
    assert pool.checks == "strict" and pool.k_base == h.kv_buffer.data_ptr()
    assert "get_page_buffer_meta" not in h.__dict__


def test_module_doctest():
    assert doctest.testmod(pws).failed == 0
