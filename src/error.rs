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

/// What of a refused request's data reached its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Landed {
    /// Not a byte: every piece was refused before any was written.
    Nothing,
    /// Some pieces landed whole, the others not at all (a deregistration
    /// in the middle of the request).
    Partly,
    /// Every byte landed; what was refused came after the data (its sync
    /// message, or a commit after its grants expired).
    All,
    /// The target did not say: a refused READ, a link the target closed,
    /// or a target that predates the report.
    Unknown,
}

impl Landed {
    /// The code carried in an `Ack` frame's `aux` (0: unknown).
    pub(crate) fn code(self) -> u32 {
        match self {
            Landed::Unknown => 0,
            Landed::Nothing => 1,
            Landed::Partly => 2,
            Landed::All => 3,
        }
    }

    /// The report a code carries (an unknown code: `Unknown`).
    pub(crate) fn from_code(c: u32) -> Self {
        match c {
            1 => Landed::Nothing,
            2 => Landed::Partly,
            3 => Landed::All,
            _ => Landed::Unknown,
        }
    }
}

impl std::fmt::Display for Landed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Landed::Nothing => "not a byte of it landed",
            Landed::Partly => "part of it landed",
            Landed::All => "all of its data landed",
            Landed::Unknown => "what landed is unknown",
        })
    }
}

/// Why a remote agent refused part of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// The range lies in no region the target registered and exported.
    NotRegistered,
    /// The access key does not match the region (stale descriptor: the region
    /// was deregistered and registered again).
    BadKey,
    /// The target does not accept this memory type over this backend.
    UnsupportedMemoryType,
    /// The request was malformed.
    Malformed,
    /// The target agent is shutting down.
    ShuttingDown,
    /// The target holds as many bytes of sync messages (from this peer, or
    /// in all) as it accepts until its application takes them; the data of
    /// the request landed, its message was not kept.
    InboxFull,
    /// The initiator aborted the request: the segments it had sent landed,
    /// the rest never came, and the sync message was not delivered.
    Aborted,
    /// A storage range (FILE or BLK) is not aligned to the block size its
    /// direct I/O needs; nothing of it was read or written.
    Misaligned,
    /// A storage range ends past the end of the target's file or device (it
    /// was truncated under its registration); nothing of it moved.
    PastEnd,
    /// The target's storage I/O failed with this OS error number (`ENOSPC`:
    /// the disk is full). Data the request wrote before the failure may
    /// have landed; earlier requests' data is intact.
    StorageIo {
        /// The `errno` (0 when the OS gave none).
        errno: u16,
    },
    /// A copy between the target's GPU memory and its staging buffers
    /// failed (a driver error, logged at the target). Data of the segment
    /// may have landed in part.
    GpuCopy,
    /// The target holds as many open requests, from all its peers, as it
    /// accepts (`Limits::max_open_requests`), and this connection held more
    /// than its fair share of them: the target closed it, failing its
    /// requests. Their data may have landed in part.
    Overloaded,
    /// The request's grants expired (the target's I/O timeout passed
    /// between the grant and the commit): the target released the ranges
    /// and failed the request. Its data may have landed in part.
    GrantExpired,
}

impl RejectReason {
    /// Numeric code used on the wire.
    pub(crate) fn code(self) -> u16 {
        match self {
            RejectReason::NotRegistered => 1,
            RejectReason::BadKey => 2,
            RejectReason::UnsupportedMemoryType => 3,
            RejectReason::Malformed => 4,
            RejectReason::ShuttingDown => 5,
            RejectReason::InboxFull => 6,
            RejectReason::Aborted => 7,
            RejectReason::Misaligned => 8,
            RejectReason::PastEnd => 9,
            RejectReason::GpuCopy => 18,
            RejectReason::Overloaded => 19,
            RejectReason::GrantExpired => 20,
            RejectReason::StorageIo { errno } => STORAGE_IO_BASE.saturating_add(errno),
        }
    }

    /// The reason for a failed storage read, write or sync at the target.
    pub(crate) fn storage_io(e: &io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            // A read stopped short: the file shrank under its region.
            return RejectReason::PastEnd;
        }
        let errno = e.raw_os_error().unwrap_or(0);
        RejectReason::StorageIo {
            errno: u16::try_from(errno)
                .ok()
                .filter(|&n| n < u16::MAX - STORAGE_IO_BASE)
                .unwrap_or(0),
        }
    }

    /// Decodes a wire code; unknown codes read as `Malformed`.
    pub(crate) fn from_code(code: u16) -> Self {
        match code {
            1 => RejectReason::NotRegistered,
            2 => RejectReason::BadKey,
            3 => RejectReason::UnsupportedMemoryType,
            5 => RejectReason::ShuttingDown,
            6 => RejectReason::InboxFull,
            7 => RejectReason::Aborted,
            8 => RejectReason::Misaligned,
            9 => RejectReason::PastEnd,
            18 => RejectReason::GpuCopy,
            19 => RejectReason::Overloaded,
            20 => RejectReason::GrantExpired,
            c if c >= STORAGE_IO_BASE => RejectReason::StorageIo {
                errno: c - STORAGE_IO_BASE,
            },
            _ => RejectReason::Malformed,
        }
    }
}

/// Wire codes from here on are [`RejectReason::StorageIo`], the `errno`
/// added.
const STORAGE_IO_BASE: u16 = 0x100;

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = match self {
            RejectReason::NotRegistered => "range not registered at the target",
            RejectReason::BadKey => "access key does not match the region (stale descriptor)",
            RejectReason::UnsupportedMemoryType => "memory type not supported by the target",
            RejectReason::Malformed => "malformed request",
            RejectReason::ShuttingDown => "target agent is shutting down",
            RejectReason::InboxFull => {
                "the target's sync-message inbox is full (its application is not taking messages)"
            }
            RejectReason::Aborted => "the initiator aborted the request",
            RejectReason::Misaligned => {
                "the storage range is not aligned to the target's direct-I/O block size"
            }
            RejectReason::PastEnd => {
                "the storage range ends past the end of the target's file or device \
                 (truncated under its registration)"
            }
            RejectReason::GpuCopy => "a copy to or from the target's GPU memory failed",
            RejectReason::Overloaded => {
                "the target holds as many open requests as it accepts, and this connection \
                 held more than its share: the target closed it"
            }
            RejectReason::GrantExpired => {
                "the request's grants expired at the target before its commit"
            }
            RejectReason::StorageIo { errno: 0 } => "storage I/O at the target failed",
            RejectReason::StorageIo { errno } => {
                let cause = io::Error::from_raw_os_error(i32::from(*errno));
                return write!(f, "storage I/O at the target failed: {cause}");
            }
        };
        f.write_str(text)
    }
}

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
        required: crate::agent::TransportKind,
        /// The transport the peer is reached over.
        actual: crate::agent::TransportKind,
    },

    /// The cluster credential could not be read or is too short.
    #[error("invalid cluster credential: {0}")]
    Credential(#[from] crate::auth::CredentialError),

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
        /// What the verbs layer reported.
        #[source]
        source: Arc<crate::verbs::VerbsError>,
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
    /// GPU memory could not be registered or moved: no driver, a range
    /// that is not device memory, on another device than its descriptor
    /// names, or past its allocation, or a failed driver call.
    #[error("GPU memory: {0}")]
    Gpu(#[from] crate::gpu::GpuError),
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
