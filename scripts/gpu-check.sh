#!/usr/bin/env bash
# GPU check for pagewire-gpudirect: the CUDA tests (ignored on a host without a GPU; run
# here with --include-ignored, so a missing GPU fails them) and the staged-mode benchmark, whose bandwidths are
# printed next to a plain one-shot copy (what cudaMemcpy gets on this machine).
#
#   scripts/gpu-check.sh                  build with cargo and run (GPU machine with Rust)
#   scripts/gpu-check.sh --package DIR    build here, put the binaries in DIR (no GPU needed)
#   scripts/gpu-check.sh --prebuilt DIR   run binaries from DIR (GPU machine without Rust)
#
# Builds without the `verbs` feature on purpose: no cmake/libclang needed, and
# staging over loopback/TCP is what this checks. Budget: 5 minutes, build included.
# Env: PAGEWIRE_GPU (ordinal, default 0), GPU_CHECK_BYTES (default 1G),
#      CARGO_OFFLINE=1 (pass --offline to cargo when the machine has no network).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=build
DIR=""
case "${1:-}" in
    --package) MODE=package; DIR="${2:?--package needs a directory}" ;;
    --prebuilt) MODE=prebuilt; DIR="${2:?--prebuilt needs a directory}" ;;
    "") ;;
    *) echo "usage: $0 [--package DIR | --prebuilt DIR]" >&2; exit 2 ;;
esac

START=$SECONDS
GPU="${PAGEWIRE_GPU:-0}"
BYTES="${GPU_CHECK_BYTES:-1G}"
CARGO_FLAGS=(--release -p pagewire-gpudirect --no-default-features --features cuda)
if [[ "${CARGO_OFFLINE:-0}" == 1 ]]; then CARGO_FLAGS+=(--offline); fi
FAILED=()

step() { printf '\n== %s (t=%ds)\n' "$*" $((SECONDS - START)); }
fail() { echo "FAIL: $*" >&2; FAILED+=("$*"); }

# Build the test binaries and the bench example; print their paths, one a line.
build_binaries() {
    command -v cargo >/dev/null || { echo "FAIL: cargo not found (use --prebuilt DIR)" >&2; exit 1; }
    # The example lives in the examples package; without `verbs` it needs no cmake/libclang.
    local ex_flags=("${CARGO_FLAGS[@]/pagewire-gpudirect/pagewire-examples}")
    cargo build "${ex_flags[@]}" --example gpu_staged_bench >&2
    # The CLI's `devices` command, CUDA on and verbs off (no libibverbs needed there). Its
    # own target dir, so the usual target/release/pagewire (verbs on) is left alone.
    cargo build --release -p pagewire-cli --no-default-features --features cuda \
        --target-dir target/gpu-check $([[ "${CARGO_OFFLINE:-0}" == 1 ]] && echo --offline) >&2
    cargo test "${CARGO_FLAGS[@]}" --no-run --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"])
'
    echo "target/release/examples/gpu_staged_bench"
    echo "target/gpu-check/release/pagewire"
}

if [[ "$MODE" == package ]]; then
    step "building binaries into $DIR"
    mkdir -p "$DIR/tests"
    while read -r bin; do
        case "$bin" in
            */examples/* | */release/pagewire) cp "$bin" "$DIR/" ;;
            *) cp "$bin" "$DIR/tests/" ;;
        esac
    done < <(build_binaries)
    # Debug info would push the set past what a device run can carry (64 MiB).
    if command -v strip >/dev/null; then strip --strip-debug "$DIR"/gpu_staged_bench "$DIR"/pagewire "$DIR"/tests/*; fi
    ls -l "$DIR" "$DIR/tests"
    echo "packaged; on the GPU machine run: scripts/gpu-check.sh --prebuilt $DIR"
    exit 0
fi

step "preflight"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L || true
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
else
    echo "nvidia-smi not found"
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
    echo "warning: ldconfig lists no libcuda.so; the tests will say why if CUDA cannot load"
fi

TESTS=()
if [[ "$MODE" == build ]]; then
    step "build (release, features: cuda)"
    mapfile -t BINS < <(build_binaries)
    for b in "${BINS[@]}"; do
        case "$b" in
            */examples/*) BENCH="$b" ;;
            */release/pagewire) CLI="$b" ;;
            *) TESTS+=("$b") ;;
        esac
    done
else
    [[ -d "$DIR/tests" ]] || { echo "FAIL: $DIR/tests missing (make it with --package)" >&2; exit 1; }
    for b in "$DIR"/tests/*; do TESTS+=("$b"); done
    BENCH="$DIR/gpu_staged_bench"
    CLI="$DIR/pagewire"
fi
((${#TESTS[@]})) || { echo "FAIL: no test binaries found" >&2; exit 1; }
[[ -x "$BENCH" ]] || { echo "FAIL: bench binary $BENCH missing" >&2; exit 1; }
[[ -x "$CLI" ]] || { echo "FAIL: CLI binary $CLI missing" >&2; exit 1; }
echo "build done at t=$((SECONDS - START))s: ${#TESTS[@]} test binaries, bench $BENCH"

step "tests (--include-ignored: the CUDA tests run, and a missing GPU fails them)"
for t in "${TESTS[@]}"; do
    echo "-- $(basename "$t")"
    if ! PAGEWIRE_GPU="$GPU" timeout 120 "$t" --include-ignored --test-threads=4 --nocapture; then
        fail "tests in $(basename "$t")"
    fi
done

step "pagewire devices (the CLI must list GPU $GPU and its path)"
if DEV_OUT="$(timeout 30 "$CLI" devices 2>&1)"; then
    echo "$DEV_OUT"
    grep -q "^  GPU $GPU: " <<<"$DEV_OUT" || fail "pagewire devices lists no GPU $GPU"
else
    echo "$DEV_OUT"; fail "pagewire devices"
fi
timeout 30 "$CLI" devices --json || fail "pagewire devices --json"

step "staged-mode benchmark ($BYTES per transfer, GPU $GPU)"
bench() {
    if ! timeout 90 "$BENCH" --gpu "$GPU" --require-gpu "$@"; then
        fail "bench $*"
    fi
}
bench --bytes "$BYTES" --chunk 2M --depth 4 --iters 5 --backend loopback
bench --bytes 256M --chunk 2M --depth 4 --iters 3 --backend tcp

step "chunk/depth sweep (256 MiB, loopback)"
SWEEP="$(mktemp)"
for cd in "256K 4" "1M 4" "4M 4" "16M 2" "2M 2" "2M 8"; do
    set -- $cd
    echo "-- chunk $1 depth $2"
    # Not a pipe: `bench` must run in this shell to record failures.
    bench --bytes 256M --chunk "$1" --depth "$2" --iters 3 --backend loopback >"$SWEEP"
    sed -n '2,8p' "$SWEEP"
done
rm -f "$SWEEP"

ELAPSED=$((SECONDS - START))
step "summary"
echo "elapsed: ${ELAPSED}s (budget 300s)"
if ((ELAPSED > 300)); then fail "over the 5-minute budget (${ELAPSED}s)"; fi
if ((${#FAILED[@]})); then
    printf 'GPU CHECK FAILED:\n'; printf '  %s\n' "${FAILED[@]}"
    exit 1
fi
echo "GPU CHECK PASSED"
