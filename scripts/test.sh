#!/usr/bin/env bash
# Runs every test of the workspace (unit, integration and doc tests). The README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
