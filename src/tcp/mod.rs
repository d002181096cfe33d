//! The TCP fallback backend.
//!
//! One listener per agent serves both the side channel (descriptor fetch)
//! and incoming data streams. To each remote agent an initiator opens a
//! *link*: `streams_per_peer` TCP connections, each with a sender thread
//! (writes frames and payloads straight from registered memory with one
//! `sendmsg` per up to 1024 iovecs) and a reader thread (lands READ data
//! straight in registered memory, routes acknowledgements). The target runs
//! one thread per incoming connection that lands WRITE payloads straight in
//! its registered memory after checking range and key, serves READs from it,
//! and acknowledges each request once all its segments have been processed.
//!
//! For peers on the same host the same agent can move data by cross-memory
//! attach instead (the `shm` backend, or `auto`): the initiator asks the
//! target to *grant* the ranges (the target checks them and pins the regions
//! against deregistration), copies with one `process_vm_writev`/`readv` per
//! up to 1024 descriptors, then commits over the socket as usual, so sync
//! messages and acknowledgements keep the same ordering guarantees.
//!
//! See `docs/architecture.md` for threads and ownership, and
//! `docs/wire-format.md` for the frames.

mod handshake;
mod local_proof;
mod rdma;
pub(crate) mod session;
mod sock;
pub(crate) mod wire;

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::agent::{
    AgentConfig, Completion, PreparedTransfer, Progress, SyncMessages, TransferAgent, TransferOp,
    TransferRequest, TransferStatus,
};
use crate::desc::{AgentDesc, BackendKind, LocalAccess, RdmaInfo};
use crate::error::{Error, RejectReason};
use crate::memory::{MemoryDescs, MemoryType, RegionMap};
use crate::registry::{Inbox, RegionGuard, Registry, Reservation, random_u64};
use crate::shm::{self, Direction, Piece};
use crate::small::{FastHash, Few};
use crate::verbs::{Device, QpInfo};

use session::{Finished, RequestTable};
use sock::{FrameReader, IdlePolicy, ProgressClock, UntilDeadline, iov, writev_all};
use wire::{
    CommitOp, Frame, HEADER_LEN, PROTOCOL_VERSION, WRITE_LIST_ENTRY, WRITE_LIST_MAX, status,
};

/// Largest segment sent inside a write list; bigger ones go alone (their
/// own `readv` costs little next to their payload).
const WRITE_LIST_PIECE_MAX: u64 = 64 << 10;

/// The backend name of an agent mode, for errors and logs.
fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Tcp => "tcp",
        Mode::Shm => "shm",
        Mode::Auto => "auto",
        Mode::Rdma => "rdma",
    }
}
/// Cross-memory requests smaller than this are copied by one thread.
const PARALLEL_COPY_MIN: u64 = 2 << 20;
/// Payload a stream writes between two looks at whether its request was
/// aborted (a job with more is written in batches of about this much).
const ABORT_CHECK_BYTES: u64 = 4 << 20;

/// Which data paths an agent offers and uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// TCP only.
    Tcp,
    /// Cross-memory attach only: every peer must be on this host.
    Shm,
    /// Cross-memory attach to peers on this host that allow it, RDMA to
    /// other peers when both have a device, TCP to the rest.
    Auto,
    /// RDMA only: every peer must be reachable over RDMA.
    Rdma,
}

/// How data reaches one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Tcp,
    Cma { pid: u32 },
    Rdma,
}
const SUPPORTED: &[MemoryType] = &[MemoryType::Dram];

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often a blocked reader wakes to check timeouts and shutdown.
fn tick(io_timeout: Duration) -> Duration {
    (io_timeout / 4).clamp(Duration::from_millis(10), Duration::from_millis(200))
}

/// A transfer agent over TCP. See the module docs.
///
/// # Resource cleanup
/// Dropping the agent stops the listener, closes every incoming connection
/// and every link to remote agents (their requests in flight fail with
/// [`Error::Closed`]), and joins all threads before returning.
pub struct TcpAgent {
    inner: Arc<Inner>,
    listener_thread: Option<JoinHandle<()>>,
    local_proof_thread: Option<JoinHandle<()>>,
}

struct Inner {
    config: AgentConfig,
    mode: Mode,
    instance: u64,
    /// Holds `instance`; peers read it back to prove direct access works.
    probe_word: Box<u64>,
    host: String,
    /// The RDMA device, for `rdma` and (when one exists) `auto` agents.
    device: Option<Arc<Device>>,
    endpoint: String,
    listen_addr: SocketAddr,
    registry: Registry,
    /// The last small RDMA request submitted, resolved (see
    /// [`SubmitCache`]).
    submit_cache: Mutex<Option<Box<SubmitCache>>>,
    inbox: Arc<Inbox>,
    peers: RwLock<HashMap<String, Arc<Peer>, FastHash>>,
    next_req: AtomicU64,
    closing: AtomicBool,
    server: Mutex<ServerConns>,
    sessions: Mutex<HashMap<(u64, u64), Arc<Session>>>,
    /// The shared receive queue and its thread, made at the first RDMA
    /// connection accepted (when `rdma_srq` is set and the device has
    /// shared receive queues).
    srq_rx: Mutex<SrqState>,
    /// The local socket on which same-host initiators prove which process
    /// they are (delegated copies); `None` when this agent never copies
    /// for initiators.
    local_proof: Option<Arc<local_proof::Listener>>,
    /// Delegated cross-memory copies this agent has done for initiators.
    delegated_copies: AtomicU64,
    /// Incoming connections that have not authenticated yet.
    unauthenticated: Arc<AtomicUsize>,
    /// Requests submitted whose outcome is not in (see
    /// [`AgentConfig::max_requests_in_flight`]).
    in_flight: Arc<AtomicUsize>,
}

/// One count in [`Inner::unauthenticated`], given back on drop.
struct Unauthenticated(Arc<AtomicUsize>);

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether incoming RDMA connections share a receive queue.
enum SrqState {
    /// Not tried yet.
    Untried,
    /// In use.
    Ready(Arc<SrqReceiver>),
    /// Off by configuration, or the device could not make one: each
    /// connection posts its own receive buffers and runs its own thread.
    PerQueuePair,
}

#[derive(Default)]
struct ServerConns {
    next_id: u64,
    socks: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl TcpAgent {
    /// A TCP-only agent: binds the listener and starts the accept thread.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`], or the bind error.
    pub fn new(config: AgentConfig) -> Result<Self, Error> {
        Self::with_mode(config, Mode::Tcp)
    }

    pub(crate) fn with_mode(mut config: AgentConfig, mode: Mode) -> Result<Self, Error> {
        config.validate()?;
        config.resolve_security()?;
        // Resolved once (the environment is read here, not per connection).
        config.rdma_ack_timeout = Some(config.effective_rdma_ack_timeout()?);
        let open = || Device::open(config.rdma_device.as_deref(), config.rdma_gid_index);
        let device = match mode {
            Mode::Rdma => Some(Arc::new(open().map_err(|e| Error::BackendUnavailable {
                backend: "rdma",
                reason: e.to_string(),
            })?)),
            Mode::Auto => match open() {
                Ok(d) => {
                    tracing::info!(agent = %config.name, device = d.name(), gid_index = d.gid_index(), "RDMA device with an active port found; auto uses rdma to remote hosts (shm on this host where possible)");
                    Some(Arc::new(d))
                }
                Err(e) => {
                    tracing::info!(agent = %config.name, reason = %e, "no RDMA device; auto uses shm and tcp");
                    None
                }
            },
            Mode::Tcp | Mode::Shm => None,
        };
        let listener = TcpListener::bind(config.listen)?;
        let listen_addr = listener.local_addr()?;
        let endpoint = match &config.advertise {
            Some(a) => a.clone(),
            None => listen_addr.to_string(),
        };
        let instance = random_u64() | 1;
        // Bound before any descriptor naming `instance` is published, so no
        // other process can hold the name first.
        let local_proof = match mode {
            Mode::Shm | Mode::Auto if config.shm_delegate => {
                match local_proof::Listener::bind(instance) {
                    Ok(l) => Some(Arc::new(l)),
                    Err(e) => {
                        tracing::info!(agent = %config.name, error = %e, "no local proof socket; this agent does not copy for initiators");
                        None
                    }
                }
            }
            _ => None,
        };
        let inner = Arc::new(Inner {
            mode,
            instance,
            probe_word: Box::new(instance),
            device,
            host: shm::host_id(),
            endpoint,
            listen_addr,
            registry: Registry::default(),
            submit_cache: Mutex::new(None),
            inbox: Arc::new(Inbox::new(
                config.inbox_max_bytes,
                config.inbox_max_bytes_per_peer,
            )),
            peers: RwLock::new(HashMap::default()),
            next_req: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            server: Mutex::new(ServerConns::default()),
            sessions: Mutex::new(HashMap::new()),
            srq_rx: Mutex::new(SrqState::Untried),
            local_proof,
            delegated_copies: AtomicU64::new(0),
            unauthenticated: Arc::new(AtomicUsize::new(0)),
            in_flight: Arc::new(AtomicUsize::new(0)),
            config,
        });
        let acceptor = Arc::clone(&inner);
        let listener_thread = std::thread::Builder::new()
            .name(format!("kvxfer-accept-{}", inner.config.name))
            .spawn(move || acceptor.accept_loop(listener))?;
        let local_proof_thread = match &inner.local_proof {
            Some(l) => {
                let (l, me) = (Arc::clone(l), Arc::clone(&inner));
                Some(
                    std::thread::Builder::new()
                        .name(format!("kvxfer-local-{}", inner.config.name))
                        .spawn(move || me.serve_local_proofs(&l))?,
                )
            }
            None => None,
        };
        tracing::debug!(agent = %inner.config.name, endpoint = %inner.endpoint, "tcp agent listening");
        Ok(Self {
            inner,
            listener_thread: Some(listener_thread),
            local_proof_thread,
        })
    }

    /// The address the listener is bound to.
    pub fn listen_addr(&self) -> SocketAddr {
        self.inner.listen_addr
    }
}

impl Drop for TcpAgent {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.closing.store(true, Ordering::SeqCst);
        // The cached resolution holds a link: it goes with the others.
        *lock(&inner.submit_cache) = None;
        // Wake the accept loop with a connection of our own; it sees
        // `closing` and returns, dropping the listener.
        let mut wake = inner.listen_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.listener_thread.take() {
            let _ = t.join();
        }
        if let (Some(l), Some(t)) = (&inner.local_proof, self.local_proof_thread.take()) {
            l.wake();
            let _ = t.join();
        }
        // Incoming connections: shut down, then join their threads.
        let (socks, threads) = {
            let mut s = lock(&inner.server);
            (std::mem::take(&mut s.socks), std::mem::take(&mut s.threads))
        };
        for s in socks.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in threads {
            let _ = t.join();
        }
        // Outgoing links.
        let peers: Vec<_> = inner
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .collect();
        for (_, p) in peers {
            if let Some(link) = lock(&p.link).take() {
                link.fail(Error::Closed);
                link.join();
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Target side: accept loop and per-connection service.
// ---------------------------------------------------------------------------

/// One initiator's link as seen by the target.
struct Session {
    remote: String,
    table: Mutex<RequestTable<HeldSync>>,
    /// Cross-memory grants held until each request's commit.
    grants: Mutex<HashMap<u64, Grants>>,
    streams: AtomicUsize,
    /// Names this session on the local proof socket (see [`local_proof`]).
    ticket: u128,
    /// The process proven to be this session's initiator, once it has
    /// presented the ticket on the local socket: the only process a
    /// delegated copy may touch.
    proven: Mutex<Option<local_proof::ProvenPeer>>,
    /// Whether this agent copies for the initiator (`Delegate`): the
    /// initiator's (pid, probe address, instance) and the probe's verdict,
    /// decided on its first delegated request.
    delegate: Mutex<Option<(u32, u64, u64, bool)>>,
}

#[derive(Default)]
struct Grants {
    seen: u32,
    guards: Vec<RegionGuard>,
    /// The admitted ranges, `(addr, len)`: a delegated copy may write (or
    /// read) only inside them.
    spans: Vec<(u64, u64)>,
    refused: Option<RejectReason>,
}

struct ServerIdle<'a> {
    inner: &'a Inner,
    clock: &'a ProgressClock,
}

impl IdlePolicy for ServerIdle<'_> {
    fn on_idle(&mut self, mid_frame: bool) -> io::Result<()> {
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "agent closing",
            ));
        }
        if mid_frame && self.clock.idle() > self.inner.config.io_timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "initiator stalled in the middle of a frame",
            ));
        }
        Ok(())
    }
}

/// A sync message as the target holds it until its request finishes: the
/// bytes, and their room in the inbox.
type HeldSync = (Vec<u8>, Reservation);

/// The sync message a `Commit` or `Delegate` announced.
enum SyncBody {
    /// None announced.
    None,
    /// Read, with room in the inbox.
    Held(HeldSync),
    /// Skipped: no room for it (the request fails with this reason).
    Refused(RejectReason),
}

/// Reads the sync message a `Commit` or `Delegate` announces (none: no
/// body allowed) into room reserved for it in `inbox`; without room, skips
/// it.
fn read_sync(
    reader: &mut FrameReader<'_>,
    inbox: &Arc<Inbox>,
    from: &str,
    has_sync: bool,
    sync_len: u32,
    idle: &mut dyn IdlePolicy,
) -> io::Result<SyncBody> {
    if !has_sync {
        return if sync_len != 0 {
            Err(violation("a body without a sync message"))
        } else {
            Ok(SyncBody::None)
        };
    }
    match inbox.reserve(from, u64::from(sync_len)) {
        Ok(room) => Ok(SyncBody::Held((
            reader.read_vec(sync_len as usize, idle)?,
            room,
        ))),
        Err(reason) => {
            tracing::debug!(remote = %from, sync_len, %reason, "refused a sync message");
            reader.discard(u64::from(sync_len), idle)?;
            Ok(SyncBody::Refused(reason))
        }
    }
}

/// Records the commit of `req` with its sync message.
fn commit(
    session: &Session,
    req: u64,
    segments: u64,
    sync: SyncBody,
) -> io::Result<Option<Finished<HeldSync>>> {
    let mut table = lock(&session.table);
    let sync = match sync {
        SyncBody::None => None,
        SyncBody::Held(h) => Some(h),
        SyncBody::Refused(reason) => {
            table.segments(req, 0, Err(reason)).map_err(violation)?;
            None
        }
    };
    table.commit(req, segments, sync).map_err(violation)
}

fn violation(detail: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail.into())
}

/// Sends header-only frames.
fn send_frames(
    sock: &TcpStream,
    frames: &[[u8; HEADER_LEN]],
    clock: &ProgressClock,
    io_timeout: Duration,
) -> io::Result<()> {
    let mut iovs: Vec<_> = frames.iter().map(|f| iov(f.as_ptr(), HEADER_LEN)).collect();
    // SAFETY: the iovecs point into `frames`, alive for the call.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs, clock, io_timeout) }
}

impl Inner {
    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        // A descriptor kept in reserve: when the process runs out, it is
        // given up to accept and close the waiting connection (its peer
        // learns at once instead of timing out), then taken again.
        let mut reserve = std::fs::File::open("/dev/null").ok();
        for conn in listener.incoming() {
            if self.closing.load(Ordering::SeqCst) {
                break;
            }
            let sock = match conn {
                Ok(s) => s,
                Err(e) => {
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    tracing::warn!(agent = %self.config.name, error = %e, "accept failed");
                    if out_of_fds && reserve.take().is_some() {
                        drop(listener.accept());
                        reserve = std::fs::File::open("/dev/null").ok();
                    } else {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    continue;
                }
            };
            let mut server = lock(&self.server);
            server.threads.retain(|t| !t.is_finished());
            if server.socks.len() >= self.config.max_incoming_connections {
                tracing::warn!(agent = %self.config.name, limit = self.config.max_incoming_connections, peer = ?sock.peer_addr().ok(), "too many incoming connections; closing a new one");
                continue;
            }
            if self.unauthenticated.fetch_add(1, Ordering::SeqCst)
                >= self.config.max_unauthenticated
            {
                self.unauthenticated.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(agent = %self.config.name, limit = self.config.max_unauthenticated, peer = ?sock.peer_addr().ok(), "too many connections still authenticating; closing a new one");
                continue;
            }
            let pending_auth = Unauthenticated(Arc::clone(&self.unauthenticated));
            let id = server.next_id;
            server.next_id += 1;
            let Ok(clone) = sock.try_clone() else {
                continue;
            };
            server.socks.insert(id, clone);
            let me = Arc::clone(&self);
            let spawned = std::thread::Builder::new()
                .name(format!("kvxfer-serve-{}", self.config.name))
                .spawn(move || {
                    if let Err(e) = me.serve(&sock, pending_auth) {
                        tracing::debug!(agent = %me.config.name, error = %e, "incoming connection ended");
                    }
                    lock(&me.server).socks.remove(&id);
                });
            match spawned {
                Ok(t) => server.threads.push(t),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot spawn connection thread");
                    server.socks.remove(&id);
                }
            }
        }
    }

    fn serve(&self, sock: &TcpStream, pending_auth: Unauthenticated) -> io::Result<()> {
        sock.set_nodelay(true)?;
        sock.set_read_timeout(Some(tick(self.config.io_timeout)))?;
        sock.set_write_timeout(Some(tick(self.config.io_timeout)))?;
        let clock = ProgressClock::new();
        let mut idle = ServerIdle {
            inner: self,
            clock: &clock,
        };
        let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
        // Nothing is answered before the initiator has authenticated, and
        // it must do so within the connect timeout.
        let stop = || self.closing.load(Ordering::Relaxed);
        reader.set_deadline(Some(
            std::time::Instant::now() + self.config.connect_timeout,
        ));
        let verdict = handshake::respond(
            sock.as_fd(),
            &mut reader,
            &stop,
            self.config.credential.as_ref(),
            &self.config.name,
            &clock,
            self.config.io_timeout,
        );
        reader.set_deadline(None);
        drop(pending_auth);
        let authenticated = match verdict? {
            handshake::Verdict::Accepted(name) => name,
            handshake::Verdict::Refused(why) => {
                tracing::warn!(agent = %self.config.name, peer = ?sock.peer_addr().ok(), %why, "refused an unauthenticated connection");
                return Ok(());
            }
        };
        loop {
            let Some(raw) = reader.next_header(&mut idle)? else {
                return Ok(());
            };
            match Frame::decode(&raw).map_err(|e| violation(e.to_string()))? {
                Frame::DescRequest => {
                    let body = self.local_desc().encode();
                    let hdr = Frame::DescReply {
                        body_len: body.len() as u32,
                    }
                    .encode();
                    let mut iovs = [
                        iov(hdr.as_ptr(), HEADER_LEN),
                        iov(body.as_ptr(), body.len()),
                    ];
                    // SAFETY: both iovecs point into live locals.
                    unsafe {
                        writev_all(sock.as_raw_fd(), &mut iovs, &clock, self.config.io_timeout)?
                    };
                }
                Frame::Hello {
                    instance,
                    expect,
                    version,
                    link,
                    stream: _,
                    name_len,
                } => {
                    let name = reader.read_vec(name_len as usize, &mut idle)?;
                    if name != authenticated.as_bytes() {
                        return Err(violation(format!(
                            "hello names agent {:?}, but the connection authenticated as {authenticated:?}",
                            String::from_utf8_lossy(&name)
                        )));
                    }
                    let st = if version != PROTOCOL_VERSION {
                        status::BAD_VERSION
                    } else if expect != 0 && expect != self.instance {
                        status::STALE_INSTANCE
                    } else {
                        status::OK
                    };
                    let hello_ack = |status, ticket| {
                        send_frames(
                            sock,
                            &[Frame::HelloAck {
                                instance: self.instance,
                                status,
                                ticket,
                            }
                            .encode()],
                            &clock,
                            self.config.io_timeout,
                        )
                    };
                    if st != status::OK {
                        return hello_ack(st, 0);
                    }
                    let key = (instance, link);
                    let session = {
                        let mut sessions = lock(&self.sessions);
                        let s = sessions.entry(key).or_insert_with(|| {
                            Arc::new(Session {
                                remote: authenticated.clone(),
                                table: Mutex::new(RequestTable::default()),
                                grants: Mutex::new(HashMap::new()),
                                streams: AtomicUsize::new(0),
                                ticket: u128::from_le_bytes(crate::auth::random_bytes()),
                                proven: Mutex::new(None),
                                delegate: Mutex::new(None),
                            })
                        });
                        // Another agent's session: a connection joins only
                        // the sessions of the agent it authenticated as.
                        if s.remote != authenticated {
                            let owner = s.remote.clone();
                            drop(sessions);
                            return Err(violation(format!(
                                "{authenticated:?} tried to join a session of {owner:?}"
                            )));
                        }
                        s.streams.fetch_add(1, Ordering::SeqCst);
                        Arc::clone(s)
                    };
                    if let Err(e) = hello_ack(status::OK, session.ticket) {
                        if session.streams.fetch_sub(1, Ordering::SeqCst) == 1 {
                            lock(&self.sessions).remove(&key);
                        }
                        return Err(e);
                    }
                    let r = self.serve_data(sock, &mut reader, &mut idle, &session);
                    if session.streams.fetch_sub(1, Ordering::SeqCst) == 1 {
                        lock(&self.sessions).remove(&key);
                    }
                    return r;
                }
                other => return Err(violation(format!("unexpected first frame {other:?}"))),
            }
        }
    }

    fn serve_data(
        &self,
        sock: &TcpStream,
        reader: &mut FrameReader<'_>,
        idle: &mut ServerIdle<'_>,
        session: &Session,
    ) -> io::Result<()> {
        let clock = idle.clock;
        // RDMA receive threads of this connection; stopped and joined when it
        // ends (dropping them).
        let mut rdma_receivers: Vec<RdmaReceiver> = Vec::new();
        loop {
            let Some(raw) = reader.next_header(idle)? else {
                return Ok(());
            };
            let finished = match Frame::decode(&raw).map_err(|e| violation(e.to_string()))? {
                Frame::Write {
                    req,
                    mem_type,
                    addr,
                    len,
                    key,
                } => {
                    let result = match self.registry.admit_remote(mem_type, addr, len, key) {
                        Ok(guard) => {
                            // SAFETY: `[addr, addr + len)` lies inside a region
                            // registered with this agent, whose registrant
                            // promised it stays valid for writes while
                            // registered; `guard` keeps it from being
                            // deregistered until the payload has landed.
                            unsafe { reader.read_into(addr as *mut u8, len as usize, idle)? };
                            drop(guard);
                            Ok(())
                        }
                        Err(reason) => {
                            tracing::debug!(remote = %session.remote, addr, len, %reason, "refused write segment");
                            reader.discard(len, idle)?;
                            Err(reason)
                        }
                    };
                    lock(&session.table)
                        .segment(req, result)
                        .map_err(violation)?
                }
                Frame::ReadReq {
                    req,
                    mem_type,
                    addr,
                    len,
                    key,
                } => {
                    let result = match self.registry.admit_remote(mem_type, addr, len, key) {
                        Ok(guard) => {
                            let hdr = Frame::ReadData {
                                req,
                                len,
                                status: status::OK,
                            }
                            .encode();
                            let mut iovs = [
                                iov(hdr.as_ptr(), HEADER_LEN),
                                iov(addr as *const u8, len as usize),
                            ];
                            // SAFETY: the payload range lies inside a region
                            // registered here and held by `guard`; the header
                            // is a live local.
                            unsafe {
                                writev_all(
                                    sock.as_raw_fd(),
                                    &mut iovs,
                                    clock,
                                    self.config.io_timeout,
                                )?
                            };
                            drop(guard);
                            Ok(())
                        }
                        Err(reason) => {
                            send_frames(
                                sock,
                                &[Frame::ReadData {
                                    req,
                                    len: 0,
                                    status: reason.code(),
                                }
                                .encode()],
                                clock,
                                self.config.io_timeout,
                            )?;
                            Err(reason)
                        }
                    };
                    lock(&session.table)
                        .segment(req, result)
                        .map_err(violation)?
                }
                Frame::Fence { req } => lock(&session.table)
                    .segment(req, Ok(()))
                    .map_err(violation)?,
                Frame::Abort { req, segments } => lock(&session.table)
                    .segments(req, segments, Err(RejectReason::Aborted))
                    .map_err(violation)?,
                Frame::WriteList {
                    req,
                    mem_type,
                    count,
                    total,
                    key,
                } => {
                    let table =
                        reader.read_vec_mid_frame(count as usize * WRITE_LIST_ENTRY, idle)?;
                    let WriteListTable { pieces, lo, hi } =
                        write_list_pieces(&table, total).map_err(violation)?;
                    // One admission for the span: a key names one region,
                    // so the span inside it puts every piece inside it.
                    let result = match self.registry.admit_remote(mem_type, lo, hi - lo, key) {
                        Ok(guard) => {
                            // SAFETY: every piece lies inside the admitted
                            // span of a registered region, writable while
                            // registered; `guard` holds the registration
                            // until the payload has landed.
                            unsafe { reader.read_into_many(&pieces, idle)? };
                            drop(guard);
                            Ok(())
                        }
                        Err(reason) => {
                            tracing::debug!(remote = %session.remote, lo, hi, %reason, "refused write list");
                            reader.discard(total, idle)?;
                            Err(reason)
                        }
                    };
                    lock(&session.table)
                        .segments(req, u64::from(count), result)
                        .map_err(violation)?
                }
                Frame::QpConnect { qpn, psn, mtu } => {
                    let gid: [u8; 16] = reader
                        .read_vec(16, idle)?
                        .try_into()
                        .map_err(|_| violation("short GID"))?;
                    let remote = QpInfo { qpn, psn, gid, mtu };
                    match self.accept_qp(&remote, &session.remote, sock) {
                        Ok((info, receiver)) => {
                            let hdr = Frame::QpAccept {
                                qpn: info.qpn,
                                psn: info.psn,
                                mtu: info.mtu,
                                status: status::OK,
                            }
                            .encode();
                            let mut iovs =
                                [iov(hdr.as_ptr(), HEADER_LEN), iov(info.gid.as_ptr(), 16)];
                            // SAFETY: both iovecs point into live locals.
                            unsafe {
                                writev_all(
                                    sock.as_raw_fd(),
                                    &mut iovs,
                                    clock,
                                    self.config.io_timeout,
                                )?
                            };
                            rdma_receivers.push(receiver);
                        }
                        Err(st) => send_frames(
                            sock,
                            &[Frame::QpAccept {
                                qpn: 0,
                                psn: 0,
                                mtu: 0,
                                status: st,
                            }
                            .encode()],
                            clock,
                            self.config.io_timeout,
                        )?,
                    }
                    None
                }
                Frame::Grant {
                    req,
                    mem_type,
                    addr,
                    len,
                    key,
                    total,
                } => {
                    let admitted = self.registry.admit_remote(mem_type, addr, len, key);
                    let answer = {
                        let mut grants = lock(&session.grants);
                        let g = grants.entry(req).or_default();
                        g.seen += 1;
                        match admitted {
                            Ok(guard) => {
                                g.guards.push(guard);
                                g.spans.push((addr, len));
                            }
                            Err(r) => {
                                g.refused.get_or_insert(r);
                            }
                        }
                        if g.seen < total {
                            None
                        } else if let Some(r) = g.refused {
                            grants.remove(&req);
                            Some(r.code())
                        } else {
                            Some(status::OK)
                        }
                    };
                    if let Some(st) = answer {
                        send_frames(
                            sock,
                            &[Frame::Granted { req, status: st }.encode()],
                            clock,
                            self.config.io_timeout,
                        )?;
                    }
                    None
                }
                Frame::Delegate {
                    req,
                    op,
                    count,
                    pid,
                    probe_addr,
                    instance,
                    sync_len,
                    has_sync,
                } => {
                    // The sync message may follow: no header read-ahead.
                    let table =
                        reader.read_vec_mid_frame(count as usize * wire::DELEGATE_ENTRY, idle)?;
                    let sync = read_sync(
                        reader,
                        &self.inbox,
                        &session.remote,
                        has_sync,
                        sync_len,
                        idle,
                    )?;
                    let answer = |st| {
                        send_frames(
                            sock,
                            &[Frame::Granted { req, status: st }.encode()],
                            clock,
                            self.config.io_timeout,
                        )
                    };
                    if !self.may_copy_for(session, pid, probe_addr, instance) {
                        answer(status::DELEGATE_REFUSED)?;
                        None
                    } else {
                        let spans = lock(&session.grants)
                            .get(&req)
                            .map(|g| g.spans.clone())
                            .unwrap_or_default();
                        let pieces = delegated_pieces(&table, &spans).map_err(violation)?;
                        let dir = match op {
                            CommitOp::Write => shm::Direction::Read,
                            CommitOp::Read => shm::Direction::Write,
                        };
                        // SAFETY: every local range lies inside a span granted
                        // for this request (checked above), in a region this
                        // agent registered, whose registrant promised it stays
                        // valid while registered; the request's grant guards
                        // keep it registered until the commit below.
                        let copied = unsafe {
                            shm::copy_parallel(
                                pid,
                                dir,
                                &pieces,
                                self.config.shm_copy_threads,
                                PARALLEL_COPY_MIN,
                                &|| false,
                            )
                        };
                        match copied {
                            Ok(_) => {
                                self.delegated_copies.fetch_add(1, Ordering::Relaxed);
                                answer(status::OK)?;
                                commit(session, req, 0, sync)?
                            }
                            Err(e) => {
                                tracing::warn!(agent = %self.config.name, remote = %session.remote, req, error = %e, "delegated cross-memory copy failed");
                                lock(&session.grants).remove(&req);
                                answer(status::DELEGATE_FAILED)?;
                                None
                            }
                        }
                    }
                }
                Frame::Commit {
                    req,
                    op: _,
                    segments,
                    sync_len,
                    has_sync,
                } => {
                    let sync = read_sync(
                        reader,
                        &self.inbox,
                        &session.remote,
                        has_sync,
                        sync_len,
                        idle,
                    )?;
                    commit(session, req, segments, sync)?
                }
                other => return Err(violation(format!("unexpected frame {other:?}"))),
            };
            if let Some(f) = finished {
                self.finish(sock, session, f, clock)?;
            }
        }
    }

    /// Whether this agent copies for the initiator of `session`, which says
    /// it is process `pid` with `instance` readable at `probe_addr`: only
    /// when delegation is on, the kernel proved on the local socket that
    /// `pid` is the session's initiator and it still lives, it is another
    /// process than this one, and the probe shows this process can reach it
    /// (decided once per session). A pid taken from the frame alone is
    /// never trusted: the copy runs with this process's privileges.
    fn may_copy_for(&self, session: &Session, pid: u32, probe_addr: u64, instance: u64) -> bool {
        if !self.config.shm_delegate {
            return false;
        }
        let proven = lock(&session.proven).as_ref().and_then(|p| p.live_pid());
        if proven != Some(pid) || pid == std::process::id() {
            tracing::warn!(agent = %self.config.name, remote = %session.remote, claimed = pid, ?proven, "refused a delegated copy: the initiator did not prove it is that process");
            return false;
        }
        let mut d = lock(&session.delegate);
        if let Some((p, a, i, ok)) = *d
            && (p, a, i) == (pid, probe_addr, instance)
        {
            return ok;
        }
        let access = LocalAccess {
            host: self.host.clone(),
            pid,
            probe_addr,
        };
        let ok = match shm::probe(&access, instance, &self.host) {
            Ok(()) => true,
            Err(why) => {
                tracing::info!(agent = %self.config.name, remote = %session.remote, %why, "not copying for this initiator; it copies itself");
                false
            }
        };
        *d = Some((pid, probe_addr, instance, ok));
        ok
    }

    /// Serves the local proof socket until the agent closes: a ticket binds
    /// the connecting process to its session, once.
    fn serve_local_proofs(&self, listener: &local_proof::Listener) {
        let stop = || self.closing.load(Ordering::SeqCst);
        listener.serve(self.config.connect_timeout, &stop, &|ticket, peer| {
            let session = lock(&self.sessions)
                .values()
                .find(|s| s.ticket == ticket)
                .cloned();
            let Some(session) = session else {
                return false;
            };
            let mut proven = lock(&session.proven);
            if proven.is_some() {
                return false;
            }
            tracing::debug!(agent = %self.config.name, remote = %session.remote, pid = ?peer.live_pid(), "initiator process proven");
            *proven = Some(peer);
            true
        });
    }

    fn finish(
        &self,
        sock: &TcpStream,
        session: &Session,
        f: Finished<HeldSync>,
        clock: &ProgressClock,
    ) -> io::Result<()> {
        // The initiator's direct copies are over: unpin before telling anyone.
        lock(&session.grants).remove(&f.req);
        if let (Ok(()), Some((msg, room))) = (&f.outcome, f.sync) {
            self.inbox.deliver(room, msg);
        }
        let st = match f.outcome {
            Ok(()) => status::OK,
            Err(r) => r.code(),
        };
        send_frames(
            sock,
            &[Frame::Ack {
                req: f.req,
                status: st,
            }
            .encode()],
            clock,
            self.config.io_timeout,
        )
    }

    /// Target side of `QpConnect`: a queue pair connected to the
    /// initiator's, receive buffers posted, and a thread that delivers the
    /// sync messages arriving as SENDs.
    fn accept_qp(
        &self,
        remote: &QpInfo,
        remote_name: &str,
        sock: &TcpStream,
    ) -> Result<(QpInfo, RdmaReceiver), u16> {
        let Some(dev) = self.device.as_ref() else {
            return Err(status::NO_RDMA);
        };
        let sink = SyncSink {
            inbox: Arc::clone(&self.inbox),
            remote: remote_name.to_owned(),
            sock: sock.try_clone().map_err(|_| status::QP_FAILED)?,
            io_timeout: self.config.io_timeout,
        };
        let refused = |e: crate::verbs::VerbsError| {
            tracing::warn!(remote = %remote_name, error = %e, "cannot accept an RDMA connection");
            status::QP_FAILED
        };
        if let Some(rx) = self.srq_receiver(dev) {
            let mut qp = dev.create_rc_on_srq(&rx.shared.srq).map_err(refused)?;
            qp.set_ack_timeout(ack_timeout(&self.config));
            qp.connect(remote).map_err(refused)?;
            let info = qp.info();
            lock(&rx.shared.conns).insert(info.qpn, Arc::new(sink));
            return Ok((
                info,
                RdmaReceiver::Shared {
                    qpn: info.qpn,
                    _qp: qp,
                    rx,
                },
            ));
        }
        let ack_timeout = ack_timeout(&self.config);
        let setup =
            || -> Result<(crate::verbs::RcQueuePair, rdma::MsgRing), crate::verbs::VerbsError> {
                // Receive events: the thread sleeps until a SEND lands.
                let mut qp = dev.create_rc_with_events(rdma::WINDOW, false, true)?;
                qp.set_ack_timeout(ack_timeout);
                qp.connect(remote)?;
                let ring = rdma::MsgRing::new(dev, rdma::RING)?;
                for slot in 0..rdma::RING {
                    // SAFETY: the ring lives in the receiver thread with the queue
                    // pair, and is dropped after it.
                    unsafe { qp.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX))? };
                }
                Ok((qp, ring))
            };
        let (qp, ring) = setup().map_err(refused)?;
        let info = qp.info();
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = ReceiverCtx {
            sink,
            stop: Arc::clone(&stop),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-rdma-recv-{remote_name}"))
            .spawn(move || ctx.run(qp, ring))
            .map_err(|_| status::QP_FAILED)?;
        Ok((
            info,
            RdmaReceiver::Own {
                stop,
                thread: Some(thread),
            },
        ))
    }

    /// The agent's shared receive queue and thread, made on first use;
    /// `None` when connections receive on their own queues (configuration,
    /// or a device that cannot make one: logged once).
    fn srq_receiver(&self, dev: &Arc<Device>) -> Option<Arc<SrqReceiver>> {
        let mut st = lock(&self.srq_rx);
        match &*st {
            SrqState::Ready(rx) => return Some(Arc::clone(rx)),
            SrqState::PerQueuePair => return None,
            SrqState::Untried => {}
        }
        if !self.config.rdma_srq {
            *st = SrqState::PerQueuePair;
            return None;
        }
        match SrqReceiver::start(dev, &self.config.name) {
            Ok(rx) => {
                tracing::info!(device = %dev.name(), depth = rx.shared.srq.depth(), "RDMA connections share one receive queue");
                *st = SrqState::Ready(Arc::clone(&rx));
                Some(rx)
            }
            Err(e) => {
                tracing::info!(device = %dev.name(), error = %e, "no shared receive queue; each RDMA connection posts its own receive buffers");
                *st = SrqState::PerQueuePair;
                None
            }
        }
    }

    fn local_desc(&self) -> AgentDesc {
        AgentDesc {
            name: self.config.name.clone(),
            instance: self.instance,
            backend: match self.mode {
                Mode::Shm => BackendKind::Shm,
                Mode::Rdma => BackendKind::Rdma,
                Mode::Tcp | Mode::Auto => BackendKind::Tcp,
            },
            endpoints: vec![self.endpoint.clone()],
            regions: self.registry.exported(),
            rdma: self.device.as_ref().map(|d| RdmaInfo {
                device: d.name().to_owned(),
            }),
            local_access: matches!(self.mode, Mode::Shm | Mode::Auto).then(|| LocalAccess {
                host: self.host.clone(),
                pid: std::process::id(),
                probe_addr: &*self.probe_word as *const u64 as u64,
            }),
        }
    }

    /// Chooses the data path to a remote agent (see [`Mode`]).
    fn choose_path(&self, desc: &AgentDesc) -> Result<Path, Error> {
        if self.mode == Mode::Tcp {
            return Ok(Path::Tcp);
        }
        let rdma_ok = self.device.is_some() && desc.rdma.is_some();
        if self.mode == Mode::Rdma {
            if !rdma_ok {
                return Err(Error::BackendUnavailable {
                    backend: "rdma",
                    reason: format!("remote agent {:?} has no RDMA device", desc.name),
                });
            }
            tracing::info!(agent = %self.config.name, remote = %desc.name, "data path: rdma");
            return Ok(Path::Rdma);
        }
        let verdict = match &desc.local_access {
            None => Err("the remote agent does not offer cross-memory access".to_string()),
            Some(a) => shm::probe(a, desc.instance, &self.host).map(|()| a.pid),
        };
        match (verdict, self.mode) {
            (Ok(pid), _) => {
                tracing::info!(agent = %self.config.name, remote = %desc.name, pid, "data path: shm (cross-memory attach)");
                Ok(Path::Cma { pid })
            }
            (Err(reason), Mode::Shm) => Err(Error::BackendUnavailable {
                backend: "shm",
                reason: format!("remote agent {:?}: {reason}", desc.name),
            }),
            (Err(reason), _) if rdma_ok => {
                tracing::info!(agent = %self.config.name, remote = %desc.name, %reason, "data path: rdma (shm not possible)");
                Ok(Path::Rdma)
            }
            (Err(reason), _) => {
                tracing::info!(agent = %self.config.name, remote = %desc.name, %reason, "data path: tcp (neither shm nor rdma possible)");
                Ok(Path::Tcp)
            }
        }
    }

    fn peer(&self, name: &str) -> Result<Arc<Peer>, Error> {
        self.peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::UnknownAgent(name.to_owned()))
    }
}

// ---------------------------------------------------------------------------
// Initiator side: peers, links, streams.
// ---------------------------------------------------------------------------

/// A loaded remote agent.
struct Peer {
    desc: AgentDesc,
    /// Exported regions: (access key, RDMA remote key).
    regions: RegionMap<(u64, Option<u32>)>,
    path: Path,
    link: Mutex<Option<Arc<Link>>>,
    /// Set when a newer load of the agent replaced this entry, or the agent
    /// was invalidated: prepared transfers resolved against it resolve
    /// again.
    retired: AtomicBool,
}

/// One outstanding request at the initiator. It completes when every
/// expected event (one acknowledgement, plus one per READ segment) has
/// arrived, so a failed request no longer touches local memory either.
struct Pending {
    completion: Arc<Completion>,
    outstanding: AtomicUsize,
    error: Mutex<Option<Error>>,
    /// Whether `error` holds one (set after it): finishing a request that
    /// did not fail takes no lock for it.
    failed: AtomicBool,
    guards: Mutex<Few<RegionGuard>>,
    /// Cross-memory path: the target's answer to the request's grants
    /// (made on first use: a channel is several allocations, which the
    /// other paths need not pay).
    granted: OnceLock<(Sender<u16>, Receiver<u16>)>,
    /// RDMA requests no waiter polls for (see [`Link::undriven`]): the
    /// link's count, decremented when this one finishes.
    undriven: Option<Arc<AtomicUsize>>,
}

impl Pending {
    fn granted(&self) -> &(Sender<u16>, Receiver<u16>) {
        self.granted.get_or_init(|| crossbeam_channel::bounded(1))
    }

    /// Records one event; returns true when it was the last.
    fn event(&self, result: Result<(), Error>) -> bool {
        if let Err(e) = result {
            lock(&self.error).get_or_insert(e);
            self.failed.store(true, Ordering::Release);
        }
        self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1
    }

    fn finish(&self, forced: Option<Error>) {
        lock(&self.guards).clear();
        let recorded = || {
            self.failed
                .load(Ordering::Acquire)
                .then(|| lock(&self.error).take())
                .flatten()
        };
        let outcome = match forced.or_else(recorded) {
            Some(e) => Err(e),
            None => Ok(()),
        };
        if self.completion.complete(outcome)
            && let Some(n) = &self.undriven
        {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

struct ReadSlot {
    req: u64,
    dst: u64,
    len: u64,
    pending: Arc<Pending>,
}

#[derive(Clone, Copy)]
struct Seg {
    mem_type: MemoryType,
    local: u64,
    remote: u64,
    len: u64,
    key: u64,
}

enum Tail {
    None,
    Commit {
        segments: u64,
        sync: Option<Vec<u8>>,
    },
    Fence,
}

/// A range the target must grant for a cross-memory request.
struct GrantRange {
    mem_type: MemoryType,
    addr: u64,
    len: u64,
    key: u64,
}

/// How a cross-memory request goes on after its grants and copy.
enum CmaOutcome {
    /// Commit it (after an `Abort` frame when `aborted`: its copy stopped
    /// or never began, and the target releases its grants and drops its
    /// sync message).
    Commit { aborted: bool },
    /// Nothing more to send: it has finished (refused, aborted before
    /// anything was sent), or the target copies and commits it.
    Done,
}

enum Job {
    /// Cross-memory request: grants, direct copy, commit.
    Cma {
        req: u64,
        op: TransferOp,
        pid: u32,
        pieces: Vec<Piece>,
        grants: Vec<GrantRange>,
        sync: Option<Vec<u8>>,
        /// Ask the target to copy (see [`should_delegate`]).
        delegate: bool,
        pending: Arc<Pending>,
    },
    Frames {
        req: u64,
        op: TransferOp,
        segs: Vec<Seg>,
        tail: Tail,
        pending: Arc<Pending>,
    },
    Stop,
}

struct StreamHandle {
    tx: Sender<Job>,
    reads: Mutex<VecDeque<ReadSlot>>,
    sock: TcpStream,
}

#[derive(Default)]
struct PendingTable {
    map: HashMap<u64, Arc<Pending>, FastHash>,
    broken: Option<Error>,
}

/// The connections from this agent to one remote agent.
struct Link {
    /// RDMA path: the connection's queue pair (posting, window, buffers).
    /// RDMA path: the link's queue pairs (empty on other paths); sync
    /// messages go on the first.
    rdma: Vec<rdma::RdmaConn>,
    /// Rotates the queue pair a request's first work request goes to.
    next_stripe: AtomicUsize,
    /// RDMA requests in flight whose waiters do not poll the completion
    /// queue themselves (large ones). While there are none, the progress
    /// threads stay off the completion queue (no completion events, no
    /// wake-ups competing with the waiting thread) and only look in now and
    /// then; submitting one wakes them.
    undriven: Arc<AtomicUsize>,
    /// The progress threads, to wake them.
    progress_threads: OnceLock<Vec<std::thread::Thread>>,
    remote: String,
    io_timeout: Duration,
    copy_threads: usize,
    /// This agent's probe address and instance, sent with `Delegate` so the
    /// target can prove it reaches this process; `None`: never delegate.
    delegate_probe: Option<(u64, u64)>,
    /// Cleared when the target refuses a delegated copy: later requests do
    /// not ask again.
    delegate_ok: AtomicBool,
    /// The agent's count of requests in flight.
    in_flight: Arc<AtomicUsize>,
    streams: Vec<StreamHandle>,
    pending: Mutex<PendingTable>,
    /// RDMA path, one queue pair: the express lane of small requests.
    express: ExpressLane,
    /// Set (under `pending`'s lock) when `pending.broken` is: a request's
    /// path reads it without the lock.
    broken: AtomicBool,
    clock: ProgressClock,
    alive: AtomicUsize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A link's express lane: one small request at a time — a single data work
/// request of at most four pieces, no sync message, its waiter polling the
/// completion queue — travels without a [`Pending`] record and a table
/// entry, and reuses the previous express request's status when its caller
/// has dropped it. What a latency-bound caller (one request, wait, the next)
/// submits; the record, the table and the status cost more than the post
/// itself (callgrind, soft-RoCE ping-pong: about 550 of 2,040 instructions a
/// request).
///
/// The lane takes no lock: its [`state`](Self::state) says who owns its
/// slot. A submitter claims a free lane (one compare-and-swap), fills the
/// slot, marks it posted and posts its work request through the queue
/// pair's [`SharedPoster`](crate::verbs::SharedPoster) — outside the send
/// queue's lock and the window: the queue pair has one send-queue entry
/// beyond the window for it. From then on the slot belongs to whoever
/// finishes the request (a compare-and-swap from posted to finishing): the
/// thread draining its completion, the submitter when the post fails, or
/// the link's last thread on exit, which also closes the lane. A request
/// finds the lane taken, or work counted in the send queue's `waiting`
/// (queued, or popped and not yet posted), or the link broken: it takes
/// the ordinary path, so it never overtakes earlier work of its caller.
struct ExpressLane {
    /// [`LANE_FREE`], [`LANE_CLAIMED`], [`LANE_POSTED`], [`LANE_FINISHING`]
    /// or [`LANE_CLOSED`].
    state: std::sync::atomic::AtomicU8,
    /// Written only by the thread that moved `state` to `CLAIMED` (until it
    /// stores `POSTED`) or to `FINISHING` (until it stores `FREE` or
    /// `CLOSED`).
    slot: std::cell::UnsafeCell<Express>,
}

/// The lane is free: a submitter may claim it.
const LANE_FREE: u8 = 0;
/// A submitter is filling the slot (a few instructions, no system call).
const LANE_CLAIMED: u8 = 1;
/// A request is in flight (or being posted); its finisher takes the slot.
const LANE_POSTED: u8 = 2;
/// A finisher is releasing the request's holds and recording its outcome.
const LANE_FINISHING: u8 = 3;
/// The link's last thread has left: no request may take the lane.
const LANE_CLOSED: u8 = 4;

// SAFETY: the slot is touched only by the one thread whose
// compare-and-swap moved `state` to CLAIMED or FINISHING, and handed on by
// release stores that the next owner's acquiring compare-and-swap reads;
// its contents (region holds, an `Arc`) are `Send`.
unsafe impl Sync for ExpressLane {}

impl Default for ExpressLane {
    fn default() -> Self {
        Self {
            state: std::sync::atomic::AtomicU8::new(LANE_FREE),
            slot: std::cell::UnsafeCell::new(Express::default()),
        }
    }
}

/// What the express lane's slot holds.
#[derive(Default)]
struct Express {
    /// The holds on the regions of the request in flight.
    guards: Few<RegionGuard>,
    /// The status of the request in flight, or of the last one: reused
    /// when nothing else refers to it any more.
    status: Option<Arc<Completion>>,
}

impl Link {
    /// Opens `streams_per_peer` connections to `peer` and starts their
    /// threads.
    fn open(
        inner: &Inner,
        peer: &AgentDesc,
        n_streams: usize,
        path: Path,
    ) -> Result<Arc<Link>, Error> {
        let cfg = &inner.config;
        let use_rdma = path == Path::Rdma;
        let link_id = random_u64();
        let mut may_delegate = false;
        let mut streams = Vec::with_capacity(n_streams);
        let mut receivers = Vec::with_capacity(n_streams);
        let mut rdma_conns = Vec::new();
        for i in 0..n_streams {
            // Each stream: connected, authenticated and greeted within the
            // connect timeout, however slowly the peer answers.
            let deadline = std::time::Instant::now() + cfg.connect_timeout;
            let sock = connect_any(&peer.endpoints, deadline)?;
            let clock = ProgressClock::new();
            let ticket = handshake(inner, peer, &sock, link_id, i as u32, &clock, deadline)?;
            if i == 0 && matches!(path, Path::Cma { .. }) && cfg.shm_delegate {
                // The target copies for this process only once the kernel
                // has told it on its local socket that this is the process.
                match local_proof::prove(peer.instance, ticket, cfg.connect_timeout) {
                    Ok(()) => may_delegate = true,
                    Err(e) => {
                        tracing::debug!(remote = %peer.name, error = %e, "no local proof; the target will not copy for this agent")
                    }
                }
            }
            if i == 0 && use_rdma {
                for k in 0..cfg.rdma_qps_per_peer {
                    rdma_conns.push(rdma_connect(inner, peer, &sock, &clock, k)?);
                }
            }
            sock.set_read_timeout(Some(tick(cfg.io_timeout)))?;
            sock.set_write_timeout(Some(tick(cfg.io_timeout)))?;
            let (tx, rx) = crossbeam_channel::unbounded();
            streams.push(StreamHandle {
                tx,
                reads: Mutex::new(VecDeque::new()),
                sock,
            });
            receivers.push(rx);
        }
        let n_qps = rdma_conns.len();
        let link = Arc::new(Link {
            rdma: rdma_conns,
            next_stripe: AtomicUsize::new(0),
            undriven: Arc::new(AtomicUsize::new(0)),
            progress_threads: OnceLock::new(),
            remote: peer.name.clone(),
            io_timeout: cfg.io_timeout,
            copy_threads: cfg.shm_copy_threads,
            delegate_probe: cfg
                .shm_delegate
                .then_some((&*inner.probe_word as *const u64 as u64, inner.instance)),
            delegate_ok: AtomicBool::new(may_delegate),
            in_flight: Arc::clone(&inner.in_flight),
            alive: AtomicUsize::new(2 * streams.len() + n_qps),
            streams,
            pending: Mutex::new(PendingTable::default()),
            express: ExpressLane::default(),
            broken: AtomicBool::new(false),
            clock: ProgressClock::new(),
            threads: Mutex::new(Vec::new()),
        });
        let mut threads = Vec::new();
        for (i, rx) in receivers.into_iter().enumerate() {
            let l = Arc::clone(&link);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvxfer-send-{}-{i}", peer.name))
                    .spawn(move || l.run_sender(i, rx))?,
            );
            let l = Arc::clone(&link);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvxfer-recv-{}-{i}", peer.name))
                    .spawn(move || l.run_reader(i))?,
            );
        }
        let mut progress = Vec::new();
        let adaptive = cfg.rdma_progress == crate::agent::RdmaProgress::Adaptive;
        for k in 0..n_qps {
            let l = Arc::clone(&link);
            let t = std::thread::Builder::new()
                .name(format!("kvxfer-rdma-{}-{k}", peer.name))
                .spawn(move || l.run_rdma_progress(k, adaptive))?;
            progress.push(t.thread().clone());
            threads.push(t);
        }
        let _ = link.progress_threads.set(progress);
        *lock(&link.threads) = threads;
        tracing::debug!(remote = %peer.name, streams = link.streams.len(), "link open");
        Ok(link)
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn insert(&self, id: u64, p: Arc<Pending>) -> Result<(), Error> {
        let mut t = lock(&self.pending);
        if let Some(e) = &t.broken {
            return Err(e.clone());
        }
        t.map.insert(id, p);
        Ok(())
    }

    /// Marks the link broken (first cause wins), unblocks its threads. The
    /// last thread to exit fails the requests still outstanding, so none
    /// completes while a thread may still touch its memory.
    fn fail(&self, cause: Error) {
        {
            let mut t = lock(&self.pending);
            if t.broken.is_some() {
                return;
            }
            tracing::debug!(remote = %self.remote, %cause, "link failed");
            t.broken = Some(cause);
            self.broken.store(true, Ordering::Release);
        }
        for r in &self.rdma {
            // Flush every posted work request; the progress threads drain
            // the completions and exit when none is left.
            let _ = lock(&r.qp).set_error();
        }
        for s in &self.streams {
            let _ = s.sock.shutdown(Shutdown::Both);
            let _ = s.tx.send(Job::Stop);
        }
    }

    fn thread_exit(&self) {
        if self.alive.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let (pending, cause) = {
            let mut t = lock(&self.pending);
            let cause = t.broken.clone().unwrap_or(Error::Closed);
            (std::mem::take(&mut t.map), cause)
        };
        for s in &self.streams {
            lock(&s.reads).clear();
        }
        for (_, p) in pending {
            p.finish(Some(cause.clone()));
        }
        self.finish_express(Err(cause), true);
    }

    fn join(&self) {
        let threads = std::mem::take(&mut *lock(&self.threads));
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }

    fn io_error(&self, e: io::Error) -> Error {
        if e.kind() == io::ErrorKind::TimedOut {
            Error::PeerTimedOut {
                remote: self.remote.clone(),
                idle: self.io_timeout,
            }
        } else if e.kind() == io::ErrorKind::InvalidData {
            Error::ProtocolViolation {
                remote: self.remote.clone(),
                detail: e.to_string(),
            }
        } else {
            Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(e),
            }
        }
    }

    fn complete_event(&self, req: u64, p: &Pending, result: Result<(), Error>) {
        if p.event(result) {
            lock(&self.pending).map.remove(&req);
            p.finish(None);
        }
    }

    fn run_sender(self: Arc<Self>, idx: usize, rx: Receiver<Job>) {
        let fd = self.streams[idx].sock.as_raw_fd();
        let mut headers: Vec<[u8; HEADER_LEN]> = Vec::new();
        let mut iovs: Vec<libc::iovec> = Vec::new();
        let mut tables: Vec<Vec<u8>> = Vec::new();
        // After each data frame: (iovecs so far, segments so far, bytes so
        // far), where an aborted request may stop.
        let mut marks: Vec<(usize, usize, u64)> = Vec::new();
        while let Ok(job) = rx.recv() {
            let (req, op, mut segs, tail, pending, mut aborted) = match job {
                Job::Stop => break,
                Job::Cma {
                    req,
                    op,
                    pid,
                    pieces,
                    grants,
                    sync,
                    delegate,
                    pending,
                } => match self.run_cma(
                    fd,
                    req,
                    op,
                    pid,
                    &pieces,
                    &grants,
                    delegate.then_some(sync.as_deref()),
                    &pending,
                ) {
                    Ok(CmaOutcome::Commit { aborted }) => (
                        req,
                        op,
                        Vec::new(),
                        Tail::Commit { segments: 0, sync },
                        pending,
                        aborted,
                    ),
                    Ok(CmaOutcome::Done) => continue,
                    Err(e) => {
                        self.fail(e);
                        break;
                    }
                },
                Job::Frames {
                    req,
                    op,
                    segs,
                    tail,
                    pending,
                } => (req, op, segs, tail, pending, false),
            };
            // Aborted before any of it went out: its segments are skipped
            // (a READ's events for them are counted here, as no data will
            // come for them).
            let mut skipped = 0;
            if !segs.is_empty() && pending.completion.abort_requested() {
                skipped = segs.len();
                if op == TransferOp::Read {
                    for _ in 0..skipped {
                        self.complete_event(req, &pending, Err(Error::Aborted));
                    }
                }
                segs.clear();
                aborted = true;
            }
            headers.clear();
            iovs.clear();
            tables.clear();
            marks.clear();
            if op == TransferOp::Write {
                // Runs of small segments to one region go as write lists
                // (one frame and one scatter read at the target for up to
                // WRITE_LIST_MAX of them); the rest as single segments.
                headers.reserve(segs.len() + 3);
                let mut bytes = 0;
                let mut i = 0;
                while i < segs.len() {
                    let s0 = &segs[i];
                    let mut j = i + 1;
                    if s0.len <= WRITE_LIST_PIECE_MAX {
                        while j < segs.len()
                            && j - i < WRITE_LIST_MAX as usize
                            && segs[j].len <= WRITE_LIST_PIECE_MAX
                            && segs[j].key == s0.key
                            && segs[j].mem_type == s0.mem_type
                        {
                            j += 1;
                        }
                    }
                    if j - i >= 2 {
                        let run = &segs[i..j];
                        let mut table = Vec::with_capacity(run.len() * WRITE_LIST_ENTRY);
                        for s in run {
                            table.extend_from_slice(&s.remote.to_le_bytes());
                            table.extend_from_slice(&s.len.to_le_bytes());
                        }
                        let total = run.iter().map(|s| s.len).sum();
                        headers.push(
                            Frame::WriteList {
                                req,
                                mem_type: s0.mem_type,
                                count: run.len() as u32,
                                total,
                                key: s0.key,
                            }
                            .encode(),
                        );
                        iovs.push(iov(
                            headers.last().expect("just pushed").as_ptr(),
                            HEADER_LEN,
                        ));
                        iovs.push(iov(table.as_ptr(), table.len()));
                        tables.push(table);
                        for s in run {
                            iovs.push(iov(s.local as *const u8, s.len as usize));
                        }
                        bytes += total;
                    } else {
                        headers.push(
                            Frame::Write {
                                req,
                                mem_type: s0.mem_type,
                                addr: s0.remote,
                                len: s0.len,
                                key: s0.key,
                            }
                            .encode(),
                        );
                        iovs.push(iov(
                            headers.last().expect("just pushed").as_ptr(),
                            HEADER_LEN,
                        ));
                        iovs.push(iov(s0.local as *const u8, s0.len as usize));
                        bytes += s0.len;
                    }
                    i = j;
                    marks.push((iovs.len(), i, bytes));
                }
            }
            let data_frames = headers.len();
            for s in segs.iter().filter(|_| op == TransferOp::Read) {
                headers.push(
                    Frame::ReadReq {
                        req,
                        mem_type: s.mem_type,
                        addr: s.remote,
                        len: s.len,
                        key: s.key,
                    }
                    .encode(),
                );
            }
            if aborted {
                headers.push(
                    Frame::Abort {
                        req,
                        segments: skipped as u64,
                    }
                    .encode(),
                );
            }
            let sync = match &tail {
                Tail::None => None,
                Tail::Fence => {
                    headers.push(Frame::Fence { req }.encode());
                    None
                }
                Tail::Commit { segments, sync } => {
                    headers.push(
                        Frame::Commit {
                            req,
                            op: match op {
                                TransferOp::Write => CommitOp::Write,
                                TransferOp::Read => CommitOp::Read,
                            },
                            segments: *segments,
                            sync_len: sync.as_ref().map_or(0, |m| m.len() as u32),
                            has_sync: sync.is_some(),
                        }
                        .encode(),
                    );
                    sync.as_deref()
                }
            };
            // Write frames are in `iovs` already; then the read requests,
            // an abort and the tail.
            let data_end = iovs.len();
            for h in &headers[data_frames..] {
                iovs.push(iov(h.as_ptr(), HEADER_LEN));
            }
            if let Some(m) = sync {
                iovs.push(iov(m.as_ptr(), m.len()));
            }
            if op == TransferOp::Read {
                let mut reads = lock(&self.streams[idx].reads);
                for s in &segs {
                    reads.push_back(ReadSlot {
                        req,
                        dst: s.local,
                        len: s.len,
                        pending: Arc::clone(&pending),
                    });
                }
            }
            let abortable = marks.last().is_some_and(|m| m.2 > ABORT_CHECK_BYTES);
            // SAFETY: header iovecs point into `headers`, the sync iovec into
            // the job (both alive until the call returns); payload iovecs
            // point into local regions validated at submit time and held by
            // the request's guards, which live until the request completes,
            // which cannot happen before this write returns (its
            // acknowledgement follows these bytes).
            let written = unsafe {
                if abortable {
                    self.write_abortable(fd, &mut iovs, &marks, data_end, req, &pending)
                } else {
                    writev_all(fd, &mut iovs, &self.clock, self.io_timeout)
                }
            };
            if let Err(e) = written {
                self.fail(self.io_error(e));
                break;
            }
        }
        self.thread_exit();
    }

    /// Writes a job's frames as [`writev_all`] does, about
    /// [`ABORT_CHECK_BYTES`] of payload at a time, looking before each batch
    /// whether the request was aborted: if so, the rest of its data frames
    /// is replaced by an `Abort` frame counting their segments, and its
    /// tail (`iovs[data_end..]`) follows.
    ///
    /// # Safety
    /// As [`writev_all`].
    unsafe fn write_abortable(
        &self,
        fd: std::os::fd::RawFd,
        iovs: &mut [libc::iovec],
        marks: &[(usize, usize, u64)],
        data_end: usize,
        req: u64,
        pending: &Pending,
    ) -> io::Result<()> {
        let segments = marks.last().map_or(0, |m| m.1);
        let (mut at, mut done) = (0, (0usize, 0usize, 0u64));
        let mut m = 0;
        while m < marks.len() {
            if pending.completion.abort_requested() {
                let abort = Frame::Abort {
                    req,
                    segments: (segments - done.1) as u64,
                }
                .encode();
                let mut rest = Vec::with_capacity(1 + iovs.len() - data_end);
                rest.push(iov(abort.as_ptr(), HEADER_LEN));
                rest.extend_from_slice(&iovs[data_end..]);
                // SAFETY: `abort` lives for the call; the rest as the caller
                // promised.
                return unsafe { writev_all(fd, &mut rest, &self.clock, self.io_timeout) };
            }
            while m + 1 < marks.len() && marks[m].2 - done.2 < ABORT_CHECK_BYTES {
                m += 1;
            }
            let end = if m + 1 == marks.len() {
                iovs.len()
            } else {
                marks[m].0
            };
            // SAFETY: forwarded contract.
            unsafe { writev_all(fd, &mut iovs[at..end], &self.clock, self.io_timeout)? };
            at = end;
            done = marks[m];
            m += 1;
        }
        Ok(())
    }

    /// Waits for the target's answer to a request's grants (or delegate).
    fn wait_granted(&self, pending: &Pending) -> Result<u16, Error> {
        loop {
            match pending.granted().1.recv_timeout(tick(self.io_timeout)) {
                Ok(st) => return Ok(st),
                Err(_) => {
                    if let Some(e) = &lock(&self.pending).broken {
                        return Err(e.clone());
                    }
                }
            }
        }
    }

    /// Asks the target to do a granted request's copy and commit it with
    /// `sync`. `Ok(true)`: done (its `Ack` completes the request);
    /// `Ok(false)`: refused, the caller copies and commits (and this link
    /// asks no more); `Err`: the target's copy failed, the link is broken.
    #[allow(clippy::too_many_arguments)]
    fn run_delegate(
        &self,
        fd: std::os::fd::RawFd,
        req: u64,
        op: TransferOp,
        pieces: &[Piece],
        sync: Option<&[u8]>,
        (probe_addr, instance): (u64, u64),
        pending: &Pending,
    ) -> Result<bool, Error> {
        let mut table = Vec::with_capacity(pieces.len() * wire::DELEGATE_ENTRY);
        for p in pieces {
            table.extend_from_slice(&p.remote.to_le_bytes());
            table.extend_from_slice(&p.local.to_le_bytes());
            table.extend_from_slice(&p.len.to_le_bytes());
        }
        let hdr = Frame::Delegate {
            req,
            op: match op {
                TransferOp::Write => CommitOp::Write,
                TransferOp::Read => CommitOp::Read,
            },
            count: pieces.len() as u32,
            pid: std::process::id(),
            probe_addr,
            instance,
            sync_len: sync.map_or(0, |m| m.len() as u32),
            has_sync: sync.is_some(),
        }
        .encode();
        let body = sync.unwrap_or_default();
        let mut iovs = [
            iov(hdr.as_ptr(), HEADER_LEN),
            iov(table.as_ptr(), table.len()),
            iov(body.as_ptr(), body.len()),
        ];
        // SAFETY: the iovecs point into `hdr`, `table` and `body`, alive for
        // the call.
        unsafe { writev_all(fd, &mut iovs, &self.clock, self.io_timeout) }
            .map_err(|e| self.io_error(e))?;
        match self.wait_granted(pending)? {
            status::OK => {
                self.clock.touch();
                Ok(true)
            }
            status::DELEGATE_REFUSED => {
                tracing::debug!(remote = %self.remote, "target declined delegated copies; copying here");
                self.delegate_ok.store(false, Ordering::Relaxed);
                Ok(false)
            }
            st => Err(Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(io::Error::other(format!(
                    "the target's delegated cross-memory copy failed (status {st})"
                ))),
            }),
        }
    }

    /// Grants and direct copy of a cross-memory request; `Err`: the link is
    /// broken.
    #[allow(clippy::too_many_arguments)]
    fn run_cma(
        &self,
        fd: std::os::fd::RawFd,
        req: u64,
        op: TransferOp,
        pid: u32,
        pieces: &[Piece],
        grants: &[GrantRange],
        delegate: Option<Option<&[u8]>>,
        pending: &Pending,
    ) -> Result<CmaOutcome, Error> {
        if pending.completion.abort_requested() {
            // Nothing sent yet: the target never hears of it.
            self.complete_event(req, pending, Err(Error::Aborted));
            return Ok(CmaOutcome::Done);
        }
        if grants.is_empty() {
            return Ok(CmaOutcome::Commit { aborted: false });
        }
        let frames: Vec<[u8; HEADER_LEN]> = grants
            .iter()
            .map(|g| {
                Frame::Grant {
                    req,
                    mem_type: g.mem_type,
                    addr: g.addr,
                    len: g.len,
                    key: g.key,
                    total: grants.len() as u32,
                }
                .encode()
            })
            .collect();
        let mut iovs: Vec<_> = frames.iter().map(|f| iov(f.as_ptr(), HEADER_LEN)).collect();
        // SAFETY: the iovecs point into `frames`, alive for the call.
        unsafe { writev_all(fd, &mut iovs, &self.clock, self.io_timeout) }
            .map_err(|e| self.io_error(e))?;
        let st = self.wait_granted(pending)?;
        if st != status::OK {
            self.complete_event(
                req,
                pending,
                Err(Error::RemoteRejected {
                    remote: self.remote.clone(),
                    reason: RejectReason::from_code(st),
                }),
            );
            return Ok(CmaOutcome::Done);
        }
        if pending.completion.abort_requested() {
            return Ok(CmaOutcome::Commit { aborted: true });
        }
        if let (Some(sync), Some((probe_addr, instance))) = (delegate, self.delegate_probe)
            && self.delegate_ok.load(Ordering::Relaxed)
            && self.run_delegate(fd, req, op, pieces, sync, (probe_addr, instance), pending)?
        {
            return Ok(CmaOutcome::Done);
        }
        let dir = match op {
            TransferOp::Write => Direction::Write,
            TransferOp::Read => Direction::Read,
        };
        let stop = || pending.completion.abort_requested();
        // SAFETY: local pieces lie in regions validated at submit time and
        // held by the request's guards until it completes, which cannot
        // happen before this copy returns (the commit follows it).
        let copied = unsafe {
            shm::copy_parallel(
                pid,
                dir,
                pieces,
                self.copy_threads,
                PARALLEL_COPY_MIN,
                &stop,
            )
        }
        .map_err(|e| Error::ConnectionLost {
            remote: self.remote.clone(),
            cause: Arc::new(if e.raw_os_error() == Some(libc::ESRCH) {
                io::Error::new(io::ErrorKind::ConnectionReset, "target process exited")
            } else {
                e
            }),
        })?;
        self.clock.touch();
        Ok(CmaOutcome::Commit { aborted: !copied })
    }

    fn run_reader(self: Arc<Self>, idx: usize) {
        let sock = &self.streams[idx].sock;
        let clock = ProgressClock::new();
        let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
        let mut idle = LinkIdle { link: &self };
        let r = self.read_loop(idx, &mut reader, &mut idle);
        if let Err(e) = r {
            self.fail(e);
        } else {
            self.fail(Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "remote agent closed the connection",
                )),
            });
        }
        self.thread_exit();
    }

    fn read_loop(
        &self,
        idx: usize,
        reader: &mut FrameReader<'_>,
        idle: &mut LinkIdle<'_>,
    ) -> Result<(), Error> {
        loop {
            let raw = match reader.next_header(idle) {
                Ok(Some(raw)) => raw,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.link_error(e)),
            };
            self.clock.touch();
            let frame = Frame::decode(&raw).map_err(|e| Error::ProtocolViolation {
                remote: self.remote.clone(),
                detail: e.to_string(),
            })?;
            match frame {
                Frame::ReadData {
                    req,
                    len,
                    status: st,
                } => {
                    let slot = lock(&self.streams[idx].reads).pop_front();
                    let Some(slot) = slot else {
                        return Err(self.violation("READ data with no READ outstanding"));
                    };
                    if slot.req != req {
                        return Err(self.violation("READ data out of order"));
                    }
                    let result = if st == status::OK {
                        if len != slot.len {
                            return Err(self.violation("READ data length differs from the request"));
                        }
                        if slot.pending.completion.abort_requested() {
                            // Aborted: the bytes are drained, the
                            // destination left as it is.
                            reader.discard(len, idle).map_err(|e| self.link_error(e))?;
                            self.complete_event(req, &slot.pending, Err(Error::Aborted));
                            continue;
                        }
                        // SAFETY: `slot.dst` lies inside a local region that
                        // was registered and validated at submit time, and the
                        // request's guards (in `slot.pending`) keep it
                        // registered until every event, this one included,
                        // has been processed.
                        unsafe { reader.read_into(slot.dst as *mut u8, len as usize, idle) }
                            .map_err(|e| self.link_error(e))?;
                        Ok(())
                    } else {
                        Err(Error::RemoteRejected {
                            remote: self.remote.clone(),
                            reason: RejectReason::from_code(st),
                        })
                    };
                    self.complete_event(req, &slot.pending, result);
                }
                Frame::Granted { req, status: st } => {
                    let p = lock(&self.pending).map.get(&req).cloned();
                    let Some(p) = p else {
                        return Err(self.violation("grant answer for an unknown request"));
                    };
                    if p.granted().0.try_send(st).is_err() {
                        return Err(self.violation("second grant answer for a request"));
                    }
                }
                Frame::Ack { req, status: st } => {
                    let p = lock(&self.pending).map.get(&req).cloned();
                    let Some(p) = p else {
                        return Err(self.violation("acknowledgement for an unknown request"));
                    };
                    let result = match st {
                        status::OK => Ok(()),
                        st => match RejectReason::from_code(st) {
                            RejectReason::Aborted => Err(Error::Aborted),
                            reason => Err(Error::RemoteRejected {
                                remote: self.remote.clone(),
                                reason,
                            }),
                        },
                    };
                    self.complete_event(req, &p, result);
                }
                other => return Err(self.violation(&format!("unexpected frame {other:?}"))),
            }
        }
    }

    fn violation(&self, detail: &str) -> Error {
        Error::ProtocolViolation {
            remote: self.remote.clone(),
            detail: detail.to_owned(),
        }
    }

    /// Maps a reader error, preferring the cause already recorded (the
    /// reader's error is often the echo of a shutdown by another thread).
    fn link_error(&self, e: io::Error) -> Error {
        if let Some(c) = &lock(&self.pending).broken {
            return c.clone();
        }
        self.io_error(e)
    }
}

struct LinkIdle<'a> {
    link: &'a Link,
}

impl IdlePolicy for LinkIdle<'_> {
    fn on_idle(&mut self, _mid_frame: bool) -> io::Result<()> {
        let t = lock(&self.link.pending);
        if t.broken.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "link closed",
            ));
        }
        if !t.map.is_empty() && self.link.clock.idle() > self.link.io_timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no progress within the I/O timeout",
            ));
        }
        Ok(())
    }
}

/// The RDMA local ACK timeout exponent, resolved when the agent was made.
fn ack_timeout(config: &AgentConfig) -> u8 {
    config
        .rdma_ack_timeout
        .unwrap_or(crate::verbs::DEFAULT_ACK_TIMEOUT)
}

/// Connects to the first endpoint that answers before `deadline`.
fn connect_any(endpoints: &[String], deadline: std::time::Instant) -> Result<TcpStream, Error> {
    let mut last = None;
    for ep in endpoints {
        let addrs = match ep.to_socket_addrs() {
            Ok(a) => a,
            Err(e) => {
                last = Some(Error::Connect {
                    addr: ep.clone(),
                    cause: Arc::new(e),
                });
                continue;
            }
        };
        for a in addrs {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(last.unwrap_or(Error::Timeout {
                    what: "connecting",
                    after: Duration::ZERO,
                }));
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    let _ = socket2::SockRef::from(&s).set_tcp_keepalive(
                        &socket2::TcpKeepalive::new()
                            .with_time(Duration::from_secs(10))
                            .with_interval(Duration::from_secs(5)),
                    );
                    return Ok(s);
                }
                Err(e) => {
                    last = Some(Error::Connect {
                        addr: a.to_string(),
                        cause: Arc::new(e),
                    })
                }
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::InvalidConnectionInfo {
        info: String::new(),
        reason: "no endpoint".into(),
    }))
}

/// Authenticates, sends `Hello` and checks the `HelloAck`; returns the
/// session's ticket.
fn handshake(
    inner: &Inner,
    peer: &AgentDesc,
    sock: &TcpStream,
    link: u64,
    stream: u32,
    clock: &ProgressClock,
    deadline: std::time::Instant,
) -> Result<u128, Error> {
    let t = inner.config.connect_timeout;
    sock.set_read_timeout(Some(tick(t)))?;
    sock.set_write_timeout(Some(tick(t)))?;
    handshake::initiate(
        sock,
        inner.config.credential.as_ref(),
        &inner.config.name,
        Some(&peer.name),
        &peer.name,
        deadline,
        t,
    )?;
    let name = inner.config.name.as_bytes();
    let hello = Frame::Hello {
        instance: inner.instance,
        expect: peer.instance,
        version: PROTOCOL_VERSION,
        link,
        stream,
        name_len: name.len() as u32,
    }
    .encode();
    let mut iovs = [
        iov(hello.as_ptr(), HEADER_LEN),
        iov(name.as_ptr(), name.len()),
    ];
    let conn_err = |e: io::Error| Error::ConnectionLost {
        remote: peer.name.clone(),
        cause: Arc::new(e),
    };
    // SAFETY: both iovecs point into live locals.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs, clock, t) }.map_err(conn_err)?;
    let mut reader = FrameReader::new(sock.as_raw_fd(), clock);
    reader.set_deadline(Some(deadline));
    let raw = reader
        .next_header(&mut UntilDeadline)
        .map_err(|e| timeout_or(e, "connection handshake", t, conn_err))?
        .ok_or_else(|| conn_err(io::ErrorKind::UnexpectedEof.into()))?;
    match Frame::decode(&raw) {
        Ok(Frame::HelloAck {
            status: status::OK,
            ticket,
            ..
        }) => Ok(ticket),
        Ok(Frame::HelloAck {
            status: status::STALE_INSTANCE,
            ..
        }) => Err(Error::StaleAgent {
            remote: peer.name.clone(),
            addr: sock.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
        }),
        other => Err(Error::ProtocolViolation {
            remote: peer.name.clone(),
            detail: format!("bad hello answer {other:?}"),
        }),
    }
}

fn timeout_or(
    e: io::Error,
    what: &'static str,
    after: Duration,
    other: impl FnOnce(io::Error) -> Error,
) -> Error {
    if e.kind() == io::ErrorKind::TimedOut {
        Error::Timeout { what, after }
    } else {
        other(e)
    }
}

/// Fetches an agent descriptor over the side channel, after the
/// authentication exchange; the descriptor must name the agent that
/// authenticated.
fn fetch_desc(inner: &Inner, info: &str) -> Result<AgentDesc, Error> {
    // One deadline for the whole exchange: connect, authenticate, fetch.
    let timeout = inner.config.connect_timeout;
    let deadline = std::time::Instant::now() + timeout;
    let addrs: Vec<SocketAddr> = info
        .to_socket_addrs()
        .map_err(|e| Error::InvalidConnectionInfo {
            info: info.to_owned(),
            reason: e.to_string(),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidConnectionInfo {
            info: info.to_owned(),
            reason: "resolves to no address".into(),
        });
    }
    let sock = connect_any(&[info.to_owned()], deadline)?;
    sock.set_read_timeout(Some(tick(timeout)))?;
    sock.set_write_timeout(Some(tick(timeout)))?;
    let target = handshake::initiate(
        &sock,
        inner.config.credential.as_ref(),
        &inner.config.name,
        None,
        info,
        deadline,
        timeout,
    )?;
    let clock = ProgressClock::new();
    let conn_err = |e: io::Error| Error::Connect {
        addr: info.to_owned(),
        cause: Arc::new(e),
    };
    send_frames(&sock, &[Frame::DescRequest.encode()], &clock, timeout).map_err(conn_err)?;
    let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
    reader.set_deadline(Some(deadline));
    let mut idle = UntilDeadline;
    let raw = reader
        .next_header(&mut idle)
        .map_err(|e| timeout_or(e, "descriptor fetch", timeout, conn_err))?
        .ok_or_else(|| conn_err(io::ErrorKind::UnexpectedEof.into()))?;
    let Ok(Frame::DescReply { body_len }) = Frame::decode(&raw) else {
        return Err(Error::ProtocolViolation {
            remote: info.to_owned(),
            detail: "expected a descriptor reply".into(),
        });
    };
    let body = reader
        .read_vec(body_len as usize, &mut idle)
        .map_err(|e| timeout_or(e, "descriptor fetch", timeout, conn_err))?;
    let desc = AgentDesc::decode(&body)?;
    if desc.name != target {
        return Err(Error::AuthFailed {
            remote: info.to_owned(),
            reason: format!(
                "the descriptor names agent {:?}, but {target:?} authenticated",
                desc.name
            ),
        });
    }
    Ok(desc)
}

impl Peer {
    /// The live link, opening a new one when there is none or it broke.
    fn link(&self, inner: &Inner) -> Result<Arc<Link>, Error> {
        let mut slot = lock(&self.link);
        if let Some(l) = slot.as_ref() {
            if !l.is_broken() {
                return Ok(Arc::clone(l));
            }
            let old = slot.take().expect("checked above");
            old.join();
        }
        let n = match self.path {
            Path::Tcp => inner.config.streams_per_peer,
            // Data bypasses the socket; one stream carries the control.
            Path::Cma { .. } | Path::Rdma => 1,
        };
        let l = Link::open(inner, &self.desc, n, self.path)?;
        *slot = Some(Arc::clone(&l));
        Ok(l)
    }
}

/// Splits `(local, remote)` pairs into segments of at most `max` bytes and
/// spreads them over `streams` streams, balancing bytes.
fn plan_segments(req: &TransferRequest, keys: &[u64], max: u64, streams: usize) -> Vec<Vec<Seg>> {
    let mut out: Vec<Vec<Seg>> = (0..streams).map(|_| Vec::new()).collect();
    let mut load = vec![0u64; streams];
    for ((l, r), &key) in req.local.descs.iter().zip(&req.remote.descs).zip(keys) {
        let mut off = 0;
        while off < l.len {
            let len = (l.len - off).min(max);
            let k = if streams == 1 {
                0
            } else {
                (0..streams).min_by_key(|&i| load[i]).unwrap_or(0)
            };
            out[k].push(Seg {
                mem_type: req.remote.mem_type,
                local: l.addr + off,
                remote: r.addr + off,
                len,
                key,
            });
            load[k] += len;
            off += len;
        }
    }
    out
}

/// A write list's pieces and the span they cover.
pub(crate) struct WriteListTable {
    /// `(address, length)` of each piece, as the scatter read takes them.
    pub(crate) pieces: Vec<(*mut u8, usize)>,
    /// Start of the span.
    pub(crate) lo: u64,
    /// End of the span.
    pub(crate) hi: u64,
}

/// The pieces of a write list's table, `(address, length)` each, with the
/// span they cover (`lo..hi`): each non-empty and not wrapping, adding up
/// to the `total` the frame announced.
///
/// # Errors
/// What is wrong with the table.
pub(crate) fn write_list_pieces(table: &[u8], total: u64) -> Result<WriteListTable, String> {
    let mut pieces = Vec::with_capacity(table.len() / WRITE_LIST_ENTRY);
    let (mut lo, mut hi, mut sum) = (u64::MAX, 0u64, 0u64);
    for e in table.chunks_exact(WRITE_LIST_ENTRY) {
        let addr = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(e[8..].try_into().expect("8 bytes"));
        let end = addr
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or("bad write list entry")?;
        lo = lo.min(addr);
        hi = hi.max(end);
        sum = sum.checked_add(len).ok_or("write list overflows")?;
        pieces.push((addr as *mut u8, len as usize));
    }
    if pieces.is_empty() {
        return Err("empty write list".into());
    }
    if sum != total {
        return Err(format!(
            "write list announces {total} bytes, its table {sum}"
        ));
    }
    Ok(WriteListTable { pieces, lo, hi })
}

/// The target's side of the connection handshake on `fd` (for the fuzz
/// targets): whether it accepted.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_respond(
    fd: std::os::fd::BorrowedFd<'_>,
    cred: Option<&crate::auth::Credential>,
) -> io::Result<bool> {
    let clock = ProgressClock::new();
    let mut reader = FrameReader::new(fd.as_raw_fd(), &clock);
    reader.set_deadline(Some(std::time::Instant::now() + Duration::from_secs(1)));
    let v = handshake::respond(
        fd,
        &mut reader,
        &|| false,
        cred,
        "target",
        &clock,
        Duration::from_secs(1),
    )?;
    Ok(matches!(v, handshake::Verdict::Accepted(_)))
}

/// The pieces of a `Delegate` table, as (local = the target's address,
/// remote = the initiator's): each non-empty, and inside one of `spans`
/// (the request's admitted grants).
pub(crate) fn delegated_pieces(
    table: &[u8],
    spans: &[(u64, u64)],
) -> Result<Vec<Piece>, &'static str> {
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    table
        .chunks_exact(wire::DELEGATE_ENTRY)
        .map(|e| {
            let (target, initiator, len) = (word(&e[..8]), word(&e[8..16]), word(&e[16..]));
            let inside = len > 0
                && target.checked_add(len).is_some_and(|end| {
                    spans
                        .iter()
                        .any(|&(a, l)| target >= a && end <= a.saturating_add(l))
                });
            if inside {
                Ok(Piece {
                    local: target,
                    remote: initiator,
                    len,
                })
            } else {
                Err("delegated piece outside the request's grants")
            }
        })
        .collect()
}

/// Adjacent runs in a descriptor list (pieces that continue the previous
/// one's range count once).
fn runs(descs: &[crate::memory::MemoryDesc]) -> usize {
    descs
        .iter()
        .zip(descs.iter().skip(1))
        .filter(|(a, b)| a.addr.checked_add(a.len) != Some(b.addr))
        .count()
        + usize::from(!descs.is_empty())
}

/// Whether a cross-memory request should be copied by the target: its
/// remote pieces are many and much more scattered than its local ones.
fn should_delegate(req: &TransferRequest) -> bool {
    let n = req.remote.descs.len();
    if n > wire::DELEGATE_MAX as usize {
        return false;
    }
    let remote = runs(&req.remote.descs);
    remote >= 16 && remote >= 2 * runs(&req.local.descs)
}

/// One grant per remote region a request touches, covering the span of its
/// descriptors in that region.
fn grant_ranges(remote: &MemoryDescs, keys: &[u64]) -> Vec<GrantRange> {
    let mut spans: Vec<GrantRange> = Vec::new();
    for (d, &key) in remote.descs.iter().zip(keys) {
        let end = d.addr + d.len;
        match spans.iter_mut().find(|g| g.key == key) {
            Some(g) => {
                let g_end = (g.addr + g.len).max(end);
                g.addr = g.addr.min(d.addr);
                g.len = g_end - g.addr;
            }
            None => spans.push(GrantRange {
                mem_type: remote.mem_type,
                addr: d.addr,
                len: d.len,
                key,
            }),
        }
    }
    spans
}

impl TcpAgent {
    /// Whether one more request may be submitted (see
    /// [`AgentConfig::max_requests_in_flight`]).
    fn room_for_one(&self) -> Result<(), Error> {
        let n = self.inner.in_flight.load(Ordering::Relaxed);
        if n >= self.inner.config.max_requests_in_flight {
            return Err(Error::WouldBlock { in_flight: n });
        }
        Ok(())
    }

    /// Submits `req` with `sync` as its sync message (taken apart from the
    /// request, which the caller keeps).
    fn submit(
        &self,
        req: &TransferRequest,
        sync: Option<Vec<u8>>,
        fence: bool,
    ) -> Result<TransferStatus, Error> {
        let inner = &self.inner;
        let generation = inner.registry.generation();
        let peer = self.check_request(req)?;
        let rdma = peer.path == Path::Rdma;
        let Resolved {
            guards,
            lkeys,
            keys,
            rkeys,
        } = self.resolve(req, sync.as_deref(), &peer)?;
        let link = peer.link(inner)?;
        if rdma {
            let wrs = plan_rdma(req, &lkeys, &rkeys, &link, &inner.config)?;
            let driver = small(req).then(|| link.driver());
            if !fence && req.local.descs.len() <= CACHE_MAX_DESCS && driver.is_some() {
                let planned = Planned {
                    peer: Arc::clone(&peer),
                    link: Arc::clone(&link),
                    wrs: wrs.clone(),
                    driver: driver.clone(),
                };
                self.remember(req, generation, &guards, planned);
            }
            return self.post_planned(&link, req.op, Cow::Owned(wrs), sync, guards, &driver);
        }
        let id = inner.next_req.fetch_add(1, Ordering::Relaxed);
        let completion = Completion::counted(None, Some(&inner.in_flight));
        let new_pending = |outstanding: usize| {
            Arc::new(Pending {
                completion: Arc::clone(&completion),
                outstanding: AtomicUsize::new(outstanding),
                error: Mutex::new(None),
                failed: AtomicBool::new(false),
                guards: Mutex::new(guards),
                granted: OnceLock::new(),
                undriven: None,
            })
        };
        if let Path::Cma { pid } = peer.path {
            let pending = new_pending(1);
            link.insert(id, Arc::clone(&pending))?;
            link.clock.touch();
            let job = Job::Cma {
                req: id,
                op: req.op,
                pid,
                pieces: req
                    .local
                    .descs
                    .iter()
                    .zip(&req.remote.descs)
                    .map(|(l, r)| Piece {
                        local: l.addr,
                        remote: r.addr,
                        len: l.len,
                    })
                    .collect(),
                grants: grant_ranges(&req.remote, &keys),
                delegate: should_delegate(req),
                sync,
                pending,
            };
            if link.streams[0].tx.send(job).is_err() {
                link.fail(Error::Closed);
            }
            return Ok(TransferStatus::new(id, completion));
        }
        let n = link.streams.len();
        let plan = plan_segments(req, &keys, inner.config.segment_size, n);
        let total: usize = plan.iter().map(Vec::len).sum();
        let reads = if req.op == TransferOp::Read { total } else { 0 };
        let fences = if fence { n - 1 } else { 0 };
        let pending = new_pending(reads + 1);
        link.insert(id, Arc::clone(&pending))?;
        link.clock.touch();
        let mut sync = sync;
        // Stream 0 carries the commit, after its own segments; every other
        // stream carries its segments (and a fence, for data-less requests).
        for (k, segs) in plan.into_iter().enumerate().rev() {
            let tail = if k == 0 {
                Tail::Commit {
                    segments: (total + fences) as u64,
                    sync: sync.take(),
                }
            } else if fence {
                Tail::Fence
            } else if segs.is_empty() {
                continue;
            } else {
                Tail::None
            };
            let job = Job::Frames {
                req: id,
                op: req.op,
                segs,
                tail,
                pending: Arc::clone(&pending),
            };
            if link.streams[k].tx.send(job).is_err() {
                link.fail(Error::Closed);
                break;
            }
        }
        Ok(TransferStatus::new(id, completion))
    }
}

/// Whether waiting threads poll the completion queue themselves for `req`:
/// only for small, latency-bound requests — on large ones a spinning
/// waiter takes the CPU from the stack that moves the data (measured on
/// soft-RoCE: dropped ACKs and stalls), and saves nothing.
fn small(req: &TransferRequest) -> bool {
    req.local.descs.iter().map(|d| d.len).sum::<u64>() <= rdma::DRIVE_MAX_BYTES
}

/// `req`'s work requests on `link`'s queue pairs, from its resolved local
/// and remote keys.
fn plan_rdma(
    req: &TransferRequest,
    lkeys: &[u32],
    rkeys: &[u32],
    link: &Link,
    config: &AgentConfig,
) -> Result<Few<rdma::Wr>, Error> {
    let pieces: Few<_> = req
        .local
        .descs
        .iter()
        .zip(lkeys)
        .zip(req.remote.descs.iter().zip(rkeys))
        .map(|((l, &lk), (r, &rk))| (lk, l.addr, rk, r.addr, l.len))
        .collect();
    let conn = link.rdma.first().ok_or(Error::Closed)?;
    Ok(rdma::plan_wrs(
        &pieces,
        conn.max_msg.min(config.segment_size).min(rdma::WR_MAX),
        conn.max_sge,
    ))
}

/// What a [`PreparedTransfer`] on a socket path keeps: its local regions
/// held (as on RDMA), nothing else.
struct PreparedHold {
    _guards: Few<RegionGuard>,
}

/// Largest request (in descriptors) [`SubmitCache`] remembers: the cache
/// is for latency-bound requests sent again and again; comparing a large
/// request costs what resolving it does.
const CACHE_MAX_DESCS: usize = 4;

/// The resolution of the last small RDMA request `submit_transfer` took,
/// reused when the next one is the same (same operation, agent and
/// descriptors) and still valid: the peer entry not retired, the link not
/// broken, no deregistration since (the registry's generation). What a
/// caller resubmitting one request gets from
/// [`submit_prepared`](TransferAgent::submit_prepared), without preparing;
/// unlike a prepared transfer it holds no region.
struct SubmitCache {
    op: TransferOp,
    remote_agent: String,
    local: MemoryDescs,
    remote: MemoryDescs,
    /// Registry generation read before the regions were resolved.
    generation: u64,
    regions: Few<Arc<crate::registry::LocalRegion>>,
    /// Shared with the submissions in flight: a hit takes one reference
    /// (no copy of the work requests) and lets the cache go.
    planned: Arc<Planned>,
}

impl SubmitCache {
    fn matches(&self, req: &TransferRequest) -> bool {
        self.op == req.op
            && same_name(&self.remote_agent, &req.remote_agent)
            && self.local == req.local
            && self.remote == req.remote
    }
}

/// `a == b` for strings as short as agent names, without a call to
/// `memcmp`: from 8 to 16 bytes, two overlapping words each (a handful of
/// instructions, against about 35 for the call on an 11-byte name, on the
/// path of every cached submission).
fn same_name(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if (8..=16).contains(&n) {
        let word = |s: &[u8], at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&s[at..at + 8]);
            u64::from_ne_bytes(w)
        };
        return word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8);
    }
    a == b
}

/// A [`Link::post_express`] hold for holds already taken: moves `taken`
/// into the lane's list.
fn hold_all(into: &mut Few<RegionGuard>, taken: &mut Few<RegionGuard>) -> bool {
    std::mem::swap(into, taken);
    true
}

/// An RDMA request resolved against one peer entry and one link, ready to
/// post again (kept by [`SubmitCache`] and by prepared transfers).
struct Planned {
    peer: Arc<Peer>,
    link: Arc<Link>,
    wrs: Few<rdma::Wr>,
    /// `Some` for requests whose waiters poll the completion queue.
    driver: Option<std::sync::Weak<dyn Progress>>,
}

impl Planned {
    /// Whether it still holds: the peer entry not replaced or invalidated,
    /// the link not broken.
    fn current(&self) -> bool {
        !self.peer.retired.load(Ordering::Acquire) && !self.link.is_broken()
    }
}

/// What an RDMA [`PreparedTransfer`] keeps: the plan, and holds on the
/// local regions (registered, their keys valid, while it lives).
struct PreparedRdma {
    planned: Planned,
    guards: Few<RegionGuard>,
}

/// A request's local and remote keys, and the holds on its local regions.
struct Resolved {
    guards: Few<RegionGuard>,
    /// RDMA local keys, one per local descriptor (RDMA path only).
    lkeys: Few<u32>,
    /// Access keys of the remote regions (socket paths).
    keys: Vec<u64>,
    /// RDMA remote keys, one per remote descriptor (RDMA path only).
    rkeys: Few<u32>,
}

impl TcpAgent {
    /// The checks of a request that need no registry: the agent open, the
    /// shape, the memory type, the remote agent known. Returns the peer.
    fn check_request(&self, req: &TransferRequest) -> Result<Arc<Peer>, Error> {
        let inner = &self.inner;
        if inner.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        req.validate_shape()?;
        if req.local.mem_type != MemoryType::Dram && !req.local.is_empty() {
            return Err(Error::UnsupportedMemoryType {
                mem_type: req.local.mem_type,
                backend: mode_name(inner.mode),
            });
        }
        inner.peer(&req.remote_agent)
    }

    /// Looks `req`'s descriptors up: local ones in the registry (held),
    /// remote ones in what `peer` exported; checks the sync message's size.
    fn resolve(
        &self,
        req: &TransferRequest,
        sync: Option<&[u8]>,
        peer: &Peer,
    ) -> Result<Resolved, Error> {
        let rdma = peer.path == Path::Rdma;
        let mut lkeys = Few::new();
        let guards = self
            .inner
            .registry
            .acquire_local_keyed(&req.local, rdma.then_some(&mut lkeys))?;
        // Access keys for the socket paths, remote keys for RDMA.
        let mut keys = Vec::new();
        let mut rkeys = Few::new();
        let mut hint = None;
        for d in &req.remote.descs {
            let found = peer.regions.find_hinted(req.remote.mem_type, d, hint);
            hint = found;
            let Some(r) = found else {
                return Err(Error::RemoteRangeNotExported {
                    remote: req.remote_agent.clone(),
                    mem_type: req.remote.mem_type,
                    desc: *d,
                });
            };
            if !rdma {
                keys.push(r.value.0);
            } else {
                rkeys.push(r.value.1.ok_or_else(|| Error::Rdma {
                    remote: req.remote_agent.clone(),
                    detail: format!(
                        "remote region {:?} is not registered with an RDMA device",
                        r.desc
                    ),
                })?);
            }
        }
        if rdma && sync.is_some_and(|m| m.len() > rdma::SYNC_MSG_MAX) {
            return Err(Error::InvalidRequest(format!(
                "sync messages on the RDMA path are at most {} bytes",
                rdma::SYNC_MSG_MAX
            )));
        }
        Ok(Resolved {
            guards,
            lkeys,
            keys,
            rkeys,
        })
    }

    /// Keeps `req`'s resolution for the next identical submission (in the
    /// entry's own allocations when there is one).
    fn remember(
        &self,
        req: &TransferRequest,
        generation: u64,
        guards: &[RegionGuard],
        planned: Planned,
    ) {
        let Ok(mut slot) = self.inner.submit_cache.try_lock() else {
            return;
        };
        let regions = guards.iter().map(|g| Arc::clone(g.region())).collect();
        match slot.as_deref_mut() {
            Some(c) => {
                c.op = req.op;
                c.remote_agent.clone_from(&req.remote_agent);
                c.local.mem_type = req.local.mem_type;
                c.local.descs.clone_from(&req.local.descs);
                c.remote.mem_type = req.remote.mem_type;
                c.remote.descs.clone_from(&req.remote.descs);
                c.generation = generation;
                c.regions = regions;
                c.planned = Arc::new(planned);
            }
            None => {
                *slot = Some(Box::new(SubmitCache {
                    op: req.op,
                    remote_agent: req.remote_agent.clone(),
                    local: req.local.clone(),
                    remote: req.remote.clone(),
                    generation,
                    regions,
                    planned: Arc::new(planned),
                }))
            }
        }
    }

    /// The latency-bound case in one pass: `req` is the request that
    /// [`SubmitCache`] holds, still valid, one data work request without a
    /// sync message, and the link's express lane takes it. The region holds
    /// go straight into the lane, and the status comes back alone (two
    /// words): no `Result` of this layer's error moved through the calls of
    /// the general path, which on soft-RoCE's 8-byte ping-pong was a fifth
    /// of the library's instructions before the post (`docs/benchmarks.md`).
    /// `None`, with nothing held or claimed: [`submit_cached`](Self::submit_cached)
    /// and the general path decide (a hit the lane turns away, taken by
    /// another request, is looked up once more there: rare, and the lookup
    /// is a few compares).
    fn express_cached(&self, req: &TransferRequest) -> Option<TransferStatus> {
        if req.sync_message.is_some() {
            return None;
        }
        let slot = self.inner.submit_cache.try_lock().ok()?;
        let c = self.cache_hit(&slot, req)?;
        let p = &c.planned;
        let (Some(driver), [wr]) = (&p.driver, p.wrs.as_slice()) else {
            return None;
        };
        let id = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        let registry = &self.inner.registry;
        let hold = |g: &mut Few<RegionGuard>| registry.hold_into(&c.regions, c.generation, g);
        let completion = p.link.post_express(id, req.op, wr, hold, driver)?;
        drop(slot);
        Some(TransferStatus::new(id, completion))
    }

    /// The entry of the submit cache (`slot`, its lock held) when it holds
    /// `req` and is still valid: the peer entry and the link current, the
    /// agent not closing.
    fn cache_hit<'a>(
        &self,
        slot: &'a Option<Box<SubmitCache>>,
        req: &TransferRequest,
    ) -> Option<&'a SubmitCache> {
        if req.local.descs.len() > CACHE_MAX_DESCS {
            return None;
        }
        let c = slot.as_deref().filter(|c| c.matches(req))?;
        (c.planned.current() && !self.inner.closing.load(Ordering::Relaxed)).then_some(c)
    }

    /// Submits `req` from [`SubmitCache`] when it holds this request, still
    /// valid; `None`: resolve it in full.
    fn submit_cached(&self, req: &TransferRequest) -> Option<Result<TransferStatus, Error>> {
        if req
            .sync_message
            .as_ref()
            .is_some_and(|m| m.len() > rdma::SYNC_MSG_MAX)
        {
            return None;
        }
        let slot = self.inner.submit_cache.try_lock().ok()?;
        let c = self.cache_hit(&slot, req)?;
        let guards = self.inner.registry.hold_current(&c.regions, c.generation)?;
        // Posted with the entry still locked (no reference on the plan
        // taken and dropped): nothing on the posting path takes this lock,
        // and a thread that finds it taken meanwhile resolves in full.
        let p = &c.planned;
        let r = self.post_planned(
            &p.link,
            req.op,
            Cow::Borrowed(&p.wrs),
            req.sync_message.clone(),
            guards,
            &p.driver,
        );
        drop(slot);
        Some(r)
    }

    /// Posts planned RDMA work requests as request `id`: its status, whose
    /// waiters drive `driver` (`None`: the progress thread completes it).
    fn post_planned(
        &self,
        link: &Arc<Link>,
        op: TransferOp,
        wrs: std::borrow::Cow<'_, Few<rdma::Wr>>,
        sync: Option<Vec<u8>>,
        mut guards: Few<RegionGuard>,
        driver: &Option<std::sync::Weak<dyn Progress>>,
    ) -> Result<TransferStatus, Error> {
        let id = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        if let (None, Some(d), [wr]) = (&sync, driver, wrs.as_slice())
            && let Some(c) = link.post_express(id, op, wr, |g| hold_all(g, &mut guards), d)
        {
            // No clock touched: the link's idle check watches the table,
            // which express requests stay out of (their queue pair's own
            // timeouts fail them).
            return Ok(TransferStatus::new(id, c));
        }
        let driven = driver.is_some();
        let completion = Completion::counted(driver.clone(), Some(&self.inner.in_flight));
        // A sync message is two events: its SEND's completion, and the
        // target's acknowledgement that it delivered it.
        let events = wrs.len() + 2 * usize::from(sync.is_some());
        if events == 0 {
            completion.complete(Ok(()));
            return Ok(TransferStatus::new(id, completion));
        }
        let pending = Arc::new(Pending {
            completion: Arc::clone(&completion),
            outstanding: AtomicUsize::new(events),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            guards: Mutex::new(guards),
            granted: OnceLock::new(),
            undriven: (!driven).then(|| Arc::clone(&link.undriven)),
        });
        link.insert(id, Arc::clone(&pending))?;
        link.clock.touch();
        if !driven {
            // Counted before posting: the progress threads must be on
            // the completion queue by the time it completes.
            link.undriven.fetch_add(1, Ordering::AcqRel);
            link.wake_progress();
        }
        link.post_rdma(id, op, wrs.into_owned(), sync, &pending);
        Ok(TransferStatus::new(id, completion))
    }
}

impl TransferAgent for TcpAgent {
    fn name(&self) -> &str {
        &self.inner.config.name
    }

    fn backend_name(&self) -> &'static str {
        mode_name(self.inner.mode)
    }

    fn remote_transport(&self, name: &str) -> Result<&'static str, Error> {
        Ok(match self.inner.peer(name)?.path {
            Path::Tcp => "tcp",
            Path::Cma { .. } => "shm",
            Path::Rdma => "rdma",
        })
    }

    unsafe fn register_memory(&self, descs: &MemoryDescs) -> Result<(), Error> {
        // SAFETY: forwarded contract of `register_memory`.
        unsafe {
            self.inner.registry.register(
                descs,
                SUPPORTED,
                mode_name(self.inner.mode),
                self.inner.device.as_deref(),
            )
        }
    }

    fn deregister_memory(&self, descs: &MemoryDescs) -> Result<(), Error> {
        self.inner.registry.deregister(descs)
    }

    fn local_agent_desc(&self) -> AgentDesc {
        self.inner.local_desc()
    }

    fn load_remote_agent(&self, desc: &AgentDesc) -> Result<(), Error> {
        desc.validate()?;
        let regions = desc.region_map()?;
        let path = self.inner.choose_path(desc)?;
        let mut peers = self.inner.peers.write().unwrap_or_else(|p| p.into_inner());
        // Same process: keep the live link, refresh the regions.
        let link = match peers.get(&desc.name) {
            Some(old) if old.desc.instance == desc.instance && old.path == path => {
                lock(&old.link).take()
            }
            Some(old) => {
                if let Some(l) = lock(&old.link).take() {
                    l.fail(Error::StaleAgent {
                        remote: desc.name.clone(),
                        addr: desc.endpoints.join(","),
                    });
                }
                None
            }
            None => None,
        };
        let peer = Arc::new(Peer {
            desc: desc.clone(),
            regions,
            path,
            link: Mutex::new(link),
            retired: AtomicBool::new(false),
        });
        if let Some(old) = peers.insert(desc.name.clone(), Arc::clone(&peer)) {
            old.retired.store(true, Ordering::Release);
            // Drop a cached resolution's hold on the old entry's link.
            *lock(&self.inner.submit_cache) = None;
        }
        drop(peers);
        // Connect now, so the first transfer does not pay for connection
        // setup. A failure is not fatal: the first transfer retries.
        if let Err(e) = peer.link(&self.inner) {
            tracing::info!(remote = %desc.name, error = %e, "eager connect failed; will retry on first transfer");
        }
        Ok(())
    }

    fn fetch_remote_agent_desc(&self, connection_info: &str) -> Result<AgentDesc, Error> {
        fetch_desc(&self.inner, connection_info)
    }

    fn remote_agent_desc(&self, name: &str) -> Result<AgentDesc, Error> {
        Ok(self.inner.peer(name)?.desc.clone())
    }

    fn invalidate_remote_agent(&self, name: &str) -> Result<(), Error> {
        let peer = self
            .inner
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
            .ok_or_else(|| Error::UnknownAgent(name.to_owned()))?;
        peer.retired.store(true, Ordering::Release);
        *lock(&self.inner.submit_cache) = None;
        if let Some(l) = lock(&peer.link).take() {
            l.fail(Error::UnknownAgent(name.to_owned()));
            l.join();
        }
        Ok(())
    }

    fn local_connection_info(&self) -> String {
        self.inner.endpoint.clone()
    }

    fn submit_transfer(&self, request: &TransferRequest) -> Result<TransferStatus, Error> {
        self.room_for_one()?;
        if let Some(st) = self.express_cached(request) {
            return Ok(st);
        }
        if let Some(r) = self.submit_cached(request) {
            return r;
        }
        self.submit(request, request.sync_message.clone(), false)
    }

    fn prepare_transfer(&self, request: &TransferRequest) -> Result<PreparedTransfer, Error> {
        let inner = &self.inner;
        let owner = inner.instance;
        let peer = self.check_request(request)?;
        let Resolved {
            guards,
            lkeys,
            rkeys,
            ..
        } = self.resolve(request, request.sync_message.as_deref(), &peer)?;
        if peer.path != Path::Rdma {
            // The socket paths keep only the holds on the local regions:
            // the request was checked now, and is validated in full on
            // every submission.
            let hold = PreparedHold { _guards: guards };
            return Ok(PreparedTransfer::new(
                request.clone(),
                owner,
                Some(Box::new(hold)),
            ));
        }
        let link = peer.link(inner)?;
        let wrs = plan_rdma(request, &lkeys, &rkeys, &link, &inner.config)?;
        let driver = small(request).then(|| link.driver());
        let resolved = PreparedRdma {
            planned: Planned {
                peer,
                link,
                wrs,
                driver,
            },
            guards,
        };
        Ok(PreparedTransfer::new(
            request.clone(),
            owner,
            Some(Box::new(resolved)),
        ))
    }

    fn submit_prepared(&self, prepared: &PreparedTransfer) -> Result<TransferStatus, Error> {
        if prepared.owner() != self.inner.instance {
            return Err(Error::InvalidRequest(
                "the transfer was prepared by another agent".into(),
            ));
        }
        self.room_for_one()?;
        let req = prepared.request();
        let fresh = prepared
            .resolved
            .as_ref()
            .and_then(|r| r.downcast_ref::<PreparedRdma>())
            .filter(|r| r.planned.current());
        let Some(r) = fresh else {
            return self.submit(req, req.sync_message.clone(), false);
        };
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        let p = &r.planned;
        self.post_planned(
            &p.link,
            req.op,
            Cow::Borrowed(&p.wrs),
            req.sync_message.clone(),
            r.guards.clone(),
            &p.driver,
        )
    }

    fn notify_sync_message(&self, remote: &str, message: Vec<u8>) -> Result<TransferStatus, Error> {
        let req = TransferRequest::write(
            MemoryDescs::new(MemoryType::Dram, Vec::new()),
            MemoryDescs::new(MemoryType::Dram, Vec::new()),
            remote,
        );
        self.room_for_one()?;
        self.submit(&req, Some(message), true)
    }

    fn take_sync_messages(&self) -> SyncMessages {
        self.inner.inbox.take()
    }

    fn wait_sync_messages(&self, timeout: Duration) -> SyncMessages {
        self.inner.inbox.wait(timeout)
    }

    fn wait_sync_messages_timed(&self, timeout: Duration) -> crate::agent::TimedSyncMessages {
        self.inner.inbox.wait_timed(timeout)
    }

    fn wake_sync_waiters(&self) {
        self.inner.inbox.wake();
    }

    fn check_remote_descs(&self, remote: &str, descs: &MemoryDescs) -> bool {
        let Ok(peer) = self.inner.peer(remote) else {
            return false;
        };
        descs
            .descs
            .iter()
            .all(|d| peer.regions.find(descs.mem_type, d).is_some())
    }
}

// ---------------------------------------------------------------------------
// RDMA path.
// ---------------------------------------------------------------------------

/// Polls a completion queue with a short spin, then sleeps: a busy-poll
/// phase for latency, bounded CPU when idle.
struct Backoff {
    idle_polls: u32,
}

impl Backoff {
    fn new() -> Self {
        Self { idle_polls: 0 }
    }

    fn reset(&mut self) {
        self.idle_polls = 0;
    }

    /// Waits before the next poll. `busy`: work is outstanding, so the
    /// completion is due soon — keep polling (yielding the CPU) instead of
    /// sleeping, which costs a timer tick of latency.
    fn wait(&mut self, busy: bool) {
        self.idle_polls = self.idle_polls.saturating_add(1);
        // While work is outstanding, sleep less: 20 µs instead of 100.
        // Pure spinning was measured worse on soft-RoCE, where the polling
        // thread takes the CPU from the kernel threads that move the data.
        if busy && self.idle_polls >= 2000 {
            std::thread::sleep(Duration::from_micros(20));
        } else if self.idle_polls < 200 {
            std::hint::spin_loop();
        } else if self.idle_polls < 2000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Where one connection's sync messages go: the inbox, and the
/// connection's socket, on which each delivery is acknowledged (the serve
/// thread no longer writes on an RDMA connection).
struct SyncSink {
    inbox: Arc<Inbox>,
    remote: String,
    sock: TcpStream,
    io_timeout: Duration,
}

impl SyncSink {
    /// Delivers one received SEND (a sync message, after its request's data
    /// by RC ordering) and acknowledges it. `false`: the connection must
    /// receive no more (a malformed message, or the socket failed).
    fn deliver(&self, bytes: &[u8], clock: &ProgressClock) -> bool {
        let Some((req, msg)) = rdma::split_sync(bytes) else {
            tracing::warn!(remote = %self.remote, "malformed RDMA sync message");
            return false;
        };
        let st = match self.inbox.reserve(&self.remote, msg.len() as u64) {
            Ok(room) => {
                self.inbox.deliver(room, msg.to_vec());
                status::OK
            }
            Err(reason) => {
                tracing::debug!(remote = %self.remote, len = msg.len(), %reason, "refused an RDMA sync message");
                reason.code()
            }
        };
        let ack = [Frame::Ack { req, status: st }.encode()];
        send_frames(&self.sock, &ack, clock, self.io_timeout).is_ok()
    }
}

/// Sleeps on a completion channel between polls: arm, poll once more (a
/// completion that came before arming raises no event), then wait at most
/// 50 ms (so a stop request is noticed). Returns `false` when the channel
/// failed.
fn idle_wait(events: &crate::verbs::CqEvents, armed: &mut bool) -> bool {
    if *armed {
        *armed = false;
        events.wait(Duration::from_millis(50)).is_ok()
    } else {
        *armed = true;
        events.arm().is_ok()
    }
}

/// What a connection's own receive thread needs (when receives are not
/// shared).
struct ReceiverCtx {
    sink: SyncSink,
    stop: Arc<AtomicBool>,
}

impl ReceiverCtx {
    /// Delivers each SEND and reposts its buffer, until stopped or the
    /// queue pair fails. Owns the queue pair and the ring; the queue pair
    /// is declared first in the tuple so it is destroyed before the ring's
    /// registration.
    fn run(self, mut qp: crate::verbs::RcQueuePair, ring: rdma::MsgRing) {
        let poller = qp.recv_poller();
        let events = qp.recv_events();
        let clock = ProgressClock::new();
        let mut done = Vec::new();
        let mut backoff = Backoff::new();
        let mut armed = false;
        while !self.stop.load(Ordering::Relaxed) {
            done.clear();
            if poller.poll(&mut done).is_err() {
                break;
            }
            if done.is_empty() {
                match &events {
                    Some(ev) => {
                        if !idle_wait(ev, &mut armed) {
                            break;
                        }
                    }
                    None => backoff.wait(false),
                }
                continue;
            }
            backoff.reset();
            for c in &done {
                let slot = c.wr_id as usize;
                if c.status != 0 || slot >= rdma::RING {
                    tracing::debug!(remote = %self.sink.remote, status = crate::verbs::wc_status_name(c.status), "RDMA receive ended");
                    return;
                }
                if !self
                    .sink
                    .deliver(&ring.read(slot, c.byte_len as usize), &clock)
                {
                    return;
                }
                // SAFETY: the slot belongs to `ring`, which outlives `qp`.
                if unsafe { qp.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX)) }.is_err() {
                    return;
                }
            }
        }
        drop(qp);
        drop(ring);
    }
}

/// Receive buffers in the agent's shared receive queue.
const SRQ_RING: usize = 256;

/// What the shared receive thread and the connections using it share.
///
/// Drop order: `srq` (whose queue pairs, holding `Arc`s to it, are gone
/// by then) is released before `ring`'s registration.
struct SrqShared {
    srq: Arc<crate::verbs::SharedReceiveQueue>,
    ring: rdma::MsgRing,
    /// Queue pair number → the connection its messages belong to.
    conns: Mutex<HashMap<u32, Arc<SyncSink>, FastHash>>,
}

/// The agent's one thread receiving the sync messages of every incoming
/// RDMA connection, from one shared receive queue. Dropped (stopped and
/// joined) with the last connection and the agent.
struct SrqReceiver {
    shared: Arc<SrqShared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SrqReceiver {
    fn start(dev: &Arc<Device>, agent: &str) -> Result<Arc<Self>, crate::verbs::VerbsError> {
        let srq = dev.create_srq(SRQ_RING as u32)?;
        let slots = (srq.depth() as usize).min(SRQ_RING);
        let ring = rdma::MsgRing::new(dev, slots)?;
        for slot in 0..slots {
            // SAFETY: the ring lives in `SrqShared` beside the queue and is
            // released after it.
            unsafe { srq.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX))? };
        }
        let shared = Arc::new(SrqShared {
            srq,
            ring,
            conns: Mutex::new(HashMap::default()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (sh, st) = (Arc::clone(&shared), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-rdma-srq-{agent}"))
            .spawn(move || srq_receive(&sh, &st, slots))
            .map_err(|e| crate::verbs::VerbsError::Verb {
                verb: "spawning the receive thread",
                source: e,
            })?;
        Ok(Arc::new(Self {
            shared,
            stop,
            thread: Some(thread),
        }))
    }
}

impl Drop for SrqReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The shared receive thread: delivers each SEND to the connection whose
/// queue pair it came through and reposts the buffer. A connection whose
/// message fails (malformed, socket gone) or whose queue pair reports an
/// error receives no more; the others are unaffected.
fn srq_receive(sh: &SrqShared, stop: &AtomicBool, slots: usize) {
    let events = sh.srq.events();
    let clock = ProgressClock::new();
    let mut done = Vec::new();
    let mut armed = false;
    while !stop.load(Ordering::Relaxed) {
        done.clear();
        if let Err(e) = sh.srq.poll(&mut done) {
            tracing::error!(error = %e, "polling the shared receive queue failed; RDMA sync messages stop");
            return;
        }
        if done.is_empty() {
            if !idle_wait(&events, &mut armed) {
                tracing::error!(
                    "the shared receive queue's channel failed; RDMA sync messages stop"
                );
                return;
            }
            continue;
        }
        for &(qpn, c) in &done {
            let slot = c.wr_id as usize;
            if slot >= slots {
                continue;
            }
            let sink = lock(&sh.conns).get(&qpn).cloned();
            match sink {
                Some(sink) if c.status == 0 => {
                    let ok = sink.deliver(&sh.ring.read(slot, c.byte_len as usize), &clock);
                    if !ok {
                        lock(&sh.conns).remove(&qpn);
                    }
                }
                Some(sink) => {
                    tracing::debug!(remote = %sink.remote, status = crate::verbs::wc_status_name(c.status), "RDMA receive ended");
                    lock(&sh.conns).remove(&qpn);
                }
                // A connection already closed.
                None => {}
            }
            // SAFETY: the slot belongs to `sh.ring`, which outlives the
            // queue (declared after it in `SrqShared`).
            if let Err(e) = unsafe {
                sh.srq
                    .post_recv(slot as u64, sh.ring.sge(slot, rdma::SYNC_MAX))
            } {
                tracing::error!(error = %e, "reposting to the shared receive queue failed");
            }
        }
    }
}

/// A connection's receiving end: its own thread, or its place in the
/// shared receive queue. Dropped when the connection ends.
enum RdmaReceiver {
    /// Stops and joins the connection's thread (which owns its queue pair).
    Own {
        stop: Arc<AtomicBool>,
        thread: Option<JoinHandle<()>>,
    },
    /// Leaves the shared receive thread's table (in `drop`), then destroys
    /// the queue pair, then releases the receiver (fields drop in order).
    Shared {
        qpn: u32,
        /// Held only to be destroyed after leaving the table.
        _qp: crate::verbs::SrqQueuePair,
        rx: Arc<SrqReceiver>,
    },
}

impl Drop for RdmaReceiver {
    fn drop(&mut self) {
        match self {
            RdmaReceiver::Own { stop, thread } => {
                stop.store(true, Ordering::Relaxed);
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
            RdmaReceiver::Shared { qpn, rx, .. } => {
                lock(&rx.shared.conns).remove(qpn);
            }
        }
    }
}

/// Initiator side of the queue-pair exchange on a fresh stream.
fn rdma_connect(
    inner: &Inner,
    peer: &AgentDesc,
    sock: &TcpStream,
    clock: &ProgressClock,
    index: usize,
) -> Result<rdma::RdmaConn, Error> {
    let dev = inner
        .device
        .as_ref()
        .ok_or_else(|| Error::BackendUnavailable {
            backend: "rdma",
            reason: "this agent has no RDMA device".into(),
        })?;
    let rerr = |e: crate::verbs::VerbsError| rdma::rdma_err(&peer.name, e);
    let events = inner.config.rdma_progress != crate::agent::RdmaProgress::Poll;
    // One send-queue entry beyond the window: the express lane's, whose
    // lone work request bypasses the window (see `Link::post_express`).
    let mut qp = dev.create_rc_with(rdma::WINDOW + 1, events).map_err(rerr)?;
    let mine = qp.info();
    let hdr = Frame::QpConnect {
        qpn: mine.qpn,
        psn: mine.psn,
        mtu: mine.mtu,
    }
    .encode();
    let t = inner.config.connect_timeout;
    let conn_err = |e: io::Error| Error::ConnectionLost {
        remote: peer.name.clone(),
        cause: Arc::new(e),
    };
    let mut iovs = [iov(hdr.as_ptr(), HEADER_LEN), iov(mine.gid.as_ptr(), 16)];
    // SAFETY: both iovecs point into live locals.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs, clock, t) }.map_err(conn_err)?;
    let mut reader = FrameReader::new(sock.as_raw_fd(), clock);
    reader.set_deadline(Some(std::time::Instant::now() + t));
    let mut idle = UntilDeadline;
    let raw = reader
        .next_header(&mut idle)
        .map_err(|e| timeout_or(e, "queue pair exchange", t, conn_err))?
        .ok_or_else(|| conn_err(io::ErrorKind::UnexpectedEof.into()))?;
    let (qpn, psn, mtu) = match Frame::decode(&raw) {
        Ok(Frame::QpAccept {
            qpn,
            psn,
            mtu,
            status: status::OK,
        }) => (qpn, psn, mtu),
        Ok(Frame::QpAccept { status: st, .. }) => {
            return Err(Error::BackendUnavailable {
                backend: "rdma",
                reason: format!(
                    "remote agent {:?} refused the queue pair ({})",
                    peer.name,
                    if st == status::NO_RDMA {
                        "it has no RDMA device"
                    } else {
                        "it could not create or connect one"
                    }
                ),
            });
        }
        other => {
            return Err(Error::ProtocolViolation {
                remote: peer.name.clone(),
                detail: format!("bad queue pair answer {other:?}"),
            });
        }
    };
    let gid: [u8; 16] = reader
        .read_vec(16, &mut idle)
        .map_err(|e| timeout_or(e, "queue pair exchange", t, conn_err))?
        .try_into()
        .map_err(|_| Error::ProtocolViolation {
            remote: peer.name.clone(),
            detail: "short GID".into(),
        })?;
    qp.set_ack_timeout(ack_timeout(&inner.config));
    qp.connect(&QpInfo { qpn, psn, gid, mtu }).map_err(rerr)?;
    rdma::RdmaConn::new(
        qp,
        dev,
        u64::MAX,
        (index, inner.config.rdma_qps_per_peer),
        inner.config.rdma_max_inflight,
    )
    .map_err(rerr)
}

impl Progress for Link {
    fn progress(&self) -> bool {
        // Every queue pair is drained (no short cut at the first with
        // completions).
        self.rdma
            .iter()
            .map(|c| self.drain_rdma(c, false))
            .sum::<usize>()
            > 0
    }
}

impl Link {
    /// What a waiting thread polls for this link's completions (weak: a
    /// status must not keep the link alive).
    fn driver(self: &Arc<Self>) -> std::sync::Weak<dyn Progress> {
        let strong: Arc<dyn Progress> = Arc::clone(self) as Arc<dyn Progress>;
        Arc::downgrade(&strong)
    }

    /// Wakes the RDMA progress threads (parked while no large request is
    /// in flight).
    fn wake_progress(&self) {
        for t in self.progress_threads.get().into_iter().flatten() {
            t.unpark();
        }
    }

    fn broken_cause(&self) -> Option<Error> {
        if !self.is_broken() {
            return None;
        }
        lock(&self.pending).broken.clone()
    }

    /// Queues a request's work requests (then its sync message as a SEND)
    /// and posts as many as the send window allows; the progress thread
    /// posts the rest as completions free the window. Never blocks.
    fn post_rdma(
        &self,
        id: u64,
        op: TransferOp,
        wrs: Few<rdma::Wr>,
        sync: Option<Vec<u8>>,
        pending: &Arc<Pending>,
    ) {
        let n = self.rdma.len();
        if n == 1 {
            // One queue pair: everything in order on it, no gate.
            let conn = &self.rdma[0];
            let mut q = lock(&conn.queue);
            // One data work request, nothing queued before it, room in the
            // window: posted at once, without going through the queue.
            if let ([wr], None) = (wrs.as_slice(), &sync)
                && self.room_alone(conn, &q, wr)
            {
                // SAFETY: the pieces lie in regions held by the request's
                // guards until its completion.
                if let Err(err) = unsafe { self.post_alone(conn, q, id, op, wr) } {
                    self.complete_event(id, pending, Err(err.clone()));
                    self.fail(err);
                }
                return;
            }
            let count = wrs.len() + usize::from(sync.is_some());
            conn.count_queued(count as u64);
            conn.waiting.fetch_add(count, Ordering::SeqCst);
            for wr in wrs {
                q.items
                    .push_back((rdma::Queued::Data { id, op, wr }, Arc::clone(pending)));
            }
            if let Some(msg) = sync {
                let gate = Vec::new();
                q.items
                    .push_back((rdma::Queued::Sync { id, msg, gate }, Arc::clone(pending)));
            }
            self.pump_locked(conn, q);
            return;
        }
        // Work requests go round the queue pairs, starting where the
        // previous request left off, so small requests spread too.
        let start = self
            .next_stripe
            .fetch_add(wrs.len().max(1), Ordering::Relaxed);
        let mut per_qp: Vec<Vec<rdma::Wr>> = (0..n).map(|_| Vec::new()).collect();
        for (i, wr) in wrs.into_iter().enumerate() {
            per_qp[(start + i) % n].push(wr);
        }
        let mut touched = vec![false; n];
        for ((conn, wrs), t) in self.rdma.iter().zip(per_qp).zip(&mut touched) {
            if wrs.is_empty() {
                continue;
            }
            *t = true;
            let mut q = lock(&conn.queue);
            conn.count_queued(wrs.len() as u64);
            conn.waiting.fetch_add(wrs.len(), Ordering::SeqCst);
            for wr in wrs {
                q.items
                    .push_back((rdma::Queued::Data { id, op, wr }, Arc::clone(pending)));
            }
        }
        if let Some(msg) = sync {
            touched[0] = true;
            // After everything queued so far on the other queue pairs
            // (this request's data included): RC orders the SEND only
            // behind its own queue pair's work.
            let gate = self.rdma[1..]
                .iter()
                .map(|c| c.queued.load(Ordering::Acquire))
                .collect();
            let conn = &self.rdma[0];
            let mut q = lock(&conn.queue);
            conn.count_queued(1);
            conn.waiting.fetch_add(1, Ordering::SeqCst);
            q.items
                .push_back((rdma::Queued::Sync { id, msg, gate }, Arc::clone(pending)));
        }
        for (conn, _) in self.rdma.iter().zip(touched).filter(|(_, t)| *t) {
            self.pump(conn);
        }
    }

    /// Whether a sync message's gate is open: every work request it waits
    /// for on the other queue pairs has completed.
    fn gate_open(&self, gate: &[u64]) -> bool {
        gate.iter()
            .zip(&self.rdma[1..])
            .all(|(&g, c)| c.completed.load(Ordering::Acquire) >= g)
    }

    /// Posts queued work requests while the window and the message buffers
    /// allow, in order, up to [`rdma::DOORBELL_BATCH`] per doorbell. On a
    /// broken link, fails every queued one instead (each counts its events,
    /// so requests still complete exactly once).
    fn pump(&self, conn: &rdma::RdmaConn) {
        self.pump_locked(conn, lock(&conn.queue));
    }

    /// [`pump`](Self::pump) with the send queue's lock already held. Work
    /// of aborted requests met at the head of the queue is not posted: it
    /// counts as done (for the gates of later sync messages) and its events
    /// fail with [`Error::Aborted`], once the lock is let go.
    fn pump_locked<'c>(
        &self,
        conn: &'c rdma::RdmaConn,
        q: std::sync::MutexGuard<'c, rdma::SendQueue>,
    ) {
        let mut skipped = Vec::new();
        self.pump_queue(conn, q, &mut skipped);
        for (item, p) in skipped {
            for _ in 0..item.events() {
                self.complete_event(item.id(), &p, Err(Error::Aborted));
            }
        }
    }

    fn pump_queue<'c>(
        &self,
        conn: &'c rdma::RdmaConn,
        mut q: std::sync::MutexGuard<'c, rdma::SendQueue>,
        skipped: &mut Vec<(rdma::Queued, Arc<Pending>)>,
    ) {
        // A basic queue pair may post part of a failed batch: one at a time.
        let batch_max = if conn.batch_is_atomic {
            rdma::DOORBELL_BATCH
        } else {
            1
        };
        loop {
            if q.items.is_empty() {
                return;
            }
            if let Some(cause) = self.broken_cause() {
                let drained: Vec<_> = q.items.drain(..).collect();
                conn.waiting.fetch_sub(drained.len(), Ordering::AcqRel);
                drop(q);
                for (item, p) in drained {
                    for _ in 0..item.events() {
                        self.complete_event(item.id(), &p, Err(cause.clone()));
                    }
                }
                return;
            }
            // The batch, and every work request's pieces back to back with
            // where each one's are: scratch kept in the queue, so posting
            // allocates nothing.
            let rdma::SendQueue {
                items,
                batch,
                sges,
                spans,
            } = &mut *q;
            batch.clear();
            while batch.len() < batch_max {
                let Some((front, p)) = items.front() else {
                    break;
                };
                if p.completion.abort_requested() {
                    let (item, p) = items.pop_front().expect("front exists");
                    conn.waiting.fetch_sub(1, Ordering::SeqCst);
                    conn.count_completed();
                    skipped.push((item, p));
                    continue;
                }
                let len = match front {
                    rdma::Queued::Data { wr, .. } => wr.len,
                    rdma::Queued::Sync { gate, .. } if !self.gate_open(gate) => break,
                    rdma::Queued::Sync { msg, .. } => msg.len() as u64,
                };
                if !conn.try_take_slot(len) {
                    break;
                }
                let send_slot = match front {
                    rdma::Queued::Sync { .. } => match conn.sends.try_acquire() {
                        Some(s) => Some(s),
                        None => {
                            conn.unwind_slot();
                            break;
                        }
                    },
                    rdma::Queued::Data { .. } => None,
                };
                let (item, p) = items.pop_front().expect("front exists");
                // Still counted in `waiting` until posted (below), so an
                // express request cannot overtake it in between.
                batch.push((item, p, send_slot));
            }
            if batch.is_empty() {
                return;
            }
            conn.posted.fetch_add(batch.len(), Ordering::AcqRel);
            sges.clear();
            spans.clear();
            for (item, _, slot) in batch.iter() {
                let start = sges.len();
                match (item, slot) {
                    (rdma::Queued::Data { wr, .. }, _) => sges.extend_from_slice(&wr.sges),
                    (rdma::Queued::Sync { id, msg, .. }, Some(slot)) => {
                        let len = conn.sends.write_sync(*slot, *id, msg);
                        sges.push(conn.sends.sge(*slot, len));
                    }
                    (rdma::Queued::Sync { .. }, None) => {}
                }
                spans.push(start..sges.len());
            }
            let posts: Few<crate::verbs::Post<'_>> = batch
                .iter()
                .zip(spans.iter())
                .map(|((item, _, slot), span)| {
                    let sg = &sges[span.clone()];
                    match item {
                        rdma::Queued::Data { id, op, wr } => rdma::data_post(*id, *op, wr, sg),
                        rdma::Queued::Sync { id, .. } => crate::verbs::Post {
                            // A sync message always has a buffer (taken above).
                            wr_id: rdma::SEND_FLAG | ((slot.unwrap_or(0) as u64) << 40) | id,
                            op: crate::verbs::PostOp::Send { imm: 0 },
                            sges: sg,
                        },
                    }
                })
                .collect();
            // SAFETY: data pieces lie in registered regions held by the
            // requests' guards, which live until every event of a request
            // (these work requests' completions among them) has happened; a
            // message slot is ours until its SEND completes.
            let r = unsafe { lock(&conn.qp).post_batch(&posts) };
            drop(posts);
            conn.waiting.fetch_sub(batch.len(), Ordering::SeqCst);
            let Err(e) = r else {
                batch.clear();
                // Still holding the lock: go on while work is queued.
                continue;
            };
            // Nothing of the batch was posted (atomic batches, or one).
            let failed = std::mem::take(batch);
            // Slots are unwound under the queue's lock, as they were taken.
            for _ in 0..failed.len() {
                conn.unwind_slot();
            }
            drop(q);
            conn.posted.fetch_sub(failed.len(), Ordering::AcqRel);
            let err = rdma::rdma_err(&self.remote, e);
            for (item, p, slot) in failed.into_iter().rev() {
                if let Some(slot) = slot {
                    conn.sends.release(slot);
                }
                for _ in 0..item.events() {
                    self.complete_event(item.id(), &p, Err(err.clone()));
                }
            }
            self.fail(err);
            // The link is broken now: the next pass fails what is queued.
            q = lock(&conn.queue);
        }
    }

    /// Whether `wr` may be posted at once, bypassing the send queue `q`:
    /// nothing queued before it, the link whole, a window slot taken for it.
    fn room_alone(&self, conn: &rdma::RdmaConn, q: &rdma::SendQueue, wr: &rdma::Wr) -> bool {
        q.items.is_empty() && !self.is_broken() && conn.try_take_slot(wr.len)
    }

    /// Posts `wr` as work request `wr_id` with the send queue's lock `q`
    /// held and a window slot taken ([`room_alone`](Self::room_alone)); on
    /// failure gives the slot back and returns the error (the caller fails
    /// the request and the link).
    ///
    /// # Safety
    /// The pieces of `wr` must lie in regions held until its completion.
    unsafe fn post_alone(
        &self,
        conn: &rdma::RdmaConn,
        q: std::sync::MutexGuard<'_, rdma::SendQueue>,
        wr_id: u64,
        op: TransferOp,
        wr: &rdma::Wr,
    ) -> Result<(), Error> {
        conn.count_queued(1);
        conn.posted.fetch_add(1, Ordering::AcqRel);
        let post = rdma::data_post(wr_id, op, wr, &wr.sges);
        // SAFETY: forwarded contract.
        let r = unsafe { lock(&conn.qp).post_batch(std::slice::from_ref(&post)) };
        let Err(e) = r else {
            return Ok(());
        };
        conn.unwind_slot();
        drop(q);
        conn.posted.fetch_sub(1, Ordering::AcqRel);
        Err(rdma::rdma_err(&self.remote, e))
    }

    /// Posts request `id` (one data work request `wr`) in the express lane
    /// when the lane is free, nothing is queued before it and the link is
    /// whole ([`ExpressLane`]); returns its status, or `None` for the
    /// ordinary path. `hold` puts the request's region holds into the
    /// lane's (empty) list once the lane is claimed; false (holds no longer
    /// current, the list left empty) frees the lane again: `None`. Not
    /// called when the lane is not taken.
    fn post_express(
        &self,
        id: u64,
        op: TransferOp,
        wr: &rdma::Wr,
        hold: impl FnOnce(&mut Few<RegionGuard>) -> bool,
        driver: &std::sync::Weak<dyn Progress>,
    ) -> Option<Arc<Completion>> {
        let [conn] = self.rdma.as_slice() else {
            return None;
        };
        let post = rdma::data_post(id | rdma::EXPRESS_FLAG, op, wr, &wr.sges);
        let lane = &self.express;
        if !crate::verbs::SharedPoster::fits(&post)
            || lane
                .state
                .compare_exchange(
                    LANE_FREE,
                    LANE_CLAIMED,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return None;
        }
        // Sequentially consistent with the count a submitter raises before
        // it queues (and the pump lowers only after posting): either this
        // sees that work, or that work comes after this request.
        if conn.waiting.load(Ordering::SeqCst) != 0 || self.is_broken() {
            lane.state.store(LANE_FREE, Ordering::Release);
            return None;
        }
        let completion = {
            // SAFETY: our compare-and-swap moved the lane to CLAIMED: the
            // slot is ours until we store POSTED.
            let slot = unsafe { &mut *lane.slot.get() };
            if !hold(&mut slot.guards) {
                lane.state.store(LANE_FREE, Ordering::Release);
                return None;
            }
            let new = || Completion::counted(Some(driver.clone()), Some(&self.in_flight));
            let status = slot.status.get_or_insert_with(new);
            match Arc::get_mut(status) {
                // Unique: the caller dropped the status it was behind.
                Some(c) => c.reset(),
                None => *status = new(),
            }
            Arc::clone(status)
        };
        conn.posted.fetch_add(1, Ordering::AcqRel);
        lane.state.store(LANE_POSTED, Ordering::Release);
        // SAFETY: the pieces lie in regions held (in the lane) until the
        // work request's completion is handled; the connection's queue pair
        // is alive (we hold the link); `post` fits (checked above).
        if let Err(e) = unsafe { conn.poster.post(&post) } {
            conn.posted.fetch_sub(1, Ordering::AcqRel);
            let err = rdma::rdma_err(&self.remote, e);
            self.finish_express(Err(err.clone()), false);
            self.fail(err);
        } else if conn.reap.look(id) {
            // A software provider completes it inside the post: reaped
            // here, the caller's wait is one load.
            self.drain_rdma(conn, false);
            conn.reap.record(completion.is_done());
        }
        Some(completion)
    }

    /// Completes the express request in flight, if any, with `result`:
    /// releases its regions, records the outcome, frees the lane.
    /// `close`: the link's last thread is leaving, no request may take
    /// the lane after this one.
    fn finish_express(&self, result: Result<(), Error>, close: bool) {
        let lane = &self.express;
        loop {
            match lane.state.load(Ordering::Acquire) {
                LANE_POSTED => {
                    if lane
                        .state
                        .compare_exchange(
                            LANE_POSTED,
                            LANE_FINISHING,
                            Ordering::Acquire,
                            Ordering::Relaxed,
                        )
                        .is_err()
                    {
                        continue;
                    }
                    // SAFETY: our compare-and-swap moved the lane to
                    // FINISHING: the slot is ours until we store below.
                    let slot = unsafe { &mut *lane.slot.get() };
                    slot.guards.clear();
                    if let Some(c) = &slot.status {
                        c.complete(result);
                    }
                    let next = if close { LANE_CLOSED } else { LANE_FREE };
                    lane.state.store(next, Ordering::Release);
                    return;
                }
                LANE_FREE if close => {
                    if lane
                        .state
                        .compare_exchange(
                            LANE_FREE,
                            LANE_CLOSED,
                            Ordering::AcqRel,
                            Ordering::Relaxed,
                        )
                        .is_ok()
                    {
                        return;
                    }
                }
                // A submitter filling the slot, or another finisher: both
                // are a few instructions from handing the lane on.
                LANE_CLAIMED | LANE_FINISHING if close => std::thread::yield_now(),
                // Nothing in flight (or someone else finishing it).
                _ => return,
            }
        }
    }

    /// Handles one completion of `conn`'s send queue, polled by the holder
    /// of its poll lock: frees its window slot and message buffer, records
    /// its request's event (failing the link on an error completion).
    /// `touched`: whether this drain has told the link's idle clock yet (a
    /// drain of express completions alone reads no clock: the idle check
    /// watches the table, which they stay out of).
    fn on_send_completion(
        &self,
        conn: &rdma::RdmaConn,
        c: &crate::verbs::Completion,
        touched: &mut bool,
    ) {
        conn.posted.fetch_sub(1, Ordering::AcqRel);
        let express = c.wr_id & rdma::EXPRESS_FLAG != 0;
        if !express {
            // The express lane's work request takes no window slot.
            conn.count_completed();
            conn.release_slot();
            if !std::mem::replace(touched, true) {
                self.clock.touch();
            }
        }
        let (req, slot) = rdma::decode_wr_id(c.wr_id);
        if let Some(slot) = slot {
            conn.sends.release(slot);
        }
        let result = match c.ok() {
            Ok(()) => Ok(()),
            Err(e) => {
                let err = self.broken_cause().unwrap_or_else(|| match e {
                    crate::verbs::VerbsError::WorkCompletion { status_name, .. } => {
                        Error::RdmaCompletion {
                            remote: self.remote.clone(),
                            status: status_name,
                        }
                    }
                    other => rdma::rdma_err(&self.remote, other),
                });
                self.fail(err.clone());
                Err(err)
            }
        };
        if express {
            self.finish_express(result, false);
            return;
        }
        // A request's last event (nothing else can count one then) is
        // taken out of the table under the same lock as the lookup.
        let mut t = lock(&self.pending);
        let found = match t.map.get(&req) {
            Some(p) if p.outstanding.load(Ordering::Acquire) == 1 => {
                t.map.remove(&req).map(|p| (p, true))
            }
            Some(p) => Some((Arc::clone(p), false)),
            None => None,
        };
        drop(t);
        match found {
            Some((p, true)) => {
                // Its count was 1 under the lock: this is its last event.
                p.event(result);
                p.finish(None);
            }
            Some((p, false)) => self.complete_event(req, &p, result),
            None => {}
        }
    }

    /// Drains the send completion queue once: frees window slots and
    /// message buffers, completes request events, fails the link on the
    /// first error completion, then posts what the freed window allows.
    /// Called by the progress thread and by threads waiting on a request
    /// (whoever gets the poll lock; the other returns at once). Returns how
    /// many completions it processed.
    /// `wait_turn`: take the poll lock even when another thread holds it
    /// (the progress thread after arming its completion channel, which
    /// must not miss a completion the other thread polled too early for).
    fn drain_rdma(&self, conn: &rdma::RdmaConn, wait_turn: bool) -> usize {
        let polling = if wait_turn {
            lock(&conn.polled)
        } else {
            match conn.polled.try_lock() {
                Ok(d) => d,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return 0,
            }
        };
        let mut touched = false;
        let n = match conn
            .cq
            .poll_each(|c| self.on_send_completion(conn, c, &mut touched))
        {
            Ok(n) => n,
            Err(e) => {
                self.fail(rdma::rdma_err(&self.remote, e));
                0
            }
        };
        if n == 0 {
            return 0;
        }
        // Only the holder of `polled` writes it: no read-modify-write.
        conn.drains
            .store(conn.drains.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        drop(polling);
        // The window has room again: post what is queued. (A submitter
        // counts its work in `waiting` before it tries the window; the
        // count, the window's release and its try are sequentially
        // consistent, so either the try found the room, or this sees the
        // count. A message buffer freed above is ordered by the ring's
        // lock in the same way.)
        if conn.waiting.load(Ordering::SeqCst) > 0 {
            self.pump(conn);
        }
        if conn.index != 0 {
            // A sync message on the first queue pair may wait for these.
            self.pump(&self.rdma[0]);
        }
        n
    }

    /// The progress thread: drains the completion queue whenever nobody
    /// waiting on a request does, so requests complete without waiters
    /// too. Exits when the link is broken and nothing is posted.
    /// `adaptive`: poll, rather than sleep on the completion channel,
    /// while work requests are posted ([`RdmaProgress::Adaptive`](crate::RdmaProgress::Adaptive)).
    fn run_rdma_progress(self: Arc<Self>, index: usize, adaptive: bool) {
        let Some(conn) = self.rdma.get(index) else {
            self.thread_exit();
            return;
        };
        let mut backoff = Backoff::new();
        // The drain count at the last look while parked for waiters.
        let mut seen = u64::MAX;
        loop {
            if self.drain_rdma(conn, false) > 0 {
                // Its own drains are not the waiters'.
                seen = conn.drains.load(Ordering::Relaxed);
                backoff.reset();
                continue;
            }
            if self.is_broken() {
                self.pump(conn);
                if conn.posted.load(Ordering::Acquire) == 0 {
                    break;
                }
            }
            // Read without the queue's lock: the submitting thread holds it
            // across its post, and a progress thread blocking on it there
            // cost both a futex round trip.
            if self.undriven.load(Ordering::Acquire) == 0
                && conn.waiting.load(Ordering::Acquire) == 0
            {
                // Only requests whose waiters poll the completion queue
                // themselves (or none): keep out of their way — a woken
                // progress thread took the CPU from them (soft-RoCE
                // ping-pong 420 µs with it, 200-225 µs without, see
                // docs/benchmarks.md). Look in every millisecond while work
                // is posted and nobody drained since the last look (a
                // waiter may have given up), every 20 ms while waiters
                // drain (a latency-bound caller: one request, wait, the
                // next) or nothing is posted; submitting a large request
                // wakes the thread at once.
                let drains = conn.drains.load(Ordering::Relaxed);
                let waiters_drain = drains != std::mem::replace(&mut seen, drains);
                let posted = conn.posted.load(Ordering::Acquire) > 0;
                let ms = if posted && !waiters_drain { 1 } else { 20 };
                std::thread::park_timeout(Duration::from_millis(ms));
                backoff.reset();
                continue;
            }
            let posted = conn.posted.load(Ordering::Acquire) > 0;
            match &conn.events {
                // Adaptive: poll while a large request's work is posted.
                Some(_) if adaptive && posted => backoff.wait(true),
                Some(ev) => {
                    // Arm, then poll once more: a completion that came
                    // before arming raises no event.
                    if let Err(e) = ev.arm() {
                        self.fail(rdma::rdma_err(&self.remote, e));
                        backoff.wait(false);
                        continue;
                    }
                    if self.drain_rdma(conn, true) > 0 {
                        continue;
                    }
                    // Bounded, so a broken link is noticed.
                    if let Err(e) = ev.wait(Duration::from_millis(20)) {
                        self.fail(rdma::rdma_err(&self.remote, e));
                        backoff.wait(false);
                    }
                }
                None => backoff.wait(posted),
            }
        }
        self.thread_exit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryDesc;

    fn descs(v: &[(u64, u64)]) -> Vec<MemoryDesc> {
        v.iter().map(|&(a, l)| MemoryDesc::new(a, l, 0)).collect()
    }

    #[test]
    fn same_name_agrees_with_string_equality() {
        let names = [
            "",
            "a",
            "b",
            "kvxfer-p",
            "kvxfer-q",
            "kvxfer-pong",
            "kvxfer-ponh",
            "xvxfer-pong",
            "kvxfer-pong-0123",
            "kvxfer-pong-0124",
            "kvxfer-pong-01234",
            "kvxfer-pong-01235",
        ];
        for a in names {
            for b in names {
                assert_eq!(same_name(a, b), a == b, "{a:?} vs {b:?}");
            }
        }
        // Same words at both ends, a difference in the middle (17+ bytes
        // compare in full; 16 bytes is covered by the two words).
        assert!(!same_name("abcdefgh-X-abcdefgh", "abcdefgh-Y-abcdefgh"));
        assert!(!same_name("abcdefgXhgfedcba", "abcdefgYhgfedcba"));
    }

    #[test]
    fn runs_count_breaks_in_adjacency() {
        assert_eq!(runs(&[]), 0);
        assert_eq!(runs(&descs(&[(0, 10), (10, 5), (15, 1)])), 1);
        assert_eq!(runs(&descs(&[(0, 10), (20, 5), (25, 1), (0, 4)])), 3);
        assert_eq!(runs(&descs(&[(u64::MAX - 1, 1), (0, 1)])), 2);
    }

    #[test]
    fn delegation_only_for_much_more_scattered_remote_sides() {
        let req = |local: Vec<MemoryDesc>, remote: Vec<MemoryDesc>| {
            TransferRequest::write(
                MemoryDescs::new(MemoryType::Dram, local),
                MemoryDescs::new(MemoryType::Dram, remote),
                "t",
            )
        };
        let contiguous: Vec<_> = (0..64).map(|i| (i * 16, 16)).collect();
        let strided: Vec<_> = (0..64).map(|i| (i * 32, 16)).collect();
        assert!(should_delegate(&req(descs(&contiguous), descs(&strided))));
        assert!(!should_delegate(&req(descs(&strided), descs(&contiguous))));
        assert!(!should_delegate(&req(descs(&strided), descs(&strided))));
        // Few pieces: not worth a round trip.
        assert!(!should_delegate(&req(
            descs(&contiguous[..8]),
            descs(&strided[..8])
        )));
    }

    #[test]
    fn delegated_pieces_must_lie_in_the_grants() {
        let entry =
            |t: u64, i: u64, n: u64| [t.to_le_bytes(), i.to_le_bytes(), n.to_le_bytes()].concat();
        let spans = [(1000, 100), (5000, 10)];
        let ok = [entry(1000, 7, 100), entry(5005, 9, 5)].concat();
        let p = delegated_pieces(&ok, &spans).unwrap();
        assert_eq!(
            p.iter()
                .map(|p| (p.local, p.remote, p.len))
                .collect::<Vec<_>>(),
            [(1000, 7, 100), (5005, 9, 5)]
        );
        for bad in [
            entry(1000, 0, 101),      // runs past its span
            entry(1090, 0, 20),       // straddles the end
            entry(2000, 0, 1),        // in no span
            entry(1000, 0, 0),        // empty
            entry(u64::MAX, 0, 2),    // wraps
            entry(5000, 0, u64::MAX), // wraps
        ] {
            assert!(delegated_pieces(&bad, &spans).is_err());
        }
        assert!(delegated_pieces(&ok, &[]).is_err());
    }

    const P: usize = 4096;
    const K: usize = 40;

    /// `K` pages of `base`, back to back.
    fn pages(base: u64) -> MemoryDescs {
        MemoryDescs::new(
            MemoryType::Dram,
            (0..K)
                .map(|i| MemoryDesc::new(base + (i * P) as u64, P as u64, 0))
                .collect(),
        )
    }

    /// Every other page of `base`, `K` of them.
    fn scattered(base: u64) -> MemoryDescs {
        MemoryDescs::new(
            MemoryType::Dram,
            (0..K)
                .map(|i| MemoryDesc::new(base + (2 * i * P) as u64, P as u64, 0))
                .collect(),
        )
    }

    fn source() -> Vec<u8> {
        (0..K * P).map(|i| (i % 251) as u8 + 1).collect()
    }

    /// An initiator's run: a WRITE of one contiguous range to scattered
    /// pages of the target (`dst`), with a sync message, and a READ of them
    /// back, checked.
    fn write_and_read_scattered(init: &TcpAgent, target: &AgentDesc, dst: u64) {
        let src = source();
        let back = vec![0u8; K * P];
        // SAFETY: the buffers outlive the registrations (deregistered
        // below, after every transfer has completed).
        unsafe {
            init.register_memory(&MemoryDescs::dram(&src)).unwrap();
            init.register_memory(&MemoryDescs::dram(&back)).unwrap();
        }
        init.load_remote_agent(target).unwrap();
        let write = TransferRequest::write(
            pages(src.as_ptr() as u64),
            scattered(dst),
            target.name.clone(),
        )
        .with_sync_message(b"landed".to_vec());
        assert!(should_delegate(&write));
        init.submit_transfer(&write)
            .unwrap()
            .wait_success(Duration::from_secs(30))
            .unwrap();
        let read = TransferRequest::read(
            pages(back.as_ptr() as u64),
            scattered(dst),
            target.name.clone(),
        );
        init.submit_transfer(&read)
            .unwrap()
            .wait_success(Duration::from_secs(30))
            .unwrap();
        assert_eq!(std::hint::black_box(&back), &src);
        init.deregister_memory(&MemoryDescs::dram(&src)).unwrap();
        init.deregister_memory(&MemoryDescs::dram(&back)).unwrap();
    }

    /// The target's side of the check: the sync message, and the bytes.
    fn check_target(target: &TcpAgent, dst: &[u8]) {
        let msgs = target.wait_sync_messages(Duration::from_secs(30));
        assert_eq!(msgs.get("init"), Some(&vec![b"landed".to_vec()]));
        let (src, dst) = (source(), std::hint::black_box(dst));
        for i in 0..K {
            assert_eq!(&dst[2 * i * P..(2 * i + 1) * P], &src[i * P..(i + 1) * P]);
            assert!(
                dst[(2 * i + 1) * P..(2 * i + 2) * P]
                    .iter()
                    .all(|&b| b == 0)
            );
        }
    }

    /// The initiator of [`scattered_remote_side_is_copied_by_the_target`]
    /// in a process of its own (this test binary run again); returns at
    /// once in an ordinary run.
    #[test]
    fn delegation_initiator_child() {
        let Ok(arg) = std::env::var("KVXFER_TEST_DELEGATION") else {
            return;
        };
        let (hex, dst) = arg.split_once(' ').unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let target = AgentDesc::decode(&bytes).unwrap();
        let init = TcpAgent::with_mode(AgentConfig::new("init"), Mode::Shm).unwrap();
        write_and_read_scattered(&init, &target, dst.parse().unwrap());
    }

    /// A WRITE to scattered remote pieces from one contiguous local range,
    /// from another process, is copied by the target (once that process
    /// proved on the local socket who it is), and a READ of them back too;
    /// with delegation off at the target, the initiator copies. Bytes and
    /// sync messages are right either way.
    #[test]
    fn scattered_remote_side_is_copied_by_the_target() {
        for target_delegates in [true, false] {
            let target = TcpAgent::with_mode(
                AgentConfig::new("target").with_shm_delegate(target_delegates),
                Mode::Shm,
            )
            .unwrap();
            let dst = vec![0u8; 2 * K * P];
            // SAFETY: `dst` outlives the agent (dropped first below).
            unsafe { target.register_memory(&MemoryDescs::dram(&dst)).unwrap() };
            let hex: String = target
                .local_agent_desc()
                .encode()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "tcp::tests::delegation_initiator_child",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(
                    "KVXFER_TEST_DELEGATION",
                    format!("{hex} {}", dst.as_ptr() as u64),
                )
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            check_target(&target, &dst);
            // Who copied: the target, both ways, only when it delegates.
            let copies = target.inner.delegated_copies.load(Ordering::Relaxed);
            assert_eq!(copies, if target_delegates { 2 } else { 0 });
            drop(target);
            drop(dst);
        }
    }

    /// Two agents in one process: the target never copies for its own
    /// process (the initiator can, and a pid it copies for must be another
    /// process that proved itself); the initiator copies, bytes right.
    #[test]
    fn a_target_never_copies_for_its_own_process() {
        let init = TcpAgent::with_mode(AgentConfig::new("init"), Mode::Shm).unwrap();
        let target = TcpAgent::with_mode(AgentConfig::new("target"), Mode::Shm).unwrap();
        let dst = vec![0u8; 2 * K * P];
        // SAFETY: `dst` outlives the agents (dropped first below).
        unsafe { target.register_memory(&MemoryDescs::dram(&dst)).unwrap() };
        write_and_read_scattered(&init, &target.local_agent_desc(), dst.as_ptr() as u64);
        check_target(&target, &dst);
        assert_eq!(target.inner.delegated_copies.load(Ordering::Relaxed), 0);
        drop((init, target));
        drop(dst);
    }
}
