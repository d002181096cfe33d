//! Unit tests of the engine that need its private items.

use crate::agent::{AgentConfig, Backend, TransferAgent, TransferRequest, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::peer::connect_any;
use crate::engine::peer::handshake;
use crate::engine::shm::plan::{delegated_pieces, runs, should_delegate};
use crate::engine::sock::ProgressClock;
use crate::engine::target::attach;
use crate::engine::{Engine, wire};
use crate::error::Error;
use crate::memory::MemoryDesc;
use crate::memory::{MemoryDescs, MemoryType};
use std::time::Duration;

fn descs(v: &[(u64, u64)]) -> Vec<MemoryDesc> {
    v.iter().map(|&(a, l)| MemoryDesc::new(a, l, 0)).collect()
}

#[test]
fn runs_count_breaks_in_adjacency() {
    assert_eq!(runs(&[]), 0);
    assert_eq!(runs(&descs(&[(0, 10), (10, 5), (15, 1)])), 1);
    assert_eq!(runs(&descs(&[(0, 10), (20, 5), (25, 1), (0, 4)])), 3);
    assert_eq!(runs(&descs(&[(u64::MAX - 1, 1), (0, 1)])), 2);
}

#[test]
fn delegation_only_for_much_more_scattered_remote_sides() {
    let req = |local: Vec<MemoryDesc>, remote: Vec<MemoryDesc>| {
        TransferRequest::write(
            MemoryDescs::new(MemoryType::Dram, local),
            MemoryDescs::new(MemoryType::Dram, remote),
            "t",
        )
    };
    let contiguous: Vec<_> = (0..64).map(|i| (i * 16, 16)).collect();
    let strided: Vec<_> = (0..64).map(|i| (i * 32, 16)).collect();
    assert!(should_delegate(&req(descs(&contiguous), descs(&strided))));
    assert!(!should_delegate(&req(descs(&strided), descs(&contiguous))));
    assert!(!should_delegate(&req(descs(&strided), descs(&strided))));
    // Few pieces: not worth a round trip.
    assert!(!should_delegate(&req(
        descs(&contiguous[..8]),
        descs(&strided[..8])
    )));
}

#[test]
fn delegated_pieces_must_lie_in_the_grants() {
    let entry =
        |t: u64, i: u64, n: u64| [t.to_le_bytes(), i.to_le_bytes(), n.to_le_bytes()].concat();
    let spans = [(1000, 100), (5000, 10)];
    let ok = [entry(1000, 7, 100), entry(5005, 9, 5)].concat();
    let p = delegated_pieces(&ok, &spans).unwrap();
    assert_eq!(
        p.iter()
            .map(|p| (p.local, p.remote, p.len))
            .collect::<Vec<_>>(),
        [(1000, 7, 100), (5005, 9, 5)]
    );
    for bad in [
        entry(1000, 0, 101),      // runs past its span
        entry(1090, 0, 20),       // straddles the end
        entry(2000, 0, 1),        // in no span
        entry(1000, 0, 0),        // empty
        entry(u64::MAX, 0, 2),    // wraps
        entry(5000, 0, u64::MAX), // wraps
    ] {
        assert!(delegated_pieces(&bad, &spans).is_err());
    }
    assert!(delegated_pieces(&ok, &[]).is_err());
}

const P: usize = 4096;
const K: usize = 40;

/// `K` pages of `base`, back to back.
fn pages(base: u64) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Dram,
        (0..K)
            .map(|i| MemoryDesc::new(base + (i * P) as u64, P as u64, 0))
            .collect(),
    )
}

/// Every other page of `base`, `K` of them.
fn scattered(base: u64) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Dram,
        (0..K)
            .map(|i| MemoryDesc::new(base + (2 * i * P) as u64, P as u64, 0))
            .collect(),
    )
}

fn source() -> Vec<u8> {
    (0..K * P).map(|i| (i % 251) as u8 + 1).collect()
}

/// An initiator's run: a WRITE of one contiguous range to scattered
/// pages of the target (`dst`), with a sync message, and a READ of them
/// back, checked.
fn write_and_read_scattered(init: &Engine, target: &AgentDesc, dst: u64) {
    let src = source();
    let back = vec![0u8; K * P];
    // SAFETY: the buffers outlive the registrations (deregistered
    // below, after every transfer has completed).
    unsafe {
        init.register_memory(&MemoryDescs::dram(&src)).unwrap();
        init.register_memory(&MemoryDescs::dram(&back)).unwrap();
    }
    init.load_remote_agent(target).unwrap();
    let write = TransferRequest::write(
        pages(src.as_ptr() as u64),
        scattered(dst),
        target.name.clone(),
    )
    .with_sync_message(b"landed".to_vec());
    assert!(should_delegate(&write));
    init.submit_transfer(&write)
        .unwrap()
        .wait_success(Duration::from_secs(30))
        .unwrap();
    let read = TransferRequest::read(
        pages(back.as_ptr() as u64),
        scattered(dst),
        target.name.clone(),
    );
    init.submit_transfer(&read)
        .unwrap()
        .wait_success(Duration::from_secs(30))
        .unwrap();
    assert_eq!(std::hint::black_box(&back), &src);
    init.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
    init.deregister_memory(&MemoryDescs::dram(&back)).unwrap();
}

/// The target's side of the check: the sync message, and the bytes.
fn check_target(target: &Engine, dst: &[u8]) {
    let msgs = target.wait_sync_messages(Duration::from_secs(30));
    assert_eq!(msgs.get("init"), Some(&vec![b"landed".to_vec()]));
    let (src, dst) = (source(), std::hint::black_box(dst));
    for i in 0..K {
        assert_eq!(&dst[2 * i * P..(2 * i + 1) * P], &src[i * P..(i + 1) * P]);
        assert!(
            dst[(2 * i + 1) * P..(2 * i + 2) * P]
                .iter()
                .all(|&b| b == 0)
        );
    }
}

/// The initiator of [`scattered_remote_side_is_copied_by_the_target`]
/// in a process of its own (this test binary run again); returns at
/// once in an ordinary run.
#[test]
fn delegation_initiator_child() {
    let Ok(arg) = std::env::var("KVXFER_TEST_DELEGATION") else {
        return;
    };
    let (hex, dst) = arg.split_once(' ').unwrap();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let target = AgentDesc::decode(&bytes).unwrap();
    let init = Engine::with_mode(AgentConfig::new("init"), Backend::Shm).unwrap();
    write_and_read_scattered(&init, &target, dst.parse().unwrap());
}

/// A WRITE to scattered remote pieces from one contiguous local range,
/// from another process, is copied by the target (once that process
/// proved on the local socket who it is), and a READ of them back too;
/// with delegation off at the target, the initiator copies. Bytes and
/// sync messages are right either way.
#[test]
fn scattered_remote_side_is_copied_by_the_target() {
    for target_delegates in [true, false] {
        let target = Engine::with_mode(
            AgentConfig::new("target").with_shm_delegate(target_delegates),
            Backend::Shm,
        )
        .unwrap();
        let dst = vec![0u8; 2 * K * P];
        // SAFETY: `dst` outlives the agent (dropped first below).
        unsafe { target.register_memory(&MemoryDescs::dram(&dst)).unwrap() };
        let hex: String = target
            .local_agent_desc()
            .encode()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "engine::tests::delegation_initiator_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(
                "KVXFER_TEST_DELEGATION",
                format!("{hex} {}", dst.as_ptr() as u64),
            )
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        check_target(&target, &dst);
        // Who copied: the target, both ways, only when it delegates.
        let copies = delegated_copies(&target);
        assert_eq!(copies, if target_delegates { 2 } else { 0 });
        drop(target);
        drop(dst);
    }
}

/// The copies `agent` did for same-host initiators, as its metrics say.
fn delegated_copies(agent: &Engine) -> u64 {
    let text = agent.metrics_text();
    let line = text
        .lines()
        .find(|l| l.starts_with("kvxfer_shm_delegated_copies_total{"))
        .unwrap_or_else(|| panic!("no delegated copies counter in\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Two agents in one process: the target never copies for its own
/// process (the initiator can, and a pid it copies for must be another
/// process that proved itself); the initiator copies, bytes right.
#[test]
fn a_target_never_copies_for_its_own_process() {
    let init = Engine::with_mode(AgentConfig::new("init"), Backend::Shm).unwrap();
    let target = Engine::with_mode(AgentConfig::new("target"), Backend::Shm).unwrap();
    let dst = vec![0u8; 2 * K * P];
    // SAFETY: `dst` outlives the agents (dropped first below).
    unsafe { target.register_memory(&MemoryDescs::dram(&dst)).unwrap() };
    write_and_read_scattered(&init, &target.local_agent_desc(), dst.as_ptr() as u64);
    check_target(&target, &dst);
    assert_eq!(delegated_copies(&target), 0);
    drop((init, target));
    drop(dst);
}

/// An `Attach` naming a transport the target does not offer (an RDMA
/// link to a TCP agent, a name no transport has) is refused with
/// `NO_TRANSPORT`, and the stream stays in step: the next attach on it is
/// answered too.
#[test]
fn attach_of_a_transport_the_target_lacks_is_refused_in_step() {
    let init = Engine::with_mode(AgentConfig::new("init"), Backend::Tcp).unwrap();
    let target = Engine::with_mode(AgentConfig::new("target"), Backend::Tcp).unwrap();
    let desc = target.local_agent_desc();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let sock = connect_any(&desc.endpoints, deadline).unwrap();
    let clock = ProgressClock::new();
    handshake(&init.inner, &desc, &sock, 1, 0, &clock, deadline).unwrap();
    let t = Duration::from_secs(30);
    for (kind, msg) in [
        (TransportKind::Rdma, vec![1u8; 28]),
        (TransportKind::Shm, Vec::new()),
        (TransportKind::Rdma, vec![2u8; 4096]),
    ] {
        let answer = attach::attach("target", &sock, &clock, t, kind, &msg).unwrap();
        assert_eq!(answer, Err(wire::status::NO_TRANSPORT), "{kind}");
    }
    // Too long a message is refused before anything is sent.
    let long = vec![0u8; wire::ATTACH_MAX as usize + 1];
    assert!(matches!(
        attach::attach("target", &sock, &clock, t, TransportKind::Rdma, &long),
        Err(Error::InvalidRequest(_))
    ));
}
