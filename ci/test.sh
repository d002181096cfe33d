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
echo "== RDMA verbs tests on the host (they say SKIPPED where no RDMA device exists)"
cargo test --locked --test rdma_verbs -- --nocapture
echo "== RDMA verbs tests inside the soft-RoCE guest (ci/rxe-guest: rxe0/rxe1 on a veth pair)"
bin=$(cargo test --locked --test rdma_verbs --no-run 2>&1 | grep -o 'target/debug/deps/rdma_verbs-[0-9a-f]*' | tail -n1)
[ -x "$bin" ] || { echo "cannot find the rdma_verbs test binary" >&2; exit 1; }
ci/rxe-guest --timeout 900 "$bin" --test-threads 1 --color never
echo "== bench CLI smoke run"
cargo build --release --locked --bin kvxfer-bench
target/release/kvxfer-bench --block-size 64KiB --batch 16 --iters 20 --warmup 2 --json
target/release/kvxfer-bench --op read --block-size 4KiB --batch 64 --iters 20 --warmup 2 --json
