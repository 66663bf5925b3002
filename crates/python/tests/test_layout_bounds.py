"""Absurd geometries and requests get a typed LayoutError before anything is allocated.

A ``layer_first`` pool of 2**40 layers used to grow page_meta's lists until the kernel
killed the process (or, under a memory limit, until Rust aborted on the failed
allocation). The checks below run once in this process and once in a child whose address
space is capped at 2 GiB, so that any large allocation would kill the child.
"""

import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from pagewire import Geometry, LayoutError, Pool, pd_connector_plan, plan

CAP = 2 << 30  # bytes of address space for the child


def huge_layers(layout="layer_first"):
    # 2**40 layers of one 1-byte slot: a 2 TiB pool (it could exist), but one page of
    # layer_first page_meta is 2**41 entries (it cannot be returned).
    g = Geometry("mha", layers=2**40, page_size=1, heads=1, head_dim=1, dtype_bytes=1, capacity=1)
    return Pool(g, layout, 0x1000)


def expect(code, call):
    with pytest.raises(LayoutError) as e:
        call()
    assert e.value.code == code, e.value
    assert isinstance(e.value, ValueError)
    return str(e.value)


def check_all():
    pool = huge_layers()
    text = expect("too_many_entries", lambda: pool.page_meta([0]))
    assert "2199023255552 entries" in text and "268435456" in text, text
    expect("too_many_entries", lambda: pool.page_meta([0], as_lists=True))
    expect("too_many_entries", lambda: pool.page_meta(np.array([0], dtype=np.int64)))
    expect("too_many_entries", lambda: pool.page_meta(np.array([0], dtype=np.uint32)))
    expect("too_many_entries", lambda: pool.with_checks("sglang").page_meta(np.array([0], dtype=np.int64)))
    expect("too_many_entries", lambda: pool.page_meta_for_pages([0]))
    expect("too_many_entries", lambda: plan(pool, huge_layers("page_first"), [0], [0]))
    # An empty request is still answered.
    assert [len(x) for x in pool.page_meta([], as_lists=True)] == [0, 0]

    # Split heads: 2**28 heads in 2**28 groups, 2**29 entries for one page.
    g = Geometry("mha", layers=1, page_size=1, heads=2**28, head_dim=1, dtype_bytes=1, capacity=1)
    heads = Pool(g, "page_head", 0x1000)
    expect("too_many_entries", lambda: heads.split_heads_meta([0], 2**28))
    expect("too_many_entries", lambda: heads.split_heads_meta(np.array([0], dtype=np.int64), 2**28))

    # Geometries no address space holds (over 2**57 bytes), or that overflow even u128.
    text = expect(
        "too_large",
        lambda: Geometry("mha", layers=2**40, page_size=1, heads=2**10, head_dim=128, dtype_bytes=2, capacity=1),
    )
    assert "576460752303423488 bytes" in text and "2^57" in text, text
    expect(
        "too_large",
        lambda: Geometry("mla", layers=2**64 - 1, page_size=1, kv_dim=2**64 - 1, dtype_bytes=2**64 - 1, capacity=2**64 - 1),
    )
    # A buffer that would end past 2**64.
    g = Geometry("mla", layers=1, page_size=1, kv_dim=1, dtype_bytes=1, capacity=2**20)
    expect("overflow", lambda: Pool(g, "page_first", 2**64 - 2**19))

    # PD plan: 2**33 per-layer blocks of one page, refused before walking them.
    ptrs = np.full(2**17, 0x1000, dtype=np.uint64)
    expect("too_many_entries", lambda: pd_connector_plan(ptrs, ptrs, np.full(2**17, 8, dtype=np.uint64), list(range(2**16)), list(range(2**16)), kind="flat"))


def test_absurd_requests_raise_layout_error():
    check_all()


def _cap():
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS is Linux's")
def test_absurd_requests_raise_under_a_memory_cap():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    code = "import test_layout_bounds as t; t.check_all(); print('ok')"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        env=env,
        preexec_fn=_cap,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])
