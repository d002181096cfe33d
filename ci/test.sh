#!/usr/bin/env bash
# Every test: formatting, lints, unit and integration tests (two-process
# agent suite over TCP), doc tests, benches compiled and smoke-run once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh test
export CARGO_TERM_COLOR=never RUST_BACKTRACE=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --locked --all-targets -- -D warnings
echo "== cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps -q
echo "== cargo test (agent suite on tcp, unit tests, benches in test mode)"
cargo test --locked --all-targets
cargo test --locked --doc
for b in shm auto; do
  echo "== agent suite on $b"
  KVXFER_TEST_BACKEND=$b cargo test --locked --test agent
done
echo "== bench CLI smoke run"
cargo build --release --locked --bin kvxfer-bench
target/release/kvxfer-bench --block-size 64KiB --batch 16 --iters 20 --warmup 2 --json
target/release/kvxfer-bench --op read --block-size 4KiB --batch 64 --iters 20 --warmup 2 --json
