#!/usr/bin/env bash
# Mooncake's tensor calls (put_tensor, get_tensor, their batch, into, from, upsert, pub and
# tensor-parallel forms) on pagewire against Mooncake's own wheel, with torch:
# crates/python/tests/tensor_mooncake_diff.py (same codes, same tensors, the same stored
# bytes, cross-reads both ways). Run by scripts/sglang-check.sh in its virtualenv, the one
# with torch (PAGEWIRE_SGLANG_VENV, default ~/.cache/pagewire/venv-sglang; pytest's .venv
# stays without torch), after it installed the pagewire wheel there.
#
# Installs mooncake-transfer-engine-non-cuda 0.3.13.post1 into that virtualenv with
# --no-deps (its torch-free dependencies are there already) unless that version is
# installed. Closes with "N passed, M failed"; exits non-zero on a failure, or when
# torch, the Mooncake wheel or pagewire is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
venv=${PAGEWIRE_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pagewire/venv-sglang}
py=$venv/bin/python
if [[ ! -x $py ]]; then
    echo "tensor-check: no virtualenv at $venv (scripts/sglang-check.sh creates it)"
    echo "0 passed, 1 failed"
    exit 1
fi
want=0.3.13.post1
have=$("$py" -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))' \
    2>/dev/null || true)
if [[ $have != "$want" ]]; then
    echo "== tensor: installing mooncake-transfer-engine-non-cuda==$want into $venv (--no-deps)"
    "$py" -m pip install -q --disable-pip-version-check --no-deps \
        "mooncake-transfer-engine-non-cuda==$want"
fi
echo "== tensor: Mooncake's tensor calls, pagewire against the wheel"
rc=0
"$py" crates/python/tests/tensor_mooncake_diff.py || rc=$?
echo "== tensor-check took $((SECONDS - t0)) s"
exit $rc
