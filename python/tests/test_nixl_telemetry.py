"""NIXL's telemetry file written by the NIXL front (`NIXL_TELEMETRY_DIR`),
read here as NIXL's `telemetry_reader.py` reads it: the shared ring's
header and 16-byte events."""

import ctypes
import mmap
import os

import pytest

import kvxfer.nixl as nixl_api
from kvxfer import nixl_bindings as b
from kvxfer import nixl_telemetry as t


class Header(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("write_pos", ctypes.c_size_t), ("read_pos", ctypes.c_size_t),
                ("version", ctypes.c_uint32), ("expected_version", ctypes.c_uint32),
                ("capacity", ctypes.c_size_t), ("mask", ctypes.c_size_t)]


class Event(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("event_type", ctypes.c_uint32), ("_padding", ctypes.c_char * 4),
                ("value", ctypes.c_uint64)]


class Reader:
    """NIXL's reader: maps the file, pops events from `read_pos`."""

    def __init__(self, path):
        self.f = open(path, "r+b")  # noqa: SIM115
        head = mmap.mmap(self.f.fileno(), ctypes.sizeof(Header))
        cap = Header.from_buffer_copy(head).capacity
        head.close()
        self.m = mmap.mmap(self.f.fileno(), ctypes.sizeof(Header) + ctypes.sizeof(Event) * cap)
        self.h = Header.from_buffer(self.m)
        self.data = (Event * cap).from_buffer(self.m, ctypes.sizeof(Header))

    def pop_all(self):
        out = []
        while self.h.read_pos != self.h.write_pos:
            e = self.data[self.h.read_pos]
            out.append((t.NAMES[e.event_type], e.value))
            self.h.read_pos = (self.h.read_pos + 1) & self.h.mask
        return out


@pytest.fixture
def telemetry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_DIR", str(tmp_path))
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "1")
    return tmp_path


def wait(a, h):
    s = a.transfer(h)
    while s == "PROC":
        s = a.check_xfer_state(h)
    return s


def test_registrations_and_transfers_reach_the_file(telemetry_dir, tmp_path):
    a = nixl_api.nixl_agent("telemetry-a", nixl_api.nixl_agent_config(backends=[]))
    a.create_backend("POSIX")
    path = telemetry_dir / "telemetry-a"
    r = Reader(path)
    assert (r.h.version, r.h.capacity, r.h.mask) == (4, 4096, 4095)
    n = 8192
    src = ctypes.create_string_buffer(os.urandom(n), n)
    reg = a.register_memory([(ctypes.addressof(src), n, 0, "")], "DRAM")
    fd = os.open(tmp_path / "kv.bin", os.O_RDWR | os.O_CREAT)
    files = a.register_memory([(0, n, fd, "")], "FILE")
    w = a.initialize_xfer("WRITE", a.get_xfer_descs([(ctypes.addressof(src), n, 0)], "DRAM"),
                          files.trim(), a.name)
    assert wait(a, w) == "DONE"
    rd = a.initialize_xfer("READ", a.get_xfer_descs([(ctypes.addressof(src), n, 0)], "DRAM"),
                           files.trim(), a.name)
    assert wait(a, rd) == "DONE"
    ev = r.pop_all()
    names = [k for k, _ in ev]
    assert ev[:2] == [("agent_memory_registered", n), ("agent_memory_registered", n)]
    assert names[2:] == ["agent_xfer_post_time", "agent_xfer_time", "agent_tx_bytes",
                         "agent_tx_requests_num", "agent_xfer_post_time", "agent_xfer_time",
                         "agent_rx_bytes", "agent_rx_requests_num"], names
    assert dict(ev[2:6])["agent_tx_bytes"] == n and dict(ev[6:])["agent_rx_bytes"] == n
    # A post that fails counts a backend error.
    a.deregister_memory(reg)
    assert a.transfer(w) == "ERR"
    assert r.pop_all() == [("agent_memory_deregistered", n), ("agent_err_backend", 1)]
    for h in (w, rd):
        a.release_xfer_handle(h)
    a.deregister_memory(files)
    os.close(fd)


def test_a_full_ring_drops_and_counts(telemetry_dir, monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_BUFFER_SIZE", "4")
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLED_METRICS", "agent_memory_*,agent_telemetry_*")
    a = nixl_api.nixl_agent("telemetry-full", nixl_api.nixl_agent_config(backends=["UCX"]))
    r = Reader(telemetry_dir / "telemetry-full")
    bufs = [ctypes.create_string_buffer(64) for _ in range(5)]
    regs = [a.register_memory([(ctypes.addressof(x), 64, 0, "")], "DRAM") for x in bufs]
    # Three slots (one stays empty): the fourth and fifth are dropped.
    assert r.pop_all() == [("agent_memory_registered", 64)] * 3
    a.deregister_memory(regs[0])
    assert r.pop_all() == [("agent_telemetry_events_dropped", 2), ("agent_memory_deregistered", 64)]


def test_a_buffer_size_that_is_no_power_of_two_is_refused(telemetry_dir, monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_BUFFER_SIZE", "1000")
    with pytest.raises(b.nixlInvalidParamError):
        nixl_api.nixl_agent("telemetry-bad", nixl_api.nixl_agent_config(backends=["UCX"]))


def test_no_file_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("NIXL_TELEMETRY_DIR", raising=False)
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "1")
    monkeypatch.chdir(tmp_path)
    nixl_api.nixl_agent("telemetry-none", nixl_api.nixl_agent_config(backends=["UCX"]))
    assert os.listdir(tmp_path) == []
