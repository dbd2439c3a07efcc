#!/usr/bin/env bash
# Runs every test of the workspace. The README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --all-targets
cargo test --workspace --doc
