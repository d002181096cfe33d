//! The verbs layer against a real kernel RDMA stack: runs for real inside
//! `ci/rxe-guest` (soft-RoCE devices rxe0 and rxe1 on a veth pair), which
//! `ci/test.sh` does on every CI run. Elsewhere these tests say that they
//! are skipped, unless `KVXFER_REQUIRE_RDMA=1` (set inside the guest), where
//! a missing device is a failure.

use std::time::{Duration, Instant};

use kvxfer::verbs::{self, Device, RcQueuePair, Sge, VerbsError, WorkCompletion};

fn require() -> bool {
    std::env::var("KVXFER_REQUIRE_RDMA").is_ok_and(|v| v == "1")
}

/// Two devices (or one device twice), or `None` after saying why.
fn two_devices(test: &str) -> Option<(Device, Device)> {
    let names = match verbs::device_names() {
        Ok(n) if !n.is_empty() => n,
        Ok(_) => {
            assert!(
                !require(),
                "KVXFER_REQUIRE_RDMA=1 but no RDMA device exists"
            );
            eprintln!("SKIPPED {test}: no RDMA device on this host (CI runs it in ci/rxe-guest)");
            return None;
        }
        Err(e) => {
            assert!(!require(), "KVXFER_REQUIRE_RDMA=1 but {e}");
            eprintln!("SKIPPED {test}: {e} (CI runs it in ci/rxe-guest)");
            return None;
        }
    };
    let a = Device::open(Some(&names[0]), None).expect("open first device");
    let b =
        Device::open(Some(names.get(1).unwrap_or(&names[0])), None).expect("open second device");
    Some((a, b))
}

fn connected_pair(a: &Device, b: &Device) -> (RcQueuePair, RcQueuePair) {
    let mut qa = a.create_rc(64).expect("create qp a");
    let mut qb = b.create_rc(64).expect("create qp b");
    let (ia, ib) = (qa.info(), qb.info());
    qa.connect(&ib).expect("connect a");
    qb.connect(&ia).expect("connect b");
    (qa, qb)
}

/// Polls until `n` completions arrived on the send (or receive) queue.
fn wait_for(qp: &RcQueuePair, recv: bool, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {n} completions, got {out:?}"
        );
        if recv {
            qp.poll_recv(&mut out).unwrap();
        } else {
            qp.poll_send(&mut out).unwrap();
        }
        if out.len() < n {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    out
}

#[test]
fn write_read_and_write_with_immediate_between_two_devices() {
    let Some((a, b)) = two_devices("write_read_and_write_with_immediate_between_two_devices")
    else {
        return;
    };
    eprintln!("devices: {} and {}", a.name(), b.name());
    let (mut qa, mut qb) = connected_pair(&a, &b);
    const N: usize = 1 << 20;
    let src: Vec<u8> = (0..N).map(|i| (i * 7 + i / 4096) as u8).collect();
    let dst = vec![0u8; N];
    let back = vec![0u8; N];
    let note = [0u8; 64];
    // SAFETY: the buffers outlive the regions (dropped at the end of the
    // test, after the queue pairs), and are only read after completions.
    let (src_mr, dst_mr, back_mr, note_mr) = unsafe {
        (
            a.register(src.as_ptr() as u64, N as u64).unwrap(),
            b.register(dst.as_ptr() as u64, N as u64).unwrap(),
            a.register(back.as_ptr() as u64, N as u64).unwrap(),
            b.register(note.as_ptr() as u64, 64).unwrap(),
        )
    };
    // SAFETY: `note` stays registered and alive until the receive completes.
    unsafe {
        qb.post_recv(
            7,
            Sge {
                lkey: note_mr.lkey(),
                addr: note.as_ptr() as u64,
                len: 64,
            },
        )
        .unwrap()
    };
    // WRITE: three local pieces gathered into one contiguous remote range.
    let third = (N / 4) as u32;
    let pieces = [
        Sge {
            lkey: src_mr.lkey(),
            addr: src.as_ptr() as u64 + 2 * u64::from(third),
            len: third,
        },
        Sge {
            lkey: src_mr.lkey(),
            addr: src.as_ptr() as u64,
            len: third,
        },
        Sge {
            lkey: src_mr.lkey(),
            addr: src.as_ptr() as u64 + 3 * u64::from(third),
            len: third,
        },
    ];
    // SAFETY: all pieces lie in `src_mr`, alive until the completion below.
    unsafe {
        qa.post_write(1, &pieces, dst_mr.rkey(), dst.as_ptr() as u64, None, true)
            .unwrap();
        // A zero-byte WRITE_WITH_IMM after the data: the receiver learns of
        // it only after the data landed (RC ordering).
        qa.post_write(
            2,
            &[],
            dst_mr.rkey(),
            dst.as_ptr() as u64,
            Some(0xC0FFEE),
            true,
        )
        .unwrap();
    }
    for c in wait_for(&qa, false, 2) {
        c.ok().unwrap();
    }
    let r = wait_for(&qb, true, 1);
    r[0].ok().unwrap();
    assert_eq!((r[0].wr_id, r[0].imm), (7, 0xC0FFEE));
    let dst = std::hint::black_box(dst);
    let t = third as usize;
    assert_eq!(dst[..t], src[2 * t..3 * t]);
    assert_eq!(dst[t..2 * t], src[..t]);
    assert_eq!(dst[2 * t..3 * t], src[3 * t..4 * t]);
    assert!(dst[3 * t..].iter().all(|&x| x == 0));

    // READ the remote range back, scattered into two local pieces.
    let half = (3 * t / 2) as u32;
    let scatter = [
        Sge {
            lkey: back_mr.lkey(),
            addr: back.as_ptr() as u64 + u64::from(half),
            len: half,
        },
        Sge {
            lkey: back_mr.lkey(),
            addr: back.as_ptr() as u64,
            len: half,
        },
    ];
    // SAFETY: both pieces lie in `back_mr`, alive until the completion.
    unsafe {
        qa.post_read(3, &scatter, dst_mr.rkey(), dst.as_ptr() as u64, true)
            .unwrap()
    };
    wait_for(&qa, false, 1)[0].ok().unwrap();
    let back = std::hint::black_box(back);
    let h = half as usize;
    assert_eq!(back[h..2 * h], dst[..h]);
    assert_eq!(back[..h], dst[h..2 * h]);
    assert!(!qa.is_error() && !qb.is_error());
    drop((qa, qb));
    drop((src_mr, dst_mr, back_mr, note_mr));
}

#[test]
fn bad_remote_key_is_a_typed_completion_error() {
    let Some((a, b)) = two_devices("bad_remote_key_is_a_typed_completion_error") else {
        return;
    };
    let (mut qa, _qb) = connected_pair(&a, &b);
    let src = vec![1u8; 4096];
    let dst = vec![0u8; 4096];
    // SAFETY: the buffers outlive the regions.
    let (src_mr, dst_mr) = unsafe {
        (
            a.register(src.as_ptr() as u64, 4096).unwrap(),
            b.register(dst.as_ptr() as u64, 4096).unwrap(),
        )
    };
    let piece = [Sge {
        lkey: src_mr.lkey(),
        addr: src.as_ptr() as u64,
        len: 4096,
    }];
    // SAFETY: the piece lies in `src_mr`, alive until the completion.
    unsafe {
        qa.post_write(
            9,
            &piece,
            dst_mr.rkey() ^ 0xff00,
            dst.as_ptr() as u64,
            None,
            true,
        )
        .unwrap()
    };
    let c = wait_for(&qa, false, 1)[0];
    match c.ok() {
        Err(VerbsError::WorkCompletion {
            wr_id: 9,
            status_name,
            ..
        }) => {
            assert_eq!(status_name, "IBV_WC_REM_ACCESS_ERR");
        }
        other => panic!("expected a remote access error, got {other:?}"),
    }
    assert!(
        qa.is_error(),
        "the queue pair is in error after a failed completion"
    );
    assert!(dst.iter().all(|&x| x == 0), "nothing landed");
    drop(qa);
    drop((src_mr, dst_mr));
}

/// Runs everywhere: asking for a device that does not exist (or for any
/// device on a host without RDMA) is a typed error, not a crash.
#[test]
fn missing_device_is_a_typed_error() {
    match Device::open(Some("no-such-device-kvxfer"), None) {
        Err(VerbsError::NoDevice(reason)) => eprintln!("as expected: {reason}"),
        other => panic!("expected NoDevice, got {other:?}"),
    }
}

#[test]
fn completion_channel_wakes_a_sleeper_and_times_out_when_idle() {
    let Some((a, b)) = two_devices("completion_channel_wakes_a_sleeper_and_times_out_when_idle")
    else {
        return;
    };
    let mut qa = a.create_rc_with(16, true).expect("create qp with events");
    let mut qb = b
        .create_rc_with_events(16, false, true)
        .expect("create qp b with receive events");
    let (ia, ib) = (qa.info(), qb.info());
    qa.connect(&ib).expect("connect a");
    qb.connect(&ia).expect("connect b");
    assert!(qb.send_events().is_none(), "no channel unless asked for");
    assert!(qa.recv_events().is_none(), "no channel unless asked for");
    let rev = qb.recv_events().expect("receive channel");
    let ev = qa.send_events().expect("channel");
    let src = vec![3u8; 4096];
    let dst = vec![0u8; 4096];
    // SAFETY: both buffers outlive the regions and the queue pairs' work.
    let (smr, dmr) = unsafe {
        (
            a.register(src.as_ptr() as u64, 4096).unwrap(),
            b.register(dst.as_ptr() as u64, 4096).unwrap(),
        )
    };
    // Idle: an armed channel reports nothing within the timeout.
    ev.arm().unwrap();
    let t = Instant::now();
    assert!(!ev.wait(Duration::from_millis(50)).unwrap());
    assert!(t.elapsed() >= Duration::from_millis(40));
    for round in 0..3u64 {
        ev.arm().unwrap();
        // SAFETY: the piece lies in `smr`, alive until the completion.
        unsafe {
            qa.post_write(
                round,
                &[Sge {
                    lkey: smr.lkey(),
                    addr: src.as_ptr() as u64,
                    len: 4096,
                }],
                dmr.rkey(),
                dst.as_ptr() as u64,
                None,
                true,
            )
            .unwrap();
        }
        assert!(
            ev.wait(Duration::from_secs(30)).unwrap(),
            "no event for the completion of round {round}"
        );
        let c = wait_for(&qa, false, 1);
        assert_eq!(c[0].wr_id, round);
        c[0].ok().unwrap();
    }
    assert_eq!(dst, src);

    // The receive side: a SEND landing in a posted buffer wakes a sleeper
    // on the receive channel; with nothing arriving, it times out.
    // SAFETY: the buffer lies in `dmr`, alive until the receive completes.
    unsafe {
        qb.post_recv(
            42,
            Sge {
                lkey: dmr.lkey(),
                addr: dst.as_ptr() as u64,
                len: 4096,
            },
        )
        .unwrap();
    }
    rev.arm().unwrap();
    assert!(!rev.wait(Duration::from_millis(50)).unwrap());
    rev.arm().unwrap();
    qa.post_send_inline(7, b"wake up", 5).unwrap();
    assert!(
        rev.wait(Duration::from_secs(30)).unwrap(),
        "no receive event for the SEND"
    );
    let r = wait_for(&qb, true, 1);
    assert_eq!((r[0].wr_id, r[0].imm, r[0].byte_len), (42, 5, 7));
    r[0].ok().unwrap();
    wait_for(&qa, false, 1)[0].ok().unwrap();
}

/// A batch posted with one doorbell: 40 WRITEs scattered over the remote
/// region (more than one batch of the agent's), then a READ of them back,
/// complete in posting order with their ids and move every byte.
#[test]
fn batch_of_work_requests_with_one_doorbell() {
    let Some((a, b)) = two_devices("batch_of_work_requests_with_one_doorbell") else {
        return;
    };
    let (mut qa, _qb) = connected_pair(&a, &b);
    const K: usize = 40;
    const PIECE: usize = 1024;
    let src: Vec<u8> = (0..K * PIECE).map(|i| (i * 7 % 251) as u8 + 1).collect();
    let dst = vec![0u8; 2 * K * PIECE];
    let back = vec![0u8; 2 * K * PIECE];
    // SAFETY: the buffers outlive the regions (dropped at the end).
    let (src_mr, dst_mr, back_mr) = unsafe {
        (
            a.register(src.as_ptr() as u64, src.len() as u64).unwrap(),
            b.register(dst.as_ptr() as u64, dst.len() as u64).unwrap(),
            a.register(back.as_ptr() as u64, back.len() as u64).unwrap(),
        )
    };
    let pieces: Vec<[Sge; 1]> = (0..K)
        .map(|i| {
            [Sge {
                lkey: src_mr.lkey(),
                addr: src.as_ptr() as u64 + (i * PIECE) as u64,
                len: PIECE as u32,
            }]
        })
        .collect();
    let whole = [Sge {
        lkey: back_mr.lkey(),
        addr: back.as_ptr() as u64,
        len: back.len() as u32,
    }];
    // Piece i lands at 2i * PIECE: every other KiB of the remote region.
    let mut posts: Vec<verbs::Post<'_>> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| verbs::Post {
            wr_id: 100 + i as u64,
            op: verbs::PostOp::Write {
                rkey: dst_mr.rkey(),
                remote_addr: dst.as_ptr() as u64 + (2 * i * PIECE) as u64,
                imm: None,
            },
            sges: p,
            host_source: true,
        })
        .collect();
    posts.push(verbs::Post {
        wr_id: 999,
        op: verbs::PostOp::Read {
            rkey: dst_mr.rkey(),
            remote_addr: dst.as_ptr() as u64,
        },
        sges: &whole,
        host_source: true,
    });
    eprintln!("batch_is_atomic: {}", qa.batch_is_atomic());
    // SAFETY: every piece lies in a registered region alive until the
    // completions below.
    unsafe { qa.post_batch(&posts).unwrap() };
    let done = wait_for(&qa, false, K + 1);
    let ids: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    let want: Vec<u64> = (0..K as u64).map(|i| 100 + i).chain([999]).collect();
    assert_eq!(ids, want);
    for c in &done {
        c.ok().unwrap();
    }
    let (dst, back) = (std::hint::black_box(dst), std::hint::black_box(back));
    for i in 0..K {
        let want = &src[i * PIECE..(i + 1) * PIECE];
        assert_eq!(&dst[2 * i * PIECE..(2 * i + 1) * PIECE], want, "piece {i}");
        assert!(
            dst[(2 * i + 1) * PIECE..(2 * i + 2) * PIECE]
                .iter()
                .all(|&x| x == 0)
        );
    }
    // The READ, posted after the WRITEs on the same queue pair, saw them.
    assert_eq!(back, dst);
    drop((qa, _qb));
    drop((src_mr, dst_mr, back_mr));
}

/// Small WRITEs go inline (their bytes copied into the work request when
/// posted, as perftest's): each lands exactly, the source can be rewritten as
/// soon as the post returns, and a WRITE one byte over the inline limit (through
/// the gather list) lands too; a one-entry WRITE_WITH_IMM and a READ of the
/// same size are unaffected.
#[test]
fn small_writes_go_inline_and_land() {
    let Some((a, b)) = two_devices("small_writes_go_inline_and_land") else {
        return;
    };
    let (mut qa, mut qb) = connected_pair(&a, &b);
    let max = verbs::MAX_INLINE as usize;
    let mut src = vec![0u8; 4096];
    // Written through this pointer only (the test rewrites the source
    // while the device may read it).
    let src_at = src.as_mut_ptr();
    let dst = vec![0u8; 4096];
    let back = vec![0u8; 4096];
    let note = [0u8; 16];
    // SAFETY: the buffers outlive the regions (dropped at the end).
    let (src_mr, dst_mr, back_mr, note_mr) = unsafe {
        (
            a.register(src_at as u64, 4096).unwrap(),
            b.register(dst.as_ptr() as u64, 4096).unwrap(),
            a.register(back.as_ptr() as u64, 4096).unwrap(),
            b.register(note.as_ptr() as u64, 16).unwrap(),
        )
    };
    let mut at = 0usize;
    for (i, len) in [1usize, 8, max - 1, max, max + 1, 200]
        .into_iter()
        .enumerate()
    {
        let fill = |v: u8| {
            for k in 0..len {
                // SAFETY: inside `src`, which nothing else touches while no
                // work request reads it.
                unsafe { src_at.add(k).write_volatile(v.wrapping_add(k as u8)) };
            }
        };
        fill(0x40 + i as u8);
        let piece = [Sge {
            lkey: src_mr.lkey(),
            addr: src_at as u64,
            len: len as u32,
        }];
        // SAFETY: the piece lies in `src_mr`; for inline sizes it is read
        // during the call, for larger ones before the completion below.
        unsafe {
            qa.post_write(
                i as u64,
                &piece,
                dst_mr.rkey(),
                dst.as_ptr() as u64 + at as u64,
                None,
                true,
            )
            .unwrap()
        };
        if len <= max {
            // Inline: the bytes were taken when posted.
            fill(0xEE);
        }
        wait_for(&qa, false, 1)[0].ok().unwrap();
        let dst = std::hint::black_box(&dst);
        for k in 0..len {
            assert_eq!(
                dst[at + k],
                (0x40 + i as u8).wrapping_add(k as u8),
                "byte {k} of the {len}-byte WRITE"
            );
        }
        at += len + 3;
    }
    // A one-entry WRITE_WITH_IMM (inline) still raises its receive after
    // the data; a READ of an inline-sized piece reads.
    // SAFETY: `note` stays registered and alive until the receive completes.
    unsafe {
        qb.post_recv(
            5,
            Sge {
                lkey: note_mr.lkey(),
                addr: note.as_ptr() as u64,
                len: 16,
            },
        )
        .unwrap()
    };
    fill_word(src_at, 0x1122_3344_5566_7788);
    let word = [Sge {
        lkey: src_mr.lkey(),
        addr: src_at as u64,
        len: 8,
    }];
    let into_back = [Sge {
        lkey: back_mr.lkey(),
        addr: back.as_ptr() as u64,
        len: 8,
    }];
    // SAFETY: pieces in `src_mr` and `back_mr`, alive until the completions.
    unsafe {
        qa.post_write(
            10,
            &word,
            dst_mr.rkey(),
            dst.as_ptr() as u64 + 4000,
            Some(77),
            true,
        )
        .unwrap();
        qa.post_read(
            11,
            &into_back,
            dst_mr.rkey(),
            dst.as_ptr() as u64 + 4000,
            true,
        )
        .unwrap();
    }
    for c in wait_for(&qa, false, 2) {
        c.ok().unwrap();
    }
    let r = wait_for(&qb, true, 1);
    r[0].ok().unwrap();
    assert_eq!((r[0].wr_id, r[0].imm), (5, 77));
    let (dst, back) = (std::hint::black_box(dst), std::hint::black_box(back));
    assert_eq!(dst[4000..4008], 0x1122_3344_5566_7788u64.to_ne_bytes());
    assert_eq!(back[..8], dst[4000..4008]);
    assert!(!qa.is_error() && !qb.is_error());
    drop((qa, qb));
    drop((src_mr, dst_mr, back_mr, note_mr));
    drop(src);
}

fn fill_word(at: *mut u8, v: u64) {
    // SAFETY: the caller's buffer holds at least 8 bytes; unaligned write.
    unsafe { at.cast::<u64>().write_unaligned(v) };
}

/// Two senders' queue pairs into two queue pairs on one shared receive
/// queue: each receive names the queue pair it came through, each sender's
/// messages keep their order, a sender finding no posted buffer waits (RNR)
/// until one is posted, and the receiving queue pairs serve one-sided
/// WRITE and READ as any other.
#[test]
fn shared_receive_queue_serves_two_queue_pairs() {
    let Some((a, b)) = two_devices("shared_receive_queue_serves_two_queue_pairs") else {
        return;
    };
    let srq = b.create_srq(16).expect("create srq");
    let mut senders = [a.create_rc(64).unwrap(), a.create_rc(64).unwrap()];
    let mut receivers = [
        b.create_rc_on_srq(&srq).unwrap(),
        b.create_rc_on_srq(&srq).unwrap(),
    ];
    assert_ne!(receivers[0].qp_num(), receivers[1].qp_num());
    for (s, r) in senders.iter_mut().zip(receivers.iter_mut()) {
        r.set_ack_timeout(20);
        let (is, ir) = (s.info(), r.info());
        s.connect(&ir).unwrap();
        r.connect(&is).unwrap();
    }
    const SLOT: usize = 64;
    let ring = vec![0u8; 4 * SLOT];
    let data = vec![0u8; 4096];
    let back = vec![0u8; 4096];
    let src: Vec<u8> = (0..4096).map(|i| (i * 13 + 5) as u8).collect();
    // SAFETY: the buffers outlive their regions (dropped last).
    let (ring_mr, data_mr, back_mr, src_mr) = unsafe {
        (
            b.register(ring.as_ptr() as u64, ring.len() as u64).unwrap(),
            b.register(data.as_ptr() as u64, 4096).unwrap(),
            a.register(back.as_ptr() as u64, 4096).unwrap(),
            a.register(src.as_ptr() as u64, 4096).unwrap(),
        )
    };
    let slot = |i: u64| Sge {
        lkey: ring_mr.lkey(),
        addr: ring.as_ptr() as u64 + i * SLOT as u64,
        len: SLOT as u32,
    };
    // Only two buffers for four messages.
    // SAFETY: the ring stays registered and alive until the queue is gone.
    unsafe {
        srq.post_recv(0, slot(0)).unwrap();
        srq.post_recv(1, slot(1)).unwrap();
    }
    for round in 1..=2 {
        for (k, s) in senders.iter_mut().enumerate() {
            s.post_send_inline(round, format!("qp{k}-msg{round}").as_bytes(), 0)
                .unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got: Vec<(u32, String)> = Vec::new();
    let mut reposted = false;
    while got.len() < 4 {
        assert!(Instant::now() < deadline, "only {got:?} arrived");
        let mut out = Vec::new();
        srq.poll(&mut out).unwrap();
        for (qpn, c) in out {
            c.ok().unwrap();
            let off = c.wr_id as usize * SLOT;
            let msg = String::from_utf8(ring[off..off + c.byte_len as usize].to_vec()).unwrap();
            got.push((qpn, msg));
        }
        if got.len() >= 2 && !reposted {
            // The other two senders have been waiting on RNR retries.
            // SAFETY: as above; slots 0 and 1 were read.
            unsafe {
                srq.post_recv(2, slot(2)).unwrap();
                srq.post_recv(3, slot(3)).unwrap();
            }
            reposted = true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    for (k, r) in receivers.iter().enumerate() {
        let mine: Vec<&str> = got
            .iter()
            .filter(|(q, _)| *q == r.qp_num())
            .map(|(_, m)| m.as_str())
            .collect();
        assert_eq!(
            mine,
            [format!("qp{k}-msg1"), format!("qp{k}-msg2")],
            "{got:?}"
        );
    }
    for s in &senders {
        for c in wait_for(s, false, 2) {
            c.ok().unwrap();
        }
    }
    // One-sided WRITE then READ through the second pair.
    let piece = |lkey: u32, buf: &[u8]| Sge {
        lkey,
        addr: buf.as_ptr() as u64,
        len: 4096,
    };
    // SAFETY: the pieces lie in registered, live buffers, read only after
    // the completions.
    unsafe {
        senders[1]
            .post_write(
                9,
                &[piece(src_mr.lkey(), &src)],
                data_mr.rkey(),
                data.as_ptr() as u64,
                None,
                true,
            )
            .unwrap();
        senders[1]
            .post_read(
                10,
                &[piece(back_mr.lkey(), &back)],
                data_mr.rkey(),
                data.as_ptr() as u64,
                true,
            )
            .unwrap();
    }
    for c in wait_for(&senders[1], false, 2) {
        c.ok().unwrap();
    }
    assert_eq!(std::hint::black_box(&back)[..], src[..]);
    assert!(!receivers[0].is_error() && !receivers[1].is_error());
    drop(receivers);
    drop(senders);
    drop(srq);
    drop((ring_mr, data_mr, back_mr, src_mr));
}
