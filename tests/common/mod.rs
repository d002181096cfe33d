//! Test harness: a peer agent in a separate process, driven over its
//! stdin/stdout, plus a deterministic byte pattern.
//!
//! The peer is this same test binary re-executed with `KVXFER_PEER=1` and
//! `--exact peer_process_entry`; that entry point runs [`peer_main`].
#![allow(dead_code)]

pub mod etcd;
pub mod faults;
pub mod proxy;
pub mod raw;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kvxfer::{AgentConfig, Backend, MemoryDesc, MemoryDescs, MemoryType, TransferAgent};

/// The backend the suite runs on (`KVXFER_TEST_BACKEND`, default `tcp`).
pub fn backend() -> Backend {
    std::env::var("KVXFER_TEST_BACKEND")
        .unwrap_or_else(|_| "tcp".into())
        .parse()
        .expect("KVXFER_TEST_BACKEND")
}

/// Whether the suite's data path moves data without the target's CPU:
/// RDMA, and libfabric on a NIC's provider (`verbs`, `efa`).
pub fn target_cpu_free() -> bool {
    match backend() {
        Backend::Rdma => true,
        Backend::Fabric => std::env::var("KVXFER_FABRIC_PROVIDER")
            .is_ok_and(|p| p.starts_with("verbs") || p.starts_with("efa")),
        _ => false,
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The pattern byte at absolute offset `off` for `seed`.
pub fn pattern_byte(seed: u64, off: u64) -> u8 {
    splitmix(seed ^ (off / 8).wrapping_mul(0x1000_0000_01B3)).to_le_bytes()[(off % 8) as usize]
}

/// Fills `buf`, which sits at offset `base` of the patterned space.
pub fn fill(buf: &mut [u8], seed: u64, base: u64) {
    let mut i = 0usize;
    while i < buf.len() {
        let off = base + i as u64;
        if off.is_multiple_of(8) && i + 8 <= buf.len() {
            let w = splitmix(seed ^ (off / 8).wrapping_mul(0x1000_0000_01B3));
            buf[i..i + 8].copy_from_slice(&w.to_le_bytes());
            i += 8;
        } else {
            buf[i] = pattern_byte(seed, off);
            i += 1;
        }
    }
}

/// First offset where `buf` (at `base`) departs from the pattern.
pub fn first_mismatch(buf: &[u8], seed: u64, base: u64) -> Option<usize> {
    let mut i = 0usize;
    while i < buf.len() {
        let off = base + i as u64;
        if off.is_multiple_of(8) && i + 8 <= buf.len() {
            let w = splitmix(seed ^ (off / 8).wrapping_mul(0x1000_0000_01B3)).to_le_bytes();
            if buf[i..i + 8] != w {
                return Some(i + (0..8).find(|&k| buf[i + k] != w[k]).unwrap_or(0));
            }
            i += 8;
        } else {
            if buf[i] != pattern_byte(seed, off) {
                return Some(i);
            }
            i += 1;
        }
    }
    None
}

/// FNV-1a over `buf`.
pub fn fnv(buf: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in buf {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The value of the first metric line that starts with `name` (0 when
/// there is none).
pub fn counter(a: &dyn kvxfer::TransferAgent, name: &str) -> u64 {
    a.metrics_text()
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse().expect("a counter's value"))
}

/// An initiator's count of requests copied through a mapped shared pool.
pub fn pooled_copies(a: &dyn kvxfer::TransferAgent) -> u64 {
    counter(a, "kvxfer_shm_pool_copies_total")
}

/// A new agent in this process, on the suite's backend, with the RDMA
/// progress mode `KVXFER_TEST_RDMA_PROGRESS` names, the queue pairs per
/// peer `KVXFER_TEST_RDMA_QPS` asks for, and shared receive queues off when
/// `KVXFER_TEST_RDMA_SRQ=0` (default: the library's).
pub fn local_agent(
    name: &str,
    tweak: impl FnOnce(AgentConfig) -> AgentConfig,
) -> Box<dyn TransferAgent> {
    let mut cfg = AgentConfig::new(name);
    if let Ok(l) = std::env::var("KVXFER_TEST_LISTEN") {
        cfg = cfg.with_listen(l.parse().expect("KVXFER_TEST_LISTEN"));
    }
    if let Ok(p) = std::env::var("KVXFER_TEST_RDMA_PROGRESS") {
        cfg = cfg.with_rdma_progress(p.parse().expect("KVXFER_TEST_RDMA_PROGRESS"));
    }
    if let Ok(n) = std::env::var("KVXFER_TEST_RDMA_QPS") {
        cfg = cfg.with_rdma_qps_per_peer(n.parse().expect("KVXFER_TEST_RDMA_QPS"));
    }
    if let Ok(v) = std::env::var("KVXFER_TEST_RDMA_SRQ") {
        cfg = cfg.with_rdma_srq(v != "0");
    }
    if let Ok(ms) = std::env::var("KVXFER_TEST_CONNECT_TIMEOUT_MS") {
        let ms = ms.parse().expect("KVXFER_TEST_CONNECT_TIMEOUT_MS");
        cfg = cfg.with_connect_timeout(Duration::from_millis(ms));
    }
    kvxfer::make_transfer_agent(backend(), tweak(cfg)).expect("agent")
}

/// A new initiator agent "init" with `src` registered, connected to `peer`;
/// returns it and the peer's agent name. Declare `src` before the call so
/// that it outlives the agent.
pub fn connect(peer: &PeerProc, src: &[u8]) -> (Box<dyn TransferAgent>, String) {
    let agent = local_agent("init", |c| c);
    register(agent.as_ref(), src);
    let name = agent
        .load_remote_agent_by_connection(&peer.conn)
        .expect("load peer");
    assert_eq!(
        agent.remote_transport(&name).unwrap(),
        expected_transport(),
        "data path chosen for a peer on this host"
    );
    (agent, name)
}

/// The data path the suite's backend must choose for a peer on this host.
pub fn expected_transport() -> &'static str {
    match backend() {
        Backend::Tcp => "tcp",
        Backend::Rdma => "rdma",
        Backend::Fabric => "fabric",
        Backend::InProcess => "inproc",
        _ => "shm",
    }
}

/// Registers `buf` with `agent`.
pub fn register(agent: &dyn TransferAgent, buf: &[u8]) {
    // SAFETY: test buffers outlive the agent's use of them: each test drops
    // or deregisters before freeing, and does not touch a buffer while a
    // transfer on it is in flight.
    unsafe {
        agent
            .register_memory(&MemoryDescs::dram(buf))
            .expect("register")
    };
}

/// Deregisters `buf` once nothing holds it (it fails `RegionBusy` until
/// then), within `within`: for a region whose request failed while a
/// transport may still move it (the libfabric transport's WRITEs to a peer
/// gone or stopped, held until the provider gives them back).
pub fn deregister_once_free(agent: &dyn TransferAgent, buf: &[u8], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        match agent.deregister_memory(&MemoryDescs::dram(buf)) {
            Ok(()) => return,
            Err(e @ kvxfer::Error::RegionBusy { .. }) => {
                assert!(
                    Instant::now() < deadline,
                    "still held after {within:?}: {e}"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("deregistering: {e}"),
        }
    }
}

/// Host descriptors for `(addr, len)` pairs.
pub fn dram(pairs: impl IntoIterator<Item = (u64, u64)>) -> MemoryDescs {
    MemoryDescs::new(
        MemoryType::Dram,
        pairs
            .into_iter()
            .map(|(a, l)| MemoryDesc::new(a, l, 0))
            .collect(),
    )
}

// ---------------------------------------------------------------------------
// The peer process.
// ---------------------------------------------------------------------------

/// A peer agent running in a child process, with one registered buffer
/// filled with the pattern of `seed`.
pub struct PeerProc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    /// The peer's agent name.
    pub name: String,
    /// Its connection info.
    pub conn: String,
    /// Address of its registered buffer.
    pub addr: u64,
    /// Length of its registered buffer.
    pub len: u64,
    exe_copy: Option<std::path::PathBuf>,
}

const REPLY: &str = "@@";

impl PeerProc {
    /// Starts a peer with a `len`-byte buffer patterned with `seed`.
    pub fn spawn(name: &str, len: u64, seed: u64, env: &[(&str, &str)]) -> Self {
        Self::spawn_as(name, len, seed, env, None)
    }

    /// As [`spawn`](Self::spawn), in network namespace `netns` (made by
    /// the test; `ip netns exec`).
    pub fn spawn_in(netns: &str, name: &str, len: u64, seed: u64, env: &[(&str, &str)]) -> Self {
        Self::spawn_with(name, len, seed, env, None, Some(netns))
    }

    /// As [`spawn`](Self::spawn), running as user and group `uid` when given
    /// (the binary is copied where that user can execute it).
    pub fn spawn_as(
        name: &str,
        len: u64,
        seed: u64,
        env: &[(&str, &str)],
        uid: Option<u32>,
    ) -> Self {
        Self::spawn_with(name, len, seed, env, uid, None)
    }

    fn spawn_with(
        name: &str,
        len: u64,
        seed: u64,
        env: &[(&str, &str)],
        uid: Option<u32>,
        netns: Option<&str>,
    ) -> Self {
        let mut exe = std::env::current_exe().expect("current exe");
        let mut exe_copy = None;
        if uid.is_some() {
            use std::os::unix::fs::PermissionsExt;
            let dir = std::env::temp_dir().join(format!("kvxfer-peer-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
            let copy = dir.join(format!("peer-{name}"));
            std::fs::copy(&exe, &copy).unwrap();
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
            exe = copy.clone();
            exe_copy = Some(copy);
        }
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        // With two RDMA devices (the soft-RoCE guest), peers use the second
        // one, so traffic crosses between devices.
        if backend() == Backend::Rdma && std::path::Path::new("/sys/class/infiniband/rxe1").exists()
        {
            cmd.env("KVXFER_RDMA_DEVICE", "rxe1");
        }
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid);
        }
        cmd.args([
            "--exact",
            "peer_process_entry",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("KVXFER_PEER", "1")
        .env("KVXFER_PEER_NAME", name)
        .env("KVXFER_PEER_LEN", len.to_string())
        .env("KVXFER_PEER_SEED", seed.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        // A copy of the executable just written can be briefly busy
        // (ETXTBSY): another test thread that forked while the copy's file
        // was open for writing holds it until that child execs.
        let mut tries = 0;
        let mut child = loop {
            match cmd.spawn() {
                Ok(c) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("spawn peer: {e:?}"),
            }
        };
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(p) = line.find(REPLY)
                    && tx.send(line[p + REPLY.len()..].to_string()).is_err()
                {
                    break;
                }
            }
        });
        let mut p = PeerProc {
            child,
            stdin,
            lines: rx,
            name: name.to_string(),
            conn: String::new(),
            addr: 0,
            len: 0,
            exe_copy,
        };
        let ready = p.line(Duration::from_secs(60)).expect("peer did not start");
        let f: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(f[0], "READY", "{ready}");
        p.conn = f[1].to_string();
        p.addr = f[2].parse().unwrap();
        p.len = f[3].parse().unwrap();
        p
    }

    /// The next reply line, if one arrives in time.
    pub fn line(&mut self, timeout: Duration) -> Option<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Sends a command and returns its reply.
    pub fn cmd(&mut self, c: &str) -> String {
        writeln!(self.stdin, "{c}").expect("peer stdin");
        self.stdin.flush().unwrap();
        self.line(Duration::from_secs(120))
            .unwrap_or_else(|| panic!("peer gave no reply to {c:?}"))
    }

    /// Descriptor of `[off, off + len)` of the peer's buffer.
    pub fn range(&self, off: u64, len: u64) -> MemoryDescs {
        assert!(off + len <= self.len);
        dram([(self.addr + off, len)])
    }

    /// The peer's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal to the peer process; `STOP` returns once it has
    /// stopped.
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(st.success());
        if sig == "STOP" {
            // `kill` returns once the signal is sent, not once every
            // thread of the peer has stopped (one may still answer a
            // request): wait for the stop itself.
            let mut status = 0;
            // SAFETY: waits for our own child, writing one int.
            let r = unsafe { libc::waitpid(self.pid() as i32, &mut status, libc::WUNTRACED) };
            assert_eq!(r, self.pid() as i32, "waiting for the peer to stop");
            assert!(
                libc::WIFSTOPPED(status),
                "the peer did not stop: {status:#x}"
            );
        }
    }

    /// Kills the peer and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PeerProc {
    /// Asks the peer to quit (killing it after 10 s) and fails the test if
    /// it had crashed: a peer ends by `quit` or by a kill, never otherwise
    /// (libfabric's `psm3` provider, loaded with the others, turns a crash
    /// into exit status 1).
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
        let end = self.child.wait();
        if !std::thread::panicking() {
            use std::os::unix::process::ExitStatusExt;
            let st = end.expect("peer status");
            assert!(
                st.success() || st.signal() == Some(libc::SIGKILL),
                "peer process {:?} crashed: {st}",
                self.name
            );
        }
        if let Some(copy) = self.exe_copy.take() {
            let _ = std::fs::remove_file(&copy);
            if let Some(dir) = copy.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// A buffer shared between the command loop and the sync watcher.
#[derive(Clone, Copy)]
struct Shared {
    ptr: usize,
    len: usize,
}

impl Shared {
    /// A snapshot of bytes `[off, off + len)`, read with volatile loads since
    /// the agent may be writing them concurrently.
    fn snapshot(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len);
        (off..off + len)
            // SAFETY: in bounds of the leaked buffer, which lives for the
            // whole process; volatile reads tolerate concurrent writes by the
            // kernel on behalf of the agent.
            .map(|i| unsafe { std::ptr::read_volatile((self.ptr + i) as *const u8) })
            .collect()
    }
}

/// Body of the peer process. Commands, one per line on stdin; each reply
/// is one stdout line starting with `@@`:
///
/// - `check SEED OFF LEN` → `OK` or `BAD <offset>`
/// - `hash` → FNV-1a of the whole buffer
/// - `fill SEED` → `OK`
/// - `dereg` → `OK` or `ERR <error>`
/// - `desc` → the encoded agent descriptor in hex
/// - `watch` → `OK`, then for each sync message received
///   `MSG <from> <text> <verdict>`, where a message `seed:S` is checked
///   against the whole buffer at the moment it is taken (`OK`/`BAD@off`)
/// - `msgs` → every message received so far, `from=text` space-separated
/// - `quit`
pub fn peer_main() {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k}"));
    let name = var("KVXFER_PEER_NAME");
    let len: usize = var("KVXFER_PEER_LEN").parse().unwrap();
    let seed: u64 = var("KVXFER_PEER_SEED").parse().unwrap();
    if let Ok(n) = std::env::var("KVXFER_PEER_NOFILE") {
        // A small descriptor limit, for the tests that exhaust it.
        let n: u64 = n.parse().unwrap();
        let lim = libc::rlimit {
            rlim_cur: n,
            rlim_max: n,
        };
        // SAFETY: a plain system call with a valid pointer to a local.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    }
    let agent: &'static dyn TransferAgent = Box::leak(local_agent(&name, |c| c));
    // KVXFER_PEER_POOL=rw|ro: the buffer is a shared pool, shared so.
    let pool = std::env::var("KVXFER_PEER_POOL").ok().map(|v| {
        let access = match v.as_str() {
            "ro" => kvxfer::PoolAccess::ReadOnly,
            _ => kvxfer::PoolAccess::ReadWrite,
        };
        (
            &*Box::leak(Box::new(kvxfer::SharedPool::new(len).unwrap())),
            access,
        )
    });
    let buf: &'static mut [u8] = match pool {
        // SAFETY: the pool is leaked, so its `len` bytes stay mapped for the
        // process's life; only this slice names them here.
        Some((p, _)) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) },
        None => Box::leak(vec![0u8; len].into_boxed_slice()),
    };
    fill(buf, seed, 0);
    let shared = Shared {
        ptr: buf.as_ptr() as usize,
        len,
    };
    let region = MemoryDescs::dram(buf);
    let register = || match pool {
        Some((p, access)) => agent.register_shared_pool(p, access).map(drop),
        // SAFETY: the buffer is leaked, so it lives as long as the process;
        // the process only reads it through volatile snapshots.
        None => unsafe { agent.register_memory(&region) },
    };
    register().expect("register");
    let out = |s: String| {
        let mut o = std::io::stdout().lock();
        writeln!(o, "\n{REPLY}{s}").unwrap();
        o.flush().unwrap();
    };
    out(format!(
        "READY {} {} {}",
        agent.local_connection_info(),
        shared.ptr,
        len
    ));
    let remote: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.first().copied() {
            Some("check") => {
                let (s, off, n): (u64, usize, usize) = (
                    f[1].parse().unwrap(),
                    f[2].parse().unwrap(),
                    f[3].parse().unwrap(),
                );
                let snap = shared.snapshot(off, n);
                out(match first_mismatch(&snap, s, off as u64) {
                    None => "OK".into(),
                    Some(i) => format!("BAD {}", off + i),
                });
            }
            Some("hash") => out(format!("{}", fnv(&shared.snapshot(0, len)))),
            Some("count") => {
                // Bytes of [off, off + n) equal to the pattern of seed s.
                let (s, off, n): (u64, usize, usize) = (
                    f[1].parse().unwrap(),
                    f[2].parse().unwrap(),
                    f[3].parse().unwrap(),
                );
                let snap = shared.snapshot(off, n);
                let mut want = vec![0u8; n];
                fill(&mut want, s, off as u64);
                out(format!(
                    "{}",
                    snap.iter().zip(&want).filter(|(a, b)| a == b).count()
                ));
            }
            Some("fill") => {
                let s: u64 = f[1].parse().unwrap();
                let mut v = vec![0u8; len];
                fill(&mut v, s, 0);
                for (i, b) in v.into_iter().enumerate() {
                    // SAFETY: in bounds of the leaked buffer; no transfer is
                    // in flight while a test asks for a fill.
                    unsafe { std::ptr::write_volatile((shared.ptr + i) as *mut u8, b) };
                }
                out("OK".into());
            }
            Some("dereg") => out(match agent.deregister_memory(&region) {
                Ok(()) => "OK".into(),
                Err(e) => format!("ERR {e}"),
            }),
            Some("reg") => out(match register() {
                Ok(()) => "OK".into(),
                Err(e) => format!("ERR {e}"),
            }),
            Some("desc") => out(agent
                .local_agent_desc()
                .encode()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()),
            Some("watch") => {
                std::thread::spawn(move || {
                    loop {
                        for (from, msgs) in agent.wait_sync_messages(Duration::from_millis(50)) {
                            for m in msgs {
                                let text = String::from_utf8_lossy(&m).into_owned();
                                let verdict = match text.strip_prefix("seed:") {
                                    Some(s) => {
                                        let s: u64 = s.parse().unwrap();
                                        match first_mismatch(&shared.snapshot(0, len), s, 0) {
                                            None => "OK".to_string(),
                                            Some(i) => format!("BAD@{i}"),
                                        }
                                    }
                                    None => "-".to_string(),
                                };
                                out(format!("MSG {from} {text} {verdict}"));
                            }
                        }
                    }
                });
                out("OK".into());
            }
            Some("msgs") => {
                let mut all: Vec<String> = Vec::new();
                for (from, msgs) in agent.take_sync_messages() {
                    for m in msgs {
                        all.push(format!("{from}={}", String::from_utf8_lossy(&m)));
                    }
                }
                out(all.join(" "));
            }
            Some("connect") => {
                *remote.lock().unwrap() = match agent.load_remote_agent_by_connection(f[1]) {
                    Ok(name) => {
                        out(format!("{name} {}", agent.remote_transport(&name).unwrap()));
                        Some(name)
                    }
                    Err(e) => {
                        out(format!("ERR {e}"));
                        None
                    }
                };
            }
            Some("put") => {
                // put REMOTE_ADDR LEN SEED: write our buffer's first LEN
                // bytes, patterned with SEED, to REMOTE_ADDR at the remote.
                let (addr, n, s): (u64, usize, u64) = (
                    f[1].parse().unwrap(),
                    f[2].parse().unwrap(),
                    f[3].parse().unwrap(),
                );
                let mut v = vec![0u8; n];
                fill(&mut v, s, 0);
                for (i, b) in v.into_iter().enumerate() {
                    // SAFETY: in bounds of the leaked buffer; no transfer is
                    // in flight.
                    unsafe { std::ptr::write_volatile((shared.ptr + i) as *mut u8, b) };
                }
                let name = remote.lock().unwrap().clone().expect("connect first");
                let req = kvxfer::TransferRequest::write(
                    dram([(shared.ptr as u64, n as u64)]),
                    dram([(addr, n as u64)]),
                    name,
                );
                out(
                    match agent
                        .submit_transfer(&req)
                        .and_then(|st| st.wait_success(Duration::from_secs(60)))
                    {
                        Ok(()) => "OK".into(),
                        Err(e) => format!("ERR {e}"),
                    },
                );
            }
            Some("quit") | None => break,
            Some(other) => out(format!("ERR unknown command {other}")),
        }
    }
    std::process::exit(0);
}
