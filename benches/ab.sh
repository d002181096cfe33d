#!/usr/bin/env bash
# Two builds of kvxfer-bench side by side (before/after a change), with the
# references in the same rounds: TCP WRITE 64 KiB x 256 (iperf3 beside it),
# shm WRITE 64 KiB x 256 (memcpy beside it), the KV cache Llama-3-8B
# TP2 -> TP1 against raw agents. One line per round; compare per-round
# ratios, the machines are noisy.
#
#   benches/ab.sh OLD_BENCH NEW_BENCH          # ROUNDS=5
# e.g. git worktree add /tmp/base REV && (cd /tmp/base && cargo build --release -p kvxfer-bench)
#      benches/ab.sh /tmp/base/target/release/kvxfer-bench target/release/kvxfer-bench
set -euo pipefail
A=$1; B=$2; ROUNDS=${ROUNDS:-5}
cd "$(dirname "$0")/.."
bash ci/install-deps.sh bench >&2
g() { python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'; }
kv() { python3 -c 'import json,sys
for l in sys.stdin:
    d = json.loads(l)
    if d.get("kind") == "kv":
        print(d["gb_per_s"], d["raw_gb_per_s"], d["ratio"]); break'; }
port=$((20000 + RANDOM % 20000))
for r in $(seq "$ROUNDS"); do
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  sleep 0.3
  ip=$(iperf3 -c 127.0.0.1 -p "$port" -t 3 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9)')
  wait
  tcp=(--backend tcp --op write --block-size 64KiB --batch 256 --iters 500 --warmup 10 --json)
  shm=(--backend shm --op write --block-size 64KiB --batch 256 --iters 500 --warmup 20 --json)
  kvx=(kv --model llama3-8b --ctx-tp 2 --gen-tp 1 --tokens 4096 --iters 5 --json)
  ta=$("$A" "${tcp[@]}" | g); tb=$("$B" "${tcp[@]}" | g)
  mc=$("$B" --memcpy --block-size 64KiB --batch 256 --iters 500 --warmup 20 | g)
  sa=$("$A" "${shm[@]}" | g); sb=$("$B" "${shm[@]}" | g)
  ka=$("$A" "${kvx[@]}" | kv); kb=$("$B" "${kvx[@]}" | kv)
  echo "round $r | iperf3 $ip | tcp old $ta new $tb | memcpy $mc | shm old $sa new $sb | kv (GB/s raw ratio) old $ka | new $kb"
done
