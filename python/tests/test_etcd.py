"""Peers found by name in a real etcd (Debian's etcd-server), started here
on loopback ports; skipped where no etcd binary exists."""

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

import kvxfer

WAIT = 30.0


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


@pytest.fixture
def etcd():
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("SKIPPED: no etcd/etcdctl binary (ci/install-deps.sh test installs them)")
    d = tempfile.mkdtemp(prefix="kvxfer-py-etcd-")
    client, peer = f"127.0.0.1:{_port()}", f"127.0.0.1:{_port()}"
    proc = subprocess.Popen(
        ["etcd", "--name", "n0", "--data-dir", os.path.join(d, "n0"),
         "--listen-client-urls", f"http://{client}", "--advertise-client-urls", f"http://{client}",
         "--listen-peer-urls", f"http://{peer}", "--initial-advertise-peer-urls", f"http://{peer}",
         "--initial-cluster", f"n0=http://{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    env = dict(os.environ, ETCDCTL_API="3")
    deadline = time.time() + 60
    while subprocess.run(["etcdctl", "--endpoints", client, "get", "x"], env=env,
                         capture_output=True).returncode != 0:
        assert time.time() < deadline, "etcd did not come up"
        time.sleep(0.1)
    yield client
    proc.kill()
    proc.wait()
    shutil.rmtree(d, ignore_errors=True)


def test_peers_by_name_and_a_taken_name(etcd):
    prefix = f"/py-{os.getpid()}"
    target = kvxfer.Agent("py-ctx", etcd=etcd, etcd_prefix=prefix, etcd_lease_ttl=3)
    dst = bytearray(4096)
    d = target.register(dst)
    init = kvxfer.Agent("py-gen", etcd=etcd, etcd_prefix=prefix, etcd_lease_ttl=3)
    src = bytearray(b"\x42" * 4096)
    s = init.register(src)
    init.connect_by_name("py-ctx")
    init.write([(s.addr, s.len)], [(d.addr, d.len)], "py-ctx").wait(WAIT)
    assert bytes(dst) == bytes(src)
    with pytest.raises(kvxfer.NameTakenError):
        kvxfer.Agent("py-ctx", etcd=etcd, etcd_prefix=prefix)
    with pytest.raises(kvxfer.UnknownAgentError):
        init.connect_by_name("nobody")
    # The target closes: its peers find it gone.
    remote = [(d.addr, d.len)]
    d.deregister()
    del d, target
    deadline = time.time() + WAIT
    while True:
        try:
            init.write([(s.addr, s.len)], remote, "py-ctx").wait(WAIT)
        except kvxfer.PeerGoneError:
            break
        except kvxfer.KvxferError:
            pass
        assert time.time() < deadline, "the closed peer never read as gone"
        time.sleep(0.1)
