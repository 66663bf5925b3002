#!/usr/bin/env bash
# Idempotent setup for a fresh Debian 12 machine (run as root): the build needs
# (cmake + libclang for sideway's bindgen), and with `--vm` the soft-RoCE VM's packages.
# Already-present packages are skipped, so a second run costs one dpkg query.
set -euo pipefail

# python3-venv/python3-dev: the Python bindings' virtualenv and libpython for `cargo test`.
# protobuf-compiler + libprotobuf-dev: protoc and its well-known types, which the
# etcd-client crate's build script compiles etcd's API with.
# With --vm (the test suite's set): etcd-server, the real etcd that the store's HA tests
# start on 127.0.0.1 ports of their own (crates/ha), and openssl, which makes the
# certificates of its TLS test; the main job needs neither.
want=(cmake libclang1-14 libclang-common-14-dev pkg-config python3-venv python3-dev
      protobuf-compiler libprotobuf-dev)
if [[ "${1:-}" == "--vm" ]]; then
    want+=(etcd-server openssl qemu-system-x86 busybox-static rdma-core ibverbs-providers ibverbs-utils
           libibverbs-dev perftest rdmacm-utils iperf3 python3 iproute2 kmod xz-utils)
fi

missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
    if [[ -x "$HOME/.cargo/bin/cargo" ]]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: no Rust toolchain found (install rustup from https://rustup.rs)" >&2
        exit 1
    fi
fi
