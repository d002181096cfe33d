"""Storage through the native API: a file opened as storage, a buffer
written into it and read back by requests to the agent itself."""

import os

import pytest

import kvxfer

WAIT = 30.0


def test_a_buffer_goes_to_a_file_and_comes_back(tmp_path):
    agent = kvxfer.Agent("py-storage", backend="tcp")
    path = tmp_path / "kv.bin"
    handle = agent.open_storage(str(path), kind="file", size=1 << 20)
    agent.register_raw([(0, 1 << 20, handle)], mem_type="file")
    src = bytearray(os.urandom(1 << 16))
    back = bytearray(1 << 16)
    s = agent.register(src)
    b = agent.register(back)
    t = agent.transfer("write", [(s.addr, s.len)], [(4096, s.len)], "py-storage",
                       remote_mem="file", remote_device=handle, durable=True)
    t.wait(WAIT)
    assert t.state == "DONE"
    assert t.transport == "storage"
    assert path.read_bytes()[4096:4096 + len(src)] == bytes(src)
    t = agent.transfer("read", [(b.addr, b.len)], [(4096, b.len)], "py-storage",
                       remote_mem="file", remote_device=handle)
    t.wait(WAIT)
    assert bytes(back) == bytes(src)
    # A range past the registered one: typed, nothing moves.
    with pytest.raises(kvxfer.NotRegisteredError):
        agent.transfer("write", [(s.addr, s.len)], [((1 << 20) - 100, s.len)], "py-storage",
                       remote_mem="file", remote_device=handle)
    # Storage with registered ranges stays open.
    with pytest.raises(kvxfer.InvalidRequestError):
        agent.close_storage(handle)
    agent.deregister_raw([(0, 1 << 20, handle)], mem_type="file")
    agent.close_storage(handle)


def test_a_peer_writes_and_reads_the_agents_file_through_it(tmp_path):
    target = kvxfer.Agent("py-storage-target", backend="tcp")
    path = tmp_path / "kv.bin"
    handle = target.open_storage(str(path), kind="file", size=1 << 20)
    target.register_raw([(0, 1 << 20, handle)], mem_type="file")
    peer = kvxfer.Agent("py-storage-peer", backend="tcp")
    name = peer.add_remote_agent(target.metadata())
    src = bytearray(os.urandom(1 << 16))
    back = bytearray(1 << 16)
    s = peer.register(src)
    b = peer.register(back)
    t = peer.transfer("write", [(s.addr, s.len)], [(8192, s.len)], name,
                      remote_mem="file", remote_device=handle, durable=True)
    t.wait(WAIT)
    assert t.state == "DONE"
    assert t.transport == "tcp"
    assert path.read_bytes()[8192:8192 + len(src)] == bytes(src)
    t = peer.transfer("read", [(b.addr, b.len)], [(8192, b.len)], name,
                      remote_mem="file", remote_device=handle)
    t.wait(WAIT)
    assert bytes(back) == bytes(src)
    # Outside what the target registered: typed, nothing sent.
    with pytest.raises(kvxfer.RemoteRangeNotExportedError):
        peer.transfer("write", [(s.addr, s.len)], [((1 << 20) - 100, s.len)], name,
                      remote_mem="file", remote_device=handle)
