#!/usr/bin/env bash
# Self-test of the soft-RoCE harness: it must pass what passes, and fail loudly on what
# fails. Each case boots one guest (about 5-10 s each under TCG).
#   1. smoke: rxe0 is ACTIVE, the RDMA_* contract is set, a file written to $SOFTROCE_OUT
#      comes back to the host                                   -> exit 0
#   2. --two-devices: rxe0 on veth0 and rxe1 on veth1, ACTIVE  -> exit 0
#      --two-rails: rxe0, rxe1, rxe0p, rxe1p on veth0, veth1, veth0p, veth1p, ACTIVE,
#      and rail 1 alone goes DOWN with veth1                    -> exit 0
#   3. a job that fails (exit 3)                                -> exit 3
#   4. rxe0 cannot be created (netdev that does not exist)      -> exit 123, loud message
#   5. rxe0 cannot be created (crc32 transform missing)         -> exit 123, loud message
#   6. a job that hangs, with --timeout 15                      -> exit 124
#   7. the guest kernel panics mid-job                          -> exit 125
#   8. cargo-test wrapper on fixture/ (one test binary fails)   -> exit 1, "1 passed, 1 failed"
# Runner options given here (e.g. --mem, --cpus) apply to every case.
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
run="$here/run-vm.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/softroce-selftest.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/out"

"$here/build-image.sh" >/dev/null || { echo "selftest: image build failed" >&2; exit 1; }

failures=0
# The runner keeps the job dir of every failed run; the expected failures here need none.
drop_kept() {
    sed -n 's/^softroce: kept job dir \(.*\)$/\1/p' "$work/log" | while read -r d; do
        [[ "$d" == */jobs/job.* ]] && rm -rf "$d"
    done
}
# passed NAME EXIT_STATUS START_SECONDS / failed MESSAGE LOG_LINES: report one case
# (a failure shows the last LOG_LINES of $work/log).
passed() {
    echo "selftest: ok    $1 (exit $2, $((SECONDS - $3)) s)"
    drop_kept
}
failed() {
    echo "selftest: FAIL  $1"
    sed 's/^/    | /' "$work/log" | tail -n "$2"
    failures=$((failures + 1))
}
# check NAME EXPECTED_RC GREP_PATTERN RUNNER_ARGS... : run, compare exit status and output.
check() {
    local name=$1 want=$2 pattern=$3 t0 got
    shift 3
    t0=$SECONDS
    "$run" "$@" >"$work/log" 2>&1
    got=$?
    if [[ "$got" == "$want" ]] && { [[ -z "$pattern" ]] || grep -Eq "$pattern" "$work/log"; }; then
        passed "$name" "$got" "$t0"
    else
        failed "$name: exit $got, wanted $want${pattern:+ and output matching /$pattern/}" 25
    fi
}

cat >"$work/smoke.sh" <<'EOF'
set -e
[ "$RDMA_DEVICE" = rxe0 ] && [ "$RDMA_REQUIRED" = 1 ]
grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state
ibv_devinfo -d rxe0 | grep -q PORT_ACTIVE
echo "written in the guest" >"$SOFTROCE_OUT/smoke.txt"
echo "SMOKE-OK"
EOF
check "smoke job on rxe0" 0 "SMOKE-OK" --out "$work/out" "$work/smoke.sh" "$@"
if [[ "$(cat "$work/out/smoke.txt" 2>/dev/null)" != "written in the guest" ]]; then
    echo "selftest: FAIL  the file written to \$SOFTROCE_OUT did not come back"
    failures=$((failures + 1))
fi

cat >"$work/two.sh" <<'EOF'
set -e
[ "$RDMA_DEVICE" = rxe0 ] && [ "$RDMA_DEVICE2" = rxe1 ]
rdma link show | grep -q 'rxe0/1 state ACTIVE .* netdev veth0'
rdma link show | grep -q 'rxe1/1 state ACTIVE .* netdev veth1'
echo "TWO-OK"
EOF
check "two devices on a veth pair" 0 "TWO-OK" --two-devices "$work/two.sh" "$@"

cat >"$work/rails.sh" <<'EOF'
set -e
[ "$RDMA_RAILS" = rxe0,rxe1 ] && [ "$RDMA_PEER_RAILS" = rxe0p,rxe1p ] && [ "$RDMA_DEVICE2" = rxe0p ]
for p in rxe0:veth0 rxe1:veth1 rxe0p:veth0p rxe1p:veth1p; do
    rdma link show | grep -q "${p%%:*}/1 state ACTIVE .* netdev ${p#*:} *$"
done
ip link set veth1 down
sleep 0.5
rdma link show | grep -q 'rxe1/1 state DOWN'
rdma link show | grep -q 'rxe1p/1 state DOWN'
rdma link show | grep -q 'rxe0/1 state ACTIVE'
echo "RAILS-OK"
EOF
check "two rails on two veth pairs" 0 "RAILS-OK" --two-rails "$work/rails.sh" "$@"

printf 'echo "this job fails on purpose"\nexit 3\n' >"$work/fail.sh"
check "failing job returns its status" 3 "fails on purpose" "$work/fail.sh" "$@"

printf 'echo "must not run"\n' >"$work/never.sh"
check "no rxe0 (bogus netdev) fails loudly" 123 "SETUP FAILED.*cannot create rxe0" \
    --append sr.ndev=nosuchdev0 "$work/never.sh" "$@"
check "no rxe0 (no crc32 transform) fails loudly" 123 "SETUP FAILED.*cannot create rxe0" \
    --append sr.nocrc=1 "$work/never.sh" "$@"

printf 'echo "hanging"\nsleep 600\n' >"$work/hang.sh"
check "hanging job times out" 124 "TIMEOUT" "$@" --timeout 15 "$work/hang.sh"

printf 'echo c >/proc/sysrq-trigger\nsleep 60\n' >"$work/panic.sh"
check "guest panic is reported" 125 "reported no exit status" "$work/panic.sh" "$@"

# The cargo-test wrapper on a throwaway crate built under $TMPDIR (host /tmp must be visible
# in the guest): 2 binaries, one with a failing test -> exit 1 and the right summary.
cp -r "$here/fixture" "$work/fixture"
t0=$SECONDS
CARGO_TARGET_DIR="$work/target" "$here/cargo-test-in-vm.sh" --vm-args "$@" --vm-args-end \
    --manifest-path "$work/fixture/Cargo.toml" >"$work/log" 2>&1
got=$?
if ((got == 1)) && grep -q '^test binaries: 1 passed, 1 failed$' "$work/log" &&
    grep -q '^test rdma_device_from_env_exists ... ok' "$work/log" &&
    grep -q 'FAILED  softroce-fixture::fails (test)' "$work/log"; then
    passed "cargo-test wrapper reports a failing test binary" "$got" "$t0"
else
    failed "cargo-test wrapper on the fixture: exit $got, wanted 1 with 1 passed, 1 failed" 40
fi

if ((failures)); then
    echo "selftest: $failures case(s) FAILED"
    exit 1
fi
echo "selftest: all cases passed"
