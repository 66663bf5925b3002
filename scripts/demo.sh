#!/usr/bin/env bash
# The main job: build the `pagewire` binary (release) and run it with no arguments:
# an end-to-end KV page transfer between two engines in one process, verified byte for
# byte, then a bandwidth table, on the best transport this host has (RDMA verbs if a
# device is usable, else TCP, said on stderr). It peaks at about 150 MB of memory (the
# last line says how much), so it fits a 1 GiB machine. Arguments go to the binary
# (`bash scripts/demo.sh --help`). Installs what it needs first (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -p pagewire-cli --bin pagewire
exec target/release/pagewire "$@"
