#!/usr/bin/env bash
# The GPU check, in two halves:
#
#   ci/gpu-check.sh build   here (no GPU needed): builds the GPU test binary
#                           (with the libfabric transport)
#                           and kvxfer-bench with --release, strips them and
#                           puts them in .gpu/ (git-ignored), to be carried
#                           to the GPU machine;
#   ci/gpu-check.sh run     on the GPU machine (no Rust toolchain there):
#                           the probe (nvidia-smi, driver, RDMA devices, the
#                           driver's dma-buf export), the VRAM suite of
#                           tests/gpu.rs against the real driver, then the
#                           benchmarks of the GPU issue side by side (DRAM vs
#                           VRAM over TCP; CUDA IPC vs a device copy; the KV
#                           cache with GPU pools over IPC vs raw); everything
#                           goes to $OUT (or /tmp/gpu-check), with a
#                           summary.txt.
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
  bin=$(cargo test --locked --release --features fabric --test gpu --no-run 2>&1 | grep -o 'target/release/deps/gpu-[0-9a-f]*' | tail -n1)
  [ -n "$bin" ] || { echo "no test binary built" >&2; exit 1; }
  cp "$bin" .gpu/gpu-tests
  cargo build --locked --release -p kvxfer-bench
  cp target/release/kvxfer-bench .gpu/kvxfer-bench
  strip .gpu/gpu-tests .gpu/kvxfer-bench
  # The binaries load libfabric at run time (and it links libibverbs,
  # librdmacm, psm...), which the GPU machine's image does not have: it
  # and the shared libraries beside glibc travel in .gpu/lib.
  rm -rf .gpu/lib && mkdir -p .gpu/lib
  fabric=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
  [ -n "$fabric" ] && cp -L "$fabric" .gpu/lib/
  ldd .gpu/kvxfer-bench .gpu/gpu-tests $fabric | awk '/=> \//{print $3}' |
    grep -v -E '/(libc|libm|libgcc_s|libpthread|libdl|ld-linux[^/]*)\.so' | sort -u |
    xargs -r -I{} cp -L {} .gpu/lib/
  ls -l .gpu
  ;;
run)
  out=${OUT:-/tmp/gpu-check}
  export LD_LIBRARY_PATH="$PWD/.gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  mkdir -p "$out"
  {
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi
    echo "== GPUs"; nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv
    echo "== RDMA devices"; ls -l /dev/infiniband 2>&1; ibv_devices 2>&1
    echo "== libcuda"; ldconfig -p 2>&1 | grep -E 'libcuda|libibverbs|libnvidia-ml' ; ls /usr/local/nvidia/lib64 2>&1 | head -20
    echo "== carried libraries resolve"; ldd .gpu/kvxfer-bench .gpu/lib/libfabric.so.1 2>&1 | grep -E 'not found|fabric'
    echo "== nvidia modules"; cat /proc/driver/nvidia/version 2>&1; ls /sys/module | grep -i -E 'nvidia|peermem' 2>&1
  } > "$out/probe.txt" 2>&1
  [ -x .gpu/gpu-tests ] || { echo "missing .gpu/gpu-tests: run 'ci/gpu-check.sh build' here and carry .gpu" | tee "$out/summary.txt"; exit 1; }
  timeout 150 .gpu/gpu-tests --test-threads 1 --nocapture > "$out/tests.txt" 2>&1
  rc=$?
  b=.gpu/kvxfer-bench
  # With .gpu/kvxfer-bench-base (an earlier build, carried too), each line
  # runs with both binaries in turn: before and after, side by side.
  bins="$b"
  [ -x .gpu/kvxfer-bench-base ] && bins="$b .gpu/kvxfer-bench-base"
  {
    # Side by side, one run each, in this order (the GPU issue's targets).
    for mem in dram vram; do
      for x in $bins; do
        echo "# $x"
        timeout 40 $x --backend tcp --memory $mem --block-size 64KiB --batch 256 --iters 200 --json
        timeout 40 $x --backend tcp --memory $mem --block-size 1MiB --batch 64 --iters 50 --json
        # READs (the serving frameworks' pull): the target's answers staged.
        timeout 40 $x --backend tcp --op read --memory $mem --block-size 64KiB --batch 256 --iters 200 --json
      done
    done
    timeout 40 $b --memcpy --memory vram --block-size 64MiB --batch 1 --iters 50
    for x in $bins; do
      echo "# $x"
      timeout 40 $x --backend shm --memory vram --block-size 64MiB --batch 1 --iters 50 --json
      # The same with four requests in flight (as perftest keeps its work
      # requests outstanding): the control messages of one overlap the
      # copies of others.
      timeout 40 $x --backend shm --memory vram --block-size 64MiB --batch 1 --iters 50 --depth 4 --json
      timeout 60 $x kv --backend shm --memory vram --model llama3-8b --ctx-tp 2 --gen-tp 1 --tokens 4096 --verify --json
      timeout 60 $x kv --backend tcp --memory vram --model llama3-8b --ctx-tp 2 --gen-tp 1 --tokens 4096 --json
    done
    # What one small request costs on the shm path, host memory and GPU
    # memory (the fixed part of every request above: grant, copy, commit).
    for mem in dram vram; do
      timeout 60 $b --backend shm --memory $mem --block-size 4KiB --batch 1 --iters 2000 --json
    done
    # The piece-copy kernel off (KVXFER_CUDA_COPY_KERNEL=0): the driver's
    # batched copies instead.
    KVXFER_CUDA_COPY_KERNEL=0 timeout 60 $b kv --backend shm --memory vram --model llama3-8b --ctx-tp 2 --gen-tp 1 --tokens 4096 --json
  } > "$out/bench.txt" 2>&1
  {
    echo "gpu suite exit status: $rc"
    grep -E '^(GPU-PROBE|SKIPPED)|test result|FAILED|panicked' "$out/tests.txt"
    grep -o 'GPU-PROBE.*' "$out/tests.txt"
    grep -o 'SKIPPED.*' "$out/tests.txt"
    grep -E '^test .* \.\.\. ' "$out/tests.txt" | sed 's/^/  /'
    echo "== bench"; cat "$out/bench.txt"
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
