#!/usr/bin/env bash
# The whole test suite: host tests (layout, TCP, loopback, CLI), then the verbs
# suite inside the soft-RoCE VM. Installs what it needs first (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --vm
export PATH="$HOME/.cargo/bin:$PATH"

echo "== host suite: cargo test --workspace"
cargo test --workspace --locked
