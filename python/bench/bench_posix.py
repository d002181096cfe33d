"""NIXL's POSIX storage backend, 1 MiB x 64 (64 MiB a request) WRITE and
READ between a DRAM buffer and a file, posted to the agent itself as
LMCache and SGLang post them: kvxfer's NIXL front (`kvxfer.nixl`) against
the real NIXL's POSIX plugin (`nixl_cu12`), the same call sequence, the
same file system, alternating rounds (each in a fresh process).

    target/pyenv/bin/python python/bench/bench_posix.py [--rounds 5] [--secs 3] [--dir DIR] [--direct] [--files N]

`--direct` opens the file with O_DIRECT (LMCache's `use_direct_io`);
without it, through the page cache. `--files N` spreads the 64 MiB over
N files (block i to file i mod N, as offload tiers keep a file a chunk).

Prints one JSON object per line; the last line is the summary (medians
and the median of the per-round ratios, kvxfer / NIXL).
"""

import argparse
import ctypes
import importlib
import importlib.util
import json
import mmap
import multiprocessing as mp
import os
import statistics
import time

BLOCK = 1 << 20
BATCH = 64
SIZE = BLOCK * BATCH
spawn = mp.get_context("spawn")


def wait(agent, h):
    s = agent.transfer(h)
    while s == "PROC":
        s = agent.check_xfer_state(h)
    if s != "DONE":
        raise RuntimeError(f"transfer ended {s}")


def measure(kind, op, path, direct, secs, nfiles, out):
    n = importlib.import_module(kind)
    a = n.nixl_agent("posix-bench", n.nixl_agent_config(backends=[]))
    a.create_backend("POSIX")
    # Page-aligned (O_DIRECT needs it).
    buf = mmap.mmap(-1, SIZE)
    buf.write(b"\x5a" * SIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    fds = []
    for j in range(nfiles):
        fd = os.open(f"{path}.{j}", os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        os.ftruncate(fd, SIZE // nfiles)
        fds.append(fd)
    dram = a.register_memory([(addr, SIZE, 0, "")], "DRAM")
    files = a.register_memory([(0, SIZE // nfiles, fd, "") for fd in fds], "FILE")
    local = a.get_xfer_descs([(addr + i * BLOCK, BLOCK, 0) for i in range(BATCH)], "DRAM")
    remote = a.get_xfer_descs(
        [((i // nfiles) * BLOCK, BLOCK, fds[i % nfiles]) for i in range(BATCH)], "FILE"
    )
    h = a.initialize_xfer(op.upper(), local, remote, "posix-bench")
    for _ in range(3):
        wait(a, h)
    count, start = 0, time.perf_counter()
    while True:
        wait(a, h)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= secs:
            break
    a.release_xfer_handle(h)
    a.deregister_memory(files)
    a.deregister_memory(dram)
    for fd in fds:
        os.close(fd)
    out.send(count * SIZE / elapsed / 1e9)


def run(kind, op, path, direct, secs, nfiles):
    rx, tx = spawn.Pipe(duplex=False)
    p = spawn.Process(target=measure, args=(kind, op, path, direct, secs, nfiles, tx))
    p.start()
    gbps = rx.recv()
    p.join()
    return gbps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--direct", action="store_true")
    ap.add_argument("--files", type=int, default=1)
    args = ap.parse_args()
    if args.files < 1 or BATCH % args.files:
        raise SystemExit(f"--files must divide {BATCH}")
    if importlib.util.find_spec("nixl_cu12") is None:
        raise SystemExit("the real NIXL (nixl-cu12) is not installed (ci/python.sh installs it)")
    path = os.path.join(args.dir, f"kvxfer-posix-bench-{os.getpid()}")
    kinds = ["kvxfer.nixl", "nixl_cu12._api"]
    rows = {(k, op): [] for k in kinds for op in ("write", "read")}
    try:
        for r in range(args.rounds):
            for op in ("write", "read"):
                order = kinds if r % 2 == 0 else kinds[::-1]
                got = {k: run(k, op, path, args.direct, args.secs, args.files) for k in order}
                for k in kinds:
                    rows[(k, op)].append(got[k])
                print(json.dumps({"round": r + 1, "op": op, **{k: round(v, 3) for k, v in got.items()}}),
                      flush=True)
    finally:
        for j in range(args.files):
            if os.path.exists(f"{path}.{j}"):
                os.unlink(f"{path}.{j}")
    summary = {}
    for op in ("write", "read"):
        ours, theirs = rows[("kvxfer.nixl", op)], rows[("nixl_cu12._api", op)]
        ratios = sorted(a / b for a, b in zip(ours, theirs))
        summary[op] = {
            "kvxfer_gb_per_s": round(statistics.median(ours), 3),
            "nixl_gb_per_s": round(statistics.median(theirs), 3),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        }
    print(json.dumps({"summary": summary, "direct": args.direct, "files": args.files}))


if __name__ == "__main__":
    main()
