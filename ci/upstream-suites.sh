#!/usr/bin/env bash
# NIXL's and Mooncake's own Python test suites, unmodified, against kvxfer's
# stand-ins (python -m kvxfer.shim). Not part of the test command: it needs
# the projects' sources and torch (a large download).
#   ci/upstream-suites.sh NIXL_CHECKOUT MOONCAKE_CHECKOUT
# NIXL_CHECKOUT: ai-dynamo/nixl (test/python/test_nixl_api.py, test_nixl_bindings.py);
# MOONCAKE_CHECKOUT: kvcache-ai/Mooncake (mooncake-wheel/tests/
# transfer_engine_{target,initiator_test}.py), run under P2PHANDSHAKE, an
# HTTP metadata server and etcd (when an etcd binary exists).
set -euo pipefail
nixl_src=$(realpath "$1")
mooncake_src=$(realpath "$2")
cd "$(dirname "$0")/.."
venv=target/upstream-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2" pytest pytest-timeout numpy torch
fi
"$venv/bin/maturin" build --quiet --release -m python/Cargo.toml -o target/wheels
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/kvxfer-*.whl
py="$PWD/$venv/bin/python"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "== NIXL test/python/test_nixl_api.py, test_nixl_bindings.py"
cp "$nixl_src/test/python/test_nixl_api.py" "$nixl_src/test/python/test_nixl_bindings.py" \
   "$nixl_src/test/python/conftest.py" "$work/"
(cd "$work" && PYTHONPATH=$("$py" -m kvxfer.shim path nixl) "$py" -m pytest -q -rs -p no:cacheprovider \
   test_nixl_api.py test_nixl_bindings.py)

echo "== NIXL examples/python, unmodified"
# GPU-only and GDS-hardware examples excepted: expanded_two_peers.py and
# basic_two_peers.py --use_cuda need GPUs; remote_storage_example needs
# GDS hardware or an NVMe-oF target. nixl_gds_example.py runs on host
# memory here (the GDS plugin is kvxfer's file storage).
ex="$nixl_src/examples/python"
nixl_py() { (cd "$work" && PYTHONPATH=$("$py" -m kvxfer.shim path nixl) timeout 300 "$py" "$@"); }
nixl_py "$ex/nixl_gds_example.py" "$work/gds.bin"
nixl_py "$ex/query_mem_example.py"
NIXL_ETCD_ENDPOINTS= nixl_py "$ex/partial_md_example.py" --init-port "$(port)" --target-port "$(port)"
# An etcd of this run's own (its client port in $cport), when there is an
# etcd binary.
etcd_up() {
  cport=$(port); local pport; pport=$(port)
  etcd --data-dir "$work/etcd-$cport" --listen-client-urls "http://127.0.0.1:$cport" \
    --advertise-client-urls "http://127.0.0.1:$cport" --listen-peer-urls "http://127.0.0.1:$pport" \
    --initial-advertise-peer-urls "http://127.0.0.1:$pport" --initial-cluster "default=http://127.0.0.1:$pport" \
    > "$work/etcd-$cport.log" 2>&1 &
  for _ in $(seq 100); do grep -q "ready to serve client requests" "$work/etcd-$cport.log" && break; sleep 0.1; done
}
if command -v etcd > /dev/null; then
  echo "-- partial_md_example.py --etcd (NIXL's etcd metadata exchange)"
  etcd_up
  NIXL_ETCD_ENDPOINTS="http://127.0.0.1:$cport" nixl_py "$ex/partial_md_example.py" --etcd
else
  echo "SKIPPED partial_md_example.py --etcd: no etcd binary (ci/install-deps.sh test installs it)"
fi
tport=$(port)
nixl_py "$ex/basic_two_peers.py" --mode target --ip 127.0.0.1 --port "$tport" &
target=$!
nixl_py "$ex/basic_two_peers.py" --mode initiator --ip 127.0.0.1 --port "$tport"
wait "$target"
echo "-- telemetry_reader.py against an agent's telemetry file"
mkdir -p "$work/telemetry"
(cd "$work" && PYTHONPATH=$("$py" -m kvxfer.shim path nixl) NIXL_TELEMETRY_ENABLE=1 \
   NIXL_TELEMETRY_DIR="$work/telemetry" "$py" -c "
import ctypes, os
from nixl._api import nixl_agent, nixl_agent_config
a = nixl_agent('GDSTester', nixl_agent_config(backends=[]))
a.create_backend('POSIX')
b = ctypes.create_string_buffer(4096)
a.register_memory([(ctypes.addressof(b), 4096, 0, '')], 'DRAM')
")
(cd "$work" && timeout 5 "$py" "$ex/telemetry_reader.py" --telemetry_path "$work/telemetry/GDSTester" 2>&1 \
   | tee "$work/telemetry.log" || true)
grep -q "agent_memory_registered" "$work/telemetry.log"

echo "== Mooncake mooncake-wheel/tests transfer engine"
cp "$mooncake_src/mooncake-wheel/tests/transfer_engine_target.py" \
   "$mooncake_src/mooncake-wheel/tests/transfer_engine_initiator_test.py" "$work/"
mooncake_run() {
  local server=$1 tport iport
  tport=$(port); iport=$(port)
  export PYTHONPATH MC_METADATA_SERVER=$server TARGET_SERVER_NAME=127.0.0.1:$tport INITIATOR_SERVER_NAME=127.0.0.1:$iport
  PYTHONPATH=$("$py" -m kvxfer.shim path mooncake)
  (cd "$work" && exec "$py" transfer_engine_target.py > "$work/target.log" 2>&1) &
  local target=$!
  for _ in $(seq 100); do grep -q "ready" "$work/target.log" 2>/dev/null && break; sleep 0.1; done
  (cd "$work" && "$py" transfer_engine_initiator_test.py)
  kill "$target"; wait "$target" 2>/dev/null || true
}
echo "-- P2PHANDSHAKE"
mooncake_run P2PHANDSHAKE
echo "-- HTTP metadata server"
mport=$(port)
"$py" -m kvxfer.mooncake_metadata --host 127.0.0.1 --port "$mport" &
mooncake_run "http://127.0.0.1:$mport/metadata"
if command -v etcd > /dev/null; then
  echo "-- etcd"
  etcd_up
  mooncake_run "127.0.0.1:$cport"
else
  echo "SKIPPED etcd: no etcd binary (ci/install-deps.sh test installs it)"
fi
echo "upstream suites: all passed"
