"""pagewire.Geometry, Pool, plan, pd_connector_plan and TransferPlan.

Checked against the worked examples of SGLang's host-pool layouts (E1-E5), SGLang's
pointer formulas written out in ``layout_reference.py``, and a brute-force row-major model
of every layout (each entry covers exactly its elements' bytes).
"""

import array
import itertools
import random

import numpy as np
import pytest

import pagewire
from pagewire import Geometry, LayoutError, Pool, TransferPlan, pd_connector_plan, plan

import layout_reference as ref

# The worked examples' pool: L=2, P=4, H=2, D=3, Dv=2, b=2, S=32.
E = dict(layers=2, page_size=4, dtype_bytes=2, capacity=32)


def sym(layout, base=0x1000, **kw):
    return Pool(Geometry("mha", heads=2, head_dim=3, **E), layout, base, **kw)


def asym(layout, **kw):
    g = Geometry("mha", heads=2, head_dim=3, v_head_dim=2, **E)
    return Pool(g, layout, 0x1000, 0x9000, **kw)


def mla(layout, **kw):
    return Pool(Geometry("mla", kv_dim=5, **E), layout, 0x1000, **kw)


def lists(meta):
    ptrs, lens = meta
    return list(map(int, ptrs)), list(map(int, lens))


IDX = list(range(8, 16))  # pages 2 and 3


# ---------------------------------------------------------------------------------------
# Worked examples


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head"])
def test_e1_symmetric_page_major(layout):
    ptrs, lens = sym(layout).page_meta(IDX)
    assert isinstance(ptrs, np.ndarray) and ptrs.dtype == np.uint64
    assert lists((ptrs, lens)) == ([0x10C0, 0x13C0, 0x1120, 0x1420], [96] * 4)
    two = Pool(sym(layout).geometry, layout, 0x1000, 0x9000)
    assert lists(two.page_meta(IDX))[0] == [0x10C0, 0x90C0, 0x1120, 0x9120]


def test_e1_byte_order_differs_per_layout():
    want = {"page_first": 0x1448, "page_first_direct": 0x1460, "page_head": 0x1436, "layer_first": 0x1520}
    for layout, addr in want.items():
        assert sym(layout).element_addr("v", 13, 1, 0, 2) == addr


def test_e2_symmetric_layer_first():
    assert lists(sym("layer_first").page_meta(IDX)) == (
        [0x1060, 0x1360, 0x11E0, 0x14E0, 0x1090, 0x1390, 0x1210, 0x1510],
        [48] * 8,
    )


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_e3_asymmetric_where_sglang_answers(layout):
    pool = asym(layout)
    assert pool.geometry.kind == "mha-split" and pool.sglang_has_meta
    assert lists(pool.page_meta(IDX)) == ([0x10C0, 0x9080, 0x1120, 0x90C0], [96, 64, 96, 64])


def test_e3_asymmetric_layer_first_extension():
    pool = asym("layer_first")
    assert not pool.sglang_has_meta
    assert lists(pool.page_meta(IDX)) == (
        [0x1060, 0x9040, 0x11E0, 0x9140, 0x1090, 0x9060, 0x1210, 0x9160],
        [48, 32] * 4,
    )


def test_e4_split_heads():
    assert lists(sym("page_head").split_heads_meta(IDX, 2)) == (
        [0x10C0, 0x13C0, 0x10F0, 0x13F0, 0x1120, 0x1420, 0x1150, 0x1450],
        [48] * 8,
    )
    pool = asym("page_head")
    assert not pool.sglang_has_split_heads
    assert lists(pool.split_heads_meta(IDX, 2)) == (
        [0x10C0, 0x9080, 0x10F0, 0x90A0, 0x1120, 0x90C0, 0x1150, 0x90E0],
        [48, 32] * 4,
    )
    assert lists(pool.page_meta(IDX))[0] == [0x10C0, 0x9080, 0x1120, 0x90C0]


def test_e5_mla_and_pd_plan():
    for layout in ("page_first", "page_first_direct"):
        assert lists(mla(layout).page_meta(IDX)) == ([0x10A0, 0x10F0], [80, 80])
    assert lists(mla("layer_first").page_meta(IDX)) == ([0x1050, 0x1190, 0x1078, 0x11B8], [40] * 4)
    p = pd_connector_plan(
        [0x100000, 0x110000, 0x120000, 0x130000],
        [0x800000, 0x810000, 0x820000, 0x830000],
        [48, 48, 32, 32],
        [2, 3, 5],
        [10, 11, 20],
    )
    assert list(zip(*(list(map(int, a)) for a in (p.srcs, p.dsts, p.lens)))) == [
        (0x100060, 0x8001E0, 96),
        (0x1000F0, 0x8003C0, 48),
        (0x110060, 0x8101E0, 96),
        (0x1100F0, 0x8103C0, 48),
        (0x120040, 0x820140, 64),
        (0x1200A0, 0x820280, 32),
        (0x130040, 0x830140, 64),
        (0x1300A0, 0x830280, 32),
    ]
    assert len(p) == 8 and p.bytes == 2 * (96 + 48) + 2 * (64 + 32)
    assert list(p)[0] == (0x100060, 0x8001E0, 96)


# ---------------------------------------------------------------------------------------
# Every layout and kind against SGLang's formulas and the row-major model

G = dict(L=2, P=4, b=2, S=32)
KINDS = {
    "mha": (ref.Geo("mha", H=4, D=3, **G), dict(heads=4, head_dim=3)),
    "mha-split": (ref.Geo("mha-split", H=4, D=3, Dv=2, **G), dict(heads=4, head_dim=3, v_head_dim=2)),
    "mla": (ref.Geo("mla", C=5, **G), dict(kv_dim=5)),
}
CASES = [(k, lay) for k in KINDS for lay in ref.LAYOUTS if not (k == "mla" and lay == "page_head")]


def make(kind, layout, checks="strict"):
    g, kw = KINDS[kind]
    geo = Geometry("mla" if kind == "mla" else "mha", layers=2, page_size=4, dtype_bytes=2, capacity=32, **kw)
    bases = {"k": 0x10000, "kv": 0x10000, "v": 0x40000 if kind == "mha-split" else 0x10000 + geo.buffer_bytes("k")}
    v = 0x40000 if kind == "mha-split" else None
    return g, bases, Pool(geo, layout, 0x10000, v, checks=checks)


@pytest.mark.parametrize("kind,layout", CASES)
def test_page_meta_matches_sglang_formulas(kind, layout):
    g, bases, pool = make(kind, layout)
    for pages in ([0], [7], [2, 3], [5, 1, 6], list(range(8))):
        idx = [p * 4 + o for p in pages for o in range(4)]
        assert lists(pool.page_meta(idx)) == ref.sglang_meta(g, layout, bases, idx)
        assert lists(pool.page_meta_for_pages(pages)) == ref.sglang_meta(g, layout, bases, idx)
    assert pool.entries_per_page == len(ref.sglang_meta(g, layout, bases, [0, 1, 2, 3])[0])


@pytest.mark.parametrize("kind,layout", CASES)
def test_entries_cover_exactly_their_elements(kind, layout):
    g, bases, pool = make(kind, layout)
    ptrs, lens = lists(pool.page_meta_for_pages(list(range(g.N))))
    it = iter(zip(ptrs, lens))
    for page in range(g.N):
        layer_sets = [[l] for l in range(g.L)] if layout == "layer_first" else [None]
        for layers in layer_sets:
            for name, dim in g.comps():
                ptr, size = next(it)
                addrs = ref.element_addrs(g, layout, bases[name], dim, page, layers=layers)
                assert ref.covers_exactly(addrs, g.b, ptr, size), (page, layers, name)


@pytest.mark.parametrize("kind", ["mha", "mha-split"])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_split_heads_formula_and_coverage(kind, factor):
    g, bases, pool = make(kind, "page_head")
    pages = [3, 0, 6]
    idx = [p * 4 + o for p in pages for o in range(4)]
    got = lists(pool.split_heads_meta(idx, factor))
    assert got == ref.sglang_split_heads(g, bases, idx, factor)
    it = iter(zip(*got))
    hg = g.H // factor
    for page in pages:
        for grp in range(factor):
            for name, dim in g.comps():
                ptr, size = next(it)
                addrs = ref.element_addrs(g, "page_head", bases[name], dim, page, heads=range(grp * hg, (grp + 1) * hg))
                assert ref.covers_exactly(addrs, g.b, ptr, size)


def test_sglang_checks_give_sglangs_pointer_for_a_misaligned_page():
    g, bases, pool = make("mha", "page_first_direct", checks="sglang")
    idx = [5, 0, 0, 0]  # only the first slot is read
    assert lists(pool.page_meta(idx)) == ref.sglang_meta(g, "page_first_direct", bases, idx)
    assert lists(pool.page_meta(np.array(idx))) == ref.sglang_meta(g, "page_first_direct", bases, idx)
    g, bases, pool = make("mha-split", "page_first_direct", checks="sglang")
    assert lists(pool.page_meta(idx)) == ref.sglang_meta(g, "page_first_direct", bases, idx)
    # SGLang's own probe: torch.zeros(page_size) to learn an entry's size.
    assert lists(pool.page_meta(np.zeros(4, dtype=np.int64)))[1] == [96 * 2, 64 * 2]
    with pytest.raises(LayoutError) as e:
        make("mha", "page_first_direct")[2].page_meta([0, 0, 0, 0])
    assert e.value.code == "non_consecutive"


# ---------------------------------------------------------------------------------------
# Index inputs: every form gives the same answer; arrays read in place agree with lists


class TensorLike:
    """Like a CPU torch tensor: no buffer protocol, ``__array__`` and ``tolist``."""

    def __init__(self, values):
        self.values = np.asarray(values, dtype=np.int64)

    def __array__(self, dtype=None, copy=None):
        return self.values

    def tolist(self):
        return self.values.tolist()

    def __len__(self):
        return len(self.values)


class ToListOnly:
    def __init__(self, values):
        self.values = list(values)

    def tolist(self):
        return list(self.values)


@pytest.mark.parametrize(
    "make_input",
    [
        list,
        tuple,
        lambda v: (x for x in v),
        lambda v: np.array(v, dtype=np.int64),
        lambda v: np.array(v, dtype=np.uint64),
        lambda v: np.array(v, dtype=np.int32),
        lambda v: np.array(v, dtype=np.uint16),
        lambda v: np.array([x for x in v for _ in (0, 1)], dtype=np.int64)[::2],  # strided
        lambda v: np.array(v, dtype=np.int64)[::-1][::-1],
        lambda v: array.array("q", v),
        lambda v: array.array("I", v),
        lambda v: memoryview(array.array("l", v)),
        lambda v: bytes(v),
        TensorLike,
        ToListOnly,
    ],
)
def test_index_forms(make_input):
    pool = sym("page_first")
    want = ([0x10C0, 0x13C0, 0x1120, 0x1420], [96] * 4)
    assert lists(pool.page_meta(make_input(IDX))) == want
    assert lists(pool.with_checks("sglang").page_meta(make_input(IDX))) == want


def _random_request(rng, n_pages, P, S):
    pages = rng.sample(range(S // P), n_pages)
    idx = [p * P + o for p in pages for o in range(P)]
    if idx and rng.random() < 0.5:
        pos = rng.randrange(len(idx))
        idx[pos] = rng.choice([idx[pos] + 1, idx[pos] + P, 0, S + 3, idx[pos] ^ 1])
    return idx


def _outcome(f):
    try:
        return lists(f())
    except LayoutError as e:
        return (e.code, str(e))


@pytest.mark.parametrize("P", [4, 3])
@pytest.mark.parametrize("checks", ["strict", "sglang"])
@pytest.mark.parametrize("layout", ref.LAYOUTS)
def test_in_place_reads_agree_with_list_path(checks, layout, P):
    """Arrays take the fast paths (one pass over the caller's memory, chunk by chunk for
    long ones); lists go through the crate's token-slot code directly. Same answers, same
    errors, including positions beyond the first chunk."""
    rng = random.Random(7)
    S = P * 8192
    geo = Geometry("mha", layers=2, page_size=P, heads=2, head_dim=3, v_head_dim=2, dtype_bytes=2, capacity=S)
    pool = Pool(geo, layout, 0x100000, 0x10000000, checks=checks)
    for n_pages in (0, 1, 3, 100, 5000):
        for _ in range(3):
            idx = _random_request(rng, n_pages, P, S)
            want = _outcome(lambda: pool.page_meta(idx))
            for arr in (np.array(idx, dtype=np.int64), np.array(idx, dtype=np.uint32), array.array("Q", idx)):
                assert _outcome(lambda: pool.page_meta(arr)) == want
            if layout == "page_head":
                want = _outcome(lambda: pool.split_heads_meta(idx, 2))
                assert _outcome(lambda: pool.split_heads_meta(np.array(idx), 2)) == want


def _strict_accepts(idx, P, S):
    """Brute force, slot by slot: strict checks accept exactly whole pages of consecutive,
    page-aligned, non-negative slots inside the pool."""
    if len(idx) % P:
        return False
    for k in range(0, len(idx), P):
        t0 = idx[k]
        if t0 < 0 or t0 % P or t0 + P > S:
            return False
        if any(idx[k + j] != t0 + j for j in range(P)):
            return False
    return True


@pytest.mark.parametrize("checks", ["strict", "sglang"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_vectorised_slot_check_is_the_per_slot_check(layout, checks):
    """Long int64 arrays take the vectorised one-pass check (without the GIL); a list takes
    the crate's slot-by-slot code. Same lists or the same error for one bad slot anywhere:
    a misaligned (but consecutive) page, a wrong slot in the middle, at the last position
    of the last page, negative values (also a run that crosses into them), pages outside
    the pool. Under strict checks, accepted exactly when the brute force accepts."""
    rng = random.Random(11)
    P, n_pages = 64, 700  # 44,800 slots: above the GIL-release threshold
    S = P * 2048
    geo = Geometry("mha", layers=2, page_size=P, heads=2, head_dim=3, v_head_dim=2, dtype_bytes=2, capacity=S)
    pool = Pool(geo, layout, 0x100000, 0x10000000, checks=checks)
    good = [p * P + o for p in rng.sample(range(S // P), n_pages) for o in range(P)]
    last = len(good) - 1
    mutations = {
        "none": lambda v: None,
        "misaligned page": lambda v: v.__setitem__(slice(P * 5, P * 6), range(P * 9 + 3, P * 10 + 3)),
        "misaligned last page": lambda v: v.__setitem__(slice(last - P + 1, last + 1), range(7, 7 + P)),
        "middle slot": lambda v: v.__setitem__(len(v) // 2 + 5, v[len(v) // 2 + 5] + 1),
        "last slot": lambda v: v.__setitem__(last, v[last] + 1),
        "first slot of last page": lambda v: v.__setitem__(last - P + 1, v[last - P + 1] - P),
        "negative slot": lambda v: v.__setitem__(last - 3, -5),
        "negative first slot": lambda v: v.__setitem__(P * 3, -P),
        "negative page": lambda v: v.__setitem__(slice(P * 2, P * 3), range(-P, 0)),
        "run into negatives": lambda v: v.__setitem__(slice(0, P), range(2**63 - 2, 2**63 - 2 + P)),
        "page past the end": lambda v: v.__setitem__(slice(P, 2 * P), range(S, S + P)),
        "page across the end": lambda v: v.__setitem__(slice(P, 2 * P), range(S - P // 2, S + P // 2)),
    }
    for name, mutate in mutations.items():
        idx = list(good)
        mutate(idx)
        wrapped = [x - 2**64 if x >= 2**63 else x for x in idx]  # int64 reading of the slots
        got = _outcome(lambda: pool.page_meta(np.array(wrapped, dtype=np.int64)))
        if checks == "sglang":
            # Only first slots are read: a negative one is an error, the others are not.
            wrapped = [x if k % P == 0 else abs(x) for k, x in enumerate(wrapped)]
        if any(x < 0 for x in wrapped):
            # A list cannot hold a negative slot for the crate: the array path names it.
            assert got[0] == "invalid_argument" and "negative" in got[1], name
        else:
            assert got == _outcome(lambda: pool.page_meta(wrapped)), name
            if checks == "strict":
                assert isinstance(got[0], list) == _strict_accepts(wrapped, P, S), name


def test_results_survive_later_calls():
    """Result arrays own their memory until they are dropped: a later call may reuse the
    memory of dropped results, never of live ones (or of views that keep them alive)."""
    P = 64
    geo = Geometry("mha", layers=2, page_size=P, heads=2, head_dim=3, dtype_bytes=2, capacity=P * 4096)
    pool = Pool(geo, "page_first", 0x100000)
    a = np.arange(2000 * P, dtype=np.int64)
    b = a[: 1000 * P] + 3000 * P
    first = pool.page_meta(a)
    keep = [x.copy() for x in first]
    view = first[0][::2]
    for _ in range(3):
        second = pool.page_meta(b)
        assert lists(second) == lists(pool.page_meta(b.tolist()))
        del second
    assert all((x == k).all() for x, k in zip(first, keep))
    del first
    pool.page_meta(a)
    assert (view == keep[0][::2]).all()


def test_negative_and_bad_index_values():
    pool = sym("page_first")
    for bad in ([8, 9, 10, -1], np.array([8, 9, 10, -1]), array.array("b", [8, 9, 10, -1])):
        with pytest.raises(LayoutError, match=r"indices\[3\] .*negative|indices\[3\] must be"):
            pool.page_meta(bad)
    with pytest.raises(LayoutError, match="one-dimensional"):
        pool.page_meta(np.arange(8).reshape(2, 4))
    with pytest.raises(TypeError):
        pool.page_meta([8.0, 9, 10, 11])
    with pytest.raises(TypeError):
        pool.page_meta(np.array([8.5, 9, 10, 11]))
    with pytest.raises(TypeError):
        pool.page_meta(12)
    with pytest.raises(LayoutError):
        pool.page_meta([2**64, 1, 2, 3])


def test_results_are_read_only_views():
    ptrs, lens = sym("page_first").page_meta(IDX)
    assert not ptrs.flags.writeable and not lens.flags.writeable
    with pytest.raises(ValueError):
        ptrs[0] = 0
    p = pd_connector_plan([0x1000], [0x2000], [16], [1, 2], [3, 4], kind="flat")
    assert p.srcs is p.srcs  # one view per array, made once
    assert not p.srcs.flags.writeable and not p.srcs.flags.owndata
    assert p.srcs.base is not None


def test_as_lists_gives_sglangs_types():
    ptrs, lens = sym("layer_first").page_meta(np.array(IDX), as_lists=True)
    assert type(ptrs) is list and type(lens) is list
    assert all(type(x) is int for x in ptrs + lens)
    ptrs, lens = sym("page_head").split_heads_meta(IDX, 2, as_lists=True)
    assert type(ptrs) is list and all(type(x) is int for x in ptrs)


# ---------------------------------------------------------------------------------------
# Errors: LayoutError (a PagewireError and a ValueError) with a code and a clear message


def test_layout_error_class():
    assert issubclass(LayoutError, pagewire.PagewireError)
    assert issubclass(LayoutError, ValueError)
    assert pagewire.errors.LayoutError is LayoutError
    assert LayoutError.__module__ == "pagewire.errors"


@pytest.mark.parametrize(
    "call,code,text",
    [
        (lambda: sym("page_first").page_meta([8, 9, 10]), "index_count", "index count 3 is not a multiple of the page size 4"),
        (lambda: sym("page_first").page_meta([9, 10, 11, 12]), "misaligned", "page #0 starts at slot 9"),
        (lambda: sym("page_first").page_meta([8, 9, 10, 11, 12, 13, 15, 14]), "non_consecutive", "page #1: slot 15 at offset 2 should be 14"),
        (lambda: sym("page_first").page_meta([32, 33, 34, 35]), "slot_out_of_range", "token slot 32 is beyond the capacity of 32"),
        (lambda: sym("page_first").page_meta_for_pages([8]), "page_out_of_range", "page 8 is beyond the pool's 8 pages"),
        (lambda: sym("page_first").split_heads_meta(IDX, 2), "split_heads_layout", "split heads need the page_head layout"),
        (lambda: sym("page_head").split_heads_meta(IDX, 3), "split_factor", "split factor 3 does not divide the 2 heads"),
        (lambda: sym("page_head").split_heads_meta(IDX, 0), "split_factor", "split factor 0"),
        (lambda: mla("page_head"), "unsupported_layout", "layout page_head is not possible for a mla pool"),
        (lambda: sym("page_sideways"), "unknown_layout", "unknown layout"),
        (lambda: Geometry("gqa", layers=1, page_size=1, dtype_bytes=1, capacity=1), "unknown_pool_kind", "unknown pool kind"),
        (lambda: Geometry("mha", layers=0, page_size=4, heads=1, head_dim=1, dtype_bytes=2, capacity=8), "invalid_geometry", "invalid layers = 0"),
        (lambda: Geometry("mha", layers=1, page_size=4, heads=1, head_dim=1, dtype_bytes=2, capacity=10), "invalid_geometry", "capacity = 10: must be a multiple of the page size"),
        (lambda: Geometry("mha", layers=1, page_size=4, head_dim=1, dtype_bytes=2, capacity=8), "missing_field", "heads is required"),
        (lambda: Geometry("mla", layers=1, page_size=4, heads=2, kv_dim=8, dtype_bytes=2, capacity=8), "extra_field", "heads = 2 does not apply to a mla pool"),
        (lambda: Geometry("mha", layers=-1, page_size=4, heads=1, head_dim=1, dtype_bytes=2, capacity=8), "invalid_argument", "layers must be in 0..2**64, got -1"),
        (lambda: Pool(asym("page_first").geometry, "page_first", 0x1000), "base", "needs a V base"),
        (lambda: Pool(sym("page_first").geometry, "page_first", 0x1000, 0x1100), "base", "overlap"),
        (lambda: Pool(sym("page_first").geometry, "page_first", 2**64 - 16), "overflow", "overflow"),
        (lambda: sym("page_first", checks="loose"), "invalid_argument", "unknown checks"),
        (lambda: sym("page_first").element_addr("latent", 0, 0), "invalid_argument", "unknown component"),
        (lambda: sym("page_first").element_addr("k", 0, 2), "index_out_of_range", "layer 2 is out of range"),
    ],
)
def test_errors(call, code, text):
    with pytest.raises(LayoutError) as e:
        call()
    assert e.value.code == code
    assert text in str(e.value)


def test_numpy_integers_are_ints():
    g = Geometry("mha", layers=np.int64(2), page_size=np.uint32(4), heads=2, head_dim=3, dtype_bytes=2, capacity=32)
    p = Pool(g, "page_first", np.uint64(0x1000))
    assert lists(p.page_meta(IDX))[0][0] == 0x10C0
    with pytest.raises(LayoutError, match="must be in 0..2"):
        Pool(g, "page_first", np.int64(-1))


def test_type_errors():
    with pytest.raises(TypeError):
        Geometry("mha", layers=1.0, page_size=4, heads=1, head_dim=1, dtype_bytes=2, capacity=8)
    with pytest.raises(TypeError):
        Geometry("mha", layers=True, page_size=4, heads=1, head_dim=1, dtype_bytes=2, capacity=8)
    with pytest.raises(TypeError):
        Pool(sym("page_first").geometry, "page_first", "0x1000")


# ---------------------------------------------------------------------------------------
# Geometry and Pool attributes


def test_geometry_attributes():
    g = Geometry("mha", heads=2, head_dim=3, v_head_dim=2, **E)
    assert (g.kind, g.layers, g.page_size, g.heads, g.head_dim, g.v_head_dim, g.kv_dim) == ("mha-split", 2, 4, 2, 3, 2, None)
    assert (g.dtype_bytes, g.capacity, g.pages, g.bytes_per_token) == (2, 32, 8, 2 * (12 + 8))
    assert g.components == ["k", "v"]
    assert (g.row_bytes("k"), g.row_bytes("v"), g.layer_page_bytes("v"), g.page_bytes("k")) == (12, 8, 32, 96)
    assert g.buffer_bytes("k") == 768
    m = Geometry("mla", kv_dim=5, **E)
    assert (m.kind, m.heads, m.head_dim, m.kv_dim, m.components) == ("mla", None, None, 5, ["kv"])
    assert m.page_bytes("kv") == m.page_bytes("k") == 80
    assert Geometry("mha", heads=2, head_dim=3, v_head_dim=3, **E).kind == "mha"
    assert Geometry("mha-split", heads=2, head_dim=3, **E).kind == "mha-split"
    assert g == Geometry("mha", heads=2, head_dim=3, v_head_dim=2, **E) and hash(g) == hash(Geometry("mha-split", heads=2, head_dim=3, v_head_dim=2, **E))
    assert "mha-split" in repr(g)


def test_pool_attributes():
    p = sym("page_head")
    assert (p.layout, p.checks, p.k_base, p.v_base) == ("page_head", "strict", 0x1000, 0x1300)
    assert p.buffers == [(0x1000, 768), (0x1300, 768)]
    assert p.sglang_has_meta and p.sglang_has_split_heads and p.entries_per_page == 2
    assert sym("layer_first").entries_per_page == 4
    assert mla("page_first").v_base is None and mla("page_first").buffers == [(0x1000, 2 * 32 * 10)]
    assert p.with_checks("sglang").checks == "sglang" and p.with_checks("sglang") != p
    assert p == sym("page_head") and len({p, sym("page_head")}) == 1
    assert "page_head" in repr(p)


# ---------------------------------------------------------------------------------------
# Plans


def _byte_map(p):
    m = {}
    for s, d, n in p:
        for k in range(n):
            assert s + k not in m, "a source byte is sent twice"
            m[s + k] = d + k
    return m


def _pool(kind, layout, base, v=None, S=32):
    g = KINDS[kind][1]
    geo = Geometry("mla" if kind == "mla" else "mha", layers=2, page_size=4, dtype_bytes=2, capacity=S, **g)
    return Pool(geo, layout, base, v)


@pytest.mark.parametrize("src_layout,dst_layout", list(itertools.product(ref.LAYOUTS, repeat=2)))
def test_plan_moves_each_element_to_its_place(src_layout, dst_layout):
    src = _pool("mha-split", src_layout, 0x10000, 0x20000)
    dst = _pool("mha-split", dst_layout, 0x80000, 0x90000, S=64)
    sp, dp = [1, 2, 7], [9, 10, 3]
    p = plan(src, dst, sp, dp)
    assert isinstance(p, TransferPlan)
    m = _byte_map(p)
    assert len(m) == p.bytes == 3 * (src.geometry.page_bytes("k") + src.geometry.page_bytes("v"))
    for s, d in zip(sp, dp):
        for slot, (c, dims) in itertools.product(range(4), [("k", 3), ("v", 2)]):
            for l, h, e in itertools.product(range(2), range(4), range(dims)):
                a = src.element_addr(c, s * 4 + slot, l, h, e)
                b = dst.element_addr(c, d * 4 + slot, l, h, e)
                assert m[a] == b and m[a + 1] == b + 1


def test_plan_heads_and_layers():
    g4 = Geometry("mha", layers=2, page_size=4, heads=4, head_dim=3, dtype_bytes=2, capacity=32)
    g2 = Geometry("mha", layers=2, page_size=4, heads=2, head_dim=3, dtype_bytes=2, capacity=32)
    src = Pool(g4, "page_head", 0x10000)
    dst = Pool(g2, "page_head", 0x80000)
    # Destination TP rank 1 of 2 holds the source's heads 2 and 3.
    p = plan(src, dst, [1], [5], heads=(0, 2))
    m = _byte_map(p)
    assert len(m) == p.bytes == 2 * g2.page_bytes("k")
    for c, slot, l, h, e in itertools.product("kv", range(4), range(2), range(2), range(3)):
        assert m[src.element_addr(c, 4 + slot, l, 2 + h, e)] == dst.element_addr(c, 20 + slot, l, h, e)
    whole = plan(Pool(g2, "page_first", 0x10000), Pool(g2, "layer_first", 0x80000), [0, 1], [2, 3])
    parts = [plan(Pool(g2, "page_first", 0x10000), Pool(g2, "layer_first", 0x80000), [0, 1], [2, 3], layers=r) for r in (range(0, 1), (1, 2))]
    assert _byte_map(whole) == {**_byte_map(parts[0]), **_byte_map(parts[1])}
    with pytest.raises(LayoutError) as e:
        plan(src, dst, [1], [5], heads=(0, 8))
    assert e.value.code == "head_shard"
    with pytest.raises(LayoutError, match="step 1"):
        plan(src, src, [1], [2], layers=range(0, 2, 2))


def test_plan_errors():
    a = _pool("mha", "page_first", 0x10000)
    with pytest.raises(LayoutError) as e:
        plan(a, _pool("mla", "page_first", 0x80000), [1], [1])
    assert e.value.code == "kind_mismatch"
    with pytest.raises(LayoutError) as e:
        plan(a, _pool("mha", "page_first", 0x80000), [1, 2], [1])
    assert e.value.code == "length_mismatch"
    with pytest.raises(LayoutError) as e:
        plan(a, _pool("mha", "page_first", 0x80000), [1, 2], [3, 3])
    assert e.value.code == "duplicate_page"
    with pytest.raises(LayoutError) as e:
        plan(a, _pool("mha", "page_first", 0x80000), [8], [1])
    assert e.value.code == "page_out_of_range"


def _blocks(p):
    return list(zip(*(list(map(int, a)) for a in (p.srcs, p.dsts, p.lens))))


def test_pd_connector_plan_against_sglangs_loop():
    rng = random.Random(3)
    L = 3
    src_k = [0x100000 + 0x10000 * i for i in range(L)]
    src_v = [0x400000 + 0x10000 * i for i in range(L)]
    dst_k = [0x800000 + 0x10000 * i for i in range(L)]
    dst_v = [0xC00000 + 0x10000 * i for i in range(L)]
    items = [48] * L + [32] * L
    for _ in range(20):
        n = rng.randrange(0, 12)
        sp = sorted(rng.sample(range(40), n))
        dp = sorted(rng.sample(range(40), n)) if rng.random() < 0.5 else [x + 7 for x in sp]
        got = _blocks(pd_connector_plan(src_k + src_v, dst_k + dst_v, items, np.array(sp, dtype=np.int32), dp))
        want = ref.pd_plan(list(zip(src_k + src_v, dst_k + dst_v, items)), sp, dp)
        assert got == want


def test_pd_connector_plan_pipeline_stages():
    # Prefill stage holds layers 2..4 of a 6-layer decode: K then V halves sliced.
    sk, sv = [0x1000, 0x2000], [0x3000, 0x4000]
    dk = [0x10000 * (i + 1) for i in range(6)]
    dv = [0x100000 * (i + 1) for i in range(6)]
    p = pd_connector_plan(sk + sv, dk + dv, [8, 8, 4, 4], [1], [2], start_layer=2)
    assert _blocks(p) == [(0x1008, dk[2] + 16, 8), (0x2008, dk[3] + 16, 8), (0x3004, dv[2] + 8, 4), (0x4004, dv[3] + 8, 4)]
    # Decode holds draft layers after the main ones: [K main(2), V main(2), K draft, V draft]
    # (5 layers' worth, not a multiple of 2): V starts at 2 * (5 // 2) = 4.
    d = [0x10000 * (i + 1) for i in range(10)]
    p = pd_connector_plan(sk + sv, d, [8, 8, 4, 4], [0], [0])
    assert [b[1] for b in _blocks(p)] == [d[0], d[1], d[4], d[5]]
    p = pd_connector_plan([0x1000, 0x2000], d[:5], [16, 16], [1], [1], kind="flat", start_layer=3)
    assert _blocks(p) == [(0x1010, d[3] + 16, 16), (0x2010, d[4] + 16, 16)]
    with pytest.raises(LayoutError, match="too few"):
        pd_connector_plan([0x1000, 0x2000], d[:5], [16, 16], [1], [1], kind="flat", start_layer=4)
    with pytest.raises(LayoutError) as e:
        pd_connector_plan([0x1000], [0x2000], [16, 16], [1], [1], kind="flat")
    assert e.value.code == "length_mismatch"
    with pytest.raises(LayoutError) as e:
        pd_connector_plan([0x1000], [0x2000], [0], [1], [1], kind="flat")
    assert e.value.code == "invalid_geometry"
    with pytest.raises(LayoutError, match="K and V halves"):
        pd_connector_plan([0x1000], [0x2000], [16], [1], [1])
    with pytest.raises(LayoutError, match="unknown kind"):
        pd_connector_plan([0x1000], [0x2000], [16], [1], [1], kind="mla")
    with pytest.raises(LayoutError) as e:
        pd_connector_plan([2**64 - 8], [0x2000], [16], [1], [1], kind="flat")
    assert e.value.code == "overflow"


def test_transfer_plan_from_arrays():
    p = TransferPlan([1, 2], np.array([3, 4]), (5, 6))
    assert _blocks(p) == [(1, 3, 5), (2, 4, 6)] and p.bytes == 11 and len(p) == 2
    assert p == TransferPlan([1, 2], [3, 4], [5, 6]) and p != TransferPlan()
    assert len(TransferPlan()) == 0 and TransferPlan().srcs.tolist() == []
    with pytest.raises(LayoutError, match="same length"):
        TransferPlan([1], [2], [])
    assert "len=2" in repr(p)


class DuckPlan:
    """What the transport's submit reads: any object with .srcs, .dsts, .lens."""


def test_plan_arrays_convert_back_without_copy_loss():
    p = plan(_pool("mha", "page_first", 0x10000), _pool("mha", "layer_first", 0x80000), [0, 1], [2, 3])
    q = TransferPlan(p.srcs, p.dsts, p.lens)
    assert q == p


def test_docs_example_runs():
    """The first example of docs/python.md's "Pools and SGLang host pools" section."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[3] / "docs" / "python.md"
    if not doc.exists():
        pytest.skip("docs/python.md is not beside the tests (installed elsewhere)")
    text = doc.read_text()
    section = text[text.index("## Pools and SGLang host pools"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, str(doc), "exec"), {})
