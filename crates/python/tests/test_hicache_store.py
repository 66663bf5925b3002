"""pagewire.sglang.PagewireStore, SGLang's HiCache L3 backend on the pagewire store, with
fake host pools (SGLang's attribute names over real memory, no torch): in every host
layout, for MHA, MHA with head_dim != v_head_dim and MLA, pages one instance writes come
back byte-exact into another instance's pool, and nothing else of that pool changes.
Plus split heads, SGLang's key names, the dynamic-backend loading path, and errors.
"""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

import pagewire.sglang as pws
from pagewire.sglang import PagewireStore

from store_helpers import Cluster, addr, buffer

L, P, S, B = 2, 4, 64, 2  # layers, page size, capacity in token slots, bytes per element


class Tensor:
    """What SGLang's host pool exposes of a tensor: ``data_ptr()`` and its size."""

    def __init__(self, mem: np.ndarray) -> None:
        self.mem = mem

    def data_ptr(self) -> int:
        return addr(self.mem)

    @property
    def nbytes(self) -> int:
        return self.mem.nbytes


class Dtype:
    itemsize = 2


def _fill(mem: np.ndarray, seed: int) -> None:
    if seed:
        mem[:] = np.random.default_rng(seed).integers(1, 256, mem.nbytes, dtype=np.uint8)


class MHAHost:
    """MHATokenToKVPoolHost: one kv_buffer, K half then V half."""

    def __init__(self, layout: str, seed: int = 0, H: int = 4, D: int = 8) -> None:
        self.layout, self.layer_num, self.page_size, self.size = layout, L, P, S
        self.head_num, self.head_dim, self.v_head_dim, self.dtype = H, D, D, Dtype()
        self.mem = buffer(2 * L * S * H * D * B)
        _fill(self.mem, seed)
        self.kv_buffer = Tensor(self.mem)


class AsymHost:
    """AsymmetricMHATokenToKVPoolHost (head_dim 12, v_head_dim 8): separate K and V."""

    def __init__(self, layout: str, seed: int = 0, H: int = 4, D: int = 12, Dv: int = 8) -> None:
        self.layout, self.layer_num, self.page_size, self.size = layout, L, P, S
        self.head_num, self.head_dim, self.v_head_dim, self.dtype = H, D, Dv, Dtype()
        k, v = buffer(L * S * H * D * B), buffer(L * S * H * Dv * B)
        _fill(k, seed)
        _fill(v, seed + 1 if seed else 0)
        self.k_mem, self.v_mem = k, v
        self.kv_buffer = (Tensor(k), Tensor(v))


class MLAHost:
    """MLATokenToKVPoolHost (latent 10 + rope 6)."""

    def __init__(self, layout: str, seed: int = 0) -> None:
        self.layout, self.layer_num, self.page_size, self.size = layout, L, P, S
        self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dim = 10, 6, 16
        self.dtype, self.dcp_size = Dtype(), 1
        self.mem = buffer(L * S * 16 * B)
        _fill(self.mem, seed)
        self.kv_buffer = Tensor(self.mem)


def mems(host) -> list:
    return [host.k_mem, host.v_mem] if isinstance(host, AsymHost) else [host.mem]


def config(master: str, mla: bool = False, **kw) -> SimpleNamespace:
    """An HiCacheStorageConfig as SGLang builds it (the fields PagewireStore reads)."""
    extra = {
        "backend_name": "pagewire",
        "module_path": "pagewire.sglang",
        "class_name": "PagewireStore",
        "interface_v1": 1,
        "master_server_address": master,
        "protocol": "tcp",
        "global_segment_size": 0,
        "local_hostname": "127.0.0.1",
    }
    extra.update(kw.pop("extra", {}))
    base = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="fake/model", tp_lcm_size=None, should_split_heads=False,
        extra_config=extra,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(nodes=2, segment=32 << 20)
    yield c
    c.close()


def slots(pages):
    return np.array([p * P + t for p in pages for t in range(P)], dtype=np.int64)


def page_bytes(pool, pages):
    """Every (ptr, len) segment of these pages in the pool, SGLang's order."""
    ptrs, lens = pool.page_meta(slots(pages), as_lists=True)
    return list(zip(ptrs, lens))


def check_copied(src_host, dst_host, src_pool, dst_pool, src_pages, dst_pages) -> None:
    """Each destination page equals its source page; every other byte of the destination
    pool is still zero."""
    import ctypes

    for sp, dp in zip(src_pages, dst_pages):
        for (a, n), (b, m) in zip(page_bytes(src_pool, [sp]), page_bytes(dst_pool, [dp])):
            assert n == m
            assert ctypes.string_at(a, n) == ctypes.string_at(b, m), f"page {sp} -> {dp}"
    touched = np.zeros(0, dtype=bool)
    for mem in mems(dst_host):
        mask = np.zeros(mem.nbytes, dtype=bool)
        base = addr(mem)
        for b, m in page_bytes(dst_pool, dst_pages):
            if base <= b < base + mem.nbytes:
                mask[b - base : b - base + m] = True
        assert not mem[~mask].any(), "bytes outside the pages read were written"
        touched = np.concatenate([touched, mask])
    assert touched.any()


HOSTS = [
    ("mha", MHAHost, ["layer_first", "page_first", "page_first_direct", "page_head"]),
    ("mha-split", AsymHost, ["layer_first", "page_first", "page_first_direct", "page_head"]),
    ("mla", MLAHost, ["layer_first", "page_first", "page_first_direct"]),
]
CASES = [(kind, cls, layout) for kind, cls, layouts in HOSTS for layout in layouts]


@pytest.mark.parametrize("kind,cls,layout", CASES, ids=[f"{k}-{l}" for k, _, l in CASES])
def test_pages_round_trip_between_instances(cluster, kind, cls, layout):
    mla = kind == "mla"
    writer = PagewireStore(config(cluster.address, mla), {})
    reader = PagewireStore(config(cluster.address, mla), {})
    src, dst = cls(layout, seed=11), cls(layout)
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    keys = [f"{kind}-{layout}-{i:062x}" for i in range(3)]
    src_pages, dst_pages = [3, 7, 2], [0, 5, 9]
    assert reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, slots(src_pages)) == [True] * 3
    assert reader.batch_exists(keys) == 3
    assert reader.batch_exists(keys + ["missing"]) == 3
    assert reader.batch_get_v1(keys, slots(dst_pages)) == [True] * 3
    check_copied(src, dst, writer.pool, reader.pool, src_pages, dst_pages)
    # Writing again skips what exists (and still reports success).
    assert writer.batch_set_v1(keys, slots(src_pages)) == [True] * 3
    # Object sizes: one page's bytes of each component (all layers).
    g = writer.pool.geometry
    sizes = [s for s, _ in writer.store._client.query([keys[0] + suffix for suffix in writer._suffixes()])]
    if mla:
        assert sizes == [L * P * 16 * B]
    else:
        assert sizes == [L * P * g.heads * g.head_dim * B, L * P * g.heads * g.v_head_dim * B]
    writer.close()
    reader.close()


def test_sglang_key_names(cluster):
    s = PagewireStore(config(cluster.address), {})
    assert [k + x for k in ["h"] for x in s._suffixes()] == ["h_0_k", "h_0_v"]
    s.close()
    s = PagewireStore(config(cluster.address, mla=True), {})
    assert s._suffixes() == ["__k"]
    s.close()
    s = PagewireStore(config(cluster.address, tp_rank=3, tp_size=4, pp_rank=1, pp_size=2), {})
    assert s._suffixes() == ["_3_1_k", "_3_1_v"]
    s.close()
    s = PagewireStore(config(cluster.address, mla=True, pp_rank=1, pp_size=2), {})
    assert s._suffixes() == ["_1_k"]
    s.close()
    s = PagewireStore(
        config(cluster.address, tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True), {}
    )
    assert s._suffixes() == ["_2_k", "_2_v", "_3_k", "_3_v"]
    s.close()
    s = PagewireStore(config(cluster.address, extra={"key_prefix": "run7"}), {})
    assert s._tag(["h"]) == ["run7_h"]
    s.close()


@pytest.mark.parametrize("cls", [MHAHost, AsymHost], ids=["mha", "mha-split"])
def test_split_heads_feed_the_ranks_of_a_wider_tp(cluster, cls):
    """A TP-1 writer splits each page's heads for two TP-2 readers (page_head): reader r
    gets heads [2r, 2r+2) of every page under ``{hash}_{r}_k/_v``."""
    writer = PagewireStore(
        config(cluster.address, tp_size=1, tp_lcm_size=2, should_split_heads=True), {}
    )
    src = cls("page_head", seed=5, H=4)
    writer.register_mem_pool_host(src)
    keys = [f"split-{cls.__name__}-{i}" for i in range(2)]
    assert writer.batch_set_v1(keys, slots([1, 4])) == [True, True]
    for r in range(2):
        reader = PagewireStore(config(cluster.address, tp_rank=r, tp_size=2, tp_lcm_size=2), {})
        dst = cls("page_head", H=2)
        reader.register_mem_pool_host(dst)
        assert reader.batch_get_v1(keys, slots([0, 6])) == [True, True]
        sp, dp = writer.pool, reader.pool
        g = sp.geometry
        import ctypes

        for s_page, d_page in [(1, 0), (4, 6)]:
            for comp, dim in [("k", g.head_dim), ("v", g.v_head_dim)]:
                for layer in range(L):
                    for t in range(P):
                        for h in range(2):
                            a = sp.element_addr(comp, s_page * P + t, layer, 2 * r + h, 0)
                            b = dp.element_addr(comp, d_page * P + t, layer, h, 0)
                            assert ctypes.string_at(a, dim * B) == ctypes.string_at(b, dim * B)
        reader.close()
    writer.close()


def test_legacy_calls_and_clear(cluster):
    s = PagewireStore(config(cluster.address), {})
    mem = buffer(8192)
    mem[:4096] = 9
    assert s.store.register_buffer(addr(mem), mem.nbytes) == 0
    assert s.set("legacy-1", None, addr(mem), 4096)
    assert s.store.is_exist("legacy-1") == 1
    # exists() asks about a page (its component keys), as SGLang's Mooncake backend does.
    assert not s.exists("legacy-1")
    assert s.get("legacy-1", addr(mem) + 4096, 4096) == addr(mem) + 4096
    assert (mem[4096:] == 9).all()
    assert s.get("legacy-2", addr(mem) + 4096, 4096) is None
    assert s.batch_set(["legacy-3"], None, [addr(mem)], [4096])
    with pytest.raises(ValueError):
        s.set("x", b"bytes")
    s.clear()
    s.close()


def test_errors(cluster):
    with pytest.raises(ValueError, match="master"):
        PagewireStore(SimpleNamespace(extra_config={}), {})
    with pytest.raises(RuntimeError, match="setup failed"):
        PagewireStore(config("127.0.0.1:1"), {})
    s = PagewireStore(config(cluster.address), {})
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        s.batch_get_v1(["k"], slots([0]))
    with pytest.raises(ValueError):
        s.register_mem_pool_host(MLAHost("page_first"))  # an MLA pool, an MHA config
    s.close()
    s = PagewireStore(config(cluster.address, tp_lcm_size=2, should_split_heads=True), {})
    with pytest.raises(ValueError, match="page_head"):
        s.register_mem_pool_host(MHAHost("page_first"))
    s.close()
    s = PagewireStore(config(cluster.address), {})
    s.register_mem_pool_host(MHAHost("page_first"))
    with pytest.raises(ValueError):
        s.batch_get_v1(["a", "b"], slots([0]))  # two keys, one page
    s.close()


def test_loadable_through_sglangs_dynamic_backend(cluster):
    """SGLang's factory imports ``module_path``, checks that ``class_name`` subclasses its
    ``HiCacheStorage`` and calls ``cls(storage_config, kwargs)``. Run in a fresh process
    with a stand-in ``sglang.srt.mem_cache.hicache_storage`` whose HiCacheStorage has
    SGLang's abstract methods, so the subclass check and the instantiation are real."""
    code = textwrap.dedent(
        f"""
        import importlib, sys, types
        from abc import ABC, abstractmethod
        from types import SimpleNamespace

        class HiCacheStorage(ABC):
            def register_mem_pool_host(self, mem_pool_host):
                self.mem_pool_host = mem_pool_host
            @abstractmethod
            def get(self, key, target_location=None, target_sizes=None): ...
            @abstractmethod
            def batch_get(self, keys, target_locations=None, target_sizes=None): ...
            @abstractmethod
            def set(self, key, value=None, target_location=None, target_sizes=None): ...
            @abstractmethod
            def batch_set(self, keys, values=None, target_locations=None, target_sizes=None): ...
            @abstractmethod
            def exists(self, key): ...

        for name in ["sglang", "sglang.srt", "sglang.srt.mem_cache"]:
            sys.modules[name] = types.ModuleType(name)
        mod = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
        mod.HiCacheStorage = HiCacheStorage
        sys.modules[mod.__name__] = mod

        extra = {{"backend_name": "pagewire", "module_path": "pagewire.sglang",
                 "class_name": "PagewireStore", "interface_v1": 1,
                 "master_server_address": "{cluster.address}", "protocol": "tcp",
                 "global_segment_size": 0}}
        cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
        assert issubclass(cls, HiCacheStorage)
        cfg = SimpleNamespace(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False,
                              should_split_heads=False, tp_lcm_size=None, extra_config=extra)
        backend = cls(cfg, {{}})
        assert backend.batch_exists(["never-written"]) == 0
        backend.close()
        print("LOADED")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "LOADED" in r.stdout, r.stderr[-3000:]


def test_exported_from_pagewire_sglang():
    assert "PagewireStore" in pws.__all__
