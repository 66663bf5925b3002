#!/usr/bin/env bash
# Python part of the test suite: creates (once) the virtualenv .venv, installs the build
# and test tools into it, builds the pagewire wheel with maturin, installs it, and runs
# pytest over crates/python/tests. Idempotent: a second run reuses the venv and the
# cargo build cache. Extra arguments go to pytest.
set -euo pipefail
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

echo "== python: maturin build (profile wheel)"
rm -rf target/wheels
(cd crates/python && ../../"$venv"/bin/maturin build --locked --profile wheel \
    -o ../../target/wheels)
"$venv/bin/pip" install -q --disable-pip-version-check --no-index --force-reinstall \
    --no-deps target/wheels/pagewire-*.whl

echo "== python: pytest"
# Run from the tests directory so that `import pagewire` finds the installed wheel, not
# the source tree.
cd crates/python/tests
rc=0
"../../../$venv/bin/python" -m pytest -q "$@" || rc=$?
# 5 = no tests collected: a broken collection must not pass silently.
exit "$rc"
