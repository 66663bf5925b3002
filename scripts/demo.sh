#!/usr/bin/env bash
# The main job: build the `pagewire` binary (release) and run it with no arguments:
# an end-to-end KV page transfer between two engines, verified byte for byte, then a
# bandwidth table, on the best transport this host has (RDMA verbs if a device is
# usable, else TCP). Installs what it needs first (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -p pagewire-cli --bin pagewire
exec target/release/pagewire "$@"
