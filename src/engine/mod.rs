//! The engine: one agent for every data path. [`Engine`] implements
//! [`TransferAgent`]; a loaded peer is reached by one of the transports
//! the agent's [`Backend`] allows, chosen per peer and memory type.
//!
//! Two floors. The **core** names no transport (`tests/layering.rs`):
//! `api` (the trait), `submit` (the submit path), `peer` and `names`
//! (connecting, descriptors, the metadata store), `target` (the listener
//! side: accept, serve, dispatch each frame to its transport, commit; with
//! the data carried in frames, a peer's storage, and transport set-up
//! frames), `transport` (the `Transport` and `Link` traits and their
//! vocabulary, the choice of a transport), `ctx` (what a transport may use
//! of its agent: its context, not the agent's state), `socket_link` (what every socket
//! link shares: streams, their sender and reader threads), `plan`, `wire`,
//! `requests`, `budget` (pure: planning, the frame codec, the target's
//! request table), `sock` (vectored socket I/O, plain or encrypted),
//! `handshake` (authentication), `settle`, `serve_each`, `pre_auth`,
//! `metrics_http`. Their imports form no cycle (`tests/layering.rs`); only
//! this root, which holds the agent's state, is named by every part.
//!
//! The **transports**, each a module that names no other: `tcp` (frames
//! over the link's streams), `shm` (same host: cross-memory attach, shared
//! pools, CUDA IPC), `rdma` (queue pairs), `fabric` (libfabric), `inproc`
//! (agents of one process), `storage` (the agent's own storage).
//! `transports` is the registry: the one file that names them all.
//!
//! See `docs/architecture.md` for threads and ownership, and
//! `docs/wire-format.md` for the frames.

mod api;
mod budget;
mod ctx;
#[cfg(feature = "fabric")]
mod fabric;
mod handshake;
mod in_flight;
mod indexed;
mod inproc;
#[cfg(feature = "metrics-endpoint")]
mod metrics_http;
mod names;
mod peer;
mod plan;
mod pre_auth;
mod rdma;
pub(crate) mod requests;
mod serve_each;
mod settle;
pub(crate) mod shm;
mod sock;
mod socket_link;
mod storage;
mod submit;
mod target;
mod tcp;
#[cfg(test)]
mod tests;
mod transport;
mod transports;
pub(crate) mod wire;

#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use handshake::fuzz_respond;
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) use plan::write_list_pieces;
use target::Session;
use transport::{Link, Transport};

/// Whether this kernel can encrypt an agent's connections
/// ([`SecurityConfig::encrypt`](crate::config::SecurityConfig::encrypt):
/// TLS 1.3 AES-128-GCM through the kernel's TLS); `Err` says why not.
/// Tried once per process.
///
/// # Errors
/// Why not: the kernel has no TLS (no `tls` module), or refused the
/// cipher.
pub fn kernel_tls_available() -> Result<(), String> {
    sock::ktls::available()
}

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::agent::{AgentConfig, Backend, TransferAgent};
use crate::auth::random_u64;
use crate::cross_memory;
use crate::desc::{AgentDesc, ExportedRegion};
use crate::error::Error;
use crate::inbox::Inbox;
use crate::memory::{MemoryType, RegionMap};
use crate::registry::Registry;
use crate::small::FastHash;

use wire::status;

/// Largest segment sent inside a write list; bigger ones go alone (their
/// own `readv` costs little next to their payload).
const WRITE_LIST_PIECE_MAX: u64 = 64 << 10;

/// Cross-memory requests smaller than this are copied by one thread.
const PARALLEL_COPY_MIN: u64 = 2 << 20;
/// Payload a stream writes between two looks at whether its request was
/// aborted (a job with more is written in batches of about this much).
const ABORT_CHECK_BYTES: u64 = 4 << 20;

const SUPPORTED: &[MemoryType] = &[
    MemoryType::Dram,
    MemoryType::Vram,
    MemoryType::File,
    MemoryType::Blk,
    MemoryType::Obj,
];

impl Inner {
    /// The agent's metrics in the Prometheus text format, its transports'
    /// own counters included.
    fn render_metrics(&self) -> String {
        let counters: Vec<_> = self.transports.iter().flat_map(|t| t.counters()).collect();
        self.metrics.render(self.in_flight.count(), &counters)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often a blocked reader wakes to check timeouts and shutdown.
fn tick(io_timeout: Duration) -> Duration {
    (io_timeout / 4).clamp(Duration::from_millis(10), Duration::from_millis(200))
}

/// A transfer agent on every data path its [`Backend`] allows: TCP, shm
/// (cross-memory attach, shared pools, CUDA IPC), RDMA, libfabric, the
/// in-process path, and its own storage. See the module docs.
///
/// # Resource cleanup
/// Dropping the agent stops the listener, closes every incoming connection
/// and every link to remote agents (their requests in flight fail with
/// [`Error::Closed`]), and joins all threads before returning.
pub struct Engine {
    inner: Arc<Inner>,
    listener_thread: Option<JoinHandle<()>>,
    /// Another handle on the listening socket, shut down to wake the
    /// accept loop when the agent is dropped.
    listener_wake: Option<TcpListener>,
    /// The metrics endpoint, when configured.
    #[cfg(feature = "metrics-endpoint")]
    metrics_server: Option<metrics_http::MetricsServer>,
}

struct Inner {
    config: AgentConfig,
    mode: Backend,
    instance: u64,
    host: String,
    /// The transports this agent may use, in order of preference.
    transports: Vec<Arc<dyn transport::Transport>>,
    endpoint: String,
    listen_addr: SocketAddr,
    registry: Arc<Registry>,
    inbox: Arc<Inbox>,
    peers: RwLock<HashMap<String, Arc<Peer>, FastHash>>,
    closing: AtomicBool,
    server: Mutex<ServerConns>,
    sessions: Mutex<HashMap<(u64, u64), Arc<Session>>>,
    /// Sessions whose last stream ended, until their transports let them
    /// go (a [`Frame::Settle`](wire::Frame::Settle) waits for them).
    leaving: Mutex<HashMap<(u64, u64), Arc<Session>>>,
    /// Requests open at this target, in all sessions (see
    /// [`Limits::max_open_requests`](crate::Limits::max_open_requests)).
    open_requests: Arc<AtomicUsize>,
    /// Incoming connections that have not authenticated yet.
    pre_auth: Arc<Mutex<pre_auth::PreAuth>>,
    /// Request ids, and the requests submitted whose outcome is not in (see
    /// [`Limits::max_requests_in_flight`](crate::Limits::max_requests_in_flight)).
    in_flight: Arc<in_flight::InFlight>,
    /// Open until the agent is dropped; in-process initiators hold it
    /// (shared) while they copy into or out of this agent's memory.
    door: RwLock<bool>,
    /// Files and block devices opened as storage, and their I/O engine.
    storage: crate::storage::Storage,
    /// Bytes of objects peers are writing here, assembled until their
    /// requests commit (`target::storage`; bounded by
    /// `Limits::max_object_assembly`).
    assembling: Arc<std::sync::atomic::AtomicU64>,
    /// The transport of requests to the agent's own storage (the
    /// registry's `own_storage`).
    own_storage: Arc<dyn transport::Transport>,
    /// The agent as its own peer: the target of requests to its storage.
    self_peer: OnceLock<Arc<Peer>>,
    /// Its publication in the metadata store, and the peers it loaded by
    /// name.
    names: names::Names,
    /// Its requests' outcomes, by transport and peer.
    metrics: crate::metrics::Metrics,
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
        // The transports with devices of their own this backend uses.
        let devices = transports::open_devices(mode, &mut config)?;
        let listener = TcpListener::bind(config.listen)?;
        let listen_addr = listener.local_addr()?;
        let endpoint = match &config.advertise {
            Some(a) => a.clone(),
            None => listen_addr.to_string(),
        };
        let instance = random_u64() | 1;
        let host = cross_memory::host_id();
        let shm = transports::shm(mode, &config, instance, &host);
        let inner = Arc::new(Inner {
            transports: transports::for_backend(mode, devices, shm),
            mode,
            instance,
            host,
            endpoint,
            listen_addr,
            registry: Arc::default(),
            inbox: Arc::new(Inbox::new(
                config.limits.inbox_max_bytes,
                config.limits.inbox_max_bytes_per_peer,
            )),
            peers: RwLock::new(HashMap::default()),
            closing: AtomicBool::new(false),
            server: Mutex::new(ServerConns::default()),
            sessions: Mutex::new(HashMap::new()),
            leaving: Mutex::new(HashMap::new()),
            open_requests: Arc::new(AtomicUsize::new(0)),
            pre_auth: Arc::default(),
            in_flight: in_flight::InFlight::new(),
            door: RwLock::new(true),
            storage: crate::storage::Storage::new(config.effective_storage_io()?),
            assembling: Arc::default(),
            own_storage: transports::own_storage(),
            self_peer: OnceLock::new(),
            names: names::Names::default(),
            metrics: crate::metrics::Metrics::new(&config.name, &config.metrics),
            config,
        });
        transports::opened(&inner);
        let acceptor = Arc::clone(&inner);
        let listener_wake = listener.try_clone().ok();
        let listener_thread = std::thread::Builder::new()
            .name(format!("kvxfer-accept-{}", inner.config.name))
            .spawn(move || acceptor.accept_loop(listener))?;
        for t in &inner.transports {
            t.start(ctx::Ctx::of(&inner))?;
        }
        tracing::debug!(agent = %inner.config.name, endpoint = %inner.endpoint, "tcp agent listening");
        #[cfg(feature = "metrics-endpoint")]
        let metrics_server = match inner.config.metrics.listen {
            Some(addr) => Some(metrics_http::MetricsServer::start(&inner, addr)?),
            None => None,
        };
        #[cfg(not(feature = "metrics-endpoint"))]
        if inner.config.metrics.listen.is_some() {
            return Err(Error::InvalidConfig(
                "this build of kvxfer has no metrics endpoint (cargo feature `metrics-endpoint`)"
                    .into(),
            ));
        }
        let engine = Self {
            inner,
            listener_thread: Some(listener_thread),
            listener_wake,
            #[cfg(feature = "metrics-endpoint")]
            metrics_server,
        };
        // Published once it answers (a failure drops, and so closes, it).
        engine.inner.publish()?;
        Ok(engine)
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
        b => Ok(Box::new(Engine::with_mode(config, b)?)),
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.closing.store(true, Ordering::SeqCst);
        // Out of the metadata store first: peers learn at once.
        inner.names.close();
        #[cfg(feature = "metrics-endpoint")]
        if let Some(m) = &mut self.metrics_server {
            m.stop();
        }
        // No in-process initiator copies into this agent after this.
        transports::closing(inner);
        for t in &inner.transports {
            t.stop();
        }
        // Incoming connections: shut down, then join their threads (they
        // land nothing more once `closing` is set). Before the listener
        // goes: an initiator whose link broke takes a refused connection
        // as proof that nothing of it lands here any more (see
        // `socket_link::Settle`). The accept loop starts no connection
        // meanwhile: it sees `closing` first.
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
        // Wake the accept loop; it sees `closing` and returns, dropping
        // the listener.
        serve_each::wake_listener(self.listener_wake.as_ref(), inner.listen_addr);
        if let Some(t) = self.listener_thread.take() {
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
            for link in p.take_links() {
                link.fail(Error::Closed);
                link.join();
            }
        }
    }
}

// Initiator side: peers, requests, links (their behaviour in each
// transport's module).

/// A loaded remote agent.
struct Peer {
    desc: AgentDesc,
    /// This entry's number, unique in the process: what a prepared list
    /// resolved against it remembers.
    entry: u64,
    /// Exported regions, by memory type and range.
    regions: RegionMap<ExportedRegion>,
    /// The transport that reaches it (for its host and GPU memory; its
    /// storage: see `storage`).
    transport: Arc<dyn Transport>,
    link: Mutex<Option<Arc<dyn Link>>>,
    /// Set when a newer load of the agent replaced this entry, or the agent
    /// was invalidated: prepared transfers resolved against it resolve
    /// again.
    retired: AtomicBool,
    /// How requests reach the peer's FILE and BLK regions.
    storage: StorageRoute,
}

/// How requests reach a peer's FILE and BLK regions: always through its
/// agent (which reads and writes its files), on the first path that moves
/// them — the peer's own path, or a lane of its own beside it.
enum StorageRoute {
    /// The peer's path moves them (TCP), or this is such a lane.
    Same,
    /// Another path (TCP beside RDMA or cross-memory attach): the lane's
    /// link opens on its first request. Retired and closed with the peer.
    Lane(Arc<Peer>),
    /// No transport of this agent moves them to the peer.
    Unreachable(Error),
}
