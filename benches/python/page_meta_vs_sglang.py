#!/usr/bin/env python3
"""pagewire's Pool.page_meta against SGLang's own get_page_buffer_meta, side by side.

SGLang's code is not in this repository: the script downloads SGLang's wheel from PyPI
(``pip download sglang==0.5.23 --no-deps``, checked against a pinned SHA-256, cached under
``target/bench-cache``), reads the host-pool modules out of the wheel, and compiles the
bodies of ``get_page_buffer_meta`` (and the helper it calls) on their own with ``ast``.
Those bodies use only their ``self`` attributes and the indices' ``len()`` and
``tolist()``, so they run on plain objects with SGLang's attribute names, without torch
or the rest of SGLang. Before timing, each configuration checks that SGLang's lists and
pagewire's are identical.

Both sides get the same input: the token slots of randomly chosen pages, as one numpy
int64 array (SGLang's callers pass an int64 CPU tensor; SGLang's body converts it with
``tolist()``, and numpy's ``tolist()`` is the faster of the two, so this favours SGLang).

Timing: rounds interleave the variants (SGLang, then each pagewire variant, in rotating
order), each sample is the mean of enough calls to last ~50 ms, with the garbage
collector collected before and disabled during each sample. Every sample records both the
wall clock and the thread's CPU time (which leaves out time spent waiting for a CPU on a
shared machine). The ratio is SGLang's time over pagewire's, per round; the report gives
its median and range over the rounds, for each clock.

Usage (after ``bash scripts/python-test.sh`` has built and installed the wheel):

    .venv/bin/python benches/python/page_meta_vs_sglang.py
    .venv/bin/python benches/python/page_meta_vs_sglang.py --pages 1000,100000 --rounds 9
    .venv/bin/python benches/python/page_meta_vs_sglang.py --wheel path/to/sglang.whl
"""

from __future__ import annotations

import __future__
import argparse
import ast
import gc
import hashlib
import os
import random
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

import pagewire
import pagewire.sglang

SGLANG_VERSION = "0.5.23"
WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
ROOT = Path(__file__).resolve().parents[2]


def fetch_wheel(path: str | None) -> Path:
    if path:
        wheel = Path(path)
    else:
        cache = ROOT / "target" / "bench-cache"
        wheel = cache / WHEEL
        if not wheel.exists():
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                 f"sglang=={SGLANG_VERSION}", "--no-deps", "--only-binary=:all:",
                 "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                 "-d", str(cache)],
                check=True,
            )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if not path and digest != WHEEL_SHA256:
        sys.exit(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def sglang_methods(wheel: Path) -> dict:
    """{(class, method): function} compiled from the wheel's own source text."""
    want = {
        "mha.py": [("MHATokenToKVPoolHost", "get_page_buffer_meta"),
                   ("AsymmetricMHATokenToKVPoolHost", "get_page_buffer_meta")],
        "mla.py": [("MLATokenToKVPoolHost", "get_page_buffer_meta"),
                   ("MLATokenToKVPoolHost", "_storage_page_index")],
    }
    out = {}
    with zipfile.ZipFile(wheel) as z:
        for fname, methods in want.items():
            member = f"sglang/srt/mem_cache/pool_host/{fname}"
            tree = ast.parse(z.read(member).decode(), member)
            classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            for cls, meth in methods:
                fn = next(f for f in classes[cls].body if isinstance(f, ast.FunctionDef) and f.name == meth)
                fn.decorator_list = []
                module = ast.Module(body=[fn], type_ignores=[])
                ns: dict = {}
                # Annotations stay strings (they name torch, which is not imported).
                code = compile(module, f"{WHEEL}:{member}:{cls}.{meth}", "exec",
                               flags=__future__.annotations.compiler_flag, dont_inherit=True)
                exec(code, {"__builtins__": __builtins__}, ns)
                out[(cls, meth)] = ns[meth]
    return out


class Tensor:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class Dtype:
    def __init__(self, itemsize):
        self.itemsize = itemsize


def fake_pool(kind, layout, L, P, S, b, H=0, D=0, Dv=0, C=0, methods=None):
    """An object with the attributes SGLang's get_page_buffer_meta reads."""

    class Host:
        pass

    h = Host()
    h.layout, h.layer_num, h.page_size, h.size, h.dtype = layout, L, P, S, Dtype(b)
    h.page_num = S // P
    if kind == "mla":
        h.kv_lora_rank, h.qk_rope_head_dim, h.kv_cache_dim = C - 64, 64, C
        h.dcp_size, h.logical_page_size = 1, P
        h.kv_buffer = Tensor(0x7F0000000000)
        spi = methods[("MLATokenToKVPoolHost", "_storage_page_index")]
        h._storage_page_index = spi.__get__(h)
        sg = methods[("MLATokenToKVPoolHost", "get_page_buffer_meta")]
    else:
        h.head_num, h.head_dim, h.v_head_dim = H, D, Dv
        if kind == "mha":
            h.kv_buffer = Tensor(0x7F0000000000)
            sg = methods[("MHATokenToKVPoolHost", "get_page_buffer_meta")]
        else:
            k_bytes = L * S * H * D * b
            v_base = 0x7F0000000000 + (k_bytes + 0xFFF) // 0x1000 * 0x1000
            h.k_buffer, h.v_buffer = Tensor(0x7F0000000000), Tensor(v_base)
            h.kv_buffer = (h.k_buffer, h.v_buffer)
            sg = methods[("AsymmetricMHATokenToKVPoolHost", "get_page_buffer_meta")]
    return h, sg.__get__(h)


CONFIGS = {
    # name: (kind, layout, geometry); per-rank shapes of real models
    "mha": ("mha", "page_first", dict(L=32, H=8, D=128, Dv=128, b=2)),            # Llama-3-8B
    "mha-layer_first": ("mha", "layer_first", dict(L=32, H=8, D=128, Dv=128, b=2)),
    "asym": ("mha-split", "page_first_direct", dict(L=48, H=4, D=192, Dv=128, b=2)),  # MiMo-V2-like
    "mla": ("mla", "page_first", dict(L=61, C=576, b=2)),                         # DeepSeek-V3
}


def timed(f, x, target_s=0.05):
    """(wall, thread CPU) seconds per call, the mean over enough calls to last ~target_s."""
    gc.collect()
    gc.disable()
    try:
        n, t0, c0 = 0, time.perf_counter(), time.thread_time()
        while True:
            f(x)
            n += 1
            dt = time.perf_counter() - t0
            if dt >= target_s:
                return dt / n, (time.thread_time() - c0) / n
    finally:
        gc.enable()


def run(name, pages, P, rounds, methods, rng):
    kind, layout, g = CONFIGS[name]
    S = 2 * pages * P  # a pool twice the request: pages come from anywhere in it
    host, sglang = fake_pool(kind, layout, S=S, P=P, methods=methods, **g)
    page_ids = np.array(rng.sample(range(S // P), pages), dtype=np.int64)
    indices = (page_ids[:, None] * P + np.arange(P, dtype=np.int64)).ravel()

    pw = pagewire.sglang.pool_of(host, checks="strict")
    pw_sg = pw.with_checks("sglang")
    ref = sglang(indices)
    for p in (pw, pw_sg):
        ptrs, lens = p.page_meta(indices)
        assert ptrs.tolist() == ref[0] and lens.tolist() == ref[1], f"{name}: lists differ from SGLang's"
        assert p.page_meta(indices, as_lists=True) == ref
    del ref

    variants = {
        "sglang": sglang,
        "strict": pw.page_meta,
        "sglang_checks": pw_sg.page_meta,
        "lists": lambda x: pw_sg.page_meta(x, as_lists=True),
    }
    samples = {k: [] for k in variants}
    order = list(variants)
    for r in range(rounds):
        for k in order[r % len(order):] + order[: r % len(order)]:
            samples[k].append(timed(variants[k], indices))
    return samples


def fmt_ms(xs):
    return f"{statistics.median(xs) * 1e3:.3f}"


def fmt_ratio(sg, pw):
    ratios = [a / b for a, b in zip(sg, pw)]
    return f"{statistics.median(ratios):.0f}x [{min(ratios):.0f}-{max(ratios):.0f}]"


def table(results, clock, rounds):
    """One markdown table; `clock` 0 = wall clock, 1 = thread CPU time."""
    name = ("wall clock", "thread CPU time")[clock]
    print(f"{name}: median per-call ms over {rounds} rounds; ratio = SGLang / pagewire per round, "
          "median [min-max]")
    print()
    print("| pool, layout | pages | SGLang ms | pagewire ms: strict / sglang checks / as_lists "
          "| ratio strict | ratio sglang checks | ratio as_lists |")
    print("|---|---|---|---|---|---|---|")
    for (kind, layout, pages), s in results:
        c = {k: [v[clock] for v in vs] for k, vs in s.items()}
        print(f"| {kind} {layout} | {pages:,} | {fmt_ms(c['sglang'])} | "
              f"{fmt_ms(c['strict'])} / {fmt_ms(c['sglang_checks'])} / {fmt_ms(c['lists'])} | "
              f"{fmt_ratio(c['sglang'], c['strict'])} | {fmt_ratio(c['sglang'], c['sglang_checks'])} | "
              f"{fmt_ratio(c['sglang'], c['lists'])} |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="1000,100000", help="comma-separated page counts")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--configs", default="mha,asym,mla", help=f"of {','.join(CONFIGS)}")
    ap.add_argument("--wheel", help="an sglang wheel already downloaded (skips pip and the hash check)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    methods = sglang_methods(fetch_wheel(args.wheel))
    rng = random.Random(args.seed)
    print(f"pagewire {pagewire.__version__}, SGLang {SGLANG_VERSION} ({WHEEL}), numpy {np.__version__}, "
          f"Python {sys.version.split()[0]}, P={args.page_size}, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print()
    results = []
    for name in args.configs.split(","):
        for pages in (int(x) for x in args.pages.split(",")):
            kind, layout, _ = CONFIGS[name]
            results.append(((kind, layout, pages), run(name, pages, args.page_size, args.rounds, methods, rng)))
            print(f"  measured {kind} {layout} {pages:,} pages", file=sys.stderr, flush=True)
    table(results, 1, args.rounds)
    table(results, 0, args.rounds)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
