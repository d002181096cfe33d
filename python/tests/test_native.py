"""The native Python API: transfers between two processes over tcp, shm and
libfabric (provider `tcp;ofi_rxm`), typed errors that change nothing,
deadlines, Ctrl-C."""

import mmap
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

import kvxfer

SIZE = 1 << 20
WAIT = 30.0
spawn = mp.get_context("spawn")


def pattern(n, salt=0):
    return bytes((i * 7 + salt) % 251 for i in range(n))


def target_main(conn, backend, fill):
    """A target in its own process: registers a buffer (filled with
    `fill`), sends its metadata, waits for one notification, sends back
    what arrived and the buffer, then waits to be told to stop."""
    agent = kvxfer.Agent("py-target", backend=backend)
    buf = bytearray(fill)
    reg = agent.register(buf)
    conn.send((agent.metadata(), agent.connection_info(), reg.addr, reg.len))
    got = {}
    deadline = time.monotonic() + WAIT
    while not got and time.monotonic() < deadline:
        got = agent.wait_notifs(1.0)
    conn.send((got, bytes(buf)))
    conn.recv()


class Target:
    def __init__(self, backend, fill=bytes(SIZE)):
        self.conn, child = spawn.Pipe()
        self.proc = spawn.Process(target=target_main, args=(child, backend, fill))
        self.proc.start()
        assert self.conn.poll(WAIT), "the target did not start"
        self.metadata, self.connection, self.addr, self.len = self.conn.recv()

    def result(self):
        assert self.conn.poll(WAIT), "the target did not report"
        return self.conn.recv()

    def stop(self):
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.proc.join(WAIT)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


BACKENDS = ["tcp", "shm", "fabric"]


@pytest.fixture(autouse=True)
def fabric_provider(monkeypatch):
    """libfabric's provider for `fabric` agents here and in the targets
    (spawned processes inherit the environment): TCP sockets."""
    monkeypatch.setenv("KVXFER_FABRIC_PROVIDER", "tcp;ofi_rxm")


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_with_a_notification_lands_in_another_process(backend):
    t = Target(backend)
    try:
        a = kvxfer.Agent("py-init", backend=backend)
        name = a.add_remote_agent(t.metadata)
        assert name == "py-target"
        assert a.remote_transport(name) == backend
        data = bytearray(pattern(SIZE))
        with a.register(data) as src:
            x = a.write(src.descs(), [(t.addr, t.len)], name, notif=b"blocks 0..8 ready")
            x.wait(WAIT)
            assert x.done() and x.state == "DONE" and x.transport == backend
        notifs, buf = t.result()
        assert notifs == {"py-init": [b"blocks 0..8 ready"]}
        assert buf == bytes(data)
    finally:
        t.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_from_another_process(backend):
    want = pattern(SIZE, salt=3)
    t = Target(backend, fill=want)
    try:
        a = kvxfer.Agent("py-init", backend=backend)
        name = a.connect(t.connection)
        dst = bytearray(SIZE)
        reg = a.register(dst)
        a.read(reg.descs(), [(t.addr, t.len)], name).wait(WAIT)
        assert bytes(dst) == want
        # The notification alone (no data) wakes the target.
        a.send_notif(name, b"bye").wait(WAIT)
        notifs, _ = t.result()
        assert notifs == {"py-init": [b"bye"]}
        reg.deregister()
    finally:
        t.stop()


def test_bad_input_is_typed_and_changes_nothing():
    t = kvxfer.Agent("py-t")
    i = kvxfer.Agent("py-i")
    dst = bytearray(b"\x55" * 4096)
    rt = t.register(dst)
    name = i.add_remote_agent(t.metadata())
    src = bytearray(b"\xaa" * 8192)
    ri = i.register(src)
    # Unknown agent.
    with pytest.raises(kvxfer.UnknownAgentError):
        i.write(ri.descs(0, 16), rt.descs(0, 16), "nobody")
    # A remote range past what the target registered.
    with pytest.raises(kvxfer.RemoteRangeNotExportedError):
        i.write(ri.descs(), [(rt.addr, 8192)], name)
    # A local range outside every registration.
    other = bytearray(64)
    with pytest.raises(kvxfer.NotRegisteredError):
        i.write([(id(other), 16)], rt.descs(0, 16), name)
    # Malformed metadata.
    with pytest.raises(kvxfer.InvalidAgentDescError):
        i.add_remote_agent(b"not an agent descriptor")
    # Pieces that do not pair up.
    with pytest.raises(kvxfer.KvxferError):
        i.write(ri.descs(0, 16), rt.descs(0, 32), name)
    # Bad arguments of the binding itself.
    with pytest.raises(ValueError):
        ri.descs(8000, 400)
    with pytest.raises(ValueError):
        i.transfer("copy", ri.descs(0, 16), rt.descs(0, 16), name)
    with pytest.raises(ValueError):
        i.wait_notifs(-1.0)
    assert bytes(dst) == b"\x55" * 4096, "a refused request changed the target"
    # Every error class is a KvxferError.
    for n in kvxfer.__all__:
        if n.endswith("Error"):
            assert issubclass(getattr(kvxfer, n), kvxfer.KvxferError)
    # The agent still works after all that.
    i.write(ri.descs(0, 4096), rt.descs(), name).wait(WAIT)
    assert bytes(dst) == b"\xaa" * 4096


def test_inproc_agents_copy_in_the_submitting_call():
    """The in-process backend (for unit tests of code built on kvxfer): a
    transfer between two agents of this process is done, data and
    notification, when the call returns; a stale remote range is refused
    and changes nothing."""
    t = kvxfer.Agent("py-inproc-t", backend="inproc")
    i = kvxfer.Agent("py-inproc-i", backend="inproc")
    dst = bytearray(4096)
    rt = t.register(dst)
    src = bytearray(pattern(4096, 5))
    ri = i.register(src)
    name = i.add_remote_agent(t.metadata())
    assert i.remote_transport(name) == "inproc"
    x = i.write(ri.descs(), rt.descs(), name, notif=b"landed")
    assert x.done() and x.state == "DONE" and x.transport == "inproc"
    assert bytes(dst) == bytes(src)
    assert t.get_new_notifs() == {"py-inproc-i": [b"landed"]}
    # The target registers its buffer again: the loaded range is stale.
    rt.deregister()
    dst2 = bytearray(4096)
    t.register(dst2)
    with pytest.raises(kvxfer.RemoteRejectedError):
        i.write(ri.descs(), [(rt.addr, 4096)], name).wait(WAIT)
    assert dst2 == bytearray(4096)


def test_integrity_checks_where_it_can_and_is_refused_where_it_cannot(tmp_path):
    """`integrity=True`: over TCP and in-process a checked write lands
    whole with its notification; to storage (a path that cannot check) it
    is refused, typed, and nothing moves."""
    for backend in ("tcp", "inproc"):
        t = kvxfer.Agent(f"py-int-t-{backend}", backend=backend)
        i = kvxfer.Agent(f"py-int-i-{backend}", backend=backend)
        dst = bytearray(1 << 20)
        rt = t.register(dst)
        src = bytearray(pattern(1 << 20, 9))
        ri = i.register(src)
        name = i.add_remote_agent(t.metadata())
        local, remote = [(ri.addr, len(src))], [(rt.addr, len(dst))]
        i.transfer("write", local, remote, name, notif=b"checked", integrity=True).wait(WAIT)
        assert bytes(dst) == bytes(src)
        assert t.wait_notifs(WAIT) == {i.name: [b"checked"]}
    a = kvxfer.Agent("py-int-storage")
    h = a.open_storage(str(tmp_path / "f"), size=4096)
    a.register_raw([(0, 4096, h)], "file")
    src = bytearray(pattern(4096, 3))
    r = a.register(src)
    with pytest.raises(kvxfer.IntegrityUnsupportedError):
        a.transfer("write", [(r.addr, 4096)], [(0, 4096)], a.name, remote_mem="file", remote_device=h, integrity=True)
    assert (tmp_path / "f").read_bytes() == bytes(4096)
    assert issubclass(kvxfer.IntegrityError, kvxfer.KvxferError)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_transfers_are_awaitable_and_queued_as_they_finish(backend):
    """Completion as events: `await` in asyncio (the loop woken by the
    completion through a CompletionQueue's descriptor), several awaited at
    once, a failure raised typed; and a CompletionQueue read by hand."""
    import asyncio
    import select

    t = kvxfer.Agent("py-aio-t", backend=backend)
    dst = bytearray(SIZE)
    rt = t.register(dst)
    i = kvxfer.Agent("py-aio-i", backend=backend)
    src = bytearray(pattern(SIZE, 9))
    ri = i.register(src)
    name = i.add_remote_agent(t.metadata())
    half = SIZE // 2

    async def both():
        x = i.write([(ri.addr, half)], [(rt.addr, half)], name)
        y = i.write([(ri.addr + half, half)], [(rt.addr + half, half)], name)
        await asyncio.wait_for(asyncio.gather(x, y), WAIT)

    asyncio.run(both())
    assert bytes(dst) == bytes(src)

    cq = kvxfer.CompletionQueue()
    assert select.select([cq.fileno()], [], [], 0)[0] == []
    x = i.read([(ri.addr, 4096)], [(rt.addr, 4096)], name)
    cq.watch(x, 42)
    assert select.select([cq.fileno()], [], [], WAIT)[0] == [cq.fileno()]
    assert cq.take() == [(42, None)]
    assert select.select([cq.fileno()], [], [], 0)[0] == []

    # A failure the target reports (its region registered anew: the loaded
    # key is stale) is raised by the await.
    rt.deregister()
    t.register(bytearray(SIZE))

    async def stale():
        with pytest.raises(kvxfer.RemoteRejectedError):
            await asyncio.wait_for(i.write(ri.descs(), [(rt.addr, SIZE)], name), WAIT)

    asyncio.run(stale())


def test_buffers_of_every_kind_register_and_stay_pinned():
    a = kvxfer.Agent("py-buffers")
    m = mmap.mmap(-1, 1 << 16)
    reg = a.register(m)
    assert reg.len == 1 << 16 and not reg.readonly
    # Exported: the mmap cannot be closed while registered.
    with pytest.raises(BufferError):
        m.close()
    reg.deregister()
    m.close()
    # Peers may write registered memory: immutable objects are refused.
    before = b"immutable source bytes"
    with pytest.raises(kvxfer.ReadOnlyBufferError):
        a.register(before)
    with pytest.raises(kvxfer.ReadOnlyBufferError):
        a.register(memoryview(bytearray(64)).toreadonly())
    assert before == b"immutable source bytes"
    ba = bytearray(100)
    with a.register(ba):
        with pytest.raises(BufferError):
            ba.extend(b"x")  # a registered bytearray cannot move
    ba.extend(b"x")
    with pytest.raises(BufferError):
        a.register(memoryview(bytearray(64))[::2])  # not contiguous


def test_a_busy_registration_cannot_go():
    t = kvxfer.Agent("py-busy-t")
    i = kvxfer.Agent("py-busy-i")
    dst = bytearray(SIZE)
    rt = t.register(dst)
    name = i.add_remote_agent(t.metadata())
    src = bytearray(SIZE)
    ri = i.register(src)
    x = i.write(ri.descs(), rt.descs(), name)
    try:
        ri.deregister()
        busy = False
    except kvxfer.RegionBusyError:
        busy = True
    x.wait(WAIT)
    if busy:
        ri.deregister()
    rt.deregister()


def test_waits_have_deadlines():
    a = kvxfer.Agent("py-deadline")
    t0 = time.monotonic()
    assert a.wait_notifs(0.3) == {}
    assert time.monotonic() - t0 >= 0.25


def proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_stopped(pid):
    """Until every thread of `pid` is stopped (`kill` returns before)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_a_peer_killed_mid_transfer_fails_it_within_the_timeout():
    t = Target("tcp")
    a = kvxfer.Agent("py-init", io_timeout=5.0, connect_timeout=5.0)
    name = a.add_remote_agent(t.metadata)
    src = bytearray(SIZE)
    reg = a.register(src)
    done = a.write(reg.descs(), [(t.addr, t.len)], name)
    done.wait(WAIT)
    assert done.is_settled()
    done.wait_settled(0.0)
    # Frozen, the target cannot acknowledge: the next write stays in flight
    # until the target dies under it.
    os.kill(t.proc.pid, signal.SIGSTOP)
    wait_stopped(t.proc.pid)
    x = a.write(reg.descs(), [(t.addr, t.len)], name, notif=b"never")
    time.sleep(0.2)
    assert x.state == "PROC", (x.state, x.telemetry(), proc_state(t.proc.pid))
    os.kill(t.proc.pid, signal.SIGKILL)
    t.proc.join()
    t0 = time.monotonic()
    with pytest.raises(kvxfer.KvxferError):
        x.wait(20.0)
    assert x.state == "ERR"
    assert time.monotonic() - t0 < 10.0
    # The broken link's bytes could still have been in a live target's
    # socket buffers: unsettled until proved. The target's port now
    # refuses: nothing of it lands any more.
    assert not x.is_settled()
    x.wait_settled(10.0)
    assert x.is_settled()
    reg.deregister()  # nothing of the failed transfer holds the buffer


def test_ctrl_c_ends_a_wait():
    code = (
        "import kvxfer, os, signal, threading, time\n"
        # Python installs its Ctrl-C handler only where SIGINT is not
        # ignored at start, and a run started in the background (nohup,
        # `&`) ignores it: the handler is put in place here.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "a = kvxfer.Agent('py-sigint')\n"
        "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    a.wait_notifs(60.0)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted after %.1f s' % (time.monotonic() - t0))\n"
    )
    # Unbuffered, with every Python thread's stack dumped at 20 s: should
    # the child hang, its output says whether the wait or the exit did.
    code = "import faulthandler\nfaulthandler.dump_traceback_later(20)\n" + code
    try:
        out = subprocess.run(
            [sys.executable, "-u", "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            "the child hung; stdout: %r, stderr: %r" % (e.stdout, e.stderr)
        ) from e
    assert "interrupted after" in out.stdout, out.stdout + out.stderr
    assert float(out.stdout.split()[2]) < 30.0


def test_requests_select_by_index_and_merge():
    from kvxfer import _kvxfer

    t = kvxfer.Agent("py-idx-t")
    i = kvxfer.Agent("py-idx-i")
    blk, n = 256, 16
    dst = bytearray(blk * n)
    src = bytearray(pattern(blk * n, 9))
    rt, ri = t.register(dst), i.register(src)
    name = i.add_remote_agent(t.metadata())
    L = _kvxfer.DescList([(ri.addr + k * blk, blk) for k in range(n)])
    R = _kvxfer.DescList([(rt.addr + k * blk, blk, 0) for k in range(n)])
    assert len(L) == n and L[1] == (ri.addr + blk, blk, 0) and L.mem_type == "dram"
    lid, rid = [0, 1, 2, 9, 4], [5, 6, 7, 0, 15]
    req = i.make_request("write", L, lid, R, rid, name, b"n")
    # (0,5)(1,6)(2,7) merge; (9,0) and (4,15) stay.
    assert (req.requested, req.desc_count, req.total_bytes) == (5, 3, 5 * blk)
    assert i.make_request("write", L, lid, R, rid, name, merge=False).desc_count == 5
    i.post(req).wait(WAIT)
    want = bytearray(blk * n)
    for a, b in zip(lid, rid):
        want[b * blk:(b + 1) * blk] = src[a * blk:(a + 1) * blk]
    assert dst == want
    assert t.wait_notifs(WAIT) == {"py-idx-i": [b"n"]}
    # Posted again, with another notification.
    i.post(req, b"again").wait(WAIT)
    assert t.wait_notifs(WAIT) == {"py-idx-i": [b"again"]}
    # Bad indices and shapes are refused before anything moves.
    with pytest.raises(ValueError):
        i.make_request("write", L, [n], R, [0], name)
    with pytest.raises(ValueError):
        i.make_request("write", L, [-1], R, [0], name)
    with pytest.raises(ValueError):
        i.make_request("write", L, [0, 1], R, [0], name)
    with pytest.raises(ValueError):
        i.make_request("move", L, [0], R, [0], name)
    np = pytest.importorskip("numpy", reason="numpy arrays as indices and descriptor lists")
    ids = np.array([3, 2, 1], dtype=np.int32)
    req = i.make_request("read", L, ids, R, ids.astype(np.uint64), name)
    assert req.desc_count == 3  # descending: nothing adjacent in order
    arr = np.array([(ri.addr + k * blk, blk, 0) for k in range(n)], dtype=np.int64)
    assert _kvxfer.DescList(arr)[n - 1] == L[n - 1]
    with pytest.raises(ValueError):
        i.make_request("write", L, np.arange(8)[::2], R, np.arange(4), name)
    with pytest.raises(ValueError):
        _kvxfer.DescList(np.zeros((4, 5), dtype=np.int64))
    with pytest.raises(ValueError):
        i.make_request("write", L, np.array([0.5]), R, [0], name)
    # Integer buffers of every width and sign (numpy, array.array); bad
    # values, booleans and two dimensions refused.
    import array

    for ids in (np.array([3, 2], dtype=np.int8), np.array([3, 2], dtype=np.uint16),
                array.array("q", [3, 2]), array.array("I", [3, 2])):
        assert i.make_request("write", L, ids, R, ids, name).requested == 2
    for bad in (np.array([0, -1], dtype=np.int32), np.array([1 << 40], dtype=np.uint64),
                np.array([True]), np.zeros((1, 1), dtype=np.int64)):
        with pytest.raises(ValueError):
            i.make_request("write", L, bad, R, [0] * len(bad), name)


def test_a_made_request_holds_its_regions_until_released():
    from kvxfer import _kvxfer

    t = kvxfer.Agent("py-hold-t", backend="tcp")
    i = kvxfer.Agent("py-hold-i", backend="tcp")
    blk, n = 4096, 8
    dst = bytearray(blk * n)
    src = bytearray(pattern(blk * n, 5))
    rt, ri = t.register(dst), i.register(src)
    name = i.add_remote_agent(t.metadata())
    L = _kvxfer.DescList([(ri.addr + k * blk, blk) for k in range(n)])
    R = _kvxfer.DescList([(rt.addr + k * blk, blk) for k in range(n)])
    ids = list(range(n))[::-1]
    req = i.make_request("write", L, ids, R, ids, name)
    # Prepared by the agent: its local region is held.
    with pytest.raises(kvxfer.RegionBusyError):
        ri.deregister()
    i.post(req).wait(WAIT)
    assert dst == src
    # READ by index: the peer's blocks back, in reverse order.
    back = bytearray(blk * n)
    rb = i.register(back)
    B = _kvxfer.DescList([(rb.addr + k * blk, blk) for k in range(n)])
    rd = i.make_request("read", B, list(range(n)), R, ids, name)
    i.post(rd).wait(WAIT)
    for k in range(n):
        assert back[k * blk:(k + 1) * blk] == dst[(n - 1 - k) * blk:(n - k) * blk]
    rd.release()
    rb.deregister()
    # Released: the region may go; the request still posts (checked in
    # full), and is refused, typed, once its region is gone.
    req.release()
    req.release()
    src[:blk] = bytes(blk)
    i.post(req).wait(WAIT)
    assert dst == src
    ri.deregister()
    with pytest.raises(kvxfer.NotRegisteredError):
        i.post(req)
    # A request the agent refuses when made is refused again when posted.
    gone = i.make_request("write", L, [0], R, [0], name)
    with pytest.raises(kvxfer.NotRegisteredError):
        i.post(gone)


class FakeDevice:
    def __init__(self, kind, index=None):
        self.type, self.index = kind, index


class FakeTensor:
    """Torch's tensor surface (no torch here): memory from a ctypes array."""

    def __init__(self, n, kind="cpu", contiguous=True):
        import ctypes

        self._mem = (ctypes.c_uint16 * n)()
        self._n = n
        self.device = FakeDevice(kind, 0 if kind == "cuda" else None)
        self._contiguous = contiguous

    def data_ptr(self):
        import ctypes

        return ctypes.addressof(self._mem)

    def numel(self):
        return self._n

    def element_size(self):
        return 2

    def is_contiguous(self):
        return self._contiguous


def test_tensors_register_by_address_and_host_memory_as_gpu_is_refused_typed():
    t = kvxfer.Agent("py-tensor-t")
    i = kvxfer.Agent("py-tensor-i")
    dst = FakeTensor(4096)
    src = bytearray(pattern(8192, 4))
    rt = t.register(dst)
    assert (rt.addr, rt.len, rt.mem_type) == (dst.data_ptr(), 8192, "dram")
    ri = i.register(src)
    name = i.add_remote_agent(t.metadata())
    x = i.write(ri.descs(), rt.descs(), name)
    x.wait(WAIT)
    assert bytes(dst._mem) == bytes(src)
    tele = x.telemetry()
    assert tele["bytes"] == 8192 and tele["descs"] == 1 and tele["transport"] == "tcp"
    assert tele["xfer_us"] is not None and tele["post_us"] >= 0
    rt.deregister()
    with pytest.raises(ValueError):
        t.register(FakeTensor(16, contiguous=False))
    # Host memory claiming to be on the GPU: the driver says it is not
    # (or there is no driver, as on CI): typed, nothing registered.
    with pytest.raises(kvxfer.GpuError):
        t.register(FakeTensor(16, kind="cuda"))

    class CudaArray:
        __cuda_array_interface__ = {"data": (1 << 40, False), "shape": (64,), "typestr": "<f4", "version": 3, "strides": None}

    with pytest.raises(kvxfer.GpuError):
        t.register(CudaArray())


class DLPackOnly:
    """A tensor that speaks DLPack only (as a JAX or TensorFlow CPU array
    does): no buffer protocol, no data_ptr; its export is numpy's."""

    def __init__(self, arr, device=(1, 0)):
        self._arr = arr
        self._device = device

    def __dlpack__(self, stream=None):
        return self._arr.__dlpack__()

    def __dlpack_device__(self):
        return self._device


def test_dlpack_tensors_register_contiguous_only():
    np = pytest.importorskip("numpy")
    t = kvxfer.Agent("py-dl-t")
    i = kvxfer.Agent("py-dl-i")
    arr = np.zeros((16, 64), dtype=np.float32)
    dst = DLPackOnly(arr)
    rt = t.register(dst)
    assert (rt.addr, rt.len, rt.mem_type) == (arr.ctypes.data, arr.nbytes, "dram")
    # A view into the middle: its address carries the offset.
    rows = DLPackOnly(arr[4:8])
    src = bytearray(pattern(arr.nbytes, 9))
    ri = i.register(src)
    name = i.add_remote_agent(t.metadata())
    i.write(ri.descs(), rt.descs(), name).wait(WAIT)
    assert arr.tobytes() == bytes(src)
    rt.deregister()
    r4 = t.register(rows)
    assert (r4.addr, r4.len) == (arr.ctypes.data + 4 * 64 * 4, 4 * 64 * 4)
    r4.deregister()
    # Strided: refused before anything is registered.
    with pytest.raises(ValueError):
        t.register(DLPackOnly(arr[:, ::2]))

