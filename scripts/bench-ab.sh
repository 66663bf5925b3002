#!/usr/bin/env bash
# Two pagewire binaries side by side in one run: a change's performance against the build
# before it. Paired rounds: for each point (WRITE and READ at 64 KiB, 1 MiB and 8 MiB,
# 2-byte latency) the old and the new binary run back to back, both ends in one process
# (`--local`), the order alternating between rounds, so a drift of the machine's speed hits
# both sides of a pair. Prints one markdown table: per point the median of each side and
# the ratio new/old of performance (bandwidth new/old, latency old/new: above 1 is faster),
# median [min, max] over the rounds.
#
#   scripts/bench-ab.sh [--rounds N] [--transport T] [--mib N] OLD NEW
#   scripts/rdma-vm.sh --cpus 2 --timeout 1800 run -- scripts/bench-ab.sh --transport verbs OLD NEW
#
#   --rounds N     paired rounds (default 5)
#   --transport T  auto | verbs | tcp | loopback (default auto: verbs when a device is usable)
#   --mib N        MiB moved per bandwidth measurement (default 32; at least 16 iterations)
#   --lat-iters N  ping-pong iterations of the latency point (default 1000)
#
# OLD and NEW are pagewire binaries, e.g. one built from the commit before a change
# (git worktree add /tmp/old REV && cargo build --release -p pagewire-cli there).
set -euo pipefail

rounds=5 transport=auto mib=32 lat_iters=1000
while [ $# -gt 2 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --transport) transport=$2; shift 2 ;;
        --mib) mib=$2; shift 2 ;;
        --lat-iters) lat_iters=$2; shift 2 ;;
        *) break ;;
    esac
done
case "${1:-}" in -h|--help|"") sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;; esac
[ $# -eq 2 ] || { echo "usage: bench-ab.sh [OPTIONS] OLD NEW" >&2; exit 2; }
old=$1 new=$2
for b in "$old" "$new"; do
    [ -x "$b" ] || { echo "bench-ab: $b is not an executable" >&2; exit 2; }
done

# Builds from before perftest's server semantics ran both ends in one process without an
# address and have no `--local`.
local_flag() {
    if "$1" bench write --help 2>/dev/null | grep -q -- '--local'; then echo --local; fi
}
old_local=$(local_flag "$old") new_local=$(local_flag "$new")

raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

# One measurement: prints the figure (MiB/s, or typical latency in us).
measure() {
    local bin=$1 kind=$2 size=$3 json loc=$old_local
    [ "$bin" = "$new" ] && loc=$new_local
    if [ "$kind" = lat ]; then
        json=$("$bin" bench lat $loc --transport "$transport" -s "$size" -n "$lat_iters" --json)
        python3 -c 'import json,sys; print(json.loads(sys.argv[1])["t_typical_us"])' "$json"
    else
        local iters=$(( mib * 1048576 / size ))
        [ "$iters" -ge 16 ] || iters=16
        json=$("$bin" bench "$kind" $loc --transport "$transport" -s "$size" -n "$iters" --json)
        python3 -c 'import json,sys; print(json.loads(sys.argv[1])["bw_avg_mib_s"])' "$json"
    fi
}

points=("write 65536" "write 1048576" "write 8388608" "read 65536" "read 1048576" "read 8388608" "lat 2")
for r in $(seq 1 "$rounds"); do
    for p in "${points[@]}"; do
        set -- $p
        order="old new"
        [ $(( r % 2 )) -eq 0 ] && order="new old"
        for side in $order; do
            bin=$old
            [ "$side" = new ] && bin=$new
            v=$(measure "$bin" "$1" "$2")
            echo "$1 $2 $r $side $v" >>"$raw"
        done
    done
    echo "bench-ab: round $r of $rounds done" >&2
done

python3 - "$raw" "$rounds" "$transport" <<'PY'
import collections, statistics, sys
raw, rounds, transport = sys.argv[1], sys.argv[2], sys.argv[3]
d = collections.defaultdict(lambda: collections.defaultdict(dict))
order = []
for line in open(raw):
    kind, size, r, side, v = line.split()
    key = (kind, int(size))
    if key not in order:
        order.append(key)
    d[key][r][side] = float(v)
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"
print(f"{rounds} paired rounds, transport {transport}; performance ratio new/old, median [min, max]")
print()
print("| point | old | new | ratio |")
print("| --- | ---: | ---: | ---: |")
for key in order:
    pairs = [p for p in d[key].values() if "old" in p and "new" in p]
    lat = key[0] == "lat"
    ratios = [(p["old"] / p["new"]) if lat else (p["new"] / p["old"]) for p in pairs]
    unit = "us" if lat else "MiB/s"
    o = statistics.median(p["old"] for p in pairs)
    n = statistics.median(p["new"] for p in pairs)
    print(f"| {key[0]} {size(key[1])} | {o:.1f} {unit} | {n:.1f} {unit} | "
          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |")
PY
