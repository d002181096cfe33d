#!/usr/bin/env bash
# The main job: the loopback transfer benchmark (kvxfer-bench with no
# arguments: a target process and an initiator on loopback, block sizes
# 4 KiB - 4 MiB). Extra arguments go to kvxfer-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh build
cargo build --release --locked -p kvxfer-bench
exec target/release/kvxfer-bench "$@"
