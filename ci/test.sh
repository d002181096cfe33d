#!/usr/bin/env bash
# Every test: formatting, lints, unit and integration tests (the two-process
# agent suite on tcp, shm and auto; the C and C++ programs against
# libkvxfer, once under valgrind; the header freshness check), doc tests,
# benches compiled and smoke-run once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh test
export CARGO_TERM_COLOR=never RUST_BACKTRACE=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --locked --workspace --all-targets -- -D warnings
echo "== cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --locked --workspace --no-deps -q
echo "== cargo test (agent suite on tcp, unit tests, C/C++ ABI tests, benches in test mode)"
cargo test --locked --workspace --all-targets
cargo test --locked --workspace --doc
for b in shm auto; do
  echo "== agent suite on $b"
  KVXFER_TEST_BACKEND=$b cargo test --locked --test agent
done
echo "== bench CLI smoke run"
cargo build --release --locked --bin kvxfer-bench
target/release/kvxfer-bench --block-size 64KiB --batch 16 --iters 20 --warmup 2 --json
target/release/kvxfer-bench --op read --block-size 4KiB --batch 64 --iters 20 --warmup 2 --json
