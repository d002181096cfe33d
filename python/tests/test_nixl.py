"""kvxfer.nixl against the real NIXL (UCX backend, DRAM): vLLM's pull
sequence in two processes — regions registered, per-block lists prepared
on both sides, a READ of scattered blocks by index with a notification,
state polled to DONE, telemetry, handles released, a notification alone —
once per implementation; return values, states, notifications and bytes
must match."""

import ctypes
import importlib
import multiprocessing as mp
import time

import pytest

BLOCK = 4096
BLOCKS = 64
SIZE = BLOCK * BLOCKS
WAIT = 60.0
spawn = mp.get_context("spawn")

# Remote blocks read, in any order, into local blocks: runs adjacent on both
# sides merge (NIXL counts descriptors after merging).
REMOTE_IDS = [3, 4, 5, 10, 11, 40, 2, 63, 62, 20]
LOCAL_IDS = [0, 1, 2, 7, 8, 9, 30, 31, 12, 50]


def pattern(n, salt):
    return bytes((i * 31 + salt) % 253 for i in range(n))


def api(module):
    return importlib.import_module(module)


def producer_main(conn, module):
    n = api(module)
    agent = n.nixl_agent("prefill-0", n.nixl_agent_config(backends=["UCX"], capture_telemetry=True))
    buf = ctypes.create_string_buffer(pattern(SIZE, 5), SIZE)
    base = ctypes.addressof(buf)
    descs = agent.get_reg_descs([(base, SIZE, 0, "")], "DRAM")
    agent.register_memory(descs)
    conn.send((agent.get_agent_metadata(), base))
    got = {}
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        if sum(len(v) for v in got.values()) >= 2:
            break
        time.sleep(0.01)
    conn.send({k: sorted(v) for k, v in got.items()})
    conn.recv()


def consumer_main(conn, module, metadata, remote_base):
    n = api(module)
    agent = n.nixl_agent("decode-0", n.nixl_agent_config(backends=["UCX"], capture_telemetry=True))
    buf = ctypes.create_string_buffer(SIZE)
    base = ctypes.addressof(buf)
    agent.register_memory(agent.get_reg_descs([(base, SIZE, 0, "")], "DRAM"))
    name = agent.add_remote_agent(metadata)
    local = [(base + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
    remote = [(remote_base + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)]
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(local, "DRAM"))
    remote_h = agent.prep_xfer_dlist(name, agent.get_xfer_descs(remote, "DRAM"))
    h = agent.make_prepped_xfer(
        "READ", local_h, LOCAL_IDS, remote_h, REMOTE_IDS, notif_msg=b"req-7:1"
    )
    first = agent.transfer(h)
    states = [first]
    deadline = time.monotonic() + WAIT
    state = first
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = agent.check_xfer_state(h)
    states.append(state)
    tele = agent.get_xfer_telemetry(h)
    agent.release_xfer_handle(h)
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    # A full prefix hit: the notification alone.
    agent.send_notif(name, b"req-8:1")
    conn.send((name, states, tele.totalBytes, tele.descCount, buf.raw))
    conn.recv()


def run(module):
    pconn, pchild = spawn.Pipe()
    p = spawn.Process(target=producer_main, args=(pchild, module))
    p.start()
    try:
        assert pconn.poll(WAIT), f"{module}: producer did not start"
        metadata, remote_base = pconn.recv()
        cconn, cchild = spawn.Pipe()
        c = spawn.Process(target=consumer_main, args=(cchild, module, metadata, remote_base))
        c.start()
        try:
            assert cconn.poll(WAIT), f"{module}: consumer did not report"
            name, states, total, count, dst = cconn.recv()
            assert pconn.poll(WAIT), f"{module}: producer did not report"
            notifs = pconn.recv()
            cconn.send("stop")
        finally:
            c.join(WAIT)
            if c.is_alive():
                c.kill()
        pconn.send("stop")
        return name, states, total, count, dst, notifs
    finally:
        p.join(WAIT)
        if p.is_alive():
            p.kill()


def expected_dst():
    src = pattern(SIZE, 5)
    want = bytearray(SIZE)
    for li, ri in zip(LOCAL_IDS, REMOTE_IDS):
        want[li * BLOCK:(li + 1) * BLOCK] = src[ri * BLOCK:(ri + 1) * BLOCK]
    return bytes(want)


def test_kvxfer_nixl_runs_the_vllm_pull_sequence():
    name, states, total, count, dst, notifs = run("kvxfer.nixl")
    assert name == b"prefill-0"
    assert states[0] in ("PROC", "DONE") and states[-1] == "DONE", states
    assert total == len(REMOTE_IDS) * BLOCK
    # 10 pairs (local, remote); runs adjacent on both sides merge:
    # (0,3)(1,4)(2,5) | (7,10)(8,11) | (9,40) | (30,2) | (31,63) | (12,62) | (50,20)
    assert count == 7, count
    assert dst == expected_dst()
    assert notifs == {"decode-0": [b"req-7:1", b"req-8:1"]}


def test_telemetry_needs_capture_telemetry_as_in_nixl():
    n = api("kvxfer.nixl")
    a = n.nixl_agent("no-telemetry", n.nixl_agent_config(backends=["UCX"]))
    buf = ctypes.create_string_buffer(BLOCK)
    base = ctypes.addressof(buf)
    a.register_memory(a.get_reg_descs([(base, BLOCK, 0, "")], "DRAM"))
    b = n.nixl_agent("peer", n.nixl_agent_config(backends=["UCX"]))
    other = ctypes.create_string_buffer(BLOCK)
    ob = ctypes.addressof(other)
    b.register_memory(b.get_reg_descs([(ob, BLOCK, 0, "")], "DRAM"))
    name = a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer(
        "WRITE", a.get_xfer_descs([(base, BLOCK, 0)], "DRAM"), a.get_xfer_descs([(ob, BLOCK, 0)], "DRAM"), name
    )
    assert a.transfer(h) in ("PROC", "DONE")
    with pytest.raises(n.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)
    a.release_xfer_handle(h)


def test_same_results_as_the_real_nixl():
    try:
        api("nixl_cu12._api")
    except ImportError as e:
        pytest.skip(f"SKIPPED: the real NIXL is not installed here ({e})")
    real = run("nixl_cu12._api")
    ours = run("kvxfer.nixl")
    assert ours[0] == real[0], f"add_remote_agent: {ours[0]!r} vs {real[0]!r}"
    assert ours[1][-1] == real[1][-1] == "DONE"
    assert ours[2] == real[2], "totalBytes"
    assert ours[3] == real[3], f"descCount: kvxfer {ours[3]} vs nixl {real[3]}"
    assert ours[4] == real[4], "destination bytes differ"
    assert ours[5] == real[5], f"notifications: {ours[5]} vs {real[5]}"


def test_descriptor_lists_edit_and_refuse_like_nixl():
    import kvxfer.nixl_bindings as b

    x = b.nixlXferDList(b.DRAM_SEG, [(1, 2, 0), (3, 4, 0)])
    x.addDesc((5, 6, 0))
    x.remDesc(0)
    assert [x[i] for i in range(x.descCount())] == [(3, 4, 0), (5, 6, 0)]
    assert x.index((5, 6, 0)) == 1
    r = b.nixlRegDList(b.DRAM_SEG, [(1, 2, 0, "m")])
    r.addDesc((9, 9, 0, b"n"))
    assert r[1] == (9, 9, 0, b"n") and r.trim().descCount() == 2
    with pytest.raises(TypeError):
        b.nixlXferDList(b.DRAM_SEG, [(1, 2)])
    with pytest.raises(TypeError):
        b.nixlXferDList(b.DRAM_SEG, [(-1, 2, 0)])
    n = api("kvxfer.nixl")
    a = n.nixl_agent("descs", n.nixl_agent_config(backends=["UCX"]))
    blob = a.get_serialized_descs(r)
    back = a.deserialize_descs(blob)
    assert type(back) is b.nixlRegDList and back[0] == (1, 2, 0, b"m")
    for bad in (b"pickle", b"KVXD1{", b'KVXD1{"mem":0,"reg":false,"descs":[[1]]}'):
        with pytest.raises(b.nixlInvalidParamError):
            a.deserialize_descs(bad)


def test_the_libfabric_plugin_moves_transfers_over_kvxfer_fabric(monkeypatch):
    """`backends=["LIBFABRIC"]` (how serving frameworks ask NIXL for EFA):
    the agents' transfers go over kvxfer's libfabric transport, here on
    provider `tcp;ofi_rxm`, with the notification after the data; the
    plugin cannot replace an agent already in use."""
    monkeypatch.delenv("KVXFER_NIXL_BACKEND", raising=False)
    monkeypatch.setenv("KVXFER_FABRIC_PROVIDER", "tcp;ofi_rxm")
    n = api("kvxfer.nixl")
    conf = n.nixl_agent_config(backends=["LIBFABRIC"])
    target = n.nixl_agent("fab-target", conf)
    init = n.nixl_agent("fab-init", conf)
    assert "LIBFABRIC" in init.get_plugin_list()
    assert init.get_backend_params("LIBFABRIC")["kvxfer_transport"] == "fabric"
    src = ctypes.create_string_buffer(pattern(SIZE, 9), SIZE)
    dst = ctypes.create_string_buffer(SIZE)
    init.register_memory(init.get_reg_descs([(ctypes.addressof(src), SIZE, 0, "")], "DRAM"))
    target.register_memory(target.get_reg_descs([(ctypes.addressof(dst), SIZE, 0, "")], "DRAM"))
    name = init.add_remote_agent(target.get_agent_metadata())
    h = init.initialize_xfer(
        "WRITE",
        init.get_xfer_descs([(ctypes.addressof(src), SIZE, 0)], "DRAM"),
        init.get_xfer_descs([(ctypes.addressof(dst), SIZE, 0)], "DRAM"),
        name,
        b"fabric-done",
    )
    state = init.transfer(h)
    deadline = time.monotonic() + WAIT
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = init.check_xfer_state(h)
    assert state == "DONE"
    assert init.query_xfer_backend(h) == "LIBFABRIC"
    assert init.query_xfer_transport(h) == "fabric"
    got = {}
    while not got and time.monotonic() < deadline:
        got = target.get_new_notifs()
    assert got == {"fab-init": [b"fabric-done"]}
    assert dst.raw == src.raw
    init.release_xfer_handle(h)
    # An agent in use keeps its transport: the plugin is refused, typed.
    late = n.nixl_agent("late", n.nixl_agent_config(backends=["UCX"]))
    late.register_memory(late.get_reg_descs([(ctypes.addressof(dst), SIZE, 0, "")], "DRAM"))
    with pytest.raises(Exception, match="before memory is registered"):
        late.create_backend("LIBFABRIC")
