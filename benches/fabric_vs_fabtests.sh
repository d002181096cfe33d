#!/usr/bin/env bash
# The libfabric transport (backend `fabric`) against libfabric's own tools on
# the same provider and endpoint type, in one run, rounds alternating:
#   latency   fi_pingpong (libfabric-bin; 8-byte messages on an RDM endpoint,
#             half the round trip) and benches/fi_rma_loop.c -L -D (8-byte
#             fi_writes bounced the same way, completing on delivery as
#             kvxfer's do; one polling thread a side, no agent) against
#             `kvxfer-bench --backend fabric --pingpong` (8-byte WRITEs
#             bounced between two agents, half the round trip);
#   bandwidth benches/fi_rma_loop.c (fi_write / fi_read of 1 MiB, 16 in
#             flight, no agent, cycling through 32 blocks: the 32 MiB that
#             kvxfer's requests cover; WRITEs both as the provider completes
#             them by default and on delivery, as kvxfer's complete) against
#             `kvxfer-bench --backend fabric` (requests of 16 × 1 MiB, 2 in
#             flight), and kvxfer's own TCP transport on the same requests.
# Prints one JSON line per measurement, then the medians and their ratios.
#   PROV=tcp;ofi_rxm ROUNDS=3 benches/fabric_vs_fabtests.sh
# GUEST=1 runs it inside the soft-RoCE guest (ci/rxe-guest), by default on
# verbs;ofi_rxm (registration cache off, as the transport requires;
# FI_UNIVERSE_SIZE=64 so that ofi_rxm's completion queue fits rxe's):
#   GUEST=1 ROUNDS=3 benches/fabric_vs_fabtests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KVXFER_RDMA_GUEST:-}" != 1 ]; then
  bash ci/install-deps.sh bench >/dev/null
  cargo build --release --locked -q -p kvxfer-bench
  mkdir -p target/fabric-bench
  gcc -O2 -o target/fabric-bench/fi_rma_loop benches/fi_rma_loop.c -lfabric
  if [ "${GUEST:-}" = 1 ]; then
    exec ci/rxe-guest --timeout 2400 env PROV="${PROV:-verbs;ofi_rxm}" ROUNDS="${ROUNDS:-3}" \
      FI_MR_CACHE_MAX_COUNT=0 FI_UNIVERSE_SIZE=64 bash benches/fabric_vs_fabtests.sh
  fi
fi
prov=${PROV:-tcp;ofi_rxm}
# The ping-pong's thread waiting for the answer yields its CPU every 1024
# polls on the host, where a provider moving the target's data in the
# target process (tcp, shm) needs the cores it would spin on; 2^16 in the
# guest, where a yield under TCG costs more than the round trip.
if [ "${KVXFER_RDMA_GUEST:-}" = 1 ]; then spin=65536; else spin=1024; fi
spin=${SPIN_YIELD:-$spin}
rounds=${ROUNDS:-3}
bench=target/release/kvxfer-bench
loop=target/fabric-bench/fi_rma_loop
out=$(mktemp)
trap 'rm -f "$out"' EXIT
port=$((20000 + RANDOM % 20000))
# Waits until a server listens on TCP port $1 (a slow guest takes a while).
listening() { for _ in $(seq 200); do ss -ltn 2>/dev/null | grep -q ":$1 " && return 0; sleep 0.05; done; return 1; }
for r in $(seq "$rounds"); do
  port=$((port + 1))
  fi_pingpong -p "$prov" -e rdm -S 8 -I 5000 -B "$port" >/dev/null 2>&1 &
  srv=$!
  listening "$port" || sleep 1
  us=$(fi_pingpong -p "$prov" -e rdm -S 8 -I 5000 -P "$port" 127.0.0.1 | awk '$1 == 8 {print $7}')
  wait "$srv" || true
  echo "{\"round\":$r,\"what\":\"fi_pingpong\",\"us\":$us}" | tee -a "$out"
  port=$((port + 1))
  "$loop" -s "$port" -p "$prov" -L -D -n 5000 >/dev/null 2>&1 &
  srv=$!
  listening "$port" || sleep 1
  "$loop" -c 127.0.0.1 "$port" -p "$prov" -L -D -n 5000 |
    sed "s/^{/{\"round\":$r,\"what\":\"fi_rma_loop\",/" | tee -a "$out"
  wait "$srv" || true
  KVXFER_FABRIC_PROVIDER="$prov" "$bench" --backend fabric --pingpong --iters 5000 --spin-yield "$spin" --json |
    sed "s/^{/{\"round\":$r,\"what\":\"kvxfer_fabric_pingpong\",/" | tee -a "$out"
  for op in write write_dc read; do
    case $op in write) flag= ;; write_dc) flag=-D ;; read) flag=-r ;; esac
    port=$((port + 1))
    "$loop" -s "$port" -p "$prov" -b 32 >/dev/null 2>&1 &
    srv=$!
    listening "$port" || sleep 1
    "$loop" -c 127.0.0.1 "$port" -p "$prov" -z 1048576 -n 400 -d 16 -b 32 $flag |
      sed "s/^{/{\"round\":$r,\"what\":\"fi_rma_loop\",/" | tee -a "$out"
    wait "$srv" || true
    [ "$op" = write_dc ] && continue
    for b in fabric tcp; do
      KVXFER_FABRIC_PROVIDER="$prov" "$bench" --backend "$b" --op "$op" --block-size 1MiB \
        --batch 16 --iters 50 --depth 2 --json |
        sed "s/^{/{\"round\":$r,\"what\":\"kvxfer_$b\",/" | tee -a "$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(what, key, op=None):
    v = [r[key] for r in rows if r["what"] == what and (op is None or r.get("op") == op)]
    return statistics.median(v)
def loop(op, dc, key="gb_per_s"):
    v = [r[key] for r in rows
         if r["what"] == "fi_rma_loop" and r["op"] == op and r.get("delivery_complete", 0) == dc]
    return statistics.median(v)
lat_fi, lat_kv = med("fi_pingpong", "us"), med("kvxfer_fabric_pingpong", "p50_us")
lat_wr = loop("pingpong", 1, "us")
print(f"8-byte latency (half round trip): fi_pingpong {lat_fi:.2f} us, fi_write on delivery {lat_wr:.2f} us, "
      f"kvxfer fabric {lat_kv:.2f} us, ratio {lat_kv / lat_fi:.3f} ({lat_kv / lat_wr:.3f} to fi_write)")
for op in ("write", "read"):
    fi, fab, tcp = loop(op, 0), med("kvxfer_fabric", "gb_per_s", op), med("kvxfer_tcp", "gb_per_s", op)
    line = f"1 MiB {op}: fi_rma_loop {fi:.3f} GB/s, kvxfer fabric {fab:.3f} GB/s ({fab / fi:.3f}x)"
    if op == "write":
        dc = loop(op, 1)
        line += f"; fi_rma_loop on delivery {dc:.3f} GB/s ({fab / dc:.3f}x)"
    print(f"{line}; kvxfer tcp {tcp:.3f} GB/s (fabric/tcp {fab / tcp:.3f})")
PY
