"""The NIXL front's etcd metadata exchange (`NIXL_ETCD_ENDPOINTS`): the
metadata calls without a peer address go through etcd with NIXL's keys,
queued as NIXL queues them; a fetch waits for metadata not there yet; an
agent that invalidates its metadata is forgotten by those that loaded it;
without etcd, the calls without an address are refused typed."""

import ctypes
import os
import subprocess
import time

import pytest

import kvxfer.nixl as nixl_api
from kvxfer import nixl_bindings as b

WAIT = 30.0


def agent(name):
    return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["UCX"]))


def buffers(a, size, fill):
    buf = ctypes.create_string_buffer(bytes([fill]) * size, size)
    reg = a.register_memory([(ctypes.addressof(buf), size, 0, "")], "DRAM")
    return buf, reg


def until(pred, what):
    """Waits for `pred` (NIXL's API is asked again: `check_remote_metadata`
    is how NIXL applications see a background fetch land)."""
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def etcd_keys(endpoint, prefix):
    out = subprocess.run(["etcdctl", "--endpoints", endpoint, "get", "--prefix", "--keys-only", prefix],
                         capture_output=True, check=True, env=dict(os.environ, ETCDCTL_API="3"))
    return [k for k in out.stdout.decode().split("\n") if k]


@pytest.fixture
def etcd_env(etcd, monkeypatch):
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", f"http://{etcd}")
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", "/nixl-test/agents/")
    return etcd


def test_metadata_through_etcd_then_a_transfer_then_invalidation(etcd_env):
    target, init = agent("etcd-target"), agent("etcd-init")
    tbuf, treg = buffers(target, 4096, 7)
    ibuf, ireg = buffers(init, 4096, 0)
    # Fetched before it is sent: the fetch waits for it (etcd's watch).
    init.fetch_remote_metadata("etcd-target")
    assert not init.check_remote_metadata("etcd-target")
    target.send_local_metadata()
    until(lambda: init.check_remote_metadata("etcd-target"), "the fetch to land")
    # NIXL's keys: the agent's prefix and its metadata.
    keys = etcd_keys(etcd_env, "/nixl-test/agents/")
    assert "/nixl-test/agents//etcd-target/" in keys
    assert "/nixl-test/agents//etcd-target/metadata" in keys
    h = init.initialize_xfer("READ", ireg.trim(), treg.trim(), "etcd-target", b"read")
    s = init.transfer(h)
    while s == "PROC":
        s = init.check_xfer_state(h)
    assert s == "DONE" and ibuf.raw == bytes([7]) * 4096
    init.release_xfer_handle(h)
    # The target leaves: its entries go, and the initiator forgets it.
    target.invalidate_local_metadata()
    until(lambda: not init.check_remote_metadata("etcd-target"), "the initiator to forget the target")
    assert etcd_keys(etcd_env, "/nixl-test/agents//etcd-target/") == []


def test_partial_metadata_under_a_label_and_a_mismatch(etcd_env):
    target, init = agent("etcd-part"), agent("etcd-part-init")
    # The buffers stay referenced while registered.
    tbuf, treg = buffers(target, 8192, 1)
    obuf, other = buffers(target, 4096, 2)
    target.send_partial_agent_metadata(treg.trim(), True, ["UCX"], label="blocks")
    init.fetch_remote_metadata("etcd-part", label="blocks")
    until(lambda: init.check_remote_metadata("etcd-part", treg.trim()), "partial metadata")
    # Only what was announced.
    assert not init.check_remote_metadata("etcd-part", other.trim())
    # An entry that holds another agent's metadata is not taken for it.
    stranger = agent("etcd-stranger")
    sbuf, _ = buffers(stranger, 4096, 3)
    subprocess.run(["etcdctl", "--endpoints", etcd_env, "put", "/nixl-test/agents//etcd-liar/metadata"],
                   input=stranger.get_agent_metadata(), check=True,
                   env=dict(os.environ, ETCDCTL_API="3"))
    init.fetch_remote_metadata("etcd-liar")
    # Queued after the lie: once the next fetch landed, the lie was judged.
    stranger.send_local_metadata()
    init.fetch_remote_metadata("etcd-stranger")
    until(lambda: init.check_remote_metadata("etcd-stranger"), "the stranger's own metadata")
    assert not init.check_remote_metadata("etcd-liar")


def test_without_etcd_a_call_without_an_address_is_refused(monkeypatch):
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    a = agent("no-etcd")
    buf, _ = buffers(a, 4096, 0)
    with pytest.raises(b.nixlInvalidParamError, match="NIXL_ETCD_ENDPOINTS"):
        a.send_local_metadata()
    with pytest.raises(b.nixlInvalidParamError):
        a.fetch_remote_metadata("someone")
