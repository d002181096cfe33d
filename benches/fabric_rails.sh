#!/usr/bin/env bash
# The libfabric transport with one rail against RAILS rails per agent (the
# domain DOM named RAILS times: that many endpoints on it), rounds
# alternating, WRITE and READ of 1 MiB blocks, 16 a request, 2 requests in
# flight. Prints one line per run, then the medians and rails/one.
#   benches/fabric_rails.sh [BENCH]     # PROV=tcp;ofi_rxm DOM=lo RAILS=2 ROUNDS=5
#   PROV=shm DOM=shm benches/fabric_rails.sh
# BENCH defaults to target/release/kvxfer-bench (built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=${1:-target/release/kvxfer-bench}
[ -x "$bench" ] || cargo build --release --locked -q -p kvxfer-bench
export KVXFER_FABRIC_PROVIDER="${PROV:-tcp;ofi_rxm}"
dom=${DOM:-lo}
rails=${RAILS:-2}
many=$(printf "%s," $(for _ in $(seq "$rails"); do echo "$dom"; done))
many=${many%,}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
gbps() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'; }
for r in $(seq "${ROUNDS:-5}"); do
  for op in write read; do
    for d in "$dom" "$many"; do
      g=$(KVXFER_FABRIC_DOMAIN=$d timeout 300 "$bench" --backend fabric --op "$op" \
        --block-size 1MiB --batch 16 --iters 100 --depth 2 --json | gbps)
      echo "$r $op $d $g" | tee -a "$out"
    done
  done
done
python3 - "$out" "$dom" "$many" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
one, many = sys.argv[2], sys.argv[3]
for op in ("write", "read"):
    m = {d: statistics.median(float(g) for _, o, dd, g in rows if o == op and dd == d) for d in (one, many)}
    print(f"{op}: one rail ({one}) {m[one]:.3f} GB/s, rails ({many}) {m[many]:.3f} GB/s, ratio {m[many] / m[one]:.3f}")
EOF
