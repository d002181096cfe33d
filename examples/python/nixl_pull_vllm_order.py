"""The transfer vLLM's NixlConnector makes (pull mode), through kvxfer.nixl
in vLLM's call order: the decode side registers its KV regions, prepares a
per-block list of its own and of the prefill side's blocks, READs the
blocks of a request by index with a notification, polls the state, reads
the telemetry and releases the handles; the prefill side frees its blocks
when the notification arrives.

    python examples/python/nixl_pull_vllm_order.py
"""

import ctypes
import multiprocessing as mp
import time

import kvxfer.nixl as nixl_api

BLOCK, BLOCKS = 16 << 10, 32


def prefill(conn):
    agent = nixl_api.nixl_agent("prefill-0", nixl_api.nixl_agent_config(capture_telemetry=True))
    kv = ctypes.create_string_buffer(bytes(range(256)) * (BLOCK * BLOCKS // 256), BLOCK * BLOCKS)
    base = ctypes.addressof(kv)
    agent.register_memory(agent.get_reg_descs([(base, BLOCK * BLOCKS, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), base))
    while True:
        notifs = agent.get_new_notifs()
        if notifs:
            conn.send(notifs)
            break
        time.sleep(0.001)
    conn.recv()


def main():
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    p = spawn.Process(target=prefill, args=(child,), daemon=True)
    p.start()
    metadata, remote_base = parent.recv()

    agent = nixl_api.nixl_agent("decode-0", nixl_api.nixl_agent_config(capture_telemetry=True))
    kv = ctypes.create_string_buffer(BLOCK * BLOCKS)
    base = ctypes.addressof(kv)
    agent.register_memory(agent.get_reg_descs([(base, BLOCK * BLOCKS, 0, "")], "DRAM"))
    remote = agent.add_remote_agent(metadata)
    local_h = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(base + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM"
    )
    remote_h = agent.prep_xfer_dlist(
        remote, [(remote_base + i * BLOCK, BLOCK, 0) for i in range(BLOCKS)], "DRAM"
    )
    local_ids, remote_ids = [0, 1, 2, 3], [10, 11, 12, 30]
    h = agent.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids, notif_msg=b"req-7:1")
    state = agent.transfer(h)
    while state == "PROC":
        time.sleep(0.0005)
        state = agent.check_xfer_state(h)
    assert state == "DONE", state
    tele = agent.get_xfer_telemetry(h)
    transport = agent.query_xfer_transport(h)
    agent.release_xfer_handle(h)
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    notifs = parent.recv()
    src = bytes(range(256)) * (BLOCK * BLOCKS // 256)
    for li, ri in zip(local_ids, remote_ids):
        assert kv.raw[li * BLOCK:(li + 1) * BLOCK] == src[ri * BLOCK:(ri + 1) * BLOCK]
    print(
        f"{remote.decode()}: {tele.totalBytes} bytes in {tele.descCount} descriptors "
        f"(4 blocks, 3 adjacent), notifications {notifs}, transport "
        f"{transport}"
    )
    parent.send("stop")
    p.join(30)


if __name__ == "__main__":
    main()
