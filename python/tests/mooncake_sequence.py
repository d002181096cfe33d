"""A scripted Mooncake transfer-engine session, run unmodified on the real
Mooncake and on kvxfer's stand-in (whichever `mooncake.engine` resolves
to): a target and an initiator engine in one process, protocol `tcp`
(`rdma` asked of the initiator, which falls back where there is no
device). Prints one line, `RESULT <json>`: `[step, value]` pairs of return
codes, ids reduced to "nonzero"/0, and bytes compared.

    python mooncake_sequence.py P2PHANDSHAKE | http://127.0.0.1:PORT/metadata | 127.0.0.1:ETCD_PORT \
        TARGET_PORT INITIATOR_PORT
"""

import json
import os
import sys
import time

from mooncake.engine import TransferEngine

N = 1 << 20
# An address no engine registers memory at.
OUTSIDE = 1 << 16
out = []


def step(name, value):
    out.append([name, value])


def main():
    server = sys.argv[1]
    base, other = int(sys.argv[2]), int(sys.argv[3])
    p2p = server == "P2PHANDSHAKE"
    t, i = TransferEngine(), TransferEngine()
    step("init target", t.initialize(f"127.0.0.1:{base}", server, "tcp", ""))
    step("init initiator (rdma)", i.initialize(f"127.0.0.1:{other}", server, "rdma", ""))
    step("init again", i.initialize(f"127.0.0.1:{other}", server, "tcp", ""))
    step("rpc port", t.get_rpc_port() > 0)
    # P2P: the session is the RPC port's; otherwise the segment's name.
    tn = f"127.0.0.1:{t.get_rpc_port() if p2p else base}"
    step("first buffer, none", t.get_first_buffer_address(tn))
    tb = t.allocate_managed_buffer(N)
    ib = i.allocate_managed_buffer(N)
    step("managed buffers", [tb != 0, ib != 0])
    step("peer's first buffer", i.get_first_buffer_address(tn) != 0)
    dst = i.get_first_buffer_address(tn)
    payload = bytes((k * 11 + 3) % 256 for k in range(4096))
    step("write bytes", i.write_bytes_to_buffer(ib, payload, len(payload)))
    step("read bytes", i.read_bytes_from_buffer(ib, 16) == payload[:16])
    step("sync write", i.transfer_sync_write(tn, ib, dst, 4096))
    step("landed", t.read_bytes_from_buffer(dst, 4096) == payload)
    step("zero length", i.transfer_sync_write(tn, ib, dst, 0))
    step("batch empty", i.batch_transfer_sync_write(tn, [], [], []))
    step("outside peer memory", i.transfer_sync_write(tn, ib, OUTSIDE, 16))
    step("lengths mismatch", i.batch_transfer_sync_write(tn, [ib], [dst, dst], [1]))
    step("unknown peer", i.transfer_sync_write("unreachable_peer:9", ib, dst, 16))
    step("async to unknown", i.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16]))
    step("submit to unknown", i.transfer_submit_write("unreachable_peer:9", 0, 0, 16))
    step("probe", i.send_probe(tn))
    step("probe unknown", i.send_probe("unreachable_peer:9") != 0)
    # Batch write of scattered pieces, then read back into a cleared buffer.
    srcs = [ib + k * 8192 for k in range(8)]
    dsts = [dst + 65536 + k * 4096 for k in range(8)]
    lens = [1000 + k * 100 for k in range(8)]
    bid = i.batch_transfer_async_write(tn, srcs, dsts, lens)
    step("async write id", bid != 0)
    step("async write status", i.get_batch_transfer_status([bid]))
    step("cleared", i.write_bytes_to_buffer(ib, bytes(65536), 65536))
    bid = i.batch_transfer_async_read(tn, srcs, dsts, lens)
    step("async read status", i.get_batch_transfer_status([bid]))
    step("read back", all(
        i.read_bytes_from_buffer(s, n) == t.read_bytes_from_buffer(d, n)
        for s, d, n in zip(srcs, dsts, lens)
    ))
    bad = i.batch_transfer_async_write(tn, [ib], [OUTSIDE], [64])
    step("bad async id", bad != 0)
    step("bad async status", i.get_batch_transfer_status([bad]))
    sid = i.transfer_submit_write(tn, ib, dst, 64)
    deadline = time.monotonic() + 30
    st = i.transfer_check_status(sid)
    while st == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
        st = i.transfer_check_status(sid)
    step("submit then check", st)
    sid = i.transfer_submit_write(tn, ib, OUTSIDE, 64)
    st = i.transfer_check_status(sid)
    while st == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
        st = i.transfer_check_status(sid)
    step("bad submit then check", st)
    step("sync read op", i.transfer_sync(tn, ib, dst, 64, TransferEngine.TransferOpcode.Read))
    step("batch sync write op", i.batch_transfer_sync(tn, [ib], [dst], [64], TransferEngine.TransferOpcode.Write))
    step("unregister unknown", i.unregister_memory(12345678))
    step("free managed", [i.free_managed_buffer(ib, N), t.free_managed_buffer(tb, N)])
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
