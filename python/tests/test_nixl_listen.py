"""The NIXL front's metadata exchange through its listener thread
(`kvxfer.nixl_listen`): full and partial metadata, fetch, invalidation, and
the listener's bounds (frame size, exchanges at once, a deadline per
exchange)."""

import ctypes
import socket
import struct
import time

import pytest

import kvxfer.nixl as nixl_api
from kvxfer import nixl_bindings as b
from kvxfer import nixl_listen

IP = "127.0.0.1"


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    monkeypatch.setenv("KVXFER_NIXL_LISTEN_HOST", IP)


def agent(name, port=0):
    return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(True, True, port, backends=["UCX"]))


def buffers(a, count, size, fill):
    bufs = [ctypes.create_string_buffer(bytes([fill]) * size, size) for _ in range(count)]
    rows = [(ctypes.addressof(x), size, 0, "") for x in bufs]
    reg = a.register_memory(rows, "DRAM")
    return bufs, reg


def wait(a, h):
    s = a.transfer(h)
    while s == "PROC":
        s = a.check_xfer_state(h)
    return s


def test_fetch_send_transfer_and_invalidate():
    """basic_two_peers.py's exchange: the initiator fetches the target's
    metadata from its listener and sends its own; a READ with a
    notification; invalidation makes the target forget it."""
    target = agent("listen-target")
    init = agent("listen-init")
    port = target.agent._listener.port
    tbufs, treg = buffers(target, 2, 4096, 7)
    ibufs, ireg = buffers(init, 2, 4096, 0)
    assert not init.check_remote_metadata("listen-target")
    init.fetch_remote_metadata("listen-target", IP, port)
    assert init.check_remote_metadata("listen-target")
    assert init.check_remote_metadata("listen-target", treg.trim())
    init.send_local_metadata(IP, port)
    assert target.check_remote_metadata("listen-init")
    h = init.initialize_xfer("READ", ireg.trim(), treg.trim(), "listen-target", b"Done_reading")
    assert wait(init, h) == "DONE"
    assert all(x.raw == bytes([7]) * 4096 for x in ibufs)
    while not target.check_remote_xfer_done("listen-init", b"Done_reading"):
        pass
    init.release_xfer_handle(h)
    init.invalidate_local_metadata(IP, port)
    assert not target.check_remote_metadata("listen-init")


def test_partial_metadata_announces_only_its_descriptors():
    """partial_md_example.py: a peer that loaded partial metadata for the
    first list may not name the second until that is announced too."""
    target = agent("partial-target")
    init = agent("partial-init")
    # The buffers stay referenced while registered.
    t1, reg1 = buffers(target, 4, 256, 1)
    t2, reg2 = buffers(target, 4, 256, 2)
    ibufs, ireg = buffers(init, 4, 256, 0)
    port = init.agent._listener.port
    target.send_partial_agent_metadata(reg1, True, ["UCX"], IP, port)
    assert init.check_remote_metadata("partial-target", reg1.trim())
    assert not init.check_remote_metadata("partial-target", reg2.trim())
    h1 = init.initialize_xfer("READ", ireg.trim(), reg1.trim(), "partial-target", b"UUID1")
    assert wait(init, h1) == "DONE"
    assert all(x.raw == bytes([1]) * 256 for x in ibufs)
    with pytest.raises(b.nixlNotFoundError):
        init.initialize_xfer("READ", ireg.trim(), reg2.trim(), "partial-target", b"UUID1")
    with pytest.raises(b.nixlNotFoundError):
        init.prep_xfer_dlist("partial-target", reg2.trim())
    target.send_partial_agent_metadata(reg2, True, ["UCX"], IP, port)
    h2 = init.initialize_xfer("READ", ireg.trim(), reg2.trim(), "partial-target", b"UUID2")
    assert wait(init, h2) == "DONE"
    assert all(x.raw == bytes([2]) * 256 for x in ibufs)
    # Full metadata lifts the restriction; the first list still works.
    init.fetch_remote_metadata("partial-target", IP, target.agent._listener.port)
    assert init.check_remote_metadata("partial-target", reg1.trim())
    for h in (h1, h2):
        init.release_xfer_handle(h)
    assert t1 and t2


def test_a_fetch_from_another_agent_and_no_address_are_refused():
    target = agent("named-target")
    init = agent("named-init")
    with pytest.raises(b.nixlMismatchError):
        init.fetch_remote_metadata("someone-else", IP, target.agent._listener.port)
    assert not init.check_remote_metadata("named-target")
    # No address and no etcd (NIXL_ETCD_ENDPOINTS): refused, as NIXL does.
    with pytest.raises(b.nixlInvalidParamError, match="NIXL_ETCD_ENDPOINTS"):
        init.send_local_metadata()


def test_the_listener_is_bounded(monkeypatch):
    """A frame over the cap is refused unread, a silent connection is
    closed at the deadline, exchanges beyond the cap are turned away; the
    listener serves a legitimate fetch afterwards."""
    monkeypatch.setattr(nixl_listen, "DEADLINE", 0.5)
    target = agent("bounded-target")
    port = target.agent._listener.port
    with socket.create_connection((IP, port)) as s:
        s.sendall(struct.pack("!cI", b"S", nixl_listen.MAX_FRAME + 1))
        s.settimeout(30)
        assert s.recv(1) == b"", "an oversized frame is not answered"
    silent = [socket.create_connection((IP, port)) for _ in range(nixl_listen.MAX_CONNS)]
    extra = socket.create_connection((IP, port))
    extra.settimeout(30)
    # Beyond the cap (or, once the silent ones are closed, at the
    # deadline): closed unanswered either way, never held.
    assert extra.recv(1) == b""
    for s in silent:
        s.settimeout(30)
        assert s.recv(1) == b"", "a silent connection outlived the deadline"
        s.close()
    extra.close()
    init = agent("bounded-init")
    init.fetch_remote_metadata("bounded-target", IP, port)
    assert init.check_remote_metadata("bounded-target")


def test_a_listen_port_in_use_is_a_typed_error():
    first = agent("port-a")
    with pytest.raises(b.nixlBackendError):
        agent("port-b", first.agent._listener.port)


def test_a_listener_that_never_comes_up_fails_the_fetch_typed(monkeypatch):
    """A fetch keeps trying a peer that does not listen (yet) for the
    exchange timeout, then fails typed."""
    s = socket.socket()
    s.bind((IP, 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setattr(b, "_EXCHANGE_TIMEOUT", 0.3)
    init = agent("early-init")
    with pytest.raises(b.nixlBackendError):
        init.fetch_remote_metadata("late-target", IP, port)


def test_invalidating_at_a_listener_that_is_gone_succeeds_at_once(monkeypatch):
    """basic_two_peers.py's tear-down: the initiator invalidates its
    metadata at a target that has already exited. NIXL queues it and
    returns; kvxfer's front tries once (nothing listens: nothing holds the
    metadata) and returns without waiting out the exchange timeout."""
    s = socket.socket()
    s.bind((IP, 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setattr(b, "_EXCHANGE_TIMEOUT", 3600.0)
    init = agent("gone-init")
    t0 = time.monotonic()
    init.invalidate_local_metadata(IP, port)
    assert time.monotonic() - t0 < 600.0, "waited out the exchange timeout"
