#!/usr/bin/env bash
# The GPU check, in two halves:
#
#   ci/gpu-check.sh build   here (no GPU needed): builds the GPU test binary
#                           with --release, strips it and puts it in .gpu/
#                           (git-ignored), to be carried to the GPU machine;
#   ci/gpu-check.sh run     on the GPU machine (no Rust toolchain there):
#                           the probe (nvidia-smi, driver, RDMA devices, the
#                           driver's dma-buf export), then the VRAM suite of
#                           tests/gpu.rs against the real driver; everything
#                           goes to $OUT (or /tmp/gpu-check), with a
#                           summary.txt that names each test's outcome.
#
# With the device tool: run `ci/gpu-check.sh build` here, then one call with
# carry [".gpu"] and the command `bash ci/gpu-check.sh run`.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
  set -e
  bash ci/install-deps.sh build
  mkdir -p .gpu
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  bin=$(cargo test --locked --release --test gpu --no-run 2>&1 | grep -o 'target/release/deps/gpu-[0-9a-f]*' | tail -n1)
  [ -n "$bin" ] || { echo "no test binary built" >&2; exit 1; }
  cp "$bin" .gpu/gpu-tests
  strip .gpu/gpu-tests
  ls -l .gpu
  ;;
run)
  out=${OUT:-/tmp/gpu-check}
  mkdir -p "$out"
  {
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi
    echo "== GPUs"; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv
    echo "== RDMA devices"; ls -l /dev/infiniband 2>&1; ibv_devices 2>&1
    echo "== nvidia modules"; cat /proc/driver/nvidia/version 2>&1; ls /sys/module | grep -i -E 'nvidia|peermem' 2>&1
  } > "$out/probe.txt" 2>&1
  [ -x .gpu/gpu-tests ] || { echo "missing .gpu/gpu-tests: run 'ci/gpu-check.sh build' here and carry .gpu" | tee "$out/summary.txt"; exit 1; }
  timeout 300 .gpu/gpu-tests --test-threads 1 --nocapture > "$out/tests.txt" 2>&1
  rc=$?
  {
    echo "gpu suite exit status: $rc"
    grep -E '^(GPU-PROBE|SKIPPED)|test result|FAILED|panicked' "$out/tests.txt"
    grep -o 'GPU-PROBE.*' "$out/tests.txt"
    grep -o 'SKIPPED.*' "$out/tests.txt"
    grep -E '^test .* \.\.\. ' "$out/tests.txt" | sed 's/^/  /'
    head -n 30 "$out/probe.txt"
  } > "$out/summary.txt" 2>&1
  cat "$out/summary.txt"
  exit $rc
  ;;
*)
  echo "usage: $0 build|run" >&2
  exit 2
  ;;
esac
