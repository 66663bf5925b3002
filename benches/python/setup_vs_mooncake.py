#!/usr/bin/env python3
"""What a store client's set-up costs with a large segment: pagewire against Mooncake Store
in one run, on this machine, over TCP on 127.0.0.1.

SGLang's HiCache gives every rank a 3200 MB segment (``global_segment_size``) and calls
``MooncakeDistributedStore.setup`` once at start-up. Each round starts, for every
contender, a fresh master and one new process, the order rotating between rounds:

* ``mooncake``: the wheel's ``mooncake_master`` and a process that imports
  ``mooncake.store`` and calls ``setup`` with the segment;
* ``pagewire``: ``pagewire store master`` and the same calls on
  ``pagewire.mooncake_compat.MooncakeDistributedStore``;
* ``serve``: ``pagewire store master`` and ``pagewire store serve --segment SEG``, timed
  from the spawn of the process until it says the segment is mounted.

For the two ``setup`` contenders the clock covers ``setup`` alone (the import and the
object's construction come before it); resident memory (VmRSS) is read before ``setup``
and right after it returns, and the table gives the growth and the total. ``serve``'s
time includes the process's own start, its RSS is the whole process once mounted.
Nothing is put: these are the costs before the first object lands.

    .venv/bin/python benches/python/setup_vs_mooncake.py --rounds 5 \\
        --pagewire target/release/pagewire

Needs both wheels in the interpreter's environment (scripts/python-test.sh installs them
into .venv) and the ``pagewire`` binary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store_vs_mooncake import QUIET, Procs, free_port, wait_port  # noqa: E402

MIB = 1 << 20
CONTENDERS = ("mooncake", "pagewire", "serve")


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def role_setup(impl: str, master: str, segment: int, local_buffer: int) -> None:
    """One client: setup with the segment, timed; prints one JSON record."""
    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from pagewire.mooncake_compat import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    before = rss_mib()
    t0 = time.perf_counter()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, local_buffer, "tcp", "", master)
    secs = time.perf_counter() - t0
    after = rss_mib()
    print(json.dumps({"rc": rc, "secs": secs, "rss_before": before, "rss_after": after}), flush=True)
    # Exit without tearing down: close() is not what is measured.
    os._exit(0)


def start_master(ps: Procs, name: str, pagewire: str) -> str:
    port = free_port()
    if name == "mooncake":
        exe = Path(sys.executable).parent / "mooncake_master"
        ps.start([str(exe), f"-rpc_port={port}", f"-metrics_port={free_port()}",
                  "-rpc_address=127.0.0.1"],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    else:
        ps.start([pagewire, "store", "master", "--listen", f"127.0.0.1:{port}"],
                 stdout=subprocess.DEVNULL)  # fmt: skip
    wait_port(port)
    return f"127.0.0.1:{port}"


def contender(name: str, a) -> dict:
    ps = Procs()
    try:
        master = start_master(ps, name, a.pagewire)
        if name == "serve":
            t0 = time.perf_counter()
            node = ps.start([a.pagewire, "store", "serve", "--master", master, "--segment",
                             str(a.segment), "--listen", "127.0.0.1:0", "--transport", "tcp"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
            line = node.stdout.readline()
            secs = time.perf_counter() - t0
            if "mounted" not in line:
                raise RuntimeError(f"pagewire store serve: {line!r}")
            return {"rc": 0, "secs": secs, "rss_before": 0.0, "rss_after": rss_mib(node.pid)}
        impl = "mooncake" if name == "mooncake" else "pagewire"
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--role", impl, "--master",
                            master, "--segment", str(a.segment)],
                           capture_output=True, text=True, timeout=120, env=QUIET)  # fmt: skip
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or not lines:
            raise RuntimeError(f"{name} setup failed:\n{r.stderr[-3000:]}")
        rec = json.loads(lines[-1])
        if rec["rc"] != 0:
            raise RuntimeError(f"{name}: setup returned {rec['rc']}")
        return rec
    finally:
        ps.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["mooncake", "pagewire"], help=argparse.SUPPRESS)
    ap.add_argument("--master")
    ap.add_argument("--segment", type=int, default=3200 * MIB, help="bytes (default 3200 MiB)")
    ap.add_argument("--local-buffer", type=int, default=16 * MIB)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pagewire", default="target/release/pagewire")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.role:
        return role_setup(a.role, a.master, a.segment, a.local_buffer)

    names = list(CONTENDERS)
    rounds, loads = [], [os.getloadavg()[0]]
    for r in range(a.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        rounds.append({name: contender(name, a) for name in order})
        loads.append(os.getloadavg()[0])
        x = rounds[-1]
        print(f"# round {r + 1}: " + ", ".join(
            f"{n} {x[n]['secs'] * 1e3:.1f} ms {x[n]['rss_after']:.1f} MiB" for n in names), flush=True)  # fmt: skip

    def cell(vals, d=1):
        return f"{statistics.median(vals):.{d}f} [{min(vals):.{d}f}, {max(vals):.{d}f}]"

    print(f"# {a.rounds} rounds, segment {a.segment / MIB:.0f} MiB, TCP on 127.0.0.1, "
          f"{os.cpu_count()} CPUs, 1-minute load {min(loads):.2f}-{max(loads):.2f} over the rounds")  # fmt: skip
    print("| contender | time (ms) | RSS growth (MiB) | RSS after (MiB) | time / Mooncake's |")
    print("|---|---:|---:|---:|---:|")
    labels = {
        "mooncake": "Mooncake `setup`",
        "pagewire": "pagewire `setup` (compat class)",
        "serve": "`pagewire store serve` (process start to mounted)",
    }
    for n in names:
        ms = [rd[n]["secs"] * 1e3 for rd in rounds]
        grow = [rd[n]["rss_after"] - rd[n]["rss_before"] for rd in rounds]
        after = [rd[n]["rss_after"] for rd in rounds]
        ratio = [rd[n]["secs"] / rd["mooncake"]["secs"] for rd in rounds]
        print(f"| {labels[n]} | {cell(ms)} | {cell(grow) if n != 'serve' else ''} | {cell(after)} "
              f"| {cell(ratio, 3) if n != 'mooncake' else ''} |")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "loads": loads, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
