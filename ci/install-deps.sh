#!/usr/bin/env bash
# Installs the Debian packages a kvxfer job needs; idempotent.
#   ci/install-deps.sh build   # compiler toolchain pieces
#   ci/install-deps.sh bench   # + iperf3, fio, python3 for the comparison scripts
#   ci/install-deps.sh test    # + g++, valgrind for the C/C++ ABI tests; python3 and
#                              #   its venv module for the Python package's tests;
#                              #   util-linux and mount (losetup, mount -t tmpfs) for
#                              #   the storage tests' loop devices and full disks;
#                              #   etcd-server and etcd-client (etcdctl) for the
#                              #   metadata-store tests' own etcd clusters, and
#                              #   iproute2 for their network namespaces,
#                              #   openssl for their TLS certificates;
#                              #   ceph-mon, ceph-osd, radosgw (and uuid-runtime)
#                              #   for the OBJ tests' one-node Ceph with its
#                              #   RADOS Gateway (ci/s3-server.sh)
#   ci/install-deps.sh guest   # + QEMU, busybox, rdma-core, perftest for ci/rxe-guest
set -euo pipefail
# cmake, libclang-dev: rdma-mummy-sys (under sideway) builds vendored
# rdma-core headers with cmake and runs bindgen; no rdma-core -dev package
# is needed, libibverbs is loaded at run time. libfabric-dev: the `fabric`
# backend's bindings (kvxfer-fabric runs bindgen over its headers; libfabric
# itself, which it brings, is loaded at run time).
want=(gcc pkg-config ca-certificates cmake libclang-dev linux-libc-dev libfabric-dev)
case "${1:-build}" in
  build) ;;
  bench) want+=(iperf3 fio python3 util-linux libfabric-bin rclone ceph-mon ceph-osd radosgw ceph-common uuid-runtime curl) ;;
  test) want+=(procps g++ valgrind python3 python3-venv util-linux mount etcd-server etcd-client iproute2 openssl ceph-mon ceph-osd radosgw ceph-common uuid-runtime curl) ;;
  guest) want+=(qemu-system-x86 busybox-static cpio kmod gzip rdma-core ibverbs-providers ibverbs-utils perftest iproute2) ;;
  *) echo "usage: $0 build|bench|test|guest" >&2; exit 2 ;;
esac
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust (rustup) first; kvxfer needs Rust >= 1.88" >&2
  exit 1
fi
