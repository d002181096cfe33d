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

/// A peer on the TCP path (which moves no GPU memory) refuses requests
/// with VRAM on either side, typed, before anything moves.
pub fn tcp_refuses_vram() {
    let host = pattern(4096, 3);
    let g = DeviceBuffer::new(0, 4096).unwrap();
    g.write(0, &[0u8; 4096]).unwrap();
    let (a, b) = (agent(Backend::Tcp, "a"), agent(Backend::Tcp, "b"));
    register_dram(a.as_ref(), &host);
    register_vram(b.as_ref(), &g).unwrap();
    register_vram(a.as_ref(), &g).unwrap();
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let e = a
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&host),
            vram(&g, 0, 4096),
            "b",
        ))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedMemoryType {
                mem_type: MemoryType::Vram,
                backend: "tcp"
            }
        ),
        "{e:?}"
    );
    assert!(device_bytes(&g).iter().all(|&x| x == 0));
    let e = a
        .submit_transfer(&TransferRequest::write(
            vram(&g, 0, 4096),
            MemoryDescs::dram(&host),
            "b",
        ))
        .unwrap_err();
    assert!(matches!(e, Error::UnsupportedMemoryType { .. }), "{e:?}");
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
        fn vram_on_the_tcp_path_is_refused_typed() {
            if $ready("vram_on_the_tcp_path_is_refused_typed") {
                suite::tcp_refuses_vram();
            }
        }
    };
}
