//! The agent conformance suite: two agents in two processes over loopback.
//! Runs on the backend named by `KVXFER_TEST_BACKEND` (default `tcp`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvxfer::{
    AgentConfig, AgentDesc, Backend, DescError, Error, Landed, MemoryDescs, RejectReason,
    TransferRequest, TransferState,
};

const WAIT: Duration = Duration::from_secs(120);

/// Entry point of the peer process (see `common::peer_main`). In a normal
/// run it checks that a peer process starts, answers and stops.
#[test]
fn peer_process_entry() {
    if std::env::var_os("KVXFER_PEER").is_some() {
        peer_main();
    }
    let mut p = PeerProc::spawn("harness", 4096, 1, &[]);
    assert_eq!(p.cmd("check 1 0 4096"), "OK");
    assert_eq!(
        p.cmd("check 2 0 4096").split_whitespace().next(),
        Some("BAD")
    );
}

/// WRITEs all of `src` to the start of `peer`'s block (agent `name`) and
/// waits for its success.
fn write_whole(
    agent: &dyn kvxfer::TransferAgent,
    src: &[u8],
    peer: &PeerProc,
    name: &str,
) -> kvxfer::TransferStatus {
    let st = agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(src),
            peer.range(0, src.len() as u64),
            name,
        ))
        .unwrap();
    st.wait_success(WAIT).unwrap();
    st
}

fn write_then_read(size: u64) {
    let mut peer = PeerProc::spawn("target", size, 11, &[]);
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 22, 0);
    let (agent, name) = connect(&peer, &src);
    assert_eq!(name, "target");

    let st = write_whole(agent.as_ref(), &src, &peer, &name);
    assert!(st.is_completed());
    assert_eq!(peer.cmd(&format!("check 22 0 {size}")), "OK");

    // READ it back into a second local buffer, after the peer re-patterns it.
    assert_eq!(peer.cmd("fill 33"), "OK");
    let dst = vec![0u8; size as usize];
    register(agent.as_ref(), &dst);
    agent
        .submit_transfer(&TransferRequest::read(
            MemoryDescs::dram(&dst),
            peer.range(0, size),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(first_mismatch(&dst, 33, 0), None);
}

#[test]
fn write_and_read_1_byte() {
    write_then_read(1);
}

#[test]
fn write_and_read_64_kib() {
    write_then_read(64 << 10);
}

#[test]
fn write_and_read_256_mib() {
    write_then_read(256 << 20);
}

#[test]
fn ten_thousand_small_descriptors_in_one_request() {
    const N: u64 = 10_000;
    const STRIDE: u64 = 256;
    const LEN: u64 = 100;
    let size = N * STRIDE;
    let mut peer = PeerProc::spawn("target", size, 5, &[]);
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 6, 0);
    let (agent, name) = connect(&peer, &src);
    // Source descriptor i at i*STRIDE, destination at (N-1-i)*STRIDE + 13:
    // a permutation, so a mis-paired descriptor cannot go unnoticed.
    let local = dram((0..N).map(|i| (src.as_ptr() as u64 + i * STRIDE, LEN)));
    let remote = dram((0..N).map(|i| (peer.addr + (N - 1 - i) * STRIDE + 13, LEN)));
    agent
        .submit_transfer(&TransferRequest::write(
            local.clone(),
            remote.clone(),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    // Expected image of the peer's buffer.
    let mut expect = vec![0u8; size as usize];
    fill(&mut expect, 5, 0);
    for i in 0..N {
        let d = ((N - 1 - i) * STRIDE + 13) as usize;
        let s = (i * STRIDE) as usize;
        expect[d..d + LEN as usize].copy_from_slice(&src[s..s + LEN as usize]);
    }
    assert_eq!(peer.cmd("hash"), fnv(&expect).to_string());
    // And back again with one READ of 10,000 descriptors.
    let back = vec![0u8; size as usize];
    register(agent.as_ref(), &back);
    let local_back = dram((0..N).map(|i| (back.as_ptr() as u64 + i * STRIDE, LEN)));
    agent
        .submit_transfer(&TransferRequest::read(local_back, remote, &name))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    for i in 0..N as usize {
        let s = i * STRIDE as usize;
        assert_eq!(
            back[s..s + LEN as usize],
            src[s..s + LEN as usize],
            "descriptor {i}"
        );
    }
}

/// The target checks its whole buffer against the pattern named in the
/// message at the moment it takes the message. With four streams per peer
/// (TCP; on RDMA, the queue pairs `KVXFER_TEST_RDMA_QPS` asks for, 3 in one
/// of CI's guest runs) the data is spread over several connections, so a
/// message released when its own connection is done (rather than when
/// every segment is) would be seen before the data and fail the check.
/// End-to-end integrity on the path this backend takes: checked WRITEs
/// and READs land whole (and the WRITE's sync message is delivered).
/// Where the target checks the ranges a request moved when it commits
/// (shm, libfabric, RDMA), two pieces written over one range cannot both
/// match what landed: that request fails with `Integrity`, and the link
/// serves on. Over TCP each piece is checked as it lands, so it fails only
/// when the other piece landed over it before its check (two streams).
#[test]
fn checked_requests_are_checked_on_every_path() {
    let size: u64 = 1 << 20;
    let mut peer = PeerProc::spawn("target", size, 5, &[]);
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 6, 0);
    let back = vec![0u8; size as usize];
    let (agent, name) = connect(&peer, &src);
    register(agent.as_ref(), &back);
    let pieces = [(3u64, 1000u64), (4096, 65536), (300_000, 600_000)];
    let at = |base: u64| dram(pieces.iter().map(|&(o, l)| (base + o, l)));
    let w = TransferRequest::write(at(src.as_ptr() as u64), at(peer.addr), &name)
        .with_sync_message(b"checked".to_vec())
        .with_integrity();
    let transport = expected_transport();
    agent
        .submit_transfer(&w)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd("msgs"), "init=checked");
    let r = TransferRequest::read(at(back.as_ptr() as u64), at(peer.addr), &name).with_integrity();
    agent
        .submit_transfer(&r)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    for (o, l) in pieces {
        let (o, l) = (o as usize, l as usize);
        assert_eq!(first_mismatch(&back[o..o + l], 6, o as u64), None);
    }
    // Two different pieces over one remote range: unchecked first (a link
    // may remember it, and must not post it again unchecked), then
    // checked, submitted and prepared.
    let to = peer.addr;
    let overlap = |checked: bool| {
        let r = TransferRequest::write(
            dram([
                (src.as_ptr() as u64, 4096),
                (src.as_ptr() as u64 + 8192, 4096),
            ]),
            dram([(to, 4096), (to, 4096)]),
            &name,
        )
        .with_sync_message(b"overlap".to_vec());
        if checked { r.with_integrity() } else { r }
    };
    agent
        .submit_transfer(&overlap(false))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd("msgs"), "init=overlap");
    let prepared = agent.prepare_transfer(&overlap(true)).unwrap();
    for round in 0..3 {
        let st = if round == 0 {
            agent.submit_transfer(&overlap(true))
        } else {
            agent.submit_prepared(&prepared)
        };
        let outcome = st.unwrap().wait_success(WAIT);
        match outcome {
            Err(e) => {
                assert!(matches!(e, Error::Integrity { .. }), "round {round}: {e}");
                assert_eq!(peer.cmd("msgs"), "", "a failed check delivers nothing");
            }
            // TCP checks each piece as it lands: on one stream, or when the
            // other piece did not land over it meanwhile, both match.
            Ok(()) => {
                assert_eq!(transport, "tcp", "round {round}: not checked");
                assert_eq!(peer.cmd("msgs"), "init=overlap");
            }
        }
    }
    drop(prepared);
    write_whole(agent.as_ref(), &src, &peer, &name);
    assert_eq!(peer.cmd(&format!("check 6 0 {size}")), "OK");
}

/// Completion callbacks run on the process's callback thread: one that
/// panics is caught and counted, one that blocks holds up no transfer; the
/// link serves on throughout.
#[test]
fn callbacks_that_panic_or_block_hold_up_no_transfer() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let mut src = vec![0u8; 4096];
    fill(&mut src, 8, 0);
    let (agent, name) = connect(&peer, &src);
    let write = || {
        agent
            .submit_transfer(&TransferRequest::write(
                MemoryDescs::dram(&src),
                peer.range(0, 4096),
                &name,
            ))
            .unwrap()
    };
    let panics = |a: &dyn kvxfer::TransferAgent| {
        a.metrics_text()
            .lines()
            .find(|l| l.starts_with("kvxfer_callback_panics_total "))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .expect("the counter")
    };
    let before = panics(agent.as_ref());
    let st = write();
    st.on_complete(|_| panic!("a callback that panics"));
    st.wait_success(WAIT).unwrap();
    // A callback that blocks until released, then later transfers.
    let (release, blocked) = std::sync::mpsc::channel::<()>();
    let (ran, seen) = std::sync::mpsc::channel();
    let st = write();
    st.on_complete(move |_| {
        let _ = blocked.recv();
    });
    st.wait_success(WAIT).unwrap();
    for _ in 0..3 {
        let st = write();
        let r = ran.clone();
        st.on_complete(move |o| r.send(o.is_ok()).unwrap());
        st.wait_success(WAIT).unwrap();
    }
    assert_eq!(peer.cmd("check 8 0 4096"), "OK");
    // The callbacks after the blocked one run once it is released.
    assert!(seen.try_recv().is_err());
    release.send(()).unwrap();
    for _ in 0..3 {
        assert!(seen.recv_timeout(WAIT).unwrap());
    }
    assert!(panics(agent.as_ref()) > before, "the panic was counted");
}

/// A request's sync message is delivered after every byte of it landed
/// (the target checks the pattern when the message arrives), over four
/// streams of 256 KiB segments: 128 segments a request, two requests of
/// different patterns so a stale round would show.
#[test]
fn sync_message_arrives_after_all_data() {
    let size: u64 = 32 << 20;
    let mut peer = PeerProc::spawn("target", size, 1, &[]);
    assert_eq!(peer.cmd("watch"), "OK");
    let agent = local_agent("init", |c| {
        c.with_streams_per_peer(4).with_segment_size(256 << 10)
    });
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let mut src = vec![0u8; size as usize];
    register(agent.as_ref(), &src);
    for round in 2..4u64 {
        fill(&mut src, round, 0);
        let st = agent
            .submit_transfer(
                &TransferRequest::write(MemoryDescs::dram(&src), peer.range(0, size), &name)
                    .with_sync_message(format!("seed:{round}")),
            )
            .unwrap();
        let msg = peer.line(WAIT).expect("sync message");
        assert_eq!(msg, format!("MSG init seed:{round} OK"));
        st.wait_success(WAIT).unwrap();
    }
    // Exactly once: nothing more arrives.
    assert_eq!(peer.line(Duration::from_millis(300)), None);
}

/// A standalone notification is ordered after the data of the transfers
/// submitted before it, even across streams (queue pairs, with
/// `KVXFER_TEST_RDMA_QPS`).
#[test]
fn notify_follows_earlier_transfers() {
    let size: u64 = 32 << 20;
    let mut peer = PeerProc::spawn("target", size, 1, &[]);
    assert_eq!(peer.cmd("watch"), "OK");
    let agent = local_agent("init", |c| {
        c.with_streams_per_peer(3).with_segment_size(128 << 10)
    });
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 9, 0);
    register(agent.as_ref(), &src);
    let st = agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, size),
            &name,
        ))
        .unwrap();
    let n = agent
        .notify_sync_message(&name, b"seed:9".to_vec())
        .unwrap();
    assert_eq!(peer.line(WAIT).unwrap(), "MSG init seed:9 OK");
    st.wait_success(WAIT).unwrap();
    n.wait_success(WAIT).unwrap();
}

#[test]
fn sync_messages_in_both_directions_grouped_by_sender() {
    let peer = PeerProc::spawn("target", 4096, 1, &[]);
    let a = local_agent("a", |c| c);
    let b = local_agent("b", |c| c);
    let name = a.load_remote_agent_by_connection(&peer.conn).unwrap();
    b.load_remote_agent_by_connection(&peer.conn).unwrap();
    // Two in-process agents notify each other, and both notify the peer.
    a.load_remote_agent(&b.local_agent_desc()).unwrap();
    b.load_remote_agent(&a.local_agent_desc()).unwrap();
    for i in 0..3 {
        a.notify_sync_message("b", format!("a{i}").into_bytes())
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
        b.notify_sync_message("a", format!("b{i}").into_bytes())
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
    }
    a.notify_sync_message(&name, b"from-a".to_vec())
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    b.notify_sync_message(&name, b"from-b".to_vec())
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    let at_b = b.take_sync_messages();
    assert_eq!(
        at_b["a"],
        vec![b"a0".to_vec(), b"a1".to_vec(), b"a2".to_vec()]
    );
    let at_a = a.take_sync_messages();
    assert_eq!(
        at_a["b"],
        vec![b"b0".to_vec(), b"b1".to_vec(), b"b2".to_vec()]
    );
    assert!(a.take_sync_messages().is_empty(), "taken messages are gone");
    let mut peer = peer;
    let mut got: Vec<String> = peer
        .cmd("msgs")
        .split_whitespace()
        .map(String::from)
        .collect();
    got.sort();
    assert_eq!(got, vec!["a=from-a", "b=from-b"]);
}

/// Senders come and go while another keeps sending to the same target (on
/// RDMA: their queue pairs share the target's receive queue): a sender
/// that leaves, with or without a message in flight, costs the others
/// nothing, and each sender's messages arrive once, in order.
#[test]
fn senders_leaving_do_not_disturb_the_others() {
    let mut peer = PeerProc::spawn("target", 4096, 1, &[]);
    let stay = local_agent("stay", |c| c);
    let name = stay.load_remote_agent_by_connection(&peer.conn).unwrap();
    let mut want = Vec::new();
    for round in 0..4 {
        let gone = local_agent(&format!("gone{round}"), |c| c);
        let gname = gone.load_remote_agent_by_connection(&peer.conn).unwrap();
        gone.notify_sync_message(&gname, format!("hello{round}").into_bytes())
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
        want.push(format!("gone{round}=hello{round}"));
        // Odd rounds leave with a message submitted and not waited for: it
        // may or may not arrive.
        if round % 2 == 1 {
            let _ = gone.notify_sync_message(&gname, b"late".to_vec());
        }
        drop(gone);
        for k in 0..5 {
            stay.notify_sync_message(&name, format!("m{round}.{k}").into_bytes())
                .unwrap()
                .wait_success(WAIT)
                .unwrap();
            want.push(format!("stay=m{round}.{k}"));
        }
    }
    let got = peer.cmd("msgs");
    let got: Vec<&str> = got
        .split_whitespace()
        .filter(|m| !m.ends_with("=late"))
        .collect();
    let order = |who: &str, v: &[&str]| -> Vec<String> {
        v.iter()
            .filter(|m| m.starts_with(who))
            .map(|m| m.to_string())
            .collect()
    };
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    assert_eq!(order("stay=", &got), order("stay=", &want));
    let mut gone_got = order("gone", &got);
    gone_got.sort();
    assert_eq!(gone_got, order("gone", &want));
}

#[test]
fn two_writers_into_one_target() {
    let size: u64 = 8 << 20;
    let mut peer = PeerProc::spawn("target", size, 1, &[]);
    let half = size / 2;
    let mut handles = Vec::new();
    for (i, seed) in [(0u64, 40u64), (1, 41)] {
        let conn = peer.conn.clone();
        let addr = peer.addr + i * half;
        handles.push(std::thread::spawn(move || {
            let agent = local_agent(&format!("writer{i}"), |c| c);
            let name = agent.load_remote_agent_by_connection(&conn).unwrap();
            let mut src = vec![0u8; half as usize];
            fill(&mut src, seed, i * half);
            register(agent.as_ref(), &src);
            agent
                .submit_transfer(&TransferRequest::write(
                    MemoryDescs::dram(&src),
                    dram([(addr, half)]),
                    name,
                ))
                .unwrap()
                .wait_success(WAIT)
                .unwrap();
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(peer.cmd(&format!("check 40 0 {half}")), "OK");
    assert_eq!(peer.cmd(&format!("check 41 {half} {half}")), "OK");
}

#[test]
fn out_of_range_remote_descriptor_is_refused_and_target_unchanged() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let src = vec![0xAAu8; 8192];
    let (agent, name) = connect(&peer, &src);
    // One byte past the end, straddling the end, and far away.
    for (addr, len) in [
        (peer.addr + 4096, 1),
        (peer.addr + 4000, 200),
        (peer.addr + (1 << 40), 8),
    ] {
        let err = agent
            .submit_transfer(&TransferRequest::write(
                dram([(src.as_ptr() as u64, len)]),
                dram([(addr, len)]),
                &name,
            ))
            .unwrap_err();
        assert!(matches!(err, Error::RemoteRangeNotExported { .. }), "{err}");
    }
    // A mixed request (one good descriptor, one bad) is refused whole.
    let err = agent
        .submit_transfer(&TransferRequest::write(
            dram([(src.as_ptr() as u64, 16), (src.as_ptr() as u64 + 16, 16)]),
            dram([(peer.addr, 16), (peer.addr + 4090, 16)]),
            &name,
        ))
        .unwrap_err();
    assert!(matches!(err, Error::RemoteRangeNotExported { .. }), "{err}");
    assert_eq!(peer.cmd("check 3 0 4096"), "OK");
}

#[test]
fn unregistered_local_source_is_refused_before_sending() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    assert_eq!(peer.cmd("watch"), "OK");
    let agent = local_agent("init", |c| c);
    let registered = vec![1u8; 4096];
    register(agent.as_ref(), &registered);
    let unregistered = vec![2u8; 4096];
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    for local in [
        MemoryDescs::dram(&unregistered),
        // Straddles the end of the registered buffer.
        dram([(registered.as_ptr() as u64 + 4000, 200)]),
    ] {
        let len = local.descs[0].len;
        let err = agent
            .submit_transfer(
                &TransferRequest::write(local, peer.range(0, len), &name)
                    .with_sync_message(b"x".to_vec()),
            )
            .unwrap_err();
        assert!(matches!(err, Error::NotRegistered { .. }), "{err}");
    }
    assert_eq!(peer.cmd("check 3 0 4096"), "OK");
    assert_eq!(
        peer.line(Duration::from_millis(300)),
        None,
        "no sync message"
    );
}

#[test]
fn mismatched_request_shapes_are_refused() {
    let peer = PeerProc::spawn("target", 4096, 3, &[]);
    let src = vec![1u8; 4096];
    let (agent, name) = connect(&peer, &src);
    let a = src.as_ptr() as u64;
    for (l, r) in [
        (dram([(a, 10)]), dram([(peer.addr, 11)])),
        (dram([(a, 10), (a + 10, 10)]), dram([(peer.addr, 10)])),
        (dram([(a, 0)]), dram([(peer.addr, 0)])),
    ] {
        let err = agent
            .submit_transfer(&TransferRequest::write(l, r, &name))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidRequest(_) | Error::InvalidDescriptor { .. }
            ),
            "{err}"
        );
    }
}

#[test]
fn invalidated_remote_cannot_be_used() {
    let peer = PeerProc::spawn("target", 4096, 3, &[]);
    let src = vec![1u8; 4096];
    let (agent, name) = connect(&peer, &src);
    agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, 4096),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    agent.invalidate_remote_agent(&name).unwrap();
    let err = agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, 4096),
            &name,
        ))
        .unwrap_err();
    assert!(matches!(err, Error::UnknownAgent(_)), "{err}");
    assert!(matches!(
        agent.notify_sync_message(&name, vec![1]),
        Err(Error::UnknownAgent(_))
    ));
    assert!(!agent.check_remote_descs(&name, &peer.range(0, 1)));
    assert!(matches!(
        agent.invalidate_remote_agent(&name),
        Err(Error::UnknownAgent(_))
    ));
    // Loading it again makes it usable again.
    agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, 4096),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
}

/// A prepared transfer goes again and again, holds its local region, is
/// refused by another agent, and follows its remote agent being
/// invalidated and loaded again (resolved afresh).
#[test]
fn prepared_transfer_is_submitted_again_and_again() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let mut src = vec![0u8; 4096];
    let (agent, name) = connect(&peer, &src);
    // Bad requests are refused when prepared, as when submitted.
    let unregistered = vec![0u8; 64];
    let err = agent
        .prepare_transfer(&TransferRequest::write(
            MemoryDescs::dram(&unregistered),
            peer.range(0, 64),
            &name,
        ))
        .unwrap_err();
    assert!(matches!(err, Error::NotRegistered { .. }), "{err}");
    let err = agent
        .prepare_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src[..64]),
            dram([(peer.addr + 4090, 64)]),
            &name,
        ))
        .unwrap_err();
    assert!(matches!(err, Error::RemoteRangeNotExported { .. }), "{err}");

    let prepared = agent
        .prepare_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, 4096),
            &name,
        ))
        .unwrap();
    for seed in 40..45 {
        fill(&mut src, seed, 0);
        agent
            .submit_prepared(&prepared)
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
        assert_eq!(peer.cmd(&format!("check {seed} 0 4096")), "OK");
    }
    let err = agent
        .deregister_memory(&MemoryDescs::dram(&src))
        .unwrap_err();
    assert!(matches!(err, Error::RegionBusy { .. }), "{err}");
    let other = local_agent("other", |c| c);
    let err = other.submit_prepared(&prepared).unwrap_err();
    assert!(matches!(err, Error::InvalidRequest(_)), "{err}");

    agent.invalidate_remote_agent(&name).unwrap();
    let err = agent.submit_prepared(&prepared).unwrap_err();
    assert!(matches!(err, Error::UnknownAgent(_)), "{err}");
    agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    fill(&mut src, 46, 0);
    agent
        .submit_prepared(&prepared)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd("check 46 0 4096"), "OK");
    drop(prepared);
    agent.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
}

/// The same small request again after its source was deregistered is
/// refused (the agent may remember a request's resolution, never past a
/// deregistration), and goes again once the source is registered anew.
/// Transfers made by index from prepared lists: permuted blocks (runs of
/// adjacent pairs merged), WRITE and READ element-exact, the sync message
/// after the data, the local region held while a transfer lives, lists
/// resolved again after a deregistration or a new load of the peer, and
/// bad input refused typed.
#[test]
fn indexed_transfers_from_prepared_lists() {
    const B: u64 = 4096;
    const N: u64 = 64;
    let mut peer = PeerProc::spawn("target", N * B, 3, &[]);
    let mut src = vec![0u8; (N * B) as usize];
    let (agent, name) = connect(&peer, &src);
    let blocks = |base: u64| dram((0..N).map(|i| (base + i * B, B)));
    let local = agent
        .prepare_desc_list(blocks(src.as_ptr() as u64), None)
        .unwrap();
    let remote = agent
        .prepare_desc_list(blocks(peer.addr), Some(&name))
        .unwrap();
    // Pair k: local block k into remote block perm[k]; groups of four in
    // reverse order, so each group is one piece.
    let perm: Vec<u32> = (0..N as u32)
        .map(|k| (N as u32 / 4 - 1 - k / 4) * 4 + k % 4)
        .collect();
    let ids: Vec<u32> = (0..N as u32).collect();
    let indexed =
        |op, local: &std::sync::Arc<kvxfer::PreparedDescList>, li: Vec<u32>, ri: Vec<u32>| {
            kvxfer::IndexedRequest {
                op,
                local: local.clone(),
                local_indices: li.into(),
                remote: remote.clone(),
                remote_indices: ri.into(),
                sync_message: Some(b"blocks landed".to_vec()),
                merge: true,
            }
        };
    // Local block k holds the pattern of remote block perm[k].
    let fill_permuted = |src: &mut [u8], seed| {
        for (k, &p) in perm.iter().enumerate() {
            let at = k * B as usize;
            fill(&mut src[at..at + B as usize], seed, u64::from(p) * B);
        }
    };
    let write_permuted = || {
        agent
            .prepare_indexed(indexed(
                kvxfer::TransferOp::Write,
                &local,
                ids.clone(),
                perm.clone(),
            ))
            .unwrap()
    };
    fill_permuted(&mut src, 51);
    let w = write_permuted();
    assert_eq!((w.total_bytes(), w.desc_count()), (N * B, (N / 4) as usize));
    if backend() == Backend::Tcp {
        // Its pairs went to the link whole: no request was made of them.
        assert!(format!("{w:?}").contains("request: None"), "{w:?}");
    }
    agent
        .submit_prepared(&w)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd(&format!("check 51 0 {}", N * B)), "OK");
    assert_eq!(peer.cmd("msgs"), "init=blocks landed");
    // The request it stands for: the pieces after merging.
    assert_eq!(w.request().local.descs.len(), (N / 4) as usize);
    assert_eq!(w.request().remote.total_len(), N * B);

    // READ into another local list, after the peer re-patterns.
    assert_eq!(peer.cmd("fill 52"), "OK");
    let dst = vec![0u8; (N * B) as usize];
    register(agent.as_ref(), &dst);
    let dlist = agent
        .prepare_desc_list(blocks(dst.as_ptr() as u64), None)
        .unwrap();
    let r = agent
        .prepare_indexed(indexed(
            kvxfer::TransferOp::Read,
            &dlist,
            ids.clone(),
            perm.clone(),
        ))
        .unwrap();
    agent
        .submit_prepared(&r)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    for (k, &p) in perm.iter().enumerate() {
        let at = k * B as usize;
        assert_eq!(
            first_mismatch(&dst[at..at + B as usize], 52, u64::from(p) * B),
            None,
            "block {k}"
        );
    }

    // One pair of the whole buffer (split into segments over the streams).
    let whole_l = agent
        .prepare_desc_list(MemoryDescs::dram(&src), None)
        .unwrap();
    let whole_r = agent
        .prepare_desc_list(peer.range(0, N * B), Some(&name))
        .unwrap();
    fill(&mut src, 53, 0);
    let mut one = indexed(kvxfer::TransferOp::Write, &whole_l, vec![0], vec![0]);
    one.remote = whole_r;
    let one = agent.prepare_indexed(one).unwrap();
    agent
        .submit_prepared(&one)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd(&format!("check 53 0 {}", N * B)), "OK");

    // Bad input, refused typed: an index outside its list, lengths that
    // differ, sides swapped, a list of another agent, a remote range not
    // exported, an unregistered local range.
    let bad = |req: kvxfer::IndexedRequest| agent.prepare_indexed(req).unwrap_err();
    let e = bad(indexed(
        kvxfer::TransferOp::Write,
        &local,
        vec![0, N as u32],
        vec![0, 1],
    ));
    assert!(
        matches!(&e, Error::InvalidRequest(m) if m.contains("local index 64")),
        "{e}"
    );
    let halves = agent
        .prepare_desc_list(dram([(src.as_ptr() as u64, B / 2)]), None)
        .unwrap();
    let e = bad(indexed(
        kvxfer::TransferOp::Write,
        &halves,
        vec![0],
        vec![0],
    ));
    assert!(
        matches!(&e, Error::InvalidRequest(m) if m.contains("length")),
        "{e}"
    );
    let mut swapped = indexed(kvxfer::TransferOp::Write, &local, vec![0], vec![0]);
    std::mem::swap(&mut swapped.local, &mut swapped.remote);
    assert!(matches!(bad(swapped), Error::InvalidRequest(_)));
    let other = local_agent("other", |c| c);
    let theirs_buf = vec![0u8; B as usize];
    register(other.as_ref(), &theirs_buf);
    let theirs = other
        .prepare_desc_list(MemoryDescs::dram(&theirs_buf), None)
        .unwrap();
    let e = bad(indexed(
        kvxfer::TransferOp::Write,
        &theirs,
        vec![0],
        vec![0],
    ));
    assert!(
        matches!(&e, Error::InvalidRequest(m) if m.contains("another agent")),
        "{e}"
    );
    let e = agent
        .prepare_desc_list(dram([(peer.addr + N * B - 8, 64)]), Some(&name))
        .unwrap_err();
    assert!(matches!(e, Error::RemoteRangeNotExported { .. }), "{e}");
    let stray = vec![0u8; 64];
    let e = agent
        .prepare_desc_list(MemoryDescs::dram(&stray), None)
        .unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    assert_eq!(peer.cmd(&format!("check 53 0 {}", N * B)), "OK");

    // The peer loaded again: transfers made before and after still go.
    agent.invalidate_remote_agent(&name).unwrap();
    agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    fill(&mut src, 54, 0);
    agent
        .submit_prepared(&one)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd(&format!("check 54 0 {}", N * B)), "OK");
    fill_permuted(&mut src, 55);
    let again = write_permuted();
    agent
        .submit_prepared(&again)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd(&format!("check 55 0 {}", N * B)), "OK");

    // Transfers made hold the local region; once they are gone it
    // deregisters, and the list is then refused (resolved again).
    let e = agent
        .deregister_memory(&MemoryDescs::dram(&src))
        .unwrap_err();
    assert!(matches!(e, Error::RegionBusy { .. }), "{e}");
    drop((w, one, again));
    agent.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
    let e = agent
        .prepare_indexed(indexed(kvxfer::TransferOp::Write, &local, vec![0], vec![0]))
        .unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    drop(r);
    agent.deregister_memory(&MemoryDescs::dram(&dst)).unwrap();
}

#[test]
fn same_request_after_deregistering_its_source_is_refused() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let mut src = vec![0u8; 64];
    fill(&mut src, 50, 0);
    let (agent, name) = connect(&peer, &src);
    let req = TransferRequest::write(MemoryDescs::dram(&src), peer.range(0, 64), &name);
    for _ in 0..3 {
        agent
            .submit_transfer(&req)
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
    }
    assert_eq!(peer.cmd("check 50 0 64"), "OK");
    agent.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
    let err = agent.submit_transfer(&req).unwrap_err();
    assert!(matches!(err, Error::NotRegistered { .. }), "{err}");
    register(agent.as_ref(), &src);
    fill(&mut src, 51, 0);
    agent
        .submit_transfer(&req)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd("check 51 0 64"), "OK");
}

/// A small request sent again and again (which a link may remember,
/// resolved) follows the target registering its memory again: once the
/// initiator loads the new descriptor, the same request lands under the new
/// keys, never the stale ones.
#[test]
fn same_request_follows_the_targets_new_registration() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let mut src = vec![0u8; 64];
    let (agent, name) = connect(&peer, &src);
    let req = TransferRequest::write(MemoryDescs::dram(&src), peer.range(0, 64), &name);
    // Each seed's pattern written by the same request, and checked there.
    let write_seeds = |peer: &mut PeerProc, src: &mut [u8], seeds: std::ops::Range<u64>| {
        for seed in seeds {
            fill(src, seed, 0);
            agent
                .submit_transfer(&req)
                .unwrap()
                .wait_success(WAIT)
                .unwrap();
            assert_eq!(peer.cmd(&format!("check {seed} 0 64")), "OK");
        }
    };
    write_seeds(&mut peer, &mut src, 60..63);
    assert_eq!(peer.cmd("dereg"), "OK");
    assert_eq!(peer.cmd("reg"), "OK");
    agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    write_seeds(&mut peer, &mut src, 63..66);
}

#[test]
fn write_after_target_deregistered_is_rejected() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let src = vec![0x55u8; 4096];
    let (agent, name) = connect(&peer, &src);
    let before = peer.cmd("hash");
    assert_eq!(peer.cmd("dereg"), "OK");
    // The initiator's copy of the descriptor is now stale; the target
    // itself refuses: one segment, many small ones (a write list on TCP),
    // and a READ.
    let small_local = dram((0..64).map(|i| (src.as_ptr() as u64 + i * 64, 64)));
    let small_remote = dram((0..64).map(|i| (peer.addr + (63 - i) * 64, 64)));
    for req in [
        TransferRequest::write(MemoryDescs::dram(&src), peer.range(0, 4096), &name),
        TransferRequest::write(small_local, small_remote, &name),
        TransferRequest::read(MemoryDescs::dram(&src), peer.range(0, 4096), &name),
    ] {
        let err = agent.submit_transfer(&req).unwrap().wait(WAIT).unwrap_err();
        // On RDMA the device refuses the stale remote key itself, on
        // libfabric the provider (each in its own words).
        assert!(
            matches!(
                err,
                Error::RemoteRejected {
                    reason: RejectReason::NotRegistered,
                    ..
                } | Error::RdmaCompletion {
                    status: "IBV_WC_REM_ACCESS_ERR",
                    ..
                } | Error::Transport {
                    transport: "fabric",
                    ..
                }
            ),
            "{err}"
        );
    }
    assert_eq!(peer.cmd("hash"), before, "target memory unchanged");
    assert!(
        src.iter().all(|&b| b == 0x55),
        "local memory unchanged by the refused READ"
    );
    // The connection survives a refusal: a notification still goes through.
    agent
        .notify_sync_message(&name, b"still here".to_vec())
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(peer.cmd("msgs"), "init=still here");
}

/// The target deregisters its region while a large WRITE into it is
/// arriving: either the deregistration is refused (the region is busy) and
/// the write completes, or the rest of the write is refused and the request
/// fails with a rejection that says what landed, as the target's memory
/// shows — never a broken connection: a notification on the same link
/// goes through afterwards.
#[test]
fn deregistration_during_an_inbound_write_is_clean() {
    let size: u64 = 64 << 20;
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 7, 0);
    for round in 0..3 {
        let mut peer = PeerProc::spawn("target", size, 3, &[]);
        let (agent, name) = connect(&peer, &src);
        let st = agent
            .submit_transfer(&TransferRequest::write(
                MemoryDescs::dram(&src),
                peer.range(0, size),
                &name,
            ))
            .unwrap();
        let dereg = peer.cmd("dereg");
        // Bytes of the target's region still its own, and bytes written.
        let mut count =
            |seed: u64| -> u64 { peer.cmd(&format!("count {seed} 0 {size}")).parse().unwrap() };
        match (st.wait(WAIT), dereg.as_str()) {
            (Ok(TransferState::Completed), _) => assert_eq!(count(7), size),
            (
                Err(Error::RemoteRejected {
                    reason: RejectReason::NotRegistered,
                    landed,
                    ..
                }),
                "OK",
            ) => {
                let (own, written) = (count(3), count(7));
                match landed {
                    Landed::Nothing => assert_eq!(own, size, "round {round}"),
                    Landed::Partly => assert!(own < size && written < size, "round {round}"),
                    other => panic!("round {round}: {other:?} ({own} own, {written} written)"),
                }
            }
            (
                Err(Error::RdmaCompletion {
                    status: "IBV_WC_REM_ACCESS_ERR",
                    ..
                }),
                "OK",
            ) => {}
            // libfabric: the provider refuses the key (in its own words).
            (
                Err(Error::Transport {
                    transport: "fabric",
                    ..
                }),
                "OK",
            ) => {}
            (other, d) => panic!("round {round}: write {other:?}, deregistration {d}"),
        }
        agent
            .notify_sync_message(&name, b"still here".to_vec())
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
        assert_eq!(peer.cmd("msgs"), "init=still here");
    }
}

/// Small requests one after another (on RDMA: the express lane, whose
/// status object is reused once its caller drops it): every status keeps
/// its own outcome — the kept ones stay completed while later requests,
/// a refused one among them, come and go — and every write lands.
#[test]
fn kept_statuses_keep_their_outcomes() {
    const N: u64 = 16;
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let mut src = vec![0u8; 4096];
    fill(&mut src, 9, 0);
    let (agent, name) = connect(&peer, &src);
    let mut kept = Vec::new();
    for i in 0..N {
        let req = TransferRequest::write(
            dram([(src.as_ptr() as u64 + i * 64, 64)]),
            peer.range(i * 64, 64),
            &name,
        );
        let st = agent.submit_transfer(&req).unwrap();
        st.wait_success(WAIT).unwrap();
        // Every other status kept, the others dropped (free for reuse).
        if i % 2 == 0 {
            kept.push(st);
        }
    }
    // The target's buffer starts filled with seed 3.
    let mut expect = vec![0u8; 4096];
    fill(&mut expect, 3, 0);
    expect[..(N * 64) as usize].copy_from_slice(&src[..(N * 64) as usize]);
    assert_eq!(peer.cmd("hash"), fnv(&expect).to_string());
    // A refused request after them fails alone.
    assert_eq!(peer.cmd("dereg"), "OK");
    let refused =
        TransferRequest::write(dram([(src.as_ptr() as u64, 64)]), peer.range(0, 64), &name);
    assert!(agent.submit_transfer(&refused).unwrap().wait(WAIT).is_err());
    for st in &kept {
        assert!(st.is_completed());
        assert_eq!(st.wait(WAIT).unwrap(), TransferState::Completed);
    }
}

/// A small request whose caller drops its status unwaited, after others
/// that were waited for (on RDMA their waiters drained the completion
/// queue, and the progress thread had stepped back): it still completes
/// on its own — its source region becomes free to deregister — and its
/// bytes land.
#[test]
fn unwaited_small_request_completes_on_its_own() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let mut src = vec![0u8; 4096];
    fill(&mut src, 5, 0);
    let (agent, name) = connect(&peer, &src);
    let req = |i: u64| {
        TransferRequest::write(
            dram([(src.as_ptr() as u64 + i * 64, 64)]),
            peer.range(i * 64, 64),
            &name,
        )
    };
    for i in 0..8 {
        agent
            .submit_transfer(&req(i))
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
    }
    drop(agent.submit_transfer(&req(8)).unwrap());
    let deadline = Instant::now() + WAIT;
    loop {
        match agent.deregister_memory(&MemoryDescs::dram(&src)) {
            Ok(()) => break,
            Err(Error::RegionBusy { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("the unwaited request never completed: {e}"),
        }
    }
    let mut expect = vec![0u8; 4096];
    fill(&mut expect, 3, 0);
    expect[..9 * 64].copy_from_slice(&src[..9 * 64]);
    assert_eq!(peer.cmd("hash"), fnv(&expect).to_string());
}

/// Threads sharing one agent and one connection: three submit small
/// requests one after another (on RDMA they contend for the express lane
/// and fall back to the ordinary path when it is taken), one submits
/// scattered requests of many work requests (the ordinary path); every
/// byte lands where it was sent and nothing else changes.
#[test]
fn threads_sharing_an_agent_mix_small_and_scattered_requests() {
    const REGION: u64 = 16 << 10;
    let mut peer = PeerProc::spawn("target", 4 * REGION, 3, &[]);
    let mut src = vec![0u8; (4 * REGION) as usize];
    fill(&mut src, 11, 0);
    let (agent, name) = connect(&peer, &src);
    let (base, to) = (src.as_ptr() as u64, peer.addr);
    let agent = agent.as_ref();
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let name = &name;
            s.spawn(move || {
                let mut kept = Vec::new();
                for i in 0..100u64 {
                    let off = t * REGION + i * 64;
                    let req = TransferRequest::write(
                        dram([(base + off, 64)]),
                        dram([(to + off, 64)]),
                        name,
                    );
                    let st = agent.submit_transfer(&req).unwrap();
                    st.wait_success(WAIT).unwrap();
                    if t == 0 {
                        kept.push(st);
                    }
                }
                assert!(kept.iter().all(|st| st.is_completed()));
            });
        }
        let name = &name;
        s.spawn(move || {
            for k in 0..8u64 {
                let offs: Vec<u64> = (0..16).map(|j| 3 * REGION + k * 2048 + j * 128).collect();
                let req = TransferRequest::write(
                    dram(offs.iter().map(|&o| (base + o, 64))),
                    dram(offs.iter().map(|&o| (to + o, 64))),
                    name,
                );
                agent
                    .submit_transfer(&req)
                    .unwrap()
                    .wait_success(WAIT)
                    .unwrap();
            }
        });
    });
    for t in 0..3 {
        let off = t * REGION;
        assert_eq!(peer.cmd(&format!("check 11 {off} 6400")), "OK");
        assert_eq!(
            peer.cmd(&format!("check 3 {} {}", off + 6400, REGION - 6400)),
            "OK"
        );
    }
    for k in 0..8u64 {
        for j in 0..16u64 {
            let off = 3 * REGION + k * 2048 + j * 128;
            assert_eq!(peer.cmd(&format!("check 11 {off} 64")), "OK");
            assert_eq!(peer.cmd(&format!("check 3 {} 64", off + 64)), "OK");
        }
    }
}

#[test]
fn refused_request_withholds_its_sync_message() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let src = vec![0x55u8; 4096];
    let (agent, name) = connect(&peer, &src);
    assert_eq!(peer.cmd("dereg"), "OK");
    let st = agent
        .submit_transfer(
            &TransferRequest::write(MemoryDescs::dram(&src), peer.range(0, 4096), &name)
                .with_sync_message(b"must not arrive".to_vec()),
        )
        .unwrap();
    assert!(st.wait(WAIT).is_err());
    assert_eq!(peer.cmd("msgs"), "");
}

/// An initiator "init" (I/O timeout `io_timeout`, `src` registered) with
/// two peer processes of `size` bytes loaded: the target and a bystander.
struct TwoPeers {
    target: PeerProc,
    bystander: PeerProc,
    agent: Box<dyn kvxfer::TransferAgent>,
    /// The target's name.
    name: String,
    /// The bystander's name.
    other: String,
}

impl TwoPeers {
    fn new(size: u64, io_timeout: Duration, src: &[u8]) -> Self {
        let target = PeerProc::spawn("target", size, 3, &[]);
        let agent = local_agent("init", |c| c.with_io_timeout(io_timeout));
        register(agent.as_ref(), src);
        let name = agent.load_remote_agent_by_connection(&target.conn).unwrap();
        let bystander = PeerProc::spawn("bystander", size, 4, &[]);
        let other = agent
            .load_remote_agent_by_connection(&bystander.conn)
            .unwrap();
        Self {
            target,
            bystander,
            agent,
            name,
            other,
        }
    }
}

/// A killed target fails its request at once (the connection breaks),
/// long before the no-progress timeout; requests to another peer of the
/// same agent go on. The timeout is wide (20 s) so that a slow machine or
/// the emulated RDMA guest, where a 64 MiB request takes seconds, never
/// trips it for the bystander.
#[test]
fn target_killed_mid_transfer_fails_within_timeout() {
    let size: u64 = 64 << 20;
    let io_timeout = Duration::from_secs(20);
    let src = vec![7u8; size as usize];
    let two = TwoPeers::new(size, io_timeout, &src);
    let (mut peer, mut bystander, agent) = (two.target, two.bystander, two.agent);
    let (name, other) = (two.name, two.other);
    // Freeze the target so the transfer is certainly in the middle, then
    // kill it.
    peer.signal("STOP");
    let local = dram((0..16).map(|_| (src.as_ptr() as u64, size)));
    let remote = dram((0..16).map(|_| (peer.addr, size)));
    let st = agent
        .submit_transfer(&TransferRequest::write(local, remote, &name))
        .unwrap();
    assert_eq!(
        st.wait(Duration::from_millis(300)).unwrap(),
        TransferState::InProgress
    );
    let t0 = Instant::now();
    peer.kill();
    let err = st.wait(io_timeout * 2).unwrap_err();
    assert!(t0.elapsed() < io_timeout, "failed after {:?}", t0.elapsed());
    assert!(matches!(err, Error::ConnectionLost { .. }), "{err}");
    // Requests to other peers are unaffected.
    agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            bystander.range(0, size),
            &other,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(bystander.cmd("hash"), fnv(&src).to_string());
    // The local region is free again once the status has failed; on the
    // libfabric transport, once the provider has given back the WRITEs it
    // still held for the dead peer.
    if backend() == Backend::Fabric {
        deregister_once_free(agent.as_ref(), &src, WAIT);
    } else {
        agent.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
    }
}

/// A target that stops taking data holds up no other peer of the same
/// agent: with a large request to the stopped target under way (more than
/// the libfabric transport's operations and bytes in flight), a small one
/// to a bystander completes, long before the I/O timeout (60 s) would fail
/// the stopped target's link; the large one completes once the target
/// resumes.
#[test]
fn a_stopped_target_holds_up_no_other_peer() {
    let size: u64 = 64 << 20;
    let io_timeout = Duration::from_secs(60);
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 6, 0);
    let two = TwoPeers::new(size, io_timeout, &src);
    let (peer, mut bystander, agent) = (two.target, two.bystander, two.agent);
    let (name, other) = (two.name, two.other);
    peer.signal("STOP");
    let local = dram((0..4).map(|_| (src.as_ptr() as u64, size)));
    let remote = dram((0..4).map(|_| (peer.addr, size)));
    let big = agent
        .submit_transfer(&TransferRequest::write(local, remote, &name))
        .unwrap();
    let t0 = Instant::now();
    let small = agent
        .submit_transfer(&TransferRequest::write(
            dram([(src.as_ptr() as u64, 4096)]),
            bystander.range(0, 4096),
            &other,
        ))
        .unwrap();
    let r = small.wait_success(io_timeout / 2);
    let took = t0.elapsed();
    peer.signal("CONT");
    r.unwrap_or_else(|e| panic!("the bystander's request, after {took:?}: {e}"));
    assert_eq!(bystander.cmd("check 6 0 4096"), "OK");
    big.wait_success(WAIT).unwrap();
}

/// A target process that stops answering: on TCP, shm and libfabric over
/// kernel sockets or shared memory (which need the target's threads) the
/// request fails with `PeerTimedOut` after the I/O timeout. On RDMA (and
/// libfabric on `verbs` or `efa`) one-sided WRITEs need no target thread at
/// all, so a frozen target process does not stall them: the request
/// completes.
#[test]
fn frozen_target_times_out() {
    if target_cpu_free() {
        let size: u64 = 4 << 20;
        let mut peer = PeerProc::spawn("target", size, 3, &[]);
        let mut src = vec![0u8; size as usize];
        fill(&mut src, 8, 0);
        let (agent, name) = connect(&peer, &src);
        peer.signal("STOP");
        let st = agent
            .submit_transfer(&TransferRequest::write(
                MemoryDescs::dram(&src),
                peer.range(0, size),
                &name,
            ))
            .unwrap();
        let r = st.wait_success(WAIT);
        peer.signal("CONT");
        r.unwrap();
        assert_eq!(peer.cmd(&format!("check 8 0 {size}")), "OK");
        return;
    }
    let size: u64 = 64 << 20;
    // 1 s, unless the run says its machine is slower: under TCG in the
    // guest, a link's set-up after the target resumes (ofi_rxm connecting
    // anew over soft-RoCE) can take longer than a second of no progress.
    let io_timeout = Duration::from_millis(
        std::env::var("KVXFER_TEST_IO_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
    );
    let peer = PeerProc::spawn("target", size, 3, &[]);
    let agent = local_agent("init", |c| c.with_io_timeout(io_timeout));
    let src = vec![7u8; size as usize];
    register(agent.as_ref(), &src);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    peer.signal("STOP");
    let local = dram((0..4).map(|_| (src.as_ptr() as u64, size)));
    let remote = dram((0..4).map(|_| (peer.addr, size)));
    let t0 = Instant::now();
    let st = agent
        .submit_transfer(&TransferRequest::write(local, remote, &name))
        .unwrap();
    let err = st.wait(io_timeout * 10).unwrap_err();
    let took = t0.elapsed();
    // Memory that a transport may still move stays registered: the
    // libfabric transport reports the failure at once, while the frozen
    // target's provider still holds its WRITEs (which read the source
    // when it resumes), so the source cannot be deregistered, and freed,
    // yet.
    let held = agent.deregister_memory(&MemoryDescs::dram(&src));
    if backend() == Backend::Fabric {
        assert!(matches!(held, Err(Error::RegionBusy { .. })), "{held:?}");
    }
    peer.signal("CONT");
    assert!(matches!(err, Error::PeerTimedOut { .. }), "{err}");
    assert!(took >= io_timeout && took < io_timeout * 3, "took {took:?}");
    // Once the target has resumed, what was held is given back.
    if held.is_err() {
        deregister_once_free(agent.as_ref(), &src, WAIT);
    }
    register(agent.as_ref(), &src);
    // A later request reconnects and works.
    let st = agent
        .submit_transfer(&TransferRequest::write(
            dram([(src.as_ptr() as u64, 4096)]),
            peer.range(0, 4096),
            &name,
        ))
        .unwrap();
    st.wait_success(WAIT).unwrap();
}

/// A region a request in flight still reads cannot be deregistered
/// (`RegionBusy`); once its deregistration succeeds, the requests that read
/// it have ended. The target is stopped to hold the request in flight,
/// which holds where the target's process takes part in ending it; where
/// the kernel completes a one-sided WRITE alone, deregistration may succeed
/// — but only after the request ended, which is checked every round.
#[test]
fn deregistering_a_region_in_flight_is_refused() {
    let size: u64 = 64 << 20;
    let peer = PeerProc::spawn("target", size, 3, &[]);
    let src = vec![7u8; size as usize];
    let (agent, name) = connect(&peer, &src);
    let mut refused = 0;
    for round in 0..3 {
        peer.signal("STOP");
        // A sync message: the request then ends only once the target took
        // it, where its process must take part (tcp, shm, a libfabric
        // commit). Where the kernel or NIC completes it alone (rdma), a
        // stopped target holds nothing: the request may end first.
        let st = agent
            .submit_transfer(
                &TransferRequest::write(MemoryDescs::dram(&src), peer.range(0, size), &name)
                    .with_sync_message(format!("held {round}").into_bytes()),
            )
            .unwrap();
        match agent.deregister_memory(&MemoryDescs::dram(&src)) {
            Err(Error::RegionBusy { .. }) => {
                refused += 1;
                peer.signal("CONT");
                st.wait_success(WAIT).unwrap();
            }
            Ok(()) => {
                // Only a request that ended lets go of its regions: its
                // status says so without the target's help.
                let state = st.wait(Duration::from_secs(5));
                assert!(
                    !matches!(state, Ok(TransferState::InProgress)),
                    "round {round}: the region was deregistered while a request still in flight could read it"
                );
                peer.signal("CONT");
                register(agent.as_ref(), &src);
            }
            Err(e) => panic!("round {round}: {e}"),
        }
    }
    assert!(
        refused > 0,
        "every request ended before its region's deregistration"
    );
    agent.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
}

#[test]
fn check_remote_descs_true_and_false() {
    let peer = PeerProc::spawn("target", 1 << 20, 3, &[]);
    let agent = local_agent("init", |c| c);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    assert!(agent.check_remote_descs(&name, &peer.range(0, 1 << 20)));
    assert!(agent.check_remote_descs(&name, &dram([(peer.addr, 1), (peer.addr + 1000, 24)])));
    assert!(!agent.check_remote_descs(&name, &dram([(peer.addr, (1 << 20) + 1)])));
    assert!(!agent.check_remote_descs(&name, &dram([(peer.addr, 1), (peer.addr - 1, 1)])));
    assert!(!agent.check_remote_descs("nobody", &peer.range(0, 1)));
    let vram = MemoryDescs::new(kvxfer::MemoryType::Vram, peer.range(0, 1).descs);
    assert!(!agent.check_remote_descs(&name, &vram));
}

#[test]
fn malformed_agent_desc_is_an_error() {
    let mut peer = PeerProc::spawn("target", 4096, 3, &[]);
    let hex = peer.cmd("desc");
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let desc = AgentDesc::decode(&bytes).unwrap();
    assert_eq!(desc.name, "target");
    assert!(matches!(
        AgentDesc::decode(&bytes[..bytes.len() - 1]),
        Err(DescError::Malformed(_))
    ));
    assert!(matches!(
        AgentDesc::decode(b"GARBAGE!"),
        Err(DescError::BadMagic(_))
    ));
    let mut v9 = bytes.clone();
    v9[4] = 9;
    assert!(matches!(
        AgentDesc::decode(&v9),
        Err(DescError::UnsupportedVersion { found: 9, .. })
    ));
    // An inconsistent descriptor is refused by the agent too.
    let agent = local_agent("init", |c| c);
    let mut bad = desc.clone();
    bad.endpoints.clear();
    assert!(matches!(
        agent.load_remote_agent(&bad),
        Err(Error::InvalidAgentDesc(_))
    ));
    // Connection info that is not an agent: a listener that answers junk.
    let junk = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = junk.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        if let Ok((mut s, _)) = junk.accept() {
            // It authenticates (without a credential) ...
            let mut b = [0u8; 40];
            let _ = s.read_exact(&mut b);
            let mut body = vec![0u8; u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize];
            let _ = s.read_exact(&mut body);
            let mut c = raw::Hdr::new(raw::AUTH_CHALLENGE);
            c.aux = 36;
            let _ = s.write_all(&c.bytes());
            let _ = s.write_all(&[[7u8; 32].as_slice(), b"junk"].concat());
            // The descriptor request, and the host id an agent that could
            // open GPU handles sends with it.
            let _ = s.read_exact(&mut b);
            let mut host = vec![0u8; u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize];
            let _ = s.read_exact(&mut host);
            let mut reply = [0u8; 40];
            reply[0] = 4; // a descriptor reply ...
            reply[4] = 12; // ... of 12 bytes ...
            let _ = s.write_all(&reply);
            let _ = s.write_all(b"not-a-desc!!"); // ... that are junk.
        }
    });
    let err = agent.load_remote_agent_by_connection(&addr).unwrap_err();
    if kvxfer::Credential::from_env().unwrap().is_some() {
        // A keyed initiator does not even ask an unkeyed listener.
        assert!(matches!(err, Error::AuthFailed { .. }), "{err}");
    } else {
        assert!(
            matches!(err, Error::InvalidAgentDesc(DescError::BadMagic(_))),
            "{err}"
        );
    }
    assert!(matches!(
        agent.load_remote_agent_by_connection("not an address"),
        Err(Error::InvalidConnectionInfo { .. })
    ));
}

#[test]
fn restarted_target_is_detected_as_stale() {
    let peer = PeerProc::spawn("target", 4096, 3, &[]);
    let agent = local_agent("init", |c| c);
    let src = vec![1u8; 4096];
    register(agent.as_ref(), &src);
    agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let mut desc = agent_desc_of(&peer);
    drop(peer);
    // A descriptor pointing at a live listener of another instance.
    let other = PeerProc::spawn("target", 4096, 3, &[]);
    desc.endpoints = vec![other.conn.clone()];
    match agent.load_remote_agent(&desc) {
        // The shm backend checks the process behind the descriptor already
        // when loading it.
        Err(Error::BackendUnavailable { backend: "shm", .. }) if backend() == Backend::Shm => {
            return;
        }
        r => r.unwrap(),
    }
    let err = agent
        .submit_transfer(&TransferRequest::write(
            dram([(src.as_ptr() as u64, 16)]),
            dram([(desc.regions[0].desc.addr, 16)]),
            "target",
        ))
        .unwrap_err();
    assert!(matches!(err, Error::StaleAgent { .. }), "{err}");
}

/// The peer's descriptor, fetched over the side channel by hand (a
/// `DescRequest` frame), as a non-Rust client would.
fn agent_desc_of(peer: &PeerProc) -> AgentDesc {
    fetch(&peer.conn)
}

fn fetch(conn: &str) -> AgentDesc {
    let mut c = raw::RawConn::connect(conn);
    c.auth("by-hand", kvxfer::Credential::from_env().unwrap().as_ref())
        .unwrap();
    AgentDesc::decode(&c.desc().unwrap()).unwrap()
}

#[test]
fn agent_drop_fails_requests_in_flight_and_returns() {
    let size: u64 = 64 << 20;
    let peer = PeerProc::spawn("target", size, 3, &[]);
    let src = vec![7u8; size as usize];
    let (agent, name) = connect(&peer, &src);
    peer.signal("STOP");
    let st = agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, size),
            &name,
        ))
        .unwrap();
    let t0 = Instant::now();
    drop(agent);
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(st.is_completed());
    assert!(matches!(st.poll(), Err(Error::Closed)), "{:?}", st.poll());
    peer.signal("CONT");
}

/// Aborting stops a transfer and quiesces it. With the target frozen, a
/// large WRITE `a` is under way, and a WRITE `b` (with a sync message) and
/// a READ `r` queued behind it are aborted: once the target runs again `a`
/// completes, `b` and `r` fail with `Aborted` having touched nothing (the
/// target's range for `b` and the local destination of `r` keep their
/// bytes) and `b`'s message never arrives. A WRITE `d` aborted while under
/// way fails with `Aborted`, its message withheld, and once it has failed
/// the target's memory no longer changes. The connection serves the next
/// request, and every region can be deregistered (no hold is left).
#[test]
fn aborted_transfers_stop_and_quiesce() {
    let size: u64 = 64 << 20;
    let mut peer = PeerProc::spawn("target", 2 * size, 1, &[]);
    // A small RDMA (or libfabric) window keeps most of a request queued at
    // the initiator, where an abort can still stop it.
    let agent = local_agent("init", |c| {
        c.with_rdma_max_inflight(1 << 20)
            .with_fabric_max_inflight(1 << 20)
    });
    let mut src = vec![0u8; 2 * size as usize];
    fill(&mut src, 9, 0);
    register(agent.as_ref(), &src);
    let dst = vec![0u8; size as usize];
    register(agent.as_ref(), &dst);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let at = src.as_ptr() as u64;
    let peer_at = peer.addr;
    let remote = move |off: u64| dram([(peer_at + off, size)]);
    let write = |off: u64, msg: &str| {
        agent
            .submit_transfer(
                &TransferRequest::write(dram([(at + off, size)]), remote(off), &name)
                    .with_sync_message(msg.as_bytes().to_vec()),
            )
            .unwrap()
    };

    peer.signal("STOP");
    let a = write(0, "a");
    let b = write(size, "b");
    assert!(b.abort(), "b cannot have finished with the target frozen");
    let r = agent
        .submit_transfer(&TransferRequest::read(
            MemoryDescs::dram(&dst),
            remote(size),
            &name,
        ))
        .unwrap();
    assert!(r.abort());
    peer.signal("CONT");
    a.wait_success(WAIT).unwrap();
    assert!(
        matches!(b.wait(WAIT), Err(Error::Aborted)),
        "{:?}",
        b.poll()
    );
    assert!(
        matches!(r.wait(WAIT), Err(Error::Aborted)),
        "{:?}",
        r.poll()
    );
    assert!(!a.abort(), "a finished: its outcome stands");
    assert!(a.wait(WAIT).is_ok());
    assert_eq!(peer.cmd(&format!("check 9 0 {size}")), "OK");
    assert_eq!(peer.cmd(&format!("check 1 {size} {size}")), "OK");
    assert_eq!(dst.iter().position(|&x| x != 0), None, "r wrote locally");
    assert_eq!(peer.cmd("msgs"), "init=a");

    // Aborted under way.
    peer.signal("STOP");
    let d = write(size, "d");
    assert!(d.abort());
    peer.signal("CONT");
    assert!(
        matches!(d.wait(WAIT), Err(Error::Aborted)),
        "{:?}",
        d.poll()
    );
    let settled = peer.cmd("hash");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(peer.cmd("hash"), settled, "d wrote after it reported");
    assert_eq!(peer.cmd("msgs"), "");

    write(size, "e").wait_success(WAIT).unwrap();
    assert_eq!(peer.cmd(&format!("check 9 {size} {size}")), "OK");
    assert_eq!(peer.cmd("msgs"), "init=e");
    agent.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
    agent.deregister_memory(&MemoryDescs::dram(&dst)).unwrap();
}

/// An abort stops a transfer within one segment per stream (4 MiB, the
/// check interval), beyond what the kernel's socket buffers (or one
/// cross-memory call) already took: a WRITE of 64 KiB pieces to a frozen
/// target, aborted once its streams are blocked mid-write, lands less than
/// that bound — per stream a segment, a full send buffer and a full receive
/// buffer (the kernel's autotuning maxima, `tcp_wmem` and `tcp_rmem`; 32 MiB
/// of receive buffer here) — and the request is twice the bound (before:
/// write lists of 1,024 pieces, 64 MiB a frame, so all of it landed).
#[test]
fn an_abort_stops_within_a_segment_per_stream() {
    if target_cpu_free() {
        println!(
            "SKIPPED: a frozen target does not block RDMA or libfabric on a NIC's provider, so \
             nothing is mid-write when the abort comes (aborted_transfers_stop_and_quiesce covers it)"
        );
        return;
    }
    const PIECE: u64 = 64 << 10;
    let most = |file: &str, default: u64| -> u64 {
        std::fs::read_to_string(file)
            .ok()
            .and_then(|s| s.split_whitespace().nth(2).and_then(|v| v.parse().ok()))
            .unwrap_or(default)
    };
    let streams = AgentConfig::new("defaults").tcp.streams_per_peer as u64;
    let bound = streams
        * ((4 << 20)
            + most("/proc/sys/net/ipv4/tcp_wmem", 4 << 20)
            + most("/proc/sys/net/ipv4/tcp_rmem", 6 << 20));
    let size = (2 * bound).max(128 << 20).next_multiple_of(PIECE);
    let mut peer = PeerProc::spawn("target", size, 1, &[]);
    let agent = local_agent("init", |c| {
        c.with_rdma_max_inflight(1 << 20)
            .with_fabric_max_inflight(1 << 20)
    });
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 9, 0);
    register(agent.as_ref(), &src);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let count =
        |peer: &mut PeerProc| -> u64 { peer.cmd(&format!("count 9 0 {size}")).parse().unwrap() };
    let before = count(&mut peer);
    let pieces = |base: u64| dram((0..size / PIECE).map(|i| (base + i * PIECE, PIECE)));
    peer.signal("STOP");
    let st = agent
        .submit_transfer(&TransferRequest::write(
            pieces(src.as_ptr() as u64),
            pieces(peer.addr),
            &name,
        ))
        .unwrap();
    // The streams fill the socket buffers and block mid-write.
    std::thread::sleep(Duration::from_millis(300));
    assert!(st.abort(), "finished before the abort: {:?}", st.poll());
    peer.signal("CONT");
    assert!(
        matches!(st.wait(WAIT), Err(Error::Aborted)),
        "{:?}",
        st.poll()
    );
    let landed = count(&mut peer) - before;
    println!(
        "an abort let {} MiB of {} land (bound {} MiB)",
        landed >> 20,
        size >> 20,
        bound >> 20
    );
    assert!(
        landed < bound,
        "{} MiB landed after the abort (bound {} MiB)",
        landed >> 20,
        bound >> 20
    );
}

/// A link that breaks under a request (its target stopped: the sync
/// message is never answered) fails it at once, but reports it unsettled:
/// the bytes it handed to the kernel may still land when the target
/// resumes. `wait_settled` cannot prove anything while the target is
/// stopped; once it runs again, it proves that nothing more of the request
/// lands (the target ended the broken link's streams), and nothing does.
/// On libfabric only the target's exit proves it.
#[test]
fn a_broken_link_reports_its_requests_unsettled_until_proved() {
    const PIECE: u64 = 1 << 20;
    let size: u64 = 16 << 20;
    let mut peer = PeerProc::spawn("target", size, 1, &[]);
    let agent = local_agent("init", |c| c.with_io_timeout(Duration::from_secs(1)));
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 9, 0);
    register(agent.as_ref(), &src);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let pieces = |base: u64| dram((0..size / PIECE).map(|i| (base + i * PIECE, PIECE)));
    let count =
        |peer: &mut PeerProc| -> u64 { peer.cmd(&format!("count 9 0 {size}")).parse().unwrap() };
    // One piece, written and answered.
    let peer_at = peer.addr;
    let write_one = || {
        let one = |base: u64| dram([(base, PIECE)]);
        let req = TransferRequest::write(one(src.as_ptr() as u64), one(peer_at), &name);
        agent
            .submit_transfer(&req)
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
    };
    // The link is up (its handshake answered) before the target stops: a
    // loaded host may not have connected it yet.
    write_one();
    peer.signal("STOP");
    let st = agent
        .submit_transfer(
            &TransferRequest::write(pieces(src.as_ptr() as u64), pieces(peer.addr), &name)
                .with_sync_message(b"never answered".to_vec()),
        )
        .unwrap();
    // The sync message needs the target's answer on every transport: the
    // link breaks at its I/O timeout.
    let outcome = st.wait(WAIT);
    assert!(
        matches!(outcome, Err(Error::PeerTimedOut { .. })),
        "{outcome:?}"
    );
    assert!(!st.is_settled(), "a broken link's request reported settled");
    // The target does not answer while stopped.
    let early = st.wait_settled(Duration::from_millis(500));
    assert!(early.is_err(), "settled while the target was stopped");
    assert!(!st.is_settled());
    peer.signal("CONT");
    if backend() == Backend::Fabric {
        // The provider, not the link's streams, moves the data: the
        // target's ending the session proves nothing, its exit does.
        let live = st.wait_settled(WAIT);
        assert!(matches!(live, Err(Error::StillLanding { .. })), "{live:?}");
        peer.kill();
        st.wait_settled(WAIT).unwrap();
        assert!(st.is_settled());
        return;
    }
    st.wait_settled(WAIT).unwrap();
    assert!(st.is_settled());
    // Nothing lands after the proof.
    let settled = count(&mut peer);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        count(&mut peer),
        settled,
        "bytes landed after the request settled"
    );
    // The agent serves the next request (a new link).
    write_one();
    assert_eq!(peer.cmd(&format!("check 9 0 {PIECE}")), "OK");
}

/// A `Registration` registers a buffer for as long as it lives: a peer
/// writes into it, and once it is dropped the range is neither a local
/// source nor a remote target any more. Dropping it while a transfer uses
/// the buffer waits for that transfer instead of freeing memory a peer can
/// still reach.
#[test]
fn registration_guard_deregisters_on_drop_after_its_transfers() {
    let size: u64 = 16 << 20;
    let mut peer = PeerProc::spawn("target", size, 3, &[]);
    let agent = local_agent("init", |c| c);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    let mut buf = vec![0u8; size as usize];
    let reg = kvxfer::Registration::new(agent.as_ref(), &mut buf).unwrap();
    assert!(reg.range(size, 1).is_err());
    assert!(reg.range(0, 0).is_err());
    let descs = reg.descs();
    agent
        .submit_transfer(&TransferRequest::read(
            descs.clone(),
            peer.range(0, size),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    // The same range cannot be registered twice.
    // SAFETY: refused (it overlaps), so nothing is registered.
    let again = unsafe { agent.register_memory(&descs) };
    assert!(matches!(again, Err(Error::Overlap { .. })), "{again:?}");
    // Dropped with a WRITE from it in flight to a frozen target: the drop
    // waits for it (the transfer completes, then the range is free).
    peer.signal("STOP");
    let st = agent
        .submit_transfer(&TransferRequest::write(
            reg.range(0, size).unwrap(),
            peer.range(0, size),
            &name,
        ))
        .unwrap();
    let thaw = std::thread::spawn({
        let pid = peer.pid();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        }
    });
    drop(reg);
    assert!(
        st.is_completed(),
        "the drop returned before its transfer ended"
    );
    st.wait_success(WAIT).unwrap();
    thaw.join().unwrap();
    assert_eq!(first_mismatch(&buf, 3, 0), None);
    assert_eq!(peer.cmd(&format!("check 3 0 {size}")), "OK");
    let err = agent
        .submit_transfer(&TransferRequest::write(
            descs.clone(),
            peer.range(0, size),
            &name,
        ))
        .unwrap_err();
    assert!(matches!(err, Error::NotRegistered { .. }), "{err}");
    // Registered again, and deregistered explicitly.
    let reg = kvxfer::Registration::new(agent.as_ref(), &mut buf).unwrap();
    reg.deregister().unwrap();
}

/// Every status says what carried it (transport, device, mechanism), and a
/// transport required for a memory type is never silently replaced: a
/// request to a peer reached another way fails before anything is sent.
#[test]
fn statuses_report_their_path_and_required_transports_hold() {
    let mut peer = PeerProc::spawn("target", 4096, 5, &[]);
    let src = vec![0x42u8; 4096];
    let (agent, name) = connect(&peer, &src);
    let st = agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, 4096),
            &name,
        ))
        .unwrap();
    st.wait_success(WAIT).unwrap();
    let path = st.data_path();
    assert_eq!(path.transport.as_str(), expected_transport());
    assert!(!path.mechanism.is_empty());
    match path.transport {
        kvxfer::TransportKind::Shm => assert_eq!(path.device, None),
        _ => assert!(path.device.is_some(), "{path:?}"),
    }

    let actual: kvxfer::TransportKind = expected_transport().parse().unwrap();
    let other = if actual == kvxfer::TransportKind::Tcp {
        kvxfer::TransportKind::Rdma
    } else {
        kvxfer::TransportKind::Tcp
    };
    for (required, ok) in [(actual, true), (other, false)] {
        let strict = local_agent("strict", |c| {
            c.with_required_transport(kvxfer::MemoryType::Dram, required)
        });
        register(strict.as_ref(), &src);
        let target = strict.load_remote_agent_by_connection(&peer.conn).unwrap();
        assert_eq!(peer.cmd("fill 6"), "OK");
        let r = strict.submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, 4096),
            &target,
        ));
        if ok {
            r.unwrap().wait_success(WAIT).unwrap();
            assert_eq!(peer.cmd("hash"), fnv(&src).to_string());
        } else {
            let err = r.unwrap_err();
            assert!(
                matches!(err, Error::TransportRequired { required: r, actual: a, .. } if r == other && a == actual),
                "{err}"
            );
            assert_eq!(peer.cmd("check 6 0 4096"), "OK", "nothing was sent");
            // A notification moves no memory: it goes.
            strict
                .notify_sync_message(&target, b"hello".to_vec())
                .unwrap()
                .wait_success(WAIT)
                .unwrap();
        }
        strict.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
    }
}

/// Bytes each libfabric rail of an agent moved, by its metrics
/// (`kvxfer_fabric_rail_bytes_total`), with the rail's domain, in order.
fn rail_bytes(agent: &dyn kvxfer::TransferAgent) -> Vec<(String, u64)> {
    rail_counter(agent, "kvxfer_fabric_rail_bytes_total")
}

/// A libfabric counter by rail: (domain, value), in the rails' order.
fn rail_counter(agent: &dyn kvxfer::TransferAgent, name: &str) -> Vec<(String, u64)> {
    let prefix = format!("{name}{{");
    agent
        .metrics_text()
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .map(|l| {
            let domain = l
                .split("domain=\"")
                .nth(1)
                .and_then(|d| d.split('"').next());
            let value = l.rsplit(' ').next().and_then(|v| v.parse().ok());
            (domain.expect(l).to_owned(), value.expect(l))
        })
        .collect()
}

/// A libfabric agent with two rails (its domain named twice: two endpoints)
/// spreads a request over both, to a peer with three: the data lands
/// whole, every rail carries part of it, and the rails' bytes add up to
/// what was asked (and the 8-byte probe each lane reads as the link
/// opens). A list with an empty name is refused, typed.
#[test]
fn requests_spread_over_every_fabric_rail() {
    if backend() != Backend::Fabric {
        println!(
            "SKIPPED: rails are the libfabric transport's (backend {:?})",
            backend()
        );
        return;
    }
    // The provider's domain, as an agent of the suite's settings names it.
    let domain = {
        let one = local_agent("one-rail", |c| c);
        let rails = rail_bytes(one.as_ref());
        assert!(!rails.is_empty(), "no rail in the metrics");
        rails[0].0.clone()
    };
    let err = kvxfer::make_transfer_agent(
        Backend::Fabric,
        AgentConfig::new("bad-rails").with_fabric_domain(format!("{domain},,{domain}")),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(&err, Error::BackendUnavailable { backend: "fabric", reason } if reason.contains("empty name")),
        "{err}"
    );

    let size: u64 = 24 << 20;
    let three = [domain.as_str(); 3].join(",");
    let mut peer = PeerProc::spawn("target", size, 11, &[("KVXFER_FABRIC_DOMAIN", &three)]);
    let agent = local_agent("init", |c| {
        c.with_fabric_domain(format!("{domain},{domain}"))
    });
    let mut src = vec![0u8; size as usize];
    fill(&mut src, 22, 0);
    register(agent.as_ref(), &src);
    let name = agent.load_remote_agent_by_connection(&peer.conn).unwrap();
    // One large descriptor, then many small ones.
    let st = write_whole(agent.as_ref(), &src, &peer, &name);
    assert_eq!(peer.cmd(&format!("check 22 0 {size}")), "OK");
    let path = st.data_path();
    assert!(
        path.device
            .as_deref()
            .is_some_and(|d| d.ends_with(&format!("/{domain}+{domain}"))),
        "{path:?}"
    );
    let _dst = read_in_pieces(agent.as_ref(), &mut peer, &name, 256);
    let rails = rail_bytes(agent.as_ref());
    assert_eq!(rails.len(), 2, "{rails:?}");
    assert!(
        rails.iter().all(|(_, b)| *b > 0),
        "a rail moved nothing: {rails:?}"
    );
    let lanes = 3;
    assert_eq!(
        rails.iter().map(|(_, b)| b).sum::<u64>(),
        2 * size + 8 * lanes,
        "{rails:?}"
    );
}

/// Fills `peer`'s range (seed 33) and reads it whole in `pieces` equal
/// descriptors, checking every byte; the buffer read into, registered with
/// `agent` (kept by the caller while the agent lives).
fn read_in_pieces(
    agent: &dyn kvxfer::TransferAgent,
    peer: &mut PeerProc,
    name: &str,
    pieces: u64,
) -> Vec<u8> {
    assert_eq!(peer.cmd("fill 33"), "OK");
    let size = peer.len;
    let dst = vec![0u8; size as usize];
    register(agent, &dst);
    let piece = size / pieces;
    let descs = |base: u64| {
        (0..pieces)
            .map(|i| kvxfer::MemoryDesc::new(base + i * piece, piece, 0))
            .collect::<Vec<_>>()
    };
    agent
        .submit_transfer(&TransferRequest::read(
            MemoryDescs::new(kvxfer::MemoryType::Dram, descs(dst.as_ptr() as u64)),
            MemoryDescs::new(kvxfer::MemoryType::Dram, descs(peer.addr)),
            name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(first_mismatch(&dst, 33, 0), None);
    dst
}

/// The domain of the libfabric agents of the suite's settings.
fn fabric_domain() -> String {
    let one = local_agent("one-rail", |c| c);
    rail_bytes(one.as_ref())[0].0.clone()
}

/// For the failover tests: a peer of two rails (an 8 MiB buffer) and an
/// agent of two rails, lanes resting `rest`, that loaded the peer with the
/// keys of its second rail wrong, and the peer's name; `None` (SKIPPED
/// printed) off the libfabric transport.
fn bent_pair(rest: Duration) -> Option<(PeerProc, Box<dyn kvxfer::TransferAgent>, String)> {
    if backend() != Backend::Fabric {
        println!(
            "SKIPPED: rails are the libfabric transport's (backend {:?})",
            backend()
        );
        return None;
    }
    let domain = fabric_domain();
    let two = format!("{domain},{domain}");
    let peer = PeerProc::spawn("target", 8 << 20, 11, &[("KVXFER_FABRIC_DOMAIN", &two)]);
    let agent = local_agent("init", |c| {
        c.with_fabric_domain(two.clone())
            .with_fabric_lane_rest(rest)
    });
    let name = load_with_second_rail_bent(agent.as_ref(), &peer);
    Some((peer, agent, name))
}

/// Loads `peer` (an agent of two rails) into `agent` with its regions'
/// keys on its second rail wrong, so that its provider refuses every
/// operation there; the peer's name.
fn load_with_second_rail_bent(agent: &dyn kvxfer::TransferAgent, peer: &PeerProc) -> String {
    let mut desc = agent.fetch_remote_agent_desc(&peer.conn).unwrap();
    let (fabric, _) = desc
        .offer("fabric")
        .expect("the peer offers no libfabric endpoint");
    let mut bent = 0;
    for region in &mut desc.regions {
        for k in region.keys.iter_mut().filter(|k| k.transport == fabric) {
            assert_eq!(k.key.len(), 16, "one key per rail of two");
            for b in &mut k.key[8..] {
                *b ^= 0xa5;
            }
            bent += 1;
        }
    }
    assert!(bent > 0, "no region of the peer has a libfabric key");
    agent.load_remote_agent(&desc).unwrap();
    desc.name
}

/// A rail that fails on a link of several lanes costs its operations a
/// second post on another lane, not their requests: the peer's second
/// rail is given a wrong key in the descriptor this agent loads (so its
/// provider refuses every operation there, as a failed NIC or path would),
/// and a WRITE and a READ spread over both lanes still land whole; the
/// failed lane is counted, taken out of service, and later requests keep
/// off it; a request refused on every lane fails, typed.
#[test]
fn a_failed_fabric_rail_moves_its_operations_to_the_others() {
    // A rest no run of the test outlasts (a loaded guest included): the
    // failed lane stays out of service throughout.
    let Some((mut peer, agent, name)) = bent_pair(Duration::from_secs(3600)) else {
        return;
    };
    let size = peer.len;

    let mut src = vec![0u8; size as usize];
    fill(&mut src, 22, 0);
    register(agent.as_ref(), &src);
    // One descriptor: a piece on each lane.
    write_whole(agent.as_ref(), &src, &peer, &name);
    assert_eq!(peer.cmd(&format!("check 22 0 {size}")), "OK");
    let failed = rail_counter(agent.as_ref(), "kvxfer_fabric_lane_failovers_total");
    assert_eq!(
        failed.iter().map(|(_, n)| n).collect::<Vec<_>>(),
        [&0, &1],
        "the lane of rail 1 (to the peer's rail 1) failed once: {failed:?}"
    );
    let before = rail_bytes(agent.as_ref());

    // Out of service: later requests keep off it.
    let _dst = read_in_pieces(agent.as_ref(), &mut peer, &name, 64);
    let after = rail_bytes(agent.as_ref());
    assert_eq!(
        after[1], before[1],
        "rail 1 moved more: {before:?} -> {after:?}"
    );
    assert_eq!(after[0].1 - before[0].1, size, "{before:?} -> {after:?}");
    let failed = rail_counter(agent.as_ref(), "kvxfer_fabric_lane_failovers_total");
    assert_eq!(failed[1].1, 1, "{failed:?}");

    // A request refused on every lane (its region deregistered) fails,
    // typed, once tried on each.
    assert_eq!(peer.cmd("dereg"), "OK");
    let err = agent
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            peer.range(0, size),
            &name,
        ))
        .unwrap()
        .wait(WAIT)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Transport {
                transport: "fabric",
                ..
            }
        ),
        "{err}"
    );
    let failed = rail_counter(agent.as_ref(), "kvxfer_fabric_lane_failovers_total");
    assert_eq!(
        failed.iter().map(|(_, n)| n).collect::<Vec<_>>(),
        [&1, &1],
        "{failed:?}"
    );
}

/// A failed lane rests out of service for the configured time, then is
/// tried again: with a rest of 1 ms, a request after it spreads over both
/// lanes again, and the failing one is taken out a second time (each
/// request still lands whole).
#[test]
fn a_rested_fabric_lane_is_tried_again() {
    let Some((mut peer, agent, name)) = bent_pair(Duration::from_millis(1)) else {
        return;
    };
    let size = peer.len;
    let mut src = vec![0u8; size as usize];
    register(agent.as_ref(), &src);
    for round in 1..=2u8 {
        fill(&mut src, u64::from(round), 0);
        // One descriptor: a piece on each lane in service.
        write_whole(agent.as_ref(), &src, &peer, &name);
        assert_eq!(peer.cmd(&format!("check {round} 0 {size}")), "OK");
        let failed = rail_counter(agent.as_ref(), "kvxfer_fabric_lane_failovers_total");
        assert_eq!(failed[1].1, u64::from(round), "round {round}: {failed:?}");
        // Longer than the rest.
        std::thread::sleep(Duration::from_millis(20));
    }
}
