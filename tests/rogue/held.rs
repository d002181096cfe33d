//! Authenticated peers that hold what the target gives them: requests
//! opened and never finished (the agent-wide budget), connections left
//! idle or fed a byte at a time, grants never committed. The attacker is
//! this test process, a raw wire client on loopback (the target has no
//! credential, so loopback peers are admitted); nothing here needs root.
//! Each test asserts the target's canaries and secret are unchanged and a
//! good peer is served while the attack goes on and after it.

use std::time::{Duration, Instant};

use super::{RawConn, Victim, common, grant, proc_status, raw};
use kvxfer::{AgentConfig, Backend, MemoryDescs, TransferAgent, TransferRequest};

/// `Closing` (target → initiator), and the `Overloaded` and `GrantExpired`
/// reasons.
const CLOSING: u8 = 23;
const KEEPALIVE: u8 = 22;
const ST_OVERLOADED: u16 = 19;
const ST_GRANT_EXPIRED: u16 = 20;

/// An authenticated data stream of a new link.
fn stream(v: &Victim, name: &str, link: u64) -> RawConn {
    let mut c = RawConn::connect(&v.conn());
    c.auth(name, None).unwrap();
    let ack = c.hello(name, link).expect("a hello answer");
    assert_eq!((ack.kind, ack.status), (raw::HELLO_ACK, raw::ST_OK));
    c
}

/// Opens requests `reqs` on `c`: each a commit of one segment that never
/// comes.
fn open_requests(c: &mut RawConn, reqs: std::ops::Range<u64>) {
    let mut frames = Vec::with_capacity(40 * (reqs.end - reqs.start) as usize);
    for req in reqs {
        let mut h = raw::Hdr::new(raw::COMMIT);
        h.flags = 1;
        h.id = req;
        h.len = 1;
        frames.extend_from_slice(&h.sealed().bytes());
    }
    std::io::Write::write_all(&mut c.s, &frames).unwrap();
}

/// Waits until the target has processed everything sent on `c` before:
/// a grant it must refuse (a bad key) is answered in turn, and opens no
/// request (the target is on shm, whose transport answers grants).
fn sync(c: &mut RawConn, v: &Victim) {
    assert_ne!(
        grant(c, u64::MAX - 1, v.region_addr(), 8, v.key() ^ 1),
        raw::ST_OK
    );
}

/// The next frame on `c` is `Closing` with `status`, then the target
/// closes the connection.
fn assert_closing(c: &mut RawConn, status: u16) {
    let h = c.recv().expect("a Closing frame before the close");
    assert_eq!((h.kind, h.status), (CLOSING, status), "{h:?}");
    assert!(c.closed());
}

/// One peer opening more than the agent-wide budget of requests is closed
/// with `Overloaded` (told in a `Closing` frame) once the budget is spent;
/// before that, it was served like anyone else.
#[test]
fn one_peer_cannot_spend_more_than_the_open_request_budget() {
    let (v, mut hog) = budget_spent_by_a_hog();
    // The budget is spent, by this peer alone: one more is refused.
    open_requests(&mut hog, 4096..4097);
    assert_closing(&mut hog, ST_OVERLOADED);
    // Its requests went with it: the budget serves others again.
    let mut next = stream(&v, "next", 2);
    open_requests(&mut next, 0..4000);
    sync(&mut next, &v);
    v.assert_untouched();
    v.still_serves(AgentConfig::new("good"));
}

/// A target with a budget of 4,096 open requests, all spent by one
/// peer's stream (returned, every request read).
fn budget_spent_by_a_hog() -> (Victim, RawConn) {
    let v = Victim::new(
        Backend::Shm,
        AgentConfig::new("target").with_max_open_requests(4096),
    );
    let mut hog = stream(&v, "hog", 1);
    open_requests(&mut hog, 0..4096);
    sync(&mut hog, &v);
    (v, hog)
}

/// The exhaustion attack of the issue against a target process with the
/// default limits: 24 connections each opening 65,534 requests that never
/// finish (1,572,816, six times the default budget of 262,144; the target
/// grew by 473 MiB without a budget, 170 to 198 MiB with it, 85 to 93 MiB
/// once an open request's sync message was boxed). The target closes connections
/// as the budget runs out, so the requests it holds (and its memory) stay
/// within the budget, and a good peer is served throughout.
#[test]
fn connections_of_open_requests_stay_within_the_agent_wide_budget() {
    let mut peer = common::PeerProc::spawn("target", 1 << 20, 1, &[]);
    let pid = peer.pid();
    let rss0 = proc_status(pid, "VmRSS:");
    let probe = |c: &mut RawConn, req: u64| -> bool {
        // A fence completing open request `req`: acknowledged while the
        // connection is served; else `Closing` (or the close itself).
        let mut fence = raw::Hdr::new(10);
        fence.id = req;
        if c.send(fence, &[]).is_err() {
            return false;
        }
        match c.recv() {
            Some(h) if h.kind == raw::ACK => {
                assert_eq!(h.id, req);
                true
            }
            Some(h) => {
                assert_eq!((h.kind, h.status), (CLOSING, ST_OVERLOADED), "{h:?}");
                false
            }
            None => false,
        }
    };
    let mut conns = Vec::new();
    for i in 0..24u64 {
        let name = format!("mallory{i}");
        let mut c = RawConn::connect(&peer.conn);
        c.auth(&name, None).unwrap();
        c.hello(&name, 100 + i).unwrap();
        open_requests(&mut c, 1..65535);
        // All read (or the connection closed on the way).
        let served = probe(&mut c, 1);
        conns.push((c, served));
    }
    let rss = proc_status(pid, "VmRSS:");
    let grown_mib = rss.saturating_sub(rss0) / 1024;
    let mut alive = 0;
    for (c, served) in &mut conns {
        if *served && probe(c, 2) {
            alive += 1;
        }
    }
    println!("connections still served: {alive} of 24; the target grew by {grown_mib} MiB");
    assert!(alive <= 4, "{alive} connections hold 65,532 requests each");
    assert!(alive >= 1);
    assert!(grown_mib < 160, "the target grew by {grown_mib} MiB");
    super::peer_still_serves(&peer);
    drop(conns);
    peer.kill();
}

/// With the budget spent by one peer, a peer below its share is served
/// and the one holding the most gives way: the good peer's request goes
/// through, and the hog is closed with `Overloaded`.
#[test]
fn a_modest_peer_makes_the_hog_give_way() {
    let (v, mut hog) = budget_spent_by_a_hog();
    v.still_serves(AgentConfig::new("good"));
    assert_closing(&mut hog, ST_OVERLOADED);
    v.still_serves(AgentConfig::new("good-after"));
}

/// A stream on which no whole frame comes for the target's I/O timeout is
/// closed, whether it sends nothing or trickles a header a byte at a time
/// (a whole header would take 40 s); a body trickled past its allowance
/// (the I/O timeout plus its length at 1 MiB/s) is cut too. Before, each
/// of them was served for ever.
#[test]
fn idle_and_trickling_streams_are_closed() {
    let io_timeout = Duration::from_secs(2);
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target").with_io_timeout(io_timeout),
    );
    let t0 = Instant::now();
    let mut idle = stream(&v, "idle", 1);
    let mut header = stream(&v, "header", 2);
    let mut body = stream(&v, "body", 3);
    // A write of 64 KiB into the region, its header whole, then its
    // payload a byte at a time.
    let mut w = raw::Hdr::new(raw::WRITE);
    w.id = 1;
    w.addr = v.region_addr();
    w.len = 65536;
    w.key = v.key();
    body.send(w, &[0x77]).unwrap();
    let tricklers = [&mut header, &mut body];
    let closed_all = loop {
        // One byte each per second: each counts as progress within its
        // frame, never a whole frame.
        let mut open = 0;
        for c in tricklers.iter() {
            if std::io::Write::write_all(&mut &c.s, &[0x77]).is_ok() {
                open += 1;
            }
        }
        if open == 0 || t0.elapsed() > Duration::from_secs(30) {
            break open == 0;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(closed_all, "a trickling stream is still served after 30 s");
    assert!(idle.closed(), "the idle stream is still open");
    // The trickled write landed nothing past what it sent.
    v.still_serves(AgentConfig::new("good"));
}

/// A good initiator's link outlives idle spells longer than the target's
/// I/O timeout: it sends keepalives, so the target keeps its streams (the
/// same connections carry the write after the spell).
#[test]
fn an_idle_link_lives_on_keepalives() {
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target").with_io_timeout(Duration::from_millis(1500)),
    );
    let good = kvxfer::make_transfer_agent(Backend::Tcp, AgentConfig::new("good")).unwrap();
    let src = vec![0x3cu8; 4096];
    // SAFETY: `src` outlives `good`.
    unsafe { good.register_memory(&MemoryDescs::dram(&src)).unwrap() };
    let name = good.load_remote_agent_by_connection(&v.conn()).unwrap();
    let write = |good: &dyn TransferAgent| {
        let dst = super::common::dram([(v.region_addr() + 8192, 4096)]);
        good.submit_transfer(&TransferRequest::write(MemoryDescs::dram(&src), dst, &name))
            .unwrap()
            .wait_success(Duration::from_secs(60))
            .unwrap();
    };
    write(good.as_ref());
    let port = v.conn().rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let before = peers_of(port);
    assert!(!before.is_empty());
    // Three times the target's timeout without a request.
    std::thread::sleep(Duration::from_millis(4500));
    write(good.as_ref());
    assert_eq!(
        peers_of(port),
        before,
        "the target closed the idle link's streams (the write reconnected)"
    );
}

/// The remote ports of the established TCP connections whose local port
/// is `port` (from `/proc/net/tcp`): the target's accepted streams.
fn peers_of(port: u16) -> std::collections::BTreeSet<u16> {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let local = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            let remote = u16::from_str_radix(f[2].rsplit(':').next()?, 16).ok()?;
            (local == port && f[3] == "01").then_some(remote)
        })
        .collect()
}

/// A grant whose commit never comes expires after the target's I/O
/// timeout, though the peer keeps its stream alive: the owner can
/// deregister the region again (before, `RegionBusy` until the peer
/// left), and the late commit fails with `GrantExpired`.
#[test]
fn a_grant_expires_without_its_commit() {
    let io_timeout = Duration::from_secs(1);
    let v = Victim::new(
        Backend::Shm,
        AgentConfig::new("target").with_io_timeout(io_timeout),
    );
    let mut c = stream(&v, "granted", 1);
    assert_eq!(grant(&mut c, 5, v.region_addr(), 4096, v.key()), raw::ST_OK);
    let region = MemoryDescs::dram(&v.buf[super::CANARY..super::CANARY + super::REGION]);
    // Held while granted.
    assert!(matches!(
        v.agent.deregister_memory(&region),
        Err(kvxfer::Error::RegionBusy { .. })
    ));
    // Kept alive meanwhile; the grant goes within the I/O timeout and a
    // sweep's second.
    let t0 = Instant::now();
    let released = loop {
        c.send(raw::Hdr::new(KEEPALIVE), &[]).unwrap();
        match v.agent.deregister_memory(&region) {
            Ok(()) => break true,
            Err(kvxfer::Error::RegionBusy { .. }) if t0.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(released);
    let mut commit = raw::Hdr::new(raw::COMMIT);
    commit.flags = 1;
    commit.id = 5;
    c.send(commit, &[]).unwrap();
    let ack = c.recv().expect("an acknowledgement");
    assert_eq!(
        (ack.kind, ack.id, ack.status),
        (raw::ACK, 5, ST_GRANT_EXPIRED)
    );
    // What was granted is the initiator's to copy, before its commit: the
    // target says so (3: all of the data; here none was written).
    assert_eq!(ack.aux, 3);
    v.assert_untouched();
}

/// Until `region` can be deregistered (its grants unpinned), within 30 s;
/// whether it could.
fn released_within_30s(v: &Victim, region: &MemoryDescs) -> bool {
    let t0 = Instant::now();
    loop {
        match v.agent.deregister_memory(region) {
            Ok(()) => return true,
            Err(kvxfer::Error::RegionBusy { .. }) if t0.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(kvxfer::Error::RegionBusy { .. }) => return false,
            Err(e) => panic!("{e}"),
        }
    }
}

/// The grants of a session belong to it, not to the connection that made
/// them: they stay pinned while another stream of the session lives, and
/// unpin when its last stream closes, long before they would expire (the
/// I/O timeout here is two minutes).
#[test]
fn grants_unpin_when_their_session_closes() {
    let v = Victim::new(
        Backend::Shm,
        AgentConfig::new("target").with_io_timeout(Duration::from_secs(120)),
    );
    let mut granted = stream(&v, "granted", 1);
    let mut other = stream(&v, "granted", 1);
    assert_eq!(
        grant(&mut granted, 5, v.region_addr(), 4096, v.key()),
        raw::ST_OK
    );
    let region = MemoryDescs::dram(&v.buf[super::CANARY..super::CANARY + super::REGION]);
    let busy = |v: &Victim| {
        matches!(
            v.agent.deregister_memory(&region),
            Err(kvxfer::Error::RegionBusy { .. })
        )
    };
    assert!(busy(&v));
    // The granting stream goes; the session lives on in the other.
    drop(granted);
    std::thread::sleep(Duration::from_millis(500));
    sync(&mut other, &v);
    assert!(busy(&v), "a grant unpinned while its session lived on");
    drop(other);
    assert!(released_within_30s(&v, &region));
    v.assert_untouched();
}
