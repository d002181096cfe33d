//! Object storage (OBJ regions) against a real S3 server: the RADOS
//! Gateway of a one-node Ceph cluster that `ci/s3-server.sh` starts
//! (`ci/test.sh` runs this suite with its environment). Without
//! `KVXFER_S3_ENDPOINT` every test prints a SKIPPED line.
//!
//! Covered: single PUTs and multipart uploads (parts in parallel), ranged
//! reads split into parallel parts, the sync message, typed errors (no
//! bucket, no key, a range past the end, wrong credentials, an unreachable
//! store, a full bucket quota), requests refused before anything is sent,
//! and a store that dies in the middle of a transfer (a proxy in front of
//! the gateway that drops every connection and stops listening): the
//! request fails, the old object stays, and nothing changes in a READ's
//! destination after the outcome.

use std::alloc::Layout;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvxfer::storage::obj::{ObjErrorKind, ObjectStore, ObjectStoreConfig};
use kvxfer::{
    AgentConfig, Backend, Error, MemoryDesc, MemoryDescs, MemoryType, RejectReason, TransferAgent,
    TransferRequest, TransportKind, make_transfer_agent,
};

const WAIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

/// Host memory for the tests.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by the test.
unsafe impl Send for Buf {}
// SAFETY: as above; readers only read.
unsafe impl Sync for Buf {}

impl Buf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Buf { ptr, len }
    }

    fn filled(len: usize, seed: u32) -> Self {
        let b = Buf::new(len);
        // SAFETY: `len` bytes allocated in `new`, owned here.
        let s = unsafe { std::slice::from_raw_parts_mut(b.ptr, len) };
        for (i, x) in s.iter_mut().enumerate() {
            *x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed)
                .to_le_bytes()[2];
        }
        b
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated and initialised in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn desc(&self, off: u64, len: u64) -> MemoryDesc {
        assert!(off + len <= self.len as u64);
        MemoryDesc::new(self.ptr as u64 + off, len, 0)
    }

    fn all(&self) -> MemoryDescs {
        MemoryDescs::new(MemoryType::Dram, vec![self.desc(0, self.len as u64)])
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

/// The server's endpoint, or a SKIPPED line.
fn endpoint(test: &str) -> Option<String> {
    match std::env::var("KVXFER_S3_ENDPOINT") {
        Ok(e) if !e.is_empty() => Some(e),
        _ => {
            println!(
                "SKIPPED {test}: no S3 server (KVXFER_S3_ENDPOINT unset; ci/test.sh starts one \
                 with ci/s3-server.sh)"
            );
            None
        }
    }
}

fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{prefix}-{}-{t:x}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A configuration for a fresh bucket at `endpoint`, credentials from the
/// environment, 5 MiB parts.
fn config(endpoint: &str, bucket: &str) -> ObjectStoreConfig {
    let mut c = ObjectStoreConfig::from_env(bucket).unwrap();
    c.endpoint = endpoint.to_owned();
    c.part_size = 5 * MIB;
    c.timeout = Duration::from_secs(60);
    c
}

/// A store with a new bucket.
fn store(endpoint: &str, test: &str) -> ObjectStore {
    let s = config(endpoint, &unique(test)).build().unwrap();
    s.create_bucket().unwrap();
    s
}

fn agent(name: &str) -> Box<dyn TransferAgent> {
    make_transfer_agent(Backend::Tcp, AgentConfig::new(unique(name))).unwrap()
}

/// Opens `key` and registers `[0, len)` of it; its handle.
fn object(a: &dyn TransferAgent, s: &ObjectStore, key: &str, len: u64) -> u32 {
    let h = a.open_object(s, key).unwrap();
    register(a, &obj(h, &[(0, len)]));
    h
}

fn register(a: &dyn TransferAgent, d: &MemoryDescs) {
    // SAFETY: every buffer registered here outlives its agent (made before
    // it) or is deregistered first; OBJ descriptors name no memory.
    unsafe { a.register_memory(d).unwrap() };
}

fn obj(h: u32, pieces: &[(u64, u64)]) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Obj,
        pieces
            .iter()
            .map(|&(o, l)| MemoryDesc::new(o, l, h))
            .collect(),
    )
}

fn run(a: &dyn TransferAgent, req: TransferRequest) -> Result<(), Error> {
    let st = a.submit_transfer(&req)?;
    st.wait_success(WAIT)?;
    assert_eq!(st.data_path().transport, TransportKind::Storage);
    Ok(())
}

fn write(a: &dyn TransferAgent, local: MemoryDescs, remote: MemoryDescs) -> Result<(), Error> {
    let me = a.name().to_owned();
    run(a, TransferRequest::write(local, remote, me))
}

fn read(a: &dyn TransferAgent, local: MemoryDescs, remote: MemoryDescs) -> Result<(), Error> {
    let me = a.name().to_owned();
    run(a, TransferRequest::read(local, remote, me))
}

fn kind(e: &Error) -> ObjErrorKind {
    match e {
        Error::Object(o) => o.kind,
        other => panic!("not an object-store error: {other}"),
    }
}

#[test]
fn objects_round_trip_by_one_put_and_by_parallel_parts() {
    let Some(ep) = endpoint("objects_round_trip_by_one_put_and_by_parallel_parts") else {
        return;
    };
    let s = store(&ep, "rt");
    // One PUT (4 KiB), a multipart upload of 3 parts with a short last one
    // (12 MiB + 3), one of exactly 2 parts.
    let sizes = [4096u64, 12 * MIB + 3, 10 * MIB];
    let srcs: Vec<Buf> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Buf::filled(n as usize, i as u32 + 1))
        .collect();
    let dsts: Vec<Buf> = sizes.iter().map(|&n| Buf::new(n as usize)).collect();
    let a = agent("rt");
    let mut handles = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        handles.push(object(a.as_ref(), &s, &format!("kv/{i}"), n));
        register(a.as_ref(), &srcs[i].all());
        register(a.as_ref(), &dsts[i].all());
    }
    // All three in one request, with a sync message after them.
    let local = MemoryDescs::new(
        MemoryType::Dram,
        srcs.iter().map(|b| b.desc(0, b.len as u64)).collect(),
    );
    let remote = MemoryDescs::new(
        MemoryType::Obj,
        handles
            .iter()
            .zip(sizes)
            .map(|(&h, n)| MemoryDesc::new(0, n, h))
            .collect(),
    );
    let me = a.name().to_owned();
    let req = TransferRequest::write(local, remote.clone(), me.clone())
        .with_sync_message(b"stored".to_vec());
    run(a.as_ref(), req).unwrap();
    assert_eq!(
        a.take_sync_messages().get(&me).map(Vec::as_slice),
        Some(&[b"stored".to_vec()][..])
    );
    for (i, &n) in sizes.iter().enumerate() {
        assert_eq!(s.object_size(&format!("kv/{i}")).unwrap(), Some(n));
    }
    // Read back whole (the 12 MiB one in three parallel ranged parts).
    let local = MemoryDescs::new(
        MemoryType::Dram,
        dsts.iter().map(|b| b.desc(0, b.len as u64)).collect(),
    );
    read(a.as_ref(), local, remote).unwrap();
    for (src, dst) in srcs.iter().zip(&dsts) {
        assert!(src.bytes() == dst.bytes(), "a read-back object differs");
    }
    // A second WRITE replaces an object whole.
    let small = Buf::filled(1000, 77);
    register(a.as_ref(), &small.all());
    write(a.as_ref(), small.all(), obj(handles[2], &[(0, 1000)])).unwrap();
    assert_eq!(s.object_size("kv/2").unwrap(), Some(1000));
    for i in 0..3 {
        s.delete_object(&format!("kv/{i}")).unwrap();
    }
}

/// A peer's objects, through its agent (over TCP, as a peer's files):
/// a WRITE is assembled at the target and PUT whole before the sync
/// message is delivered; READs are ranged GETs; a WRITE not from offset 0
/// or with integrity is refused before anything is sent; one past the
/// target's assembly budget fails typed and stores nothing.
#[test]
fn a_peers_objects_through_its_agent() {
    let Some(ep) = endpoint("a_peers_objects_through_its_agent") else {
        return;
    };
    let s = store(&ep, "peer");
    let n = 12 * MIB + 5;
    let target = agent("obj-target");
    let h = object(target.as_ref(), &s, "kv/peer", n);
    let init = agent("obj-init");
    let name = init
        .load_remote_agent_by_connection(&target.local_connection_info())
        .unwrap();
    let src = Buf::filled(n as usize, 9);
    let dst = Buf::new(n as usize);
    register(init.as_ref(), &src.all());
    register(init.as_ref(), &dst.all());
    let req = TransferRequest::write(src.all(), obj(h, &[(0, n)]), &name)
        .with_sync_message(b"stored".to_vec());
    let st = init.submit_transfer(&req).unwrap();
    st.wait_success(WAIT).unwrap();
    assert_eq!(st.data_path().transport, TransportKind::Tcp);
    assert_eq!(s.object_size("kv/peer").unwrap(), Some(n));
    assert_eq!(
        target
            .take_sync_messages()
            .get(init.name())
            .map(Vec::as_slice),
        Some(&[b"stored".to_vec()][..])
    );
    // Back in two ranges, the second from an odd offset.
    let split = 3 * MIB + 1;
    let local = MemoryDescs::new(
        MemoryType::Dram,
        vec![dst.desc(0, split), dst.desc(split, n - split)],
    );
    init.submit_transfer(&TransferRequest::read(
        local,
        obj(h, &[(0, split), (split, n - split)]),
        &name,
    ))
    .unwrap()
    .wait_success(WAIT)
    .unwrap();
    assert!(src.bytes() == dst.bytes(), "the object read back differs");

    // Refused before anything is sent.
    let e = init
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::new(MemoryType::Dram, vec![src.desc(0, 4096)]),
            obj(h, &[(4096, 4096)]),
            &name,
        ))
        .unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    let e = init
        .submit_transfer(
            &TransferRequest::write(src.all(), obj(h, &[(0, n)]), &name).with_integrity(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::IntegrityUnsupported { .. }), "{e}");

    // A target that assembles at most 1 MiB: a 4 MiB object fails typed,
    // and the object it was to replace stays as it was.
    let mut cfg = AgentConfig::new(unique("obj-small"));
    cfg.limits.max_object_assembly = MIB;
    let small = make_transfer_agent(Backend::Tcp, cfg).unwrap();
    let hs = object(small.as_ref(), &s, "kv/peer", 4 * MIB);
    let name = init
        .load_remote_agent_by_connection(&small.local_connection_info())
        .unwrap();
    let e = init
        .submit_transfer(&TransferRequest::write(
            MemoryDescs::new(MemoryType::Dram, vec![src.desc(0, 4 * MIB)]),
            obj(hs, &[(0, 4 * MIB)]),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::RemoteRejected {
                reason: RejectReason::ObjectAssemblyFull,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(s.object_size("kv/peer").unwrap(), Some(n));
    s.delete_object("kv/peer").unwrap();
}

#[test]
fn ranged_reads_land_where_described() {
    let Some(ep) = endpoint("ranged_reads_land_where_described") else {
        return;
    };
    let s = store(&ep, "ranges");
    let n = 11 * MIB + 12345;
    let src = Buf::filled(n as usize, 5);
    let a = agent("ranges");
    let h = object(a.as_ref(), &s, "blob", n);
    register(a.as_ref(), &src.all());
    write(a.as_ref(), src.all(), obj(h, &[(0, n)])).unwrap();
    // 24 ranges of the object, scattered into a buffer in another order,
    // one of them larger than a part.
    let mut ranges: Vec<(u64, u64)> = (0..23).map(|i| (i * 64 * 1024 + i * 7, 4096 + i)).collect();
    ranges.push((2 * MIB + 1, 6 * MIB));
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let dst = Buf::new(total as usize);
    register(a.as_ref(), &dst.all());
    let mut at = 0;
    let mut local = Vec::new();
    for r in ranges.iter().rev() {
        local.push(dst.desc(at, r.1));
        at += r.1;
    }
    local.reverse();
    let remote = obj(h, &ranges);
    read(
        a.as_ref(),
        MemoryDescs::new(MemoryType::Dram, local.clone()),
        remote,
    )
    .unwrap();
    for (d, &(off, len)) in local.iter().zip(&ranges) {
        let got = &dst.bytes()[(d.addr - dst.ptr as u64) as usize..][..len as usize];
        assert!(
            got == &src.bytes()[off as usize..(off + len) as usize],
            "range {off}+{len} differs"
        );
    }
}

#[test]
fn store_failures_are_typed_and_bad_requests_send_nothing() {
    let Some(ep) = endpoint("store_failures_are_typed_and_bad_requests_send_nothing") else {
        return;
    };
    let s = store(&ep, "errors");
    let a = agent("errors");
    let buf = Buf::filled(8192, 3);
    register(a.as_ref(), &buf.all());
    let one = |off, len| MemoryDescs::new(MemoryType::Dram, vec![buf.desc(off, len)]);

    // No such key; then a range past the end of one that exists.
    let h = object(a.as_ref(), &s, "missing", 8192);
    let e = read(a.as_ref(), one(0, 4096), obj(h, &[(0, 4096)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::NoSuchKey, "{e}");
    write(a.as_ref(), one(0, 100), obj(h, &[(0, 100)])).unwrap();
    let e = read(a.as_ref(), one(0, 4096), obj(h, &[(0, 4096)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::InvalidRange, "{e}");
    let e = read(a.as_ref(), one(0, 100), obj(h, &[(4096, 100)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::InvalidRange, "{e}");

    // Refused before anything is sent: a WRITE not at offset 0, two
    // descriptors writing one object, a READ into overlapping memory, an
    // object not open, closing an object with registered regions.
    let e = write(a.as_ref(), one(0, 100), obj(h, &[(100, 100)])).unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    let two = MemoryDescs::new(MemoryType::Dram, vec![buf.desc(0, 10), buf.desc(10, 10)]);
    let e = write(a.as_ref(), two, obj(h, &[(0, 10), (0, 10)])).unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)), "{e}");
    let overlapping = MemoryDescs::new(MemoryType::Dram, vec![buf.desc(0, 50), buf.desc(40, 50)]);
    let e = read(a.as_ref(), overlapping, obj(h, &[(0, 50), (50, 50)])).unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)), "{e}");
    // SAFETY: no memory behind OBJ descriptors.
    let e = unsafe { a.register_memory(&obj(999_999, &[(0, 10)])) }.unwrap_err();
    assert!(matches!(e, Error::InvalidDescriptor { .. }), "{e}");
    assert!(matches!(a.close_storage(h), Err(Error::InvalidRequest(_))));
    assert_eq!(s.object_size("missing").unwrap(), Some(100));

    // A bucket that does not exist.
    let nob = config(&ep, &unique("nobucket")).build().unwrap();
    let h2 = object(a.as_ref(), &nob, "k", 100);
    let e = write(a.as_ref(), one(0, 100), obj(h2, &[(0, 100)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::NoSuchBucket, "{e}");

    // Wrong credentials.
    let mut c = config(&ep, &s.config().bucket);
    c.secret_key = "not-the-secret".into();
    let wrong = c.build().unwrap();
    let h3 = object(a.as_ref(), &wrong, "k", 100);
    let e = write(a.as_ref(), one(0, 100), obj(h3, &[(0, 100)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::AccessDenied, "{e}");
    let e = read(a.as_ref(), one(0, 100), obj(h3, &[(0, 100)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::AccessDenied, "{e}");

    // Nothing listening: tried again, then unreachable.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = config(&format!("http://127.0.0.1:{port}"), "b");
    c.retries = 2;
    let gone = c.build().unwrap();
    let h4 = object(a.as_ref(), &gone, "k", 100);
    let e = write(a.as_ref(), one(0, 100), obj(h4, &[(0, 100)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::Unreachable, "{e}");

    // The agent still serves.
    write(a.as_ref(), one(0, 8192), obj(h, &[(0, 8192)])).unwrap();
    let back = Buf::new(8192);
    register(a.as_ref(), &back.all());
    read(a.as_ref(), back.all(), obj(h, &[(0, 8192)])).unwrap();
    assert!(back.bytes() == buf.bytes());
    a.deregister_memory(&obj(h3, &[(0, 100)])).unwrap();
    a.close_storage(h3).unwrap();
}

#[test]
fn a_full_bucket_quota_fails_the_write_and_keeps_the_old_object() {
    let Some(ep) = endpoint("a_full_bucket_quota_fails_the_write_and_keeps_the_old_object") else {
        return;
    };
    let Ok(admin) = std::env::var("KVXFER_S3_ADMIN") else {
        println!("SKIPPED a_full_bucket_quota...: KVXFER_S3_ADMIN unset (no radosgw-admin)");
        return;
    };
    let s = store(&ep, "quota");
    let bucket = s.config().bucket.clone();
    let admin: Vec<&str> = admin.split_whitespace().collect();
    let sh = |args: &[&str]| {
        let st = std::process::Command::new(admin[0])
            .args(&admin[1..])
            .args(args)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&st.stderr)
        );
    };
    sh(&[
        "quota",
        "set",
        "--quota-scope=bucket",
        "--bucket",
        &bucket,
        "--max-size=4194304",
    ]);
    sh(&[
        "quota",
        "enable",
        "--quota-scope=bucket",
        "--bucket",
        &bucket,
    ]);
    let a = agent("quota");
    let first = Buf::filled(MIB as usize, 1);
    let big = Buf::filled(8 * MIB as usize, 2);
    register(a.as_ref(), &first.all());
    register(a.as_ref(), &big.all());
    let h = object(a.as_ref(), &s, "k", 8 * MIB);
    write(a.as_ref(), first.all(), obj(h, &[(0, MIB)])).unwrap();
    // 8 MiB: more than the 4 MiB the bucket may hold (a multipart upload).
    let e = write(a.as_ref(), big.all(), obj(h, &[(0, 8 * MIB)])).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::QuotaExceeded, "{e}");
    // The object is still the first one.
    assert_eq!(s.object_size("k").unwrap(), Some(MIB));
    let back = Buf::new(MIB as usize);
    register(a.as_ref(), &back.all());
    read(a.as_ref(), back.all(), obj(h, &[(0, MIB)])).unwrap();
    assert!(back.bytes() == first.bytes());
}

/// A proxy in front of the gateway that can die: every connection cut and
/// the listener closed, as a killed server.
struct Proxy {
    port: u16,
    dead: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    /// Bytes forwarded from the server to the client.
    down: Arc<AtomicU64>,
}

impl Proxy {
    fn start(upstream: &str) -> Proxy {
        let target = upstream.trim_start_matches("http://").to_owned();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let dead = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let down = Arc::new(AtomicU64::new(0));
        let (d, c, n) = (Arc::clone(&dead), Arc::clone(&conns), Arc::clone(&down));
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(client) = s else { continue };
                if d.load(Ordering::SeqCst) {
                    // Dead: the listener goes with this thread.
                    return;
                }
                let server = TcpStream::connect(&target).unwrap();
                c.lock().unwrap().push(client.try_clone().unwrap());
                c.lock().unwrap().push(server.try_clone().unwrap());
                let pump =
                    |mut from: TcpStream, mut to: TcpStream, count: Option<Arc<AtomicU64>>| {
                        std::thread::spawn(move || {
                            let mut b = vec![0u8; 64 << 10];
                            while let Ok(k) = from.read(&mut b) {
                                if k == 0 || to.write_all(&b[..k]).is_err() {
                                    break;
                                }
                                if let Some(c) = &count {
                                    c.fetch_add(k as u64, Ordering::SeqCst);
                                }
                            }
                            let _ = to.shutdown(Shutdown::Both);
                        });
                    };
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    None,
                );
                pump(server, client, Some(Arc::clone(&n)));
            }
        });
        Proxy {
            port,
            dead,
            conns,
            down,
        }
    }

    /// Dies: no new connection, every open one cut.
    fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        // Wake the accepting thread so that it returns and drops the
        // listener.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[test]
fn a_store_that_dies_mid_transfer_fails_the_request_and_nothing_lands_after() {
    let Some(ep) =
        endpoint("a_store_that_dies_mid_transfer_fails_the_request_and_nothing_lands_after")
    else {
        return;
    };
    let good = store(&ep, "dies");
    let bucket = good.config().bucket.clone();
    let n = 40 * MIB;
    let src = Buf::filled(n as usize, 9);
    let a = agent("dies");
    register(a.as_ref(), &src.all());
    let h = object(a.as_ref(), &good, "k", n);
    write(a.as_ref(), src.all(), obj(h, &[(0, n)])).unwrap();

    // READ through the proxy; it dies once some of the answer has come.
    let proxy = Proxy::start(&ep);
    let mut c = config(&format!("http://127.0.0.1:{}", proxy.port), &bucket);
    c.retries = 1;
    let via = c.build().unwrap();
    let h2 = object(a.as_ref(), &via, "k", n);
    let dst = Buf::new(n as usize);
    register(a.as_ref(), &dst.all());
    let me = a.name().to_owned();
    let st = a
        .submit_transfer(&TransferRequest::read(
            dst.all(),
            obj(h2, &[(0, n)]),
            me.clone(),
        ))
        .unwrap();
    while proxy.down.load(Ordering::SeqCst) < MIB && !st.is_completed() {
        std::thread::yield_now();
    }
    proxy.kill();
    let e = st.wait_success(WAIT).unwrap_err();
    assert!(
        matches!(
            kind(&e),
            ObjErrorKind::Unreachable | ObjErrorKind::InvalidRange
        ),
        "{e}"
    );
    // Nothing changes in the destination after the outcome.
    let seen = dst.bytes().to_vec();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        dst.bytes() == &seen[..],
        "bytes landed after the READ's outcome"
    );

    // A WRITE of other bytes through a proxy that dies: fails, and the
    // object keeps its old bytes.
    let proxy = Proxy::start(&ep);
    let mut c = config(&format!("http://127.0.0.1:{}", proxy.port), &bucket);
    c.retries = 1;
    let via = c.build().unwrap();
    let h3 = object(a.as_ref(), &via, "k", n);
    let other = Buf::filled(n as usize, 10);
    register(a.as_ref(), &other.all());
    let st = a
        .submit_transfer(&TransferRequest::write(other.all(), obj(h3, &[(0, n)]), me))
        .unwrap();
    // Kill it once the store has answered something (the upload's
    // creation) or the request ended.
    while proxy.down.load(Ordering::SeqCst) == 0 && !st.is_completed() {
        std::thread::yield_now();
    }
    proxy.kill();
    let e = st.wait_success(WAIT).unwrap_err();
    assert_eq!(kind(&e), ObjErrorKind::Unreachable, "{e}");
    let back = Buf::new(n as usize);
    register(a.as_ref(), &back.all());
    read(a.as_ref(), back.all(), obj(h, &[(0, n)])).unwrap();
    assert!(
        back.bytes() == src.bytes(),
        "a failed WRITE changed the object"
    );
}
