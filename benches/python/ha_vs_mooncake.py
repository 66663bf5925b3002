#!/usr/bin/env python3
"""Masters on etcd, pagewire against Mooncake Store's HA mode, in one run on this machine
(TCP and etcd on 127.0.0.1 only).

One etcd cluster of three members (the ``etcd`` binary on PATH, Debian's etcd-server, or
``PAGEWIRE_ETCD``) is started here on ports of its own and serves both parts:

**Failover** (``--rounds``, the systems' order alternating between rounds). For each
system, a fresh group in etcd (its own cluster id) of two masters
(``mooncake_master --enable_ha=true --ha_backend_type=etcd --enable_oplog=true ...``,
``pagewire store master --ha etcd://...``), one holder process that contributes a
segment, and two client processes that ``setup(..., master_server_addr="etcd://...")``
and loop: put a fresh key, get back the last key whose put succeeded. Every value is
derived from its key and a generation (``value(key, gen)``), so a get that returns any
other byte is counted as wrong. The holder and clients are the same code for both
systems: ``mooncake.store.MooncakeDistributedStore`` or
``pagewire.mooncake_compat.MooncakeDistributedStore``. Each client publishes ``--keys``
keys, loops for ``--steady`` seconds, then the leader (the master the leader key in
etcd names) is killed with SIGKILL. Per round: seconds from the kill to the first put and
the first get that succeed (calls started after the kill, bytes checked), to a new leader
key in etcd, calls failed after the kill, and how many of the objects whose put
succeeded before the kill read back with their bytes once both clients are served again
(after ``--settle`` seconds more).

**Op-log cost** (``--oplog-rounds``): ``pagewire bench store`` (64 objects of 64 KiB a
batch: Llama-3-8B geometry with 2 layers, 32 pages) against one master, and against two
masters on etcd through ``--master etcd://...``, each with fresh processes and one
``pagewire store serve`` node, the order alternating; the ratio is per round.

    .venv/bin/python benches/python/ha_vs_mooncake.py --rounds 5 --oplog-rounds 10 \\
        --pagewire target/release/pagewire --json target/ha.json

Every process started here dies with it (SIGKILL at exit, and each child's parent-death
signal). All traffic is on 127.0.0.1; Mooncake's client library still binds its own
listeners on the wildcard address (its handshake and TCP transport ports).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store_vs_mooncake import free_port, wait_port  # noqa: E402

MIB = 1 << 20
SYSTEMS = ("mooncake", "pagewire")
# etcd and every child: no proxy for 127.0.0.1, quieter glog.
ENV = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
ENV.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", GLOG_minloglevel="1")
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def value(key: str, gen: int, size: int) -> bytes:
    """The only bytes a get of `key` may return: derived from the key and its generation."""
    return random.Random(f"{key}/{gen}").randbytes(size)


# ---------------------------------------------------------------- processes


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the child gets SIGKILL when this process ends, however it ends.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class Procs:
    """Every process this run starts; all are killed at exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, **kw) -> subprocess.Popen:
        kw.setdefault("env", ENV)
        p = subprocess.Popen(argv, preexec_fn=_die_with_parent, **kw)
        self.procs.append(p)
        if self is not ALL:
            ALL.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


ALL = Procs()
atexit.register(ALL.kill_all)
for _sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(_sig, lambda s, f: sys.exit(128 + s))


class Etcd:
    """A cluster of `n` etcd members on 127.0.0.1 ports picked here."""

    def __init__(self, n: int) -> None:
        exe = os.environ.get("PAGEWIRE_ETCD") or shutil.which("etcd")
        if not exe:
            raise SystemExit("no `etcd` on PATH: install Debian's etcd-server or set PAGEWIRE_ETCD")
        self.dir = tempfile.mkdtemp(prefix="pagewire-ha-bench-etcd-")
        # atexit runs this before ALL.kill_all (registered first): stop etcd, then remove.
        atexit.register(lambda: (ALL.kill_all(), shutil.rmtree(self.dir, True)))
        self.clients = [free_port() for _ in range(n)]
        peers = [free_port() for _ in range(n)]
        initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
        for i in range(n):
            c, p = f"http://127.0.0.1:{self.clients[i]}", f"http://127.0.0.1:{peers[i]}"
            ALL.start([exe, f"--name=m{i}", f"--data-dir={self.dir}/m{i}",
                       f"--listen-client-urls={c}", f"--advertise-client-urls={c}",
                       f"--listen-peer-urls={p}", f"--initial-advertise-peer-urls={p}",
                       f"--initial-cluster={initial}", "--initial-cluster-state=new",
                       f"--initial-cluster-token={self.dir}", "--logger=zap", "--log-level=error"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 30
        while not self._healthy():
            if time.monotonic() > deadline:
                raise RuntimeError("etcd did not become healthy within 30 s")
            time.sleep(0.1)

    @property
    def hosts(self) -> str:
        return ";".join(f"127.0.0.1:{c}" for c in self.clients)

    @property
    def url(self) -> str:
        return f"etcd://{self.hosts}"

    def _healthy(self) -> bool:
        for c in self.clients:
            try:
                with LOCAL.open(f"http://127.0.0.1:{c}/health", timeout=1) as r:
                    if json.load(r).get("health") == "true":
                        return True
            except OSError:
                pass
        return False

    def get(self, key: str) -> str | None:
        """The key's value through etcd's JSON gateway (any member that answers)."""
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        for c in self.clients:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{c}/v3/kv/range", data=body)
                with LOCAL.open(req, timeout=1) as r:
                    kvs = json.load(r).get("kvs") or []
                return base64.b64decode(kvs[0]["value"]).decode(errors="replace") if kvs else None
            except OSError:
                continue
        return None


# ---------------------------------------------------------------- child roles


def store_class(impl: str):
    if impl == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from pagewire.mooncake_compat import MooncakeDistributedStore
    return MooncakeDistributedStore


def role_holder(a) -> None:
    """Contributes the segment, then waits for stdin to close (or to be killed)."""
    s = store_class(a.impl)()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", a.segment, 16 * MIB, "tcp", "", a.master)
    print(f"READY {rc}", flush=True)
    sys.stdin.read()
    os._exit(0)


def role_client(a) -> None:
    """Publishes --keys keys, then puts and gets in a loop until told of the kill, served
    again, settled and checked; prints one JSON record."""
    s = store_class(a.impl)()
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", a.master)
    if rc != 0:
        print(json.dumps({"error": f"setup returned {rc}"}), flush=True)
        os._exit(1)
    kill_at: list[float] = []
    done = threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            if line.startswith("KILL "):
                kill_at.append(float(line.split()[1]))
        done.set()  # stdin closed: the parent gave up on this round

    threading.Thread(target=listen, daemon=True).start()
    published: list[tuple[str, int, float]] = []  # (key, gen, end) of every OK put
    wrong = 0
    calls = []  # (op, start, end, ok)

    codes: dict[str, int] = {}  # return codes of puts that failed after the kill

    def put(key: str, gen: int) -> bool:
        t0 = time.monotonic()
        rc = s.put(key, value(key, gen, a.size))
        calls.append(("put", t0, time.monotonic(), rc == 0))
        if rc != 0 and kill_at:
            codes[str(rc)] = codes.get(str(rc), 0) + 1
        return rc == 0

    def get(key: str, gen: int) -> bool:
        nonlocal wrong
        t0 = time.monotonic()
        got = s.get(key)
        t1 = time.monotonic()
        ok = bool(got)
        if ok and got != value(key, gen, a.size):
            wrong += 1
            ok = False
        calls.append(("get", t0, t1, ok))
        return ok

    for i in range(a.keys):
        k = f"{a.tag}/pre/{i}"
        if not (put(k, 0) and get(k, 0)):
            print(json.dumps({"error": f"publishing {k} failed before any kill"}), flush=True)
            os._exit(1)
        published.append((k, 0, calls[-1][2]))
    print(f"PUBLISHED {len(published)}", flush=True)
    last = published[-1][:2]
    gen = scan = 0
    first_put = first_get = None
    while not done.is_set():
        gen += 1
        k = f"{a.tag}/loop/{gen}"
        if put(k, gen):
            published.append((k, gen, calls[-1][2]))
            last = (k, gen)
        get(*last)
        if kill_at:
            # Calls started after the kill, in order, from where the last look ended.
            t_kill = kill_at[0]
            for op, t0, t1, ok in calls[scan:]:
                if ok and t0 >= t_kill:
                    if op == "put" and first_put is None:
                        first_put = t1
                    if op == "get" and first_get is None:
                        first_get = t1
            scan = len(calls)
            served = first_put is not None and first_get is not None
            if served and time.monotonic() > max(first_put, first_get) + a.settle:
                break
            if time.monotonic() > t_kill + a.recover_timeout:
                break
    if not kill_at:
        print(json.dumps({"error": "stdin closed before the kill"}), flush=True)
        os._exit(1)
    t_kill = kill_at[0]
    published = [x for x in published if x[2] < t_kill]
    served_at = max(first_put, first_get) if first_put and first_get else float("inf")
    before = [c for c in calls if c[2] < t_kill]
    after = [c for c in calls if c[2] >= t_kill]
    # How long before the kill each object that did not read back had been put.
    lost = [t_kill - end for k, g, end in published if first_get is None or not get(k, g)]
    rec = {
        "published": len(published),
        "kept": len(published) - len(lost),
        "lost_put_before_kill_s": sorted(lost)[:64],
        "lost_max_s": max(lost, default=None),
        "put_codes_after": codes,
        "wrong": wrong,
        "calls_before": len(before),
        "failed_before": sum(1 for c in before if not c[3]),
        "calls_after": len(after),
        "failed_after": sum(1 for c in after if not c[3]),
        # Failed calls until this client had both a put and a get served, and after.
        "failed_gap": sum(1 for c in after if not c[3] and c[2] <= served_at),
        "failed_late": sum(1 for c in after if not c[3] and c[2] > served_at),
        "first_put_s": None if first_put is None else first_put - t_kill,
        "first_get_s": None if first_get is None else first_get - t_kill,
        "longest_call_s": max((c[2] - c[1] for c in after), default=0.0),
    }
    print(json.dumps(rec), flush=True)
    os._exit(0)


# ---------------------------------------------------------------- failover rounds


def me(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def start_masters(ps: Procs, system: str, etcd: Etcd, cid: str, a, logdir: Path,
                  shard: tuple[int, int] | None = None) -> list[tuple]:
    """Two masters of group `cid` (of shard i of S for `shard=(S, i)`, pagewire only):
    [(process, "127.0.0.1:port")]."""
    out = []
    for i in range(2):
        port = free_port()
        log = open(logdir / f"{cid}-{shard[1] if shard else ''}master{i}.log", "w")
        if system == "mooncake":
            exe = Path(sys.executable).parent / "mooncake_master"
            argv = [str(exe), "--enable_ha=true", "--ha_backend_type=etcd",
                    f"--ha_backend_connstring={etcd.hosts}", "--rpc_address=127.0.0.1",
                    f"--rpc_port={port}", "--enable_oplog=true", f"--cluster_id={cid}",
                    "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]  # fmt: skip
        else:
            argv = [a.pagewire, "store", "master", "--listen", f"127.0.0.1:{port}",
                    "--ha", etcd.url, "--cluster-id", cid]  # fmt: skip
            if shard:
                argv += ["--shards", str(shard[0]), "--shard", str(shard[1])]
        # Masters log at INFO: their election and warm-up steps are what the logs are for.
        p = ps.start(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(ENV, GLOG_minloglevel="0"))
        out.append((p, f"127.0.0.1:{port}"))
    return out


def leader_key(system: str, cid: str) -> str:
    if system == "mooncake":
        return f"mooncake-store/{cid}/master_view"
    return f"pagewire-store/{cid}/leader"


def leader_of(etcd: Etcd, system: str, cid: str, masters) -> int | None:
    v = etcd.get(leader_key(system, cid))
    if v is None:
        return None
    for i, (_, addr) in enumerate(masters):
        if addr in v:
            return i
    return None


def wait_leader(etcd, system, cid, masters, not_index=None, timeout=60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        i = leader_of(etcd, system, cid, masters)
        if i is not None and i != not_index:
            return i
        time.sleep(0.02)
    raise RuntimeError(f"{system}: no leader in etcd within {timeout} s "
                       f"(key {leader_key(system, cid)}: {etcd.get(leader_key(system, cid))!r})")  # fmt: skip


def mooncake_states(log: Path, wall_kill: float) -> dict:
    """Seconds after the kill at which Mooncake's promoted master logged its last entry
    into leader_warmup and into serving (glog's local wall-clock time stamps)."""
    out = {}
    day = time.strftime("%Y-%m-%d", time.localtime(wall_kill))
    for line in log.read_text(errors="replace").splitlines():
        for state in ("leader_warmup", "serving"):
            if f"Master runtime state -> {state}," in line:
                hms = line.split()[1]
                t = time.mktime(time.strptime(f"{day} {hms.split('.')[0]}", "%Y-%m-%d %H:%M:%S"))
                out[state] = t + float("0." + hms.split(".")[1]) - wall_kill
    return out


def failover_round(system: str, etcd: Etcd, a, r: int, logdir: Path) -> dict:
    ps = Procs()
    cid = f"habench-{os.getpid()}-{system}-{r}"
    env = dict(ENV, PAGEWIRE_STORE_CLUSTER_ID=cid, MC_STORE_CLUSTER_ID=cid)
    try:
        masters = start_masters(ps, system, etcd, cid, a, logdir)
        leader = wait_leader(etcd, system, cid, masters)
        common = ["--impl", system, "--master", etcd.url]
        holder = ps.start(me("--role", "holder", *common, "--segment", str(a.segment)),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                          stderr=open(logdir / f"{cid}-holder.log", "w"))  # fmt: skip
        line = holder.stdout.readline()
        if line.strip() != "READY 0":
            raise RuntimeError(f"{system} holder: {line!r} (log {logdir}/{cid}-holder.log)")
        clients = []
        for c in range(2):
            p = ps.start(me("--role", "client", *common, "--keys", str(a.keys), "--size",
                            str(a.size), "--tag", f"{cid}/c{c}", "--settle", str(a.settle),
                            "--recover-timeout", str(a.recover_timeout)),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                         stderr=open(logdir / f"{cid}-client{c}.log", "w"))  # fmt: skip
            clients.append(p)
        for p in clients:
            line = p.stdout.readline()
            if not line.startswith("PUBLISHED"):
                raise RuntimeError(f"{system} client: {line!r} (logs in {logdir})")
        time.sleep(a.steady)
        # The leader right now (it cannot change in between: nothing else is failing).
        leader = leader_of(etcd, system, cid, masters)
        if leader is None:
            raise RuntimeError(f"{system}: no leader before the kill")
        t_kill, wall_kill = time.monotonic(), time.time()
        masters[leader][0].kill()
        for p in clients:
            p.stdin.write(f"KILL {t_kill!r}\n")
            p.stdin.flush()
        wait_leader(etcd, system, cid, masters, not_index=leader, timeout=a.recover_timeout)
        t_leader = time.monotonic() - t_kill
        recs = []
        for p in clients:
            # Not communicate(): closing its stdin would end the client's loop.
            p.wait(timeout=a.recover_timeout + 120)
            out = p.stdout.read()
            lines = [x for x in out.splitlines() if x.startswith("{")]
            if not lines:
                raise RuntimeError(f"{system} client gave no record (logs in {logdir})")
            rec = json.loads(lines[-1])
            if "error" in rec:
                raise RuntimeError(f"{system} client: {rec['error']}")
            recs.append(rec)

        def worst(k):
            xs = [x[k] for x in recs]
            return None if any(x is None for x in xs) else max(xs)

        def total(k):
            return sum(x[k] for x in recs)

        states = {}
        if system == "mooncake":
            states = mooncake_states(logdir / f"{cid}-master{1 - leader}.log", wall_kill)
        return {
            "leader_s": t_leader,
            "warmup_s": states.get("leader_warmup"),
            "serving_s": states.get("serving"),
            "first_put_s": worst("first_put_s"),
            "first_get_s": worst("first_get_s"),
            "failed_after": total("failed_after"),
            "failed_gap": total("failed_gap"),
            "failed_late": total("failed_late"),
            "calls_after": total("calls_after"),
            "failed_before": total("failed_before"),
            "calls_before": total("calls_before"),
            "published": total("published"),
            "kept": total("kept"),
            "wrong": total("wrong"),
            "lost_put_before_kill_s": sorted(sum((x["lost_put_before_kill_s"] for x in recs), []))[:64],
            "lost_max_s": max((x["lost_max_s"] for x in recs if x["lost_max_s"] is not None), default=None),
            "put_codes_after": {k: sum(x["put_codes_after"].get(k, 0) for x in recs)
                                for k in sorted({k for x in recs for k in x["put_codes_after"]})},
            "longest_call_s": max(x["longest_call_s"] for x in recs),
            "clients": recs,
        }
    finally:
        ps.kill_all()


# ---------------------------------------------------------------- op-log cost


def oplog_round(mode: str, clients: int, etcd: Etcd, a, r: int, logdir: Path) -> dict:
    """`mode`: "single" (one master, no etcd), "etcd" (two masters on etcd) or "etcdS"
    (S shards of two masters each on etcd)."""
    ps = Procs()
    cid = f"habench-{os.getpid()}-oplog-{r}-{clients}-{mode}"
    try:
        if mode == "single":
            port = free_port()
            ps.start([a.pagewire, "store", "master", "--listen", f"127.0.0.1:{port}"],
                     stdout=subprocess.DEVNULL)  # fmt: skip
            wait_port(port)
            master, extra = f"127.0.0.1:{port}", []
        elif mode == "etcd":
            masters = start_masters(ps, "pagewire", etcd, cid, a, logdir)
            wait_leader(etcd, "pagewire", cid, masters)
            master, extra = etcd.url, ["--cluster-id", cid]
        else:
            shards = int(mode.removeprefix("etcd"))
            for i in range(shards):
                masters = start_masters(ps, "pagewire", etcd, cid, a, logdir, (shards, i))
                wait_leader(etcd, "pagewire", f"{cid}/shard/{i}", masters)
            master, extra = etcd.url, ["--cluster-id", cid]
        batches = a.oplog_iters + a.oplog_warmup
        # Half again as much as the objects take: the master evicts at 90 % usage, and a
        # sharded node splits its segment evenly while keys split by hash only roughly.
        seg = clients * batches * 64 * 64 * 1024 * 3 // 2
        node = ps.start([a.pagewire, "store", "serve", "--master", master, *extra, "--segment",
                         str(seg), "--listen", "127.0.0.1:0", "--transport", "tcp"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        line = node.stdout.readline()
        if "mounted" not in line:
            raise RuntimeError(f"pagewire store serve ({mode}): {line!r}")
        r = subprocess.run([a.pagewire, "bench", "store", "--master", master, *extra,
                            "--model", "llama3-8b", "--layers", "2", "--pages", "32",
                            "-n", str(a.oplog_iters), "--warmup", str(a.oplog_warmup),
                            "--clients", str(clients),
                            "--transport", "tcp", "--listen", "127.0.0.1:0", "--json"],
                           capture_output=True, text=True, timeout=600, env=ENV)  # fmt: skip
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or not lines:
            raise RuntimeError(f"bench store ({mode}) failed:\n{r.stderr[-2000:]}")
        rec = json.loads(lines[-1])
        assert rec["objects_per_batch"] == 64 and rec["object_bytes"] == 64 * 1024, rec
        return {"put": rec["put"], "get": rec["get"]}
    finally:
        ps.kill_all()


# ---------------------------------------------------------------- report


def cell(xs, d=2) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.{d}f} [{min(xs):.{d}f}, {max(xs):.{d}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["holder", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5, help="failover rounds (default 5; 0: none)")
    ap.add_argument("--oplog-rounds", type=int, default=10, help="op-log cost rounds (default 10; 0: none)")
    ap.add_argument("--oplog-iters", type=int, default=100, help="measured batches per bench store run")
    ap.add_argument("--oplog-warmup", type=int, default=4)
    ap.add_argument("--etcd-members", type=int, default=3, help="etcd cluster size (default 3)")
    ap.add_argument("--oplog-shards", default="",
                    help="also measure clusters of these shard counts on etcd, comma separated (e.g. 2)")
    ap.add_argument("--oplog-clients", default="1,4",
                    help="bench store --clients values to measure, comma separated (default 1,4)")  # fmt: skip
    ap.add_argument("--keys", type=int, default=32, help="keys each client publishes first (default 32)")
    ap.add_argument("--size", type=int, default=64 * 1024, help="bytes per value (default 64 KiB)")
    ap.add_argument("--segment", type=int, default=512 * MIB, help="the holder's segment")
    ap.add_argument("--steady", type=float, default=1.0, help="seconds of loop before the kill")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds of loop after both first OK calls, before the check")  # fmt: skip
    ap.add_argument("--recover-timeout", type=float, default=60.0)
    ap.add_argument("--pagewire", default="target/release/pagewire")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="failover: mooncake,pagewire")
    ap.add_argument("--logs", help="directory for the processes' logs (default: a temporary one)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.role == "holder":
        return role_holder(a)
    if a.role == "client":
        return role_client(a)

    logdir = Path(a.logs or tempfile.mkdtemp(prefix="pagewire-ha-bench-logs-"))
    logdir.mkdir(parents=True, exist_ok=True)
    etcd = Etcd(a.etcd_members)
    loads = [os.getloadavg()[0]]
    systems = [s for s in SYSTEMS if s in a.systems.split(",")]
    fail: dict[str, list] = {s: [] for s in systems}
    for r in range(a.rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for s in order:
            x = failover_round(s, etcd, a, r, logdir)
            fail[s].append(x)
            print(f"# failover round {r + 1} {s}: leader {x['leader_s']:.2f} s, first put "
                  f"{x['first_put_s']}, first get {x['first_get_s']}, failed {x['failed_gap']}+{x['failed_late']}"
                  f"/{x['calls_after']}, kept {x['kept']}/{x['published']}, wrong {x['wrong']}, "
                  f"lost: put {x['lost_max_s']} s before the kill at most; failed put codes {x['put_codes_after']}",
                  file=sys.stderr, flush=True)  # fmt: skip
        loads.append(os.getloadavg()[0])
    nclients = [int(x) for x in a.oplog_clients.split(",")]
    modes = ["single", "etcd"] + [f"etcd{int(x)}" for x in a.oplog_shards.split(",") if x.strip()]
    oplog: dict[str, list] = {f"{m}/{c}": [] for m in modes for c in nclients}
    for r in range(a.oplog_rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for c in nclients:
            for m in order:
                oplog[f"{m}/{c}"].append(oplog_round(m, c, etcd, a, r, logdir))
            print(f"# op-log round {r + 1}, {c} clients: put MiB/s single "
                  f"{oplog[f'single/{c}'][-1]['put']['mib_s']:.0f}, "
                  f"etcd {oplog[f'etcd/{c}'][-1]['put']['mib_s']:.0f}", file=sys.stderr, flush=True)  # fmt: skip
        loads.append(os.getloadavg()[0])

    print(f"# {os.cpu_count()} CPUs, 1-minute load {min(loads):.2f}-{max(loads):.2f} over the run; "
          f"etcd: {a.etcd_members} member(s) on 127.0.0.1; logs in {logdir}")  # fmt: skip
    if a.rounds:
        print()
        print(f"Failover: {a.rounds} rounds per system; two masters, one holder ({a.segment // MIB} MiB "
              f"segment), two clients; values of {a.size} B; {a.keys} keys per client published first; "
              "seconds after the SIGKILL of the leader, median [min, max]; first put/get: the later "
              "of the two clients; failed: calls of both clients that failed after the kill, until the client "
              "had both a put and a get served, and after that (until the check); kept: objects "
              "whose put succeeded before the kill that read back with their bytes afterwards.")  # fmt: skip
        print()
        print("| system | new leader in etcd (s) | first OK put (s) | first OK get (s) | failed calls, gap + after | "
              "longest call (s) | kept / published | wrong bytes |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for s in systems:
            xs = fail[s]
            kept = "; ".join(f"{x['kept']}/{x['published']}" for x in xs)
            print(f"| {s} | {cell([x['leader_s'] for x in xs])} | {cell([x['first_put_s'] for x in xs])} "
                  f"| {cell([x['first_get_s'] for x in xs])} | {cell([x['failed_gap'] for x in xs], 0)} + "
                  f"{cell([x['failed_late'] for x in xs], 0)} "
                  f"| {cell([x['longest_call_s'] for x in xs])} | {kept} | {sum(x['wrong'] for x in xs)} |")  # fmt: skip
        ratio = [p["first_put_s"] / m["first_put_s"]
                 for p, m in zip(fail.get("pagewire", []), fail.get("mooncake", []))
                 if p["first_put_s"] and m["first_put_s"]]  # fmt: skip
        mc = fail.get("mooncake", [])
        if mc:
            print()
            print(f"Mooncake's promoted master (its log): leader_warmup from "
                  f"{cell([x['warmup_s'] for x in mc])} s to serving at {cell([x['serving_s'] for x in mc])} s "
                  "after the kill.")  # fmt: skip
        for s in systems:
            xs = fail[s]
            lossy = [x for x in xs if x["kept"] < x["published"]]
            codes: dict[str, int] = {}
            for x in xs:
                for k, v in x["put_codes_after"].items():
                    codes[k] = codes.get(k, 0) + v
            print()
            print(f"{s}: objects lost in {len(lossy)} of {len(xs)} rounds"
                  + (f", put at most {max(x['lost_max_s'] for x in lossy) * 1e3:.0f} ms before the kill"
                     if lossy else "")
                  + f"; failed puts after the kill by return code, all rounds: {codes or 'none'}.")  # fmt: skip
        print()
        print(f"pagewire / Mooncake, time to the first OK put per round: {cell(ratio)}; checked gets "
              f"before the kill: {sum(x['calls_before'] for s in systems for x in fail[s])}, failed "
              f"{sum(x['failed_before'] for s in systems for x in fail[s])}.")  # fmt: skip
    if a.oplog_rounds:
        print()
        print(f"Op-log cost: `pagewire bench store --model llama3-8b --layers 2 --pages 32 -n {a.oplog_iters}` "
              f"(64 x 64 KiB a batch) with `--clients N` (N clients at once, MiB/s summed), "
              f"{a.oplog_rounds} rounds, order alternating; MiB/s, median [min, max]; "
              "ratio etcd / single per round; p50: the run's median batch time.")  # fmt: skip
        print()
        print("| op | clients | single master MiB/s | two masters on etcd MiB/s | ratio | single p50 ms "
              "| etcd p50 ms | ratio |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for op in ("put", "get"):
            for c in nclients:
                one = [x[op]["mib_s"] for x in oplog[f"single/{c}"]]
                ha = [x[op]["mib_s"] for x in oplog[f"etcd/{c}"]]
                one50 = [x[op]["p50_ms"] for x in oplog[f"single/{c}"]]
                ha50 = [x[op]["p50_ms"] for x in oplog[f"etcd/{c}"]]
                print(f"| {op} | {c} | {cell(one, 0)} | {cell(ha, 0)} | {cell([b / x for x, b in zip(one, ha)])} "
                      f"| {cell(one50)} | {cell(ha50)} | {cell([b / x for x, b in zip(one50, ha50)])} |")  # fmt: skip
        for m in modes[2:]:
            print()
            print(f"Sharded: {m[4:]} shards of two masters each on the same etcd, against the unsharded pair; "
                  "ratio per round.")  # fmt: skip
            print()
            print("| op | clients | two masters on etcd MiB/s | sharded MiB/s | ratio | sharded p50 ms |")
            print("| --- | ---: | ---: | ---: | ---: | ---: |")
            for op in ("put", "get"):
                for c in nclients:
                    ha = [x[op]["mib_s"] for x in oplog[f"etcd/{c}"]]
                    sh = [x[op]["mib_s"] for x in oplog[f"{m}/{c}"]]
                    print(f"| {op} | {c} | {cell(ha, 0)} | {cell(sh, 0)} | {cell([b / x for x, b in zip(ha, sh)])} "
                          f"| {cell([x[op]['p50_ms'] for x in oplog[f'{m}/{c}']])} |")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "loads": loads, "failover": fail,
                                            "oplog": oplog}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
