//! The in-process transport (`Backend::InProcess`): two agents of this
//! process, every transfer a copy in the submitting thread. Its statuses
//! are final when `submit_transfer` returns, so these tests need no wait.

use std::time::Duration;

use kvxfer::{
    AgentConfig, Backend, Error, MemoryDescs, MemoryType, RejectReason, TransferAgent,
    TransferRequest, TransferState, TransportKind, make_transfer_agent,
};

fn agent(name: &str) -> Box<dyn TransferAgent> {
    make_transfer_agent(Backend::InProcess, AgentConfig::new(name)).unwrap()
}

fn agent_with(name: &str, f: impl FnOnce(AgentConfig) -> AgentConfig) -> Box<dyn TransferAgent> {
    make_transfer_agent(Backend::InProcess, f(AgentConfig::new(name))).unwrap()
}

/// Registers `buf` with `agent` (the buffers outlive the agents in every
/// test: declared first).
fn register(agent: &dyn TransferAgent, buf: &[u8]) {
    // SAFETY: every buffer registered here is declared before its agent,
    // so it stays allocated while the agent exists.
    unsafe { agent.register_memory(&MemoryDescs::dram(buf)).unwrap() };
}

fn sub(buf: &[u8], off: usize, len: usize) -> MemoryDescs {
    MemoryDescs::dram(&buf[off..off + len])
}

/// The state right after submission: the in-process path never leaves a
/// transfer in progress.
fn done(r: Result<kvxfer::TransferStatus, Error>) -> Result<(), Error> {
    let st = r?;
    match st.poll() {
        Ok(TransferState::Completed) => Ok(()),
        Ok(TransferState::InProgress) => panic!("in-process transfer still in progress"),
        Err(e) => Err(e),
    }
}

fn pair() -> (Box<dyn TransferAgent>, Box<dyn TransferAgent>) {
    (agent("init"), agent("target"))
}

/// Each of `a` and `b` loads the other's descriptor (after registering:
/// a descriptor lists the regions registered when it was taken).
fn introduce(a: &dyn TransferAgent, b: &dyn TransferAgent) {
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    b.load_remote_agent(&a.local_agent_desc()).unwrap();
}

#[test]
fn scattered_write_and_read_copy_exactly_the_described_bytes() {
    let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    let dst = vec![0u8; 8192];
    let back = vec![0u8; 4096];
    let (a, b) = pair();
    register(a.as_ref(), &src);
    register(a.as_ref(), &back);
    register(b.as_ref(), &dst);
    introduce(a.as_ref(), b.as_ref());
    assert_eq!(a.remote_transport("target").unwrap(), "inproc");
    // Three pieces to three places, one of them out of order.
    let local = MemoryDescs::new(
        MemoryType::Dram,
        [(0, 100), (100, 1000), (1100, 2996)]
            .iter()
            .flat_map(|&(o, l)| sub(&src, o, l).descs)
            .collect(),
    );
    let remote = MemoryDescs::new(
        MemoryType::Dram,
        [(5000, 100), (0, 1000), (2000, 2996)]
            .iter()
            .flat_map(|&(o, l)| sub(&dst, o, l).descs)
            .collect(),
    );
    let st = a
        .submit_transfer(&TransferRequest::write(local, remote.clone(), "target"))
        .unwrap();
    assert_eq!(st.poll().unwrap(), TransferState::Completed);
    assert_eq!(st.data_path().transport, TransportKind::InProcess);
    assert_eq!(&dst[5000..5100], &src[0..100]);
    assert_eq!(&dst[0..1000], &src[100..1100]);
    assert_eq!(&dst[2000..4996], &src[1100..4096]);
    assert!(dst[1000..2000].iter().all(|&x| x == 0));
    assert!(dst[5100..].iter().all(|&x| x == 0));
    // And back, gathered into one local buffer.
    let gathered = MemoryDescs::new(
        MemoryType::Dram,
        [(0, 100), (100, 1000), (1100, 2996)]
            .iter()
            .flat_map(|&(o, l)| sub(&back, o, l).descs)
            .collect(),
    );
    done(a.submit_transfer(&TransferRequest::read(gathered, remote, "target"))).unwrap();
    assert_eq!(back, src[..4096]);
}

#[test]
fn sync_message_lands_with_the_data_and_notifications_in_order() {
    let src = vec![9u8; 64];
    let dst = vec![0u8; 64];
    let (a, b) = pair();
    register(a.as_ref(), &src);
    register(b.as_ref(), &dst);
    introduce(a.as_ref(), b.as_ref());
    let mut req =
        TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), "target");
    req.sync_message = Some(b"first".to_vec());
    done(a.submit_transfer(&req)).unwrap();
    done(a.notify_sync_message("target", b"second".to_vec())).unwrap();
    // Already there: nothing to wait for.
    let got = b.take_sync_messages();
    assert_eq!(got["init"], vec![b"first".to_vec(), b"second".to_vec()]);
    assert_eq!(dst, src);
    // The other way too.
    done(b.notify_sync_message("init", b"back".to_vec())).unwrap();
    assert_eq!(
        a.wait_sync_messages(Duration::from_secs(5))["target"],
        vec![b"back".to_vec()]
    );
}

#[test]
fn refused_requests_change_nothing_and_keep_their_sync_message() {
    let src = vec![5u8; 256];
    let dst = vec![0u8; 256];
    let (a, b) = pair();
    register(a.as_ref(), &src);
    register(b.as_ref(), &dst);
    introduce(a.as_ref(), b.as_ref());
    let desc = b.local_agent_desc();
    // Outside what the target exported: refused at submission.
    let outside = MemoryDescs::new(
        MemoryType::Dram,
        vec![kvxfer::MemoryDesc::new(dst.as_ptr() as u64 + 128, 256, 0)],
    );
    let err = a
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            outside,
            "target",
        ))
        .unwrap_err();
    assert!(matches!(err, Error::RemoteRangeNotExported { .. }), "{err}");
    // Registered again by the target: the loaded descriptor's key is stale;
    // the second piece is the stale one, so the first must not land either.
    b.deregister_memory(&MemoryDescs::dram(&dst)).unwrap();
    register(b.as_ref(), &dst);
    let mut req =
        TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), "target");
    req.sync_message = Some(b"withheld".to_vec());
    let err = done(a.submit_transfer(&req)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RemoteRejected {
                reason: RejectReason::BadKey,
                ..
            }
        ),
        "{err}"
    );
    assert!(dst.iter().all(|&x| x == 0));
    assert!(b.take_sync_messages().is_empty());
    // Deregistered by the target: refused, nothing written.
    b.deregister_memory(&MemoryDescs::dram(&dst)).unwrap();
    a.load_remote_agent(&desc).unwrap();
    let err = done(a.submit_transfer(&req)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RemoteRejected {
                reason: RejectReason::NotRegistered,
                ..
            }
        ),
        "{err}"
    );
    assert!(dst.iter().all(|&x| x == 0));
    // A request whose local side is not registered never reaches the target.
    let loose = vec![1u8; 16];
    let err = a
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&loose),
            MemoryDescs::dram(&dst[..16]),
            "target",
        ))
        .unwrap_err();
    assert!(matches!(err, Error::NotRegistered { .. }), "{err}");
}

#[test]
fn a_full_inbox_refuses_the_whole_request() {
    let src = vec![3u8; 64];
    let dst = vec![0u8; 64];
    let a = agent("init");
    let b = agent_with("target", |c| c.with_inbox_limits(16, 16));
    register(a.as_ref(), &src);
    register(b.as_ref(), &dst);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let mut req =
        TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), "target");
    req.sync_message = Some(vec![0u8; 17]);
    let err = done(a.submit_transfer(&req)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RemoteRejected {
                reason: RejectReason::InboxFull,
                ..
            }
        ),
        "{err}"
    );
    assert!(dst.iter().all(|&x| x == 0));
    req.sync_message = Some(vec![1u8; 16]);
    done(a.submit_transfer(&req)).unwrap();
    assert_eq!(dst, src);
    assert_eq!(b.take_sync_messages()["init"], vec![vec![1u8; 16]]);
}

#[test]
fn an_agent_writes_to_itself_even_overlapping() {
    let buf: Vec<u8> = (0..100u8).collect();
    let a = agent("self");
    register(a.as_ref(), &buf);
    a.load_remote_agent(&a.local_agent_desc()).unwrap();
    done(a.submit_transfer(&TransferRequest::write(
        sub(&buf, 0, 60),
        sub(&buf, 20, 60),
        "self",
    )))
    .unwrap();
    let want: Vec<u8> = (0..20u8).chain(0..60u8).chain(80..100u8).collect();
    assert_eq!(buf, want);
}

#[test]
fn a_dropped_target_fails_its_initiators() {
    let src = vec![1u8; 64];
    let dst = vec![0u8; 64];
    let a = agent("init");
    let b = agent("target");
    register(a.as_ref(), &src);
    register(b.as_ref(), &dst);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let desc = b.local_agent_desc();
    drop(b);
    let req = TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), "target");
    let err = done(a.submit_transfer(&req)).unwrap_err();
    assert!(matches!(err, Error::ConnectionLost { .. }), "{err}");
    assert!(dst.iter().all(|&x| x == 0));
    // Its descriptor no longer reaches anything in this process.
    let err = a.load_remote_agent(&desc).unwrap_err();
    assert!(
        matches!(err, Error::BackendUnavailable { backend: "inproc", ref reason } if reason.contains("not an agent of this process")),
        "{err}"
    );
}

#[test]
fn agents_of_other_backends_are_reached_their_own_way() {
    let src = vec![2u8; 64];
    let dst = vec![0u8; 64];
    let a = agent("init");
    let tcp = make_transfer_agent(Backend::Tcp, AgentConfig::new("tcp-target")).unwrap();
    register(a.as_ref(), &src);
    register(tcp.as_ref(), &dst);
    // A TCP agent of this process is not listed for in-process access.
    let err = a.load_remote_agent(&tcp.local_agent_desc()).unwrap_err();
    assert!(matches!(err, Error::BackendUnavailable { .. }), "{err}");
    // An in-process agent serves TCP initiators like any other agent.
    let b = agent("target");
    let dst2 = vec![0u8; 64];
    register(b.as_ref(), &dst2);
    tcp.load_remote_agent_by_connection(&b.local_connection_info())
        .unwrap();
    register(tcp.as_ref(), &src);
    let st = tcp
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            MemoryDescs::dram(&dst2),
            "target",
        ))
        .unwrap();
    st.wait_success(Duration::from_secs(30)).unwrap();
    assert_eq!(st.data_path().transport, TransportKind::Tcp);
    assert_eq!(dst2, src);
}

#[test]
fn a_required_transport_other_than_inproc_fails_typed() {
    let src = vec![2u8; 64];
    let dst = vec![0u8; 64];
    let a = agent_with("init", |c| {
        c.with_required_transport(MemoryType::Dram, TransportKind::Rdma)
    });
    let b = agent("target");
    register(a.as_ref(), &src);
    register(b.as_ref(), &dst);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    let err = a
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            MemoryDescs::dram(&dst),
            "target",
        ))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TransportRequired {
                actual: TransportKind::InProcess,
                required: TransportKind::Rdma,
                ..
            }
        ),
        "{err}"
    );
    assert!(dst.iter().all(|&x| x == 0));
}

#[test]
fn busy_regions_cannot_be_deregistered_and_prepared_transfers_repeat() {
    let src = vec![4u8; 128];
    let dst = vec![0u8; 128];
    let (a, b) = pair();
    register(a.as_ref(), &src);
    register(b.as_ref(), &dst);
    introduce(a.as_ref(), b.as_ref());
    let req = TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), "target");
    let prepared = a.prepare_transfer(&req).unwrap();
    // The prepared transfer holds its local region.
    let err = a.deregister_memory(&MemoryDescs::dram(&src)).unwrap_err();
    assert!(matches!(err, Error::RegionBusy { .. }), "{err}");
    for _ in 0..3 {
        done(a.submit_prepared(&prepared)).unwrap();
    }
    assert_eq!(dst, src);
    drop(prepared);
    a.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
}

/// A target dropped while another thread is copying into it: its drop
/// returns only once that copy is over, and no copy starts after.
#[test]
fn dropping_a_target_waits_out_copies_under_way() {
    let len = 64 << 20;
    let (a_src, b_src) = (vec![0xAAu8; len], vec![0xBBu8; len]);
    let mut dst = vec![0u8; len];
    let dst_ptr = dst.as_mut_ptr();
    let a = std::sync::Arc::new(agent("init"));
    let b = agent("target");
    register(a.as_ref().as_ref(), &a_src);
    register(a.as_ref().as_ref(), &b_src);
    let dst_descs = MemoryDescs::new(
        MemoryType::Dram,
        vec![kvxfer::MemoryDesc::new(dst_ptr as u64, len as u64, 0)],
    );
    // SAFETY: `dst` is declared before the agents and outlives them; no
    // reference to it is used until the target is dropped.
    unsafe { b.register_memory(&dst_descs).unwrap() };
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    // The writer copies 0xAA, 0xBB, 0xAA, ... into `dst`, back to back.
    let reqs = [&a_src, &b_src]
        .map(|src| TransferRequest::write(MemoryDescs::dram(src), dst_descs.clone(), "target"));
    let writer = {
        let a = std::sync::Arc::clone(&a);
        std::thread::spawn(move || {
            for k in 0.. {
                match done(a.submit_transfer(&reqs[k % 2])) {
                    Ok(()) => {}
                    Err(Error::ConnectionLost { .. }) => return k,
                    Err(e) => panic!("{e}"),
                }
            }
            unreachable!()
        })
    };
    // The middle of `dst` turns 0xBB while the second copy is half done
    // (a copy's last stores go to both ends): drop the target then.
    // SAFETY: `dst_ptr + len/2` lies in `dst`, alive; a volatile read of a
    // byte the writer may be copying over.
    while unsafe { std::ptr::read_volatile(dst_ptr.add(len / 2)) } != 0xBB && !writer.is_finished()
    {
        std::hint::spin_loop();
    }
    drop(b);
    // Marks at both ends, where the copy's last stores go, stay.
    const MARK: usize = 64 << 10;
    // SAFETY: the target agent is dropped, so no in-process initiator
    // writes `dst` any more (which is what the test checks).
    unsafe {
        std::ptr::write_bytes(dst_ptr, 0x55, MARK);
        std::ptr::write_bytes(dst_ptr.add(len - MARK), 0x55, MARK);
    }
    let landed = writer.join().unwrap();
    assert!(landed >= 1);
    let marked = |x: &[u8]| x.iter().all(|&x| x == 0x55);
    assert!(
        marked(&dst[..MARK]) && marked(&dst[len - MARK..]),
        "written after the drop"
    );
}

/// One request of the model test: a WRITE or a READ of `pieces`, each
/// (local offset, remote offset, length).
#[derive(Clone, Debug)]
struct Op {
    write: bool,
    pieces: Vec<(usize, usize, usize)>,
}

const SIDE: usize = 4096;

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    let piece =
        (0..SIDE, 0..SIDE, 1..512usize).prop_map(|(l, r, n)| (l.min(SIDE - n), r.min(SIDE - n), n));
    (any::<bool>(), proptest::collection::vec(piece, 1..6))
        .prop_map(|(write, pieces)| Op { write, pieces })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Random scattered WRITEs and READs between two agents leave both
    /// buffers exactly as a byte-by-byte model of the same requests does.
    #[test]
    fn scattered_requests_agree_with_a_model(ops in proptest::collection::vec(op(), 1..12)) {
        let mut local: Vec<u8> = (0..SIDE).map(|i| (i % 251) as u8).collect();
        let mut remote: Vec<u8> = (0..SIDE).map(|i| (i % 241) as u8 ^ 0x80).collect();
        let (mut want_local, mut want_remote) = (local.clone(), remote.clone());
        let (lp, rp) = (local.as_mut_ptr() as u64, remote.as_mut_ptr() as u64);
        let (a, b) = pair();
        let whole = |p: u64| MemoryDescs::new(MemoryType::Dram, vec![kvxfer::MemoryDesc::new(p, SIDE as u64, 0)]);
        // SAFETY: both buffers are declared before the agents and outlive
        // them; they are read only after the agents are dropped.
        unsafe {
            a.register_memory(&whole(lp)).unwrap();
            b.register_memory(&whole(rp)).unwrap();
        }
        introduce(a.as_ref(), b.as_ref());
        for op in &ops {
            let descs = |base: u64, pick: fn(&(usize, usize, usize)) -> usize| MemoryDescs::new(
                MemoryType::Dram,
                op.pieces.iter().map(|p| kvxfer::MemoryDesc::new(base + pick(p) as u64, p.2 as u64, 0)).collect(),
            );
            let (l, r) = (descs(lp, |p| p.0), descs(rp, |p| p.1));
            let req = if op.write {
                TransferRequest::write(l, r, "target")
            } else {
                TransferRequest::read(l, r, "target")
            };
            done(a.submit_transfer(&req)).unwrap();
            for &(lo, ro, n) in &op.pieces {
                if op.write {
                    want_remote[ro..ro + n].copy_from_slice(&want_local[lo..lo + n]);
                } else {
                    want_local[lo..lo + n].copy_from_slice(&want_remote[ro..ro + n]);
                }
            }
        }
        drop((a, b));
        proptest::prop_assert_eq!(local, want_local);
        proptest::prop_assert_eq!(remote, want_remote);
    }
}

/// A prepared TCP transfer is planned once and posted again and again:
/// scattered pieces split into segments over several streams, each post
/// moving the memory as it is then (not as it was when prepared), its
/// sync message delivered each time; a prepared READ gathers back; once
/// the peer is loaded again (its entry replaced) the plan is not used and
/// the request is resolved afresh.
#[test]
fn prepared_tcp_transfers_post_their_plan_again_and_again() {
    const N: usize = 64;
    const PIECE: usize = 8192;
    let mut src = vec![0u8; N * PIECE];
    let dst = vec![0u8; N * PIECE];
    let back = vec![0u8; N * PIECE];
    let cfg = |n: &str| {
        AgentConfig::new(n)
            .with_streams_per_peer(3)
            .with_segment_size(4096)
    };
    let a = make_transfer_agent(Backend::Tcp, cfg("p-init")).unwrap();
    let b = make_transfer_agent(Backend::Tcp, cfg("p-target")).unwrap();
    register(a.as_ref(), &src);
    register(a.as_ref(), &back);
    register(b.as_ref(), &dst);
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    // Piece i of `src` goes to slot (i * 5) % N of `dst`.
    let slot = |i: usize| (i * 5) % N;
    let scattered = |local: &[u8]| {
        let l = (0..N)
            .map(|i| {
                kvxfer::MemoryDesc::new(local.as_ptr() as u64 + (i * PIECE) as u64, PIECE as u64, 0)
            })
            .collect();
        let r = (0..N)
            .map(|i| {
                kvxfer::MemoryDesc::new(
                    dst.as_ptr() as u64 + (slot(i) * PIECE) as u64,
                    PIECE as u64,
                    0,
                )
            })
            .collect();
        (
            MemoryDescs::new(MemoryType::Dram, l),
            MemoryDescs::new(MemoryType::Dram, r),
        )
    };
    let (l, r) = scattered(&src);
    let write = a
        .prepare_transfer(
            &TransferRequest::write(l, r, "p-target").with_sync_message(b"w".to_vec()),
        )
        .unwrap();
    let (l, r) = scattered(&back);
    let read = a
        .prepare_transfer(&TransferRequest::read(l, r, "p-target"))
        .unwrap();
    let wait = Duration::from_secs(60);
    for round in 0..3u8 {
        for (i, x) in src.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(7) ^ round;
        }
        a.submit_prepared(&write)
            .unwrap()
            .wait_success(wait)
            .unwrap();
        assert_eq!(b.wait_sync_messages(wait)["p-init"], vec![b"w".to_vec()]);
        for i in 0..N {
            assert!(
                dst[slot(i) * PIECE..][..PIECE] == src[i * PIECE..][..PIECE],
                "round {round}, piece {i}"
            );
        }
        a.submit_prepared(&read)
            .unwrap()
            .wait_success(wait)
            .unwrap();
        assert_eq!(back, src, "round {round}: read back");
    }
    // The peer loaded again: its entry is replaced, the plan is not used.
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    src.fill(0x5a);
    a.submit_prepared(&write)
        .unwrap()
        .wait_success(wait)
        .unwrap();
    assert!(dst.iter().all(|&x| x == 0x5a));
    assert_eq!(b.wait_sync_messages(wait)["p-init"], vec![b"w".to_vec()]);
}
