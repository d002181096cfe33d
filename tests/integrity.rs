//! End-to-end integrity (`TransferRequest::with_integrity`), tried through
//! a TCP proxy that flips one bit of what crosses it: a checked request
//! whose bytes were damaged on the way fails with `Error::Integrity`, its
//! sync message is not delivered, the damage is counted, and the link
//! serves the next request; the same flip in an unchecked request lands
//! unnoticed (the proxy's premise). Paths and memory types that cannot
//! check refuse it at submission.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvxfer::{AgentConfig, Backend, Error, MemoryDescs, TransferRequest, make_transfer_agent};

mod common;
use common::proxy::{Dir, Pair};
use common::{counter, dram, fill, first_mismatch, register};

const WAIT: Duration = Duration::from_secs(20);

/// Two TCP agents in this process, the initiator reaching the target only
/// through a proxy (one stream, so the proxy's byte offsets are the
/// stream's).
fn pair(dir: Dir, at: u64) -> Pair {
    Pair::start(
        AgentConfig::new("integrity-init").with_streams_per_peer(1),
        AgentConfig::new("integrity-target"),
        dir,
        at,
    )
}

/// `n` pieces of `piece` bytes each, every other one of a buffer.
fn pieces(buf: &[u8], n: usize, piece: usize) -> MemoryDescs {
    dram((0..n).map(|i| (buf.as_ptr() as u64 + (2 * i * piece) as u64, piece as u64)))
}

/// A WRITE (of `n` pieces of `piece` bytes) through a proxy that flips a
/// bit in its payload: unchecked, it lands damaged and reports success;
/// checked, it fails with `Integrity`, its message is not delivered, the
/// target counts it, and the next checked WRITE on the link lands whole.
fn damaged_write(n: usize, piece: usize, at: u64) {
    let p = pair(Dir::Up, at);
    let len = 2 * n * piece;
    let mut src = vec![0u8; len];
    fill(&mut src, 7, 0);
    let dst = vec![0u8; len];
    register(p.init.as_ref(), &src);
    register(p.target.as_ref(), &dst);
    p.load();
    let req = |checked: bool| {
        let r = TransferRequest::write(pieces(&src, n, piece), pieces(&dst, n, piece), &p.name)
            .with_sync_message(b"landed".to_vec());
        if checked { r.with_integrity() } else { r }
    };
    let whole = |dst: &[u8]| {
        (0..n).all(|i| {
            let o = 2 * i * piece;
            first_mismatch(&dst[o..o + piece], 7, o as u64).is_none()
        })
    };

    // Unchecked: the flip lands, and the request says it landed.
    p.proxy.armed.store(true, Ordering::Release);
    p.init
        .submit_transfer(&req(false))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(
        p.proxy.flipped.load(Ordering::Relaxed),
        1,
        "the proxy flipped a bit"
    );
    assert!(!whole(&dst), "an unchecked request landed the damaged byte");
    assert_eq!(
        p.target.wait_sync_messages(WAIT)[&"integrity-init".to_string()].len(),
        1
    );

    // Checked: the same damage fails it, and its message never comes.
    let connections = p.proxy.accepted.load(Ordering::Relaxed);
    p.proxy.armed.store(true, Ordering::Release);
    let e = p
        .init
        .submit_transfer(&req(true))
        .unwrap()
        .wait_success(WAIT)
        .unwrap_err();
    assert_eq!(
        p.proxy.flipped.load(Ordering::Relaxed),
        2,
        "the proxy flipped a bit"
    );
    assert!(matches!(e, Error::Integrity { .. }), "{e}");
    assert_eq!(
        counter(p.target.as_ref(), "kvxfer_integrity_failures_total"),
        1
    );
    assert!(
        p.init.metrics_text().contains("outcome=\"integrity\"} 1"),
        "{}",
        p.init.metrics_text()
    );

    // The next checked request on the same connection lands whole, and
    // only its message is delivered.
    p.init
        .submit_transfer(&req(true))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert!(whole(&dst), "the next checked request repaired the blocks");
    let msgs = p.target.take_sync_messages();
    assert_eq!(
        msgs[&"integrity-init".to_string()],
        vec![b"landed".to_vec()]
    );
    assert_eq!(
        p.proxy.accepted.load(Ordering::Relaxed),
        connections,
        "the failure did not take the connection down"
    );
}

#[test]
fn a_damaged_write_segment_fails_with_integrity() {
    // Two 4 MiB pieces, 4 MiB segments: the flip lands mid-payload.
    damaged_write(2, 4 << 20, 6 << 20);
}

#[test]
fn a_damaged_write_list_fails_with_integrity() {
    // 512 pieces of 2 KiB go as write lists: the flip lands in a payload.
    damaged_write(512, 2 << 10, 700 << 10);
}

#[test]
fn damaged_read_data_fails_with_integrity() {
    let p = pair(Dir::Down, 3 << 20);
    let len = 8 << 20;
    let mut src = vec![0u8; len];
    fill(&mut src, 11, 0);
    let dst = vec![0u8; len];
    register(p.target.as_ref(), &src);
    register(p.init.as_ref(), &dst);
    p.load();
    let req = |checked: bool| {
        let r = TransferRequest::read(MemoryDescs::dram(&dst), MemoryDescs::dram(&src), &p.name);
        if checked { r.with_integrity() } else { r }
    };
    p.proxy.armed.store(true, Ordering::Release);
    p.init
        .submit_transfer(&req(false))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(p.proxy.flipped.load(Ordering::Relaxed), 1);
    assert!(
        first_mismatch(&dst, 11, 0).is_some(),
        "unchecked, the damage landed"
    );

    p.proxy.armed.store(true, Ordering::Release);
    let e = p
        .init
        .submit_transfer(&req(true))
        .unwrap()
        .wait_success(WAIT)
        .unwrap_err();
    assert_eq!(p.proxy.flipped.load(Ordering::Relaxed), 2);
    let Error::Integrity { what, .. } = &e else {
        panic!("{e}")
    };
    assert!(what.contains("READ"), "{what}");

    p.init
        .submit_transfer(&req(true))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(first_mismatch(&dst, 11, 0), None);
}

#[test]
fn checked_requests_land_whole_in_every_layout() {
    // 256 KiB segments, and 4 MiB ones (a WRITE's summed a chunk at a time
    // after each `sendmsg`, small frames summed before and gathered).
    for segment in [256 << 10, 4 << 20] {
        land_whole_in_every_layout(segment);
    }
}

fn land_whole_in_every_layout(segment: u64) {
    // No damage: many pieces, odd sizes, several streams, both directions.
    let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("whole-target")).unwrap();
    let init = make_transfer_agent(
        Backend::Tcp,
        AgentConfig::new("whole-init")
            .with_streams_per_peer(3)
            .with_segment_size(segment),
    )
    .unwrap();
    let len = 6 << 20;
    let mut src = vec![0u8; len];
    fill(&mut src, 3, 0);
    let mut dst = vec![0u8; len];
    register(init.as_ref(), &src);
    register(target.as_ref(), &dst);
    let name = init
        .load_remote_agent_by_connection(&target.local_connection_info())
        .unwrap();
    let layouts: [&[(u64, u64)]; 4] = [
        &[(0, len as u64)],
        &[(1, 3), (100, 65_535), (70_001, 1 << 20), (2 << 20, 4097)],
        &[
            (0, 512),
            (4096, 512),
            (8192, 1 << 16),
            (1 << 17, 77),
            (3 << 20, 2 << 20),
        ],
        // Small frames summed before, between large ones summed after.
        &[
            (0, 100),
            (1 << 20, 300_000),
            (2 << 20, 1000),
            (5 << 20, 5000),
        ],
    ];
    for (k, layout) in layouts.iter().enumerate() {
        dst.fill(0);
        let at = |base: &[u8]| dram(layout.iter().map(|&(o, l)| (base.as_ptr() as u64 + o, l)));
        let whole = |buf: &[u8], op: &str| {
            for &(o, l) in layout.iter() {
                let (o, l) = (o as usize, l as usize);
                let bad = first_mismatch(&buf[o..o + l], 3, o as u64);
                assert_eq!(bad, None, "layout {k} {op}");
            }
        };
        let req = TransferRequest::write(at(&src), at(&dst), &name).with_integrity();
        init.submit_transfer(&req)
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
        whole(&dst, "write");
        // READ back from the target's copy into a fresh local buffer.
        let back = vec![0u8; len];
        register(init.as_ref(), &back);
        let req = TransferRequest::read(at(&back), at(&dst), &name).with_integrity();
        init.submit_transfer(&req)
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
        whole(&back, "read");
        init.deregister_memory(&MemoryDescs::dram(&back)).unwrap();
    }
    assert_eq!(
        counter(target.as_ref(), "kvxfer_integrity_failures_total"),
        0
    );
}

#[test]
fn checked_requests_over_shm_land_whole() {
    // The initiator copies into the target's memory itself, then commits
    // with each range's CRC32C; the target checks them before it answers.
    let target = make_transfer_agent(Backend::Shm, AgentConfig::new("shm-target")).unwrap();
    let init = make_transfer_agent(Backend::Shm, AgentConfig::new("shm-init")).unwrap();
    let len = 4 << 20;
    let mut src = vec![0u8; len];
    fill(&mut src, 5, 0);
    let dst = vec![0u8; len];
    let back = vec![0u8; len];
    register(init.as_ref(), &src);
    register(init.as_ref(), &back);
    register(target.as_ref(), &dst);
    let name = init
        .load_remote_agent_by_connection(&target.local_connection_info())
        .unwrap();
    assert_eq!(init.remote_transport(&name).unwrap(), "shm");
    let at = |b: &[u8]| {
        let p = b.as_ptr() as u64;
        dram([(p + 3, 1000), (p + 4096, 65536), (p + (1 << 20), 3 << 20)])
    };
    let w = TransferRequest::write(at(&src), at(&dst), &name)
        .with_sync_message(b"checked".to_vec())
        .with_integrity();
    init.submit_transfer(&w)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    let msgs = target.wait_sync_messages(WAIT);
    assert_eq!(msgs[&"shm-init".to_string()], vec![b"checked".to_vec()]);
    let r = TransferRequest::read(at(&back), at(&dst), &name).with_integrity();
    init.submit_transfer(&r)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    for b in [&dst, &back] {
        for (o, l) in [(3usize, 1000usize), (4096, 65536), (1 << 20, 3 << 20)] {
            assert_eq!(first_mismatch(&b[o..o + l], 5, o as u64), None);
        }
    }
    assert_eq!(
        counter(target.as_ref(), "kvxfer_integrity_failures_total"),
        0
    );
    // One check per descriptor, at most 2^19 in a commit: more is refused
    // at submission, typed, and nothing moves.
    let (s0, d0) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    let n = (1u64 << 19) + 1;
    let many = |base: u64| dram((0..n).map(|i| (base + i % 4096, 1)));
    let e = init
        .submit_transfer(&TransferRequest::write(many(s0), many(d0), &name).with_integrity())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)), "{e}");
}

/// Every `Commit` with a sync message carries the message's CRC32C (in
/// `key`, bit 32 set): a hand-written initiator's commit whose message
/// does not match it is refused (status 21) and the message is never
/// delivered; the right one is; a commit without one is taken as before;
/// a malformed `key` is a protocol violation.
#[test]
fn a_damaged_sync_message_is_refused_and_never_delivered() {
    use common::raw::{ACK, COMMIT, Hdr, RawConn};
    let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("raw-sync-target")).unwrap();
    let mut c = RawConn::connect(&target.local_connection_info());
    c.auth(
        "raw-syncer",
        kvxfer::Credential::from_env().unwrap().as_ref(),
    )
    .unwrap();
    assert_eq!(c.hello("raw-syncer", 78).unwrap().status, 0);
    let mut commit = |id: u64, msg: &[u8], key: u64| {
        let mut h = Hdr::new(COMMIT);
        h.flags = 1 | 0x80; // write, sync message
        h.id = id;
        h.aux = msg.len() as u32;
        h.key = key;
        c.send(h, msg).unwrap();
        c.recv().map(|a| {
            assert_eq!((a.kind, a.id), (ACK, id));
            a.status
        })
    };
    let msg = b"blocks 0-15 landed";
    let crc = common::raw::crc32c(msg);
    let mut damaged = msg.to_vec();
    damaged[3] ^= 0x10;
    assert_eq!(commit(1, &damaged, 1 << 32 | u64::from(crc)), Some(21));
    assert_eq!(commit(2, msg, 1 << 32 | u64::from(crc)), Some(0));
    assert_eq!(commit(3, b"unchecked", 0), Some(0));
    let msgs = target.take_sync_messages();
    assert_eq!(
        msgs[&"raw-syncer".to_string()],
        vec![msg.to_vec(), b"unchecked".to_vec()],
        "the damaged message was delivered"
    );
    assert_eq!(commit(4, msg, 2 << 32 | u64::from(crc)), None);
}

#[test]
fn a_commit_whose_check_does_not_match_fails_and_delivers_nothing() {
    // A hand-written initiator commits a request whose data "moved beside
    // the stream" with checks: a wrong CRC32C fails it (status 21) and its
    // sync message is not delivered; the right one completes it; a range
    // outside every region is refused; the connection goes on throughout.
    use common::raw::{ACK, COMMIT, Hdr, RawConn};
    let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("raw-check-target")).unwrap();
    let mut mem = vec![0u8; 64 << 10];
    fill(&mut mem, 13, 0);
    register(target.as_ref(), &mem);
    let mut c = RawConn::connect(&target.local_connection_info());
    c.auth(
        "raw-checker",
        kvxfer::Credential::from_env().unwrap().as_ref(),
    )
    .unwrap();
    let desc = kvxfer::AgentDesc::decode(&c.desc().unwrap()).unwrap();
    let key = desc.regions[0].key;
    let ack = c.hello("raw-checker", 77).unwrap();
    assert_eq!(ack.status, 0);
    let (addr, len) = (mem.as_ptr() as u64 + 100, 30_000u64);
    let good = common::raw::crc32c(&mem[100..30_100]);
    let mut commit = |id: u64, entry: (u64, u64, u64, u32)| {
        let msg = b"checked";
        let mut h = Hdr::new(COMMIT);
        h.flags = 1 | 0x80 | 0x20; // write, sync message, checks
        h.id = id;
        h.aux = msg.len() as u32;
        h.addr = 1;
        let mut body = msg.to_vec();
        body.extend_from_slice(&entry.0.to_le_bytes());
        body.extend_from_slice(&entry.1.to_le_bytes());
        body.extend_from_slice(&entry.2.to_le_bytes());
        body.extend_from_slice(&entry.3.to_le_bytes());
        c.send(h, &body).unwrap();
        let a = c.recv().unwrap();
        assert_eq!((a.kind, a.id), (ACK, id));
        a.status
    };
    assert_eq!(commit(1, (addr, len, key, good ^ 1)), 21);
    assert_eq!(commit(2, (addr, len, key, good)), 0);
    assert_ne!(
        commit(3, (addr, len, key ^ 1, good)),
        0,
        "a wrong key is refused"
    );
    assert_ne!(
        commit(4, (8, len, key, good)),
        0,
        "a range outside the region is refused"
    );
    let msgs = target.take_sync_messages();
    assert_eq!(
        msgs[&"raw-checker".to_string()],
        vec![b"checked".to_vec()],
        "only the request that checked out delivered its message"
    );
    assert_eq!(
        counter(target.as_ref(), "kvxfer_integrity_failures_total"),
        1
    );
}

#[test]
fn in_process_copies_are_checked_and_storage_refuses() {
    // In-process: the copying thread sums the source before and the
    // destination after each copy.
    let target =
        make_transfer_agent(Backend::InProcess, AgentConfig::new("inproc-target")).unwrap();
    let init = make_transfer_agent(Backend::InProcess, AgentConfig::new("inproc-init")).unwrap();
    let mut src = vec![0u8; 1 << 20];
    fill(&mut src, 17, 0);
    let dst = vec![0u8; 1 << 20];
    register(init.as_ref(), &src);
    register(target.as_ref(), &dst);
    let name = init
        .load_remote_agent_by_connection(&target.local_connection_info())
        .unwrap();
    let req = TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), &name)
        .with_integrity();
    init.submit_transfer(&req)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(first_mismatch(&dst, 17, 0), None);

    // Storage (the agent's own file): nothing checks what reaches the
    // disk, so a checked request is refused and nothing is written.
    let dir = std::env::temp_dir().join(format!("kvxfer-integrity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f");
    let h = init
        .open_storage(&kvxfer::StorageSpec::file(&path).create(4096))
        .unwrap();
    let file = MemoryDescs::new(
        kvxfer::MemoryType::File,
        vec![kvxfer::MemoryDesc::new(0, 4096, h)],
    );
    // SAFETY: a file range, not memory.
    unsafe { init.register_memory(&file).unwrap() };
    let local = dram([(src.as_ptr() as u64, 4096)]);
    let to_file = TransferRequest::write(local.clone(), file.clone(), init.name());
    let e = init
        .submit_transfer(&to_file.clone().with_integrity())
        .unwrap_err();
    assert!(matches!(e, Error::IntegrityUnsupported { .. }), "{e}");
    assert!(
        std::fs::read(&path).unwrap().iter().all(|&b| b == 0),
        "nothing was written"
    );
    // Unchecked, the same request goes.
    init.submit_transfer(&to_file)
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), src[..4096]);
    init.deregister_memory(&file).unwrap();
    init.close_storage(h).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checked WRITE aborted while its stream is held mid-frame: the frame
/// under way ends with its trailer (summed after its chunks were sent),
/// then the `Abort`; the stream stays in step, nothing fails its check,
/// and the next checked WRITE lands whole on the same connection.
#[test]
fn a_checked_write_aborted_mid_frame_keeps_its_stream_in_step() {
    // The default 4 MiB segments: sixteen frames, held inside the second.
    let p = pair(Dir::Up, 0);
    let len = 64 << 20;
    let mut src = vec![0u8; len];
    fill(&mut src, 5, 0);
    let dst = vec![0u8; len];
    register(p.init.as_ref(), &src);
    register(p.target.as_ref(), &dst);
    p.load();
    let req = || {
        TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), &p.name)
            .with_sync_message(b"landed".to_vec())
            .with_integrity()
    };
    // A first request opens the connection (the proxy counts it).
    let warm = TransferRequest::write(
        dram([(src.as_ptr() as u64, 4096)]),
        dram([(dst.as_ptr() as u64, 4096)]),
        &p.name,
    );
    p.init
        .submit_transfer(&warm.with_integrity())
        .unwrap()
        .wait_success(WAIT)
        .unwrap();

    p.proxy.hold.after(6 << 20);
    let st = p.init.submit_transfer(&req()).unwrap();
    p.proxy.hold.wait_held();
    // At most 6 MiB went through and the kernel's buffers hold far less
    // than the rest: the request cannot have finished.
    assert!(st.abort(), "finished before the abort: {:?}", st.poll());
    p.proxy.hold.release();
    assert!(
        matches!(st.wait(WAIT), Err(Error::Aborted)),
        "{:?}",
        st.poll()
    );
    assert!(p.target.take_sync_messages().is_empty());

    p.init
        .submit_transfer(&req())
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert_eq!(first_mismatch(&dst, 5, 0), None);
    assert_eq!(
        counter(p.target.as_ref(), "kvxfer_integrity_failures_total"),
        0
    );
    assert_eq!(
        p.proxy.accepted.load(Ordering::Relaxed),
        1,
        "the abort took the connection down"
    );
}
