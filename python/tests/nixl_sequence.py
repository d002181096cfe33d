"""A scripted NIXL session, run unmodified on the real NIXL and on kvxfer's
stand-in (whichever `import nixl` resolves to): two agents in one process,
DRAM. Prints one line, `RESULT <json>`: a list of `[step, outcome]` where
an outcome is `["ok", value]` or `["raise", exception class name]`.
Values are what the application can see and rely on; timings are reduced
to the relations NIXL promises.

    python nixl_sequence.py
"""

import ctypes
import os
import time

import nixl._bindings as bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
from session import report, step

N = 4096
def wait_done(agent, h, limit=30.0):
    deadline = time.monotonic() + limit
    s = agent.check_xfer_state(h)
    while s == "PROC" and time.monotonic() < deadline:
        s = agent.check_xfer_state(h)
    return s


def main():
    os.environ.pop("NIXL_TELEMETRY_ENABLE", None)
    step("sync modes", lambda: [m.name for m in nixl_thread_sync_t])
    step("bad sync mode", lambda: nixl_agent_config(sync_mode=2))
    step("empty name", lambda: nixl_agent(""))
    a = nixl_agent("seq-a", nixl_agent_config(backends=["UCX"], capture_telemetry=True))
    b = nixl_agent("seq-b", nixl_agent_config(backends=["UCX"]))
    e = nixl_agent("seq-e", nixl_agent_config(backends=[]))
    step("backends", lambda: sorted(a.backends))
    step("UCX in plugins", lambda: "UCX" in a.get_plugin_list())
    step("UCX mems", lambda: sorted(a.get_plugin_mem_types("UCX")))
    step("backend mems", lambda: sorted(a.get_backend_mem_types("UCX")))
    step("unknown plugin mems", lambda: a.get_plugin_mem_types("UVX"))
    step("unknown plugin params", lambda: a.get_plugin_params("UVX"))
    step("unknown backend params", lambda: a.get_backend_params("UVX"))
    step("create unknown", lambda: a.create_backend("UVX"))
    step("create again", lambda: a.create_backend("UCX"))

    bufs = [ctypes.create_string_buffer(bytes((i * 7 + k) % 251 for i in range(N)), N)
            for k in range(3)]
    pa, pb, pc = (ctypes.addressof(x) for x in bufs)

    # Descriptor lists: what NIXL accepts and refuses.
    step("xfer 4-tuple", lambda: a.get_xfer_descs([(pa, 16, 0, "m")], "DRAM"))
    step("xfer no mem type", lambda: a.get_xfer_descs([(pa, 16, 0)]))
    step("xfer bad mem type", lambda: a.get_xfer_descs([(pa, 16, 0)], "V-RAM"))
    step("reg 3-tuple", lambda: a.get_reg_descs([(pa, 16, 0)], "DRAM"))
    step("reg as xfer", lambda: a.get_xfer_descs(a.get_reg_descs([(pa, 16, 0, "")], "DRAM")))
    step("xfer as reg", lambda: a.get_reg_descs(a.get_xfer_descs([(pa, 16, 0)], "DRAM")))
    step("empty list", lambda: a.get_xfer_descs([], "DRAM"))
    step("cpu alias", lambda: int(a.get_xfer_descs([(pa, 16, 0)], "cpu").getType()))
    step("reg meta", lambda: list(a.get_reg_descs([(pa, 16, 0, "meta")], "DRAM")[0][1:]))
    step("dlist count", lambda: a.get_xfer_descs([(pa, 1, 0), (pb, 2, 0)], "DRAM").descCount())
    step("dlist item", lambda: list(bindings.nixlXferDList(bindings.DRAM_SEG, [(1, 2, 3)])[0]))
    step("dlist empty", lambda: bindings.nixlRegDList(bindings.DRAM_SEG).isEmpty())

    # Registration.
    step("register a", lambda: a.register_memory(a.get_reg_descs([(pa, N, 0, "")], "DRAM")) is not None)
    step("register a again", lambda: a.register_memory(a.get_reg_descs([(pa, N, 0, "")], "DRAM")) is not None)
    step("register b", lambda: b.register_memory(b.get_reg_descs([(pb, N, 0, "")], "DRAM")) is not None)
    step("deregister unknown", lambda: a.deregister_memory(a.get_reg_descs([(pc, N, 0, "")], "DRAM")))
    step("no-backend register", lambda: e.register_memory(e.get_reg_descs([(pc, N, 0, "")], "DRAM")))
    step("no-backend metadata", lambda: e.get_agent_metadata())
    step("no-backend prep", lambda: e.prep_xfer_dlist("", e.get_xfer_descs([(pc, 16, 0)], "DRAM")))

    # Peers.
    step("add garbage", lambda: a.add_remote_agent(b"garbage"))
    step("add b", lambda: a.add_remote_agent(b.get_agent_metadata()))
    step("add b again", lambda: a.add_remote_agent(b.get_agent_metadata()))
    step("remove unknown", lambda: a.remove_remote_agent("nobody"))
    step("notif to unknown", lambda: a.send_notif("nobody", b"x"))
    step("make_connection", lambda: a.make_connection("seq-b"))

    # Transfers: checks made when the request is made.
    def x(descs):
        return a.get_xfer_descs(descs, "DRAM")

    half = N // 2
    step("invalid op prepped", lambda: a.make_prepped_xfer("RD", 0, [], 0, []))
    step("invalid op init", lambda: a.initialize_xfer("WR", x([(pa, 1, 0)]), x([(pb, 1, 0)]), "seq-b"))
    step("init unknown agent", lambda: a.initialize_xfer("WRITE", x([(pa, 16, 0)]), x([(pb, 16, 0)]), "nobody"))
    step("init local unregistered", lambda: a.initialize_xfer("WRITE", x([(pc, 16, 0)]), x([(pb, 16, 0)]), "seq-b"))
    step("init remote unregistered", lambda: a.initialize_xfer("WRITE", x([(pa, 16, 0)]), x([(pc, 16, 0)]), "seq-b"))
    step("init length mismatch", lambda: a.initialize_xfer("WRITE", x([(pa, 16, 0)]), x([(pb, 32, 0)]), "seq-b"))
    step("init count mismatch", lambda: a.initialize_xfer("WRITE", x([(pa, 16, 0)]), x([(pb, 16, 0), (pb + 16, 16, 0)]), "seq-b"))
    step("prep unknown agent", lambda: a.prep_xfer_dlist("nobody", x([(pb, 16, 0)])))
    step("prep remote unregistered", lambda: a.prep_xfer_dlist("seq-b", x([(pc, 16, 0)])))
    step("prep local unregistered", lambda: a.prep_xfer_dlist("NIXL_INIT_AGENT", x([(pc, 16, 0)])))

    # A WRITE of two adjacent halves with a notification: combined form.
    src = x([(pa, half, 0), (pa + half, half, 0)])
    dst = x([(pb, half, 0), (pb + half, half, 0)])
    h = a.initialize_xfer("WRITE", src, dst, "seq-b", b"seq-1")
    step("transfer", lambda: a.transfer(h) in ("PROC", "DONE"))
    step("final state", lambda: wait_done(a, h))
    step("landed", lambda: ctypes.string_at(pb, N) == ctypes.string_at(pa, N))
    t = a.get_xfer_telemetry(h)
    step("telemetry counts", lambda: [t.totalBytes, t.descCount])
    step("telemetry relations", lambda: [t.startTime > 0, t.postDuration > 0,
                                        t.xferDuration >= t.postDuration])
    # NIXL's steady clock: its epoch is not the wall clock's.
    step("telemetry clock", lambda: abs(t.startTime - time.monotonic_ns() // 1000) < 60_000_000)
    step("telemetry type", lambda: type(t).__name__)
    step("no telemetry", lambda: b.get_xfer_telemetry(h))
    step("query backend", lambda: a.query_xfer_backend(h))
    step("repost", lambda: a.transfer(h) in ("PROC", "DONE"))
    step("repost state", lambda: wait_done(a, h))
    step("release", lambda: a.release_xfer_handle(h))
    step("release again", lambda: a.release_xfer_handle(h))

    # Prepared lists, by index: adjacent pairs merge unless told not to.
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", x([(pa + i * 256, 256, 0) for i in range(16)]))
    remote = a.prep_xfer_dlist("seq-b", x([(pb + i * 256, 256, 0) for i in range(16)]))
    for skip in (False, True):
        h2 = a.make_prepped_xfer("READ", local, [0, 1, 2, 9, 5], remote, [3, 4, 5, 0, 15],
                                 b"", skip_desc_merge=skip)
        a.transfer(h2)
        step(f"prepped state skip={skip}", lambda h2=h2: wait_done(a, h2))
        step(f"prepped descCount skip={skip}", lambda h2=h2: a.get_xfer_telemetry(h2).descCount)
        a.release_xfer_handle(h2)
    step("index count mismatch", lambda: a.make_prepped_xfer("READ", local, [0, 1], remote, [0]))
    step("index out of range", lambda: a.make_prepped_xfer("READ", local, [0, 99], remote, [0, 1]))
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)

    # Notifications: standalone, then what the target sees.
    step("send notif", lambda: a.send_notif("seq-b", b"seq-2"))
    deadline = time.monotonic() + 30
    got = {}
    while sum(len(v) for v in got.values()) < 3 and time.monotonic() < deadline:
        for k, v in b.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
    step("notifs", lambda: {k: sorted(m.decode() for m in v) for k, v in got.items()})
    step("check done nothing", lambda: b.check_remote_xfer_done("seq-a", b"seq"))
    a.send_notif("seq-b", b"tag-x-1")
    deadline = time.monotonic() + 30
    found = False
    while not found and time.monotonic() < deadline:
        found = b.check_remote_xfer_done("seq-a", b"x-1", tag_is_prefix=False)
    step("check done substring", lambda: found)
    step("remove b", lambda: a.remove_remote_agent("seq-b"))
    step("transfer after remove", lambda: a.prep_xfer_dlist("seq-b", x([(pb, 16, 0)])))

    # Telemetry switched by the environment, over the config.
    def write_64(name, capture):
        ag = nixl_agent(name, nixl_agent_config(backends=["UCX"], capture_telemetry=capture))
        ag.register_memory(ag.get_reg_descs([(pc, N, 0, "")], "DRAM"))
        ag.add_remote_agent(b.get_agent_metadata())
        hh = ag.initialize_xfer("WRITE", ag.get_xfer_descs([(pc, 64, 0)], "DRAM"),
                                ag.get_xfer_descs([(pb, 64, 0)], "DRAM"), "seq-b")
        ag.transfer(hh)
        wait_done(ag, hh)
        return ag, hh

    os.environ["NIXL_TELEMETRY_ENABLE"] = "n"
    c, hc = write_64("seq-c", True)
    step("env off", lambda: c.get_xfer_telemetry(hc))
    c.release_xfer_handle(hc)
    os.environ["NIXL_TELEMETRY_ENABLE"] = "y"
    d, hd = write_64("seq-d", False)
    step("env on", lambda: d.get_xfer_telemetry(hd).totalBytes)
    d.release_xfer_handle(hd)
    os.environ.pop("NIXL_TELEMETRY_ENABLE")

    # The bindings' agent, as NIXL's pybind module gives it.
    import pickle

    lst = bindings.nixlXferDList(bindings.DRAM_SEG, [(1000, 105, 0), (2000, 30, 0)])
    step("pickled list equal", lambda: pickle.loads(pickle.dumps(lst)) == lst)
    step("edited list differs", lambda: bindings.nixlXferDList(bindings.DRAM_SEG, [(1, 2, 0)]) == lst)
    cfg = bindings.nixlAgentConfig()
    cfg.useProgThread = False
    x1, x2 = bindings.nixlAgent("raw-1", cfg), bindings.nixlAgent("raw-2", cfg)
    u1, u2 = x1.createBackend("UCX", {}), x2.createBackend("UCX", {})
    r1 = bindings.nixlRegDList(bindings.DRAM_SEG)
    r1.addDesc((pa, N, 0, "dead"))
    r2 = bindings.nixlRegDList(bindings.DRAM_SEG)
    r2.addDesc((pc, N, 0, "dead"))
    step("raw register", lambda: [int(x1.registerMem(r1, [u1])), int(x2.registerMem(r2, [u2]))])
    step("raw load", lambda: x1.loadRemoteMD(x2.getLocalMD()))
    src = bindings.nixlXferDList(bindings.DRAM_SEG)
    src.addDesc((pa + 8, 8, 0))
    dst = bindings.nixlXferDList(bindings.DRAM_SEG)
    dst.addDesc((pc + 8, 8, 0))
    req = x1.createXferReq(bindings.NIXL_WRITE, src, dst, "raw-2", "n\0tification")
    st = x1.postXferReq(req)
    step("raw post", lambda: st in (bindings.NIXL_SUCCESS, bindings.NIXL_IN_PROG))
    deadline = time.monotonic() + 30
    notes = {}
    while (st != bindings.NIXL_SUCCESS or not notes) and time.monotonic() < deadline:
        if st != bindings.NIXL_SUCCESS:
            st = x1.getXferStatus(req)
        if not notes:
            notes = x2.getNotifs(notes)
    step("raw status", lambda: int(st))
    step("raw notifs", lambda: notes)
    step("raw landed", lambda: ctypes.string_at(pc + 8, 8) == ctypes.string_at(pa + 8, 8))
    step("raw release", lambda: int(x1.releaseXferReq(req)))
    step("raw deregister", lambda: int(x1.deregisterMem(r1, [u1])))
    step("raw deregister again", lambda: x1.deregisterMem(r1, [u1]))
    step("raw invalidate", lambda: int(x1.invalidateRemoteMD("raw-2")))

    report()
    # The real NIXL may crash in its destructors at exit: the result is out.
    os._exit(0)


if __name__ == "__main__":
    main()
