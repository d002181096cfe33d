"""Shared pools from Python: a target in another process registers a
`SharedPool`; a shm initiator maps it and copies with plain loads and
stores, both ways; deregistration revokes the mapping."""

import multiprocessing as mp

import kvxfer

SIZE = 1 << 20
WAIT = 30.0
spawn = mp.get_context("spawn")


def pattern(n, salt=0):
    return bytes((i * 7 + salt) % 251 for i in range(n))


def pool_target(conn):
    agent = kvxfer.Agent("py-pool-target", backend="shm")
    pool = kvxfer.SharedPool(SIZE)
    view = pool.buffer()
    view[:] = pattern(SIZE, salt=1)
    reg = agent.register_pool(pool)
    conn.send((agent.connection_info(), reg.addr, reg.len))
    # Told when the initiator is done: report what landed, deregister.
    conn.recv()
    conn.send(bytes(view))
    reg.deregister()
    conn.send("deregistered")
    conn.recv()


def pooled(agent):
    for line in agent.metrics_text().splitlines():
        if line.startswith("kvxfer_shm_pool_copies_total"):
            return int(line.rsplit(" ", 1)[1])
    return 0


def pool_mappings():
    with open("/proc/self/maps") as f:
        return sum("memfd:kvxfer-pool" in line for line in f)


def test_a_shared_pool_is_mapped_copied_and_revoked():
    conn, child = spawn.Pipe()
    proc = spawn.Process(target=pool_target, args=(child,))
    proc.start()
    try:
        assert conn.poll(WAIT), "the target did not start"
        info, addr, length = conn.recv()
        assert length == SIZE
        a = kvxfer.Agent("py-pool-init", backend="shm")
        name = a.connect(info)
        back = bytearray(SIZE)
        with a.register(back) as dst:
            a.read(dst.descs(), [(addr, SIZE)], name).wait(WAIT)
        assert bytes(back) == pattern(SIZE, salt=1)
        data = bytearray(pattern(SIZE, salt=2))
        with a.register(data) as src:
            a.write(src.descs(), [(addr, SIZE)], name).wait(WAIT)
        assert pooled(a) == 2
        assert pool_mappings() == 1
        conn.send("report")
        assert conn.poll(WAIT)
        assert conn.recv() == bytes(data)
        assert conn.poll(WAIT)
        assert conn.recv() == "deregistered"
        # Revoked before the target's deregistration returned.
        assert pool_mappings() == 0
        conn.send("stop")
    finally:
        proc.join(WAIT)
        if proc.is_alive():
            proc.kill()


def test_a_pool_is_memory_of_its_own():
    pool = kvxfer.SharedPool(4096)
    assert len(pool) == 4096 and pool.addr != 0
    v = pool.buffer()
    v[10] = 7
    assert pool.buffer()[10] == 7
    try:
        kvxfer.SharedPool()
    except ValueError:
        pass
    else:
        raise AssertionError("a pool needs a size or a descriptor")
    t = kvxfer.Agent("py-pool-only", backend="shm")
    reg = t.register_pool(pool, read_only=True)
    assert reg.descs() == [(pool.addr, 4096)]
    reg.deregister()
