"""WRITE 64 KiB x 256 (16 MiB a request) between two processes over TCP on
loopback, side by side in one run: kvxfer's native Python API, kvxfer.nixl
with prepared lists, kvxfer.mooncake's batch write, and (when installed) the real NIXL (UCX over TCP) and
the real Mooncake (TCP) on the same call sequence; plus the per-call cost of
make_prepped_xfer + transfer with 4,096 descriptor indices.

    target/pyenv/bin/python python/bench/bench_write.py [--rounds 3] [--secs 2]

Prints one JSON object per line; the last line is the summary.
"""

import argparse
import ctypes
import importlib
import json
import multiprocessing as mp
import os
import statistics
import time

BLOCK = 64 << 10
BATCH = 256
SIZE = BLOCK * BATCH
spawn = mp.get_context("spawn")


def target(conn, kind):
    buf = ctypes.create_string_buffer(SIZE)
    addr = ctypes.addressof(buf)
    if kind == "native":
        import kvxfer

        a = kvxfer.Agent("bench-target", backend="tcp")
        a.register_raw([(addr, SIZE, 0)])
        conn.send((a.metadata(), addr))
    elif kind in ("kvxfer.nixl", "nixl_cu12._api"):
        n = importlib.import_module(kind)
        a = n.nixl_agent("bench-target", n.nixl_agent_config(backends=["UCX"]))
        a.register_memory(a.get_reg_descs([(addr, SIZE, 0, "")], "DRAM"))
        conn.send((a.get_agent_metadata(), addr))
    else:  # mooncake
        m = importlib.import_module(kind)
        te = m.TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert te.register_memory(addr, SIZE) == 0
        conn.send((f"127.0.0.1:{te.get_rpc_port()}", addr))
    conn.recv()


def measure(kind, secs):
    conn, child = spawn.Pipe()
    p = spawn.Process(target=target, args=(child, kind))
    p.start()
    meta, raddr = conn.recv()
    src = ctypes.create_string_buffer(b"\x5a" * SIZE, SIZE)
    saddr = ctypes.addressof(src)
    local = [(saddr + i * BLOCK, BLOCK) for i in range(BATCH)]
    remote = [(raddr + i * BLOCK, BLOCK) for i in range(BATCH)]
    try:
        if kind == "native":
            import kvxfer

            a = kvxfer.Agent("bench-init", backend="tcp")
            a.register_raw([(saddr, SIZE, 0)])
            name = a.add_remote_agent(meta)
            # Separate descriptors, as the other engines get them.
            req = a.make_request(
                "write",
                kvxfer._kvxfer.DescList(local),
                list(range(BATCH)),
                kvxfer._kvxfer.DescList(remote),
                list(range(BATCH)),
                name,
                merge=False,
            )

            def once():
                a.post(req).wait(30.0)
        elif kind in ("kvxfer.nixl", "nixl_cu12._api"):
            n = importlib.import_module(kind)
            a = n.nixl_agent("bench-init", n.nixl_agent_config(backends=["UCX"]))
            a.register_memory(a.get_reg_descs([(saddr, SIZE, 0, "")], "DRAM"))
            name = a.add_remote_agent(meta)
            lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(x, n_, 0) for x, n_ in local], "DRAM")
            rh = a.prep_xfer_dlist(name, [(x, n_, 0) for x, n_ in remote], "DRAM")
            ids = list(range(BATCH))
            h = a.make_prepped_xfer("WRITE", lh, ids, rh, ids, skip_desc_merge=True)

            def once():
                s = a.transfer(h)
                while s == "PROC":
                    s = a.check_xfer_state(h)
                assert s == "DONE", s
        else:
            m = importlib.import_module(kind)
            te = m.TransferEngine()
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            assert te.register_memory(saddr, SIZE) == 0
            srcs = [x for x, _ in local]
            dsts = [x for x, _ in remote]
            lens = [BLOCK] * BATCH

            def once():
                assert te.batch_transfer_sync_write(meta, srcs, dsts, lens) == 0

        for _ in range(5):
            once()
        n_ = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < secs:
            once()
            n_ += 1
        dt = time.perf_counter() - t0
        return n_ * SIZE / dt / 1e9
    finally:
        conn.send("stop")
        p.join(30)
        if p.is_alive():
            p.kill()


def bench_cli(secs):
    """kvxfer-bench on the same workload (its target in another process)."""
    import subprocess

    exe = os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "kvxfer-bench")
    iters = max(20, int(secs * 150))
    out = subprocess.run(
        [exe, "--backend", "tcp", "--op", "write", "--block-size", "64KiB", "--batch", "256",
         "--iters", str(iters), "--warmup", "5", "--json"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    return json.loads(out.stdout.splitlines()[0])["gb_per_s"]


def call_overhead():
    """µs per make_prepped_xfer + transfer (posting only) with 4,096
    descriptor indices (numpy int arrays), kvxfer.nixl to a peer over TCP."""
    import numpy as np

    os.environ["KVXFER_NIXL_BACKEND"] = "tcp"
    n = importlib.import_module("kvxfer.nixl")
    t = n.nixl_agent("ovh-target", n.nixl_agent_config(backends=["UCX"]))
    i = n.nixl_agent("ovh-init", n.nixl_agent_config(backends=["UCX"]))
    cnt, blk = 4096, 4096
    dst = ctypes.create_string_buffer(cnt * blk)
    src = ctypes.create_string_buffer(cnt * blk)
    d, s = ctypes.addressof(dst), ctypes.addressof(src)
    t.register_memory(t.get_reg_descs([(d, cnt * blk, 0, "")], "DRAM"))
    i.register_memory(i.get_reg_descs([(s, cnt * blk, 0, "")], "DRAM"))
    name = i.add_remote_agent(t.get_agent_metadata())
    ldesc = np.array([(s + k * blk, blk, 0) for k in range(cnt)], dtype=np.int64)
    rdesc = np.array([(d + k * blk, blk, 0) for k in range(cnt)], dtype=np.int64)
    lh = i.prep_xfer_dlist("NIXL_INIT_AGENT", ldesc, "DRAM")
    rh = i.prep_xfer_dlist(name, rdesc, "DRAM")
    rng = np.random.default_rng(7)
    samples = []
    for _ in range(200):
        lid = rng.permutation(cnt).astype(np.int32)
        rid = rng.permutation(cnt).astype(np.int32)
        t0 = time.perf_counter_ns()
        h = i.make_prepped_xfer("WRITE", lh, lid, rh, rid, notif_msg=b"x")
        st = i.transfer(h)
        samples.append((time.perf_counter_ns() - t0) / 1000)
        while st == "PROC":
            st = i.check_xfer_state(h)
        i.release_xfer_handle(h)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--secs", type=float, default=2.0)
    args = ap.parse_args()
    os.environ.setdefault("KVXFER_NIXL_BACKEND", "tcp")
    os.environ.setdefault("UCX_TLS", "tcp")
    kinds = ["cli", "native", "kvxfer.nixl", "kvxfer.mooncake"]
    for mod in ("nixl_cu12._api", "mooncake.engine"):
        try:
            importlib.import_module(mod)
            kinds.append(mod)
        except ImportError:
            print(json.dumps({"skipped": mod, "why": "not installed"}))
    res = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else list(reversed(kinds))):
            v = bench_cli(args.secs) if k == "cli" else measure(k, args.secs)
            res[k].append(v)
            print(json.dumps({"round": r, "kind": k, "gb_per_s": round(v, 3)}), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    summary = {"median_gb_per_s": {k: round(v, 3) for k, v in med.items()}}
    summary["native_vs_cli"] = round(med["native"] / med["cli"], 3)
    summary["nixl_front_vs_cli"] = round(med["kvxfer.nixl"] / med["cli"], 3)
    if "nixl_cu12._api" in med:
        summary["nixl_front_vs_real_nixl"] = round(med["kvxfer.nixl"] / med["nixl_cu12._api"], 3)
    if "mooncake.engine" in med:
        summary["native_vs_real_mooncake"] = round(med["native"] / med["mooncake.engine"], 3)
        summary["mooncake_front_vs_real_mooncake"] = round(
            med["kvxfer.mooncake"] / med["mooncake.engine"], 3
        )
    summary["make_prepped_xfer_plus_transfer_4096_us"] = round(call_overhead(), 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
