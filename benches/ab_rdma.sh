#!/usr/bin/env bash
# Two builds of kvxfer-bench side by side in one boot of the soft-RoCE guest:
# ib_write_lat and both builds' two-process 8-byte ping-pong, alternating
# (order reversed every other round), then 1 MiB WRITE and READ streams of
# each beside ib_write_bw and ib_read_bw.
# The binaries must lie inside this tree (the guest sees it), e.g. under
# target/. TCG: compare within the boot only; runs land in two modes about
# 2x apart, so compare the fast-mode medians too.
#
#   benches/ab_rdma.sh target/ab/old-bench target/release/kvxfer-bench   # LAT_ROUNDS=15 ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${KVXFER_RDMA_GUEST:-}" != 1 ]; then
  exec ci/rxe-guest --timeout 2400 env LAT_ROUNDS="${LAT_ROUNDS:-15}" ROUNDS="${ROUNDS:-3}" bash benches/ab_rdma.sh "$@"
fi
A=$1; B=$2
json() { sed -n 's/.*"'"$1"'":\([-+0-9.eE]*\).*/\1/p' | head -n 1; }
listening() { for _ in $(seq 100); do ss -ltn 2>/dev/null | grep -q ':18515 ' && return 0; sleep 0.05; done; return 1; }
perf_bw() { # tool -> MB/s at 1 MiB (average)
  local v= t s
  for t in 1 2 3; do
    timeout 300 "$1" -d rxe1 -x 0 -s 1048576 -n 200 >/dev/null 2>&1 &
    s=$!
    listening || sleep "$t"
    v=$(timeout 300 "$1" -d rxe0 -x 0 -s 1048576 -n 200 127.0.0.1 2>/dev/null | awk '$1 == 1048576 {print $4}')
    wait "$s" || true
    [ -n "$v" ] && break
  done
  echo "$v"
}
lat() {
  local v= t s
  for t in 1 2 3; do
    timeout 300 ib_write_lat -d rxe1 -x 0 -s 8 -n 1000 >/dev/null 2>&1 &
    s=$!
    listening || sleep "$t"
    v=$(timeout 300 ib_write_lat -d rxe0 -x 0 -s 8 -n 1000 127.0.0.1 2>/dev/null | awk '$1 == 8 {print $5}')
    wait "$s" || true
    [ -n "$v" ] && break
  done
  echo "$v"
}
pp() { KVXFER_RDMA_DEVICE=rxe0 timeout 600 "$1" --backend rdma --pingpong --iters 1000 --warmup 20 --target-rdma-device rxe1 --idle-secs 0 --two-process --json | json p50_us; }
bw() { KVXFER_RDMA_DEVICE=rxe0 timeout 600 "$1" --backend rdma --op "${2:-write}" --block-size 1MiB --batch 16 --iters 13 --warmup 2 --target-rdma-device rxe1 --depth 4 --json | json gb_per_s; }
for r in $(seq "$LAT_ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then l=$(lat); a=$(pp "$A"); b=$(pp "$B"); else b=$(pp "$B"); a=$(pp "$A"); l=$(lat); fi
  echo "latency round $r: ib_write_lat $l us, old $a us, new $b us"
done
for r in $(seq "$ROUNDS"); do
  # Order reversed every other round, as for the latency.
  if [ $((r % 2)) = 1 ]; then
    ow=$(bw "$A"); nw=$(bw "$B"); orr=$(bw "$A" read); nr=$(bw "$B" read)
  else
    nw=$(bw "$B"); ow=$(bw "$A"); nr=$(bw "$B" read); orr=$(bw "$A" read)
  fi
  echo "bandwidth round $r: write: ib_write_bw $(perf_bw ib_write_bw) MB/s, old $ow GB/s, new $nw GB/s;" \
    "read: ib_read_bw $(perf_bw ib_read_bw) MB/s, old $orr GB/s, new $nr GB/s"
done
