#!/usr/bin/env bash
# WRITE 64 KiB x 256 descriptors between two processes on loopback with
# kvxfer's TCP backend, against one iperf3 stream, measured alternately in
# the same run (ROUNDS rounds each; medians and their ratio printed).
#
#   benches/tcp_vs_iperf3.sh            # 5 rounds
#   ROUNDS=9 SECONDS_PER_RUN=5 benches/tcp_vs_iperf3.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
SECS=${SECONDS_PER_RUN:-4}
STREAMS=${STREAMS:-}  # empty: the library default

bash ci/install-deps.sh bench >&2
cargo build --release --locked -p kvxfer-bench >&2
BENCH=target/release/kvxfer-bench

port=$((20000 + RANDOM % 20000))
iperf_once() {
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.3
  iperf3 -c 127.0.0.1 -p "$port" -t "$SECS" -J | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["end"]["sum_received"]["bits_per_second"] / 8 / 1e9)'
  wait "$srv" || true
}
# About SECS seconds of 16 MiB requests at ~3 GB/s.
iters=$((SECS * 180))
kvxfer_once() {
  "$BENCH" --backend tcp --op write --block-size 64KiB --batch 256 \
    --iters "$iters" --warmup 10 ${STREAMS:+--streams "$STREAMS"} --json | python3 -c '
import json, sys
print(json.loads(sys.stdin.readline())["gb_per_s"])'
}

ip=(); kx=()
for r in $(seq "$ROUNDS"); do
  i=$(iperf_once); k=$(kvxfer_once)
  ip+=("$i"); kx+=("$k")
  printf 'round %d: iperf3 %.3f GB/s   kvxfer %.3f GB/s   ratio %.3f\n' "$r" "$i" "$k" \
    "$(python3 -c "print($k/$i)")"
done
python3 - "${ip[*]}" "${kx[*]}" <<'PY'
import statistics, sys
ip = [float(x) for x in sys.argv[1].split()]
kx = [float(x) for x in sys.argv[2].split()]
mi, mk = statistics.median(ip), statistics.median(kx)
print(f"median: iperf3 {mi:.3f} GB/s   kvxfer {mk:.3f} GB/s   ratio {mk/mi:.3f} (target >= 0.85)")
PY
