#!/usr/bin/env bash
# Peers by name through etcd: resolve-and-connect (etcd lookup, side-channel
# descriptor fetch, connection, first 4 KiB write) to 1,000 new peers in
# turn, and 256 agents publishing at once, against a one-member etcd started
# here on loopback (Debian's etcd-server).
#
#   benches/etcd_names.sh            # PEERS=1000 BURST=256
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-deps.sh test >&2
cargo build --release --locked -p kvxfer-bench >&2
PEERS=${PEERS:-1000}
BURST=${BURST:-256}
dir=$(mktemp -d)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
client="127.0.0.1:$(port)"
peer="127.0.0.1:$(port)"
etcd --name n0 --data-dir "$dir/n0" \
  --listen-client-urls "http://$client" --advertise-client-urls "http://$client" \
  --listen-peer-urls "http://$peer" --initial-advertise-peer-urls "http://$peer" \
  --initial-cluster "n0=http://$peer" >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
trap 'kill $etcd_pid 2>/dev/null; wait $etcd_pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
  ETCDCTL_API=3 etcdctl --endpoints "$client" get x >/dev/null 2>&1 && break
  sleep 0.1
done
ulimit -n 65536 2>/dev/null || true
target/release/kvxfer-bench names --metadata "etcd://$client" --peers "$PEERS" --burst "$BURST"
