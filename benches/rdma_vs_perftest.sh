#!/usr/bin/env bash
# kvxfer's RDMA backend against perftest on the same soft-RoCE devices, in one
# boot of the guest (ci/rxe-guest): rxe0 (initiator) -> rxe1 (target).
#   WRITE bandwidth at 1 MiB   kvxfer-bench --op write  vs  ib_write_bw
#   READ bandwidth at 1 MiB    kvxfer-bench --op read   vs  ib_read_bw
#   8-byte WRITE latency       kvxfer-bench (batch 1)   vs  ib_write_lat
#   and the TCP fallback on the same workload, same guest (loopback).
# TCG emulation makes absolute figures meaningless: compare ratios only.
#
#   benches/rdma_vs_perftest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KVXFER_RDMA_GUEST:-}" != 1 ]; then
  cargo build --release --locked --bin kvxfer-bench >&2
  exec ci/rxe-guest --timeout 1800 bash benches/rdma_vs_perftest.sh
fi

B=target/release/kvxfer-bench
N=${ITERS:-50}
out=$(mktemp -d)
json() { python3 -c "import json,sys; d=json.loads(sys.stdin.readline()); print(d['$1'])"; }

perf_bw() { # tool size -> MB/s (average)
  timeout 300 "$1" -d rxe1 -x 0 -s "$2" -n "$N" >/dev/null 2>&1 &
  local srv=$!
  sleep 1
  timeout 300 "$1" -d rxe0 -x 0 -s "$2" -n "$N" 127.0.0.1 2>/dev/null | awk '$1 == "'"$2"'" {print $4}'
  wait "$srv" || true
}
perf_lat() { # -> typical (median) latency in us
  timeout 300 ib_write_lat -d rxe1 -x 0 -s 8 -n 500 >/dev/null 2>&1 &
  local srv=$!
  sleep 1
  timeout 300 ib_write_lat -d rxe0 -x 0 -s 8 -n 500 127.0.0.1 2>/dev/null | awk '$1 == "8" {print $5}'
  wait "$srv" || true
}
kx() { # backend op block batch -> json line
  KVXFER_RDMA_DEVICE=rxe0 timeout 600 "$B" --backend "$1" --op "$2" --block-size "$3" --batch "$4" \
    --iters "${5:-12}" --warmup 2 --target-rdma-device rxe1 --json
}

wbw=$(perf_bw ib_write_bw 1048576)
echo "ib_write_bw: $wbw MB/s" >&2
kw=$(kx rdma write 1MiB 4 | json gb_per_s)
echo "kvxfer write: $kw GB/s" >&2
rbw=$(perf_bw ib_read_bw 1048576)
echo "ib_read_bw: $rbw MB/s" >&2
kr=$(kx rdma read 1MiB 4 | json gb_per_s)
echo "kvxfer read: $kr GB/s" >&2
lat=$(perf_lat)
echo "ib_write_lat: $lat us" >&2
kl=$(kx rdma write 8 1 500 | json p50_us)
echo "kvxfer 8 B write p50: $kl us" >&2
kt=$(kx tcp write 1MiB 4 | json gb_per_s)
echo "kvxfer tcp: $kt GB/s" >&2
python3 - "$wbw" "$kw" "$rbw" "$kr" "$lat" "$kl" "$kt" <<'PY'
import sys
wbw, kw, rbw, kr, lat, kl, kt = (float(x) for x in sys.argv[1:])
kw_mb, kr_mb, kt_mb = kw * 1e3, kr * 1e3, kt * 1e3   # GB/s (10^9) -> MB/s (10^6)
# perftest reports MB/sec as 2^20 bytes/s.
wbw_mb, rbw_mb = wbw * 1.048576, rbw * 1.048576
print(f"WRITE 1 MiB : ib_write_bw {wbw_mb:9.1f} MB/s  kvxfer {kw_mb:9.1f} MB/s  ratio {kw_mb/wbw_mb:.3f} (target >= 0.95)")
print(f"READ  1 MiB : ib_read_bw  {rbw_mb:9.1f} MB/s  kvxfer {kr_mb:9.1f} MB/s  ratio {kr_mb/rbw_mb:.3f} (target >= 0.95)")
print(f"WRITE 8 B   : ib_write_lat {lat:8.2f} us    kvxfer {kl:8.2f} us (p50, submit to completion)  ratio {kl/lat:.3f} (target <= 1.1)")
print(f"TCP fallback, same workload, same guest (loopback): {kt_mb:9.1f} MB/s; RDMA/TCP {kw_mb/kt_mb:.2f}x")
PY
