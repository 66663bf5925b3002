#!/usr/bin/env bash
# pagewire against Mooncake's transfer engine, side by side in one run: Mooncake's own
# `transfer_engine_bench` (from the mooncake-transfer-engine-non-cuda wheel, installed into
# a virtualenv by this script) and `pagewire bench write|read`, same block size, same
# batch, same seconds, in alternating rounds. Over TCP on 127.0.0.1 on a host without an
# RDMA device; over RDMA on the device when one is visible (the soft-RoCE VM):
#
#   scripts/bench-vs-mooncake.sh                                    # host: TCP
#   scripts/rdma-vm.sh --cpus 2 --mem 2048 run -- scripts/bench-vs-mooncake.sh   # VM: rxe0
#   scripts/bench-vs-perftest.sh --report                           # both, in the report
#
# The guest runs the host's files read-only, so the virtualenv must exist before a VM run:
# any host run creates it (or --install-only).
#
# Mapping of the two benches' knobs (see "Mooncake" in docs/benchmarks.md):
#   Mooncake --block_size S --batch_size B --threads T --duration D
#   pagewire -s S -Q B -t T*B -q T -D D -f 0
# Each Mooncake thread submits a batch of B requests, waits for all of them, frees it and
# starts the next, so T batches are in flight; pagewire's bench is one thread that keeps
# T*B operations in flight in batches of B over T streams (TCP) or queue pairs (verbs).
# With T = 1 (the default) both have exactly one batch of B in flight at a time.
#
# Options:
#   --rounds N        rounds (default 5); each runs, for WRITE and READ and every size,
#                     the two benches back to back, the order alternating between rounds
#   --sizes "S..."    block sizes in bytes (default "65536 1048576 8388608")
#   --batch B         requests per batch on both sides (default 16 on TCP, 4 on RDMA: on
#                     rxe under TCG a batch of 16 x 8 MiB takes Mooncake about 10 s)
#   --threads T       Mooncake's submitting threads = pagewire's -q (default 1; on 2
#                     cores more threads cost Mooncake: its threads spin on the status)
#   --secs D          seconds per run (default 5 on TCP, 8 on RDMA)
#   --transport T     tcp | rdma (default: rdma if --device is visible, else tcp)
#   --device DEV      RDMA device (default: $RDMA_DEVICE, else rxe0)
#   --out DIR         raw outputs and mooncake.md (default target/bench-vs-mooncake/<time>-<pid>,
#                     or under $SOFTROCE_OUT inside the VM)
#   --pagewire PATH   the binary (default target/release/pagewire)
#   --venv DIR        the virtualenv holding the wheel (default target/bench-venv)
#   --install-only    create or check the virtualenv, then exit
# Environment: MC_GID_INDEX (default 0 on RDMA), passed to Mooncake.
set -uo pipefail
cd "$(dirname "$0")/.."

MOONCAKE_WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
rounds=5 sizes="65536 1048576 8388608" batch="" threads=1 secs="" transport="" dev="${RDMA_DEVICE:-rxe0}"
out="" pw="target/release/pagewire" venv="target/bench-venv" install_only=0
while (($#)); do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --sizes) sizes="$2"; shift 2 ;;
        --batch) batch="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --secs) secs="$2"; shift 2 ;;
        --transport) transport="$2"; shift 2 ;;
        --device) dev="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --pagewire) pw="$2"; shift 2 ;;
        --venv) venv="$2"; shift 2 ;;
        --install-only) install_only=1; shift ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench-vs-mooncake: unknown option $1" >&2; exit 2 ;;
    esac
done

die() { echo "bench-vs-mooncake: $*" >&2; exit 1; }

# --- the wheel, in its own virtualenv (idempotent) --------------------------------------
# Its own venv, not .venv: .venv also holds the pagewire wheel and its import hook, and
# this bench only needs Mooncake's binary. A stamp with the pinned requirement makes a
# rerun (and the read-only guest) skip pip entirely.
tebench=""
ensure_mooncake() {
    local stamp="$venv/.mooncake-installed"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$MOONCAKE_WHEEL" ]]; then
        # The soft-RoCE guest runs the host's files (writes vanish) and has no network.
        [[ -z "${SOFTROCE_OUT:-}" ]] ||
            die "$venv has no $MOONCAKE_WHEEL; run this script (or --install-only) once on the host first"
        if [[ ! -x "$venv/bin/python" ]]; then
            echo "bench-vs-mooncake: creating $venv" >&2
            mkdir -p "$(dirname "$venv")"
            python3 -m venv "$venv" || die "python3 -m venv failed"
        fi
        echo "bench-vs-mooncake: installing $MOONCAKE_WHEEL into $venv" >&2
        "$venv/bin/pip" install -q --disable-pip-version-check "$MOONCAKE_WHEEL" ||
            die "pip install $MOONCAKE_WHEEL failed"
        echo "$MOONCAKE_WHEEL" >"$stamp"
    fi
    tebench="$(echo "$venv"/lib/python3*/site-packages/mooncake/transfer_engine_bench)"
    [[ -f "$tebench" ]] || die "the wheel has no mooncake/transfer_engine_bench under $venv"
    [[ -x "$tebench" ]] || chmod +x "$tebench" || die "cannot make $tebench executable"
    # The binary links libibverbs.so.1 (and libnuma) even for TCP.
    if ldd "$tebench" | grep -q "not found"; then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null && [[ -w /var/lib/dpkg ]]; then
            echo "bench-vs-mooncake: installing libibverbs1 libnuma1 (needed by $tebench)" >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                libibverbs1 libnuma1 >/dev/null 2>&1 ||
                { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                    --no-install-recommends libibverbs1 libnuma1 >/dev/null; }
        fi
        if ldd "$tebench" | grep -q "not found"; then
            ldd "$tebench" | grep "not found" >&2
            die "libraries missing for $tebench"
        fi
    fi
}
ensure_mooncake
((install_only)) && { echo "$tebench"; exit 0; }

[[ -x "$pw" ]] || die "$pw not found; build it: cargo build --release -p pagewire-cli"
if [[ -z "$transport" ]]; then
    if [[ -e "/sys/class/infiniband/$dev" ]]; then transport=rdma; else transport=tcp; fi
fi
case "$transport" in
    tcp) pw_transport=(--transport tcp); mc_extra=(--protocol=tcp); secs=${secs:-5} batch=${batch:-16} ;;
    rdma)
        [[ -e "/sys/class/infiniband/$dev" ]] || die "no RDMA device $dev"
        pw_transport=(--transport verbs -d "$dev"); mc_extra=(--protocol=rdma "--device_name=$dev")
        export MC_GID_INDEX="${MC_GID_INDEX:-0}"; secs=${secs:-8} batch=${batch:-4} ;;
    *) die "--transport is tcp or rdma" ;;
esac
if [[ -z "$out" ]]; then
    stamp="$(date -u +%Y%m%d-%H%M%S)-$$"
    if [[ -n "${SOFTROCE_OUT:-}" ]]; then out="$SOFTROCE_OUT/bench-vs-mooncake/$stamp"; else out="target/bench-vs-mooncake/$stamp"; fi
fi
mkdir -p "$out/raw" || die "cannot create $out"

# Waits until $1 (a command) prints something, at most $2 tenths of a second.
wait_until() {
    local t=0
    until eval "$1" || ((t >= $2)); do sleep 0.1; t=$((t + 1)); done
    eval "$1"
}
listening() { grep -q ":$(printf '%04X' "$1") 00000000" /proc/net/tcp /proc/net/tcp6 2>/dev/null; }
# Generous: startup under TCG takes seconds, and a batch on rxe can take several more.
limit=$((secs * 3 + 120))

# One Mooncake run: a target that registers T*B*S bytes (it sizes its buffer from the same
# flags as the initiator), an initiator that runs D seconds.
port=19600
run_mooncake() {
    local op=$1 s=$2 f=$3 buf=$((threads * batch * s))
    local common=(--metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1:0 "${mc_extra[@]}"
                  --buffer_size="$buf" --block_size="$s" --batch_size="$batch" --threads="$threads")
    "$tebench" --mode=target "${common[@]}" >"$f.target" 2>&1 &
    local tpid=$!
    # P2P mode binds a free handshake port (15000-17000) and logs it.
    local seg=""
    wait_until "grep -q 'listening on 127.0.0.1:[0-9]' '$f.target' 2>/dev/null" 1200
    seg="$(grep -o 'listening on 127.0.0.1:[0-9]*' "$f.target" | head -1 | sed 's/listening on //')"
    # The port is logged before the buffer is allocated and registered (which pins it on
    # rxe: seconds under TCG). Registered means the main thread has reached its idle loop,
    # sleep(1): clock_nanosleep (230) after the allocation's log line.
    wait_until "grep -q 'numa node num' '$f.target' 2>/dev/null && [[ \$(cut -d' ' -f1 /proc/$tpid/syscall 2>/dev/null) == 230 ]]" 1200
    local rc=1
    if [[ -n "$seg" ]]; then
        timeout "$limit" "$tebench" --mode=initiator "${common[@]}" --segment_id="$seg" \
            --operation="$op" --duration="$secs" --report_unit=MiB --report_precision=3 >"$f" 2>&1
        rc=$?
    fi
    kill "$tpid" 2>/dev/null
    wait "$tpid" 2>/dev/null
    if ((rc != 0)) || ! grep -q "Test completed" "$f"; then
        echo "  FAILED: Mooncake $op $s (rc $rc); last lines of $f and $f.target:" >&2
        tail -n 6 "$f" "$f.target" 2>/dev/null | sed 's/^/    /' >&2
        return 1
    fi
}

run_pagewire() {
    local op=$1 s=$2 f=$3
    port=$((port + 1))
    local flags=("${pw_transport[@]}" -s "$s" -Q "$batch" -t $((threads * batch)) -q "$threads"
                 -D "$secs" -f 0 -p "$port" --json)
    timeout "$limit" "$pw" bench "$op" --server "${flags[@]}" >"$f.server" 2>&1 &
    local spid=$!
    wait_until "listening $port" 600
    timeout "$limit" "$pw" bench "$op" 127.0.0.1 "${flags[@]}" >"$f" 2>"$f.err"
    local rc=$?
    wait "$spid" 2>/dev/null
    if ((rc != 0)); then
        echo "  FAILED: pagewire $op $s (rc $rc)" >&2
        tail -n 6 "$f.err" "$f.server" | sed 's/^/    /' >&2
        return 1
    fi
}

{
    echo "## Machine"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- kernel: $(uname -r)"
    echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') ($(nproc) online)"
    echo "- pagewire: $("$pw" --version 2>/dev/null), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "- Mooncake: $MOONCAKE_WHEEL, \`$(basename "$tebench")\`"
    echo
} >"$out/machine.md"
cat "$out/machine.md"

rc=0
: >"$out/raw/load.txt"
for ((r = 1; r <= rounds; r++)); do
    echo "mooncake round $r/$rounds ($transport)" >&2
    echo "$r start $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/raw/load.txt"
    for op in write read; do
        for s in $sizes; do
            mc="$out/raw/mooncake_${op}_${s}_$r.txt" pwf="$out/raw/pagewire_${op}_${s}_$r.json"
            if ((r % 2)); then
                run_mooncake "$op" "$s" "$mc" || rc=1
                run_pagewire "$op" "$s" "$pwf" || rc=1
            else
                run_pagewire "$op" "$s" "$pwf" || rc=1
                run_mooncake "$op" "$s" "$mc" || rc=1
            fi
        done
    done
    echo "$r end $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/raw/load.txt"
done

{
    if [[ $transport == tcp ]]; then
        echo "## pagewire vs Mooncake transfer_engine_bench: TCP on 127.0.0.1"
    else
        echo "## pagewire vs Mooncake transfer_engine_bench: RDMA on $dev"
    fi
    python3 - "$out/raw" "$rounds" "$sizes" "$batch" "$threads" "$secs" "$transport" <<'PY'
import json, os, re, statistics, sys
raw, rounds, sizes = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split()]
batch, threads, secs, transport = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
done = re.compile(r"Test completed: duration ([\d.]+), batch count (\d+), throughput ([\d.]+) MiB/s")

def mooncake(p):
    try:
        m = done.search(open(p).read())
    except OSError:
        return None
    return float(m.group(3)) if m else None

def pagewire(p):
    try:
        lines = [l for l in open(p).read().splitlines() if l.startswith("{")]
        v = json.loads(lines[-1])["bw_avg_mib_s"]
        return v if v > 0 else None
    except Exception:
        return None

def cell(xs, d=1):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.{d}f} [{min(xs):.{d}f}, {max(xs):.{d}f}]"

loads = [l.split()[2] for l in open(os.path.join(raw, "load.txt")) if l.strip()]
mc_flags = f"--protocol={transport} --block_size=S --batch_size={batch} --threads={threads} --duration={secs}"
pw_flags = f"-s S -Q {batch} -t {threads * batch} -q {threads} -D {secs} -f 0"
print(f"\n{rounds} rounds, the order alternating; Mooncake `transfer_engine_bench {mc_flags}` "
      f"(P2PHANDSHAKE), pagewire `bench write|read {pw_flags}`; MiB/s = 2^20 B/s; median [min, max]; "
      f"ratio = pagewire / Mooncake per round. 1-minute load average over the rounds: "
      f"{min(loads)}-{max(loads)} ({os.cpu_count()} CPUs).\n")
print("| op | bytes | Mooncake MiB/s | pagewire MiB/s | ratio | rounds >= 1.00 | Mooncake spread |")
print("|---|---:|---:|---:|---:|---:|---:|")
for op in ("write", "read"):
    for s in sizes:
        a = [mooncake(os.path.join(raw, f"mooncake_{op}_{s}_{r}.txt")) for r in range(1, rounds + 1)]
        b = [pagewire(os.path.join(raw, f"pagewire_{op}_{s}_{r}.json")) for r in range(1, rounds + 1)]
        rr = [y / x for x, y in zip(a, b) if x and y]
        aa = [x for x in a if x]
        spread = f"{max(aa) / min(aa):.2f}" if aa else "n/a"
        ok = sum(1 for x in rr if x >= 1.0)
        print(f"| {op.upper()} | {s} | {cell(a)} | {cell(b)} | {cell(rr, 2)} | {ok}/{len(rr)} | {spread} |")
PY
} >"$out/mooncake.md"
cat "$out/mooncake.md"
echo "raw outputs: $out/raw" >&2
exit $rc
