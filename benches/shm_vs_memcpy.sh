#!/usr/bin/env bash
# WRITE 64 KiB x 256 descriptors between two processes on this host with the
# shm backend (cross-memory attach), against a single-thread memcpy of the
# same descriptors in one process, alternating in the same run; medians and
# their ratio are printed.
#
#   benches/shm_vs_memcpy.sh             # 5 rounds
#   ROUNDS=9 benches/shm_vs_memcpy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
ITERS=${ITERS:-500}
THREADS=${THREADS:-}  # shm copy threads; empty: the library default

bash ci/install-deps.sh bench >&2
cargo build --release --locked -p kvxfer-bench >&2
BENCH=target/release/kvxfer-bench
gbps() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'; }

mc=(); sh=()
for r in $(seq "$ROUNDS"); do
  m=$("$BENCH" --memcpy --block-size 64KiB --batch 256 --iters "$ITERS" --warmup 20 | gbps)
  s=$("$BENCH" --backend shm --op write --block-size 64KiB --batch 256 --iters "$ITERS" --warmup 20 ${THREADS:+--shm-copy-threads "$THREADS"} --json | gbps)
  mc+=("$m"); sh+=("$s")
  printf 'round %d: memcpy %.3f GB/s   shm %.3f GB/s   ratio %.3f\n' "$r" "$m" "$s" \
    "$(python3 -c "print($s/$m)")"
done
python3 - "${mc[*]}" "${sh[*]}" <<'PY'
import statistics, sys
mc = [float(x) for x in sys.argv[1].split()]
sh = [float(x) for x in sys.argv[2].split()]
a, b = statistics.median(mc), statistics.median(sh)
print(f"median: memcpy {a:.3f} GB/s   shm {b:.3f} GB/s   ratio {b/a:.3f} (target >= 0.5)")
PY
