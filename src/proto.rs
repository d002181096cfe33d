//! The protocol's vocabulary, shared by the pure parts of the crate (the
//! memory model, the descriptor, the frame codecs, request planning, the
//! KV-cache machines) and the agent layer: what moved the bytes
//! ([`TransportKind`]), a transfer ([`TransferRequest`]), and why a peer
//! refused one ([`RejectReason`], [`Landed`]). It imports nothing of the
//! crate but the memory model, so the pure parts depend on it and not on
//! the agent layer (whose [`Error`](crate::Error) wraps these).

#![forbid(unsafe_code)]

use std::io;
use std::str::FromStr;

use crate::memory::MemoryDescs;

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a handshake MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// A data path: how bytes move between this agent and a peer. Its
/// discriminant is its code on the wire (a transport's own frames name it
/// by that code, `docs/wire-format.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum TransportKind {
    /// TCP streams: the kernel copies between the socket and registered
    /// memory (`sendmsg` / `readv`).
    Tcp = 1,
    /// Cross-memory attach between processes of one host
    /// (`process_vm_writev` / `process_vm_readv`), by the initiator or, for
    /// scattered remote pieces, by the target.
    Shm = 2,
    /// One-sided RDMA WRITE / READ on reliable-connected queue pairs, zero
    /// copy.
    Rdma = 3,
    /// One-sided `fi_write` / `fi_read` on a libfabric reliable-datagram
    /// endpoint, zero copy.
    Fabric = 4,
    /// A plain copy between two agents of one process
    /// ([`Backend::InProcess`](crate::agent::Backend::InProcess)).
    InProcess = 5,
    /// Reads and writes between host memory and the agent's own storage
    /// (FILE and BLK regions), by `io_uring` or `pread`/`pwrite`.
    Storage = 6,
}

impl TransportKind {
    /// Every transport.
    pub(crate) const ALL: [Self; 6] = [
        Self::Tcp,
        Self::Shm,
        Self::Rdma,
        Self::Fabric,
        Self::InProcess,
        Self::Storage,
    ];

    /// Its code on the wire (its discriminant).
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    /// The transport whose code is `code`, if any.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }

    /// Its name, NUL-terminated: the one table of transport names (the
    /// C API's included).
    fn name_with_nul(self) -> &'static str {
        match self {
            Self::Tcp => "tcp\0",
            Self::Shm => "shm\0",
            Self::Rdma => "rdma\0",
            Self::Fabric => "fabric\0",
            Self::InProcess => "inproc\0",
            Self::Storage => "storage\0",
        }
    }

    /// Its name: `"tcp"`, `"shm"`, `"rdma"`, `"fabric"`, `"inproc"` or
    /// `"storage"`.
    pub fn as_str(self) -> &'static str {
        let n = self.name_with_nul();
        &n[..n.len() - 1]
    }

    /// Its name as a C string (for the C API).
    pub fn as_cstr(self) -> &'static std::ffi::CStr {
        std::ffi::CStr::from_bytes_with_nul(self.name_with_nul().as_bytes()).unwrap_or(c"unknown")
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transport name no transport has ([`TransportKind`]'s `FromStr`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown transport {name:?} ({known})")]
pub struct UnknownTransport {
    /// The name asked for, lowercased.
    pub name: String,
    /// The names there are, comma-separated.
    pub known: String,
}

impl FromStr for TransportKind {
    type Err = UnknownTransport;

    fn from_str(s: &str) -> Result<Self, UnknownTransport> {
        // Storage is the agent's own, never a peer's data path.
        let named = || Self::ALL.into_iter().filter(|t| *t != Self::Storage);
        named()
            .find(|t| t.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownTransport {
                name: s.to_ascii_lowercase(),
                known: named().map(Self::as_str).collect::<Vec<_>>().join(", "),
            })
    }
}

/// Direction of a one-sided transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferOp {
    /// Local memory is read, remote memory written.
    Write,
    /// Remote memory is read, local memory written.
    Read,
}

/// One transfer: pairs of equally long local and remote descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferRequest {
    /// Direction.
    pub op: TransferOp,
    /// Local descriptors (TensorRT-LLM's `src`).
    pub local: MemoryDescs,
    /// Remote descriptors (TensorRT-LLM's `dst`), pairwise with `local`.
    pub remote: MemoryDescs,
    /// Name of the remote agent.
    pub remote_agent: String,
    /// Delivered to the remote agent after all of this request's data.
    pub sync_message: Option<Vec<u8>>,
    /// Storage targets (FILE, BLK): the request completes only once the
    /// data written is on stable storage (`fdatasync` of each file
    /// written). Ignored by the other memory types.
    pub durable: bool,
    /// End-to-end integrity: a CRC32C of every piece, computed over the
    /// source bytes and checked over the destination bytes before the
    /// request is reported complete. A mismatch fails the request with
    /// [`Error::Integrity`](crate::error::Error::Integrity) and its sync
    /// message is not delivered. Host memory (DRAM) on both sides, over
    /// TCP (each piece checked as it lands), shm, libfabric and RDMA (the
    /// ranges moved checked by the target at the commit; at most 2¹⁹
    /// descriptors; a target's shared pool, mapped by the initiator:
    /// both sides of each copy compared byte for byte there) or
    /// in-process (both sides of each copy summed); other
    /// memory types (GPU memory, storage) refuse it at submission with
    /// [`Error::IntegrityUnsupported`](crate::error::Error::IntegrityUnsupported).
    pub integrity: bool,
}

impl TransferRequest {
    /// WRITE `local` (source) into `remote` (destination) at `remote_agent`.
    pub fn write(local: MemoryDescs, remote: MemoryDescs, remote_agent: impl Into<String>) -> Self {
        Self {
            op: TransferOp::Write,
            local,
            remote,
            remote_agent: remote_agent.into(),
            sync_message: None,
            durable: false,
            integrity: false,
        }
    }

    /// READ `remote` (source) at `remote_agent` into `local` (destination).
    pub fn read(local: MemoryDescs, remote: MemoryDescs, remote_agent: impl Into<String>) -> Self {
        Self {
            op: TransferOp::Read,
            local,
            remote,
            remote_agent: remote_agent.into(),
            sync_message: None,
            durable: false,
            integrity: false,
        }
    }

    /// Storage targets: completes only once the data written is on stable
    /// storage (see [`durable`](Self::durable)).
    pub fn with_durable(mut self) -> Self {
        self.durable = true;
        self
    }

    /// Checks every piece end to end (see [`integrity`](Self::integrity)).
    pub fn with_integrity(mut self) -> Self {
        self.integrity = true;
        self
    }

    /// Attaches a sync message, delivered after the request's data.
    pub fn with_sync_message(mut self, msg: impl Into<Vec<u8>>) -> Self {
        self.sync_message = Some(msg.into());
        self
    }
}

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
    /// A piece of a request with integrity checks did not match its
    /// checksum (or a frame header its seal): what landed of it must be
    /// treated as invalid, and the sync message was not delivered.
    Integrity,
    /// The target's object store failed the request's PUT or GET (the
    /// store's error is logged at the target); an object a WRITE was
    /// meant to replace is as it was.
    ObjectStore,
    /// The target holds as many bytes of objects being written by its
    /// peers (assembled until their requests commit, then PUT whole) as it
    /// accepts (`Limits::max_object_assembly`); nothing of this object was
    /// stored.
    ObjectAssemblyFull,
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
            RejectReason::Integrity => 21,
            RejectReason::ObjectStore => 23,
            RejectReason::ObjectAssemblyFull => 24,
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
            21 => RejectReason::Integrity,
            23 => RejectReason::ObjectStore,
            24 => RejectReason::ObjectAssemblyFull,
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
            RejectReason::Integrity => {
                "a piece did not match its checksum at the target: what landed of it is invalid"
            }
            RejectReason::ObjectStore => "the target's object store failed the request",
            RejectReason::ObjectAssemblyFull => {
                "the target holds as many bytes of objects being written as it accepts"
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
