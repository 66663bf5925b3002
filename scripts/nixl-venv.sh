#!/usr/bin/env bash
# NIXL's published wheel in its own virtualenv, target/nixl-check/venv (idempotent: a rerun
# installs nothing). Prints the interpreter's path. Used by scripts/nixl-check.sh and by
# the benchmarks that compare against NIXL (benches/python/bench_mooncake_compat.py).
# No torch: NIXL imports it only when it is there. The wheel brings its own UCX.
set -euo pipefail
cd "$(dirname "$0")/.."
NIXL_WHEEL="nixl-cu12==1.4.0"
venv=target/nixl-check/venv
stamp=$venv/.nixl-installed
if [[ ! -f $stamp || "$(cat "$stamp")" != "$NIXL_WHEEL" ]]; then
    echo "nixl-venv: installing $NIXL_WHEEL into $venv" >&2
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$NIXL_WHEEL" numpy >&2
    echo "$NIXL_WHEEL" >"$stamp"
fi
echo "$PWD/$venv/bin/python"
