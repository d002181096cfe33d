"""Peers found by name in a real etcd (Debian's etcd-server), started here
on loopback ports (the `etcd` fixture, conftest.py); skipped where no etcd
binary exists."""

import os
import time

import pytest

import kvxfer

WAIT = 30.0


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
