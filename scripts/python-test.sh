#!/usr/bin/env bash
# Python part of the test suite: creates (once) the virtualenv .venv, installs the build
# and test tools into it, builds the pagewire wheel with maturin, installs it, and runs
# pytest over crates/python/tests. Idempotent: a second run reuses the venv and the
# cargo build cache. Extra arguments go to pytest; --install-only (first) stops before it,
# for the benchmarks that need .venv (scripts/bench-vs-perftest.sh --section python).
set -euo pipefail
install_only=0
[[ "${1:-}" == --install-only ]] && { install_only=1; shift; }
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

venv=.venv
py="${PYTHON:-python3}"
if [[ ! -x "$venv/bin/python" ]]; then
    echo "python: creating $venv with $($py --version)"
    "$py" -m venv "$venv"
fi
# Pinned so that a rerun installs nothing new; pip skips what is already satisfied.
"$venv/bin/pip" install -q --disable-pip-version-check \
    maturin==1.16.0 pytest==8.4.2 numpy==2.3.5

# --- Mooncake reference (differential test of pagewire.mooncake_compat) ------------------
# The real Mooncake wheel, for tests/test_mooncake_diff.py (which fails, never skips,
# without it). Its engine.so links libibverbs.so.1 even for TCP, so that library must be
# installed (rdma-core's libibverbs1; scripts/setup.sh --vm installs it too).
if ! dpkg-query -W -f='${Status}' libibverbs1 2>/dev/null | grep -q "install ok installed"; then
    echo "python: installing libibverbs1 (needed by the Mooncake wheel)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 \
        >/dev/null 2>&1 ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends libibverbs1 >/dev/null; }
fi
"$venv/bin/pip" install -q --disable-pip-version-check \
    mooncake-transfer-engine-non-cuda==0.3.13.post1
# --- end Mooncake reference ----------------------------------------------------------------

echo "== python: maturin build (profile wheel)"
rm -rf target/wheels
(cd crates/python && ../../"$venv"/bin/maturin build --locked --profile wheel \
    -o ../../target/wheels)
"$venv/bin/pip" install -q --disable-pip-version-check --no-index --force-reinstall \
    --no-deps target/wheels/pagewire-*.whl

((install_only)) && exit 0

echo "== python: the C ABI library (for the C <-> Python interop test)"
cargo build --locked -q -p pagewire-capi
export PAGEWIRE_CAPI_LIB="${CARGO_TARGET_DIR:-$PWD/target}/debug/libtransfer_engine.so"

echo "== python: the pagewire binary (standalone client tests)"
cargo build --locked -q -p pagewire-cli
export PAGEWIRE_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/pagewire"

echo "== python: pytest"
# Run from the tests directory so that `import pagewire` finds the installed wheel, not
# the source tree.
cd crates/python/tests
rc=0
"../../../$venv/bin/python" -m pytest -q "$@" || rc=$?
# 5 = no tests collected: a broken collection must not pass silently.
exit "$rc"
