//! Rogue peers: a hand-written wire client attacks a target agent in this
//! process (an exported region with canaries around it, a secret it never
//! exported). After each attack the canaries and the secret are unchanged
//! and the target still serves a good peer.

mod common;
#[path = "rogue/held.rs"]
mod held;
#[path = "rogue/local_proof.rs"]
mod local_proof;

use std::os::linux::net::SocketAddrExt;
use std::time::Duration;

use common::raw::{self, Hdr, RawConn};
use kvxfer::{
    AgentConfig, AgentDesc, Backend, Credential, Error, MemoryDesc, MemoryDescs, MemoryType,
    StorageSpec, TransferAgent, TransferRequest, make_transfer_agent,
};

const SECRET: &[u8] = b"TOP SECRET: never exported, never to leave this process";
const REGION: usize = 1 << 20;
const CANARY: usize = 4096;

/// A target with one exported 1 MiB region inside a larger buffer whose
/// edges are canaries, and a secret elsewhere in the process.
struct Victim {
    agent: Box<dyn TransferAgent>,
    buf: Vec<u8>,
    secret: Vec<u8>,
    desc: AgentDesc,
}

impl Victim {
    fn new(backend: Backend, config: AgentConfig) -> Self {
        let agent = make_transfer_agent(backend, config).unwrap();
        let buf = vec![0xA5u8; REGION + 2 * CANARY];
        let region = MemoryDescs::dram(&buf[CANARY..CANARY + REGION]);
        // SAFETY: `buf` outlives the agent (fields drop in declaration
        // order), and the test only reads it, through black boxes.
        unsafe { agent.register_memory(&region).unwrap() };
        let desc = agent.local_agent_desc();
        Self {
            agent,
            buf,
            secret: SECRET.to_vec(),
            desc,
        }
    }

    fn conn(&self) -> String {
        self.agent.local_connection_info()
    }

    fn region_addr(&self) -> u64 {
        self.buf.as_ptr() as u64 + CANARY as u64
    }

    fn key(&self) -> u64 {
        self.desc.regions[0].key
    }

    /// Canaries, region and secret as they were.
    fn assert_untouched(&self) {
        let buf = std::hint::black_box(&self.buf);
        assert!(
            buf.iter().all(|&b| b == 0xA5),
            "the target's memory changed"
        );
        assert_eq!(std::hint::black_box(&self.secret), SECRET);
    }

    /// A good peer still gets a WRITE through, which lands.
    fn still_serves(&self, cfg: AgentConfig) {
        let good = make_transfer_agent(Backend::Tcp, cfg).unwrap();
        let src = vec![0x3cu8; 4096];
        // SAFETY: `src` outlives `good`.
        unsafe { good.register_memory(&MemoryDescs::dram(&src)).unwrap() };
        let name = good.load_remote_agent_by_connection(&self.conn()).unwrap();
        let dst = common::dram([(self.region_addr() + 8192, 4096)]);
        good.submit_transfer(&TransferRequest::write(MemoryDescs::dram(&src), dst, &name))
            .unwrap()
            .wait_success(Duration::from_secs(60))
            .unwrap();
        let buf = std::hint::black_box(&self.buf);
        assert!(
            buf[CANARY + 8192..CANARY + 12288]
                .iter()
                .all(|&b| b == 0x3c)
        );
        drop(good);
    }
}

fn grant(c: &mut RawConn, req: u64, addr: u64, len: u64, key: u64) -> u16 {
    let mut g = Hdr::shm(raw::SHM_GRANT, 0);
    g.id = req;
    g.addr = addr;
    g.len = len;
    g.key = key;
    g.aux = 1;
    c.send(g, &[]).unwrap();
    let a = c.recv().expect("an answer to the grant");
    assert!(a.is_shm(raw::SHM_GRANTED) && a.id == req, "{a:?}");
    // The answer's status travels in `aux`.
    a.aux as u16
}

/// Asks the target to copy `len` bytes between `target_addr` (its side)
/// and `initiator_addr` in process `pid`, as a WRITE (the target reads the
/// initiator) or a READ (the target writes it). The target's answer.
fn delegate(
    c: &mut RawConn,
    req: u64,
    write: bool,
    pid: u32,
    target_addr: u64,
    initiator_addr: u64,
    len: u64,
) -> u16 {
    // A probe word the frame points at, holding the "instance" it claims:
    // the old check (read it back through the pid) passes for any pid that
    // maps this address with this value, e.g. the target itself.
    let probe: Box<u64> = Box::new(0x6d61_6c6c_6f72_7921);
    let st = delegate_probed(
        c,
        req,
        write,
        pid,
        (&*probe as *const u64 as u64, *probe),
        (target_addr, initiator_addr, len),
    );
    std::hint::black_box(&probe);
    st
}

/// [`delegate`] with the probe word (its address in `pid` and the value
/// claimed there) and the piece `(target, initiator, len)` given.
fn delegate_probed(
    c: &mut RawConn,
    req: u64,
    write: bool,
    pid: u32,
    (probe_addr, probe_value): (u64, u64),
    (target_addr, initiator_addr, len): (u64, u64, u64),
) -> u16 {
    let mut d = Hdr::shm(raw::SHM_DELEGATE, if write { 1 } else { 2 });
    d.id = req;
    d.aux = 1;
    d.addr = probe_addr;
    d.key = probe_value;
    d.len = u64::from(pid);
    let mut table = target_addr.to_le_bytes().to_vec();
    table.extend_from_slice(&initiator_addr.to_le_bytes());
    table.extend_from_slice(&len.to_le_bytes());
    c.send(d, &table).unwrap();
    let a = c.recv().expect("an answer to the delegate");
    assert!(a.is_shm(raw::SHM_GRANTED) && a.id == req, "{a:?}");
    a.aux as u16
}

/// Presents a session's ticket on the target's local socket, as an
/// initiator on this host does to prove which process it is (with its own
/// memory file).
fn prove_local(instance: u64, ticket: u128) -> u8 {
    let addr =
        std::os::unix::net::SocketAddr::from_abstract_name(format!("kvxfer-{instance:016x}"))
            .unwrap();
    let mut s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    let mem = std::fs::File::open("/proc/self/mem").unwrap();
    present(&mut s, ticket, Some(&mem)).expect("an answer")
}

/// Sends `ticket` through `s`, with `mem` as `SCM_RIGHTS` when given; the
/// target's answer byte, `None` when it closed without one.
fn present(
    s: &mut std::os::unix::net::UnixStream,
    ticket: u128,
    mem: Option<&std::fs::File>,
) -> Option<u8> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    use std::io::Read;
    use std::os::fd::AsFd;
    let bytes = ticket.to_le_bytes();
    let fds: Vec<_> = mem.iter().map(|m| m.as_fd()).collect();
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let sent = sendmsg(
        &*s,
        &[std::io::IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .ok()?;
    assert_eq!(sent, bytes.len());
    let mut a = [0u8];
    s.read_exact(&mut a).ok()?;
    Some(a[0])
}

/// A peer that names the target's own pid (or a third process's) in a
/// `Delegate` cannot make the target read its secret into the exported
/// region, nor write the region over the secret: the target copies only
/// for the process the kernel proved to be the initiator, and never for
/// itself.
#[test]
fn a_forged_delegate_reads_and_writes_nothing() {
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", None).unwrap();
    let ack = c.hello("mallory", 77).unwrap();
    assert_eq!((ack.kind, ack.status), (raw::HELLO_ACK, raw::ST_OK));
    let me = std::process::id();
    let secret = v.secret.as_ptr() as u64;
    let n = SECRET.len() as u64;
    let mut third = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mut req = 0;
    let mut attack = |c: &mut RawConn, pid: u32| {
        for write in [true, false] {
            req += 1;
            assert_eq!(grant(c, req, v.region_addr(), 4096, v.key()), raw::ST_OK);
            let st = delegate(c, req, write, pid, v.region_addr(), secret, n);
            assert_eq!(st, raw::ST_DELEGATE_REFUSED, "pid {pid}, write {write}");
            v.assert_untouched();
        }
    };
    // Unproven: the target's own pid, and a third process.
    attack(&mut c, me);
    attack(&mut c, third.id());
    // Proven — the kernel says this connection's process is the test
    // process, which is the target's own: still refused, and a third
    // process's pid does not match the proof.
    let ticket = u128::from(ack.addr) | u128::from(ack.len) << 64;
    assert_eq!(prove_local(v.desc.instance, ticket), 0);
    // A ticket binds one process: proving it again (a session's pool
    // channel) binds nothing new (another process is refused:
    // `local_proof::a_bound_ticket_binds_no_other_process`); a ticket of
    // no session binds nothing.
    assert_eq!(prove_local(v.desc.instance, ticket), 0);
    assert_eq!(prove_local(v.desc.instance, ticket ^ 1), 1);
    attack(&mut c, me);
    attack(&mut c, third.id());
    let _ = third.kill();
    let _ = third.wait();
    drop(c);
    v.still_serves(AgentConfig::new("good"));
}

fn credential(fill: u8) -> Credential {
    Credential::new(
        (0..32u8)
            .map(|i| i.wrapping_mul(37) ^ fill)
            .collect::<Vec<u8>>(),
    )
    .unwrap()
}

/// The secrets the round-two attack found accepted are refused, typed,
/// however they reach the agent: built directly, or read from a secret
/// file.
#[test]
fn guessable_secrets_are_refused() {
    let dir = std::env::temp_dir().join(format!("kvxfer-weak-{}", std::process::id()));
    for weak in [
        "abcdefgh".repeat(4),
        "01234567".repeat(5),
        "Password1".repeat(3),
    ] {
        let e = Credential::new(weak.clone().into_bytes()).unwrap_err();
        assert!(
            matches!(e, kvxfer::auth::CredentialError::TooWeak { .. }),
            "{weak}: {e}"
        );
        std::fs::write(&dir, format!("{weak}\n")).unwrap();
        let e = Credential::from_file(&dir).unwrap_err();
        assert!(
            matches!(e, kvxfer::auth::CredentialError::TooWeak { .. }),
            "{weak}: {e}"
        );
    }
    std::fs::remove_file(&dir).unwrap();
}

/// With a credential configured, a peer that does not prove it holds the
/// secret is answered nothing: no descriptor, no keys, no data.
#[test]
fn unauthenticated_peers_get_nothing() {
    let k = credential(1);
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target").with_credential(k.clone()),
    );
    // Old-style first frames and garbage: the connection closes unanswered.
    for first in [raw::DESC_REQUEST, raw::HELLO, raw::WRITE, 0xff] {
        let mut c = RawConn::connect(&v.conn());
        let mut h = Hdr::new(first);
        h.len = 16;
        h.aux = 5;
        c.send(h, b"hello").unwrap();
        assert!(c.closed(), "frame kind {first} was answered");
    }
    // No credential.
    let mut c = RawConn::connect(&v.conn());
    assert_eq!(c.auth("mallory", None), Err(raw::ST_AUTH_REQUIRED));
    assert!(c.closed());
    // Another secret.
    let mut c = RawConn::connect(&v.conn());
    assert_eq!(
        c.auth("mallory", Some(&credential(2))),
        Err(raw::ST_AUTH_FAILED)
    );
    assert!(c.closed());
    // The right one: the descriptor comes.
    let mut c = RawConn::connect(&v.conn());
    c.auth("friend", Some(&k)).unwrap();
    let d = AgentDesc::decode(&c.desc().unwrap()).unwrap();
    assert_eq!(d.regions[0].key, v.key());
    v.assert_untouched();
    v.still_serves(AgentConfig::new("good").with_credential(k));
}

/// A frame of a transport the target does not offer (a cross-memory grant
/// to a TCP agent), or of an unknown transport, is a protocol violation:
/// the connection closes unanswered, nothing is admitted, and the target
/// serves others.
#[test]
fn frames_of_transports_the_target_lacks_close_the_connection() {
    let v = Victim::new(Backend::Tcp, AgentConfig::new("target"));
    for (transport, kind) in [(raw::SHM, raw::SHM_GRANT), (0, 1), (200, 1)] {
        let mut c = RawConn::connect(&v.conn());
        c.auth("mallory", None).unwrap();
        c.hello("mallory", 9).unwrap();
        let mut g = Hdr::shm(kind, 0);
        g.flags = transport;
        g.id = 1;
        g.addr = v.region_addr();
        g.len = 4096;
        g.key = v.key();
        g.aux = 1;
        c.send(g, &[]).unwrap();
        assert!(c.closed(), "transport {transport}: answered");
    }
    v.assert_untouched();
    v.still_serves(AgentConfig::new("good"));
}

/// Agents with different secrets, or only one with a secret, never
/// exchange anything; with the same secret they transfer.
#[test]
fn agents_authenticate_each_other() {
    let k = credential(3);
    let keyed = Victim::new(
        Backend::Tcp,
        AgentConfig::new("keyed").with_credential(k.clone()),
    );
    let open = Victim::new(Backend::Tcp, AgentConfig::new("open"));
    let cases = [
        (Some(credential(4)), &keyed),
        (None, &keyed),
        (Some(k.clone()), &open),
    ];
    for (cred, target) in cases {
        let mut cfg = AgentConfig::new("init");
        if let Some(c) = cred {
            cfg = cfg.with_credential(c);
        }
        let init = make_transfer_agent(Backend::Tcp, cfg).unwrap();
        let err = init
            .load_remote_agent_by_connection(&target.conn())
            .unwrap_err();
        assert!(matches!(err, Error::AuthFailed { .. }), "{err}");
        // Nor does a descriptor obtained elsewhere open a link.
        init.load_remote_agent(&target.desc).unwrap();
        let src = vec![1u8; 64];
        // SAFETY: `src` outlives `init`.
        unsafe { init.register_memory(&MemoryDescs::dram(&src)).unwrap() };
        let err = init
            .submit_transfer(&TransferRequest::write(
                MemoryDescs::dram(&src),
                common::dram([(target.region_addr(), 64)]),
                &target.desc.name,
            ))
            .and_then(|st| st.wait_success(Duration::from_secs(60)))
            .unwrap_err();
        assert!(matches!(err, Error::AuthFailed { .. }), "{err}");
        target.assert_untouched();
        drop(init);
    }
    keyed.still_serves(AgentConfig::new("good").with_credential(k));
}

/// A connection is served under the name it authenticated as: a `Hello`
/// claiming another agent's name ends the connection, and sync messages
/// arrive under the authenticated name only.
#[test]
fn a_name_is_bound_to_its_connection() {
    let k = credential(5);
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target").with_credential(k.clone()),
    );
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", Some(&k)).unwrap();
    assert_eq!(c.hello("ctx-0", 1), None, "a spoofed hello was answered");
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", Some(&k)).unwrap();
    let ack = c.hello("mallory", 2).unwrap();
    assert_eq!((ack.kind, ack.status), (raw::HELLO_ACK, raw::ST_OK));
    let mut commit = Hdr::new(raw::COMMIT);
    commit.flags = 1 | 0x80;
    commit.id = 1;
    commit.aux = 2;
    c.send(commit, b"hi").unwrap();
    let a = c.recv().unwrap();
    assert_eq!((a.kind, a.status), (raw::ACK, raw::ST_OK));
    let msgs = v.agent.wait_sync_messages(Duration::from_secs(30));
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert_eq!(msgs["mallory"], vec![b"hi".to_vec()]);
}

/// A peer that connects and says nothing, or half a header, is dropped
/// after the connect timeout, and others are served meanwhile.
#[test]
fn a_stalled_handshake_is_dropped() {
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target").with_connect_timeout(Duration::from_secs(1)),
    );
    let mut silent = RawConn::connect(&v.conn());
    let mut half = RawConn::connect(&v.conn());
    std::io::Write::write_all(&mut half.s, &[raw::AUTH_HELLO, 0, 0]).unwrap();
    v.still_serves(AgentConfig::new("good"));
    // Closed by the target (the read timeout is 30 s, far beyond 1 s).
    assert!(silent.closed());
    assert!(half.closed());
}

/// Without a credential an agent listens on loopback only, unless told
/// `insecure`.
#[test]
fn a_public_listener_needs_a_credential_or_insecure() {
    let public = "0.0.0.0:0".parse().unwrap();
    if Credential::from_env().unwrap().is_none() {
        let err = make_transfer_agent(Backend::Tcp, AgentConfig::new("a").with_listen(public))
            .err()
            .expect("a public listener without a credential");
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    }
    for cfg in [
        AgentConfig::new("b")
            .with_listen(public)
            .with_insecure(true),
        AgentConfig::new("c")
            .with_listen(public)
            .with_credential(credential(6)),
    ] {
        make_transfer_agent(Backend::Tcp, cfg).unwrap();
    }
}

/// A stale WRITE into a region the target has deregistered is refused
/// (`RemoteRejected`), and the connection it shares with other requests
/// stays up: a WRITE to another region, submitted with it, lands.
#[test]
fn a_refused_write_does_not_take_down_the_connection() {
    let v = Victim::new(Backend::Tcp, AgentConfig::new("target"));
    let other = vec![0u8; REGION];
    // SAFETY: `other` outlives its registration (deregistered below).
    unsafe { v.agent.register_memory(&MemoryDescs::dram(&other)).unwrap() };
    let init = make_transfer_agent(Backend::Tcp, AgentConfig::new("init")).unwrap();
    let src = vec![0x77u8; REGION];
    // SAFETY: `src` outlives `init`.
    unsafe { init.register_memory(&MemoryDescs::dram(&src)).unwrap() };
    let name = init.load_remote_agent_by_connection(&v.conn()).unwrap();
    // The exported region goes away after the initiator took its key.
    v.agent
        .deregister_memory(&MemoryDescs::dram(&v.buf[CANARY..CANARY + REGION]))
        .unwrap();
    for size in [4096u64, 64 << 10, 256 << 10, REGION as u64] {
        let stale = init
            .submit_transfer(&TransferRequest::write(
                common::dram([(src.as_ptr() as u64, size)]),
                common::dram([(v.region_addr(), size)]),
                &name,
            ))
            .unwrap();
        let good = init
            .submit_transfer(&TransferRequest::write(
                common::dram([(src.as_ptr() as u64, size)]),
                common::dram([(other.as_ptr() as u64, size)]),
                &name,
            ))
            .unwrap();
        let err = stale.wait_success(Duration::from_secs(60)).unwrap_err();
        assert!(
            matches!(err, Error::RemoteRejected { .. }),
            "{size} bytes: {err}"
        );
        good.wait_success(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{size} bytes: {e}"));
    }
    assert!(std::hint::black_box(&other).iter().all(|&b| b == 0x77));
    v.assert_untouched();
    drop(init);
    v.agent
        .deregister_memory(&MemoryDescs::dram(&other))
        .unwrap();
}

/// A raw peer aimed at the target's storage (a FILE region opened for
/// direct I/O): a misaligned range, a range past the end of the file
/// (truncated under its region), another handle, a write list, a grant
/// for direct access, or the region's key presented as host memory are
/// each refused with their own status, the file and the target's memory
/// unchanged; an aligned write lands.
#[test]
fn a_rogue_peer_reaches_storage_only_through_the_checks() {
    const FILE: u64 = 64 << 10;
    // On shm, whose transport serves grants (its peers' storage on TCP).
    let v = Victim::new(Backend::Shm, AgentConfig::new("target"));
    let dir = std::env::temp_dir().join(format!("kvxfer-rogue-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f");
    let h = v
        .agent
        .open_storage(&StorageSpec::file(&path).create(FILE).direct(true))
        .unwrap();
    let region = MemoryDescs::new(MemoryType::File, vec![MemoryDesc::new(0, FILE, h)]);
    // SAFETY: a storage descriptor names a file range, not memory.
    unsafe { v.agent.register_memory(&region).unwrap() };
    let key = v
        .agent
        .local_agent_desc()
        .regions
        .iter()
        .find(|r| r.mem_type == MemoryType::File)
        .unwrap()
        .key;
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", None).unwrap();
    c.hello("mallory", 9).unwrap();
    const FILE_TYPE: u8 = 4;
    // One WRITE segment and its commit; the target's status for it.
    let mut req = 0;
    let mut write = |c: &mut RawConn, mem: u8, handle: u32, addr: u64, len: u64, key: u64| {
        req += 1;
        let mut w = Hdr::new(raw::WRITE);
        w.flags = mem;
        w.aux = handle;
        w.id = req;
        w.addr = addr;
        w.len = len;
        w.key = key;
        c.send(w, &vec![0xEEu8; len as usize]).unwrap();
        let mut commit = Hdr::new(raw::COMMIT);
        commit.flags = 1;
        commit.id = req;
        commit.len = 1;
        c.send(commit, &[]).unwrap();
        let a = c.recv().expect("an ack");
        assert_eq!((a.kind, a.id), (raw::ACK, req));
        a.status
    };
    const NOT_REGISTERED: u16 = 1;
    const UNSUPPORTED: u16 = 3;
    const MISALIGNED: u16 = 8;
    const PAST_END: u16 = 9;
    assert_eq!(write(&mut c, FILE_TYPE, h, 100, 4096, key), MISALIGNED);
    assert_eq!(write(&mut c, FILE_TYPE, h, 0, 100, key), MISALIGNED);
    assert_eq!(
        write(&mut c, FILE_TYPE, h + 1, 0, 4096, key),
        NOT_REGISTERED
    );
    assert_eq!(write(&mut c, FILE_TYPE, h, 0, 4096, key ^ 1), 2);
    // The file offset as a host address, with the file's key.
    assert_eq!(write(&mut c, 0, h, 0, 4096, key), NOT_REGISTERED);
    assert_eq!(write(&mut c, 0, h, v.region_addr(), 4096, key), 2);
    // Direct access (a grant) and write lists: host memory only.
    let mut g = Hdr::shm(raw::SHM_GRANT, FILE_TYPE);
    g.id = 100;
    g.len = 4096;
    g.key = key;
    g.aux = 1;
    c.send(g, &[]).unwrap();
    let a = c.recv().unwrap();
    assert!(a.is_shm(raw::SHM_GRANTED), "{a:?}");
    assert_eq!(a.aux as u16, UNSUPPORTED);
    let mut wl = Hdr::new(raw::WRITE_LIST);
    wl.flags = FILE_TYPE;
    wl.id = 101;
    wl.aux = 2;
    wl.len = 8192;
    wl.key = key;
    let mut body = Vec::new();
    for off in [0u64, 4096] {
        body.extend_from_slice(&off.to_le_bytes());
        body.extend_from_slice(&4096u64.to_le_bytes());
    }
    body.extend_from_slice(&[0xEE; 8192]);
    c.send(wl, &body).unwrap();
    let mut commit = Hdr::new(raw::COMMIT);
    commit.flags = 1;
    commit.id = 101;
    commit.len = 2;
    c.send(commit, &[]).unwrap();
    let a = c.recv().unwrap();
    assert_eq!((a.kind, a.id, a.status), (raw::ACK, 101, UNSUPPORTED));
    assert!(
        std::fs::read(&path).unwrap().iter().all(|&b| b == 0),
        "a refused write changed the file"
    );
    // Truncated under its region: writes and reads past the end refused.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(FILE / 2)
        .unwrap();
    assert_eq!(write(&mut c, FILE_TYPE, h, FILE / 2, 4096, key), PAST_END);
    let mut r = Hdr::new(raw::READ_REQ);
    r.flags = FILE_TYPE;
    r.aux = h;
    r.id = 200;
    r.addr = FILE - 4096;
    r.len = 4096;
    r.key = key;
    c.send(r, &[]).unwrap();
    let d = c.recv().unwrap();
    assert_eq!((d.kind, d.len, d.status), (raw::READ_DATA, 0, PAST_END));
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        FILE / 2,
        "not grown"
    );
    // An aligned write inside the file lands; the connection carried on.
    assert_eq!(write(&mut c, FILE_TYPE, h, 4096, 4096, key), raw::ST_OK);
    let data = std::fs::read(&path).unwrap();
    assert!(data[4096..8192].iter().all(|&b| b == 0xEE));
    assert!(data[..4096].iter().chain(&data[8192..]).all(|&b| b == 0));
    v.assert_untouched();
    v.still_serves(AgentConfig::new("good"));
    drop(c);
    v.agent.deregister_memory(&region).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `Abort` from a raw peer: a request it aborts is answered `Aborted` once
/// its sent segments are in, its sync message withheld; an abort that
/// claims more segments than the commit announces is a protocol violation
/// that closes only that peer's connection. The target's memory is
/// untouched and it serves others throughout.
#[test]
fn aborts_are_counted_and_cannot_be_abused() {
    let v = Victim::new(Backend::Tcp, AgentConfig::new("target"));
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", None).unwrap();
    c.hello("mallory", 7).unwrap();
    let commit = |req: u64, segments: u64, sync: &[u8]| {
        let mut h = Hdr::new(raw::COMMIT);
        h.flags = 1 | 0x80;
        h.id = req;
        h.len = segments;
        h.aux = sync.len() as u32;
        h
    };
    let abort = |req: u64, segments: u64| {
        let mut h = Hdr::new(raw::ABORT);
        h.id = req;
        h.len = segments;
        h
    };
    // Three segments announced, all three skipped: answered, no message.
    c.send(commit(1, 3, b"must not arrive"), b"must not arrive")
        .unwrap();
    c.send(abort(1, 3), &[]).unwrap();
    let a = c.recv().unwrap();
    assert_eq!((a.kind, a.id, a.status), (raw::ACK, 1, raw::ST_ABORTED));
    // Aborted with nothing skipped (a copy that never began): the same.
    c.send(abort(2, 0), &[]).unwrap();
    c.send(commit(2, 0, b"nor this"), b"nor this").unwrap();
    let a = c.recv().unwrap();
    assert_eq!((a.kind, a.id, a.status), (raw::ACK, 2, raw::ST_ABORTED));
    assert!(v.agent.take_sync_messages().is_empty());
    // More skipped than the commit announces (u64::MAX: no overflow).
    c.send(abort(3, u64::MAX), &[]).unwrap();
    c.send(commit(3, 1, b""), b"").unwrap();
    assert!(c.closed(), "an impossible abort was accepted");
    v.assert_untouched();
    v.still_serves(AgentConfig::new("good"));
}

/// Sync messages a target's application does not take are held within a
/// byte budget per sender and in all: beyond it a request fails with
/// `InboxFull` at its sender, others' messages still arrive, and taking
/// the messages makes room again.
#[test]
fn sync_messages_are_held_within_a_budget() {
    const MIB: usize = 1 << 20;
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target").with_inbox_limits(4 * MIB as u64, 2 * MIB as u64 + 4096),
    );
    // A raw peer announces 1 MiB messages for requests whose data never
    // comes: two are held, the rest are refused before their bodies are
    // kept.
    let mut c = RawConn::connect(&v.conn());
    c.auth("mallory", None).unwrap();
    c.hello("mallory", 3).unwrap();
    let body = vec![0x11u8; MIB];
    for req in 1..=6u64 {
        let mut commit = Hdr::new(raw::COMMIT);
        commit.flags = 1 | 0x80;
        commit.id = req;
        commit.len = 1; // one segment that never arrives
        commit.aux = MIB as u32;
        c.send(commit, &body).unwrap();
    }
    // Request 6's segment arrives (a fence): it finishes, refused.
    let mut fence = Hdr::new(10);
    fence.id = 6;
    c.send(fence, &[]).unwrap();
    let a = c.recv().unwrap();
    assert_eq!((a.kind, a.id, a.status), (raw::ACK, 6, 6), "InboxFull");
    // Another peer is not starved by mallory's share.
    let good = make_transfer_agent(Backend::Tcp, AgentConfig::new("good")).unwrap();
    let name = good.load_remote_agent_by_connection(&v.conn()).unwrap();
    let notify = |n: usize| {
        good.notify_sync_message(&name, vec![0x22; n])
            .and_then(|st| st.wait_success(Duration::from_secs(60)))
    };
    notify(MIB).unwrap();
    // 2 MiB held for mallory and 2 MiB queued for good: the inbox is full.
    notify(MIB).unwrap();
    let err = notify(MIB).unwrap_err();
    assert!(
        matches!(
            err,
            Error::RemoteRejected {
                reason: kvxfer::RejectReason::InboxFull,
                ..
            }
        ),
        "{err}"
    );
    // Taken, the messages make room.
    let got = v.agent.take_sync_messages();
    assert_eq!(got["good"].len(), 2);
    notify(MIB).unwrap();
    // Mallory's connection goes: its held messages' room comes back.
    drop(c);
    let t0 = std::time::Instant::now();
    loop {
        match notify(2 * MIB) {
            Ok(()) => break,
            Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                assert!(matches!(e, Error::RemoteRejected { .. }), "{e}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("room never came back: {e}"),
        }
        let _ = v.agent.take_sync_messages();
    }
    v.assert_untouched();
}

/// A listener that answers like a very slow agent: every byte of its
/// answers 50 ms apart, for as long as it is let.
fn trickling_listener(
    script: impl Fn(&mut std::net::TcpStream) -> std::io::Result<()> + Send + 'static,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = std::sync::Arc::clone(&stop);
    std::thread::spawn(move || {
        l.set_nonblocking(true).unwrap();
        while !s2.load(std::sync::atomic::Ordering::SeqCst) {
            match l.accept() {
                Ok((mut c, _)) => {
                    c.set_nonblocking(false).unwrap();
                    let _ = script(&mut c);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    (addr, stop)
}

/// Writes `bytes` one at a time, 50 ms apart, for at most two minutes.
fn trickle(c: &mut std::net::TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let t0 = std::time::Instant::now();
    for b in bytes {
        if t0.elapsed() > Duration::from_secs(120) {
            break;
        }
        c.write_all(&[*b])?;
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Loading a peer that answers, but ever so slowly, fails with a timeout
/// after about the connect timeout: the exchange has one deadline, not a
/// timeout per byte.
#[test]
fn a_trickling_peer_cannot_hold_a_load_past_its_deadline() {
    use std::io::Read;
    let challenge = |c: &mut std::net::TcpStream| -> std::io::Result<Vec<u8>> {
        let mut b = [0u8; 40];
        c.read_exact(&mut b)?;
        let mut body = vec![0u8; u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize];
        c.read_exact(&mut body)?;
        let mut h = Hdr::new(raw::AUTH_CHALLENGE);
        h.aux = 36;
        Ok([h.bytes().as_slice(), &[7u8; 32], b"slow"].concat())
    };
    // Slow in the handshake: the challenge trickles in.
    let (in_auth, stop1) = trickling_listener(move |c| {
        let answer = challenge(c)?;
        trickle(c, &answer)
    });
    // Slow in the descriptor: a quick handshake, then a 1 MiB body that
    // trickles.
    let (in_desc, stop2) = trickling_listener(move |c| {
        use std::io::Write;
        let answer = challenge(c)?;
        c.write_all(&answer)?;
        let mut b = [0u8; 40];
        c.read_exact(&mut b)?;
        let mut h = Hdr::new(raw::DESC_REPLY);
        h.aux = 1 << 20;
        c.write_all(&h.bytes())?;
        trickle(c, &vec![0u8; 1 << 20])
    });
    let init = make_transfer_agent(
        Backend::Tcp,
        AgentConfig::new("init").with_connect_timeout(Duration::from_secs(1)),
    )
    .unwrap();
    for addr in [in_auth, in_desc] {
        let t0 = std::time::Instant::now();
        let err = init.load_remote_agent_by_connection(&addr).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{addr}: {err}");
        // Bounded by the deadline, not by the peer (which would go on for
        // two minutes); the margin is for a loaded machine.
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    }
    stop1.store(true, std::sync::atomic::Ordering::SeqCst);
    stop2.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// An outsider re-opening idle connections from eight sources (each past
/// its share) never keeps a good peer out: while the flood goes on, each
/// of six good peers loads the target at its first try, and the flood's
/// connections are the ones evicted.
#[test]
fn idle_connections_cannot_crowd_out_peers() {
    use std::net::{Ipv4Addr, SocketAddr, TcpStream};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let v = Victim::new(
        Backend::Tcp,
        AgentConfig::new("target")
            .with_connect_timeout(Duration::from_secs(600))
            .with_connection_limits(1024, 16)
            .with_pre_auth_limits(4, Duration::from_secs(600)),
    );
    let target: SocketAddr = v.conn().parse().unwrap();
    let (stop, opened) = (AtomicBool::new(false), AtomicUsize::new(0));
    let open = |source: u8| -> TcpStream {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        let from = SocketAddr::from((Ipv4Addr::new(127, 0, 0, source), 0));
        s.bind(&from.into()).unwrap();
        s.connect(&target.into()).unwrap();
        let s = TcpStream::from(s);
        s.set_nonblocking(true).unwrap();
        opened.fetch_add(1, Ordering::SeqCst);
        s
    };
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // Eight live connections per source, each re-opened once the
            // target closes it.
            let mut held: Vec<(u8, TcpStream)> = (3..11)
                .flat_map(|src| (0..8).map(move |_| src))
                .map(|src| (src, open(src)))
                .collect();
            while !stop.load(Ordering::SeqCst) {
                for (src, s) in &mut held {
                    let mut b = [0u8; 1];
                    if matches!(s.peek(&mut b), Ok(0)) {
                        *s = open(*src);
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        // The table is full of the flood (64 connections for 16 slots).
        while opened.load(Ordering::SeqCst) < 64 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let before = opened.load(Ordering::SeqCst);
        for i in 0..6 {
            let good =
                make_transfer_agent(Backend::Tcp, AgentConfig::new(format!("good{i}"))).unwrap();
            good.load_remote_agent_by_connection(&v.conn())
                .unwrap_or_else(|e| panic!("good peer {i} kept out during the flood: {e}"));
        }
        // The flood went on meanwhile: the target evicted its connections
        // and it opened new ones.
        assert!(opened.load(Ordering::SeqCst) > before);
        v.still_serves(AgentConfig::new("good-during"));
        stop.store(true, Ordering::SeqCst);
    });
    v.still_serves(AgentConfig::new("good-after"));
}

/// Entry point of the processes the local proof attacks run
/// (`local_proof::role_main`); a no-op in an ordinary run.
#[test]
fn rogue_role_entry() {
    if let Ok(role) = std::env::var("KVXFER_ROGUE_ROLE") {
        local_proof::role_main(&role);
    }
}

/// Entry point of the peer process (`common::PeerProc`); a no-op in an
/// ordinary run.
#[test]
fn peer_process_entry() {
    if std::env::var_os("KVXFER_PEER").is_some() {
        common::peer_main();
    }
}

/// A caller that submits faster than a peer completes meets back-pressure:
/// past `max_requests_in_flight` a submission fails at once with
/// `WouldBlock` (nothing submitted), and goes through again once requests
/// complete — memory stays bounded instead of growing per submission.
#[test]
fn submissions_past_the_in_flight_budget_would_block() {
    const LIMIT: usize = 8;
    let peer = common::PeerProc::spawn("target", 1 << 20, 1, &[]);
    let init = make_transfer_agent(
        Backend::Tcp,
        AgentConfig::new("init").with_max_requests_in_flight(LIMIT),
    )
    .unwrap();
    let src = vec![9u8; 4096];
    // SAFETY: `src` outlives `init`.
    unsafe { init.register_memory(&MemoryDescs::dram(&src)).unwrap() };
    let name = init.load_remote_agent_by_connection(&peer.conn).unwrap();
    let write = |i: u64| {
        TransferRequest::write(
            MemoryDescs::dram(&src),
            common::dram([(peer.addr + i * 4096, 4096)]),
            &name,
        )
        .with_sync_message(format!("{i}").into_bytes())
    };
    // A frozen target acknowledges nothing: every request stays in flight.
    peer.signal("STOP");
    let mut statuses: Vec<_> = (0..LIMIT as u64)
        .map(|i| init.submit_transfer(&write(i)).unwrap())
        .collect();
    for _ in 0..3 {
        let err = init.submit_transfer(&write(9)).unwrap_err();
        assert!(
            matches!(err, Error::WouldBlock { in_flight: LIMIT }),
            "{err}"
        );
        let err = init.notify_sync_message(&name, b"x".to_vec()).unwrap_err();
        assert!(matches!(err, Error::WouldBlock { .. }), "{err}");
    }
    // Dropping a status does not free its slot: the request is still in
    // flight.
    statuses.pop();
    assert!(matches!(
        init.submit_transfer(&write(9)),
        Err(Error::WouldBlock { .. })
    ));
    peer.signal("CONT");
    for st in statuses {
        st.wait_success(Duration::from_secs(60)).unwrap();
    }
    // The dropped one completes too; then the budget is whole again.
    let t0 = std::time::Instant::now();
    let more: Vec<_> = loop {
        match (0..LIMIT as u64)
            .map(|i| init.submit_transfer(&write(i)))
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(v) => break v,
            Err(e) => {
                assert!(t0.elapsed() < Duration::from_secs(60), "{e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    for st in more {
        st.wait_success(Duration::from_secs(60)).unwrap();
    }
}

/// When the target process runs out of file descriptors, the links it
/// already serves keep working, a new peer is turned away at once (not left
/// to time out in the listen queue), and once descriptors free up new
/// peers are served again.
#[test]
fn running_out_of_descriptors_keeps_serving_existing_links() {
    let peer = common::PeerProc::spawn("target", 1 << 20, 1, &[("KVXFER_PEER_NOFILE", "64")]);
    let cfg = |name: &str| AgentConfig::new(name).with_connect_timeout(Duration::from_secs(10));
    let a = make_transfer_agent(Backend::Tcp, cfg("a")).unwrap();
    let src = vec![5u8; 4096];
    // SAFETY: `src` outlives `a`.
    unsafe { a.register_memory(&MemoryDescs::dram(&src)).unwrap() };
    let name = a.load_remote_agent_by_connection(&peer.conn).unwrap();
    let write = || {
        a.submit_transfer(&TransferRequest::write(
            MemoryDescs::dram(&src),
            common::dram([(peer.addr, 4096)]),
            &name,
        ))
        .and_then(|st| st.wait_success(Duration::from_secs(60)))
    };
    write().unwrap();
    // Authenticated, idle connections until the target has no descriptor
    // left for one more (it closes it at once).
    let mut flood = Vec::new();
    let exhausted = (0..200).any(|i| {
        let mut c = RawConn::connect(&peer.conn);
        let served = c.auth(&format!("idle-{i}"), None).is_ok()
            && c.hello(&format!("idle-{i}"), i).is_some();
        flood.push(c);
        !served
    });
    assert!(exhausted, "200 connections did not exhaust 64 descriptors");
    // The link already open still works.
    write().unwrap();
    // A new peer is turned away, not left waiting for its timeout.
    let b = make_transfer_agent(Backend::Tcp, cfg("b")).unwrap();
    let err = b.load_remote_agent_by_connection(&peer.conn).unwrap_err();
    assert!(!matches!(err, Error::Timeout { .. }), "{err}");
    // Descriptors come back: served again.
    drop(flood);
    let t0 = std::time::Instant::now();
    while let Err(e) = b.load_remote_agent_by_connection(&peer.conn) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "never served again: {e}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    write().unwrap();
}

/// A field of `/proc/<pid>/status` (kB for memory, a count for threads).
pub(crate) fn proc_status(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The memory-exhaustion attack of the hardening issue against a target
/// process with the default limits: 58 commits of 16 MiB sync messages
/// whose data never comes, on one connection. The target stays within its
/// per-peer budget (256 MiB), its threads stay few, and it still serves.
#[test]
fn a_sync_message_flood_leaves_the_target_bounded() {
    let mut peer = common::PeerProc::spawn("target", 1 << 20, 1, &[]);
    let pid = peer.pid();
    let (rss0, threads0) = (proc_status(pid, "VmRSS:"), proc_status(pid, "Threads:"));
    let mut c = RawConn::connect(&peer.conn);
    c.auth("mallory", None).unwrap();
    c.hello("mallory", 5).unwrap();
    let body = vec![0x33u8; 16 << 20];
    for req in 1..=58u64 {
        let mut commit = Hdr::new(raw::COMMIT);
        commit.flags = 1 | 0x80;
        commit.id = req;
        commit.len = 1;
        commit.aux = body.len() as u32;
        c.send(commit, &body).unwrap();
    }
    // A data-less request after them (commit, then its one fence): once
    // it is acknowledged, every commit before it on this connection has
    // been read.
    let mut commit = Hdr::new(raw::COMMIT);
    commit.flags = 1;
    commit.id = 1 << 40;
    commit.len = 1;
    c.send(commit, &[]).unwrap();
    let mut fence = Hdr::new(10);
    fence.id = 1 << 40;
    c.send(fence, &[]).unwrap();
    let a = c.recv().unwrap();
    assert_eq!((a.kind, a.id), (raw::ACK, 1 << 40));
    let (rss, threads) = (proc_status(pid, "VmRSS:"), proc_status(pid, "Threads:"));
    let grown_mib = rss.saturating_sub(rss0) / 1024;
    assert!(grown_mib < 320, "the target grew by {grown_mib} MiB");
    assert!(threads <= threads0 + 4, "threads {threads0} -> {threads}");
    peer_still_serves(&peer);
    drop(c);
    peer.kill();
}

/// A good peer's write to the target process `peer` lands.
pub(crate) fn peer_still_serves(peer: &common::PeerProc) {
    let good = make_transfer_agent(Backend::Tcp, AgentConfig::new("good")).unwrap();
    let src = vec![0x44u8; 4096];
    // SAFETY: `src` outlives `good`.
    unsafe { good.register_memory(&MemoryDescs::dram(&src)).unwrap() };
    let name = good.load_remote_agent_by_connection(&peer.conn).unwrap();
    good.submit_transfer(&TransferRequest::write(
        MemoryDescs::dram(&src),
        common::dram([(peer.addr, 4096)]),
        &name,
    ))
    .unwrap()
    .wait_success(Duration::from_secs(60))
    .unwrap();
}
