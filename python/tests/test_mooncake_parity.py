"""kvxfer's Mooncake stand-in against the real Mooncake (0.3.13, TCP):
one scripted session (`mooncake_sequence.py`: initialisation with `rdma`
falling back, managed buffers, the peer's first buffer, byte access, sync,
batch and async transfers with their status calls, submit/check, probes,
refusals and their codes) is run unmodified with `mooncake.engine`
resolving once to each, under each metadata service: P2P handshake,
Mooncake's HTTP metadata protocol (served by `kvxfer.mooncake_metadata`,
which both speak to) and etcd. Every step must match."""

import threading

import pytest

from conftest import free_port, run_script, shim_env
from kvxfer.mooncake_metadata import MetadataServer

MUST = {
    "init target": 0,
    "init initiator (rdma)": 0,
    "init again": 0,
    "peer's first buffer": True,
    "sync write": 0,
    "landed": True,
    "outside peer memory": -1,
    "async write status": 0,
    "read back": True,
    "bad async status": -1,
    "submit then check": 1,
    "bad submit then check": -1,
    "unregister unknown": -3,
    "free managed": [0, 0],
}


@pytest.fixture
def http_metadata():
    server = MetadataServer("127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server.url
    server.shutdown()
    server.server_close()


def compare(server, real_env):
    ours = run_script("mooncake_sequence.py", shim_env("mooncake", over_real=True), server,
                      free_port(), free_port())
    got = dict(ours)
    for step, want in MUST.items():
        assert got[step] == want, f"{server}: {step}: {got[step]} (want {want})"
    if real_env is None:
        return
    real = run_script("mooncake_sequence.py", real_env, server, free_port(), free_port())
    assert [s for s, _ in ours] == [s for s, _ in real]
    diff = [(s, o, r) for (s, o), (_, r) in zip(ours, real) if o != r]
    assert not diff, "\n".join(f"{server}: {s}: kvxfer {o} vs mooncake {r}" for s, o, r in diff)


def test_p2p_handshake_same_as_mooncake(real_mooncake_env):
    compare("P2PHANDSHAKE", real_mooncake_env)


def test_http_metadata_same_as_mooncake(http_metadata, real_mooncake_env):
    compare(http_metadata, real_mooncake_env)


def test_etcd_same_as_mooncake(etcd, real_mooncake_env):
    compare(etcd, real_mooncake_env)
