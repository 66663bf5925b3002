#!/usr/bin/env bash
# A NIXL agent transfer through NIXL's Mooncake backend running on pagewire's
# libtransfer_engine.so (a manual check, not part of scripts/test.sh: it downloads NIXL).
#
# NIXL's published wheels (nixl-cu12 1.4.0, 1.5.1) ship no Mooncake plugin (their plugins/
# has no libplugin_MOONCAKE.so: creating the backend fails with NIXL_ERR_NOT_FOUND). So
# this builds NIXL's own plugin source, unmodified, at the wheel's version, against
# Mooncake's transfer_engine_c.h (MOONCAKE_TE_HEADER; pagewire's header otherwise), links
# it with pagewire's library, drops it into the wheel's plugin directory, and runs
# crates/capi/tests/nixl/two_agents.py as two processes.
#
# Sources (extracted trees; cloned from GitHub when unset):
#   NIXL_SRC    ai-dynamo/nixl at v1.4.0 (the wheel's version)
#   ABSL_SRC    abseil-cpp at 20250814.1 (the ABI of the absl the wheel bundles)
#   TOMLPP_SRC  marzer/tomlplusplus at v3.4.0
# Backend: PAGEWIRE_TRANSPORT (default tcp; verbs inside scripts/rdma-vm.sh run).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$repo/target/nixl-check
mkdir -p "$work"
export PATH="$HOME/.cargo/bin:$PATH"

fetch() { # name url tag
    local dir="$work/src-$1"
    [[ -d $dir ]] || git clone -q --depth 1 --branch "$3" "$2" "$dir"
    echo "$dir"
}
NIXL_SRC=${NIXL_SRC:-$(fetch nixl https://github.com/ai-dynamo/nixl v1.4.0)}
ABSL_SRC=${ABSL_SRC:-$(fetch absl https://github.com/abseil/abseil-cpp 20250814.1)}
TOMLPP_SRC=${TOMLPP_SRC:-$(fetch tomlpp https://github.com/marzer/tomlplusplus v3.4.0)}
te_include=${MOONCAKE_TE_HEADER:+$(dirname "$MOONCAKE_TE_HEADER")}
te_include=${te_include:-$repo/crates/capi/include}

echo "== pagewire's libtransfer_engine.so"
cargo build -q -p pagewire-capi
lib=$repo/target/debug

echo "== nixl-cu12 1.4.0 in $work/venv"
bash scripts/nixl-venv.sh >/dev/null
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
nixl_libs=$site/.nixl_cu12.mesonpy.libs

echo "== NIXL's Mooncake plugin from $NIXL_SRC, against $te_include/transfer_engine_c.h"
s=$NIXL_SRC/src
g++ -std=c++17 -O1 -fPIC -shared -o "$nixl_libs/plugins/libplugin_MOONCAKE.so" \
    "$s/plugins/mooncake/mooncake_backend.cpp" "$s/plugins/mooncake/mooncake_plugin.cpp" \
    -I "$te_include" -I "$s/api/cpp" -I "$s/api/cpp/backend" -I "$s/infra" -I "$s/core" \
    -I "$s/core/telemetry" -I "$s/utils" -I "$s/utils/common" -I "$s/utils/serdes" \
    -I "$ABSL_SRC" -I "$TOMLPP_SRC/include" \
    -L "$lib" -ltransfer_engine -L "$nixl_libs" -lnixl_common -lserdes -lnixl \
    -Wl,-rpath,'$ORIGIN/..' -Wl,-rpath,"$lib"
echo "   $(ldd "$nixl_libs/plugins/libplugin_MOONCAKE.so" | grep transfer_engine)"

echo "== two agents, backend ${PAGEWIRE_TRANSPORT:=tcp}"
export PAGEWIRE_TRANSPORT NIXL_MOONCAKE_IP_ADDR=${NIXL_MOONCAKE_IP_ADDR:-127.0.0.1}
run=$(mktemp -d)
py=$repo/crates/capi/tests/nixl/two_agents.py
"$work/venv/bin/python" "$py" target "$run" > "$run/target.log" 2>&1 &
target=$!
rc=0
"$work/venv/bin/python" "$py" initiator "$run" 2>&1 | grep -v ' INFO ' || rc=1
wait "$target" || rc=1
grep -v ' INFO ' "$run/target.log"
rm -rf "$run"
echo "nixl-check: $([[ $rc == 0 ]] && echo ok || echo FAILED)"
exit $rc
