#!/usr/bin/env bash
# A real S3 server for the OBJ tests: a one-node Ceph cluster (one monitor,
# one OSD on memstore, no replication) with a RADOS Gateway on loopback.
#
#   ci/s3-server.sh start DIR   # installs Debian's packages if missing, starts
#                               # everything under DIR, writes DIR/env
#   ci/s3-server.sh stop DIR
#
# DIR/env sets KVXFER_S3_ENDPOINT, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
# AWS_REGION, KVXFER_S3_BUCKET (a bucket made for the tests) and
# KVXFER_S3_ADMIN (the radosgw-admin command line, for quotas).
# KVXFER_S3_MEMSTORE_BYTES: the OSD's memory store (2 GiB by default; the
# benchmarks take more).
set -euo pipefail
cmd=${1:?start|stop}
dir=$(realpath -m "${2:?a directory}")

# The daemons' pids, from their pid files (a daemon that ends removes its
# own).
pids() { cat "$dir"/run/*.pid 2>/dev/null || true; }
stop() {
    local all
    all=$(pids)
    [ -n "$all" ] || return 0
    # shellcheck disable=SC2086
    kill $all 2>/dev/null || true
    for _ in $(seq 50); do
        # shellcheck disable=SC2086
        kill -0 $all 2>/dev/null || break
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -9 $all 2>/dev/null || true
    rm -f "$dir"/run/*.pid
}
if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

# A failed start says which command failed, with its exit status (the Ceph
# tools exit with an errno: 28 is ENOSPC), the free space where the daemons
# write, and the end of their logs.
failed() {
    local rc=$? line=$1
    echo "ci/s3-server.sh: line $line exited $rc" >&2
    df -h "$dir" /tmp >&2 || true
    for f in "$dir"/log/*.log; do
        [ -e "$f" ] || continue
        echo "--- ${f##*/}" >&2
        tail -n 20 "$f" >&2
    done
    exit "$rc"
}
trap 'failed $LINENO' ERR

if ! command -v radosgw >/dev/null || ! command -v ceph-osd >/dev/null || ! command -v ceph-mon >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends ceph-mon ceph-osd radosgw ceph-common uuid-runtime >/dev/null
fi

stop
rm -rf "$dir"
mkdir -p "$dir"/{mon,osd,run,log}
# Free ports: the monitor's and the gateway's.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mon_port=$(port)
rgw_port=$(port)
fsid=$(uuidgen)
conf=$dir/ceph.conf
cat > "$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$mon_port
public addr = 127.0.0.1
auth allow insecure global id reclaim = false
mon data avail warn = 1
mon data avail crit = 0
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
keyring = $dir/keyring
mon data = $dir/mon
osd data = $dir/osd
osd objectstore = memstore
memstore device bytes = ${KVXFER_S3_MEMSTORE_BYTES:-2147483648}
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
osd max object size = 1073741824
setuser match path = $dir
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw dns name = localhost
rgw bucket quota ttl = 0
rgw enable usage log = false
# Overwritten objects' old data goes within seconds (the benchmarks
# overwrite gigabytes; the default keeps it two hours).
rgw gc obj min wait = 1
rgw gc processor period = 2
CONF
c=(-c "$conf")
# One keyring holds every entity's key; the monitor takes them in at mkfs.
ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$dir/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' >/dev/null
ceph-authtool "$dir/keyring" --gen-key -n osd.0 --cap mon 'allow profile osd' --cap osd 'allow *' >/dev/null
ceph-authtool "$dir/keyring" --gen-key -n client.rgw --cap mon 'allow rw' --cap osd 'allow rwx' >/dev/null
monmaptool --create --addv a "[v2:127.0.0.1:$mon_port]" --fsid "$fsid" "$dir/monmap" >/dev/null
ceph-mon "${c[@]}" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring" >/dev/null
ceph-mon "${c[@]}" -i a 2>>"$dir/log/start.log"
osd_uuid=$(uuidgen)
timeout 60 ceph "${c[@]}" osd new "$osd_uuid" >/dev/null
ceph-osd "${c[@]}" -i 0 --mkfs --osd-uuid "$osd_uuid" >/dev/null 2>&1
ceph-osd "${c[@]}" -i 0 2>>"$dir/log/start.log"
timeout 60 ceph "${c[@]}" osd crush add osd.0 1 root=default host=localhost >/dev/null 2>&1 || true
radosgw "${c[@]}" -n client.rgw 2>>"$dir/log/start.log"
for _ in $(seq 600); do
    curl -s -o /dev/null "http://127.0.0.1:$rgw_port/" && break
    sleep 0.2
done
curl -s -o /dev/null "http://127.0.0.1:$rgw_port/" || { echo "radosgw did not answer; logs in $dir/log" >&2; exit 1; }
access=$(head -c 10 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F)
secret=$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')
timeout 60 radosgw-admin "${c[@]}" user create --uid kvxfer --display-name kvxfer \
    --access-key "$access" --secret-key "$secret" >/dev/null
# A bucket for the tests that cannot make one (the C and Python suites).
empty_sha=e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855
curl -sf -o /dev/null --aws-sigv4 "aws:amz:us-east-1:s3" --user "$access:$secret" \
    -H "x-amz-content-sha256: $empty_sha" -X PUT "http://127.0.0.1:$rgw_port/kvxfer"
cat > "$dir/env" <<ENV
export KVXFER_S3_ENDPOINT=http://127.0.0.1:$rgw_port
export AWS_ACCESS_KEY_ID=$access
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
export KVXFER_S3_BUCKET=kvxfer
export KVXFER_S3_ADMIN="radosgw-admin -c $conf"
ENV
echo "radosgw on http://127.0.0.1:$rgw_port (environment in $dir/env)"
