//! The transfer-agent contract: registration, remote agents, one-sided
//! READ/WRITE requests with completion status, and sync messages.
//!
//! This is TensorRT-LLM's `BaseTransferAgent` in Rust. A request names local
//! descriptors and remote descriptors pairwise (TensorRT-LLM's `src` is the
//! local list and `dst` the remote list, whatever the direction):
//!
//! | op | data flows | `local` | `remote` |
//! |---|---|---|---|
//! | [`TransferOp::Write`] | local → remote | source | destination |
//! | [`TransferOp::Read`]  | remote → local | destination | source |
//!
//! # Ordering guarantee
//! A request's sync message reaches the remote agent's inbox only after
//! every byte of that request is visible in the destination memory (for a
//! READ: after the remote has finished reading its source memory and the
//! initiator's status completes once the bytes have landed locally), and it
//! is delivered exactly once. A request that fails delivers no sync message.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::{AgentConfig, DEFAULT_RDMA_MAX_INFLIGHT, RdmaProgress};
use crate::desc::AgentDesc;
use crate::error::Error;
use crate::memory::MemoryDescs;
pub use crate::proto::{TransferOp, TransferRequest, TransportKind};
pub(crate) use crate::status::{Completion, Progress};
pub use crate::status::{DataPath, PreparedTransfer, TransferState, TransferStatus};

impl TransferRequest {
    /// Checks the pairing: same count, same lengths, non-empty descriptors.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] or [`Error::InvalidDescriptor`].
    pub fn validate_shape(&self) -> Result<(), Error> {
        if self.local.len() != self.remote.len() {
            return Err(Error::InvalidRequest(format!(
                "{} local descriptors but {} remote descriptors",
                self.local.len(),
                self.remote.len()
            )));
        }
        for (i, (l, r)) in self.local.descs.iter().zip(&self.remote.descs).enumerate() {
            l.validate()?;
            r.validate()?;
            if l.len != r.len {
                return Err(Error::InvalidRequest(format!(
                    "descriptor {i}: local length {} != remote length {}",
                    l.len, r.len
                )));
            }
        }
        Ok(())
    }
}

/// Sync messages received, grouped by sending agent, each group in arrival
/// order.
pub type SyncMessages = HashMap<String, Vec<Vec<u8>>>;

/// Wakes the threads waiting for one agent's sync messages
/// ([`TransferAgent::sync_waker`]); holds the agent's inbox only, never
/// the agent. Cheap to clone.
#[derive(Clone)]
pub struct SyncWaker(pub(crate) std::sync::Arc<crate::inbox::Inbox>);

impl SyncWaker {
    /// As [`TransferAgent::wake_sync_waiters`].
    pub fn wake(&self) {
        self.0.wake();
    }
}

impl std::fmt::Debug for SyncWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SyncWaker")
    }
}

/// Sync messages as [`SyncMessages`], each with the moment the agent
/// received it (for timings that must not depend on when the caller got
/// around to taking them).
pub type TimedSyncMessages = HashMap<String, Vec<(Vec<u8>, Instant)>>;

/// Sync messages taken together with the peers that left meanwhile
/// ([`TransferAgent::wait_sync_batch`]).
#[derive(Debug, Default)]
pub struct SyncBatch {
    /// The messages, by sender, each with the moment it was received.
    pub messages: TimedSyncMessages,
    /// Peers whose last connection into this agent ended since the last
    /// batch, each with how many of its messages in `messages` were
    /// received before that (the last such end): a message in several
    /// parts begun before it will not be finished on that connection.
    /// Peers whose messages reach the agent without a connection (agents
    /// of one process) are not listed; nor are departures past the first
    /// 1,024 peers between two takes.
    pub departed: HashMap<String, usize>,
}

/// Which backend [`make_transfer_agent`](crate::make_transfer_agent) builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Backend {
    /// The best path per peer: cross-memory attach (and shared pools, CUDA
    /// IPC) to peers on this host that allow it, RDMA to peers with a device
    /// when this host has one, TCP to the others; each choice and its
    /// reason are logged.
    #[default]
    Auto,
    /// The TCP fallback.
    Tcp,
    /// Intra-node only: cross-memory attach to peers on this host; loading
    /// a peer it cannot reach that way fails.
    Shm,
    /// RDMA verbs only (reliable-connected queue pairs); creating the agent
    /// fails without a usable device, loading a peer without one fails.
    Rdma,
    /// libfabric only (reliable-datagram endpoints with RMA: EFA, and every
    /// other fabric libfabric drives; see [`FabricConfig`](crate::FabricConfig));
    /// creating the agent fails without a usable provider (or in a build
    /// without the cargo feature `fabric`), loading a peer on another
    /// provider fails.
    Fabric,
    /// Agents of this process only: a transfer is a plain copy between two
    /// agents' registered memory, done in the submitting thread (its status
    /// is final when `submit_transfer` returns), checked and ordered as on
    /// every other path. For tests of code built on the agent, and for
    /// agents that share one process; loading a peer of another process
    /// fails.
    InProcess,
}

impl Backend {
    /// Its name: `"auto"`, `"tcp"`, `"shm"`, `"rdma"`, `"fabric"` or `"inproc"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Tcp => "tcp",
            Backend::Shm => "shm",
            Backend::Rdma => "rdma",
            Backend::Fabric => "fabric",
            Backend::InProcess => "inproc",
        }
    }
}

impl FromStr for Backend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        [
            Backend::Auto,
            Backend::Tcp,
            Backend::Shm,
            Backend::Rdma,
            Backend::Fabric,
            Backend::InProcess,
        ]
        .into_iter()
        .find(|b| b.as_str().eq_ignore_ascii_case(s))
        .ok_or_else(|| {
            Error::InvalidConfig(format!(
                "unknown backend {:?} (expected auto, tcp, shm, rdma, fabric or inproc)",
                s.to_ascii_lowercase()
            ))
        })
    }
}

/// The transfer-agent contract, implemented by every backend.
///
/// All methods take `&self`; agents are `Send + Sync` and meant to be shared
/// between threads (wrap the box in an `Arc`).
pub trait TransferAgent: Send + Sync {
    /// This agent's name.
    fn name(&self) -> &str;

    /// The backend's name (`"tcp"`, ...).
    fn backend_name(&self) -> &'static str;

    /// Registers every descriptor of `descs` for local use and remote access.
    /// All or nothing: on error nothing is registered.
    ///
    /// # Safety
    /// For as long as a range stays registered, it must remain valid for
    /// reads and writes (allocated, not unmapped), and the caller must not
    /// access bytes that a transfer in flight is reading or writing except
    /// through this agent: the agent and remote peers read and write it at
    /// any time while a transfer names it.
    ///
    /// # Errors
    /// [`Error::InvalidDescriptor`], [`Error::Overlap`] (with an existing
    /// registration or another descriptor of `descs`),
    /// [`Error::UnsupportedMemoryType`].
    unsafe fn register_memory(&self, descs: &MemoryDescs) -> Result<(), Error>;

    /// Registers all of `pool` (see [`crate::pool`]) as one host-memory
    /// region, and offers it to same-host peers to map: on the shm
    /// transport a proven peer maps the pool's file once and copies with
    /// plain loads and stores; every other transport moves it as any host
    /// memory. The registration holds the pool's mapping until
    /// [`deregister_memory`](Self::deregister_memory) is given the
    /// descriptors returned, which also revokes every peer's mapping.
    ///
    /// # Errors
    /// As [`register_memory`](Self::register_memory).
    fn register_shared_pool(
        &self,
        pool: &crate::pool::SharedPool,
        access: crate::pool::PoolAccess,
    ) -> Result<MemoryDescs, Error>;

    /// Deregisters ranges registered before, each given exactly as it was
    /// registered. All or nothing.
    ///
    /// A shared pool ([`register_shared_pool`](Self::register_shared_pool))
    /// is revoked from every same-host peer that mapped it before this
    /// returns: each unmaps it once its own copies into the pool have
    /// ended (those hold no grant, so they do not make the pool busy).
    ///
    /// # Errors
    /// [`Error::NotARegistration`], or [`Error::RegionBusy`] while a
    /// transfer in flight uses the region.
    fn deregister_memory(&self, descs: &MemoryDescs) -> Result<(), Error>;

    /// A descriptor of this agent: name, endpoints, exported regions and
    /// their keys, as registered now.
    fn local_agent_desc(&self) -> AgentDesc;

    /// Loads (or replaces) a remote agent from its descriptor.
    ///
    /// # Errors
    /// [`Error::InvalidAgentDesc`] when the descriptor is inconsistent, or
    /// was produced by a backend this agent cannot talk to.
    fn load_remote_agent(&self, desc: &AgentDesc) -> Result<(), Error>;

    /// Fetches a remote agent's descriptor from its connection info
    /// (`host:port`) over the side channel, loads it, and returns its name.
    ///
    /// # Errors
    /// [`Error::InvalidConnectionInfo`], [`Error::Connect`],
    /// [`Error::Timeout`], [`Error::InvalidAgentDesc`].
    fn load_remote_agent_by_connection(&self, connection_info: &str) -> Result<String, Error> {
        let desc = self.fetch_remote_agent_desc(connection_info)?;
        self.load_remote_agent(&desc)?;
        Ok(desc.name)
    }

    /// Finds a remote agent by name in the metadata store (see
    /// [`crate::metadata`]), fetches its current descriptor over the side
    /// channel from the endpoint published there (the same instance must
    /// answer) and loads it. A peer loaded so is watched: when it leaves
    /// the store its requests fail with [`Error::PeerGone`], and the next
    /// request to it resolves it again.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] without a metadata store;
    /// [`Error::UnknownAgent`] when no live agent has that name;
    /// [`Error::MetadataStore`] when the store cannot be reached; and as
    /// [`load_remote_agent_by_connection`](Self::load_remote_agent_by_connection).
    fn load_remote_agent_by_name(&self, name: &str) -> Result<(), Error>;

    /// Fetches a remote agent's descriptor from its connection info, as
    /// [`load_remote_agent_by_connection`](Self::load_remote_agent_by_connection)
    /// does, without loading it (to check its name first, for example).
    ///
    /// # Errors
    /// As [`load_remote_agent_by_connection`](Self::load_remote_agent_by_connection).
    fn fetch_remote_agent_desc(&self, connection_info: &str) -> Result<AgentDesc, Error>;

    /// The data path used to reach a loaded remote agent: `"tcp"`, `"shm"`,
    /// `"rdma"` or `"inproc"`.
    ///
    /// # Errors
    /// [`Error::UnknownAgent`].
    fn remote_transport(&self, name: &str) -> Result<&'static str, Error>;

    /// The descriptor a remote agent was loaded from.
    ///
    /// # Errors
    /// [`Error::UnknownAgent`].
    fn remote_agent_desc(&self, name: &str) -> Result<AgentDesc, Error>;

    /// Forgets a remote agent and closes its connections; its transfers in
    /// flight fail.
    ///
    /// # Errors
    /// [`Error::UnknownAgent`].
    fn invalidate_remote_agent(&self, name: &str) -> Result<(), Error>;

    /// The agent's metrics in the Prometheus text exposition format:
    /// requests finished by transport, peer and outcome, bytes moved, and
    /// (when timing is on) latency histograms ([`crate::metrics`]).
    fn metrics_text(&self) -> String;

    /// Where the metrics endpoint listens (`http://<addr>/metrics`), when
    /// configured ([`AgentConfig::with_metrics_listen`](crate::AgentConfig::with_metrics_listen)).
    fn metrics_addr(&self) -> Option<std::net::SocketAddr>;

    /// Connection info (`host:port`) other agents pass to
    /// [`load_remote_agent_by_connection`](Self::load_remote_agent_by_connection).
    fn local_connection_info(&self) -> String;

    /// Validates and submits a transfer. Local descriptors are checked
    /// against local registrations, remote ones against the regions the
    /// remote exported, before anything is sent.
    ///
    /// # Errors
    /// Validation errors ([`Error::UnknownAgent`], [`Error::NotRegistered`],
    /// [`Error::RemoteRangeNotExported`], [`Error::InvalidRequest`], ...);
    /// failures after submission are reported by the returned status.
    fn submit_transfer(&self, request: &TransferRequest) -> Result<TransferStatus, Error>;

    /// Validates `request` as [`submit_transfer`](Self::submit_transfer)
    /// does and keeps the resolution, for submitting the same transfer
    /// again and again with [`submit_prepared`](Self::submit_prepared).
    /// Nothing is sent.
    ///
    /// # Errors
    /// The validation errors of `submit_transfer`.
    fn prepare_transfer(&self, request: &TransferRequest) -> Result<PreparedTransfer, Error>;

    /// [`prepare_transfer`](Self::prepare_transfer) of a request the
    /// prepared transfer then owns (not copied: a large request's
    /// descriptor lists are not made twice).
    ///
    /// # Errors
    /// As `prepare_transfer`.
    fn prepare_transfer_owned(&self, request: TransferRequest) -> Result<PreparedTransfer, Error> {
        self.prepare_transfer(&request)
    }

    /// Prepares `descs` once for one side of later transfers made by index
    /// ([`prepare_indexed`](Self::prepare_indexed)): this agent's memory
    /// (`remote_agent` `None`; every descriptor registered) or a remote
    /// agent's (every descriptor inside a region it exported).
    ///
    /// # Errors
    /// [`Error::InvalidDescriptor`], [`Error::NotRegistered`],
    /// [`Error::UnknownAgent`], [`Error::RemoteRangeNotExported`], as
    /// `submit_transfer` would for a request of these descriptors.
    fn prepare_desc_list(
        &self,
        descs: MemoryDescs,
        remote_agent: Option<&str>,
    ) -> Result<Arc<crate::indexed::PreparedDescList>, Error>;

    /// A transfer of pairs selected by index from two prepared lists, made
    /// ready to post with [`submit_prepared`](Self::submit_prepared). On the
    /// TCP path nothing per descriptor is done here beyond reading the
    /// indices: the link's threads find each pair's segments as they send
    /// them. Elsewhere the pairs are merged into a request and prepared as
    /// [`prepare_transfer`](Self::prepare_transfer) prepares one.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a bad shape (an index outside its
    /// list, lengths that differ, a list of another agent or side); the
    /// validation errors of `submit_transfer`.
    fn prepare_indexed(
        &self,
        request: crate::indexed::IndexedRequest,
    ) -> Result<PreparedTransfer, Error>;

    /// Submits a prepared transfer: what `submit_transfer(prepared.request())`
    /// does, without looking anything up again.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a transfer another agent prepared;
    /// otherwise those of `submit_transfer`.
    fn submit_prepared(&self, prepared: &PreparedTransfer) -> Result<TransferStatus, Error>;

    /// Sends a sync message not tied to a transfer. It is ordered after the
    /// data of every transfer submitted earlier to the same remote agent.
    /// The status completes once the remote has delivered it.
    ///
    /// # Errors
    /// [`Error::UnknownAgent`], [`Error::Connect`].
    fn notify_sync_message(&self, remote: &str, message: Vec<u8>) -> Result<TransferStatus, Error>;

    /// Takes every sync message received so far.
    fn take_sync_messages(&self) -> SyncMessages;

    /// Waits up to `timeout` for at least one sync message, then takes all
    /// received so far (empty on timeout).
    fn wait_sync_messages(&self, timeout: Duration) -> SyncMessages;

    /// As [`wait_sync_messages`](Self::wait_sync_messages), with the moment
    /// each message was received. The default stamps them when taken.
    fn wait_sync_messages_timed(&self, timeout: Duration) -> TimedSyncMessages {
        let now = Instant::now();
        self.wait_sync_messages(timeout)
            .into_iter()
            .map(|(from, msgs)| (from, msgs.into_iter().map(|m| (m, now)).collect()))
            .collect()
    }

    /// As [`wait_sync_messages_timed`](Self::wait_sync_messages_timed),
    /// with the peers whose last connection into this agent ended meanwhile
    /// (their departure also ends the wait). For a protocol that
    /// reassembles messages of several parts per sender: a sender's
    /// unfinished message can go when its connection ends. The other
    /// waits and takes drop departures. The default reports none.
    fn wait_sync_batch(&self, timeout: Duration) -> SyncBatch {
        SyncBatch {
            messages: self.wait_sync_messages_timed(timeout),
            departed: HashMap::new(),
        }
    }

    /// Makes every thread now blocked in
    /// [`wait_sync_messages`](Self::wait_sync_messages) return at once (with
    /// what has arrived, possibly nothing); when none is, the next call
    /// returns at once. For event loops that wait on sync messages and also
    /// take commands from other threads (or transfer completions, see
    /// [`TransferStatus::on_complete`]): a command is seen now, not when
    /// the wait times out, even when it came just before the wait began.
    fn wake_sync_waiters(&self);

    /// A handle that does what [`wake_sync_waiters`](Self::wake_sync_waiters)
    /// does without holding the agent: for completion callbacks
    /// ([`TransferStatus::on_complete`](crate::TransferStatus::on_complete)),
    /// which must not keep the agent alive nor call into it.
    fn sync_waker(&self) -> SyncWaker;

    /// Whether every descriptor lies inside a region `remote` exported, as
    /// known from its loaded descriptor. False for an unknown agent.
    fn check_remote_descs(&self, remote: &str, descs: &MemoryDescs) -> bool;

    /// Opens a file or block device as storage; returns its handle, the
    /// `device_id` of the FILE or BLK descriptors that name ranges of it
    /// (`addr` = byte offset). Register such descriptors with
    /// [`register_memory`](Self::register_memory); a request to this agent
    /// itself (its own name as the remote agent) then moves data between
    /// host memory and them.
    ///
    /// # Errors
    /// [`Error::Storage`] when the path cannot be opened as asked;
    /// [`Error::InvalidConfig`] when it is not of the kind asked;
    /// [`Error::BackendUnavailable`] when the I/O engine cannot start.
    fn open_storage(&self, spec: &crate::storage::StorageSpec) -> Result<u32, Error>;

    /// Adopts an open descriptor of a regular file as storage (with the
    /// descriptor's own access mode, through the page cache unless it was
    /// opened with `O_DIRECT`: then offsets, lengths and addresses must be
    /// multiples of 4096, [`Error::Misaligned`] otherwise); returns its
    /// handle, as [`open_storage`](Self::open_storage). Ranges may be
    /// registered past the file's end and a WRITE there extends it, as
    /// with [`StorageSpec::grow`](crate::storage::StorageSpec::grow).
    ///
    /// # Errors
    /// As [`open_storage`](Self::open_storage).
    fn adopt_storage(&self, fd: std::os::fd::OwnedFd) -> Result<u32, Error>;

    /// Opens object `key` of `store` (it need not exist yet); returns its
    /// handle, the `device_id` of the OBJ descriptors that name ranges of
    /// it (`addr` = byte offset in the object). Register such descriptors
    /// with [`register_memory`](Self::register_memory); a request to this
    /// agent itself then PUTs host memory into the object (a descriptor
    /// writes its object whole: `addr` 0) or reads ranges of it back
    /// ([`crate::storage::obj`]). Close it with
    /// [`close_storage`](Self::close_storage).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a key that is empty or longer than 1,024
    /// bytes.
    fn open_object(
        &self,
        store: &crate::storage::obj::ObjectStore,
        key: &str,
    ) -> Result<u32, Error>;

    /// Closes storage or object `handle`, refused while regions of it are
    /// registered.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for an unknown handle or one in use.
    fn close_storage(&self, handle: u32) -> Result<(), Error>;
}
