"""The calls serving frameworks make, with their import lines, as two
processes on one host (DRAM), run unmodified on the real libraries and on
kvxfer's stand-ins (whichever `nixl` / `mooncake` resolve to):

    python frameworks.py FRAMEWORK ROLE EXCHANGE_DIR

FRAMEWORK is `vllm` (NixlConnector's pull: per-block lists prepared on
both sides, a READ by index with a notification, telemetry, a
notification alone), `sglang-nixl` (the prefill pushes KV chunks and an
aux slot with `initialize_xfer("WRITE")`, the decode counts
notifications), `sglang-mooncake` (per-layer batch writes over a P2P
session, protocol `rdma` falling back) or `lmcache` (the NIXL channel's
two-stage set-up with serialized descriptor lists, then a write and a read
by page index). The two roles meet through files in EXCHANGE_DIR. Each
prints `RESULT <json>`: what it observed.
"""

import ctypes
import json
import os
import sys
import time
import uuid

WAIT = 60.0
LAYERS = 4
BLOCK = 4096
BLOCKS = 32


def pattern(n, salt):
    return bytes((i * 31 + salt) % 253 for i in range(n))


class Exchange:
    """Messages between the two roles, as files written whole."""

    def __init__(self, d, me):
        self.d = d
        self.me = me

    def put(self, tag, obj):
        path = os.path.join(self.d, f"{self.me}-{tag}")
        with open(path + ".tmp", "w") as f:
            json.dump(obj, f, default=lambda b: {"hex": bytes(b).hex()})
        os.rename(path + ".tmp", path)

    def get(self, peer, tag):
        path = os.path.join(self.d, f"{peer}-{tag}")
        deadline = time.monotonic() + WAIT
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{peer} never sent {tag}")
            time.sleep(0.005)
        with open(path) as f:
            return json.load(f, object_hook=lambda o: bytes.fromhex(o["hex"]) if "hex" in o else o)


def buffers(count, size, salt):
    bufs = [ctypes.create_string_buffer(pattern(size, salt + k), size) for k in range(count)]
    return bufs, [ctypes.addressof(b) for b in bufs]


def poll(agent, handle):
    deadline = time.monotonic() + WAIT
    state = agent.check_xfer_state(handle)
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    return state


def notifs_until(agent, count):
    got = {}
    deadline = time.monotonic() + WAIT
    while sum(len(v) for v in got.values()) < count and time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    return got


# -- vLLM NixlConnector (pull) ----------------------------------------------


def vllm(role, ex):
    from nixl._api import nixl_agent as NixlWrapper
    from nixl._bindings import nixlXferTelemetry
    from nixl._api import nixl_agent_config

    agent = NixlWrapper(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    # K and V per layer, one region each.
    bufs, bases = buffers(2 * LAYERS, BLOCK * BLOCKS, 1 if role == "prefill" else 100)
    descs = agent.get_reg_descs([(b, BLOCK * BLOCKS, 0, "") for b in bases], "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    if role == "prefill":
        ex.put("meta", {"md": agent.get_agent_metadata(), "bases": bases, "name": agent.name})
        got = notifs_until(agent, 2)
        consumer = ex.get("decode", "done")
        return {
            "notifs": {k == consumer["name"]: sorted(m.decode() for m in v) for k, v in got.items()},
            "source unchanged": all(
                ctypes.string_at(b, BLOCK * BLOCKS) == pattern(BLOCK * BLOCKS, 1 + k)
                for k, b in enumerate(bases)
            ),
        }
    peer = ex.get("prefill", "meta")
    remote = agent.add_remote_agent(peer["md"])
    local = [(b + i * BLOCK, BLOCK, 0) for b in bases for i in range(BLOCKS)]
    far = [(b + i * BLOCK, BLOCK, 0) for b in peer["bases"] for i in range(BLOCKS)]
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(local, "DRAM"))
    remote_h = agent.prep_xfer_dlist(remote, agent.get_xfer_descs(far, "DRAM"))
    import numpy as np

    # Blocks 3,4,5 and 9 of the request, in every layer's K and V.
    remote_ids = np.array([r * BLOCKS + i for r in range(2 * LAYERS) for i in (3, 4, 5, 9)])
    local_ids = np.array([r * BLOCKS + i for r in range(2 * LAYERS) for i in (10, 11, 12, 0)])
    h = agent.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids,
                                notif_msg=b"req-1:1")
    first = agent.transfer(h)
    state = poll(agent, h)
    t = agent.get_xfer_telemetry(h)
    agent.release_xfer_handle(h)
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    agent.send_notif(remote, b"req-2:1")
    ok = True
    for r in range(2 * LAYERS):
        src = pattern(BLOCK * BLOCKS, 1 + r)
        for li, ri in zip((10, 11, 12, 0), (3, 4, 5, 9)):
            ok &= ctypes.string_at(bases[r] + li * BLOCK, BLOCK) == src[ri * BLOCK:(ri + 1) * BLOCK]
    ex.put("done", {"name": agent.name})
    return {
        "remote name": remote == peer["name"].encode(),
        "first": first in ("PROC", "DONE"),
        "state": state,
        "telemetry": [isinstance(t, nixlXferTelemetry), t.totalBytes, t.descCount],
        "data": ok,
    }


# -- SGLang, NIXL backend (push) --------------------------------------------


def group_contiguous(src, dst):
    """Runs of consecutive indices on both sides (as SGLang groups them)."""
    runs = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0][-1] + 1 and d == runs[-1][1][-1] + 1:
            runs[-1][0].append(s)
            runs[-1][1].append(d)
        else:
            runs.append(([s], [d]))
    return runs


def sglang_nixl(role, ex):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    from nixl._bindings import nixlBackendError, nixlCancelledError, nixlRemoteDisconnectError

    agent = nixl_agent(
        str(uuid.uuid4()),
        nixl_agent_config(backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW),
    )
    plugins = agent.get_plugin_list()
    agent.create_backend("UCX")
    kv, kv_ptrs = buffers(LAYERS, BLOCK * BLOCKS, 7 if role == "prefill" else 50)
    aux, aux_ptrs = buffers(1, 512, 9 if role == "prefill" else 60)
    kv_descs = agent.register_memory([(p, BLOCK * BLOCKS, 0, "") for p in kv_ptrs], "DRAM")
    aux_descs = agent.register_memory([(aux_ptrs[0], 512, 0, "")], "DRAM")
    if role == "decode":
        ex.put("args", {"md": agent.get_agent_metadata(), "name": agent.name, "kv": kv_ptrs,
                        "aux": aux_ptrs})
        got = notifs_until(agent, 3)
        msgs = sorted(m.decode("ascii") for v in got.values() for m in v)
        ok = all(
            ctypes.string_at(kv_ptrs[layer] + d * BLOCK, BLOCK)
            == pattern(BLOCK * BLOCKS, 7 + layer)[s * BLOCK:(s + 1) * BLOCK]
            for layer in range(LAYERS) for s, d in zip(SRC_PAGES, DST_PAGES)
        )
        aux_ok = ctypes.string_at(aux_ptrs[0] + 128, 64) == pattern(512, 9)[64:128]
        return {"plugins": "UCX" in plugins, "notifs": msgs, "kv": ok, "aux": aux_ok,
                "registered": [kv_descs is not None, aux_descs is not None]}
    peer = ex.get("decode", "args")
    agent.add_remote_agent(peer["md"])
    handles = []
    for chunk, (src_pages, dst_pages) in enumerate(((SRC_PAGES[:3], DST_PAGES[:3]),
                                                    (SRC_PAGES[3:], DST_PAGES[3:]))):
        src, dst = [], []
        for layer in range(LAYERS):
            for s_run, d_run in group_contiguous(src_pages, dst_pages):
                src.append((kv_ptrs[layer] + s_run[0] * BLOCK, BLOCK * len(s_run), 0))
                dst.append((peer["kv"][layer] + d_run[0] * BLOCK, BLOCK * len(s_run), 0))
        notif = "_".join(["7", "kv", str(chunk), str(int(chunk == 1))])
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"),
                                  agent.get_xfer_descs(dst, "DRAM"), peer["name"],
                                  notif.encode("ascii"))
        handles.append((h, agent.transfer(h)))
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(aux_ptrs[0] + 64, 64, 0)], "DRAM"),
                              agent.get_xfer_descs([(peer["aux"][0] + 128, 64, 0)], "DRAM"),
                              peer["name"], b"7_aux")
    handles.append((h, agent.transfer(h)))
    try:
        states = [poll(agent, h) for h, _ in handles]
    except (nixlRemoteDisconnectError, nixlBackendError, nixlCancelledError) as e:
        states = [type(e).__name__]
    return {"plugins": "UCX" in plugins, "posted": [s != "ERR" for _, s in handles],
            "states": states}


SRC_PAGES = [2, 3, 4, 10, 11, 20]
DST_PAGES = [5, 6, 7, 1, 2, 30]


# -- SGLang, Mooncake backend -----------------------------------------------


def sglang_mooncake(role, ex):
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = [te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")]
    kv, kv_ptrs = buffers(LAYERS, BLOCK * BLOCKS, 3 if role == "prefill" else 40)
    rc.append(te.batch_register_memory(kv_ptrs, [BLOCK * BLOCKS] * LAYERS))
    if role == "decode":
        ex.put("args", {"session": f"127.0.0.1:{te.get_rpc_port()}", "kv": kv_ptrs})
        ex.get("prefill", "done")
        ok = all(
            ctypes.string_at(kv_ptrs[layer] + d * BLOCK, BLOCK)
            == pattern(BLOCK * BLOCKS, 3 + layer)[s * BLOCK:(s + 1) * BLOCK]
            for layer in range(LAYERS) for s, d in zip(SRC_PAGES, DST_PAGES)
        )
        rc.append(te.batch_unregister_memory(kv_ptrs))
        return {"rc": rc, "kv": ok}
    peer = ex.get("decode", "args")
    for layer in range(LAYERS):
        src, dst, lens = [], [], []
        for s_run, d_run in group_contiguous(SRC_PAGES, DST_PAGES):
            src.append(kv_ptrs[layer] + s_run[0] * BLOCK)
            dst.append(peer["kv"][layer] + d_run[0] * BLOCK)
            lens.append(BLOCK * len(s_run))
        rc.append(te.batch_transfer_sync_write(peer["session"], src, dst, lens))
    ex.put("done", {})
    return {"rc": rc}


# -- LMCache NIXL channel ---------------------------------------------------


def lmcache(role, ex):
    from nixl._api import nixl_agent as NixlAgent
    from nixl._api import nixl_agent_config

    pages = 16
    size = pages * BLOCK
    buf, (ptr,) = buffers(1, size, 5 if role == "sender" else 70)
    agent = NixlAgent(str(uuid.uuid4()), nixl_agent_config(backends=["UCX"]))
    reg_descs = agent.get_reg_descs([(ptr, size, 0, "")], mem_type="cpu")
    agent.register_memory(reg_descs)
    xfer_descs = agent.get_xfer_descs([(a, BLOCK, 0) for a in range(ptr, ptr + size, BLOCK)],
                                      mem_type="cpu")
    xfer_handler = agent.prep_xfer_dlist("", xfer_descs, mem_type="cpu")
    if role == "receiver":
        # The init side channel: answers the two set-up requests.
        init = ex.get("sender", "init")
        name = agent.add_remote_agent(init["md"])
        ex.put("init", {"name": name, "md": agent.get_agent_metadata()})
        reg = ex.get("sender", "memreg")
        remote_h = agent.prep_xfer_dlist(reg["name"], agent.deserialize_descs(reg["dlist"]))
        ex.put("memreg", {"dlist": agent.get_serialized_descs(xfer_descs)})
        ex.get("sender", "done")
        ok = all(ctypes.string_at(ptr + d * BLOCK, BLOCK) == pattern(size, 5)[s * BLOCK:(s + 1) * BLOCK]
                 for s, d in ((0, 8), (1, 9), (5, 2)))
        agent.deregister_memory(reg_descs)
        agent.release_dlist_handle(xfer_handler)
        agent.release_dlist_handle(remote_h)
        return {"sender name": name == init["name"].encode(), "written": ok}
    ex.put("init", {"md": agent.get_agent_metadata(), "name": agent.name})
    resp = ex.get("receiver", "init")
    remote_name = agent.add_remote_agent(resp["md"])
    ex.put("memreg", {"name": resp["name"], "dlist": agent.get_serialized_descs(xfer_descs)})
    reg = ex.get("receiver", "memreg")
    remote_h = agent.prep_xfer_dlist(remote_name, agent.deserialize_descs(reg["dlist"]))
    results = []
    for op, local, far in (("WRITE", [0, 1, 5], [8, 9, 2]), ("READ", [12, 13], [3, 4])):
        h = agent.make_prepped_xfer(op, xfer_handler, local, remote_h, far)
        agent.transfer(h)
        while True:
            status = agent.check_xfer_state(h)
            if status != "PROC":
                break
            time.sleep(0.001)
        results.append(status)
        agent.release_xfer_handle(h)
    read_ok = all(ctypes.string_at(ptr + d * BLOCK, BLOCK) == pattern(size, 70)[s * BLOCK:(s + 1) * BLOCK]
                  for d, s in ((12, 3), (13, 4)))
    ex.put("done", {})
    agent.deregister_memory(reg_descs)
    agent.release_dlist_handle(xfer_handler)
    agent.release_dlist_handle(remote_h)
    return {"states": results, "read": read_ok}


ROLES = {
    "vllm": (vllm, ("prefill", "decode")),
    "sglang-nixl": (sglang_nixl, ("prefill", "decode")),
    "sglang-mooncake": (sglang_mooncake, ("prefill", "decode")),
    "lmcache": (lmcache, ("sender", "receiver")),
}


def main():
    framework, role, d = sys.argv[1:4]
    fn, roles = ROLES[framework]
    assert role in roles
    result = fn(role, Exchange(d, role))
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    # The real NIXL may crash in its destructors at exit: the result is out.
    os._exit(0)


if __name__ == "__main__":
    main()
