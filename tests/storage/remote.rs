//! A peer's storage: FILE and BLK regions registered by one agent, written
//! and read by another through the first agent (on TCP, beside whatever
//! path moves host memory between them).

use super::*;

use kvxfer::RejectReason;

/// A target agent and an initiator, both on `backend`, the initiator
/// having loaded the target (after `setup` registered the target's
/// regions).
fn pair(
    backend: Backend,
    name: &str,
    setup: impl FnOnce(&dyn TransferAgent),
) -> (Box<dyn TransferAgent>, Box<dyn TransferAgent>) {
    let target = make_transfer_agent(backend, AgentConfig::new(format!("{name}-target"))).unwrap();
    setup(target.as_ref());
    let init = make_transfer_agent(backend, AgentConfig::new(format!("{name}-init"))).unwrap();
    init.load_remote_agent(&target.local_agent_desc()).unwrap();
    (target, init)
}

/// Runs `req` from `init`; the data path it took.
fn run_remote(init: &dyn TransferAgent, req: TransferRequest) -> Result<TransportKind, Error> {
    let st = init.submit_transfer(&req)?;
    st.wait_success(WAIT)?;
    Ok(st.data_path().transport)
}

fn rejected(e: &Error) -> Option<RejectReason> {
    match e {
        Error::RemoteRejected { reason, .. } => Some(*reason),
        _ => None,
    }
}

#[test]
fn a_peers_file_round_trips_through_its_agent() {
    const PIECE: u64 = 64 << 10;
    const N: usize = 256;
    // TCP moves host memory too; shm and auto (cross-memory attach here)
    // reach the peer's storage on a TCP lane of their own.
    for backend in [Backend::Tcp, Backend::Shm, Backend::Auto] {
        let dir = tempdir();
        let path = dir.join("f");
        let size = 2 * N as u64 * PIECE;
        let mut h = 0;
        let (target, init) = pair(backend, "rt", |t| {
            h = t
                .open_storage(&StorageSpec::file(&path).create(size))
                .unwrap();
            register(t, &file_descs(h, &[(0, size)], MemoryType::File));
        });
        let tname = target.name().to_owned();
        let src = Buf::filled(N * PIECE as usize, 31);
        let back = Buf::new(N * PIECE as usize);
        register(init.as_ref(), &src.all());
        register(init.as_ref(), &back.all());

        // One byte, with a sync message that arrives after it.
        let req = TransferRequest::write(
            sub(&src, 3, 1),
            file_descs(h, &[(11, 1)], MemoryType::File),
            &tname,
        )
        .with_sync_message(b"one".to_vec());
        assert_eq!(
            run_remote(init.as_ref(), req).unwrap(),
            TransportKind::Tcp,
            "{backend:?}"
        );
        assert_eq!(std::fs::read(&path).unwrap()[11], src.bytes()[3]);
        let msgs = target.take_sync_messages();
        assert_eq!(
            msgs.get(init.name()).map(Vec::as_slice),
            Some(&[b"one".to_vec()][..])
        );

        // 256 pieces of 64 KiB to scattered even slots, and back.
        let perm = shuffled(N, 7);
        let local = |b: &Buf| pieces(b, N, PIECE);
        let remote = even_slots(h, &perm, PIECE);
        let w = TransferRequest::write(local(&src), remote.clone(), &tname);
        run_remote(init.as_ref(), w).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        for (i, &p) in perm.iter().enumerate() {
            let at = 2 * p * PIECE as usize;
            assert_eq!(
                &on_disk[at..at + PIECE as usize],
                &src.bytes()[i * PIECE as usize..(i + 1) * PIECE as usize],
                "{backend:?}: piece {i}"
            );
        }
        let r = TransferRequest::read(local(&back), remote, &tname);
        run_remote(init.as_ref(), r).unwrap();
        assert!(
            back.bytes() == src.bytes(),
            "{backend:?}: read back differs"
        );

        // Host memory between them still takes the backend's own path.
        let peer_mem = Buf::new(4096);
        register(target.as_ref(), &peer_mem.all());
        init.load_remote_agent(&target.local_agent_desc()).unwrap();
        let dram = TransferRequest::write(sub(&src, 0, 4096), peer_mem.all(), &tname);
        let kind = run_remote(init.as_ref(), dram).unwrap();
        let expect = match backend {
            Backend::Tcp => TransportKind::Tcp,
            _ => TransportKind::Shm,
        };
        assert_eq!(kind, expect, "{backend:?}");
        assert_eq!(peer_mem.bytes(), &src.bytes()[..4096]);
        drop(init);
        drop(target);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn one_gib_to_a_peers_file_and_back_is_element_exact() {
    const LEN: u64 = 1 << 30;
    let dir = tempdir();
    let path = dir.join("f");
    let mut region = None;
    let (target, init) = pair(Backend::Tcp, "gib", |t| {
        region = Some(open_file(t, &path, LEN).1);
    });
    let region = region.unwrap();
    let src = Buf::filled(LEN as usize, 37);
    register(init.as_ref(), &src.all());
    let tname = target.name().to_owned();
    let w = TransferRequest::write(src.all(), region.clone(), &tname);
    run_remote(init.as_ref(), w).unwrap();
    let back = Buf::new(LEN as usize);
    register(init.as_ref(), &back.all());
    let r = TransferRequest::read(back.all(), region, &tname);
    run_remote(init.as_ref(), r).unwrap();
    assert!(back.bytes() == src.bytes(), "1 GiB read back differs");
    drop(init);
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_requests_to_a_peers_storage_are_typed_and_change_nothing() {
    let dir = tempdir();
    let path = dir.join("f");
    let mut h = 0;
    let (target, init) = pair(Backend::Tcp, "bad", |t| {
        h = t
            .open_storage(&StorageSpec::file(&path).create(16384))
            .unwrap();
        register(t, &file_descs(h, &[(0, 8192)], MemoryType::File));
    });
    let tname = target.name().to_owned();
    let src = Buf::filled(16384, 41);
    register(init.as_ref(), &src.all());
    // Past the registered range, another handle, the other storage kind:
    // not exported, refused before anything is sent.
    for remote in [
        file_descs(h, &[(4096, 8192)], MemoryType::File),
        file_descs(h + 1, &[(0, 8192)], MemoryType::File),
        file_descs(h, &[(0, 8192)], MemoryType::Blk),
    ] {
        let req = TransferRequest::write(sub(&src, 0, 8192), remote, &tname);
        let e = init.submit_transfer(&req).unwrap_err();
        assert!(matches!(e, Error::RemoteRangeNotExported { .. }), "{e}");
    }
    // The region registered again: the old key is refused by the target.
    let region = file_descs(h, &[(0, 8192)], MemoryType::File);
    target.deregister_memory(&region).unwrap();
    register(target.as_ref(), &region);
    let req = TransferRequest::write(sub(&src, 0, 8192), region.clone(), &tname);
    let e = run_remote(init.as_ref(), req).unwrap_err();
    assert_eq!(rejected(&e), Some(RejectReason::BadKey), "{e}");
    assert!(
        std::fs::read(&path).unwrap().iter().all(|&b| b == 0),
        "nothing written"
    );
    drop(init);
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_peers_file_truncated_under_its_region_is_refused() {
    let dir = tempdir();
    let path = dir.join("f");
    let mut region = None;
    let (target, init) = pair(Backend::Tcp, "trunc", |t| {
        region = Some(open_file(t, &path, 8192).1);
    });
    let region = region.unwrap();
    let tname = target.name().to_owned();
    let src = Buf::filled(8192, 43);
    let back = Buf::new(8192);
    register(init.as_ref(), &src.all());
    register(init.as_ref(), &back.all());
    run_remote(
        init.as_ref(),
        TransferRequest::write(src.all(), region.clone(), &tname),
    )
    .unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let e = run_remote(
        init.as_ref(),
        TransferRequest::read(back.all(), region.clone(), &tname),
    )
    .unwrap_err();
    assert_eq!(rejected(&e), Some(RejectReason::PastEnd), "{e}");
    assert!(e.to_string().contains("truncated"), "{e}");
    assert!(back.bytes().iter().all(|&b| b == 0), "nothing read");
    let e = run_remote(
        init.as_ref(),
        TransferRequest::write(src.all(), region, &tname),
    )
    .unwrap_err();
    assert_eq!(rejected(&e), Some(RejectReason::PastEnd), "{e}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4096, "not grown");
    drop(init);
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_peer_writes_past_the_end_of_a_file_opened_to_grow() {
    let dir = tempdir();
    let path = dir.join("f");
    std::fs::File::create(&path).unwrap();
    let mut region = None;
    let (target, init) = pair(Backend::Tcp, "grow", |t| {
        let h = t
            .open_storage(&StorageSpec::file(&path).grow(true))
            .unwrap();
        let r = file_descs(h, &[(0, 8192)], MemoryType::File);
        register(t, &r);
        region = Some(r);
    });
    let region = region.unwrap();
    let tname = target.name().to_owned();
    let src = Buf::filled(8192, 47);
    let back = Buf::new(8192);
    register(init.as_ref(), &src.all());
    register(init.as_ref(), &back.all());
    // A READ of the empty file: past its end, refused.
    let e = run_remote(
        init.as_ref(),
        TransferRequest::read(back.all(), region.clone(), &tname),
    )
    .unwrap_err();
    assert_eq!(rejected(&e), Some(RejectReason::PastEnd), "{e}");
    // A WRITE grows it; then the READ finds the bytes.
    run_remote(
        init.as_ref(),
        TransferRequest::write(src.all(), region.clone(), &tname),
    )
    .unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 8192);
    run_remote(
        init.as_ref(),
        TransferRequest::read(back.all(), region, &tname),
    )
    .unwrap();
    assert_eq!(back.bytes(), src.bytes());
    drop(init);
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_peers_full_disk_is_a_typed_enospc_and_earlier_data_stays() {
    let fs = match Tmpfs::mount(1 << 20) {
        Ok(f) => f,
        Err(why) => {
            println!("SKIPPED a_peers_full_disk_is_a_typed_enospc_and_earlier_data_stays: {why}");
            return;
        }
    };
    let path = fs.0.join("f");
    let mut h = 0;
    let (target, init) = pair(Backend::Tcp, "full", |t| {
        // A sparse 8 MiB file on a 1 MiB filesystem.
        h = t
            .open_storage(&StorageSpec::file(&path).create(8 << 20))
            .unwrap();
        register(t, &file_descs(h, &[(0, 8 << 20)], MemoryType::File));
    });
    let tname = target.name().to_owned();
    let first = Buf::filled(256 << 10, 47);
    let big = Buf::filled(4 << 20, 53);
    let back = Buf::new(256 << 10);
    for b in [&first, &big, &back] {
        register(init.as_ref(), &b.all());
    }
    let head = file_descs(h, &[(0, 256 << 10)], MemoryType::File);
    run_remote(
        init.as_ref(),
        TransferRequest::write(first.all(), head.clone(), &tname),
    )
    .unwrap();
    let tail = file_descs(h, &[(1 << 20, 4 << 20)], MemoryType::File);
    let e = run_remote(
        init.as_ref(),
        TransferRequest::write(big.all(), tail, &tname),
    )
    .unwrap_err();
    assert_eq!(
        rejected(&e),
        Some(RejectReason::StorageIo {
            errno: libc::ENOSPC as u16
        }),
        "{e}"
    );
    assert!(e.to_string().contains("No space left on device"), "{e}");
    // The connection carries on.
    run_remote(
        init.as_ref(),
        TransferRequest::read(back.all(), head, &tname),
    )
    .unwrap();
    assert!(back.bytes() == first.bytes(), "earlier data changed");
    drop(init);
    drop(target);
}

#[test]
fn a_durable_write_to_a_peer_leaves_no_dirty_page_behind() {
    const LEN: usize = 1 << 20;
    let dir = tempdir();
    let path = dir.join("f");
    let mut region = None;
    let (target, init) = pair(Backend::Tcp, "durable", |t| {
        region = Some(open_file(t, &path, LEN as u64).1);
    });
    let region = region.unwrap();
    let tname = target.name().to_owned();
    let src = Buf::filled(LEN, 59);
    register(init.as_ref(), &src.all());
    run_remote(
        init.as_ref(),
        TransferRequest::write(src.all(), region.clone(), &tname),
    )
    .unwrap();
    let before = match dirty_pages(&path, LEN) {
        Ok(n) => n,
        Err(why) => {
            println!("SKIPPED a_durable_write_to_a_peer_leaves_no_dirty_page_behind: {why}");
            return;
        }
    };
    run_remote(
        init.as_ref(),
        TransferRequest::write(src.all(), region, &tname).with_durable(),
    )
    .unwrap();
    let after = dirty_pages(&path, LEN).unwrap();
    println!("dirty pages after a plain write to a peer {before}, after a durable one {after}");
    assert_eq!(
        after, 0,
        "a durable write was acknowledged with dirty pages"
    );
    drop(init);
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_peers_block_device_round_trips_and_refuses_misaligned_ranges() {
    let lo = match LoopDev::new(16 << 20) {
        Ok(l) => l,
        Err(why) => {
            println!(
                "SKIPPED a_peers_block_device_round_trips_and_refuses_misaligned_ranges: {why}"
            );
            return;
        }
    };
    let mut h = 0;
    let (target, init) = pair(Backend::Tcp, "blk", |t| {
        h = t.open_storage(&StorageSpec::block(&lo.dev)).unwrap();
        register(t, &file_descs(h, &[(0, 16 << 20)], MemoryType::Blk));
    });
    let tname = target.name().to_owned();
    let src = Buf::filled(3 << 20, 61);
    let back = Buf::new(3 << 20);
    register(init.as_ref(), &src.all());
    register(init.as_ref(), &back.all());
    // One block, and 3 MiB (several bounce-buffer pieces), from unaligned
    // host memory: the target's buffer is the aligned one.
    let one = file_descs(h, &[(8 << 20, 4096)], MemoryType::Blk);
    run_remote(
        init.as_ref(),
        TransferRequest::write(sub(&src, 1, 4096), one, &tname),
    )
    .unwrap();
    assert_eq!(read_direct(&lo.dev, 8 << 20, 4096), &src.bytes()[1..4097]);
    let big = file_descs(h, &[(4096, 3 << 20)], MemoryType::Blk);
    run_remote(
        init.as_ref(),
        TransferRequest::write(src.all(), big.clone(), &tname),
    )
    .unwrap();
    run_remote(
        init.as_ref(),
        TransferRequest::read(back.all(), big, &tname),
    )
    .unwrap();
    assert!(back.bytes() == src.bytes(), "read back differs");
    // Misaligned offset or length: refused by the initiator before anything
    // moves, with the block size the peer exported.
    let align = target
        .local_agent_desc()
        .regions
        .iter()
        .find(|r| r.mem_type == MemoryType::Blk)
        .unwrap()
        .align;
    assert!(align >= 512, "{align}");
    let before = read_direct(&lo.dev, 12 << 20, 8192);
    for (off, len, what) in [(12 << 20 | 100, 4096, "offset"), (12 << 20, 4000, "length")] {
        let local = MemoryDescs::new(
            MemoryType::Dram,
            vec![
                MemoryDesc::new(src.addr(), 4096, 0),
                MemoryDesc::new(src.addr() + 4096, len, 0),
            ],
        );
        let req = TransferRequest::write(
            local,
            file_descs(h, &[(12 << 20, 4096), (off, len)], MemoryType::Blk),
            &tname,
        );
        match init.submit_transfer(&req) {
            Err(Error::Misaligned { what: w, block, .. }) => {
                assert_eq!((w, block), (what, align));
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        read_direct(&lo.dev, 12 << 20, 8192),
        before,
        "nothing written"
    );
    drop(init);
    drop(target);
}
