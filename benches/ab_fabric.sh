#!/usr/bin/env bash
# Two builds of kvxfer-bench side by side on the libfabric transport's
# 8-byte ping-pong (half round trip, p50), alternating builds each round,
# with fi_pingpong on the same provider in the same round. Prints one line
# per round, then the medians and new/old.
#   benches/ab_fabric.sh OLD_BENCH NEW_BENCH           # PROV=tcp;ofi_rxm ROUNDS=5
#   GUEST=1 benches/ab_fabric.sh OLD_BENCH NEW_BENCH   # verbs;ofi_rxm in the soft-RoCE guest
# (paths relative to the repository; the guest sees it at the same place).
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1; B=$2
if [ "${KVXFER_RDMA_GUEST:-}" != 1 ]; then
  bash ci/install-deps.sh bench >/dev/null
  if [ "${GUEST:-}" = 1 ]; then
    exec ci/rxe-guest --timeout 2400 env PROV="${PROV:-verbs;ofi_rxm}" ROUNDS="${ROUNDS:-5}" \
      FI_MR_CACHE_MAX_COUNT=0 FI_UNIVERSE_SIZE=64 bash benches/ab_fabric.sh "$A" "$B"
  fi
fi
prov=${PROV:-tcp;ofi_rxm}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
listening() { for _ in $(seq 200); do ss -ltn 2>/dev/null | grep -q ":$1 " && return 0; sleep 0.05; done; return 1; }
p50() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["p50_us"])'; }
port=$((20000 + RANDOM % 20000))
for r in $(seq "${ROUNDS:-5}"); do
  port=$((port + 1))
  fi_pingpong -p "$prov" -e rdm -S 8 -I 2000 -B "$port" >/dev/null 2>&1 &
  srv=$!
  listening "$port" || sleep 1
  fi=$(fi_pingpong -p "$prov" -e rdm -S 8 -I 2000 -P "$port" 127.0.0.1 | awk '$1 == 8 {print $7}')
  wait "$srv" || true
  old=$(KVXFER_FABRIC_PROVIDER="$prov" "$A" --backend fabric --pingpong --iters 2000 --json | p50)
  new=$(KVXFER_FABRIC_PROVIDER="$prov" "$B" --backend fabric --pingpong --iters 2000 --json | p50)
  echo "round $r $prov fi_pingpong $fi old $old new $new" | tee -a "$out"
done
python3 - "$out" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
med = lambda k: statistics.median(float(r[r.index(k) + 1]) for r in rows)
fi, old, new = med("fi_pingpong"), med("old"), med("new")
print(f"medians: fi_pingpong {fi:.2f} us, old {old:.2f} us, new {new:.2f} us, new/old {new / old:.3f}, new/fi_pingpong {new / fi:.3f}")
PY
