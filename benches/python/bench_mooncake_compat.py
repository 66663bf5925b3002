#!/usr/bin/env python3
"""Per-call time of Mooncake's TransferEngine API: pagewire.mooncake_compat against the
real Mooncake wheel and against NIXL's Python agent, side by side in one run, over TCP on
127.0.0.1.

Each implementation gets two processes of its own, a target (registers a 4 MiB buffer
and waits) and an initiator (registers its own 4 MiB and runs the calls), so neither
shares an interpreter or an engine with another. The driver runs the rounds: in every
round each implementation runs every case (N calls, each timed), the order of the
implementations rotating from round to round, and only one implementation is running at
a time: the processes of the others are stopped (SIGSTOP) until their turn. A round
gives two ratios per pair: of the mean per-call times (what a caller waits in all) and
of the median ones (the typical call); the table gives each ratio's median over the
rounds with its min-max spread, and per implementation the median and p99 over all
calls and the spread of the rounds' p50 and p99.

NIXL (nixl-cu12's `nixl_agent`, default configuration, UCX backend, in its own
virtualenv: `--nixl PYTHON`, by default target/nixl-check/venv from scripts/nixl-venv.sh)
runs with UCX_TLS=tcp and UCX_NET_DEVICES=lo unless those are set: UCX over TCP on
loopback, not shared memory. It is measured twice: `nixl` makes a request per call (the
addresses are the call's, as in Mooncake's API) and `nixl-reuse` reposts one request.

Cases: `batch_transfer_sync_write` of 32 x 64 KiB (SGLang's PD send: one call per
request, one entry per contiguous run of pages) and `transfer_sync_write` of 4 KiB.

`--baseline DIR` adds a third implementation, another pagewire build installed in DIR
(`pip install --target DIR --no-deps pagewire-*.whl`), run the same way: the table then
also gives pagewire over that baseline, an A/B of two builds in one run. The order of
the implementations rotates from round to round. "cs/call" is the context switches of
both processes of an implementation (every thread, voluntary and involuntary, from
/proc) per call, over all rounds.

    .venv/bin/python benches/python/bench_mooncake_compat.py            # 10 rounds
    .venv/bin/python benches/python/bench_mooncake_compat.py --rounds 20 --json out.json
    .venv/bin/python benches/python/bench_mooncake_compat.py --baseline /tmp/pw-main
    .venv/bin/python benches/python/bench_mooncake_compat.py --nixl none   # without NIXL

Needs both wheels in the interpreter's environment (scripts/python-test.sh installs
them into .venv). Bytes are checked on the target once before timing starts.
"""

import argparse
import base64
import ctypes
import functools
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

MB = 1 << 20
BUF = 4 * MB
PAGE = 64 << 10
CASES = {
    "batch_transfer_sync_write 32 x 64 KiB": ("batch", 32, PAGE),
    "transfer_sync_write 4 KiB": ("single", 1, 4096),
}


NIXL = ("nixl", "nixl-reuse")


def engine_class(impl):
    if impl == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        if impl == "baseline":
            sys.path.insert(0, os.environ["PW_BENCH_BASELINE"])
        from pagewire.mooncake_compat import TransferEngine
    return TransferEngine


class MooncakeApi:
    """Mooncake's TransferEngine calls (the wheel's or pagewire's class)."""

    def __init__(self, impl):
        self.te = engine_class(impl)()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise SystemExit(f"{impl}: initialize returned {rc}")

    def register(self, addr, n):
        if self.te.register_memory(addr, n) != 0:
            raise SystemExit("register_memory failed")

    def session(self):
        return f"127.0.0.1:{self.te.get_rpc_port()}"

    def connect(self, sid):
        return sid

    def call(self, kind, peer, srcs, dsts, lens):
        """A function that makes one synchronous call and returns its code."""
        if kind == "batch":
            return functools.partial(self.te.batch_transfer_sync_write, peer, srcs, dsts, lens)
        return functools.partial(self.te.transfer_sync_write, peer, srcs[0], dsts[0], lens[0])


class NixlApi:
    """NIXL's Python agent with its UCX backend (transports chosen by UCX_TLS).

    `nixl` builds a request per call, as Mooncake's synchronous calls take their addresses
    per call: descriptor lists, `initialize_xfer`, `transfer`, `check_xfer_state` until
    done, `release_xfer_handle`. `nixl-reuse` creates one request and reposts it: NIXL's
    cheapest path for a transfer that repeats, which a caller with new pages cannot use.
    """

    def __init__(self, impl):
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl import nixl_agent, nixl_agent_config
        self.reuse = impl == "nixl-reuse"
        self.agent = nixl_agent(f"{impl}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))

    def register(self, addr, n):
        self.agent.register_memory([(addr, n, 0, "")], "DRAM")

    def session(self):
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def connect(self, sid):
        return self.agent.add_remote_agent(base64.b64decode(sid))

    def call(self, kind, peer, srcs, dsts, lens):
        ag = self.agent
        local = [(s, n, 0) for s, n in zip(srcs, lens)]
        remote = [(d, n, 0) for d, n in zip(dsts, lens)]

        def wait(x):
            st = ag.transfer(x)
            while st == "PROC":
                st = ag.check_xfer_state(x)
            return 0 if st == "DONE" else -1

        if self.reuse:
            x = ag.initialize_xfer("WRITE", ag.get_xfer_descs(local, "DRAM"),
                                   ag.get_xfer_descs(remote, "DRAM"), peer)  # fmt: skip
            return functools.partial(wait, x)

        def once():
            x = ag.initialize_xfer("WRITE", ag.get_xfer_descs(local, "DRAM"),
                                   ag.get_xfer_descs(remote, "DRAM"), peer)  # fmt: skip
            rc = wait(x)
            ag.release_xfer_handle(x)
            return rc

        return once


def start_engine(impl):
    api = NixlApi(impl) if impl in NIXL else MooncakeApi(impl)
    buf = ctypes.create_string_buffer(BUF)
    addr = ctypes.addressof(buf)
    api.register(addr, BUF)
    return api, buf, addr


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def role_target(impl):
    api, buf, addr = start_engine(impl)
    reply({"sid": api.session(), "addr": addr})
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "digest":
            off, n = int(cmd[1]), int(cmd[2])
            reply({"sha256": hashlib.sha256(ctypes.string_at(addr + off, n)).hexdigest()})
        elif cmd and cmd[0] == "quit":
            break
    os._exit(0)


def role_initiator(impl):
    api, buf, addr = start_engine(impl)
    ctypes.memmove(addr, os.urandom(BUF), BUF)
    reply({"ready": True})
    peer_sid, peer = None, None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "target":
            peer_sid, peer = api.connect(cmd[1]), int(cmd[2])
            reply({"ok": True})
        elif cmd[0] == "digest":
            off, n = int(cmd[1]), int(cmd[2])
            reply({"sha256": hashlib.sha256(ctypes.string_at(addr + off, n)).hexdigest()})
        elif cmd[0] == "run":
            kind, entries, size, calls = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
            srcs = [addr + i * size for i in range(entries)]
            # reversed destinations: the target's pages are not in the source's order
            dsts = [peer + (entries - 1 - i) * size for i in range(entries)]
            call = api.call(kind, peer_sid, srcs, dsts, [size] * entries)
            times = []
            clock = time.perf_counter_ns
            for _ in range(calls):
                t = clock()
                rc = call()
                times.append(clock() - t)
                if rc != 0:
                    reply({"error": f"{impl}: {kind} call returned {rc}"})
                    break
            else:
                reply({"ns": times})
        elif cmd[0] == "quit":
            break
    os._exit(0)


class Proc:
    def __init__(self, role, impl, python, env=None):
        self.p = subprocess.Popen(
            [python, os.path.abspath(__file__), "--role", role, impl],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.hello = self.read()

    def read(self):
        line = ""
        while not line.startswith("{"):  # NIXL logs on stdout
            line = self.p.stdout.readline()
            if not line:
                raise SystemExit(f"child exited ({self.p.poll()})")
        out = json.loads(line)
        if "error" in out:
            raise SystemExit(out["error"])
        return out

    def switches(self):
        """Context switches of every thread of the process so far."""
        n = 0
        task = f"/proc/{self.p.pid}/task"
        for t in os.listdir(task):
            try:
                with open(f"{task}/{t}/status") as f:
                    for line in f:
                        if "ctxt_switches:" in line:  # voluntary and nonvoluntary
                            n += int(line.split()[-1])
            except OSError:
                pass  # the thread ended
        return n

    def pause(self, stop):
        """Stops (or continues) every thread of the process: an implementation waiting
        for its turn must not take CPU from the one measured (a NIXL agent's progress
        thread polls without pause, even when idle)."""
        os.kill(self.p.pid, signal.SIGSTOP if stop else signal.SIGCONT)

    def cmd(self, *words):
        self.p.stdin.write(" ".join(map(str, words)) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.pause(False)
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=10)
        except Exception:
            self.p.kill()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def spread(xs, d=3):
    return f"{statistics.median(xs):.{d}f} [{min(xs):.{d}f}, {max(xs):.{d}f}]"


def nixl_python(arg):
    """The interpreter that has NIXL (its own virtualenv: nixl-cu12 brings its UCX)."""
    if arg == "none":
        return None
    if arg != "auto":
        return arg
    here = os.path.dirname(os.path.abspath(__file__))
    py = os.path.join(here, "..", "..", "target", "nixl-check", "venv", "bin", "python")
    return os.path.abspath(py) if os.path.exists(py) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls-batch", type=int, default=300, help="calls per round, 32 x 64 KiB case")
    ap.add_argument("--calls-single", type=int, default=2000, help="calls per round, 4 KiB case")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls per case before round 1")
    ap.add_argument("--json", help="write the raw per-round figures here")
    ap.add_argument("--baseline", metavar="DIR", help="another pagewire build installed in DIR, run as 'baseline'")
    ap.add_argument("--nixl", default="auto", metavar="PYTHON",
                    help="interpreter with nixl-cu12 (auto: target/nixl-check/venv, if there; none: no NIXL)")  # fmt: skip
    ap.add_argument("--role", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        (role_target if a.role[0] == "target" else role_initiator)(a.role[1])
        return

    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")
    impls = ["mooncake", "pagewire"]
    pythons = {"mooncake": sys.executable, "pagewire": sys.executable}
    # UCX over TCP on loopback only (by default UCX would take shared memory between two
    # processes of one host); the caller's UCX_* settings win.
    nixl_env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    nixl_env.setdefault("UCX_TLS", "tcp")
    nixl_env.setdefault("UCX_NET_DEVICES", "lo")
    nixl_py = nixl_python(a.nixl)
    if nixl_py:
        impls += list(NIXL)
        pythons.update({i: nixl_py for i in NIXL})
    elif a.nixl == "auto":
        print("# NIXL left out: no target/nixl-check/venv (scripts/nixl-venv.sh creates it)")
    if a.baseline:
        os.environ["PW_BENCH_BASELINE"] = os.path.abspath(a.baseline)
        impls.append("baseline")
        pythons["baseline"] = sys.executable
    procs = {}
    for impl in impls:
        env = nixl_env if impl in NIXL else None
        tgt = Proc("target", impl, pythons[impl], env)
        ini = Proc("initiator", impl, pythons[impl], env)
        ini.cmd("target", tgt.hello["sid"], tgt.hello["addr"])
        procs[impl] = (tgt, ini)
        tgt.pause(True)
        ini.pause(True)

    def turn(impl, go):
        for p in procs[impl]:
            p.pause(not go)

    calls = {"batch": a.calls_batch, "single": a.calls_single}
    # correctness once: a batch lands on the target, in the reversed page order
    for impl, (tgt, ini) in procs.items():
        turn(impl, True)
        ini.cmd("run", "batch", 32, PAGE, 1)
        for i in (0, 5, 31):
            want = ini.cmd("digest", i * PAGE, PAGE)["sha256"]
            got = tgt.cmd("digest", (31 - i) * PAGE, PAGE)["sha256"]
            if want != got:
                raise SystemExit(f"{impl}: page {i} differs on the target")
        for name, (kind, entries, size) in CASES.items():
            ini.cmd("run", kind, entries, size, a.warmup)
        turn(impl, False)

    # (numerator, denominator) of each ratio reported
    pairs = [("pagewire", "mooncake")]
    if nixl_py:
        pairs += [("pagewire", "nixl"), ("pagewire", "nixl-reuse")]
    if a.baseline:
        pairs += [("baseline", "mooncake"), ("pagewire", "baseline")]
    rows = {name: {impl: [] for impl in impls} for name in CASES}
    p50s = {name: {impl: [] for impl in impls} for name in CASES}
    p99s = {name: {impl: [] for impl in impls} for name in CASES}
    switches = {name: {impl: 0 for impl in impls} for name in CASES}
    ratios = {name: {p: [] for p in pairs} for name in CASES}
    med_ratios = {name: {p: [] for p in pairs} for name in CASES}
    loads = [os.getloadavg()[0]]
    for r in range(a.rounds):
        # every implementation runs every case once per round, the order rotating
        order = impls[r % len(impls):] + impls[: r % len(impls)]
        for name, (kind, entries, size) in CASES.items():
            means, medians = {}, {}
            for impl in order:
                tgt, ini = procs[impl]
                turn(impl, True)
                cs = tgt.switches() + ini.switches()
                ns = ini.cmd("run", kind, entries, size, calls[kind])["ns"]
                switches[name][impl] += tgt.switches() + ini.switches() - cs
                turn(impl, False)
                rows[name][impl].extend(ns)
                means[impl] = statistics.fmean(ns)
                medians[impl] = statistics.median(ns)
                p50s[name][impl].append(medians[impl] / 1e3)
                p99s[name][impl].append(pct(ns, 0.99) / 1e3)
            for num, den in pairs:
                ratios[name][(num, den)].append(means[num] / means[den])
                med_ratios[name][(num, den)].append(medians[num] / medians[den])
        loads.append(os.getloadavg()[0])
    for tgt, ini in procs.values():
        ini.close()
        tgt.close()

    load = os.getloadavg()
    print(f"# {a.rounds} rounds, TCP on 127.0.0.1, {os.cpu_count()} CPUs, "
          f"1-minute load {min(loads):.2f}-{max(loads):.2f} over the rounds "
          f"(at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")  # fmt: skip
    if nixl_py:
        print(f"# NIXL: UCX_TLS={nixl_env['UCX_TLS']} UCX_NET_DEVICES={nixl_env['UCX_NET_DEVICES']}")
    print("| case | implementation | median / p99 of all calls (us) "
          "| p50 per round (us) | p99 per round (us) | cs/call |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for name in CASES:
        for impl in impls:
            xs = rows[name][impl]
            print(
                f"| {name} | {impl} | {pct(xs, .5) / 1e3:.1f} / {pct(xs, .99) / 1e3:.1f} "
                f"| {spread(p50s[name][impl], 1)} | {spread(p99s[name][impl], 1)} "
                f"| {switches[name][impl] / max(1, len(xs)):.2f} |"
            )
    print()
    print("| case | ratio | of means: median [min, max] | of medians: median [min, max] |")
    print("|---|---|---|---|")
    for name in CASES:
        for num, den in pairs:
            print(
                f"| {name} | {num} / {den} "
                f"| {spread(ratios[name][(num, den)])} | {spread(med_ratios[name][(num, den)])} |"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "mean_ratios": {n: {f"{x}/{y}": v for (x, y), v in r.items()} for n, r in ratios.items()},
                    "median_ratios": {n: {f"{x}/{y}": v for (x, y), v in r.items()} for n, r in med_ratios.items()},
                    "p50_us": p50s,
                    "p99_us": p99s,
                    "switches_per_call": {
                        n: {i: switches[n][i] / max(1, len(rows[n][i])) for i in impls} for n in CASES
                    },
                    "load": load,
                    "loads": loads,
                    "rounds": a.rounds,
                    "calls": calls,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
