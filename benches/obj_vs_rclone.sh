#!/usr/bin/env bash
# OBJ WRITE and READ of 64 objects x 16 MiB in 8 MiB parts, 8 HTTP requests
# in flight, against rclone with the same part size and concurrency
# (--transfers 8, one part of each upload at a time; downloads whole, 8 at
# once), on the same server: a one-node Ceph RADOS Gateway on loopback
# started here (ci/s3-server.sh, its OSD in memory). rclone's files live in
# /dev/shm, so neither side touches a disk. Alternating rounds; one line a
# round, then the medians and ratios.
#
#   benches/obj_vs_rclone.sh             # ROUNDS=5
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh bench >&2
cargo build --release --locked -p kvxfer-bench >&2
ROUNDS=${ROUNDS:-5}
s3=$(mktemp -d /tmp/kvxfer-s3-bench.XXXXXX)
files=$(mktemp -d /dev/shm/kvxfer-rclone.XXXXXX)
back=$(mktemp -d /dev/shm/kvxfer-rclone-back.XXXXXX)
out=$(mktemp)
trap 'bash ci/s3-server.sh stop "$s3"; rm -rf "$s3" "$files" "$back" "$out"' EXIT
# Each round writes 2 x 4 GiB (warm-up included); overwritten objects wait
# for the gateway's garbage collection.
KVXFER_S3_MEMSTORE_BYTES=$((8 << 30)) bash ci/s3-server.sh start "$s3" >&2
# shellcheck disable=SC1091
. "$s3/env"
export AWS_ENDPOINT_URL=$KVXFER_S3_ENDPOINT
export RCLONE_CONFIG_S3_TYPE=s3 RCLONE_CONFIG_S3_PROVIDER=Ceph \
  RCLONE_CONFIG_S3_ENDPOINT=$KVXFER_S3_ENDPOINT \
  RCLONE_CONFIG_S3_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID \
  RCLONE_CONFIG_S3_SECRET_ACCESS_KEY=$AWS_SECRET_ACCESS_KEY
# The AWS SDK in rclone refuses a CA bundle its HTTP transport cannot take
# (plain http here needs none).
unset AWS_CA_BUNDLE
for i in $(seq 0 63); do head -c $((16 << 20)) /dev/urandom > "$files/$i"; done
ours() { # op -> GB/s
  target/release/kvxfer-bench --memory "obj:$KVXFER_S3_BUCKET/kvxfer" --op "$1" \
    --block-size 16MiB --batch 64 --iters 3 --warmup 1 --json |
    python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'
}
rc() { # op -> GB/s (the same 1 GiB, 3 times, timed)
  local flags=(-q --transfers 8 --checkers 8 --s3-chunk-size 8M --s3-upload-cutoff 8M
    --s3-upload-concurrency 1 --s3-disable-checksum --ignore-checksum --no-check-dest
    --multi-thread-streams 0 --no-traverse)
  if [ "$1" = write ]; then
    rclone copy "$files" "s3:$KVXFER_S3_BUCKET/rclone" "${flags[@]}"
  else
    rclone copy "s3:$KVXFER_S3_BUCKET/rclone" "$back" "${flags[@]}"
  fi
  local t0 t1
  t0=$(date +%s.%N)
  for _ in 1 2 3; do
    if [ "$1" = write ]; then
      rclone copy "$files" "s3:$KVXFER_S3_BUCKET/rclone" "${flags[@]}"
    else
      rm -rf "${back:?}"/*
      rclone copy "s3:$KVXFER_S3_BUCKET/rclone" "$back" "${flags[@]}"
    fi
  done
  t1=$(date +%s.%N)
  python3 -c "print(3 * 64 * (16 << 20) / ($t1 - $t0) / 1e9)"
}
# READ needs the objects a WRITE made.
ours write >/dev/null
rc write >/dev/null
for r in $(seq "$ROUNDS"); do
  for op in write read; do
    if [ $((r % 2)) = 1 ]; then a=$(ours "$op"); b=$(rc "$op"); else b=$(rc "$op"); a=$(ours "$op"); fi
    echo "round $r $op kvxfer $a rclone $b" | tee -a "$out"
  done
done
python3 - "$out" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
for op in ("write", "read"):
    a = [float(r[4]) for r in rows if r[2] == op]
    b = [float(r[6]) for r in rows if r[2] == op]
    ratios = sorted(x / y for x, y in zip(a, b))
    print(f"{op}: kvxfer {statistics.median(a):.3f} GB/s, rclone {statistics.median(b):.3f} GB/s, "
          f"median of per-round ratios {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
PY
