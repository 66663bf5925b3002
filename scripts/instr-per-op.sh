#!/usr/bin/env bash
# User-space instructions per operation, counted by callgrind, for perftest and pagewire on
# the same RDMA device. Run it inside the soft-RoCE VM:
#
#   scripts/rdma-vm.sh --quiet --cpus 2 --timeout 900 run -- scripts/instr-per-op.sh
#
# Rows (client side; the server runs natively):
#   round trip of a 2 B ping-pong: ib_write_lat, pagewire bench lat (a prepared batch
#     started per ping), with --poll-memory, and both with --submit-each (a batch per ping)
#   one 8 B RDMA WRITE:             ib_write_bw, pagewire bench write
# Each figure is (instructions at the larger -n - instructions at the smaller -n) divided by
# the difference in -n, so start-up and connection setup cancel out. Counts are exact for
# the code that runs, but what runs depends on timing: spinning while the peer works adds
# a run-dependent part to the round-trip totals (docs/benchmarks.md, "Instructions per
# operation"). Needs valgrind in the guest (the VM uses the host's files).
#
# Options: --bin PATH (pagewire binary; default target/release/pagewire), --dev NAME
# (default rxe0), --out DIR (default $SOFTROCE_OUT/instr-per-op or target/instr-per-op).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=target/release/pagewire
DEV=rxe0
OUT="${SOFTROCE_OUT:-target}/instr-per-op"
while (($#)); do
    case "$1" in
        --bin) BIN="$2"; shift 2 ;;
        --dev) DEV="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "instr-per-op: unknown argument $1" >&2; exit 2 ;;
    esac
done
for tool in valgrind callgrind_annotate ib_write_lat ib_write_bw; do
    command -v "$tool" >/dev/null || { echo "FAIL: $tool not found (apt-get install valgrind perftest)" >&2; exit 1; }
done
[[ -x "$BIN" ]] || { echo "FAIL: $BIN missing (cargo build --release -p pagewire-cli)" >&2; exit 1; }
[[ -e "/sys/class/infiniband/$DEV" ]] || { echo "FAIL: RDMA device $DEV not found (run inside the soft-RoCE VM)" >&2; exit 1; }
mkdir -p "$OUT"
PORT=21500

wait_port() {
    local t=0
    until grep -q ":$(printf '%04X' "$1") 00000000" /proc/net/tcp /proc/net/tcp6 2>/dev/null || ((t >= 100)); do
        sleep 0.1; t=$((t + 1))
    done
}

# Runs one server natively and its client under callgrind; prints the client's instruction count.
count() { # name n server-command client-command (both without -p)
    local name="$1" n="$2" server="$3" client="$4"
    PORT=$((PORT + 1))
    $server -p "$PORT" >"$OUT/$name-$n.server" 2>&1 &
    local spid=$!
    wait_port "$PORT"
    timeout 400 valgrind --tool=callgrind --callgrind-out-file="$OUT/$name-$n.cg" \
        $client -p "$PORT" >"$OUT/$name-$n.client" 2>"$OUT/$name-$n.valgrind"
    local rc=$?
    wait "$spid"
    if ((rc != 0)); then
        echo "FAIL: $name -n $n exited $rc (see $OUT/$name-$n.client)" >&2
        return 1
    fi
    grep -o 'refs: *[0-9,]*' "$OUT/$name-$n.valgrind" | tr -dc '0-9'
}

# Inclusive instructions of function FN (callgrind's "file:FN [binary]" entry) in a profile.
inclusive() { # profile fn
    callgrind_annotate --inclusive=yes --threshold=100 "$1" 2>/dev/null |
        awk -v fn=":$2 [" 'index($0, fn) && $0 !~ /=>/ { gsub(",", "", $1); if ($1 > m) m = $1 } END { print m + 0 }'
}

# Prints one table row: instructions per operation between -n N1 and -n N2, in all and
# inside each of the functions named after the templates (deterministic, unlike the total).
row() { # label name N1 N2 server-template client-template ('%n' stands for -n) [fn...]
    local label="$1" name="$2" n1="$3" n2="$4" s="$5" c="$6" a b cells="" fn
    shift 6
    a=$(count "$name" "$n1" "${s//%n/$n1}" "${c//%n/$n1}") || return 1
    b=$(count "$name" "$n2" "${s//%n/$n2}" "${c//%n/$n2}") || return 1
    for fn in "$@"; do
        local fa fb
        fa=$(inclusive "$OUT/$name-$n1.cg" "$fn")
        fb=$(inclusive "$OUT/$name-$n2.cg" "$fn")
        cells="$cells $fn $(((fb - fa) / (n2 - n1)));"
    done
    echo "| $label | $(((b - a) / (n2 - n1))) | ${cells:- } |"
}

echo "# User-space instructions per operation (callgrind, client side)"
echo
echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); device: $DEV; pagewire: $("$BIN" --version 2>/dev/null), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo
echo "Totals include spinning while the peer works and each tool's own statistics, so they"
echo "vary from run to run (ib_write_lat: 149 to 1115 in four runs); the per-function figures"
echo "vary much less (Engine::submit: within about 20%), since only some branches depend on timing."
echo
echo "| client | instructions per operation | of which, inside |"
echo "| --- | ---: | --- |"
# perftest's client and server for TOOL with FLAGS.
ib_row() { # label name N1 N2 tool flags
    row "$1" "$2" "$3" "$4" "$5 -d $DEV $6 -F" "$5 -d $DEV $6 -F 127.0.0.1"
}

# pagewire's `bench SUB` with FLAGS over verbs, then the functions to break out.
pw_row() { # label name N1 N2 sub flags fn...
    local label="$1" name="$2" n1="$3" n2="$4" sub="$5" flags="$6"
    shift 6
    row "$label" "$name" "$n1" "$n2" \
        "$BIN bench $sub --server -d $DEV --transport verbs $flags" \
        "$BIN bench $sub 127.0.0.1 -d $DEV --transport verbs $flags" "$@"
}

E=pagewire_transport::engine::Engine
P=pagewire_transport::prepared::PreparedBatch
W=pagewire_transport::batch::TransferHandle::wait
FAILED=0
LAT="-s 2 -n %n"
ib_row "ib_write_lat, 2 B round trip" ib_write_lat 400 1400 ib_write_lat "$LAT" || FAILED=1
# bench lat starts one prepared ping (as ib_write_lat re-posts one WR); --submit-each
# submits a new batch per ping, the general path.
pw_row "pagewire bench lat, 2 B round trip" pw_lat 400 1400 lat "$LAT" \
    "$P::start_tagged" "$P::wait" "$E::poll_notification" || FAILED=1
pw_row "pagewire bench lat --poll-memory, 2 B round trip" pw_lat_poll 400 1400 lat \
    "$LAT --poll-memory" "$P::start" "$P::wait" || FAILED=1
pw_row "pagewire bench lat --submit-each, 2 B round trip" pw_lat_each 400 1400 lat \
    "$LAT --submit-each" "$E::submit" "$E::poll_notification" || FAILED=1
pw_row "pagewire bench lat --submit-each --poll-memory, 2 B round trip" pw_lat_each_poll 400 1400 lat \
    "$LAT --submit-each --poll-memory" "$E::submit" "$W" || FAILED=1
BW="-s 8 -n %n"
ib_row "ib_write_bw, one 8 B WRITE" ib_write_bw 1000 5000 ib_write_bw "$BW" || FAILED=1
pw_row "pagewire bench write, one 8 B WRITE" pw_write 1000 5000 write "$BW" "$E::submit" || FAILED=1
echo
echo "raw outputs: $OUT"
exit "$FAILED"
