//! The VRAM agent suite, shared by `tests/gpu.rs` (the real driver, where
//! one is present) and `tests/gpu_fake.rs` (the stand-in driver of
//! `tests/gpu/fakecuda.c`). `gpu_suite!(ready)` defines one `#[test]` per
//! case; each first calls `ready()`, which returns `false` (after printing
//! a SKIPPED line) when there is no driver to run against.

use kvxfer::gpu::{DeviceBuffer, GpuError};
use kvxfer::{
    AgentConfig, Backend, Error, MemoryDesc, MemoryDescs, MemoryType, TransferAgent,
    TransferRequest, TransferState, make_transfer_agent,
};

pub fn agent(backend: Backend, name: &str) -> Box<dyn TransferAgent> {
    make_transfer_agent(backend, AgentConfig::new(name)).unwrap()
}

pub fn vram(buf: &DeviceBuffer, off: u64, len: u64) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Vram,
        vec![MemoryDesc::new(buf.addr() + off, len, buf.device())],
    )
}

/// Registers all of `buf` as VRAM.
pub fn register_vram(agent: &dyn TransferAgent, buf: &DeviceBuffer) -> Result<(), Error> {
    // SAFETY: every buffer registered here is declared before its agent, so
    // it stays allocated while the agent exists.
    unsafe { agent.register_memory(&vram(buf, 0, buf.len())) }
}

pub fn register_dram(agent: &dyn TransferAgent, buf: &[u8]) {
    // SAFETY: as in `register_vram`.
    unsafe { agent.register_memory(&MemoryDescs::dram(buf)).unwrap() };
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

pub fn device_bytes(buf: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len() as usize];
    buf.read(0, &mut out).unwrap();
    out
}

fn completed(r: Result<kvxfer::TransferStatus, Error>) -> Result<(), Error> {
    let st = r?;
    st.wait(std::time::Duration::from_secs(60))?;
    assert_eq!(st.poll()?, TransferState::Completed);
    Ok(())
}

/// `n` pieces of `piece` bytes, the i-th at `(i * 7) % n` on the far side:
/// scattered both ways.
fn scattered(
    local: (MemoryType, u64, u32),
    remote: (MemoryType, u64, u32),
    n: u64,
    piece: u64,
) -> (MemoryDescs, MemoryDescs) {
    let mut l = Vec::new();
    let mut r = Vec::new();
    for i in 0..n {
        l.push(MemoryDesc::new(local.1 + i * piece, piece, local.2));
        r.push(MemoryDesc::new(
            remote.1 + (i * 7 % n) * piece,
            piece,
            remote.2,
        ));
    }
    (MemoryDescs::new(local.0, l), MemoryDescs::new(remote.0, r))
}

/// Where piece `i` of a scattered transfer lands.
fn unscatter(src: &[u8], n: u64, piece: u64) -> Vec<u8> {
    let mut out = vec![0u8; src.len()];
    for i in 0..n {
        let (from, to) = ((i * piece) as usize, ((i * 7 % n) * piece) as usize);
        out[to..to + piece as usize].copy_from_slice(&src[from..from + piece as usize]);
    }
    out
}

/// DRAM→VRAM, VRAM→VRAM and VRAM→DRAM (writes), and the reads back, on
/// the in-process path: 64 pieces of 64 KiB scattered, and one byte.
pub fn inproc_round_trips() {
    const N: u64 = 64;
    const PIECE: u64 = 64 << 10;
    let len = N * PIECE;
    let src = pattern(len as usize, 7);
    let back = vec![0u8; len as usize];
    let g1 = DeviceBuffer::new(0, len).unwrap();
    let g2 = DeviceBuffer::new(0, len).unwrap();
    let (a, b) = (
        agent(Backend::InProcess, "a"),
        agent(Backend::InProcess, "b"),
    );
    register_dram(a.as_ref(), &src);
    register_dram(a.as_ref(), &back);
    register_vram(a.as_ref(), &g1).unwrap();
    register_vram(b.as_ref(), &g2).unwrap();
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    b.load_remote_agent(&a.local_agent_desc()).unwrap();
    let dram = |buf: &[u8]| (MemoryType::Dram, buf.as_ptr() as u64, 0);
    let gpu = |g: &DeviceBuffer| (MemoryType::Vram, g.addr(), g.device());

    // DRAM (a) → VRAM (b), scattered.
    let (l, r) = scattered(dram(&src), gpu(&g2), N, PIECE);
    completed(a.submit_transfer(&TransferRequest::write(l, r, "b"))).unwrap();
    let on_g2 = unscatter(&src, N, PIECE);
    assert!(device_bytes(&g2) == on_g2, "DRAM→VRAM write differs");

    // VRAM (b) → VRAM (a), a read by a, scattered back: g1 = src.
    let (l, r) = scattered(gpu(&g1), gpu(&g2), N, PIECE);
    completed(a.submit_transfer(&TransferRequest::read(l, r, "b"))).unwrap();
    assert!(device_bytes(&g1) == src, "VRAM→VRAM read differs");

    // VRAM (a) → DRAM (b side is a's own DRAM through b's agent): b writes
    // a's `back` from its VRAM, then a reads b's VRAM into `back` again.
    let (l, r) = scattered(gpu(&g2), dram(&back), N, PIECE);
    completed(b.submit_transfer(&TransferRequest::write(l, r, "a"))).unwrap();
    assert!(unscatter(&on_g2, N, PIECE).len() == back.len());
    assert!(
        back == unscatter(&on_g2, N, PIECE),
        "VRAM→DRAM write differs"
    );

    // One byte, VRAM → DRAM by a read.
    let one = vec![0u8; 1];
    register_dram(a.as_ref(), &one);
    completed(a.submit_transfer(&TransferRequest::read(
        MemoryDescs::dram(&one),
        vram(&g2, 5, 1),
        "b",
    )))
    .unwrap();
    assert_eq!(one[0], on_g2[5]);
}

/// A registration that is not device memory, names another device, or
/// runs past its allocation fails typed, and registers nothing (not even
/// the good descriptors of the same call).
pub fn registration_errors() {
    let host = vec![0u8; 4096];
    let g = DeviceBuffer::new(0, 1 << 20).unwrap();
    let a = agent(Backend::InProcess, "a");
    let reg = |descs: Vec<MemoryDesc>| {
        // SAFETY: nothing here is registered for good: each call fails.
        unsafe { a.register_memory(&MemoryDescs::new(MemoryType::Vram, descs)) }
    };
    let good = MemoryDesc::new(g.addr(), 4096, 0);
    type Check = fn(&Error) -> bool;
    let cases: [(MemoryDesc, &str, Check); 3] = [
        (
            MemoryDesc::new(host.as_ptr() as u64, 4096, 0),
            "not device memory",
            |e| matches!(e, Error::Gpu(GpuError::NotDeviceMemory { .. })),
        ),
        (
            MemoryDesc::new(g.addr() + 8192, 4096, 1),
            "another device",
            |e| {
                matches!(
                    e,
                    Error::Gpu(GpuError::WrongDevice {
                        claimed: 1,
                        actual: 0,
                        ..
                    })
                )
            },
        ),
        (
            MemoryDesc::new(g.addr() + (1 << 20) - 10, 11, 0),
            "past the allocation",
            |e| matches!(e, Error::Gpu(GpuError::PastAllocation { .. })),
        ),
    ];
    for (bad, what, check) in cases {
        let e = reg(vec![good, bad]).unwrap_err();
        assert!(check(&e), "{what}: {e:?}");
    }
    // Nothing was registered: the good range is still free to register.
    reg(vec![good]).unwrap();
    // Host memory as VRAM, alone: refused too.
    assert!(matches!(
        reg(vec![MemoryDesc::new(host.as_ptr() as u64, 16, 0)]),
        Err(Error::Gpu(GpuError::NotDeviceMemory { .. }))
    ));
    a.deregister_memory(&MemoryDescs::new(MemoryType::Vram, vec![good]))
        .unwrap();
}

/// Agents on `backend` with a staging ring of `chunk`-byte buffers.
fn staged_agent(
    backend: Backend,
    name: &str,
    chunk: usize,
    slots: usize,
) -> Box<dyn TransferAgent> {
    make_transfer_agent(
        backend,
        AgentConfig::new(name).with_gpu_staging(chunk, slots),
    )
    .unwrap()
}

/// VRAM over TCP, staged through pinned buffers on both sides: DRAM→VRAM,
/// VRAM→VRAM and VRAM→DRAM writes and reads, 64 KiB × 256 scattered and
/// 1 MiB × 64, and one byte; element-exact, and counted as staging copies.
/// The initiator's ring has small buffers (many chunks per segment, the
/// pipeline exercised), the target's the default.
pub fn tcp_round_trips() {
    let len: u64 = 16 << 20;
    let src = pattern(len as usize, 11);
    let back = vec![0u8; len as usize];
    let ga = DeviceBuffer::new(0, len).unwrap();
    let gb = DeviceBuffer::new(0, len).unwrap();
    let a = staged_agent(Backend::Tcp, "a", 96 << 10, 2);
    let b = agent(Backend::Tcp, "b");
    register_dram(a.as_ref(), &src);
    register_dram(a.as_ref(), &back);
    register_vram(a.as_ref(), &ga).unwrap();
    register_vram(b.as_ref(), &gb).unwrap();
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let dram = |buf: &[u8]| (MemoryType::Dram, buf.as_ptr() as u64, 0);
    let gpu = |g: &DeviceBuffer| (MemoryType::Vram, g.addr(), g.device());
    let (copies0, bytes0) = kvxfer::gpu::staging_copies();
    for (n, piece) in [(256u64, 64u64 << 10), (16, 1 << 20)] {
        gb.write(0, &vec![0u8; len as usize]).unwrap();
        ga.write(0, &vec![0u8; len as usize]).unwrap();
        // DRAM (a) → VRAM (b).
        let (l, r) = scattered(dram(&src), gpu(&gb), n, piece);
        let st = a
            .submit_transfer(&TransferRequest::write(l, r, "b"))
            .unwrap();
        completed(Ok(st)).unwrap();
        let on_gb = unscatter(&src[..(n * piece) as usize], n, piece);
        assert!(
            device_bytes(&gb)[..on_gb.len()] == on_gb[..],
            "DRAM→VRAM over TCP, {n} × {piece}"
        );
        // VRAM (b) → VRAM (a): a read, gathered back in order.
        let (l, r) = scattered(gpu(&ga), gpu(&gb), n, piece);
        completed(a.submit_transfer(&TransferRequest::read(l, r, "b"))).unwrap();
        assert!(
            device_bytes(&ga)[..on_gb.len()] == src[..on_gb.len()],
            "VRAM→VRAM read over TCP"
        );
        // VRAM (a) → VRAM (b), a write, then VRAM (b) → DRAM (a), a read.
        gb.write(0, &vec![0u8; len as usize]).unwrap();
        let (l, r) = scattered(gpu(&ga), gpu(&gb), n, piece);
        completed(a.submit_transfer(&TransferRequest::write(l, r, "b"))).unwrap();
        assert!(
            device_bytes(&gb)[..on_gb.len()] == on_gb[..],
            "VRAM→VRAM write over TCP"
        );
        let (l, r) = scattered(dram(&back), gpu(&gb), n, piece);
        completed(a.submit_transfer(&TransferRequest::read(l, r, "b"))).unwrap();
        assert!(
            back[..on_gb.len()] == src[..on_gb.len()],
            "VRAM→DRAM read over TCP"
        );
    }
    // One byte, VRAM (b) → VRAM (a) and DRAM (a) → VRAM (b).
    gb.write(7, &[0xa5]).unwrap();
    completed(a.submit_transfer(&TransferRequest::read(
        vram(&ga, 3, 1),
        vram(&gb, 7, 1),
        "b",
    )))
    .unwrap();
    let mut one = [0u8];
    ga.read(3, &mut one).unwrap();
    assert_eq!(one[0], 0xa5);
    completed(a.submit_transfer(&TransferRequest::write(
        MemoryDescs::dram(&src[9..10]),
        vram(&gb, 0, 1),
        "b",
    )))
    .unwrap();
    gb.read(0, &mut one).unwrap();
    assert_eq!(one[0], src[9]);
    let (copies, bytes) = kvxfer::gpu::staging_copies();
    // Every byte of VRAM crossed a staging buffer on each side it was on.
    assert!(copies > copies0 && bytes - bytes0 >= 2 * (256 * (64 << 10) + 16 * (1 << 20)));
    assert!(a.metrics_text().contains("kvxfer_gpu_staging_bytes_total"));
}

/// A stale key for a peer's VRAM (deregistered and registered again) is
/// refused by the target, typed, and the memory is unchanged; the link
/// goes on serving the next request.
pub fn tcp_stale_vram_key_is_refused() {
    let src = pattern(1 << 20, 5);
    let g = DeviceBuffer::new(0, 1 << 20).unwrap();
    g.write(0, &vec![0u8; 1 << 20]).unwrap();
    let a = agent(Backend::Tcp, "a");
    let b = agent(Backend::Tcp, "b");
    register_dram(a.as_ref(), &src);
    register_vram(b.as_ref(), &g).unwrap();
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    b.deregister_memory(&vram(&g, 0, g.len())).unwrap();
    register_vram(b.as_ref(), &g).unwrap();
    let st = a
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            vram(&g, 0, 1 << 20),
            "b",
        ))
        .unwrap();
    let e = st.wait(std::time::Duration::from_secs(60)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::RemoteRejected {
                reason: kvxfer::RejectReason::BadKey,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(device_bytes(&g).iter().all(|&x| x == 0));
    // The same link, the descriptor loaded again: it lands.
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    completed(a.submit_transfer(&TransferRequest::write(
        MemoryDescs::dram(&src),
        vram(&g, 0, 1 << 20),
        "b",
    )))
    .unwrap();
    assert!(device_bytes(&g) == src);
}

/// The KV cache with GPU pools: context TP2 → generation TP1 on the
/// in-process path, every element of every block checked, no staging copy.
/// Then a generation rank asking for end-to-end integrity, which GPU
/// memory does not offer: the context ranks refuse, both sides hear why,
/// and nothing lands.
pub fn kv_tp2_to_tp1_vram_pools() {
    use kvxfer::cache::pattern::{check_block, fill_block};
    use kvxfer::cache::{
        Attention, CacheReceiver, CacheSender, CacheState, DataType, ReceiverConfig, RecvRequest,
        SenderConfig, distinct_heads, rank_slice,
    };
    use std::sync::Arc;
    use std::time::Duration;

    let st =
        |tp: u32| CacheState::new(4, 8 / tp, 64, 16, DataType::Bf16, Attention::Default, tp, 1);
    let (ctx_s, gen_s) = (st(2), st(1));
    let d = distinct_heads(&ctx_s, &gen_s);
    const BLOCKS: u32 = 8;
    let tokens = 100u32;
    let n = tokens.div_ceil(16);
    let ctx_slices: Vec<_> = (0..2).map(|r| rank_slice(&ctx_s, r, d)).collect();
    let gen_slice = rank_slice(&gen_s, 0, d);
    let pool = |bytes: u64| DeviceBuffer::new(0, bytes * u64::from(BLOCKS)).unwrap();
    let ctx_pools: Vec<DeviceBuffer> = ctx_slices.iter().map(|s| pool(s.block_bytes())).collect();
    let gen_pool = pool(gen_slice.block_bytes());
    let agents: Vec<Arc<dyn TransferAgent>> = (0..3)
        .map(|i| Arc::from(agent(Backend::InProcess, &format!("kv{i}"))))
        .collect();
    for (a, p) in agents.iter().zip(ctx_pools.iter().chain([&gen_pool])) {
        register_vram(a.as_ref(), p).unwrap();
    }
    // Context blocks 0..n, filled on the host and copied up.
    for (r, s) in ctx_slices.iter().enumerate() {
        let bb = s.block_bytes() as usize;
        let mut host = vec![0u8; bb];
        for b in 0..n {
            fill_block(&ctx_s, s, &mut host, b);
            ctx_pools[r].write(u64::from(b) * bb as u64, &host).unwrap();
        }
    }
    let sc = SenderConfig {
        mem_type: MemoryType::Vram,
        ..SenderConfig::default()
    };
    let rc = ReceiverConfig {
        mem_type: MemoryType::Vram,
        ..ReceiverConfig::default()
    };
    let senders: Vec<CacheSender> = (0..2)
        .map(|r| {
            CacheSender::new(
                Arc::clone(&agents[r]),
                ctx_s.clone(),
                r as u32,
                None,
                sc.clone(),
            )
            .unwrap()
        })
        .collect();
    let conns: Vec<String> = agents[..2]
        .iter()
        .map(|a| a.local_connection_info())
        .collect();
    let receiver = CacheReceiver::new(
        Arc::clone(&agents[2]),
        gen_s.clone(),
        0,
        ctx_s.clone(),
        &conns,
        rc.clone(),
    )
    .unwrap();
    // Generation blocks in reverse order.
    let gb = gen_slice.block_bytes();
    let recv = receiver
        .request(RecvRequest {
            request_id: 9,
            ctx_dp_rank: 0,
            blocks: (0..n)
                .map(|b| gen_pool.addr() + u64::from(BLOCKS - 1 - b) * gb)
                .collect(),
            last_block_key: None,
        })
        .unwrap();
    let sends: Vec<_> = senders
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let bb = ctx_slices[r].block_bytes();
            s.send(
                9,
                (0..n)
                    .map(|b| ctx_pools[r].addr() + u64::from(b) * bb)
                    .collect(),
            )
            .unwrap()
        })
        .collect();
    for h in sends {
        let stats = h.wait(Duration::from_secs(60)).unwrap();
        assert_eq!(stats.staging_copies, 0);
    }
    recv.wait(Duration::from_secs(60)).unwrap();
    let mut host = vec![0u8; gb as usize];
    for b in 0..n {
        gen_pool
            .read(u64::from(BLOCKS - 1 - b) * gb, &mut host)
            .unwrap();
        if let Some(m) = check_block(&gen_s, &gen_slice, &host, b, tokens) {
            panic!("generation block {b}: {m}");
        }
    }
    drop(receiver);
    let checked = CacheReceiver::new(
        Arc::clone(&agents[2]),
        gen_s.clone(),
        0,
        ctx_s.clone(),
        &conns,
        ReceiverConfig {
            integrity: true,
            ..rc
        },
    )
    .unwrap();
    let before = device_bytes(&gen_pool);
    let recv = checked
        .request(RecvRequest {
            request_id: 10,
            ctx_dp_rank: 0,
            blocks: (0..n)
                .map(|b| gen_pool.addr() + u64::from(b) * gb)
                .collect(),
            last_block_key: None,
        })
        .unwrap();
    // The first rank to try refuses; the other may hear of it first (the
    // generation side cancels the request on the first failure).
    let mut refused = 0;
    for (r, s) in senders.iter().enumerate() {
        let bb = ctx_slices[r].block_bytes();
        let blocks = (0..n).map(|b| ctx_pools[r].addr() + u64::from(b) * bb);
        match s
            .send(10, blocks.collect())
            .unwrap()
            .wait(Duration::from_secs(60))
        {
            Err(kvxfer::cache::CacheError::Transfer(Error::IntegrityUnsupported { .. })) => {
                refused += 1
            }
            Err(kvxfer::cache::CacheError::Cancelled { .. }) => {}
            other => panic!("context rank {r}: {other:?}"),
        }
    }
    assert!(refused >= 1);
    let e = recv.wait(Duration::from_secs(60)).unwrap_err();
    assert!(e.to_string().contains("integrity"), "{e}");
    assert!(device_bytes(&gen_pool) == before, "nothing landed");
    drop(checked);
    drop(senders);
}

fn fnv(buf: &[u8]) -> u64 {
    buf.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The child side of [`ipc_two_processes`]: a shm agent with 4 MiB of GPU
/// memory (pattern seed 21) registered, its connection info printed as
/// `READY <info>`, then commands on stdin: `HASH` (the memory's FNV hash),
/// `NOTIFS` (sync messages received), `REREG` (deregister the memory and
/// register it again: a new key), `EXIT`. `vmm`: the memory is a VMM
/// allocation shareable as a file descriptor (PyTorch's expandable
/// segments), not `cuMemAlloc`'s.
pub fn ipc_child(vmm: bool) {
    use std::io::BufRead;
    let g = if vmm {
        DeviceBuffer::new_vmm(0, 4 << 20).unwrap()
    } else {
        DeviceBuffer::new(0, 4 << 20).unwrap()
    };
    g.write(0, &pattern(4 << 20, 21)).unwrap();
    let a = agent(Backend::Shm, "gpu-child");
    register_vram(a.as_ref(), &g).unwrap();
    println!("READY {}", a.local_connection_info());
    let mut notifs: Vec<String> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().trim() {
            "HASH" => println!("HASH {:x}", fnv(&device_bytes(&g))),
            "REREG" => {
                a.deregister_memory(&vram(&g, 0, g.len())).unwrap();
                register_vram(a.as_ref(), &g).unwrap();
                println!("HASH rereg");
            }
            "NOTIFS" => {
                for (_, msgs) in a.take_sync_messages() {
                    notifs.extend(
                        msgs.into_iter()
                            .map(|m| String::from_utf8_lossy(&m).into_owned()),
                    );
                }
                println!("NOTIFS {}", notifs.join(","));
            }
            _ => break,
        }
    }
}

/// A peer process on this host, its GPU memory reached through CUDA IPC
/// on the shm path: scattered writes from host and GPU memory, reads back
/// into GPU memory, the sync message delivered once the data is in place;
/// checked against the child's own view of its memory. `spawn` starts the
/// child (this test binary running `ipc_child`, with memory of the kind it
/// is told: "legacy" or "vmm"). `vmm`: both sides' GPU
/// memory is VMM memory, the child's reached through its allocation's file
/// descriptor (handed over the proven local channel) instead of a legacy
/// handle in the descriptor.
pub fn ipc_two_processes(spawn: fn(&str) -> std::process::Child, vmm: bool) {
    use std::io::{BufRead, BufReader, Write};
    const LEN: u64 = 4 << 20;
    /// Kills the child if the test fails before it exits.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Reap(spawn(if vmm { "vmm" } else { "legacy" }));
    let mut input = child.0.stdin.take().unwrap();
    let mut output = BufReader::new(child.0.stdout.take().unwrap());
    let mut answer = |cmd: &str, input: &mut std::process::ChildStdin| -> String {
        if !cmd.is_empty() {
            writeln!(input, "{cmd}").unwrap();
        }
        loop {
            let mut l = String::new();
            assert!(output.read_line(&mut l).unwrap() > 0, "the child ended");
            for tag in ["READY ", "HASH ", "NOTIFS"] {
                if let Some(at) = l.find(tag) {
                    return l[at + tag.len()..].trim().to_owned();
                }
            }
        }
    };
    let conn = answer("", &mut input);
    let src = pattern(LEN as usize, 5);
    let ga = if vmm {
        DeviceBuffer::new_vmm(0, LEN).unwrap()
    } else {
        DeviceBuffer::new(0, LEN).unwrap()
    };
    ga.write(0, &pattern(LEN as usize, 9)).unwrap();
    let a = agent(Backend::Shm, "gpu-parent");
    register_dram(a.as_ref(), &src);
    register_vram(a.as_ref(), &ga).unwrap();
    let name = a.load_remote_agent_by_connection(&conn).unwrap();
    if a.remote_transport(&name).unwrap() != "shm" {
        println!("SKIPPED ipc_two_processes: cross-memory attach is not allowed here");
        return;
    }
    let desc = a.remote_agent_desc(&name).unwrap();
    // A legacy handle (72 bytes) in the key, or a VMM allocation's offset
    // and size (16 bytes: its descriptor goes over the local channel).
    assert_eq!(ipc_handles(&desc), usize::from(!vmm));
    assert_eq!(shm_keys_of(&desc, 16), usize::from(vmm));
    let base = a
        .remote_agent_desc(&name)
        .unwrap()
        .regions
        .iter()
        .find(|r| r.mem_type == MemoryType::Vram)
        .unwrap()
        .desc;
    let mut expect = pattern(LEN as usize, 21);
    let dram = |buf: &[u8]| (MemoryType::Dram, buf.as_ptr() as u64, 0);
    let gpu = |g: &DeviceBuffer| (MemoryType::Vram, g.addr(), g.device());
    let child_gpu = (MemoryType::Vram, base.addr, base.device_id);
    // Host → the child's GPU, 64 KiB × 32 scattered, with a notification.
    let (l, r) = scattered(dram(&src), child_gpu, 32, 64 << 10);
    let st = a
        .submit_transfer(
            &TransferRequest::write(l, r, &name).with_sync_message(b"host-to-gpu".to_vec()),
        )
        .unwrap();
    completed(Ok(st)).unwrap();
    let moved = unscatter(&src[..2 << 20], 32, 64 << 10);
    expect[..2 << 20].copy_from_slice(&moved);
    assert_eq!(
        answer("HASH", &mut input),
        format!("{:x}", fnv(&expect)),
        "host → GPU over IPC"
    );
    assert_eq!(answer("NOTIFS", &mut input), "host-to-gpu");
    // GPU → the child's GPU, the upper 2 MiB, one piece.
    let st = a
        .submit_transfer(&TransferRequest::write(
            vram(&ga, 2 << 20, 2 << 20),
            MemoryDescs::new(
                MemoryType::Vram,
                vec![MemoryDesc::new(
                    base.addr + (2 << 20),
                    2 << 20,
                    base.device_id,
                )],
            ),
            &name,
        ))
        .unwrap();
    assert_eq!(st.data_path().transport, kvxfer::TransportKind::Shm);
    completed(Ok(st)).unwrap();
    expect[2 << 20..].copy_from_slice(&pattern(LEN as usize, 9)[2 << 20..]);
    assert_eq!(
        answer("HASH", &mut input),
        format!("{:x}", fnv(&expect)),
        "GPU → GPU over IPC"
    );
    // The child's GPU → this GPU, scattered reads.
    ga.write(0, &vec![0u8; LEN as usize]).unwrap();
    let (l, r) = scattered(gpu(&ga), child_gpu, 64, 64 << 10);
    completed(a.submit_transfer(&TransferRequest::read(l, r, &name))).unwrap();
    let p = 64usize << 10;
    let gathered: Vec<u8> = (0..64)
        .flat_map(|i| expect[(i * 7 % 64) * p..][..p].iter().copied())
        .collect();
    assert!(device_bytes(&ga) == gathered, "GPU ← GPU over IPC");
    // The child registers its memory again: the old key is refused at the
    // grant, before anything is copied.
    assert_eq!(answer("REREG", &mut input), "rereg");
    let st = a
        .submit_transfer(&TransferRequest::write(
            vram(&ga, 0, 4096),
            MemoryDescs::new(
                MemoryType::Vram,
                vec![MemoryDesc::new(base.addr, 4096, base.device_id)],
            ),
            &name,
        ))
        .unwrap();
    let e = st.wait(std::time::Duration::from_secs(60)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::RemoteRejected {
                reason: kvxfer::RejectReason::BadKey,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        answer("HASH", &mut input),
        format!("{:x}", fnv(&expect)),
        "nothing written"
    );
    // Nothing was staged.
    writeln!(input, "EXIT").unwrap();
    assert!(child.0.wait().unwrap().success());
}

/// On the shm path within one process (the same address space: no handle
/// to open), the target's GPU memory is written and read by device copies,
/// and the initiator's own GPU memory towards the target's host memory is
/// refused typed (cross-memory attach cannot read device memory).
pub fn ipc_same_process() {
    let src = pattern(1 << 20, 4);
    let g = DeviceBuffer::new(0, 1 << 20).unwrap();
    let mine = DeviceBuffer::new(0, 1 << 20).unwrap();
    let host = vec![0u8; 1 << 20];
    let (a, b) = (agent(Backend::Shm, "a"), agent(Backend::Shm, "b"));
    register_dram(a.as_ref(), &src);
    register_vram(a.as_ref(), &mine).unwrap();
    register_vram(b.as_ref(), &g).unwrap();
    register_dram(b.as_ref(), &host);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    if a.remote_transport("b").unwrap() != "shm" {
        println!("SKIPPED ipc_same_process: cross-memory attach is not allowed here");
        return;
    }
    completed(a.submit_transfer(&TransferRequest::write(
        MemoryDescs::dram(&src),
        vram(&g, 0, 1 << 20),
        "b",
    )))
    .unwrap();
    assert!(device_bytes(&g) == src);
    completed(a.submit_transfer(&TransferRequest::read(
        vram(&mine, 0, 1 << 20),
        vram(&g, 0, 1 << 20),
        "b",
    )))
    .unwrap();
    assert!(device_bytes(&mine) == src);
    let e = a
        .submit_transfer(&TransferRequest::write(
            vram(&mine, 0, 4096),
            MemoryDescs::dram(&host[..4096]),
            "b",
        ))
        .unwrap_err();
    assert!(matches!(e, Error::UnsupportedMemoryType { .. }), "{e:?}");
}

/// GPU memory on the libfabric transport, provider `shm` (the provider
/// here that moves device memory, `FI_HMEM`, and then requires
/// `FI_MR_HMEM`): a libfabric built with CUDA registers the regions with
/// their device and the bytes move element-exact both ways; one built
/// without (Debian's) registers none, and requests name the missing
/// registration, typed, while host memory on the same agents still moves.
pub fn fabric_round_trips() {
    let fabric = |name: &str| {
        make_transfer_agent(
            Backend::Fabric,
            AgentConfig::new(name).with_fabric_provider("shm"),
        )
    };
    let (a, b) = match (fabric("a"), fabric("b")) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            assert!(matches!(e, Error::BackendUnavailable { .. }), "{e:?}");
            println!("SKIPPED vram_over_fabric: no libfabric shm endpoint here: {e}");
            return;
        }
    };
    let n = 1u64 << 20;
    let src = pattern(n as usize, 9);
    let back = vec![0u8; n as usize];
    let g = DeviceBuffer::new(0, n).unwrap();
    let mine = DeviceBuffer::new(0, n).unwrap();
    register_dram(a.as_ref(), &src);
    register_dram(a.as_ref(), &back);
    register_vram(a.as_ref(), &mine).unwrap();
    register_vram(b.as_ref(), &g).unwrap();
    let host = vec![0u8; n as usize];
    register_dram(b.as_ref(), &host);
    let desc = b.local_agent_desc();
    a.load_remote_agent(&desc).unwrap();
    assert_eq!(a.remote_transport("b").unwrap(), "fabric");
    // Host memory moves whatever libfabric makes of GPU memory.
    completed(a.submit_transfer(&TransferRequest::write(
        MemoryDescs::dram(&src),
        MemoryDescs::dram(&host),
        "b",
    )))
    .unwrap();
    assert!(host == src);
    let fabric_index = desc
        .transports
        .iter()
        .position(|t| t.name == "fabric")
        .expect("a fabric agent offers its endpoint") as u8;
    let gpu_region = desc
        .regions
        .iter()
        .find(|r| r.mem_type == MemoryType::Vram)
        .expect("the GPU region is exported");
    let write = a.submit_transfer(&TransferRequest::write(
        MemoryDescs::dram(&src),
        vram(&g, 0, n),
        "b",
    ));
    if gpu_region.key_for(fabric_index).is_none() {
        let e = write.unwrap_err();
        assert!(
            matches!(&e, Error::BackendUnavailable { reason, .. } if reason.contains("without a fabric registration")),
            "{e:?}"
        );
        let e = a
            .submit_transfer(&TransferRequest::write(
                vram(&mine, 0, 4096),
                MemoryDescs::dram(&host[..4096]),
                "b",
            ))
            .unwrap_err();
        assert!(
            matches!(&e, Error::BackendUnavailable { reason, .. } if reason.contains("without a registration with this agent's fabric device")),
            "{e:?}"
        );
        println!(
            "SKIPPED vram_over_fabric (its GPU part): this libfabric registers no GPU memory (built without CUDA); refusals checked"
        );
        return;
    }
    completed(write).unwrap();
    assert!(device_bytes(&g) == src);
    completed(a.submit_transfer(&TransferRequest::read(
        vram(&mine, 0, n),
        vram(&g, 0, n),
        "b",
    )))
    .unwrap();
    assert!(device_bytes(&mine) == src);
    completed(a.submit_transfer(&TransferRequest::read(
        MemoryDescs::dram(&back),
        vram(&g, 0, n),
        "b",
    )))
    .unwrap();
    assert!(back == src);
}

/// The descriptor an unauthenticated-on-loopback raw client gets from the
/// agent at `conn` with a `DescRequest` naming host `host` (empty: asks for
/// no GPU handles), as a non-Rust peer would speak it.
fn raw_desc(conn: &str, host: &[u8]) -> kvxfer::AgentDesc {
    use std::io::{Read, Write};
    let header = |kind: u8, aux: u32| {
        let mut h = [0u8; 40];
        h[0] = kind;
        h[4..8].copy_from_slice(&aux.to_le_bytes());
        h
    };
    let mut s = std::net::TcpStream::connect(conn).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    // AuthHello (no credential): a nonce, then the name.
    let mut hello = header(17, 32 + 3).to_vec();
    hello.extend_from_slice(&[7u8; 32]);
    hello.extend_from_slice(b"raw");
    s.write_all(&hello).unwrap();
    let mut h = [0u8; 40];
    s.read_exact(&mut h).unwrap();
    assert_eq!((h[0], u16::from_le_bytes([h[2], h[3]])), (18, 0));
    let mut skip = vec![0u8; u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize];
    s.read_exact(&mut skip).unwrap();
    let mut ask = header(3, host.len() as u32).to_vec();
    ask.extend_from_slice(host);
    s.write_all(&ask).unwrap();
    s.read_exact(&mut h).unwrap();
    assert_eq!(h[0], 4);
    let mut body = vec![0u8; u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize];
    s.read_exact(&mut body).unwrap();
    kvxfer::AgentDesc::decode(&body).unwrap()
}

/// How many of `desc`'s GPU regions have a key of `len` bytes with its shm
/// transport (`docs/wire-format.md`): 72, a CUDA IPC handle; 16, a VMM
/// allocation whose descriptor goes over the local channel.
fn shm_keys_of(desc: &kvxfer::AgentDesc, len: usize) -> usize {
    let Some((i, _)) = desc.offer("shm") else {
        return 0;
    };
    desc.regions
        .iter()
        .filter(|r| r.mem_type == MemoryType::Vram && r.key_for(i).is_some_and(|k| k.len() == len))
        .count()
}

/// How many of `desc`'s GPU regions carry their CUDA IPC handle.
fn ipc_handles(desc: &kvxfer::AgentDesc) -> usize {
    shm_keys_of(desc, 72)
}

/// CUDA IPC handles (each opens a whole allocation) go only to peers on
/// this host that ask for them: not in the descriptor the application
/// hands around, nor to a requester that does not ask (a TCP agent) or
/// names another host; a shm agent that loads the handle-less descriptor
/// asks the agent for them and copies through CUDA IPC.
pub fn ipc_handles_only_to_same_host_askers() {
    let g = DeviceBuffer::new(0, 1 << 20).unwrap();
    let src = pattern(1 << 20, 6);
    let b = agent(Backend::Shm, "holder");
    register_vram(b.as_ref(), &g).unwrap();
    assert_eq!(ipc_handles(&b.local_agent_desc()), 0);
    let conn = b.local_connection_info();
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(ipc_handles(&raw_desc(&conn, b"")), 0);
    assert_eq!(ipc_handles(&raw_desc(&conn, b"another-host")), 0);
    assert_eq!(ipc_handles(&raw_desc(&conn, boot_id.trim().as_bytes())), 1);
    let tcp = agent(Backend::Tcp, "tcp-peer");
    let name = tcp.load_remote_agent_by_connection(&conn).unwrap();
    assert_eq!(ipc_handles(&tcp.remote_agent_desc(&name).unwrap()), 0);
    let a = agent(Backend::Shm, "shm-peer");
    register_dram(a.as_ref(), &src);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    if a.remote_transport("holder").unwrap() != "shm" {
        println!(
            "SKIPPED ipc_handles_only_to_same_host_askers: cross-memory attach is not allowed here"
        );
        return;
    }
    assert_eq!(ipc_handles(&a.remote_agent_desc("holder").unwrap()), 1);
    let st = a
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            vram(&g, 0, 1 << 20),
            "holder",
        ))
        .unwrap();
    assert_eq!(st.data_path().transport, kvxfer::TransportKind::Shm);
    completed(Ok(st)).unwrap();
    assert!(device_bytes(&g) == src);
}

/// WRITEs from GPU memory over TCP aborted while their copies run ahead
/// across segments: each ends (aborted, or completed when it was all sent
/// by then), every destination piece is whole or untouched, no sync
/// message of an aborted one is delivered, and the link goes on serving.
pub fn tcp_vram_write_abort() {
    const N: u64 = 128;
    const PIECE: u64 = 256 << 10;
    let len = N * PIECE;
    let src = pattern(len as usize, 41);
    let g = DeviceBuffer::new(0, len).unwrap();
    g.write(0, &src).unwrap();
    let dst = vec![0u8; len as usize];
    let a = staged_agent(Backend::Tcp, "ab-init", 64 << 10, 2);
    let b = agent(Backend::Tcp, "ab-target");
    register_vram(a.as_ref(), &g).unwrap();
    register_dram(b.as_ref(), &dst);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let gpu = (MemoryType::Vram, g.addr(), g.device());
    let host = (MemoryType::Dram, dst.as_ptr() as u64, 0);
    let want = unscatter(&src, N, PIECE);
    let mut aborted = 0;
    for round in 0..4 {
        // SAFETY: `dst` is registered with `b` and written only by it.
        unsafe { std::ptr::write_bytes(dst.as_ptr() as *mut u8, 0, dst.len()) };
        let (l, r) = scattered(gpu, host, N, PIECE);
        let st = a
            .submit_transfer(
                &TransferRequest::write(l, r, "ab-target").with_sync_message(b"m".to_vec()),
            )
            .unwrap();
        st.abort();
        let ended = st.wait(std::time::Duration::from_secs(60));
        let landed = dst
            .chunks(PIECE as usize)
            .zip(want.chunks(PIECE as usize))
            .filter(|(d, w)| {
                let whole = d == w;
                assert!(
                    whole || d.iter().all(|&x| x == 0),
                    "round {round}: a piece half written"
                );
                whole
            })
            .count();
        let msgs = b.take_sync_messages();
        match ended {
            Err(Error::Aborted) => {
                aborted += 1;
                assert!(msgs.is_empty(), "round {round}: an aborted write's message");
            }
            Ok(TransferState::Completed) => assert_eq!(landed, N as usize),
            other => panic!("round {round}: {other:?}"),
        }
    }
    // 32 MiB in flight when the abort comes: at least one is cut short.
    assert!(aborted >= 1, "none of 4 aborted");
    // The link goes on serving.
    g.write(0, &[0x77]).unwrap();
    completed(a.submit_transfer(&TransferRequest::write(
        vram(&g, 0, 1),
        MemoryDescs::dram(&dst[..1]),
        "ab-target",
    )))
    .unwrap();
    assert_eq!(dst[0], 0x77);
}

/// A new directory under the temporary directory.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kvxfer-gpu-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// GPU memory to and from storage, staged through pinned buffers: the
/// agent's own FILE regions (through the page cache, and opened for direct
/// I/O where the file system allows it), scattered 64 KiB × 64 and
/// 1 MiB × 4 (durable) each way, and one byte; element-exact on the GPU
/// and in the file, counted as staging copies. Then a peer's FILE written from GPU memory and read
/// back into it, through the peer's agent over TCP.
pub fn storage_round_trips() {
    use kvxfer::StorageSpec;
    const PIECE: u64 = 64 << 10;
    const N: u64 = 64;
    let len = N * PIECE;
    let dir = scratch_dir("storage");
    let src = pattern(len as usize, 23);
    let ga = DeviceBuffer::new(0, len).unwrap();
    let gb = DeviceBuffer::new(0, len).unwrap();
    ga.write(0, &src).unwrap();
    // Small staging buffers: many chunks per piece, the pipeline exercised.
    let a = staged_agent(Backend::Tcp, "st", 16 << 10, 2);
    register_vram(a.as_ref(), &ga).unwrap();
    register_vram(a.as_ref(), &gb).unwrap();
    let me = a.name().to_owned();
    let gpu = |g: &DeviceBuffer| (MemoryType::Vram, g.addr(), g.device());
    let (copies0, bytes0) = kvxfer::gpu::staging_copies();
    let mut moved = 0u64;
    for direct in [false, true] {
        let path = dir.join(format!("f-{direct}"));
        let spec = StorageSpec::file(&path).create(len).direct(direct);
        let h = match a.open_storage(&spec) {
            Ok(h) => h,
            Err(e) if direct => {
                println!("SKIPPED (direct I/O part of storage_round_trips): {e}");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        let region = MemoryDescs::new(MemoryType::File, vec![MemoryDesc::new(0, len, h)]);
        // SAFETY: storage descriptors name file ranges, not memory.
        unsafe { a.register_memory(&region).unwrap() };
        gb.write(0, &vec![0u8; len as usize]).unwrap();
        // 64 KiB × 64, scattered: VRAM → FILE, then FILE → VRAM.
        let (l, r) = scattered(gpu(&ga), (MemoryType::File, 0, h), N, PIECE);
        completed(a.submit_transfer(&TransferRequest::write(l, r, me.as_str()))).unwrap();
        assert!(
            std::fs::read(&path).unwrap() == unscatter(&src, N, PIECE),
            "VRAM → FILE (direct: {direct})"
        );
        let (l, r) = scattered(gpu(&gb), (MemoryType::File, 0, h), N, PIECE);
        completed(a.submit_transfer(&TransferRequest::read(l, r, me.as_str()))).unwrap();
        assert!(device_bytes(&gb) == src, "FILE → VRAM (direct: {direct})");
        // 1 MiB × 4, durable, the halves swapped.
        let mib = 1u64 << 20;
        let (l, r) = scattered(gpu(&ga), (MemoryType::File, 0, h), 4, mib);
        let st = a.submit_transfer(&TransferRequest::write(l, r, me.as_str()).with_durable());
        completed(st).unwrap();
        gb.write(0, &vec![0u8; len as usize]).unwrap();
        let (l, r) = scattered(gpu(&gb), (MemoryType::File, 0, h), 4, mib);
        completed(a.submit_transfer(&TransferRequest::read(l, r, me.as_str()))).unwrap();
        assert!(device_bytes(&gb)[..4 << 20] == src[..4 << 20], "1 MiB × 4");
        moved += 2 * len + 2 * (4 << 20);
        if !direct {
            // One byte each way.
            gb.write(5, &[0x3c]).unwrap();
            completed(a.submit_transfer(&TransferRequest::write(
                vram(&gb, 5, 1),
                MemoryDescs::new(MemoryType::File, vec![MemoryDesc::new(len - 1, 1, h)]),
                me.as_str(),
            )))
            .unwrap();
            completed(a.submit_transfer(&TransferRequest::read(
                vram(&gb, 0, 1),
                MemoryDescs::new(MemoryType::File, vec![MemoryDesc::new(len - 1, 1, h)]),
                me.as_str(),
            )))
            .unwrap();
            let mut one = [0u8];
            gb.read(0, &mut one).unwrap();
            assert_eq!(one[0], 0x3c);
        }
    }
    let (copies, bytes) = kvxfer::gpu::staging_copies();
    assert!(copies > copies0 && bytes - bytes0 >= moved);

    // A peer's FILE, from and into GPU memory, through the peer's agent.
    let b = agent(Backend::Tcp, "st-peer");
    let path = dir.join("peer");
    let h = b
        .open_storage(&StorageSpec::file(&path).create(len))
        .unwrap();
    // SAFETY: as above.
    unsafe {
        b.register_memory(&MemoryDescs::new(
            MemoryType::File,
            vec![MemoryDesc::new(0, len, h)],
        ))
        .unwrap()
    };
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let (l, r) = scattered(gpu(&ga), (MemoryType::File, 0, h), N, PIECE);
    completed(a.submit_transfer(&TransferRequest::write(l, r, "st-peer"))).unwrap();
    assert!(
        std::fs::read(&path).unwrap() == unscatter(&src, N, PIECE),
        "VRAM → a peer's FILE"
    );
    gb.write(0, &vec![0u8; len as usize]).unwrap();
    let (l, r) = scattered(gpu(&gb), (MemoryType::File, 0, h), N, PIECE);
    completed(a.submit_transfer(&TransferRequest::read(l, r, "st-peer"))).unwrap();
    assert!(device_bytes(&gb) == src, "a peer's FILE → VRAM");

    // GPU memory to and from objects, through a host buffer per HTTP
    // request (a PUT, each part of a multipart upload, each ranged GET),
    // against the S3 server the test command starts.
    match std::env::var("KVXFER_S3_ENDPOINT") {
        Err(_) => println!(
            "SKIPPED VRAM to and from objects: no S3 server here (KVXFER_S3_ENDPOINT unset; ci/test.sh starts one)"
        ),
        Ok(endpoint) => vram_objects(a.as_ref(), &endpoint),
    }
    drop(a);
    drop(b);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// VRAM to and from objects of `a`'s own in the store at `endpoint`: a
/// 12 MiB buffer PUT as a multipart upload of 5 MiB parts, read back whole
/// (ranged GETs of a part each) and from an offset into a second buffer;
/// every byte checked, and each request's HTTP requests counted as
/// staging copies.
fn vram_objects(a: &dyn TransferAgent, endpoint: &str) {
    use kvxfer::storage::obj::ObjectStoreConfig;
    let bucket = std::env::var("KVXFER_S3_BUCKET").unwrap_or_else(|_| "kvxfer".into());
    let mut cfg = ObjectStoreConfig::from_env(&bucket).unwrap();
    cfg.endpoint = endpoint.to_owned();
    cfg.part_size = 5 << 20;
    let store = cfg.build().unwrap();
    let len = 12u64 << 20;
    let src = pattern(len as usize, 41);
    let ga = DeviceBuffer::new(0, len).unwrap();
    let gb = DeviceBuffer::new(0, len).unwrap();
    ga.write(0, &src).unwrap();
    register_vram(a, &ga).unwrap();
    register_vram(a, &gb).unwrap();
    let key = format!(
        "vram-{}-{:x}",
        std::process::id(),
        std::ptr::addr_of!(len) as u64
    );
    let o = a.open_object(&store, &key).unwrap();
    // SAFETY: a range of an object, not memory.
    unsafe {
        a.register_memory(&MemoryDescs::new(
            MemoryType::Obj,
            vec![MemoryDesc::new(0, len, o)],
        ))
        .unwrap()
    };
    let me = a.name().to_owned();
    let obj =
        |off: u64, n: u64| MemoryDescs::new(MemoryType::Obj, vec![MemoryDesc::new(off, n, o)]);
    let (copies0, _) = kvxfer::gpu::staging_copies();
    completed(a.submit_transfer(&TransferRequest::write(vram(&ga, 0, len), obj(0, len), &me)))
        .unwrap();
    assert_eq!(store.object_size(&key).unwrap(), Some(len));
    completed(a.submit_transfer(&TransferRequest::read(vram(&gb, 0, len), obj(0, len), &me)))
        .unwrap();
    assert!(device_bytes(&gb) == src, "an object → VRAM");
    gb.write(0, &vec![0u8; len as usize]).unwrap();
    let (off, n) = (3u64 << 20, 1u64 << 20);
    completed(a.submit_transfer(&TransferRequest::read(vram(&gb, 0, n), obj(off, n), &me)))
        .unwrap();
    let got = device_bytes(&gb);
    assert!(
        got[..n as usize] == src[off as usize..(off + n) as usize],
        "a range → VRAM"
    );
    assert!(got[n as usize..].iter().all(|&b| b == 0), "past the range");
    // Three parts out, three ranged GETs in, one more.
    let (copies, _) = kvxfer::gpu::staging_copies();
    assert!(copies - copies0 >= 7, "{} staging copies", copies - copies0);
    store.delete_object(&key).unwrap();
}

/// Many pieces copied between two buffers in one call (the piece-copy
/// kernel's work on one device): 64 of 16 KiB in reverse order, then
/// lengths and offsets off every alignment, one over the kernel's 64 KiB
/// entry; every byte checked. `from`: the source buffer's device.
pub fn small_pieces(from: u32) {
    let g1 = DeviceBuffer::new(from, 2 << 20).unwrap();
    let g2 = DeviceBuffer::new(0, 2 << 20).unwrap();
    g1.write(0, &pattern(2 << 20, 3)).unwrap();
    g2.write(0, &vec![0u8; 2 << 20]).unwrap();
    let mut pieces: Vec<(u64, u64, u64)> = (0..64)
        .map(|i| (i * 16384, (63 - i) * 16384, 16384))
        .collect();
    pieces.extend([
        (1 << 20, (1 << 20) + 3, 200 << 10),
        ((1 << 20) + (256 << 10) + 1, 17, 1000),
        (
            (1 << 20) + (300 << 10),
            (1 << 20) + (300 << 10) + 16,
            4096 + 15,
        ),
        ((1 << 20) + (320 << 10) + 8, 64, 1),
    ]);
    g2.copy_pieces(&g1, &pieces).unwrap();
    let src = device_bytes(&g1);
    let dst = device_bytes(&g2);
    let mut want = vec![0u8; 2 << 20];
    for &(at, src_at, len) in &pieces {
        let (at, src_at, len) = (at as usize, src_at as usize, len as usize);
        want[at..][..len].copy_from_slice(&src[src_at..][..len]);
    }
    assert!(dst == want, "pieces copied inexactly");
}

/// Defines the suite's tests; `$ready` says whether to run (else it has
/// printed why not).
#[macro_export]
macro_rules! gpu_suite {
    ($ready:path) => {
        #[test]
        fn vram_inproc_round_trips() {
            if $ready("vram_inproc_round_trips") {
                suite::inproc_round_trips();
            }
        }

        #[test]
        fn vram_registration_errors_are_typed_and_register_nothing() {
            if $ready("vram_registration_errors_are_typed_and_register_nothing") {
                suite::registration_errors();
            }
        }

        #[test]
        fn vram_small_pieces_copy_exactly() {
            if $ready("vram_small_pieces_copy_exactly") {
                suite::small_pieces(0);
            }
        }

        #[test]
        fn vram_kv_cache_tp2_to_tp1_pools_on_the_gpu() {
            if $ready("vram_kv_cache_tp2_to_tp1_pools_on_the_gpu") {
                suite::kv_tp2_to_tp1_vram_pools();
            }
        }

        #[test]
        fn vram_over_tcp_staged_round_trips() {
            if $ready("vram_over_tcp_staged_round_trips") {
                suite::tcp_round_trips();
            }
        }

        #[test]
        fn vram_to_storage_and_back_staged() {
            if $ready("vram_to_storage_and_back_staged") {
                suite::storage_round_trips();
            }
        }

        #[test]
        fn vram_write_over_tcp_aborted_mid_pipeline() {
            if $ready("vram_write_over_tcp_aborted_mid_pipeline") {
                suite::tcp_vram_write_abort();
            }
        }

        #[test]
        fn vram_over_tcp_stale_key_is_refused() {
            if $ready("vram_over_tcp_stale_key_is_refused") {
                suite::tcp_stale_vram_key_is_refused();
            }
        }

        #[test]
        fn vram_over_fabric() {
            if $ready("vram_over_fabric") {
                suite::fabric_round_trips();
            }
        }

        #[test]
        fn ipc_handles_go_only_to_same_host_peers_that_ask() {
            if $ready("ipc_handles_go_only_to_same_host_peers_that_ask") {
                suite::ipc_handles_only_to_same_host_askers();
            }
        }

        #[test]
        fn vram_through_cuda_ipc_in_one_process() {
            if $ready("vram_through_cuda_ipc_in_one_process") {
                suite::ipc_same_process();
            }
        }

        /// This test binary again, as the child of the two-process IPC
        /// tests: `gpu_ipc_peer_child` with memory of `kind` ("legacy" or
        /// "vmm").
        fn ipc_child_process(kind: &str) -> std::process::Child {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "gpu_ipc_peer_child",
                    "--exact",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env("KVXFER_GPU_CHILD", kind)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        }

        #[test]
        fn vram_through_cuda_ipc_between_two_processes() {
            if $ready("vram_through_cuda_ipc_between_two_processes") {
                suite::ipc_two_processes(ipc_child_process, false);
            }
        }

        #[test]
        fn vmm_vram_through_file_descriptors_between_two_processes() {
            if $ready("vmm_vram_through_file_descriptors_between_two_processes") {
                suite::ipc_two_processes(ipc_child_process, true);
            }
        }

        /// Not a test of its own: the child process of
        /// `vram_through_cuda_ipc_between_two_processes`.
        #[test]
        fn gpu_ipc_peer_child() {
            if let Some(kind) = std::env::var_os("KVXFER_GPU_CHILD")
                && $ready("gpu_ipc_peer_child")
            {
                suite::ipc_child(kind == "vmm");
            }
        }
    };
}
