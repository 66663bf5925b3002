"""Brute-force references for the layout tests (pure Python and numpy, no pagewire).

Two independent models:

* ``sglang_meta`` / ``sglang_split_heads``: the pointer formulas of SGLang's host pools
  (``get_page_buffer_meta``, ``get_split_heads_page_buffer_meta``) written out from their
  specification, plus the same formulas with V's own head dim where SGLang refuses.
* ``element_addrs``: every element's byte address from the row-major shape of each layout,
  so that an entry can be checked to cover exactly the bytes of its page (and layer, or
  head group) and nothing else.
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


class Geo:
    """Plain geometry numbers: L, P, H, D, Dv (0 for MLA), C (MLA), b, S."""

    def __init__(self, kind, L, P, b, S, H=1, D=0, Dv=None, C=0):
        self.kind, self.L, self.P, self.b, self.S = kind, L, P, b, S
        self.N = S // P
        if kind == "mla":
            self.H, self.D, self.Dv = 1, C, 0
        else:
            self.H, self.D, self.Dv = H, D, D if Dv is None else Dv
        self.C = C

    def comps(self):
        """(name, dim) per buffer, in SGLang's order."""
        if self.kind == "mla":
            return [("kv", self.C)]
        return [("k", self.D), ("v", self.Dv)]

    def row(self, dim):
        return self.H * dim * self.b


def page_starts(indices, P):
    return [indices[i] for i in range(0, len(indices), P)]


def sglang_meta(g: Geo, layout, bases, indices):
    """``(ptrs, sizes)`` by SGLang's formulas. ``bases`` maps a buffer name to its address
    (for the symmetric pool V is ``bases['k'] + V_OFF``)."""
    ptrs, sizes = [], []
    L, P, S, b = g.L, g.P, g.S, g.b
    for t0 in page_starts(list(indices), P):
        if g.kind == "mha-split" and layout == "page_first_direct":
            unit = (t0 // P) * P  # the asymmetric pool floors to the page start
        else:
            unit = t0
        if layout == "layer_first":
            for l in range(L):
                for name, dim in g.comps():
                    row = g.row(dim)
                    ptrs.append(bases[name] + t0 * row + l * S * row)
                    sizes.append(P * row)
        else:
            for name, dim in g.comps():
                row = g.row(dim)
                ptrs.append(bases[name] + unit * L * row)
                sizes.append(L * P * row)
    return ptrs, sizes


def sglang_split_heads(g: Geo, bases, indices, factor):
    """SGLang's split-heads formula (page_head), with V's own dim for mha-split."""
    ptrs, sizes = [], []
    L, P, b, H = g.L, g.P, g.b, g.H
    hg = H // factor
    for t0 in page_starts(list(indices), P):
        for gi in range(factor):
            for name, dim in g.comps():
                ptrs.append(bases[name] + t0 * L * H * dim * b + gi * hg * P * L * dim * b)
                sizes.append(L * b * P * H * dim // factor)
    return ptrs, sizes


def _shape_and_index(g: Geo, layout, dim, t, l, h, d):
    P, L, S, N, H = g.P, g.L, g.S, g.N, g.H
    p, o = t // P, t % P
    if layout == "layer_first":
        return (L, S, H, dim), (l, t, h, d)
    if layout == "page_first":
        return (S, L, H, dim), (t, l, h, d)
    if layout == "page_first_direct":
        return (N, L, P, H, dim), (p, l, o, h, d)
    if layout == "page_head":
        return (N, H, P, L, dim), (p, h, o, l, d)
    raise ValueError(layout)


def element_addrs(g: Geo, layout, base, dim, page, layers=None, heads=None):
    """Sorted byte addresses of element 0-bytes of (page, layers, heads, all dims) of one
    buffer at ``base``."""
    layers = range(g.L) if layers is None else layers
    heads = range(g.H) if heads is None else heads
    t = np.arange(page * g.P, (page + 1) * g.P)
    T, Lx, Hx, Dx = np.meshgrid(t, np.array(list(layers)), np.array(list(heads)), np.arange(dim), indexing="ij")
    shape, idx = _shape_and_index(g, layout, dim, T, Lx, Hx, Dx)
    flat = np.ravel_multi_index(idx, shape)
    return np.sort(base + flat.ravel() * g.b)


def covers_exactly(addrs, b, ptr, size):
    """Whether elements at ``addrs`` (``b`` bytes each) fill ``[ptr, ptr+size)`` exactly."""
    addrs = np.asarray(addrs)
    return (
        len(addrs) * b == size
        and int(addrs[0]) == ptr
        and int(addrs[-1]) + b == ptr + size
        and len(np.unique(addrs)) == len(addrs)
    )


def page_runs(src_pages, dst_pages):
    """SGLang's ``group_concurrent_contiguous``: runs consecutive on both sides."""
    runs = []
    for s, d in zip(src_pages, dst_pages):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def pd_plan(layers_params, src_pages, dst_pages):
    """SGLang's ``_send_kvcache_generic`` blocks for ``[(src, dst, item_len), ...]``."""
    out = []
    runs = page_runs(src_pages, dst_pages)
    for src, dst, item in layers_params:
        for s, d, n in runs:
            out.append((src + s * item, dst + d * item, item * n))
    return out
