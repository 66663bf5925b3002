#!/usr/bin/env python3
"""What reading index arrays through the buffer protocol (crates/python/src/ffi.rs) saves.

Without ``PyObject_GetBuffer`` (outside the limited API before Python 3.11), an abi3-py39
extension reaches an array's memory either through ``__array_interface__`` (numpy only: a
dict built per call) or through ``memoryview(obj).tobytes()`` (a full copy into a new
``bytes`` before the extension's own copy). This script times, side by side:

* per-call cost on a short array: ``Pool.page_meta`` on a numpy array (buffer protocol)
  and on the same array behind an object exposing only ``__array_interface__``;
* the copy the memoryview route cannot avoid, ``memoryview(a).tobytes()``, against the
  whole ``Pool.page_meta`` call on the same array read in place.

Times are the thread's CPU time per call, median over 7 interleaved rounds.

Usage: .venv/bin/python benches/python/index_input_paths.py
"""

import gc
import os
import statistics
import time

import numpy as np

import pagewire


class InterfaceOnly:
    """Exposes an array through ``__array_interface__`` alone (no buffer protocol)."""

    def __init__(self, a):
        self.a = a

    @property
    def __array_interface__(self):
        return self.a.__array_interface__


def per_call(f, x, target_s=0.05):
    """Thread CPU seconds per call (the machine may be shared), over ~target_s of wall."""
    gc.collect()
    gc.disable()
    try:
        n, t0, c0 = 0, time.perf_counter(), time.thread_time()
        while True:
            f(x)
            n += 1
            if time.perf_counter() - t0 >= target_s:
                return (time.thread_time() - c0) / n
    finally:
        gc.enable()


def rounds(variants, x, k=7):
    out = {name: [] for name in variants}
    names = list(variants)
    for r in range(k):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out[name].append(per_call(variants[name], x))
    return {name: statistics.median(v) for name, v in out.items()}


def main():
    P = 64
    geo = pagewire.Geometry("mha", layers=32, page_size=P, heads=8, head_dim=128, dtype_bytes=2, capacity=P * 200_000)
    pool = pagewire.Pool(geo, "page_first", 0x7F0000000000)
    print(f"load average {os.getloadavg()[0]:.1f}; thread CPU time per call, median of 7 rounds")
    print()
    print("| pages (int64 slots) | numpy, buffer protocol | same array, `__array_interface__` only | `memoryview(a).tobytes()` alone |")
    print("|---|---|---|---|")
    for pages in (1, 1000, 100_000):
        a = (np.arange(pages, dtype=np.int64)[:, None] * P + np.arange(P)).ravel()
        t = rounds(
            {
                "buffer": pool.page_meta,
                "iface": lambda x: pool.page_meta(InterfaceOnly(x)),
                "tobytes": lambda x: memoryview(x).tobytes(),
            },
            a,
        )
        print(f"| {pages:,} ({pages * P:,}) | {t['buffer'] * 1e6:,.1f} us | {t['iface'] * 1e6:,.1f} us | {t['tobytes'] * 1e6:,.1f} us |")


if __name__ == "__main__":
    main()
