"""Without numpy, the layout API returns lists and still reads buffers in place.

Run in a subprocess where ``import numpy`` fails (``sys.modules["numpy"] = None``), since
pagewire looks numpy up once per process.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # every `import numpy` now raises ImportError
    import array
    import pagewire, pagewire.sglang
    from pagewire import Geometry, LayoutError, Pool, TransferPlan, pd_connector_plan, plan

    g = Geometry("mha", layers=2, page_size=4, heads=2, head_dim=3, dtype_bytes=2, capacity=32)
    pool = Pool(g, "page_first", 0x1000)
    want = ([0x10C0, 0x13C0, 0x1120, 0x1420], [96, 96, 96, 96])
    idx = list(range(8, 16))

    class TensorLike:  # a tensor without numpy: only tolist() helps
        def __array__(self, dtype=None, copy=None):
            raise AssertionError("no numpy to call this")
        def tolist(self):
            return idx

    for form in (idx, tuple(idx), array.array("q", idx), memoryview(array.array("H", idx)), TensorLike()):
        got = pool.page_meta(form)
        assert type(got[0]) is list and type(got[1]) is list, type(got[0])
        assert got == want, got
    assert pool.with_checks("sglang").page_meta(array.array("q", idx)) == want
    assert pool.page_meta_for_pages([2, 3]) == want

    p = pd_connector_plan([0x100000, 0x120000], [0x800000, 0x820000], [48, 32], [2, 3, 5], [10, 11, 20])
    assert type(p.srcs) is list and p.srcs == [0x100060, 0x1000F0, 0x120040, 0x1200A0]
    assert p.srcs is not p.srcs  # a fresh list each time: lists are mutable
    assert p.lens == [96, 48, 64, 32] and p.bytes == 240
    q = plan(pool, Pool(g, "layer_first", 0x8000), [2], [5])
    assert type(q.dsts) is list and len(q) > 0
    assert TransferPlan(array.array("Q", [1]), [2], (3,)).lens == [3]

    try:
        pool.page_meta(array.array("q", [8, 9, 10, -1]))
        raise AssertionError("negative index accepted")
    except LayoutError as e:
        assert "negative" in str(e)

    class Buf:
        def __init__(self, p): self.p = p
        def data_ptr(self): return self.p
    class Host:
        layout, layer_num, page_size, size = "page_head", 2, 4, 32
        head_num, head_dim, v_head_dim = 2, 3, 2
        class dtype: itemsize = 2
        kv_buffer = (Buf(0x1000), Buf(0x9000))
    h = Host()
    pagewire.sglang.patch_host_pool(h)
    assert h.get_split_heads_page_buffer_meta(idx, 2) == (
        [0x10C0, 0x9080, 0x10F0, 0x90A0, 0x1120, 0x90C0, 0x1150, 0x90E0],
        [48, 32] * 4,
    )
    assert pagewire._native._u64_roundtrip(array.array("B", [1, 2])) == [1, 2]
    print("ok")
    """
)


def test_lists_without_numpy():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
