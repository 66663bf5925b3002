#!/usr/bin/env bash
# SGLang's own code on pagewire: SGLang 0.5.23 from PyPI, unchanged, with
# PAGEWIRE_AS_MOONCAKE=1 and pagewire's store master (scripts/sglang/check.py says what
# runs: PD transfers through SGLang's MooncakeTransferEngine between two processes, and
# through SGLang's MooncakeKVManager, KVSender, KVReceiver and bootstrap server (prefill
# and decode processes, MHA and MLA pools), SGLang's test_mooncake_store.py, real MHA and MLA host pools through SGLang's
# MooncakeStore HiCache backend between two processes, and the same with the shared
# engine reused).
#
# The virtualenv (PAGEWIRE_SGLANG_VENV, default ~/.cache/pagewire/venv-sglang, outside the
# checkout so that a fresh clone (CI) finds it installed; about 5.7 GB: torch's CUDA
# build and its libraries) gets scripts/sglang/requirements.txt, each package with
# --no-deps, and the pagewire wheel scripts/python-test.sh built (target/wheels). A rerun
# with the same requirements and the same wheel installs nothing. Closes with
# "N passed, M failed"; exits non-zero on any failure or missing import.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
t0=$SECONDS

venv=${PAGEWIRE_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pagewire/venv-sglang}
mkdir -p "$(dirname "$venv")"
req=scripts/sglang/requirements.txt
wheel=$(ls target/wheels/pagewire-*.whl 2>/dev/null | head -n 1 || true)
if [[ -z $wheel ]]; then
    echo "sglang-check: no pagewire wheel in target/wheels (scripts/python-test.sh builds it)"
    echo "0 passed, 1 failed"
    exit 1
fi

[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
stamp=$venv/.pagewire-installed
want="$(sha256sum "$req" "$wheel" | cut -d' ' -f1 | tr '\n' ' ')"
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    echo "== sglang: installing $req into $venv (--no-deps)"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$req"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-index --no-deps \
        --force-reinstall "$wheel"
    # A new file, not a write in place: a copy made with `cp -al` shares the old inode.
    echo "$want" > "$stamp.new" && mv "$stamp.new" "$stamp"
    echo "== sglang: installed in $((SECONDS - t0)) s ($(du -sh "$venv" | cut -f1))"
else
    echo "== sglang: $venv is up to date"
fi

echo "== sglang: pagewire's store master"
cargo build --locked -q -p pagewire-cli
port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
target/debug/pagewire store master --listen "127.0.0.1:$port" > "$log" 2>&1 &
master=$!
trap 'kill $master 2>/dev/null; wait $master 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 50); do
    grep -q listening "$log" && break
    kill -0 $master 2>/dev/null || break
    sleep 0.1
done
cat "$log"

rc=0
# PAGEWIRE_AS_MOONCAKE=1 from the start: the wheel's hook is installed at interpreter
# start-up (a .pth file), so `import mooncake.engine` and `mooncake.store` give pagewire.
PAGEWIRE_AS_MOONCAKE=1 MOONCAKE_MASTER=127.0.0.1:$port PYTHONWARNINGS=ignore "$venv/bin/python" scripts/sglang/check.py all || rc=$?
# Mooncake's tensor calls against Mooncake's wheel need torch: this virtualenv has it.
PAGEWIRE_SGLANG_VENV=$venv bash scripts/tensor-check.sh || rc=$?
echo "== sglang-check took $((SECONDS - t0)) s"
exit $rc
