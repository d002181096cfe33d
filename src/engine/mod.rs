//! The engine: one agent for every data path. [`Engine`] implements
//! [`TransferAgent`]; a loaded peer is reached over TCP streams, by
//! cross-memory attach (same host) or over RDMA queue pairs, chosen per
//! peer and memory type among the transports the agent's [`Backend`]
//! allows (`transport`).
//!
//! One listener per agent serves the side channel (descriptor fetch) and
//! incoming data streams. To each remote agent an initiator opens a *link*:
//! `streams_per_peer` TCP connections, each with a sender and a reader
//! thread (`tcp_stream`); on the cross-memory path the copy is the
//! initiator's (`cma`), with grants and the commit over the socket; on RDMA
//! one-sided work requests on the link's queue pairs (`rdma`). The target
//! side (`target`) runs one thread per incoming connection.
//!
//! Modules: `transport` (the transports and the choice of one per peer
//! and memory type), `peer` (connecting, descriptors), `plan` (request
//! planning, no I/O), `submit` (the submit path), `api` (the trait),
//! `target`, `tcp_stream`, `cma`, `rdma` (data types, `link`, `recv`),
//! `wire` and `requests` (the frame codec and the target's request table,
//! no I/O), `sock` (vectored socket I/O), `handshake` and `local_proof`
//! (authentication, the initiator's process proof).
//!
//! See `docs/architecture.md` for threads and ownership, and
//! `docs/wire-format.md` for the frames.

mod api;
mod cma;
mod handshake;
mod local_proof;
mod peer;
mod plan;
mod rdma;
pub(crate) mod requests;
mod sock;
mod submit;
mod target;
mod tcp_stream;
#[cfg(test)]
mod tests;
mod transport;
pub(crate) mod wire;

use peer::*;
#[cfg(feature = "fuzzing")]
pub(crate) use plan::fuzz_respond;
use plan::*;
pub(crate) use plan::{delegated_pieces, write_list_pieces};
use rdma::recv::*;
use submit::*;
use target::*;

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
    AgentConfig, Backend, Completion, DataPath, PreparedTransfer, Progress, SyncMessages,
    TransferAgent, TransferOp, TransferRequest, TransferStatus, TransportKind,
};
use crate::auth::random_u64;
use crate::desc::{AgentDesc, BackendKind, LocalAccess, RdmaInfo};
use crate::error::{Error, RejectReason};
use crate::memory::{MemoryDescs, MemoryType, RegionMap};
use crate::registry::{Inbox, RegionGuard, Registry, Reservation};
use crate::shm::{self, Direction, Piece};
use crate::small::{FastHash, Few};
use crate::verbs::{Device, QpInfo};

use requests::{Finished, RequestTable};
use sock::{FrameReader, IdlePolicy, ProgressClock, UntilDeadline, iov, writev_all};
use wire::{
    CommitOp, Frame, HEADER_LEN, PROTOCOL_VERSION, WRITE_LIST_ENTRY, WRITE_LIST_MAX, status,
};

/// Largest segment sent inside a write list; bigger ones go alone (their
/// own `readv` costs little next to their payload).
const WRITE_LIST_PIECE_MAX: u64 = 64 << 10;

/// Cross-memory requests smaller than this are copied by one thread.
const PARALLEL_COPY_MIN: u64 = 2 << 20;
/// Payload a stream writes between two looks at whether its request was
/// aborted (a job with more is written in batches of about this much).
const ABORT_CHECK_BYTES: u64 = 4 << 20;

/// How data reaches one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Tcp,
    Cma { pid: u32 },
    Rdma,
}

impl Path {
    fn kind(self) -> TransportKind {
        match self {
            Path::Tcp => TransportKind::Tcp,
            Path::Cma { .. } => TransportKind::Shm,
            Path::Rdma => TransportKind::Rdma,
        }
    }
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
pub struct Engine {
    inner: Arc<Inner>,
    listener_thread: Option<JoinHandle<()>>,
    local_proof_thread: Option<JoinHandle<()>>,
}

struct Inner {
    config: AgentConfig,
    mode: Backend,
    instance: u64,
    /// Holds `instance`; peers read it back to prove direct access works.
    probe_word: Box<u64>,
    host: String,
    /// The RDMA device, for `rdma` and (when one exists) `auto` agents.
    device: Option<Arc<Device>>,
    /// The transports this agent may use, in order of preference.
    transports: Vec<Box<dyn transport::Transport>>,
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
    /// [`Limits::max_requests_in_flight`](crate::Limits::max_requests_in_flight)).
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

impl Engine {
    /// A TCP-only agent: binds the listener and starts the accept thread.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`], or the bind error.
    pub fn new(config: AgentConfig) -> Result<Self, Error> {
        Self::with_mode(config, Backend::Tcp)
    }

    pub(crate) fn with_mode(mut config: AgentConfig, mode: Backend) -> Result<Self, Error> {
        config.validate()?;
        config.resolve_security()?;
        // Resolved once (the environment is read here, not per connection).
        config.rdma.ack_timeout = Some(config.rdma.effective_ack_timeout()?);
        let open = || Device::open(config.rdma.device.as_deref(), config.rdma.gid_index);
        let device = match mode {
            Backend::Rdma => Some(Arc::new(open().map_err(|e| Error::BackendUnavailable {
                backend: "rdma",
                reason: e.to_string(),
            })?)),
            Backend::Auto => match open() {
                Ok(d) => {
                    tracing::info!(agent = %config.name, device = d.name(), gid_index = d.gid_index(), "RDMA device with an active port found; auto uses rdma to remote hosts (shm on this host where possible)");
                    Some(Arc::new(d))
                }
                Err(e) => {
                    tracing::info!(agent = %config.name, reason = %e, "no RDMA device; auto uses shm and tcp");
                    None
                }
            },
            Backend::Tcp | Backend::Shm => None,
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
            Backend::Shm | Backend::Auto if config.shm.delegate => {
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
        let host = shm::host_id();
        let inner = Arc::new(Inner {
            transports: transport::for_backend(mode, device.is_some(), &host),
            mode,
            instance,
            probe_word: Box::new(instance),
            device,
            host,
            endpoint,
            listen_addr,
            registry: Registry::default(),
            submit_cache: Mutex::new(None),
            inbox: Arc::new(Inbox::new(
                config.limits.inbox_max_bytes,
                config.limits.inbox_max_bytes_per_peer,
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
}

/// Builds a transfer agent on `backend`.
///
/// # Errors
/// [`Error::InvalidConfig`], [`Error::BackendUnavailable`], or the
/// listener's bind error.
pub fn make_transfer_agent(
    backend: Backend,
    config: AgentConfig,
) -> Result<Box<dyn TransferAgent>, Error> {
    match backend {
        Backend::Auto => {
            tracing::info!(
                agent = %config.name,
                "backend auto: shm (cross-memory attach) to same-host peers that allow it, rdma to peers with a device when this host has one, tcp otherwise"
            );
            Ok(Box::new(Engine::with_mode(config, Backend::Auto)?))
        }
        Backend::Tcp => Ok(Box::new(Engine::new(config)?)),
        Backend::Shm => Ok(Box::new(Engine::with_mode(config, Backend::Shm)?)),
        Backend::Rdma => Ok(Box::new(Engine::with_mode(config, Backend::Rdma)?)),
    }
}

impl Drop for Engine {
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

// Initiator side: peers, requests, links (their behaviour: `tcp_stream`,
// `cma`, `rdma::link`).

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
    /// What carries this link's requests (every status reports it).
    path: Arc<crate::agent::DataPath>,
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
/// The lane takes no lock ([`rdma::lane::Lane`], model-checked with loom):
/// a submitter claims a free lane (one compare-and-swap), fills the slot,
/// marks it posted and posts its work request through the queue pair's
/// [`SharedPoster`](crate::verbs::SharedPoster) — outside the send queue's
/// lock and the window: the queue pair has one send-queue entry beyond the
/// window for it. From then on the slot belongs to whoever finishes the
/// request: the thread draining its completion, the submitter when the
/// post fails, or the link's last thread on exit, which also closes the
/// lane. A request finds the lane taken, or work counted in the send
/// queue's `waiting` (queued, or popped and not yet posted), or the link
/// broken: it takes the ordinary path, so it never overtakes earlier work
/// of its caller.
type ExpressLane = rdma::lane::Lane<Express>;

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
            // A target in this very process never copies for it: no proof,
            // no delegation asked.
            let other_process = !matches!(path, Path::Cma { pid } if pid == std::process::id());
            if i == 0 && matches!(path, Path::Cma { .. }) && cfg.shm.delegate && other_process {
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
                for k in 0..cfg.rdma.qps_per_peer {
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
        let (device, mechanism) = match path {
            Path::Tcp => (
                streams[0].sock.peer_addr().ok().map(|a| a.to_string()),
                "TCP streams; the kernel copies between socket and registered memory",
            ),
            Path::Cma { .. } => (
                None,
                "cross-memory attach (process_vm_writev/readv), one copy",
            ),
            Path::Rdma => (
                inner.device.as_ref().map(|d| d.name().to_owned()),
                "one-sided RDMA WRITE/READ on RC queue pairs, zero copy",
            ),
        };
        let data_path = Arc::new(DataPath {
            transport: path.kind(),
            device,
            mechanism,
        });
        let link = Arc::new(Link {
            rdma: rdma_conns,
            next_stripe: AtomicUsize::new(0),
            undriven: Arc::new(AtomicUsize::new(0)),
            progress_threads: OnceLock::new(),
            remote: peer.name.clone(),
            io_timeout: cfg.io_timeout,
            copy_threads: cfg.shm.copy_threads,
            delegate_probe: cfg
                .shm
                .delegate
                .then_some((&*inner.probe_word as *const u64 as u64, inner.instance)),
            delegate_ok: AtomicBool::new(may_delegate),
            in_flight: Arc::clone(&inner.in_flight),
            path: data_path,
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
        let adaptive = cfg.rdma.progress == crate::agent::RdmaProgress::Adaptive;
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
}
