"""Disaggregated prefill -> decode with heterogeneous TP, through kvxfer's
native Python API: a context executor with TP2 (two ranks, two processes)
writes a request's paged KV cache straight into the pool of a generation
executor with TP1 (this process). Every element is checked.

    python examples/python/disagg_prefill_decode.py [--backend tcp|shm|auto]
"""

import argparse
import multiprocessing as mp
import sys
import time

import kvxfer

LAYERS, HEADS, HEAD_SIZE, TOKENS_PER_BLOCK = 4, 8, 64, 16
TOKENS = 40  # three blocks, the last one partial
POOL_BLOCKS = 8


def ctx_state():
    return kvxfer.CacheState(LAYERS, HEADS // 2, HEAD_SIZE, TOKENS_PER_BLOCK, "bf16", tp=2)


def gen_state():
    return kvxfer.CacheState(LAYERS, HEADS, HEAD_SIZE, TOKENS_PER_BLOCK, "bf16", tp=1)


def context_rank(rank, backend, conn):
    """One prefill rank: computes (here: fills with the test pattern) its
    share of the request's blocks and sends it when the decode side asks."""
    ctx, gen = ctx_state(), gen_state()
    agent = kvxfer.Agent(f"ctx-{rank}", backend=backend)
    bb = kvxfer.block_bytes(ctx, rank, gen)
    pool = bytearray(bb * POOL_BLOCKS)
    reg = agent.register(pool)
    n = -(-TOKENS // TOKENS_PER_BLOCK)
    blocks = [5, 2, 7][:n]  # scattered in the pool
    for logical, b in enumerate(blocks):
        kvxfer.pattern_fill(ctx, rank, gen, pool, b * bb, logical)
    sender = kvxfer.CacheSender(agent, ctx, rank)
    conn.send(agent.connection_info())
    request_id = conn.recv()
    stats = sender.send(request_id, [reg.addr + b * bb for b in blocks]).wait(60.0)
    conn.send(stats)
    conn.recv()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tcp")
    args = ap.parse_args()
    spawn = mp.get_context("spawn")
    ranks = []
    for r in range(2):
        parent, child = spawn.Pipe()
        # Daemons: they go with this process if it fails.
        p = spawn.Process(target=context_rank, args=(r, args.backend, child), daemon=True)
        p.start()
        ranks.append((p, parent))
    connections = [c.recv() for _, c in ranks]

    ctx, gen = ctx_state(), gen_state()
    agent = kvxfer.Agent("gen-0", backend=args.backend)
    bb = kvxfer.block_bytes(gen, 0, ctx)
    pool = bytearray(bb * POOL_BLOCKS)
    reg = agent.register(pool)
    receiver = kvxfer.CacheReceiver(agent, gen, 0, ctx, connections)
    request_id = 0x7E57_0001
    n = -(-TOKENS // TOKENS_PER_BLOCK)
    dst = [1, 6, 3][:n]
    t0 = time.perf_counter()
    handle = receiver.request(request_id, [reg.addr + b * bb for b in dst])
    for _, c in ranks:
        c.send(request_id)
    stats = handle.wait(60.0)
    dt = time.perf_counter() - t0
    sent = [c.recv() for _, c in ranks]
    for logical, b in enumerate(dst):
        bad = kvxfer.pattern_check(gen, 0, ctx, pool, b * bb, logical, TOKENS)
        if bad:
            print("MISMATCH:", bad)
            sys.exit(1)
    print(
        f"request {request_id:#x}: {stats['bytes']} bytes in {stats['fragments_coalesced']} "
        f"writes from 2 context ranks (TP2 -> TP1), {stats['staging_copies']} staging copies, "
        f"{dt * 1e3:.1f} ms; every element checked"
    )
    assert sum(s["bytes"] for s in sent) == stats["bytes"]
    for p, c in ranks:
        c.send("stop")
        p.join(30)


if __name__ == "__main__":
    main()
