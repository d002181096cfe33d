#!/usr/bin/env bash
# Two builds of kvxfer-bench side by side (before/after a change), with the
# references in the same rounds: TCP WRITE 64 KiB x 256 (iperf3 beside it),
# shm WRITE 64 KiB x 256 (memcpy beside it), the KV cache Llama-3-8B
# TP2 -> TP1 against raw agents. The builds' order flips every round. One
# line per round, then the medians and new/old; compare per-round ratios
# too, the machines are noisy.
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
# Both builds on the same arguments, reading the result with $1; the old
# one first in odd rounds. Prints "old|new".
both() {
  local f=$1 a b
  shift
  if [ $((r % 2)) = 1 ]; then
    a=$("$A" "$@" | $f); b=$("$B" "$@" | $f)
  else
    b=$("$B" "$@" | $f); a=$("$A" "$@" | $f)
  fi
  echo "$a|$b"
}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
port=$((20000 + RANDOM % 20000))
for r in $(seq "$ROUNDS"); do
  iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
  sleep 0.3
  ip=$(iperf3 -c 127.0.0.1 -p "$port" -t 3 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9)')
  wait
  tcp=(--backend tcp --op write --block-size 64KiB --batch 256 --iters 500 --warmup 10 --json)
  shm=(--backend shm --op write --block-size 64KiB --batch 256 --iters 500 --warmup 20 --json)
  kvx=(kv --model llama3-8b --ctx-tp 2 --gen-tp 1 --tokens 4096 --iters 5 --json)
  IFS='|' read -r ta tb <<<"$(both g "${tcp[@]}")"
  mc=$("$B" --memcpy --block-size 64KiB --batch 256 --iters 500 --warmup 20 | g)
  IFS='|' read -r sa sb <<<"$(both g "${shm[@]}")"
  IFS='|' read -r ka kb <<<"$(both kv "${kvx[@]}")"
  echo "round $r | iperf3 $ip | tcp old $ta new $tb | memcpy $mc | shm old $sa new $sb | kv (GB/s raw ratio) old $ka | new $kb" | tee -a "$out"
done
python3 - "$out" <<'PY'
import statistics, sys
rows = [l.split("|") for l in open(sys.argv[1])]
med = statistics.median
ip = med(float(r[1].split()[1]) for r in rows)
mc = med(float(r[3].split()[1]) for r in rows)
def pair(i):
    o = [float(r[i].split()[2]) for r in rows]; n = [float(r[i].split()[4]) for r in rows]
    return med(o), med(n)
to, tn = pair(2); so, sn = pair(4)
ko = med(float(r[5].split()[-3]) for r in rows); kn = med(float(r[6].split()[1]) for r in rows)
kro = med(float(r[5].split()[-1]) for r in rows); krn = med(float(r[6].split()[3]) for r in rows)
print(f"medians of {len(rows)} rounds:")
print(f"TCP 64 KiB x 256: old {to:.3f} new {tn:.3f} GB/s (new/old {tn / to:.3f}); vs iperf3 {ip:.3f}: old {to / ip:.3f} new {tn / ip:.3f}")
print(f"shm 64 KiB x 256: old {so:.3f} new {sn:.3f} GB/s (new/old {sn / so:.3f}); vs memcpy {mc:.3f}: old {so / mc:.3f} new {sn / mc:.3f}")
print(f"KV TP2 -> TP1: old {ko:.3f} new {kn:.3f} GB/s (new/old {kn / ko:.3f}); vs raw agents: old {kro:.3f} new {krn:.3f}")
PY
