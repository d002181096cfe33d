#!/usr/bin/env bash
# The seeded fault-injection suite (tests/faults.rs) over many seeds, on
# each backend that runs here: a frame-aware proxy damages one frame per
# run (bit flips, truncation, duplicates, drops, delays, stalls, kills)
# of a checked WRITE or READ, and of a KV request (a quarter as many), and
# every run is checked to fail closed. The test command runs 8 seeds on
# tcp, shm and rdma; this runs SEEDS (default 1000) from FIRST (default
# 1000) on tcp, shm and fabric, and a fifth as many on rdma in the
# soft-RoCE guest (about 2 s a seed there under TCG).
#   ci/fault-soak.sh [SEEDS] [FIRST]
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh test >/dev/null
seeds=${1:-1000}
first=${2:-1000}
cargo build --locked --features fabric --tests -q
for b in tcp shm fabric; do
  echo "== $b: $seeds seeds from $first"
  start=$(date +%s)
  KVXFER_FABRIC_PROVIDER="tcp;ofi_rxm" KVXFER_TEST_BACKEND=$b \
    KVXFER_FAULT_SEEDS=$seeds KVXFER_FAULT_FIRST_SEED=$first \
    cargo test --locked --features fabric --test faults -q -- --nocapture 2>&1 | grep -E "seeds from|test result|panicked"
  echo "$b: $(( $(date +%s) - start )) s"
done
b=$(cargo test --locked --test faults --no-run 2>&1 | grep -o "target/debug/deps/faults-[0-9a-f]*" | tail -n1)
echo "== rdma (soft-RoCE guest): $(( seeds / 5 )) seeds from $first"
start=$(date +%s)
KVXFER_RDMA_ACK_TIMEOUT=20 KVXFER_TEST_BACKEND=rdma ci/rxe-guest --timeout 3600 sh -c \
  "KVXFER_FAULT_SEEDS=$(( seeds / 5 )) KVXFER_FAULT_FIRST_SEED=$first $b --color never --nocapture" 2>&1 |
  grep -E "seeds from|test result|panicked"
echo "rdma: $(( $(date +%s) - start )) s"
