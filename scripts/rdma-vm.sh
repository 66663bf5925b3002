#!/usr/bin/env bash
# Front door of the soft-RoCE VM harness (scripts/softroce/, docs/testing.md).
#
#   rdma-vm.sh [OPTIONS] test [CARGO TEST ARGS] [-- LIBTEST ARGS]
#       build the test binaries on the host (cargo test --no-run) and run all of them in
#       one guest with RDMA_REQUIRED=1 RDMA_DEVICE=rxe0; non-zero exit if any failed
#   rdma-vm.sh [OPTIONS] run -- COMMAND [ARGS]
#       run COMMAND in the guest (cwd: repository root) and return its exit status
#   rdma-vm.sh [OPTIONS] shell       interactive shell in the guest (exit or Ctrl-D: poweroff)
#   rdma-vm.sh image                 build the guest image (cached) and print its directory
#   rdma-vm.sh selftest              check the harness itself (pass, fail, no rxe, timeout)
#
# OPTIONS (before the subcommand, or right after it):
#   --timeout S   limit for the whole guest run (default 600; test: 900; shell: 3600)
#   --mem MB      guest RAM (default 1024)          --cpus N      vCPUs (default 1)
#   --two-devices rxe0 on veth0 + rxe1 on veth1 (RDMA_DEVICE2=rxe1), traffic crosses veth
#   --two-rails   two veth pairs: rxe0,rxe1 on veth0,veth1 and rxe0p,rxe1p on their peers
#                 (RDMA_RAILS=rxe0,rxe1 RDMA_PEER_RAILS=rxe0p,rxe1p RDMA_DEVICE2=rxe0p)
#   --mtu N       netdev MTU (default 9000 -> RoCE MTU 4096)
#   --append STR  extra kernel parameters, e.g. "sr.ip=10.9.9.1/24"
#   --out DIR     host dir shared read-write at the same path in the guest ($SOFTROCE_OUT;
#                 default <repo>/target/softroce-out)
#   --env K=V     extra environment for the command / test binaries (repeatable)
#   --kvm auto|on|off   (default auto: KVM only with kvm_intel/kvm_amd loaded)
#   --keep        keep the job dir (console.log) after a successful run
#   --quiet       only the job's own output (no kernel / init lines)
#
# Exit status: the command's (run), 0/1 (test); 124 timeout, 125 guest reported nothing
# (panic, crash), 123 guest setup failed (e.g. rxe0 could not be created), 2 usage.
set -uo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/.." && pwd)"
sr="$here/softroce"

usage() { sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; }

vmopts=() envs=() timeout_set=0
# Parses one harness option from "$@"; returns the number of words consumed (0: not ours).
take_opt() {
    case "$1" in
        --timeout|--mem|--cpus|--mtu|--append|--out|--kvm)
            [[ $# -ge 2 ]] || { echo "rdma-vm: $1 needs a value" >&2; exit 2; }
            [[ "$1" == --timeout ]] && timeout_set=1
            vmopts+=("$1" "$2"); return 2 ;;
        --env)
            [[ $# -ge 2 && "$2" == *=* ]] || { echo "rdma-vm: --env needs K=V" >&2; exit 2; }
            envs+=("$2"); return 2 ;;
        --two-devices|--two-rails|--keep) vmopts+=("$1"); return 1 ;;
        --quiet|-q) vmopts+=(--quiet); return 1 ;;
    esac
    return 0
}

while (($#)); do
    case "$1" in -h|--help) usage; exit 0 ;; esac
    take_opt "$@"; n=$?
    ((n)) || break
    shift "$n"
done
cmd="${1:-}"
(($#)) && shift
# Options right after the subcommand (not --quiet for test: that is cargo's).
while (($#)); do
    [[ "$cmd" == test && ( "$1" == --quiet || "$1" == -q ) ]] && break
    take_opt "$@"; n=$?
    ((n)) || break
    shift "$n"
done

# Environment forwarded into the guest job: the caller's PATH (so commands resolve as on
# the host), a few Rust knobs when set, and --env pairs.
env_lines() {
    printf 'export PATH=%q\n' "$PATH"
    local v
    for v in RUST_LOG RUST_BACKTRACE RUST_MIN_STACK; do
        [[ -n "${!v:-}" ]] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    for v in "${envs[@]}"; do
        printf 'export %s=%q\n' "${v%%=*}" "${v#*=}"
    done
}

case "$cmd" in
    run)
        [[ "${1:-}" == -- ]] && shift
        (($#)) || { echo "rdma-vm: run needs a command: rdma-vm.sh run -- COMMAND [ARGS]" >&2; exit 2; }
        job="$(mktemp "${TMPDIR:-/tmp}/rdma-vm-job.XXXXXX")"
        trap 'rm -f "$job"' EXIT
        {
            echo '#!/bin/bash'
            env_lines
            printf 'cd %q || exit 1\n' "$repo"
            printf '%q ' "$@"
            echo
        } >"$job"
        "$sr/run-vm.sh" "${vmopts[@]}" "$job"
        exit $?
        ;;
    test)
        ((timeout_set)) || vmopts=(--timeout 900 "${vmopts[@]}")
        envfile="$(mktemp "${TMPDIR:-/tmp}/rdma-vm-env.XXXXXX")"
        trap 'rm -f "$envfile"' EXIT
        env_lines >"$envfile"
        SOFTROCE_ENV_FILE="$envfile" "$sr/cargo-test-in-vm.sh" --vm-args "${vmopts[@]}" --vm-args-end "$@"
        exit $?
        ;;
    shell)
        ((timeout_set)) || vmopts=(--timeout 3600 "${vmopts[@]}")
        exec "$sr/run-vm.sh" "${vmopts[@]}" --shell
        ;;
    image)
        exec "$sr/build-image.sh"
        ;;
    selftest)
        exec "$sr/selftest.sh" "${vmopts[@]}"
        ;;
    "")
        usage >&2
        exit 2
        ;;
    *)
        echo "rdma-vm: unknown subcommand '$cmd'" >&2
        usage >&2
        exit 2
        ;;
esac
