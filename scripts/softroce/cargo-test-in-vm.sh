#!/usr/bin/env bash
# Build the test binaries on the host and run all of them in ONE soft-RoCE guest.
#
#   cargo-test-in-vm.sh [--vm-args RUNNER OPTIONS... --vm-args-end] [CARGO TEST ARGS] [-- LIBTEST ARGS]
#
# Each binary runs as under `cargo test`: cwd = its package directory, CARGO_MANIFEST_DIR
# set, plus RDMA_REQUIRED=1, RDMA_DEVICE=rxe0 (RDMA_DEVICE2=rxe1 with --two-devices) and
# RUST_BACKTRACE=1, and with --include-ignored (unless the libtest args already choose
# --ignored or --include-ignored): the tests that need an RDMA device are #[ignore]d on a
# host and run here. Prints which binaries ran, their libtest output, and a closing
# "test binaries: N passed, M failed". Exit: 0 all passed, 1 a test failed or nothing ran,
# 123/124/125 guest setup failure / timeout / crash (see run-vm.sh).
# SOFTROCE_ENV_FILE may name a file of `export` lines added to the job (rdma-vm.sh uses it).
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

vmargs=()
if [[ "${1:-}" == --vm-args ]]; then
    shift
    while (($#)) && [[ "$1" != --vm-args-end ]]; do vmargs+=("$1"); shift; done
    (($#)) && shift
fi
cargo_args=() test_args=()
while (($#)); do
    if [[ "$1" == -- ]]; then shift; test_args=("$@"); break; fi
    cargo_args+=("$1"); shift
done

# The hardware tests are ignored on a host; here they run (see above).
case " ${test_args[*]} " in
    *" --ignored "* | *" --include-ignored "*) ;;
    *) test_args=(--include-ignored "${test_args[@]}") ;;
esac

cd "$repo" || exit 1
export PATH="$HOME/.cargo/bin:$PATH"

work="$(mktemp -d "${TMPDIR:-/tmp}/rdma-vm-test.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "softroce: cargo test --no-run ${cargo_args[*]}" >&2
cargo test --no-run --message-format=json-render-diagnostics "${cargo_args[@]}" >"$work/cargo.json"
crc=$?
if ((crc != 0)); then
    echo "softroce: building the test binaries failed (cargo exit $crc)" >&2
    exit 1
fi
python3 "$here/imagetool.py" cargo-tests <"$work/cargo.json" >"$work/binaries"
nbin=$(wc -l <"$work/binaries")
if ((nbin == 0)); then
    echo "softroce: cargo built no test binaries for: ${cargo_args[*]:-(workspace default)}; nothing ran" >&2
    exit 1
fi

# Results go to a host directory that the guest sees at the same path (--out).
resdir="$work/out"
mkdir -p "$resdir"
{
    echo '#!/bin/bash'
    [[ -n "${SOFTROCE_ENV_FILE:-}" && -f "$SOFTROCE_ENV_FILE" ]] && cat "$SOFTROCE_ENV_FILE"
    printf 'results=%q\n' "$resdir/results"
    printf 'targs=('; printf '%q ' "${test_args[@]}"; printf ')\n'
    cat <<'EOF'
export RDMA_REQUIRED=1 RUST_BACKTRACE=${RUST_BACKTRACE:-1}
pass=0 fail=0
: >"$results"
run_bin() {
    local name=$1 exe=$2 dir=$3 rc
    echo "=== [$name] ${exe#"$PWD"/} on ${RDMA_DEVICE:-?}${RDMA_DEVICE2:+ + $RDMA_DEVICE2}"
    local t0=$EPOCHREALTIME
    printf 'running\t%s\n' "$name" >>"$results"
    (cd "$dir" && CARGO_MANIFEST_DIR="$dir" exec "$exe" "${targs[@]}")
    rc=$?
    local ms=$(( (${EPOCHREALTIME/./} - ${t0/./}) / 1000 ))
    printf '%s\t%s\t%s\n' "$rc" "$name" "$ms" >>"$results"
    if ((rc == 0)); then pass=$((pass + 1)); else fail=$((fail + 1)); echo "=== [$name] FAILED (exit $rc)"; fi
}
EOF
    while IFS=$'\t' read -r name exe dir; do
        printf 'run_bin %q %q %q\n' "$name" "$exe" "$dir"
    done <"$work/binaries"
    echo 'echo "=== guest: $pass binaries passed, $fail failed"'
    echo 'exit $((fail > 0))'
} >"$work/job.sh"

echo "softroce: running $nbin test binaries in one guest" >&2
"$here/run-vm.sh" "${vmargs[@]}" --out "$resdir" "$work/job.sh"
vrc=$?

# Summary from the host side, so it is right even when the guest died half-way.
passed=0 failed=0 lines=()
declare -A done_rc=() done_ms=() started=()
if [[ -f "$resdir/results" ]]; then
    while IFS=$'\t' read -r rc name ms; do
        if [[ "$rc" == running ]]; then started["$name"]=1; continue; fi
        done_rc["$name"]=$rc
        done_ms["$name"]=$ms
    done <"$resdir/results"
fi
fmt_ms() { [[ "${1:-}" =~ ^[0-9]+$ ]] && printf '%d.%01d s' $(($1 / 1000)) $(($1 % 1000 / 100)) || printf '? s'; }
notrun=0
while IFS=$'\t' read -r name exe dir; do
    if [[ -n "${done_rc[$name]+x}" ]]; then
        if [[ "${done_rc[$name]}" == 0 ]]; then
            passed=$((passed + 1)); lines+=("  ok      $name ($(fmt_ms "${done_ms[$name]}"))")
        else
            failed=$((failed + 1)); lines+=("  FAILED  $name (exit ${done_rc[$name]}, $(fmt_ms "${done_ms[$name]}"))")
        fi
    else
        notrun=$((notrun + 1))
        if [[ -n "${started[$name]+x}" ]]; then
            lines+=("  UNFINISHED $name (was running when the guest stopped)")
        else
            lines+=("  NOT RUN $name")
        fi
    fi
done <"$work/binaries"
echo "softroce: test binaries run in the guest:"
printf '%s\n' "${lines[@]}"
summary="test binaries: $passed passed, $failed failed"
((notrun)) && summary="$summary, $notrun not run"
case "$vrc" in
    123) summary="$summary (guest setup failed)" ;;
    124) summary="$summary (guest TIMED OUT)" ;;
    125) summary="$summary (guest crashed / reported nothing)" ;;
esac
echo "$summary"
if ((vrc == 123 || vrc == 124 || vrc == 125)); then exit "$vrc"; fi
if ((failed || notrun || vrc != 0)); then exit 1; fi
exit 0
