#!/usr/bin/env bash
# Storage WRITE and READ, 1 MiB x 64, against fio with the io_uring engine,
# O_DIRECT, 1 MiB blocks and queue depth 64, on the same file and the same
# block device (a loop device over a file, made here), alternating rounds.
# Prints one line per round and the median ratios. The `peer-file` rows
# move the same data to a peer agent's file, through that agent over TCP
# on loopback (`--storage-peer`), against the same fio figure.
#
#   benches/storage_vs_fio.sh            # ROUNDS=5, DIR=target/storage-bench
# Needs root for the loop device (the BLK rows are skipped without one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh bench >&2
cargo build --release --locked -p kvxfer-bench >&2
ROUNDS=${ROUNDS:-5}
DIR=${DIR:-target/storage-bench}
mkdir -p "$DIR"
file="$DIR/data"
img="$DIR/blk.img"
truncate -s 256M "$img"
lo=$(losetup -f --show "$img" 2>/dev/null || true)
trap '[ -n "$lo" ] && losetup -d "$lo"; rm -f "$img" "$file"' EXIT
[ -n "$lo" ] || echo "no loop device (losetup failed): BLK rows skipped" >&2
ours() { # op memory [flag] -> GB/s
  target/release/kvxfer-bench --memory "$2" ${3:-} --op "$1" --block-size 1MiB --batch 64 \
    --iters 40 --warmup 4 --json | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'
}
fio_bw() { # op path -> GB/s
  fio --name=kvxfer --filename="$2" --rw="$1" --bs=1M --iodepth=64 --ioengine=io_uring \
    --direct=1 --size=64M --loops=40 --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(j[sys.argv[1]]["bw_bytes"] / 1e9)' "$1"
}
# The file exists at full size before fio's first read.
target/release/kvxfer-bench --memory "file:$file" --block-size 1MiB --batch 64 --iters 2 --warmup 0 --json >/dev/null
out=$(mktemp)
for r in $(seq "$ROUNDS"); do
  for op in write read; do
    if [ $((r % 2)) = 1 ]; then a=$(ours "$op" "file:$file"); b=$(fio_bw "$op" "$file");
    else b=$(fio_bw "$op" "$file"); a=$(ours "$op" "file:$file"); fi
    echo "round $r file $op kvxfer $a fio $b" | tee -a "$out"
    if [ $((r % 2)) = 1 ]; then a=$(ours "$op" "file:$file" --storage-peer); b=$(fio_bw "$op" "$file");
    else b=$(fio_bw "$op" "$file"); a=$(ours "$op" "file:$file" --storage-peer); fi
    echo "round $r peer-file $op kvxfer $a fio $b" | tee -a "$out"
    if [ -n "$lo" ]; then
      if [ $((r % 2)) = 1 ]; then a=$(ours "$op" "blk:$lo"); b=$(fio_bw "$op" "$lo");
      else b=$(fio_bw "$op" "$lo"); a=$(ours "$op" "blk:$lo"); fi
      echo "round $r blk $op kvxfer $a fio $b" | tee -a "$out"
    fi
  done
done
python3 - "$out" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    w = line.split()
    rows.setdefault((w[2], w[3]), []).append((float(w[5]), float(w[7])))
for (kind, op), v in sorted(rows.items()):
    r = [a / b for a, b in v]
    print(f"{kind} {op}: kvxfer {statistics.median(a for a, _ in v):.3f} GB/s, fio {statistics.median(b for _, b in v):.3f} GB/s, "
          f"median ratio {statistics.median(r):.3f} (spread {min(r):.2f}-{max(r):.2f})")
EOF
rm -f "$out"
