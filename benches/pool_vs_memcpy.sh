#!/usr/bin/env bash
# Shared pools (#64): WRITE and READ between two processes on this host
# with the shm backend, the target's memory a shared pool that the
# initiator maps (`kvxfer-bench --shared-pool`), against a single-thread
# memcpy of the same descriptors in one process and against the
# cross-memory path (the same target memory, not shared), alternating in
# the same run. Two shapes: 64 KiB x 256 and 4 MiB x 16. Medians of the
# per-round ratios are printed.
#
#   benches/pool_vs_memcpy.sh             # 5 rounds
#   ROUNDS=9 benches/pool_vs_memcpy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
ITERS=${ITERS:-300}

bash ci/install-deps.sh bench >&2
cargo build --release --locked -p kvxfer-bench >&2
BENCH=target/release/kvxfer-bench
gbps() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'; }

out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq "$ROUNDS"); do
  for shape in "64KiB 256" "4MiB 16"; do
    set -- $shape
    m=$("$BENCH" --memcpy --block-size "$1" --batch "$2" --iters "$ITERS" --warmup 20 | gbps)
    for op in write read; do
      c=$("$BENCH" --backend shm --op "$op" --block-size "$1" --batch "$2" --iters "$ITERS" --warmup 20 --json | gbps)
      p=$("$BENCH" --backend shm --shared-pool --op "$op" --block-size "$1" --batch "$2" --iters "$ITERS" --warmup 20 --json | gbps)
      printf 'round %d %sx%s %-5s memcpy %7.3f  cross-memory %7.3f  pool %7.3f GB/s  pool/memcpy %.3f  cross-memory/memcpy %.3f\n' \
        "$r" "$1" "$2" "$op" "$m" "$c" "$p" "$(python3 -c "print($p/$m)")" "$(python3 -c "print($c/$m)")"
      echo "$1x$2 $op $m $c $p" >> "$out"
    done
  done
done
python3 - "$out" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    shape, op, m, c, p = line.split()
    rows[(shape, op)].append((float(m), float(c), float(p)))
print("median of per-round ratios (targets: pool/memcpy >= 0.8 at 64KiBx256, >= 1.0 at 4MiBx16)")
for (shape, op), v in rows.items():
    pm = statistics.median(p / m for m, c, p in v)
    cm = statistics.median(c / m for m, c, p in v)
    lo, hi = min(p / m for m, c, p in v), max(p / m for m, c, p in v)
    print(f"{shape:10s} {op:5s} memcpy {statistics.median(m for m,_,_ in v):7.3f} GB/s  "
          f"pool {statistics.median(p for _,_,p in v):7.3f} GB/s  pool/memcpy {pm:.3f} ({lo:.3f}-{hi:.3f})  "
          f"cross-memory/memcpy {cm:.3f}")
PY
