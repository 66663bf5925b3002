#!/usr/bin/env bash
# pagewire vs perftest on the same RDMA device in the same run, pagewire's TCP
# backend vs iperf3 on loopback, and pagewire vs Mooncake's transfer_engine_bench on both
# (scripts/bench-vs-mooncake.sh). Prints side-by-side tables (markdown) with the ratio
# pagewire/perftest per message size: median of N runs, with the min and max.
#
#   scripts/bench-vs-perftest.sh --report                             # everything: the tables of docs/benchmarks.md
#   scripts/rdma-vm.sh run -- scripts/bench-vs-perftest.sh            # RDMA part only, in the soft-RoCE VM
#   scripts/bench-vs-perftest.sh --section tcp                        # TCP part only, on the host
#   scripts/bench-vs-perftest.sh --section ha                         # masters on etcd against Mooncake HA, on the host
#   scripts/rdma-vm.sh --two-rails --cpus 2 --mem 2048 run -- scripts/bench-vs-perftest.sh --section rails
#                                                                     # two rails against one, in the VM
#
# Options:
#   --report                 run the TCP, TCP pages, Mooncake (TCP), python and ha sections here, then
#                            the paired, verbs pages and Mooncake (rxe) sections in the
#                            soft-RoCE VM (scripts/rdma-vm.sh --cpus 2 --mem 2048), and write
#                            one markdown report of all the tables (report.md in --out). The
#                            VM part takes about 2.5 min per --pair-rounds round on a 2-core
#                            TCG host, plus about 4 min per --mc-rounds round, plus a minute.
#   --section S              rdma | paired | tcp | pages | mooncake | python | ha | rails | all, or a list
#                            such as "rdma pages" (mooncake: scripts/bench-vs-mooncake.sh, over
#                            verbs when a device is visible, else TCP; not in "all"; rails:
#                            `bench write` at 1 MiB and 8 MiB over two rails against one, in
#                            paired rounds alternating the order, between the rail lists of
#                            RDMA_RAILS and RDMA_PEER_RAILS (rdma-vm.sh --two-rails); not in
#                            "all"; python: on the host, TCP on 127.0.0.1, installs .venv
#                            (scripts/python-test.sh --install-only) and NIXL's wheel
#                            (scripts/nixl-venv.sh), then benches/python/bench_mooncake_compat.py
#                            (one synchronous call, pagewire against Mooncake's wheel and
#                            NIXL's UCX over TCP) and benches/python/setup_vs_mooncake.py (a
#                            store client's setup with a 3200 MiB segment); not in "all";
#                            ha: on the host, installs .venv like python, starts a 3-member
#                            etcd (Debian's etcd-server) on 127.0.0.1 and runs
#                            benches/python/ha_vs_mooncake.py: kill -9 of the leading master
#                            while two clients put and get, pagewire's masters on etcd
#                            against mooncake_master --enable_ha --enable_oplog, then `bench
#                            store` against one master and against --master etcd://; not in
#                            "all")
#                            (default: "rdma pages" if an RDMA device is visible, else
#                            "tcp pages"). pages: `bench pages` (Llama-3-8B preset, random
#                            pages) against `bench write` at the same bytes per work request,
#                            on verbs when a device is visible, else on TCP. paired: the
#                            targets' range measured in pairs (below).
#   --pair-rounds N          rounds of the paired section (default 5). Each round runs, for
#                            WRITE and READ and every size from 64 KiB to 8 MiB, perftest and
#                            pagewire back to back with one size per process (`-s`), the order
#                            alternating between rounds, then ib_write_lat, ib_send_lat and
#                            pagewire's two latency loops, each with manual and auto progress,
#                            in rotating order (--poll-memory
#                            against ib_write_lat, notify against ib_send_lat, the perftest
#                            tool that waits the same way): a drift of the guest's speed
#                            hits both sides of a pair, which the `-a` sweeps (minutes apart
#                            per size) cannot promise. Ratios are per pair. 5 rounds take
#                            about 13 min in the 2-vCPU TCG guest.
#   --pair-mib N             MiB each paired bandwidth measurement moves (default 32; at
#                            least 16 iterations per size)
#   --pair-small-iters N     iterations of the paired small-message runs (2, 8, 64 and 512 B,
#                            WRITE and READ, message rate; default 5000, perftest's -n for
#                            ib_write_bw, so a process's first batch weighs little)
#   --pages N --page-iters N pages per batch and batches of the pages runs (default 8 and 5
#                            on verbs, 32 and 20 on TCP)
#   --mc-rounds N            rounds of the mooncake section (default 5)
#   --rails-rounds N         rounds of the rails section (default 5)
#   --py-rounds N            rounds of the python section's call benchmark (default 10)
#   --setup-rounds N         rounds of the python section's setup benchmark (default 5)
#   --ha-rounds N            failover rounds of the ha section, per system (default 5)
#   --oplog-rounds N         `bench store` rounds of the ha section, per master set-up (default 10)
#   --rails-mib N            MiB each rails measurement moves (default 64; at least 16 WRs)
#   --runs N                 runs of every test (default 3)
#   --iters N                iterations per size for the bandwidth sweeps (default 50: with
#                            fewer, each size is one or two batches and pagewire's fixed
#                            per-batch cost dominates; the 3-run rdma section takes ~6 min)
#   --lat-iters N            ping-pong iterations for the latency tests (default 1000)
#   --device DEV             RDMA device (default: $RDMA_DEVICE, else rxe0)
#   --tcp-size SIZE          message size of pagewire's TCP runs (default 1M)
#   --tcp-secs S             seconds per TCP run (default 5)
#   --streams "1 4"          stream counts compared with iperf3 (default "1 4")
#   --out DIR                raw outputs and tables (default: a new directory per invocation,
#                            target/bench-vs-perftest/<time>-<pid>, or under $SOFTROCE_OUT
#                            inside the VM, so concurrent runs never mix their files)
#   --pagewire PATH          the binary (default target/release/pagewire)
#   --raw PATH               the raw-verbs ping-pong for the latency floor (default
#                            target/release/examples/raw_verbs_lat; the row is skipped if
#                            missing: cargo build --release -p pagewire-transport --example raw_verbs_lat)
#   --pool DIR...            measure nothing: print the paired section's tables pooled over
#                            the raw outputs of earlier invocations (each DIR an --out
#                            directory or its raw/), every round of each, with a 95%
#                            bootstrap interval of every median ratio. Last option.
set -uo pipefail
cd "$(dirname "$0")/.."

report=0 section="" mc_rounds=5 py_rounds=10 setup_rounds=5 ha_rounds=5 oplog_rounds=10 rails_rounds=5 rails_mib=64 pages_n="" page_iters="" runs=3 pair_rounds=5 pair_mib=32 pair_small_iters=5000 iters=50 lat_iters=1000 dev="${RDMA_DEVICE:-rxe0}" tcp_size=1M tcp_secs=5
streams="1 4" out="" pw="target/release/pagewire" raw="target/release/examples/raw_verbs_lat"
pair_sizes="65536 131072 262144 524288 1048576 2097152 4194304 8388608" pair_small="2 8 64 512"
pool_dirs=()
while (($#)); do
    case "$1" in
        --report) report=1; shift ;;
        --section) section="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --mc-rounds) mc_rounds="$2"; shift 2 ;;
        --rails-rounds) rails_rounds="$2"; shift 2 ;;
        --py-rounds) py_rounds="$2"; shift 2 ;;
        --setup-rounds) setup_rounds="$2"; shift 2 ;;
        --ha-rounds) ha_rounds="$2"; shift 2 ;;
        --oplog-rounds) oplog_rounds="$2"; shift 2 ;;
        --rails-mib) rails_mib="$2"; shift 2 ;;
        --pair-rounds) pair_rounds="$2"; shift 2 ;;
        --pair-mib) pair_mib="$2"; shift 2 ;;
        --pair-small-iters) pair_small_iters="$2"; shift 2 ;;
        --pages) pages_n="$2"; shift 2 ;;
        --page-iters) page_iters="$2"; shift 2 ;;
        --iters) iters="$2"; shift 2 ;;
        --lat-iters) lat_iters="$2"; shift 2 ;;
        --device) dev="$2"; shift 2 ;;
        --tcp-size) tcp_size="$2"; shift 2 ;;
        --tcp-secs) tcp_secs="$2"; shift 2 ;;
        --streams) streams="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --pagewire) pw="$2"; shift 2 ;;
        --raw) raw="$2"; shift 2 ;;
        --pool) shift; pool_dirs=("$@"); (($#)) || { echo "bench-vs-perftest: --pool needs directories" >&2; exit 2; }; break ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench-vs-perftest: unknown option $1" >&2; exit 2 ;;
    esac
done
# --pool measures nothing: it only re-tabulates (after the definitions below).
pool_only=$((${#pool_dirs[@]} > 0))
if ((!pool_only)) && [[ -z "$out" ]]; then
    stamp="$(date -u +%Y%m%d-%H%M%S)-$$"
    if [[ -n "${SOFTROCE_OUT:-}" ]]; then out="$SOFTROCE_OUT/bench-vs-perftest/$stamp"; else out="target/bench-vs-perftest/$stamp"; fi
fi
((pool_only)) || mkdir -p "$out/raw"
((pool_only)) || [[ -x "$pw" ]] || { echo "bench-vs-perftest: $pw not found; build it: cargo build --release -p pagewire-cli" >&2; exit 1; }
have_rdma=0
[[ -e "/sys/class/infiniband/$dev" ]] && have_rdma=1
if [[ -z "$section" ]]; then
    if ((have_rdma)); then section="rdma pages"; else section="tcp pages"; fi
fi
[[ "$section" == all ]] && section="rdma paired tcp pages"

port=19000
next_port() { port=$((port + 1)); }

# Runs "SERVER CMD" in the background and "CLIENT CMD" in the foreground; the client's
# stdout goes to $1. perftest's client does not retry, so wait until the server listens.
pair() {
    local outfile="$1" server="$2" client="$3"
    bash -c "$server" >"$outfile.server" 2>&1 &
    local spid=$!
    local t=0
    until grep -q ":$(printf '%04X' "$port") 00000000" /proc/net/tcp /proc/net/tcp6 2>/dev/null || ((t >= 100)); do
        sleep 0.1; t=$((t + 1))
    done
    bash -c "$client" >"$outfile" 2>"$outfile.err"
    local rc=$?
    wait "$spid" 2>/dev/null
    if ((rc != 0)); then
        echo "  FAILED ($rc): $client" >&2
        sed 's/^/    /' "$outfile.err" "$outfile.server" | tail -n 12 >&2
    fi
    return $rc
}

machine() {
    echo "## Machine"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- kernel: $(uname -r)"
    echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) online)"
    echo "- load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "- pagewire: $("$pw" --version 2>/dev/null), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
}

rdma_section() {
    command -v ib_write_bw >/dev/null || { echo "bench-vs-perftest: perftest is not installed" >&2; return 1; }
    echo "## RDMA: $dev, perftest vs pagewire (same device, same run)" | tee "$out/rdma.md"
    local r
    for ((r = 1; r <= runs; r++)); do
        echo "run $r/$runs" >&2
        for t in write read; do
            next_port
            pair "$out/raw/perftest_${t}_$r.txt" \
                "ib_${t}_bw -d $dev -a -n $iters -F -p $port" \
                "ib_${t}_bw -d $dev -a -n $iters -F -p $port 127.0.0.1"
            next_port
            pair "$out/raw/pagewire_${t}_$r.txt" \
                "$pw bench $t --server -d $dev --transport verbs -a -n $iters -p $port" \
                "$pw bench $t 127.0.0.1 -d $dev --transport verbs -a -n $iters -p $port"
        done
        next_port
        pair "$out/raw/perftest_lat_$r.txt" \
            "ib_write_lat -d $dev -n $lat_iters -F -p $port" \
            "ib_write_lat -d $dev -n $lat_iters -F -p $port 127.0.0.1"
        next_port
        pair "$out/raw/perftestsend_lat_$r.txt" \
            "ib_send_lat -d $dev -n $lat_iters -F -p $port" \
            "ib_send_lat -d $dev -n $lat_iters -F -p $port 127.0.0.1"
        next_port
        pair "$out/raw/pagewire_lat_$r.txt" \
            "$pw bench lat --server -d $dev --transport verbs -n $lat_iters -p $port" \
            "$pw bench lat 127.0.0.1 -d $dev --transport verbs -n $lat_iters -p $port"
        next_port
        pair "$out/raw/pagewirepoll_lat_$r.txt" \
            "$pw bench lat --server -d $dev --transport verbs -n $lat_iters -p $port --poll-memory" \
            "$pw bench lat 127.0.0.1 -d $dev --transport verbs -n $lat_iters -p $port --poll-memory"
        # The general path: a new batch per ping instead of one prepared batch.
        local m
        for m in "" "--poll-memory"; do
            next_port
            pair "$out/raw/pagewireeach${m:+poll}_lat_$r.txt" \
                "$pw bench lat --server -d $dev --transport verbs -n $lat_iters -p $port --submit-each $m" \
                "$pw bench lat 127.0.0.1 -d $dev --transport verbs -n $lat_iters -p $port --submit-each $m"
        done
        if [[ -x "$raw" ]]; then
            for m in "" "--imm"; do
                next_port
                pair "$out/raw/raw${m:+imm}_lat_$r.txt" "$raw --server $m -d $dev -n $lat_iters -p $port" \
                    "$raw 127.0.0.1 $m -d $dev -n $lat_iters -p $port"
            done
        fi
    done
    # Header blocks of the last run, for the record.
    for f in perftest_write pagewire_write; do
        { echo; echo "### $f header (run $runs)"; echo; echo '```'; sed -n '1,/#bytes/p' "$out/raw/${f}_$runs.txt"; echo '```'; } >>"$out/rdma.md"
    done
    python3 - "$out/raw" "$runs" rdma >>"$out/rdma.md" <<'PY'
import re, statistics, sys, os
raw, runs, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
row = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(.*)$")

def table(path):
    """size -> list of numbers after the iterations column."""
    out, seen = {}, False
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return out
    for l in lines:
        if "#bytes" in l:
            seen = True
            continue
        m = row.match(l) if seen else None
        if m:
            nums = [float(x) for x in l.split()[2:]]
            out[int(m.group(1))] = nums
    return out

def runs_of(tool, test):
    return [table(os.path.join(raw, f"{tool}_{test}_{r}.txt")) for r in range(1, runs + 1)]

def mmm(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return (min(xs), statistics.median(xs), max(xs))

def fmt(t, d=2):
    if t is None:
        return "n/a"
    lo, med, hi = t
    return f"{med:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"

for test, title in (("write", "RDMA WRITE bandwidth, `-a`"), ("read", "RDMA READ bandwidth, `-a`")):
    pf, pw = runs_of("perftest", test), runs_of("pagewire", test)
    sizes = sorted(set().union(*[set(t) for t in pf + pw]))
    print(f"\n### {title} ({runs} runs; median [min, max]; ratio = pagewire/perftest per run)\n")
    print("| bytes | perftest BW avg MiB/s | pagewire BW avg MiB/s | ratio BW | perftest Mpps | pagewire Mpps | ratio Mpps |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s in sizes:
        def col(runs_, i):
            return [t[s][i] if s in t and len(t[s]) > i else None for t in runs_]
        a_bw, b_bw = col(pf, 1), col(pw, 1)
        a_mr, b_mr = col(pf, 2), col(pw, 2)
        r_bw = [b / a if a and b is not None else None for a, b in zip(a_bw, b_bw)]
        r_mr = [b / a if a and b is not None else None for a, b in zip(a_mr, b_mr)]
        print(f"| {s} | {fmt(mmm(a_bw))} | {fmt(mmm(b_bw))} | {fmt(mmm(r_bw))} | {fmt(mmm(a_mr), 6)} | {fmt(mmm(b_mr), 6)} | {fmt(mmm(r_mr))} |")

print(f"\n### RDMA latency, 2 bytes ({runs} runs; median [min, max]; usec; ratio = row/ib_write_lat per run, or row/ib_send_lat where the row says so)\n")
print("notify: each side waits for the engine's notification of the peer's write; poll: `--poll-memory`, spins on the last byte like ib_write_lat. "
      "prepared: one prepared batch started per ping (the default; perftest also re-posts one work request); "
      "submit-each: a new batch per ping (`--submit-each`). raw verbs: `raw_verbs_lat`, ib_write_lat's loop on sideway without the engine (with `--imm`: each WRITE carries an immediate and the receiver polls for the RECV completion, the floor of the notify rows).\n")
print("| client | t_min | t_typical | ratio t_typical | 99% | ratio 99% |")
print("|---|---:|---:|---:|---:|---:|")
def lat_col(runs_, i):
    return [t[2][i] if 2 in t and len(t[2]) > i else None for t in runs_]
pf = runs_of("perftest", "lat")
pfs = runs_of("perftestsend", "lat")
rows = [("ib_write_lat (perftest)", "perftest", pf), ("ib_send_lat (perftest, SEND + RECV completion)", "perftestsend", pf),
        ("raw verbs (sideway, no engine)", "raw", pf),
        ("raw verbs, WRITE_WITH_IMM + RECV (no engine)", "rawimm", pf),
        ("pagewire, prepared, poll", "pagewirepoll", pf), ("pagewire, prepared, notify", "pagewire", pf),
        ("pagewire, prepared, notify, ratio to ib_send_lat", "pagewire", pfs),
        ("pagewire, submit-each, poll", "pagewireeachpoll", pf), ("pagewire, submit-each, notify", "pagewireeach", pf)]
for label, tool, ref in rows:
    rr = runs_of(tool, "lat")
    if not any(rr) or not any(ref):
        continue
    cells = []
    for i in (0, 2, 5):
        a, b = lat_col(ref, i), lat_col(rr, i)
        cells.append(fmt(mmm(b)))
        if i != 0:
            cells.append(fmt(mmm([y / x if x and y is not None else None for x, y in zip(a, b)])))
    print(f"| {label} | " + " | ".join(cells) + " |")
PY
    cat "$out/rdma.md"
}

# The paired section's tables over the raw outputs in RAWDIR... : one invocation's
# (pool 0), or several pooled (pool 1, adds a bootstrap interval of each median ratio).
paired_tables() {
    local pool=$1; shift
    python3 - "$pair_mib" "$pair_sizes" "$lat_iters" "$pair_small" "$pair_small_iters" "$pool" "$@" <<'PY'
import re, statistics, sys, os, random
# argv: mib sizes lat_iters small small_iters pool(0|1) RAWDIR...
mib, sizes, lat_iters = sys.argv[1], [int(x) for x in sys.argv[2].split()], sys.argv[3]
small, small_iters, pool = [int(x) for x in sys.argv[4].split()], sys.argv[5], sys.argv[6] == "1"
raws = sys.argv[7:]
row = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)")
pair_file = re.compile(r"pair_\w+?_(\d+)\.txt")

def first_row(path, col):
    """The first result row's column `col` (counted after #bytes and #iterations)."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    seen = False
    for l in lines:
        if "#bytes" in l:
            seen = True
            continue
        if seen and row.match(l):
            nums = l.split()[2:]
            return float(nums[col]) if len(nums) > col else None
    return None

def rounds_in(d):
    """The rounds in raw dir `d`: the trailing numbers of its pairs' output files."""
    return sorted({int(m.group(1)) for f in os.listdir(d) if (m := pair_file.fullmatch(f))})

rounds = [(d, r) for d in raws for r in rounds_in(d)]

def q(xs, p):
    xs = sorted(xs)
    i = p * (len(xs) - 1)
    lo = int(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)

def cell(xs, d=2):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.{d}f} [{min(xs):.{d}f}, {max(xs):.{d}f}]"

def ci(xs):
    """95% bootstrap interval of the median (fixed seed, so a table re-prints the same)."""
    if len(xs) < 2:
        return "n/a"
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(4000))
    return f"{meds[100]:.2f}-{meds[3899]:.2f}"

def col(name, c):
    return [first_row(os.path.join(d, name.format(r=r)), c) for d, r in rounds]

def ratios(a, b):
    return [y / x for x, y in zip(a, b) if x and y is not None]

ci_head, ci_rule = (" ratio 95% CI |", "---:|") if pool else ("", "")
if pool:
    print(f"\nPooled over {len(raws)} invocations, {len(rounds)} rounds in all: "
          + ", ".join(f"`{os.path.basename(os.path.dirname(d.rstrip('/'))) or d}`" for d in raws) + ". "
          "Each cell: median [min, max] over the pairs; a ratio is pagewire/perftest within one pair. "
          "\"ratio 95% CI\" is a bootstrap interval of the median ratio (4000 resamples of the pairs): "
          "a target is met within the noise if its threshold lies inside the interval or on the good side of it.\n")
else:
    print(f"\n{len(rounds)} rounds. Each cell: median [min, max] over the rounds; a ratio is "
          f"pagewire/perftest within one pair (the two runs back to back, order alternating by round). "
          f"Each bandwidth run moves at least {mib} MiB (`-s SIZE -n max(16, {mib} MiB / SIZE)`); "
          f"\"perftest spread\" is max/min of perftest's own runs of that size, the noise to read the ratios against.\n")
for test, title in (("write", "RDMA WRITE"), ("read", "RDMA READ")):
    print(f"\n### {title} bandwidth, 64 KiB-8 MiB, in pairs\n")
    print(f"| bytes | perftest MiB/s | pagewire MiB/s | ratio |{ci_head} pairs >= 1.00 | perftest spread |")
    print(f"|---:|---:|---:|---:|{ci_rule}---:|---:|")
    at_or_above = 0
    for s in sizes:
        a = col(f"pair_perftest_{test}_{s}_{{r}}.txt", 1)
        b = col(f"pair_pagewire_{test}_{s}_{{r}}.txt", 1)
        rr = ratios(a, b)
        ok = sum(1 for x in rr if x >= 1.0)
        if rr and statistics.median(rr) >= 1.0:
            at_or_above += 1
        aa = [x for x in a if x]
        spread = f"{max(aa) / min(aa):.2f}" if aa else "n/a"
        extra = f" {ci(rr)} |" if pool else ""
        print(f"| {s} | {cell(a)} | {cell(b)} | {cell(rr)} |{extra} {ok}/{len(rr)} | {spread} |")
    print(f"\nSizes whose median ratio is at least 1.00: {at_or_above}/{len(sizes)}.")

for test, title in (("write", "RDMA WRITE"), ("read", "RDMA READ")):
    iters = "" if pool else f" (`-s SIZE -n {small_iters}`)"
    print(f"\n### {title} message rate, small messages, in pairs{iters}\n")
    print(f"| bytes | perftest Mpps | pagewire Mpps | ratio |{ci_head} pairs >= 0.90 | perftest spread |")
    print(f"|---:|---:|---:|---:|{ci_rule}---:|---:|")
    for s in small:
        a = col(f"pair_perftest_{test}_{s}_{{r}}.txt", 2)
        b = col(f"pair_pagewire_{test}_{s}_{{r}}.txt", 2)
        rr = ratios(a, b)
        ok = sum(1 for x in rr if x >= 0.9)
        aa = [x for x in a if x]
        spread = f"{max(aa) / min(aa):.2f}" if aa else "n/a"
        extra = f" {ci(rr)} |" if pool else ""
        print(f"| {s} | {cell(a, 4)} | {cell(b, 4)} | {cell(rr)} |{extra} {ok}/{len(rr)} | {spread} |")

iters = "" if pool else f"`-n {lat_iters}`; "
print(f"\n### RDMA latency, 2 bytes, in rounds ({iters}the six clients in rotating order each round; usec)\n")
print("Each pagewire mode against the perftest tool that detects the peer's message the same way: "
      "`--poll-memory` spins on the last byte, as ib_write_lat does; notify waits for a receive "
      "completion (WRITE_WITH_IMM), as ib_send_lat does (SEND). Ratios are per round. "
      "manual: `bench lat`'s default, only the loop's own waits reap (no completion thread, "
      "as in perftest); auto: `--progress auto`, the engine's completion thread as well.\n")
print(f"| client | against | t_typical | ratio t_typical | ratio q25-q75 |{ci_head} rounds within 1.10 | 99% | ratio 99% |")
print(f"|---|---|---:|---:|---:|{ci_rule}---:|---:|---:|")
for label, tool, ref, ref_label in (
        ("ib_write_lat (perftest)", "perftest", None, ""),
        ("ib_send_lat (perftest)", "perftestsend", "perftest", "ib_write_lat"),
        ("pagewire, prepared, poll, manual", "pagewirepoll", "perftest", "ib_write_lat"),
        ("pagewire, prepared, poll, auto", "pagewirepollauto", "perftest", "ib_write_lat"),
        ("pagewire, prepared, notify, manual", "pagewire", "perftestsend", "ib_send_lat"),
        ("pagewire, prepared, notify, auto", "pagewireauto", "perftestsend", "ib_send_lat"),
        ("pagewire, prepared, notify, manual", "pagewire", "perftest", "ib_write_lat")):
    t, p99 = col(f"pair_{tool}_lat_{{r}}.txt", 2), col(f"pair_{tool}_lat_{{r}}.txt", 5)
    if ref is None:
        extra = " |" if pool else ""
        print(f"| {label} | | {cell(t)} | | |{extra} | {cell(p99)} | |")
        continue
    rt = ratios(col(f"pair_{ref}_lat_{{r}}.txt", 2), t)
    r99 = ratios(col(f"pair_{ref}_lat_{{r}}.txt", 5), p99)
    iqr = f"{q(rt, 0.25):.2f}-{q(rt, 0.75):.2f}" if rt else "n/a"
    within = sum(1 for x in rt if x <= 1.10)
    extra = f" {ci(rt)} |" if pool else ""
    print(f"| {label} | {ref_label} | {cell(t)} | {cell(rt)} | {iqr} |{extra} {within}/{len(rt)} | {cell(p99)} | {cell(r99)} |")
PY
}

# The targets' range in pairs: one size per process, the two tools back to back.
paired_section() {
    command -v ib_write_bw >/dev/null || { echo "bench-vs-perftest: perftest is not installed" >&2; return 1; }
    local r t s n k
    run_pf() {
        next_port
        pair "$out/raw/pair_perftest_${t}_${s}_$r.txt" \
            "ib_${t}_bw -d $dev -s $s -n $n -F -p $port" \
            "ib_${t}_bw -d $dev -s $s -n $n -F -p $port 127.0.0.1"
    }
    run_pw() {
        next_port
        pair "$out/raw/pair_pagewire_${t}_${s}_$r.txt" \
            "$pw bench $t --server -d $dev --transport verbs -s $s -n $n -p $port" \
            "$pw bench $t 127.0.0.1 -d $dev --transport verbs -s $s -n $n -p $port"
    }
    # pagewire's latency pair: the raw file's tag, then the flags both ends get.
    pw_lat() {
        local tag=$1 flags="${*:2}"
        pair "$out/raw/pair_${tag}_lat_$r.txt" \
            "$pw bench lat --server -d $dev --transport verbs -n $lat_iters -p $port${flags:+ $flags}" \
            "$pw bench lat 127.0.0.1 -d $dev --transport verbs -n $lat_iters -p $port${flags:+ $flags}"
    }
    lat_one() {
        next_port
        case "$1" in
        perftest) pair "$out/raw/pair_perftest_lat_$r.txt" \
            "ib_write_lat -d $dev -n $lat_iters -F -p $port" \
            "ib_write_lat -d $dev -n $lat_iters -F -p $port 127.0.0.1" ;;
        send) pair "$out/raw/pair_perftestsend_lat_$r.txt" \
            "ib_send_lat -d $dev -n $lat_iters -F -p $port" \
            "ib_send_lat -d $dev -n $lat_iters -F -p $port 127.0.0.1" ;;
        poll) pw_lat pagewirepoll --poll-memory ;;
        notify) pw_lat pagewire ;;
        pollauto) pw_lat pagewirepollauto --poll-memory --progress auto ;;
        notifyauto) pw_lat pagewireauto --progress auto ;;
        esac
    }
    for ((r = 1; r <= pair_rounds; r++)); do
        echo "paired round $r/$pair_rounds" >&2
        for t in write read; do
            for s in $pair_small; do
                n=$pair_small_iters
                if ((r % 2)); then run_pf; run_pw; else run_pw; run_pf; fi
            done
            for s in $pair_sizes; do
                n=$((pair_mib * 1048576 / s))
                ((n < 16)) && n=16
                if ((r % 2)); then run_pf; run_pw; else run_pw; run_pf; fi
            done
        done
        local order=(perftest poll pollauto send notify notifyauto)
        for ((k = 0; k < 6; k++)); do lat_one "${order[$(((k + r) % 6))]}"; done
    done
    {
        echo "## RDMA in pairs: $dev, perftest vs pagewire, one size per process, back to back"
        paired_tables 0 "$out/raw"
    } >"$out/paired.md"
    cat "$out/paired.md"
}

tcp_section() {
    command -v iperf3 >/dev/null || { echo "bench-vs-perftest: iperf3 is not installed" >&2; return 1; }
    local r s
    for ((r = 1; r <= runs; r++)); do
        echo "tcp run $r/$runs" >&2
        for s in $streams; do
            next_port
            pair "$out/raw/iperf3_P${s}_$r.json" \
                "iperf3 -s -1 -p $port" \
                "iperf3 -c 127.0.0.1 -p $port -P $s -t $tcp_secs -J"
            next_port
            pair "$out/raw/pagewire_tcp_q${s}_$r.json" \
                "$pw bench write --server --transport tcp -q $s -s $tcp_size -D $tcp_secs -p $port --json" \
                "$pw bench write 127.0.0.1 --transport tcp -q $s -s $tcp_size -D $tcp_secs -p $port --json"
        done
    done
    {
        echo "## TCP on loopback: pagewire --transport tcp vs iperf3 (same stream count)"
        python3 - "$out/raw" "$runs" "$streams" "$tcp_size" "$tcp_secs" <<'PY'
import json, statistics, sys, os
raw, runs, streams, size, secs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4], sys.argv[5]
def iperf(p):
    try:
        j = json.load(open(p))
        return j["end"]["sum_received"]["bits_per_second"] / 1e9
    except Exception:
        return None
def pw(p):
    try:
        lines = [l for l in open(p).read().splitlines() if l.startswith("{")]
        return json.loads(lines[-1])["bw_avg_gbit_s"]
    except Exception:
        return None
def mmm(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), statistics.median(xs), max(xs)) if xs else None
def fmt(t):
    return "n/a" if t is None else f"{t[1]:.2f} [{t[0]:.2f}, {t[2]:.2f}]"
print(f"\n{runs} runs of {secs} s each; Gb/s = 10^9 bit/s; median [min, max]. pagewire: `bench write --transport tcp -s {size} -D {secs} -q N` (time-window average); iperf3: `-P N -t {secs}`, receiver sum.\n")
print("| streams | iperf3 Gb/s | pagewire Gb/s | ratio pagewire/iperf3 |")
print("|---:|---:|---:|---:|")
for s in streams:
    a = [iperf(os.path.join(raw, f"iperf3_P{s}_{r}.json")) for r in range(1, runs + 1)]
    b = [pw(os.path.join(raw, f"pagewire_tcp_q{s}_{r}.json")) for r in range(1, runs + 1)]
    rr = [y / x if x and y is not None else None for x, y in zip(a, b)]
    print(f"| {s} | {fmt(mmm(a))} | {fmt(mmm(b))} | {fmt(mmm(rr))} |")
PY
    } >"$out/tcp.md"
    cat "$out/tcp.md"
}

pages_section() {
    local transport=tcp dflag=() p=${pages_n:-32} n=${page_iters:-20} r
    if ((have_rdma)); then transport=verbs; dflag=(-d "$dev"); p=${pages_n:-8}; n=${page_iters:-5}; fi
    # Llama-3-8B, 16-token pages, page_first: each page is one 1 MiB K run and one 1 MiB V
    # run, so every work request carries 1 MiB; bench write -s 1M moves the same bytes.
    local wr_total=$((p * 2 * n))
    for ((r = 1; r <= runs; r++)); do
        echo "pages run $r/$runs ($transport)" >&2
        next_port
        pair "$out/raw/pages_$r.json" \
            "$pw bench pages --server ${dflag[*]} --transport $transport --model llama3-8b --pattern random --page-size 16 --pages $p --pool-pages $((4 * p)) -n $n -p $port --json" \
            "$pw bench pages 127.0.0.1 ${dflag[*]} --transport $transport --model llama3-8b --pattern random --page-size 16 --pages $p --pool-pages $((4 * p)) -n $n -p $port --json"
        next_port
        pair "$out/raw/pages_write_$r.json" \
            "$pw bench write --server ${dflag[*]} --transport $transport -s 1M -n $wr_total -p $port --json" \
            "$pw bench write 127.0.0.1 ${dflag[*]} --transport $transport -s 1M -n $wr_total -p $port --json"
    done
    {
        echo "## bench pages vs bench write at the same bytes per work request ($transport)"
        python3 - "$out/raw" "$runs" "$transport" "$p" "$n" "$wr_total" <<'PY'
import json, statistics, sys, os
raw, runs, transport, p, n, wrs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
def last_json(path):
    try:
        return json.loads([l for l in open(path).read().splitlines() if l.startswith("{")][-1])
    except Exception:
        return None
def mmm(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), statistics.median(xs), max(xs)) if xs else None
def fmt(t, d=2):
    return "n/a" if t is None else f"{t[1]:.{d}f} [{t[0]:.{d}f}, {t[2]:.{d}f}]"
pages = [last_json(os.path.join(raw, f"pages_{r}.json")) for r in range(1, runs + 1)]
writes = [last_json(os.path.join(raw, f"pages_write_{r}.json")) for r in range(1, runs + 1)]
a = [x["mib_per_s"] if x else None for x in pages]
b = [x["bw_avg_mib_s"] if x else None for x in writes]
rr = [x / y if x is not None and y else None for x, y in zip(a, b)]
one = next((x for x in pages if x), None)
print()
if one:
    avg = one["bytes"] // max(one["work_requests"], 1)
    print(f"`bench pages --model llama3-8b --pattern random --page-size 16 --pages {p} -n {n}` "
          f"({one['bytes']} B per batch in {one['work_requests']} work requests of {avg} B on average, "
          f"{one['segments_raw']} segments before and {one['segments_plan']} after coalescing) against "
          f"`bench write -s 1M -n {wrs}`; {runs} runs, median [min, max].\n")
print("| | MiB/s | pages/s | batch p50 / p99 [ms] |")
print("|---|---:|---:|---:|")
pp = [x["pages_per_s"] if x else None for x in pages]
p50 = [x["batch_p50_us"] / 1e3 if x else None for x in pages]
p99 = [x["batch_p99_us"] / 1e3 if x else None for x in pages]
print(f"| bench pages | {fmt(mmm(a))} | {fmt(mmm(pp), 1)} | {fmt(mmm(p50), 1)} / {fmt(mmm(p99), 1)} |")
print(f"| bench write -s 1M | {fmt(mmm(b))} | | |")
print(f"| ratio pages/write | {fmt(mmm(rr))} | | |")
PY
    } >"$out/pages.md"
    cat "$out/pages.md"
}

# Two rails against one: the same pair of engines' first rails alone, then both rails
# (rail i to the peer's rail i, each over its own veth pair), back to back per size, the
# order alternating between rounds; the ratio is per pair.
rails_section() {
    local two="${RDMA_RAILS:-}" peer="${RDMA_PEER_RAILS:-}" r s n
    [[ "$two" == *,* && "$peer" == *,* ]] || {
        echo "bench-vs-perftest: the rails section needs RDMA_RAILS and RDMA_PEER_RAILS (scripts/rdma-vm.sh --two-rails)" >&2
        return 1
    }
    run_rails() {
        local tag=$1 mine=$2 theirs=$3
        next_port
        pair "$out/raw/rails_${tag}_${s}_$r.txt" \
            "$pw bench write --server -d $theirs --transport verbs -s $s -n $n -p $port" \
            "$pw bench write 127.0.0.1 -d $mine --transport verbs -s $s -n $n -p $port"
    }
    one() { run_rails one "${two%%,*}" "${peer%%,*}"; }
    both() { run_rails two "$two" "$peer"; }
    for ((r = 1; r <= rails_rounds; r++)); do
        echo "rails round $r/$rails_rounds" >&2
        for s in 1048576 8388608; do
            n=$((rails_mib * 1048576 / s))
            ((n < 16)) && n=16
            if ((r % 2)); then one; both; else both; one; fi
        done
    done
    {
        echo "## Two rails ($two to $peer) against one (${two%%,*} to ${peer%%,*}), bench write, $rails_rounds paired rounds"
        python3 - "$out/raw" "$rails_rounds" <<'PY'
import re, statistics, sys
raw, rounds = sys.argv[1], int(sys.argv[2])
row = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)")
def avg(tag, s, r):
    try:
        lines = open(f"{raw}/rails_{tag}_{s}_{r}.txt").read().splitlines()
    except OSError:
        return None
    for l in lines:
        m = row.match(l)
        if m:
            return float(m.group(4))
    return None
def cell(xs, d=1):
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.{d}f} [{min(xs):.{d}f}, {max(xs):.{d}f}]" if xs else "n/a"
print()
print("| size | one rail MiB/s | two rails MiB/s | ratio two/one |")
print("|---|---|---|---|")
for s in (1048576, 8388608):
    one = [avg("one", s, r) for r in range(1, rounds + 1)]
    two = [avg("two", s, r) for r in range(1, rounds + 1)]
    ratio = [b / a for a, b in zip(one, two) if a and b]
    print(f"| {s >> 20} MiB | {cell(one)} | {cell(two)} | {cell(ratio, 2)} |")
print()
print("median [min, max] over the rounds of bench's BW average")
PY
    } >"$out/rails.md"
    cat "$out/rails.md"
}

# pagewire vs Mooncake: its own script (it installs the wheel into a virtualenv).
mooncake_section() {
    bash scripts/bench-vs-mooncake.sh --rounds "$mc_rounds" --device "$dev" --pagewire "$pw" \
        --out "$out/mooncake" >/dev/null || return 1
    cp "$out/mooncake/mooncake.md" "$out/mooncake.md"
    cat "$out/mooncake.md"
}

# Python bindings and store client against Mooncake's wheel and NIXL's (host only: TCP on
# 127.0.0.1). Each benchmark prints its own tables.
python_section() {
    bash scripts/python-test.sh --install-only >"$out/raw/python-install.log" 2>&1 ||
        { echo "bench-vs-perftest: scripts/python-test.sh --install-only failed: $out/raw/python-install.log" >&2; return 1; }
    local nixl
    nixl="$(bash scripts/nixl-venv.sh)" || return 1
    {
        echo "## Python: one synchronous call, pagewire against Mooncake and NIXL (TCP on 127.0.0.1)"
        echo
        .venv/bin/python benches/python/bench_mooncake_compat.py --rounds "$py_rounds" --nixl "$nixl" \
            --json "$out/raw/python-calls.json" || return 1
        echo
        echo "## Store client setup with a 3200 MiB segment, pagewire against Mooncake"
        echo
        .venv/bin/python benches/python/setup_vs_mooncake.py --rounds "$setup_rounds" --pagewire "$pw" \
            --json "$out/raw/python-setup.json" || return 1
    } >"$out/python.md"
    cat "$out/python.md"
}

# Masters on etcd against Mooncake's HA mode (host only: etcd and TCP on 127.0.0.1). The
# benchmark kills every process it started when it ends; it gets SIGTERM if this shell
# dies first (setpriv --pdeathsig) or is interrupted.
ha_section() {
    command -v etcd >/dev/null || [[ -n "${PAGEWIRE_ETCD:-}" ]] ||
        { echo "bench-vs-perftest: the ha section needs etcd (Debian's etcd-server, or PAGEWIRE_ETCD)" >&2; return 1; }
    bash scripts/python-test.sh --install-only >"$out/raw/python-install.log" 2>&1 ||
        { echo "bench-vs-perftest: scripts/python-test.sh --install-only failed: $out/raw/python-install.log" >&2; return 1; }
    echo "## Masters on etcd: failover against Mooncake's HA mode, and the op-log's cost" >"$out/ha.md"
    echo >>"$out/ha.md"
    setpriv --pdeathsig TERM .venv/bin/python benches/python/ha_vs_mooncake.py --rounds "$ha_rounds" \
        --oplog-rounds "$oplog_rounds" --oplog-shards 2 --pagewire "$pw" --logs "$out/raw/ha-logs" \
        --json "$out/raw/ha.json" >>"$out/ha.md" &
    local py=$! rc
    trap 'kill -TERM $py 2>/dev/null' INT TERM
    wait "$py"
    rc=$?
    trap - INT TERM
    cat "$out/ha.md"
    return $rc
}

# --report: the host's sections here, the RDMA ones in the VM, one report of all tables.
if ((report)); then
    here_args=(--runs "$runs" --tcp-secs "$tcp_secs" --tcp-size "$tcp_size" --streams "$streams")
    [[ -n "$pages_n" ]] && here_args+=(--pages "$pages_n")
    [[ -n "$page_iters" ]] && here_args+=(--page-iters "$page_iters")
    abs_out="$(cd "$out" && pwd)"
    t0=$SECONDS
    here_args+=(--mc-rounds "$mc_rounds")
    echo "report: TCP sections on this host (the Mooncake one installs its wheel once)" >&2
    bash "$0" --section "tcp pages mooncake python ha" --out "$abs_out/host" --pagewire "$pw" "${here_args[@]}" \
        --py-rounds "$py_rounds" --setup-rounds "$setup_rounds" --ha-rounds "$ha_rounds" \
        --oplog-rounds "$oplog_rounds" >/dev/null
    rc_host=$?
    echo "report: paired, pages and mooncake sections in the soft-RoCE VM ($pair_rounds + $mc_rounds rounds)" >&2
    vm_timeout=$((600 + pair_rounds * 240 + mc_rounds * 360))
    # 2 GiB: room for Mooncake's target and initiator, which each register batch x 8 MiB.
    scripts/rdma-vm.sh --quiet --cpus 2 --mem 2048 --timeout "$vm_timeout" --out "$abs_out" run -- \
        scripts/bench-vs-perftest.sh --section "paired pages mooncake" --out "$abs_out/vm" --pagewire "$pw" \
        --pair-rounds "$pair_rounds" --pair-mib "$pair_mib" --pair-small-iters "$pair_small_iters" \
        --lat-iters "$lat_iters" --device "$dev" "${here_args[@]}" >"$abs_out/vm.log" 2>&1
    rc_vm=$?
    {
        echo "# pagewire benchmark report"
        echo
        echo "\`scripts/bench-vs-perftest.sh --report --pair-rounds $pair_rounds --mc-rounds $mc_rounds --py-rounds $py_rounds --setup-rounds $setup_rounds --ha-rounds $ha_rounds --oplog-rounds $oplog_rounds --runs $runs\`, $((SECONDS - t0)) s in all."
        echo
        echo "Host:"
        echo
        sed '1,2d' "$abs_out/host/machine.md"
        echo "Soft-RoCE guest (\`scripts/rdma-vm.sh --cpus 2\`):"
        echo
        sed '1,2d' "$abs_out/vm/machine.md" 2>/dev/null || echo "- (no output: see vm.log)"
        for f in vm/paired.md vm/pages.md vm/mooncake.md host/tcp.md host/pages.md host/mooncake.md host/python.md host/ha.md; do
            [[ -f "$abs_out/$f" ]] && { echo; cat "$abs_out/$f"; }
        done
    } >"$abs_out/report.md"
    cat "$abs_out/report.md"
    echo "report: $abs_out/report.md (host exit $rc_host, VM exit $rc_vm)" >&2
    exit $((rc_host || rc_vm))
fi

if ((pool_only)); then
    raws=()
    for d in "${pool_dirs[@]}"; do
        [[ -d "$d/raw" ]] && d="$d/raw"
        ls "$d"/pair_perftest_*_1.txt >/dev/null 2>&1 || { echo "bench-vs-perftest: no paired outputs in $d" >&2; exit 1; }
        raws+=("$d")
    done
    echo "## RDMA in pairs, pooled: perftest vs pagewire, one size per process, back to back"
    paired_tables 1 "${raws[@]}"
    exit $?
fi
machine | tee "$out/machine.md"
rc=0
for s in $section; do
    case "$s" in
        rdma) rdma_section || rc=1 ;;
        paired) paired_section || rc=1 ;;
        tcp) tcp_section || rc=1 ;;
        pages) pages_section || rc=1 ;;
        mooncake) mooncake_section || rc=1 ;;
        python) python_section || rc=1 ;;
        ha) ha_section || rc=1 ;;
        rails) rails_section || rc=1 ;;
        *) echo "bench-vs-perftest: unknown section $s (rdma, paired, tcp, pages, mooncake, python, ha, rails, all)" >&2; exit 2 ;;
    esac
done
echo "raw outputs: $out/raw" >&2
exit $rc
