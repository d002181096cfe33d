//! Storage tiers: FILE regions on a temporary directory and BLK regions on
//! a loop device made by the test, moved to and from host memory by a
//! request to the agent itself, on both I/O engines (`io_uring`, and
//! `pread`/`pwrite`); and (`remote`) a peer's FILE and BLK regions written
//! and read through the peer's agent. Tests that need what this machine cannot make (a
//! loop device, a tmpfs mount, the kernel's page flags) print a SKIPPED
//! line with the reason.

use std::alloc::Layout;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvxfer::{
    AgentConfig, Backend, Error, MemoryDesc, MemoryDescs, MemoryType, StorageIo, StorageSpec,
    TransferAgent, TransferRequest, TransportKind, make_transfer_agent,
};

const WAIT: Duration = Duration::from_secs(120);

#[path = "storage/remote.rs"]
mod remote;

/// A zeroed buffer aligned for direct I/O (4 KiB).
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Buf { ptr, len }
    }

    fn filled(len: usize, seed: u32) -> Self {
        let mut b = Buf::new(len);
        for (i, x) in b.bytes_mut().iter_mut().enumerate() {
            *x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed)
                .to_le_bytes()[1];
        }
        b
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated and initialised (zeroed) in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn all(&self) -> MemoryDescs {
        MemoryDescs::new(
            MemoryType::Dram,
            vec![MemoryDesc::new(self.addr(), self.len as u64, 0)],
        )
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr,
                Layout::from_size_align(self.len.max(1), 4096).unwrap(),
            )
        };
    }
}

/// The engines this machine offers (io_uring only where it starts).
fn engines() -> Vec<StorageIo> {
    let mut v = vec![StorageIo::Psync];
    let probe = agent("probe", StorageIo::IoUring);
    let dir = tempdir();
    match probe.open_storage(&StorageSpec::file(dir.join("probe")).create(4096)) {
        Ok(_) => v.push(StorageIo::IoUring),
        Err(e) => println!("SKIPPED io_uring engine: {e}"),
    }
    drop(probe);
    let _ = std::fs::remove_dir_all(&dir);
    v
}

fn agent(name: &str, io: StorageIo) -> Box<dyn TransferAgent> {
    let cfg = AgentConfig::new(name).with_storage_io(io);
    make_transfer_agent(Backend::Tcp, cfg).unwrap()
}

fn tempdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "kvxfer-storage-{}-{}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .elapsed()
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

/// Opens `path` as a FILE of `size` bytes (created) and registers all of
/// it; its handle and region.
fn open_file(agent: &dyn TransferAgent, path: &Path, size: u64) -> (u32, MemoryDescs) {
    let h = agent
        .open_storage(&StorageSpec::file(path).create(size))
        .unwrap();
    let region = file_descs(h, &[(0, size)], MemoryType::File);
    register(agent, &region);
    (h, region)
}

/// Registers `descs` with `agent`.
fn register(agent: &dyn TransferAgent, descs: &MemoryDescs) {
    // SAFETY: every host buffer registered here outlives its agent (declared
    // before it); storage descriptors name file ranges, not memory.
    unsafe { agent.register_memory(descs).unwrap() };
}

fn file_descs(handle: u32, pieces: &[(u64, u64)], mem_type: MemoryType) -> MemoryDescs {
    MemoryDescs::new(
        mem_type,
        pieces
            .iter()
            .map(|&(off, len)| MemoryDesc::new(off, len, handle))
            .collect(),
    )
}

fn run(agent: &dyn TransferAgent, req: TransferRequest) -> Result<(), Error> {
    let st = agent.submit_transfer(&req)?;
    st.wait_success(WAIT)?;
    assert_eq!(st.data_path().transport, TransportKind::Storage);
    Ok(())
}

fn write(agent: &dyn TransferAgent, local: MemoryDescs, remote: MemoryDescs) -> Result<(), Error> {
    let me = agent.name().to_owned();
    run(agent, TransferRequest::write(local, remote, me))
}

fn read(agent: &dyn TransferAgent, local: MemoryDescs, remote: MemoryDescs) -> Result<(), Error> {
    let me = agent.name().to_owned();
    run(agent, TransferRequest::read(local, remote, me))
}

/// `len` bytes at `off` of `buf` as one host descriptor.
fn sub(buf: &Buf, off: u64, len: u64) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Dram,
        vec![MemoryDesc::new(buf.addr() + off, len, 0)],
    )
}

/// `n` host descriptors of `piece` bytes, back to back from the start of `b`.
fn pieces(b: &Buf, n: usize, piece: u64) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Dram,
        (0..n)
            .map(|i| MemoryDesc::new(b.addr() + i as u64 * piece, piece, 0))
            .collect(),
    )
}

/// Storage descriptors of `piece` bytes: piece `i` at even slot `perm[i]`
/// of file `h` (the odd slots stay untouched).
fn even_slots(h: u32, perm: &[usize], piece: u64) -> MemoryDescs {
    file_descs(
        h,
        &perm
            .iter()
            .map(|&p| (2 * p as u64 * piece, piece))
            .collect::<Vec<_>>(),
        MemoryType::File,
    )
}

/// A deterministic permutation of `0..n`.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut s = seed | 1;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.swap(i, (s % (i as u64 + 1)) as usize);
    }
    v
}

#[test]
fn one_byte_round_trip_through_a_file() {
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled(4096, 1);
        let back = Buf::new(4096);
        let a = agent("one-byte", io);
        let (h, _) = open_file(a.as_ref(), &dir.join("f"), 4096);
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &back.all());
        write(
            a.as_ref(),
            sub(&src, 5, 1),
            file_descs(h, &[(7, 1)], MemoryType::File),
        )
        .unwrap();
        let on_disk = std::fs::read(dir.join("f")).unwrap();
        assert_eq!(on_disk[7], src.bytes()[5], "{io:?}");
        assert!(on_disk.iter().enumerate().all(|(i, &b)| i == 7 || b == 0));
        read(
            a.as_ref(),
            sub(&back, 100, 1),
            file_descs(h, &[(7, 1)], MemoryType::File),
        )
        .unwrap();
        assert_eq!(back.bytes()[100], src.bytes()[5]);
        assert!(
            back.bytes()
                .iter()
                .enumerate()
                .all(|(i, &b)| i == 100 || b == 0)
        );
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn scattered_64k_pieces_land_where_described() {
    const PIECE: u64 = 64 << 10;
    const N: usize = 256;
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled(N * PIECE as usize, 7);
        let back = Buf::new(N * PIECE as usize);
        let a = agent("scatter", io);
        let h = a
            .open_storage(&StorageSpec::file(dir.join("f")).create(2 * N as u64 * PIECE))
            .unwrap();
        register(
            a.as_ref(),
            &file_descs(h, &[(0, 2 * N as u64 * PIECE)], MemoryType::File),
        );
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &back.all());
        // Piece i of memory goes to slot perm[i] of the file's even slots.
        let perm = shuffled(N, 42);
        let local = |b: &Buf| pieces(b, N, PIECE);
        let remote = even_slots(h, &perm, PIECE);
        write(a.as_ref(), local(&src), remote.clone()).unwrap();
        let on_disk = std::fs::read(dir.join("f")).unwrap();
        for (i, &p) in perm.iter().enumerate() {
            let at = 2 * p * PIECE as usize;
            assert_eq!(
                &on_disk[at..at + PIECE as usize],
                &src.bytes()[i * PIECE as usize..(i + 1) * PIECE as usize],
                "{io:?}: piece {i}"
            );
            assert!(
                on_disk[at + PIECE as usize..at + 2 * PIECE as usize]
                    .iter()
                    .all(|&b| b == 0)
            );
        }
        read(a.as_ref(), local(&back), remote).unwrap();
        assert!(back.bytes() == src.bytes(), "{io:?}: read back differs");
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_request_to_several_files_lands_in_each_split_among_the_workers() {
    // 16 MiB over four files, durable: large enough that the page-cache
    // workers take it in parts, a file each (and the READ back in parts of
    // consecutive pieces).
    const LEN: u64 = 4 << 20;
    const FILES: usize = 4;
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled(FILES * LEN as usize, 23);
        let back = Buf::new(FILES * LEN as usize);
        let a = agent("files", io);
        let handles: Vec<u32> = (0..FILES)
            .map(|i| open_file(a.as_ref(), &dir.join(format!("f{i}")), LEN).0)
            .collect();
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &back.all());
        // File i takes the i-th quarter, in four pieces given in turn.
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for q in 0..4u64 {
            for (i, &h) in handles.iter().enumerate() {
                let off = i as u64 * LEN + q * LEN / 4;
                local.push(MemoryDesc::new(src.addr() + off, LEN / 4, 0));
                remote.push(MemoryDesc::new(q * LEN / 4, LEN / 4, h));
            }
        }
        let local = MemoryDescs::new(MemoryType::Dram, local);
        let remote = MemoryDescs::new(MemoryType::File, remote);
        let me = a.name().to_owned();
        run(
            a.as_ref(),
            TransferRequest::write(local.clone(), remote.clone(), me).with_durable(),
        )
        .unwrap();
        for i in 0..FILES {
            let path = dir.join(format!("f{i}"));
            let on_disk = std::fs::read(&path).unwrap();
            let want = &src.bytes()[i * LEN as usize..(i + 1) * LEN as usize];
            assert!(on_disk == want, "{io:?}: file {i}");
            if let Ok(n) = dirty_pages(&path, LEN as usize) {
                assert_eq!(n, 0, "{io:?}: file {i} not synced");
            }
        }
        let back_local = MemoryDescs::new(
            MemoryType::Dram,
            local
                .descs
                .iter()
                .map(|d| MemoryDesc::new(d.addr - src.addr() + back.addr(), d.len, 0))
                .collect(),
        );
        read(a.as_ref(), back_local, remote).unwrap();
        assert!(back.bytes() == src.bytes(), "{io:?}: read back differs");
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn one_gib_round_trip_is_element_exact() {
    const LEN: u64 = 1 << 30;
    // One engine is enough for the size (both move the small cases above).
    let io = *engines().last().unwrap();
    let dir = tempdir();
    let src = Buf::filled(LEN as usize, 3);
    let back = Buf::new(LEN as usize);
    let a = agent("gib", io);
    let (_, region) = open_file(a.as_ref(), &dir.join("f"), LEN);
    register(a.as_ref(), &src.all());
    register(a.as_ref(), &back.all());
    write(a.as_ref(), src.all(), region.clone()).unwrap();
    read(a.as_ref(), back.all(), region).unwrap();
    assert!(
        back.bytes() == src.bytes(),
        "{io:?}: 1 GiB read back differs"
    );
    drop(a);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sync_message_follows_the_data_into_the_agents_own_inbox() {
    let io = *engines().last().unwrap();
    let dir = tempdir();
    let src = Buf::filled(8192, 9);
    let a = agent("notify", io);
    let (_, region) = open_file(a.as_ref(), &dir.join("f"), 8192);
    register(a.as_ref(), &src.all());
    let req =
        TransferRequest::write(src.all(), region, "notify").with_sync_message(b"landed".to_vec());
    let st = a.submit_transfer(&req).unwrap();
    st.wait_success(WAIT).unwrap();
    let msgs = a.take_sync_messages();
    assert_eq!(
        msgs.get("notify").map(Vec::as_slice),
        Some(&[b"landed".to_vec()][..])
    );
    assert_eq!(std::fs::read(dir.join("f")).unwrap(), src.bytes());
    drop(a);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_storage_requests_are_typed_errors_and_change_nothing() {
    let io = *engines().last().unwrap();
    let dir = tempdir();
    let src = Buf::filled(16384, 5);
    let a = agent("bad", io);
    let h = a
        .open_storage(&StorageSpec::file(dir.join("f")).create(8192))
        .unwrap();
    register(a.as_ref(), &src.all());
    // A region past the end of the file, or on no open handle: refused.
    let past = file_descs(h, &[(4096, 8192)], MemoryType::File);
    // SAFETY: storage descriptors name file ranges.
    let e = unsafe { a.register_memory(&past) }.unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    let nowhere = file_descs(h + 99, &[(0, 4096)], MemoryType::File);
    // SAFETY: as above.
    let e = unsafe { a.register_memory(&nowhere) }.unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    // The handle is a FILE: BLK descriptors of it are refused.
    let wrong = file_descs(h, &[(0, 4096)], MemoryType::Blk);
    // SAFETY: as above.
    let e = unsafe { a.register_memory(&wrong) }.unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    let region = file_descs(h, &[(0, 8192)], MemoryType::File);
    register(a.as_ref(), &region);
    // A range outside the registered region: refused, nothing written.
    let e = write(
        a.as_ref(),
        sub(&src, 0, 4096),
        file_descs(h, &[(6144, 4096)], MemoryType::File),
    )
    .unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    // Host memory not registered: refused.
    let stray = Buf::new(4096);
    let e = write(
        a.as_ref(),
        stray.all(),
        file_descs(h, &[(0, 4096)], MemoryType::File),
    )
    .unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    assert!(
        std::fs::read(dir.join("f"))
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    // A peer's request naming storage the agent did not register (another
    // handle) is refused before anything is sent (a peer's requests to
    // registered storage: `remote`).
    let peer = agent("bad-peer", io);
    let peer_src = Buf::filled(4096, 6);
    register(peer.as_ref(), &peer_src.all());
    peer.load_remote_agent(&a.local_agent_desc()).unwrap();
    let e = peer
        .submit_transfer(&TransferRequest::write(
            peer_src.all(),
            file_descs(h + 1, &[(0, 4096)], MemoryType::File),
            "bad",
        ))
        .unwrap_err();
    assert!(matches!(e, Error::RemoteRangeNotExported { .. }), "{e}");
    drop(peer);
    assert!(
        std::fs::read(dir.join("f"))
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    // Closing storage with registered regions is refused; after
    // deregistering, it closes.
    assert!(matches!(a.close_storage(h), Err(Error::InvalidRequest(_))));
    a.deregister_memory(&region).unwrap();
    a.close_storage(h).unwrap();

    drop(a);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An adopted descriptor keeps its mode, on every engine: one opened
/// through the page cache takes scattered, unaligned pieces both ways
/// (its writes go to the page-cache writer); one opened with `O_DIRECT`
/// has a misaligned offset refused, typed, before anything moves, and
/// round-trips aligned pieces.
#[test]
fn an_adopted_descriptor_keeps_its_mode() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempdir();
    for io in engines() {
        let a = agent("adopter", io);
        let src = Buf::filled(64 << 10, 7);
        let back = Buf::new(64 << 10);
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &back.all());
        // Through the page cache.
        let path = dir.join(format!("buffered-{io:?}"));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let h = a.adopt_storage(f.into()).unwrap();
        register(
            a.as_ref(),
            &file_descs(h, &[(0, 1 << 20)], MemoryType::File),
        );
        let pieces = [(3u64, 1000u64), (5000, 20_000), (40_001, 7)];
        let remote = file_descs(h, &pieces, MemoryType::File);
        let local = |b: &Buf| {
            MemoryDescs::new(
                MemoryType::Dram,
                pieces
                    .iter()
                    .map(|&(o, l)| MemoryDesc::new(b.addr() + o, l, 0))
                    .collect(),
            )
        };
        write(a.as_ref(), local(&src), remote.clone()).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        for &(o, l) in &pieces {
            let (o, l) = (o as usize, l as usize);
            assert_eq!(on_disk[o..o + l], src.bytes()[o..o + l], "{io:?}");
        }
        read(a.as_ref(), local(&back), remote).unwrap();
        for &(o, l) in &pieces {
            let (o, l) = (o as usize, l as usize);
            assert_eq!(back.bytes()[o..o + l], src.bytes()[o..o + l], "{io:?}");
        }
        // With O_DIRECT, where the filesystem has it.
        let path = dir.join(format!("direct-{io:?}"));
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path);
        let Ok(f) = direct else {
            println!(
                "SKIPPED O_DIRECT adoption: {} refuses O_DIRECT",
                dir.display()
            );
            continue;
        };
        let h = a.adopt_storage(f.into()).unwrap();
        register(
            a.as_ref(),
            &file_descs(h, &[(0, 1 << 20)], MemoryType::File),
        );
        let e = write(
            a.as_ref(),
            sub(&src, 0, 4096),
            file_descs(h, &[(100, 4096)], MemoryType::File),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Misaligned { .. }), "{io:?}: {e}");
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            0,
            "{io:?}: something moved"
        );
        let aligned = file_descs(h, &[(8192, 16384)], MemoryType::File);
        write(a.as_ref(), sub(&src, 4096, 16384), aligned.clone()).unwrap();
        read(a.as_ref(), sub(&back, 0, 16384), aligned).unwrap();
        assert_eq!(back.bytes()[..16384], src.bytes()[4096..20480], "{io:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_truncated_under_its_region_fails_the_next_transfer() {
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled(8192, 11);
        let back = Buf::new(8192);
        let a = agent("trunc", io);
        let path = dir.join("f");
        let h = a
            .open_storage(&StorageSpec::file(&path).create(8192))
            .unwrap();
        let region = file_descs(h, &[(0, 8192)], MemoryType::File);
        register(a.as_ref(), &region);
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &back.all());
        write(a.as_ref(), src.all(), region.clone()).unwrap();
        // Someone else truncates the file to 4 KiB.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = read(a.as_ref(), back.all(), region.clone()).unwrap_err();
        match &e {
            Error::Storage { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
                assert!(e.to_string().contains("truncated"), "{e}");
            }
            other => panic!("{io:?}: {other}"),
        }
        assert!(back.bytes().iter().all(|&b| b == 0), "nothing read");
        let e = write(a.as_ref(), src.all(), region).unwrap_err();
        assert!(matches!(e, Error::Storage { .. }), "{e}");
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            4096,
            "not grown back"
        );
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_file_opened_to_grow_takes_writes_past_its_end_and_refuses_reads_there() {
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled(16384, 21);
        let back = Buf::new(16384);
        let a = agent("grow", io);
        let path = dir.join("f");
        std::fs::File::create(&path).unwrap();
        // Not opened to grow: a range past the end is refused at registration.
        let h = a.open_storage(&StorageSpec::file(&path)).unwrap();
        let region = file_descs(h, &[(0, 16384)], MemoryType::File);
        // SAFETY: a storage range, not memory.
        let e = unsafe { a.register_memory(&region) }.unwrap_err();
        assert!(matches!(e, Error::InvalidDescriptor { .. }), "{io:?}: {e}");
        a.close_storage(h).unwrap();
        let h = a
            .open_storage(&StorageSpec::file(&path).grow(true))
            .unwrap();
        let region = file_descs(h, &[(0, 16384)], MemoryType::File);
        register(a.as_ref(), &region);
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &back.all());
        // A WRITE at 8 KiB of the empty file extends it to 12 KiB.
        write(
            a.as_ref(),
            sub(&src, 0, 4096),
            file_descs(h, &[(8192, 4096)], MemoryType::File),
        )
        .unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 12288, "{io:?}");
        // The hole before it reads as zeros; the written part reads back.
        read(
            a.as_ref(),
            sub(&back, 0, 12288),
            file_descs(h, &[(0, 12288)], MemoryType::File),
        )
        .unwrap();
        assert!(back.bytes()[..8192].iter().all(|&b| b == 0));
        assert_eq!(&back.bytes()[8192..12288], &src.bytes()[..4096]);
        // A READ past the end: refused before anything moves.
        let before = back.bytes().to_vec();
        let e = read(
            a.as_ref(),
            sub(&back, 0, 8192),
            file_descs(h, &[(8192, 8192)], MemoryType::File),
        )
        .unwrap_err();
        match &e {
            Error::Storage { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
            }
            other => panic!("{io:?}: {other}"),
        }
        assert_eq!(back.bytes(), &before[..], "nothing read");
        // Outside the registered range stays refused.
        let e = write(
            a.as_ref(),
            sub(&src, 0, 4096),
            file_descs(h, &[(16384, 4096)], MemoryType::File),
        )
        .unwrap_err();
        assert!(matches!(e, Error::NotRegistered { .. }), "{io:?}: {e}");
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A tmpfs of `size` bytes mounted on a new directory; unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(size: u64) -> Result<Self, String> {
        let dir = tempdir();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_full_disk_is_a_typed_enospc_and_earlier_data_stays() {
    const FS: u64 = 1 << 20;
    let fs = match Tmpfs::mount(FS) {
        Ok(f) => f,
        Err(why) => {
            println!("SKIPPED a_full_disk_is_a_typed_enospc_and_earlier_data_stays: {why}");
            return;
        }
    };
    for io in engines() {
        let path = fs.0.join(format!("f-{io:?}"));
        let first = Buf::filled(256 << 10, 13);
        let big = Buf::filled(4 << 20, 17);
        let back = Buf::new(256 << 10);
        let a = agent("full", io);
        // A sparse 8 MiB file on a 1 MiB filesystem.
        let h = a
            .open_storage(&StorageSpec::file(&path).create(8 << 20))
            .unwrap();
        let region = file_descs(h, &[(0, 8 << 20)], MemoryType::File);
        register(a.as_ref(), &region);
        register(a.as_ref(), &first.all());
        register(a.as_ref(), &big.all());
        register(a.as_ref(), &back.all());
        let head = file_descs(h, &[(0, 256 << 10)], MemoryType::File);
        write(a.as_ref(), first.all(), head.clone()).unwrap();
        let e = write(
            a.as_ref(),
            big.all(),
            file_descs(h, &[(1 << 20, 4 << 20)], MemoryType::File),
        )
        .unwrap_err();
        match &e {
            Error::Storage { source, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{io:?}: {e}")
            }
            other => panic!("{io:?}: {other}"),
        }
        read(a.as_ref(), back.all(), head).unwrap();
        assert!(
            back.bytes() == first.bytes(),
            "{io:?}: earlier data changed"
        );
        drop(a);
        std::fs::remove_file(&path).unwrap();
    }
}

/// Pages of `path`'s first `len` bytes that the kernel holds dirty (not
/// yet written to the device), read from the page flags of a mapping; an
/// error where this machine does not expose them.
fn dirty_pages(path: &Path, len: usize) -> Result<usize, String> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    // SAFETY: a fresh shared read-only mapping of an open file.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().to_string());
    }
    let page = 4096;
    let mut sum = 0u64;
    for p in (0..len).step_by(page) {
        // SAFETY: inside the mapping; faults the page in.
        sum += u64::from(unsafe { std::ptr::read_volatile((map as *const u8).add(p)) });
    }
    std::hint::black_box(sum);
    let mut pagemap = std::fs::File::open("/proc/self/pagemap").map_err(|e| e.to_string())?;
    let mut flags =
        std::fs::File::open("/proc/kpageflags").map_err(|e| format!("/proc/kpageflags: {e}"))?;
    let mut dirty = 0;
    for p in (0..len).step_by(page) {
        let vpn = (map as usize + p) / page;
        let mut e = [0u8; 8];
        pagemap
            .seek(SeekFrom::Start(vpn as u64 * 8))
            .map_err(|e| e.to_string())?;
        pagemap.read_exact(&mut e).map_err(|e| e.to_string())?;
        let e = u64::from_le_bytes(e);
        let pfn = e & ((1 << 55) - 1);
        if e >> 63 == 0 || pfn == 0 {
            // SAFETY: the mapping made above.
            unsafe { libc::munmap(map, len) };
            return Err("page frame numbers are hidden (needs CAP_SYS_ADMIN)".into());
        }
        let mut k = [0u8; 8];
        flags
            .seek(SeekFrom::Start(pfn * 8))
            .map_err(|e| e.to_string())?;
        flags.read_exact(&mut k).map_err(|e| e.to_string())?;
        // KPF_DIRTY is bit 4.
        if u64::from_le_bytes(k) & (1 << 4) != 0 {
            dirty += 1;
        }
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(map, len) };
    Ok(dirty)
}

#[test]
fn a_durable_write_leaves_no_dirty_page_behind() {
    const LEN: usize = 1 << 20;
    for io in engines() {
        let dir = tempdir();
        let path = dir.join("f");
        let src = Buf::filled(LEN, 19);
        let a = agent("durable", io);
        let h = a
            .open_storage(&StorageSpec::file(&path).create(LEN as u64))
            .unwrap();
        let region = file_descs(h, &[(0, LEN as u64)], MemoryType::File);
        register(a.as_ref(), &region);
        register(a.as_ref(), &src.all());
        let me = a.name().to_owned();
        // Not durable: the pages are (normally) still dirty in the cache.
        run(
            a.as_ref(),
            TransferRequest::write(src.all(), region.clone(), me.clone()),
        )
        .unwrap();
        let before = match dirty_pages(&path, LEN) {
            Ok(n) => n,
            Err(why) => {
                println!("SKIPPED a_durable_write_leaves_no_dirty_page_behind: {why}");
                return;
            }
        };
        run(
            a.as_ref(),
            TransferRequest::write(src.all(), region, me).with_durable(),
        )
        .unwrap();
        let after = dirty_pages(&path, LEN).unwrap();
        println!("{io:?}: dirty pages after a plain write {before}, after a durable one {after}");
        assert_eq!(
            after, 0,
            "{io:?}: a durable write completed with dirty pages"
        );
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A loop device over a sparse file of `size` bytes; detached on drop.
struct LoopDev {
    dev: PathBuf,
    dir: PathBuf,
}

impl LoopDev {
    fn new(size: u64) -> Result<Self, String> {
        let dir = tempdir();
        let img = dir.join("img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(size))
            .map_err(|e| e.to_string())?;
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&img)
            .output()
            .map_err(|e| format!("losetup: {e}"))?;
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(format!(
                "losetup: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Ok(LoopDev { dev, dir })
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads `len` bytes at `off` of a device, bypassing the page cache.
fn read_direct(dev: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap();
    let mut b = Buf::new(len);
    f.read_exact_at(b.bytes_mut(), off).unwrap();
    b.bytes().to_vec()
}

#[test]
fn block_device_round_trips_and_refuses_misaligned_ranges() {
    let lo = match LoopDev::new(64 << 20) {
        Ok(l) => l,
        Err(why) => {
            println!("SKIPPED block_device_round_trips_and_refuses_misaligned_ranges: {why}");
            return;
        }
    };
    for io in engines() {
        let a = agent("blk", io);
        let h = a.open_storage(&StorageSpec::block(&lo.dev)).unwrap();
        let region = file_descs(h, &[(0, 64 << 20)], MemoryType::Blk);
        register(a.as_ref(), &region);
        // One block.
        let one = Buf::filled(4096, 21);
        let back = Buf::new(4096);
        register(a.as_ref(), &one.all());
        register(a.as_ref(), &back.all());
        write(
            a.as_ref(),
            one.all(),
            file_descs(h, &[(8192, 4096)], MemoryType::Blk),
        )
        .unwrap();
        assert_eq!(read_direct(&lo.dev, 8192, 4096), one.bytes(), "{io:?}");
        read(
            a.as_ref(),
            back.all(),
            file_descs(h, &[(8192, 4096)], MemoryType::Blk),
        )
        .unwrap();
        assert!(back.bytes() == one.bytes());
        // 64 KiB x 256, scattered over the device.
        const PIECE: u64 = 64 << 10;
        let src = Buf::filled(256 * PIECE as usize, 23);
        let got = Buf::new(256 * PIECE as usize);
        register(a.as_ref(), &src.all());
        register(a.as_ref(), &got.all());
        let perm = shuffled(256, 7);
        let local = |b: &Buf| {
            MemoryDescs::new(
                MemoryType::Dram,
                (0..256)
                    .map(|i| MemoryDesc::new(b.addr() + i as u64 * PIECE, PIECE, 0))
                    .collect(),
            )
        };
        let remote = file_descs(
            h,
            &perm
                .iter()
                .map(|&p| ((1 << 20) + p as u64 * PIECE, PIECE))
                .collect::<Vec<_>>(),
            MemoryType::Blk,
        );
        write(a.as_ref(), local(&src), remote.clone()).unwrap();
        read(a.as_ref(), local(&got), remote).unwrap();
        assert!(
            got.bytes() == src.bytes(),
            "{io:?}: scattered BLK round trip differs"
        );
        // Misaligned offset, length, and memory address: typed, nothing
        // written.
        let before = read_direct(&lo.dev, 0, 16384);
        for (local, off, len, what) in [
            (sub(&one, 0, 512), 100, 512, "offset"),
            (sub(&one, 0, 100), 0, 100, "length"),
            (sub(&one, 1, 512), 0, 512, "memory address"),
        ] {
            let e = write(
                a.as_ref(),
                local,
                file_descs(h, &[(off, len)], MemoryType::Blk),
            )
            .unwrap_err();
            match e {
                Error::Misaligned { what: w, .. } => assert_eq!(w, what, "{io:?}"),
                other => panic!("{io:?}: {other}"),
            }
        }
        assert_eq!(
            read_direct(&lo.dev, 0, 16384),
            before,
            "{io:?}: misaligned write changed the device"
        );
        // A misaligned region is refused at registration.
        // SAFETY: storage descriptors name device ranges.
        let e = unsafe { a.register_memory(&file_descs(h, &[(100, 4096)], MemoryType::Blk)) }
            .unwrap_err();
        assert!(matches!(e, Error::Misaligned { .. }), "{e}");
        drop(a);
    }
}

#[test]
fn a_kv_pool_offloads_to_a_file_and_comes_back_exactly() {
    use kvxfer::cache::pattern::{check_block, fill_block};
    use kvxfer::cache::{Attention, CacheState, DataType, rank_slice};
    let io = *engines().last().unwrap();
    let dir = tempdir();
    // Llama-3-8B-like, generation side TP1: 32 layers, 8 KV heads of 128,
    // 16 tokens a block, 64 blocks.
    let state = CacheState::new(32, 8, 128, 16, DataType::Bf16, Attention::Default, 1, 1);
    state.validate().unwrap();
    let slice = rank_slice(&state, 0, 8);
    let bb = slice.block_bytes() as usize;
    const BLOCKS: u32 = 64;
    let mut pool = Buf::new(bb * BLOCKS as usize);
    for b in 0..BLOCKS {
        fill_block(
            &state,
            &slice,
            &mut pool.bytes_mut()[b as usize * bb..(b as usize + 1) * bb],
            b,
        );
    }
    let other = Buf::new(bb * BLOCKS as usize);
    let a = agent("offload", io);
    let h = a
        .open_storage(&StorageSpec::file(dir.join("kv")).create(bb as u64 * u64::from(BLOCKS)))
        .unwrap();
    let region = file_descs(h, &[(0, bb as u64 * u64::from(BLOCKS))], MemoryType::File);
    register(a.as_ref(), &region);
    register(a.as_ref(), &pool.all());
    register(a.as_ref(), &other.all());
    // Blocks offloaded in a scattered order (as an eviction would), then
    // loaded into the other pool at the same block index.
    let order = shuffled(BLOCKS as usize, 99);
    let blocks = |b: &Buf| {
        MemoryDescs::new(
            MemoryType::Dram,
            order
                .iter()
                .map(|&i| MemoryDesc::new(b.addr() + (i * bb) as u64, bb as u64, 0))
                .collect(),
        )
    };
    let slots = file_descs(
        h,
        &(0..BLOCKS as usize)
            .map(|k| ((k * bb) as u64, bb as u64))
            .collect::<Vec<_>>(),
        MemoryType::File,
    );
    write(a.as_ref(), blocks(&pool), slots.clone()).unwrap();
    read(a.as_ref(), blocks(&other), slots).unwrap();
    for b in 0..BLOCKS {
        let blk = &other.bytes()[b as usize * bb..(b as usize + 1) * bb];
        if let Some(m) = check_block(&state, &slice, blk, b, BLOCKS * 16) {
            panic!("block {b}: {m}");
        }
    }
    drop(a);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn host_regions_come_and_go_between_storage_transfers() {
    // More host regions, each used with storage then deregistered, than
    // the io_uring engine has registered-buffer slots: each one's slot is
    // given back, and every transfer moves the right bytes.
    for io in engines() {
        let dir = tempdir();
        let a = agent("churn", io);
        let (_, region) = open_file(a.as_ref(), &dir.join("f"), 4096);
        for round in 0..300u32 {
            let src = Buf::filled(4096, round);
            register(a.as_ref(), &src.all());
            write(a.as_ref(), src.all(), region.clone()).unwrap();
            a.deregister_memory(&src.all()).unwrap();
            let back = Buf::new(4096);
            register(a.as_ref(), &back.all());
            read(a.as_ref(), back.all(), region.clone()).unwrap();
            assert!(back.bytes() == src.bytes(), "{io:?}: round {round}");
            a.deregister_memory(&back.all()).unwrap();
        }
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn dropping_the_agent_waits_for_its_storage_transfers() {
    // A large write still running when the agent is dropped: the drop
    // returns only once nothing touches the memory or the file any more,
    // and the status then holds the outcome.
    const LEN: u64 = 256 << 20;
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled(LEN as usize, 29);
        let a = agent("drop", io);
        let (h, _) = open_file(a.as_ref(), &dir.join("f"), LEN);
        register(a.as_ref(), &src.all());
        // 256 pieces of 1 MiB, more than the ring's 256 entries can hold
        // with its wake-up read.
        let local = MemoryDescs::new(
            MemoryType::Dram,
            (0..256)
                .map(|i| MemoryDesc::new(src.addr() + i * (1 << 20), 1 << 20, 0))
                .collect(),
        );
        let remote = file_descs(
            h,
            &(0..256)
                .map(|i| (i * (1 << 20), 1 << 20))
                .collect::<Vec<_>>(),
            MemoryType::File,
        );
        let st = a
            .submit_transfer(&TransferRequest::write(local, remote, "drop"))
            .unwrap();
        drop(a);
        assert!(
            st.is_completed(),
            "{io:?}: the drop returned before the write finished"
        );
        st.wait_success(Duration::ZERO).unwrap();
        assert!(
            std::fs::read(dir.join("f")).unwrap() == src.bytes(),
            "{io:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn an_aborted_storage_transfer_quiesces_and_delivers_no_message() {
    const PIECE: u64 = 4096;
    const N: u64 = 16384;
    for io in engines() {
        let dir = tempdir();
        let src = Buf::filled((N * PIECE) as usize, 67);
        let a = agent("abort", io);
        let (h, _) = open_file(a.as_ref(), &dir.join("f"), N * PIECE);
        register(a.as_ref(), &src.all());
        // 16384 pieces of 4 KiB, in reverse order: many ops, most of them
        // still waiting for the kernel when the abort comes.
        let local = MemoryDescs::new(
            MemoryType::Dram,
            (0..N)
                .map(|i| MemoryDesc::new(src.addr() + i * PIECE, PIECE, 0))
                .collect(),
        );
        let remote = file_descs(
            h,
            &(0..N).rev().map(|i| (i * PIECE, PIECE)).collect::<Vec<_>>(),
            MemoryType::File,
        );
        let req = TransferRequest::write(local, remote, "abort").with_sync_message(b"m".to_vec());
        let st = a.submit_transfer(&req).unwrap();
        let asked = st.abort();
        let outcome = st.wait(WAIT);
        // Quiet once it reports: the memory can go at once.
        a.deregister_memory(&src.all()).unwrap();
        let msgs = a.take_sync_messages();
        let on_disk = std::fs::read(dir.join("f")).unwrap();
        let landed = (0..N as usize)
            .filter(|&i| {
                let at = (N as usize - 1 - i) * PIECE as usize;
                let piece = &on_disk[at..at + PIECE as usize];
                let want = &src.bytes()[i * PIECE as usize..(i + 1) * PIECE as usize];
                assert!(
                    piece == want || piece.iter().all(|&b| b == 0),
                    "{io:?}: piece {i} is neither written nor untouched"
                );
                piece == want
            })
            .count();
        match outcome {
            Err(Error::Aborted) => {
                assert!(asked);
                assert!(
                    msgs.is_empty(),
                    "{io:?}: an aborted request's message arrived"
                );
                println!("{io:?}: aborted with {landed} of {N} pieces written");
            }
            Ok(kvxfer::TransferState::Completed) => {
                // Everything was under way before the abort: as usual.
                assert_eq!(landed, N as usize, "{io:?}");
                assert_eq!(msgs.get("abort").map(Vec::len), Some(1), "{io:?}");
                println!("{io:?}: completed before the abort took effect");
            }
            other => panic!("{io:?}: {other:?}"),
        }
        drop(a);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// OBJ ranges need an open object (tests/obj.rs moves data to a real S3
/// server, its own and a peer's): registering one whose handle is no open
/// object, and a request naming the objects of an agent never loaded, are
/// typed errors that register and move nothing.
#[test]
fn object_ranges_without_an_open_object_are_refused_typed() {
    let a = agent("obj", StorageIo::Auto);
    let src = Buf::filled(4096, 3);
    register(a.as_ref(), &src.all());
    let obj = file_descs(1, &[(0, 4096)], MemoryType::Obj);
    // SAFETY: an OBJ descriptor names no memory; it is refused.
    let e = unsafe { a.register_memory(&obj) }.unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    let e = a
        .submit_transfer(&TransferRequest::write(src.all(), obj, "another-agent"))
        .unwrap_err();
    assert!(matches!(e, Error::UnknownAgent(_)), "{e}");
}
