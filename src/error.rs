//! The agent layer's error type.
//!
//! Variants are grouped by who is at fault: the caller (API misuse), the
//! remote peer (rejections, protocol violations, disconnects) or the
//! environment (I/O, timeouts). Every variant is `Clone`, so one failure can
//! be reported to every waiter of a transfer status.

#![forbid(unsafe_code)]

use std::io;
use std::sync::Arc;
use std::time::Duration;

use crate::desc::DescError;
use crate::memory::{MemoryDesc, MemoryError, MemoryType};
use crate::proto::UnknownTransport;
pub use crate::proto::{Landed, RejectReason};

/// Errors of the transfer-agent layer.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- caller's fault -------------------------------------------------
    /// A descriptor is empty or wraps around the address space.
    #[error("invalid descriptor {desc:?}: {reason}")]
    InvalidDescriptor {
        /// The offending descriptor.
        desc: MemoryDesc,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A registration overlaps one that already exists.
    #[error("descriptor {desc:?} overlaps registered region {existing:?}")]
    Overlap {
        /// The descriptor being registered.
        desc: MemoryDesc,
        /// The existing registration it overlaps.
        existing: MemoryDesc,
    },
    /// The backend cannot register or move this memory type.
    #[error("memory type {mem_type} is not supported by the {backend} backend")]
    UnsupportedMemoryType {
        /// The memory type asked for.
        mem_type: MemoryType,
        /// The backend's name.
        backend: &'static str,
    },
    /// A local descriptor lies outside every registered region.
    #[error("local {mem_type} range {desc:?} is not inside a registered region")]
    NotRegistered {
        /// The memory type of the descriptor.
        mem_type: MemoryType,
        /// The descriptor.
        desc: MemoryDesc,
    },
    /// Deregistration asked for a range that was never registered as such.
    #[error("{mem_type} region {desc:?} is not registered (deregister takes the registered range)")]
    NotARegistration {
        /// The memory type of the descriptor.
        mem_type: MemoryType,
        /// The descriptor.
        desc: MemoryDesc,
    },
    /// Deregistration of a region that in-flight transfers still use.
    #[error(
        "region {desc:?} has {in_flight} transfer(s) in flight; wait for them before deregistering"
    )]
    RegionBusy {
        /// The region.
        desc: MemoryDesc,
        /// How many transfers use it now.
        in_flight: usize,
    },
    /// No remote agent of that name is loaded (or, resolving by name, none
    /// is published in the metadata store).
    #[error("unknown remote agent {0:?} (load it first, or it was invalidated)")]
    UnknownAgent(String),
    /// The remote agent left: its entry in the metadata store expired (its
    /// process died) or was removed (it closed), or names another instance
    /// (it restarted). Its requests in flight failed with this; a peer
    /// loaded by name is resolved again on the next request.
    #[error("remote agent {remote:?} is gone (it left the metadata store)")]
    PeerGone {
        /// The remote agent.
        remote: String,
    },
    /// The metadata store could not be used (unreachable, or it answered
    /// with an error).
    #[error("metadata store {store}: {reason}")]
    MetadataStore {
        /// The store (e.g. `etcd 127.0.0.1:2379`).
        store: String,
        /// What went wrong.
        reason: String,
    },
    /// Another live agent is published under this name in the metadata
    /// store.
    #[error("agent name {name:?} is taken in {store} by a live agent")]
    NameTaken {
        /// The name.
        name: String,
        /// The store.
        store: String,
    },
    /// A remote descriptor lies outside every region the remote exported.
    #[error("remote agent {remote:?} exported no {mem_type} region containing {desc:?}")]
    RemoteRangeNotExported {
        /// The remote agent.
        remote: String,
        /// The memory type of the descriptor.
        mem_type: MemoryType,
        /// The descriptor.
        desc: MemoryDesc,
    },
    /// Source and destination lists do not pair up.
    #[error("request is malformed: {0}")]
    InvalidRequest(String),
    /// A remote agent descriptor could not be decoded or is inconsistent.
    #[error("invalid agent descriptor: {0}")]
    InvalidAgentDesc(#[from] DescError),
    /// Connection information is not a `host:port` this agent can reach.
    #[error("invalid connection info {info:?}: {reason}")]
    InvalidConnectionInfo {
        /// The string given.
        info: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The backend asked for is not available in this build or on this host.
    #[error("backend {backend} is unavailable: {reason}")]
    BackendUnavailable {
        /// The backend's name.
        backend: &'static str,
        /// Why.
        reason: String,
    },

    /// The configuration requires a transport for this memory type
    /// (`AgentConfig::with_required_transport`) and the peer is reached
    /// another way. Nothing was sent.
    #[error(
        "{mem_type} transfers to {remote:?} must use {required}, but this agent reaches it over {actual}"
    )]
    TransportRequired {
        /// The remote agent.
        remote: String,
        /// The memory type of the request.
        mem_type: MemoryType,
        /// The transport the configuration requires.
        required: crate::proto::TransportKind,
        /// The transport the peer is reached over.
        actual: crate::proto::TransportKind,
    },

    /// The cluster credential could not be read or is too short.
    #[error("invalid cluster credential: {0}")]
    Credential(#[from] crate::auth::error::CredentialError),

    // ---- peer's fault ---------------------------------------------------
    /// The connection handshake failed: the peer holds another cluster
    /// secret, holds none where one is required, or claimed another name
    /// than the one expected. Nothing was sent to or accepted from it.
    #[error("authentication with {remote:?} failed: {reason}")]
    AuthFailed {
        /// The remote agent (or endpoint).
        remote: String,
        /// What did not check out.
        reason: String,
    },
    /// The remote agent refused (part of) the request; nothing of the
    /// refused range was touched, and `landed` says what of the request
    /// was.
    #[error("remote agent {remote:?} rejected the request: {reason} ({landed})")]
    RemoteRejected {
        /// The remote agent.
        remote: String,
        /// Why it refused.
        reason: RejectReason,
        /// What of the request's data reached its destination.
        landed: Landed,
    },
    /// End-to-end integrity ([`TransferRequest::integrity`](crate::TransferRequest::integrity)):
    /// a piece of the request did not match the CRC32C computed over its
    /// source, or a frame header did not match its seal. The request is
    /// not complete: what landed of it at the destination must be treated
    /// as invalid, and its sync message was not delivered.
    #[error("integrity check failed with {remote:?}: {what}")]
    Integrity {
        /// The remote agent.
        remote: String,
        /// What failed: the direction and the destination range.
        what: String,
    },
    /// End-to-end integrity was asked of a path or memory type that cannot
    /// check it yet; nothing was sent.
    #[error("end-to-end integrity is not available {reason}")]
    IntegrityUnsupported {
        /// Where it is not available.
        reason: String,
    },
    /// The remote agent's process is not the one the loaded descriptor
    /// describes (it restarted); reload its descriptor.
    #[error("remote agent {remote:?} at {addr} is a different instance than the loaded descriptor")]
    StaleAgent {
        /// The remote agent.
        remote: String,
        /// The endpoint that answered.
        addr: String,
    },
    /// The peer sent something this protocol does not allow.
    #[error("protocol violation by {remote:?}: {detail}")]
    ProtocolViolation {
        /// The remote agent (or endpoint).
        remote: String,
        /// What was wrong.
        detail: String,
    },
    /// The connection to the peer broke (reset, closed, or the peer died).
    #[error("connection to remote agent {remote:?} lost: {cause}")]
    ConnectionLost {
        /// The remote agent.
        remote: String,
        /// The I/O error that ended it.
        cause: Arc<io::Error>,
    },

    // ---- environment ----------------------------------------------------
    /// Connecting to the peer failed.
    #[error("cannot connect to {addr}: {cause}")]
    Connect {
        /// The endpoint.
        addr: String,
        /// The I/O error.
        cause: Arc<io::Error>,
    },
    /// An RDMA verb failed (registration, queue-pair set-up, posting); the
    /// verbs layer's error is the source.
    #[error("RDMA failure with remote agent {remote:?}: {source}")]
    Rdma {
        /// The remote agent (empty for local operations such as registration).
        remote: String,
        /// What the verbs layer reported (a
        /// [`VerbsError`](crate::verbs::VerbsError)).
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// An RDMA work request completed with an error status, e.g.
    /// `IBV_WC_REM_ACCESS_ERR` (the remote region was deregistered, or the
    /// range lies outside it) or `IBV_WC_RETRY_EXC_ERR` (the peer is
    /// unreachable). The queue pair is then in error: the link is rebuilt
    /// on the next request.
    #[error("RDMA work request to remote agent {remote:?} completed with {status}")]
    RdmaCompletion {
        /// The remote agent.
        remote: String,
        /// The work-completion status (`IBV_WC_*`).
        status: &'static str,
    },
    /// A transport's own operation failed (set-up, registration, posting,
    /// a completion with an error); the transport's error is the source.
    #[error("{transport} failure with remote agent {remote:?}: {source}")]
    Transport {
        /// The transport.
        transport: &'static str,
        /// The remote agent (empty for local operations such as
        /// registration).
        remote: String,
        /// What the transport reported.
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A broken link's requests could not be proved settled: the target
    /// still runs, and a transport outside the link's streams (a libfabric
    /// provider) may still land their data there until it closes its agent
    /// or exits (see [`TransferStatus::wait_settled`](crate::TransferStatus::wait_settled)).
    #[error(
        "remote agent {remote:?} still runs: what the libfabric provider moved for the broken link may land there until it closes its agent or exits"
    )]
    StillLanding {
        /// The remote agent.
        remote: String,
    },
    /// The peer made no progress for longer than the configured I/O timeout.
    #[error("remote agent {remote:?} made no progress for {idle:?}; connection declared dead")]
    PeerTimedOut {
        /// The remote agent.
        remote: String,
        /// How long nothing moved.
        idle: Duration,
    },
    /// A blocking call did not finish in time.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// The operation.
        what: &'static str,
        /// The timeout that elapsed.
        after: Duration,
    },
    /// The agent has as many requests in flight as it allows
    /// (`Limits::max_requests_in_flight`); wait for some to complete
    /// and submit again. Nothing was submitted.
    #[error(
        "{in_flight} requests in flight, the most this agent allows; wait for some and submit again"
    )]
    WouldBlock {
        /// Requests in flight when the submission was refused.
        in_flight: usize,
    },
    /// The transfer was aborted by its caller
    /// ([`TransferStatus::abort`](crate::TransferStatus::abort)); what it
    /// had sent before the abort landed, nothing more of it will.
    #[error("the transfer was aborted")]
    Aborted,
    /// The agent is shutting down.
    #[error("the agent is shutting down")]
    Closed,
    /// A local I/O error outside any peer connection.
    #[error("I/O error: {0}")]
    Io(Arc<io::Error>),
    /// A read, write or sync of storage (a FILE or BLK region) failed; the
    /// OS error is kept (`ENOSPC` for a full device, `EIO`, ...). What the
    /// request wrote before the failure may have landed; nothing else
    /// changed.
    #[error("storage {op} on handle {handle} failed: {source}")]
    Storage {
        /// The storage handle (the descriptors' `device_id`).
        handle: u64,
        /// `open`, `write`, `read`, `fdatasync`, ...
        op: &'static str,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },
    /// An object-store request failed: which, and of what kind (a missing
    /// bucket or key, denied access, a full quota, throttling or an
    /// unreachable store through every retry, a deadline, a bad range).
    /// A failed WRITE leaves the object as it was (a PUT replaces it whole
    /// or not at all; a failed multipart upload is aborted); a failed READ
    /// may have written part of its destination.
    #[error(transparent)]
    Object(#[from] crate::storage::obj::error::ObjError),
    /// GPU memory could not be registered or moved: no driver, a range
    /// that is not device memory, on another device than its descriptor
    /// names, or past its allocation, or a failed driver call.
    #[error("GPU memory: {0}")]
    Gpu(#[from] crate::gpu::error::GpuError),
    /// A direct-I/O (`O_DIRECT`) storage range or buffer is not aligned to
    /// the device's logical block size; nothing was read or written.
    #[error("{what} {value:#x} is not a multiple of storage handle {handle}'s block size {block}")]
    Misaligned {
        /// The storage handle.
        handle: u64,
        /// `offset`, `length` or `memory address`.
        what: &'static str,
        /// The misaligned value.
        value: u64,
        /// The alignment direct I/O needs.
        block: u32,
    },
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(Arc::new(e))
    }
}

impl From<MemoryError> for Error {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::InvalidDescriptor { desc, reason } => {
                Error::InvalidDescriptor { desc, reason }
            }
            MemoryError::Overlap { desc, existing } => Error::Overlap { desc, existing },
        }
    }
}

impl From<UnknownTransport> for Error {
    fn from(e: UnknownTransport) -> Self {
        Error::InvalidConfig(e.to_string())
    }
}
