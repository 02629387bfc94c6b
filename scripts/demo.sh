#!/usr/bin/env bash
# The main job on a fresh machine: build dpukv and run the engine demo — load 1M keys into a
# shared-memory arena, serve reads from separate reader processes while the writer keeps
# writing, and print the figures. (Until the node issue lands, the engine demo is the main job.)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "cargo (Rust stable) is required" >&2; exit 1; }
cargo build --release -p dpukv-storage --bin dpukv-arena
exec ./target/release/dpukv-arena demo --keys "${DPUKV_DEMO_KEYS:-1000000}" --seconds "${DPUKV_DEMO_SECONDS:-5}" --readers "${DPUKV_DEMO_READERS:-2}"
