"""pagewire's store against Mooncake Store in one run, on this machine, over TCP on
127.0.0.1: put and get throughput of batches of KV pages, and per-batch latency.

Each round starts fresh processes for every contender and runs them one after the other
(the order rotates between rounds), so all see the same machine state:

* ``pagewire``: ``pagewire store master``, one ``pagewire store serve`` (storage node),
  and ``pagewire bench store --master ... --json`` as the client;
* ``pagewire-py``: the same master and node, and the Python client below driving
  ``pagewire.mooncake_compat.MooncakeDistributedStore`` (the harness Mooncake gets);
* ``mooncake``: the wheel's ``mooncake_master``, one storage process
  (``MooncakeDistributedStore.setup`` with the segment), and the Python client below
  driving ``mooncake.store.MooncakeDistributedStore``.

Every client puts the same batches (``--pages`` pages of a ``--model`` preset, one
object per page and component with SGLang's keys, pointers from a ``page_first`` host
pool computed by pagewire's layout code) with one ``batch_put_from``, then gets them back
with one ``batch_get_into``, ``--iters`` times after ``--warmup`` unmeasured batches.
Keys are fresh every batch and nothing is removed, so each storage node's segment holds
every batch of a run.

    .venv/bin/python benches/python/store_vs_mooncake.py --rounds 5 \\
        --pagewire target/release/pagewire --out target/store-vs-mooncake.json

Prints per-round figures, then per contender the median and range of MiB/s, and the
pagewire/Mooncake ratios per round (median and range).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
PRESETS = {  # kind, layers, heads, head_dim (MLA: kv_dim)
    "llama3-8b": ("mha", 32, 8, 128),
    "llama3-70b": ("mha", 80, 8, 128),
    "deepseek-v3": ("mla", 61, 1, 576),
}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def pool_objects(model: str, pages: int, page_size: int):
    """(pool bytes, [(offset, len)] per object in SGLang's order, keys suffixes)."""
    import pagewire

    kind, layers, heads, d = PRESETS[model]
    if kind == "mla":
        g = pagewire.Geometry("mla", layers=layers, page_size=page_size, kv_dim=d,
                              dtype_bytes=2, capacity=pages * page_size)  # fmt: skip
        suffixes = ["__k"]
    else:
        g = pagewire.Geometry("mha", layers=layers, page_size=page_size, heads=heads,
                              head_dim=d, dtype_bytes=2, capacity=pages * page_size)  # fmt: skip
        suffixes = ["_0_k", "_0_v"]
    pool = pagewire.Pool(g, "page_first", 0)
    size = sum(n for _, n in pool.buffers)
    ptrs, lens = pool.page_meta_for_pages(list(range(pages)), as_lists=True)
    return size, list(zip(ptrs, lens)), suffixes


# ---------------------------------------------------------------- child roles


def role_storage(impl: str, master: str, segment: int) -> None:
    """A storage process: contributes the segment, then waits for stdin to close."""
    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from pagewire.mooncake_compat import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 * MIB, "tcp", "", master)
    print(f"READY {rc}", flush=True)
    sys.stdin.read()
    s.close()


def role_client(impl: str, master: str, a: argparse.Namespace) -> None:
    """Puts and gets batches with one call each; prints one JSON record."""
    import numpy as np

    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from pagewire.mooncake_compat import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", master)
    assert rc == 0, f"client setup: {rc}"
    size, objs, suffixes = pool_objects(a.model, a.pages, a.page_size)
    src = np.zeros(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    src[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    assert s.register_buffer(src.ctypes.data, size) == 0
    assert s.register_buffer(dst.ctypes.data, size) == 0
    sp = [src.ctypes.data + off for off, _ in objs]
    dp = [dst.ctypes.data + off for off, _ in objs]
    lens = [n for _, n in objs]
    put_lat, get_lat = [], []
    run = os.getpid()
    for it in range(a.warmup + a.iters):
        keys = [
            f"{run:016x}{it:016x}{p:016x}{0:016x}{sfx}"
            for p in range(a.pages)
            for sfx in suffixes
        ]
        t0 = time.perf_counter()
        r = s.batch_put_from(keys, sp, lens)
        t1 = time.perf_counter()
        assert all(x == 0 for x in r), f"put: {r[:8]}"
        g = s.batch_get_into(keys, dp, lens)
        t2 = time.perf_counter()
        assert all(x == n for x, n in zip(g, lens)), f"get: {g[:8]}"
        if a.verify:
            assert np.array_equal(src, dst), "bytes read back differ"
            dst[:] = 0
        if it >= a.warmup:
            put_lat.append(t1 - t0)
            get_lat.append(t2 - t1)
    s.close()
    print(json.dumps(summary(put_lat, get_lat, sum(lens))), flush=True)


def summary(put, get, batch_bytes):
    def one(lat):
        lat = sorted(lat)
        tot = sum(lat)
        pct = lambda p: lat[min(len(lat) - 1, max(0, int(round(p / 100 * len(lat) + 0.5)) - 1))]
        return {
            "mib_s": batch_bytes * len(lat) / tot / MIB,
            "p50_ms": pct(50) * 1e3,
            "p99_ms": pct(99) * 1e3,
        }

    return {"put": one(put), "get": one(get), "batch_bytes": batch_bytes}


# ---------------------------------------------------------------- orchestration


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.stdin:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def me(*args: str) -> list:
    return [sys.executable, os.path.abspath(__file__), *args]


def client_args(a) -> list:
    out = ["--model", a.model, "--pages", str(a.pages), "--page-size", str(a.page_size),
           "--iters", str(a.iters), "--warmup", str(a.warmup)]  # fmt: skip
    return out + (["--verify"] if a.verify else [])


# Mooncake logs every step through glog on stderr: keep warnings and errors only.
QUIET = dict(os.environ, GLOG_minloglevel="1")


def start_storage(ps: Procs, impl: str, master: str, segment: int) -> None:
    p = ps.start(me("--role", "storage", "--impl", impl, "--master", master,
                    "--segment", str(segment)),
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=QUIET)  # fmt: skip
    line = p.stdout.readline()
    if line.strip() != "READY 0":
        raise RuntimeError(f"{impl} storage did not start: {line!r}")


def run_client(impl: str, master: str, a) -> dict:
    r = subprocess.run(me("--role", "client", "--impl", impl, "--master", master, *client_args(a)),
                       capture_output=True, text=True, timeout=600, env=QUIET)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"{impl} client failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def contender(name: str, a, segment: int) -> dict:
    ps = Procs()
    try:
        if name == "mooncake":
            port = free_port()
            exe = Path(sys.executable).parent / "mooncake_master"
            ps.start([str(exe), f"-rpc_port={port}", f"-metrics_port={free_port()}",
                      "-rpc_address=127.0.0.1"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            wait_port(port)
            master = f"127.0.0.1:{port}"
            start_storage(ps, "mooncake", master, segment)
            return run_client("mooncake", master, a)
        port = free_port()
        ps.start([a.pagewire, "store", "master", "--listen", f"127.0.0.1:{port}"],
                 stdout=subprocess.DEVNULL)  # fmt: skip
        wait_port(port)
        master = f"127.0.0.1:{port}"
        node = ps.start([a.pagewire, "store", "serve", "--master", master, "--segment",
                         str(segment), "--listen", "127.0.0.1:0", "--transport", "tcp"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = node.stdout.readline()
        if "mounted" not in line:
            raise RuntimeError(f"pagewire store serve: {line!r}")
        if name == "pagewire-py":
            return run_client("pagewire", master, a)
        argv = [a.pagewire, "bench", "store", "--master", master, "--transport", "tcp",
                "--model", a.model, "--pages", str(a.pages), "--page-size", str(a.page_size),
                "-n", str(a.iters), "--warmup", str(a.warmup), "--json"]  # fmt: skip
        if a.verify:
            argv.append("--verify")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"pagewire bench store failed:\n{r.stderr[-3000:]}")
        rec = json.loads(r.stdout)
        return {
            "put": {k: rec["put"][k] for k in ("mib_s", "p50_ms", "p99_ms")},
            "get": {k: rec["get"][k] for k in ("mib_s", "p50_ms", "p99_ms")},
            "batch_bytes": rec["batch_bytes"],
        }
    finally:
        ps.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["storage", "client"])
    ap.add_argument("--impl", default="pagewire")
    ap.add_argument("--master")
    ap.add_argument("--segment", type=int, default=0)
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--contenders", default="pagewire,pagewire-py,mooncake")
    ap.add_argument("--pagewire", default="target/release/pagewire")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.role == "storage":
        return role_storage(a.impl, a.master, a.segment)
    if a.role == "client":
        return role_client(a.impl, a.master, a)

    size, objs, _ = pool_objects(a.model, a.pages, a.page_size)
    batch = sum(n for _, n in objs)
    # Room for every batch of a run, with slack (Mooncake evicts from 90 %).
    segment = int(batch * (a.iters + a.warmup) * 1.3) + 64 * MIB
    names = a.contenders.split(",")
    print(f"store vs Mooncake: {a.model}, {a.pages} pages x {a.page_size} tokens per batch = "
          f"{len(objs)} objects of {objs[0][1] / MIB:.2f} MiB, {batch / MIB:.1f} MiB per batch; "
          f"{a.iters} batches (+{a.warmup} warm-up) per run, {a.rounds} rounds, TCP on 127.0.0.1, "
          f"segment {segment / MIB:.0f} MiB", flush=True)  # fmt: skip
    rounds = []
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        res = {}
        for name in order:
            res[name] = contender(name, a, segment)
            x = res[name]
            print(f"round {r + 1} {name:12s} put {x['put']['mib_s']:8.1f} MiB/s "
                  f"(p50 {x['put']['p50_ms']:7.2f} ms, p99 {x['put']['p99_ms']:7.2f})  "
                  f"get {x['get']['mib_s']:8.1f} MiB/s (p50 {x['get']['p50_ms']:7.2f} ms, "
                  f"p99 {x['get']['p99_ms']:7.2f})", flush=True)  # fmt: skip
        rounds.append(res)

    def stat(vals):
        return f"{statistics.median(vals):8.1f} [{min(vals):.1f}, {max(vals):.1f}]"

    print("\nmedian [min, max] over rounds")
    for name in names:
        for op in ("put", "get"):
            v = [rd[name][op]["mib_s"] for rd in rounds]
            p50 = [rd[name][op]["p50_ms"] for rd in rounds]
            p99 = [rd[name][op]["p99_ms"] for rd in rounds]
            print(f"  {name:12s} {op} MiB/s {stat(v)}   p50 ms {stat(p50)}   p99 ms {stat(p99)}")
    if "mooncake" in names:
        print("ratios to mooncake, per round: median [min, max]")
        for name in names:
            if name == "mooncake":
                continue
            for op in ("put", "get"):
                q = [rd[name][op]["mib_s"] / rd["mooncake"][op]["mib_s"] for rd in rounds]
                print(f"  {name:12s} {op} {statistics.median(q):.2f} [{min(q):.2f}, {max(q):.2f}]")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
