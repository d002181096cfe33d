//! C ABI for kvxfer: `libkvxfer.so`, `libkvxfer.a`, `include/kvxfer.h`.
//!
//! Conventions (see `sys/README.md`):
//! - Every function returns a [`kvxfer_result`] (except the few that return
//!   a static string or a length, and say so); outputs go through pointer
//!   arguments, written only on success.
//! - The last failure's message is kept per thread: [`kvxfer_last_error`].
//! - Handles are opaque pointers. Every call checks that a handle is live
//!   (issued by this library, of the right kind, not yet freed): a null,
//!   forged or freed handle is `KVXFER_ERR_NULL_ARGUMENT` /
//!   `KVXFER_ERR_INVALID_HANDLE`, not a crash.
//! - No panic crosses the boundary: it becomes `KVXFER_ERR_PANIC`.
//! - Memory types and operations are plain `uint32_t` values checked on
//!   entry, so an out-of-range value from C is an error, not undefined
//!   behaviour.
//!
//! This file holds the types, the handle table, errors and the panic
//! boundary; the functions live by area: `agent` (agents, descriptors,
//! peers), `memory` (registration), `transfers` (submitting, prepared
//! transfers, notifications), `status` (waits, aborts, callbacks,
//! completion queues), `messages` (sync messages), `storage`, `pool`
//! (shared pools), `cache` (the KV-cache layer).
#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, OnceLock};

mod agent;
mod cache;
mod memory;
mod messages;
mod pool;
mod status;
mod storage;
mod transfers;
pub use agent::*;
pub use cache::*;
pub use memory::*;
pub use messages::*;
pub use pool::*;
pub use status::*;
pub use storage::*;
pub use transfers::*;

use kvxfer_core::{
    CompletionQueue, Error, MemoryDesc, MemoryDescs, MemoryType, TransferAgent, TransferStatus,
};

/// Result of every call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvxfer_result {
    /// Success.
    KVXFER_OK = 0,
    /// `kvxfer_status_wait`: the transfer is still running at the timeout.
    KVXFER_IN_PROGRESS = 1,
    /// A required pointer argument is NULL.
    KVXFER_ERR_NULL_ARGUMENT = 100,
    /// A handle that this library did not issue, of another kind, or freed.
    KVXFER_ERR_INVALID_HANDLE = 101,
    /// An argument is out of range (memory type, operation, UTF-8, backend
    /// name, option, request shape).
    KVXFER_ERR_INVALID_ARGUMENT = 102,
    /// An output buffer is too small; the needed length was written.
    KVXFER_ERR_BUFFER_TOO_SMALL = 103,
    /// A descriptor is empty or wraps around the address space.
    KVXFER_ERR_INVALID_DESCRIPTOR = 200,
    /// A registration overlaps an existing one.
    KVXFER_ERR_OVERLAP = 201,
    /// The backend cannot handle this memory type.
    KVXFER_ERR_UNSUPPORTED_MEMORY_TYPE = 202,
    /// A local descriptor is outside every registered region (or, for
    /// deregistration, is not a registration).
    KVXFER_ERR_NOT_REGISTERED = 203,
    /// Deregistration of a region that transfers in flight use.
    KVXFER_ERR_REGION_BUSY = 204,
    /// No remote agent of that name is loaded.
    KVXFER_ERR_UNKNOWN_AGENT = 205,
    /// A remote descriptor is outside every region the remote exported.
    KVXFER_ERR_REMOTE_RANGE = 206,
    /// An agent descriptor does not decode or is inconsistent.
    KVXFER_ERR_INVALID_AGENT_DESC = 207,
    /// The backend is not available (in this build, on this host, or for
    /// this peer).
    KVXFER_ERR_BACKEND_UNAVAILABLE = 208,
    /// The remote agent refused the request.
    KVXFER_ERR_REMOTE_REJECTED = 300,
    /// The remote agent restarted since its descriptor was loaded.
    KVXFER_ERR_STALE_AGENT = 301,
    /// The peer broke the protocol.
    KVXFER_ERR_PROTOCOL = 302,
    /// The connection to the peer was lost (reset, closed, peer died).
    KVXFER_ERR_CONNECTION_LOST = 303,
    /// Connecting to the peer failed.
    KVXFER_ERR_CONNECT = 304,
    /// The peer made no progress within the I/O timeout.
    KVXFER_ERR_PEER_TIMEOUT = 305,
    /// A blocking call timed out.
    KVXFER_ERR_TIMEOUT = 306,
    /// The agent is shutting down.
    KVXFER_ERR_CLOSED = 307,
    /// Another I/O error.
    KVXFER_ERR_IO = 308,
    /// An RDMA verb failed, or a work request completed with an error status
    /// (named in the message, e.g. `IBV_WC_REM_ACCESS_ERR`).
    KVXFER_ERR_RDMA = 309,
    /// The peer did not authenticate (another cluster secret, or none where
    /// one is required), or claimed another name than expected.
    KVXFER_ERR_AUTH = 310,
    /// The agent has as many requests in flight as it allows; wait for
    /// some and submit again (nothing was submitted).
    KVXFER_ERR_WOULD_BLOCK = 311,
    /// A KV-cache request was cancelled (by either side) or failed on the
    /// context side; the message says which and why.
    KVXFER_ERR_CANCELLED = 312,
    /// The transfer was aborted (`kvxfer_status_abort`): what it had sent
    /// landed, nothing more of it will.
    KVXFER_ERR_ABORTED = 313,
    /// The configuration requires a transport for this memory type and the
    /// peer is reached another way; nothing was sent.
    KVXFER_ERR_TRANSPORT_REQUIRED = 314,
    /// The remote agent left the metadata store (its process died, closed
    /// or restarted); a peer loaded by name is resolved again on the next
    /// request.
    KVXFER_ERR_PEER_GONE = 315,
    /// The metadata store (etcd) cannot be reached or refused the request.
    KVXFER_ERR_METADATA_STORE = 316,
    /// Another live agent holds this name in the metadata store.
    KVXFER_ERR_NAME_TAKEN = 317,
    /// GPU memory could not be registered or moved: no CUDA driver, a range
    /// that is not device memory, on another device than `device_id`
    /// names, or past its allocation, or a failed driver call.
    KVXFER_ERR_GPU = 318,
    /// A KV-cache request ended (the message says why), but context ranks
    /// writing into its blocks did not confirm that they stopped: their
    /// writes may still land. Reuse the blocks only once
    /// `kvxfer_cache_wait_settled` returns `KVXFER_OK`.
    KVXFER_ERR_UNSETTLED = 319,
    /// End-to-end integrity (`KVXFER_SUBMIT_INTEGRITY`, or a KV receiver
    /// made with it): a piece did not match the CRC32C of its source where
    /// it landed. The transfer failed; what landed of it must not be used,
    /// and its notification was not delivered.
    KVXFER_ERR_INTEGRITY = 320,
    /// End-to-end integrity was asked of a path or memory type that cannot
    /// check it (host memory over TCP, shm or inproc only); nothing was sent.
    KVXFER_ERR_INTEGRITY_UNSUPPORTED = 321,
    /// An object-store request failed (the message names the request, the
    /// bucket and key, and the kind: no such bucket or key, access denied,
    /// quota exceeded, throttled, invalid range, timeout, unreachable). A
    /// failed WRITE left the object as it was.
    KVXFER_ERR_OBJECT_STORE = 322,
    /// A bug: a panic was caught at the boundary.
    KVXFER_ERR_PANIC = 900,
}

use kvxfer_result::*;

/// A memory type: one of the `KVXFER_MEM_*` values.
pub type kvxfer_mem_type = u32;
/// Host memory.
pub const KVXFER_MEM_DRAM: kvxfer_mem_type = 0;
/// GPU memory.
pub const KVXFER_MEM_VRAM: kvxfer_mem_type = 1;
/// Block device.
pub const KVXFER_MEM_BLK: kvxfer_mem_type = 2;
/// Object store.
pub const KVXFER_MEM_OBJ: kvxfer_mem_type = 3;
/// File.
pub const KVXFER_MEM_FILE: kvxfer_mem_type = 4;

/// A transfer direction: one of the `KVXFER_OP_*` values.
pub type kvxfer_op = u32;
/// Local memory is read, remote memory written.
pub const KVXFER_OP_WRITE: kvxfer_op = 0;
/// Remote memory is read, local memory written.
pub const KVXFER_OP_READ: kvxfer_op = 1;

/// Flags of `kvxfer_agent_submit_flags`: any of the `KVXFER_SUBMIT_*`
/// values, or-ed.
pub type kvxfer_submit_flags = u32;
/// Storage targets (FILE, BLK): the transfer completes only once the data
/// written is on stable storage (`fdatasync` of each file written).
pub const KVXFER_SUBMIT_DURABLE: kvxfer_submit_flags = 1;
/// End-to-end integrity: a CRC32C of every piece, computed over the source
/// and checked where it lands before the transfer completes
/// (`KVXFER_ERR_INTEGRITY` on a mismatch; host memory only, else
/// `KVXFER_ERR_INTEGRITY_UNSUPPORTED`).
pub const KVXFER_SUBMIT_INTEGRITY: kvxfer_submit_flags = 2;

/// One byte range: `[addr, addr + len)` on device `device_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvxfer_mem_desc {
    /// Start address (or offset for block/object/file memory).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device index.
    pub device_id: u32,
}

/// Optional agent settings. Zero or NULL fields keep the default. Set
/// `struct_size` to `sizeof(kvxfer_options)`: later versions append fields
/// and read only what the caller's struct holds.
#[repr(C)]
pub struct kvxfer_options {
    /// `sizeof(kvxfer_options)` as the caller compiled it.
    pub struct_size: usize,
    /// Listen address (`host:port`), default `127.0.0.1:0`.
    pub listen: *const c_char,
    /// Address advertised to peers, default: the bound one.
    pub advertise: *const c_char,
    /// TCP streams per remote agent (default 2).
    pub streams_per_peer: u32,
    /// No-progress timeout in milliseconds (default 30000).
    pub io_timeout_ms: u32,
    /// Connection timeout in milliseconds (default 5000).
    pub connect_timeout_ms: u32,
    /// RDMA queue pairs per remote agent, 1..=16 (default 1).
    pub rdma_qps_per_peer: u32,
    /// RDMA local ACK timeout exponent, 1..=31: retransmit after
    /// 4.096 µs × 2^n (default `KVXFER_RDMA_ACK_TIMEOUT`, else 14).
    pub rdma_ack_timeout: u32,
    /// Non-zero: each incoming RDMA connection posts its own receive
    /// buffers and runs its own thread, instead of sharing the agent's
    /// shared receive queue.
    pub rdma_no_shared_receive_queue: u32,
    /// Path of a file holding the cluster secret (at least 16 bytes and
    /// 128 bits by its length and kinds of characters; a
    /// trailing newline is dropped). Every connection authenticates with
    /// it; NULL: `KVXFER_SECRET_FILE`, else `KVXFER_SECRET`, else none.
    pub secret_file: *const c_char,
    /// Non-zero: allow a non-loopback `listen` without a cluster secret
    /// (any process that reaches the port can then read and write the
    /// exported memory).
    pub insecure: u32,
    /// `"tcp"`, `"shm"`, `"rdma"`, `"fabric"` or `"inproc"`: host-memory transfers must use this
    /// transport; one to a peer reached another way fails with
    /// `KVXFER_ERR_TRANSPORT_REQUIRED` before anything is sent (an `auto`
    /// agent otherwise falls back to TCP). NULL: no requirement.
    pub require_dram_transport: *const c_char,
    /// An etcd cluster (`host:port[,host:port...]`) to publish the agent in
    /// and find peers in by name (`kvxfer_agent_load_remote_by_name`).
    /// NULL: `KVXFER_ETCD`, else none.
    pub etcd_endpoints: *const c_char,
    /// The key prefix in etcd (NULL: `KVXFER_ETCD_PREFIX`, else
    /// `/kvxfer`).
    pub etcd_prefix: *const c_char,
    /// The agent's lease in etcd, in seconds, at least 2 (0: 5).
    pub etcd_lease_ttl_s: u32,
    /// TLS to etcd: PEM file of the certificate authorities its server
    /// certificate must chain to (NULL: plain HTTP).
    pub etcd_ca_file: *const c_char,
    /// With `etcd_ca_file`: this client's certificate chain and key (PEM
    /// files), for etcd's `--client-cert-auth` (NULL: none).
    pub etcd_cert_file: *const c_char,
    /// The key of `etcd_cert_file`.
    pub etcd_key_file: *const c_char,
}

/// A transfer request. `local` and `remote` pair up element by element
/// (TensorRT-LLM's `src` is `local`, `dst` is `remote`).
#[repr(C)]
pub struct kvxfer_request {
    /// `KVXFER_OP_WRITE` or `KVXFER_OP_READ`.
    pub op: kvxfer_op,
    /// Memory type of `local`.
    pub local_type: kvxfer_mem_type,
    /// Local descriptors.
    pub local: *const kvxfer_mem_desc,
    /// Number of local descriptors.
    pub local_count: usize,
    /// Memory type of `remote`.
    pub remote_type: kvxfer_mem_type,
    /// Remote descriptors.
    pub remote: *const kvxfer_mem_desc,
    /// Number of remote descriptors.
    pub remote_count: usize,
    /// Name of the remote agent (NUL-terminated UTF-8).
    pub remote_agent: *const c_char,
    /// Sync message delivered after the data, or NULL for none.
    pub sync_message: *const u8,
    /// Length of the sync message (it may be 0 with a non-NULL pointer).
    pub sync_message_len: usize,
}

/// A transfer agent. Thread-safe: every function taking a
/// `kvxfer_agent*` may be called from several threads at once, except
/// `kvxfer_agent_free`, which must be the last call on it.
pub struct kvxfer_agent {
    /// Shared with the KV-cache senders and receivers made on it: the agent
    /// lives until the last of them is freed too.
    agent: std::sync::Arc<dyn TransferAgent>,
    /// The object stores its objects were opened in.
    stores: kvxfer_core::storage::obj::ObjectStores,
}

/// A submitted transfer. Thread-safe for `kvxfer_status_*` queries and
/// waits; free it once, after the last of them. Freeing does not cancel.
pub struct kvxfer_status {
    status: TransferStatus,
}

/// A transfer resolved once (`kvxfer_agent_prepare`) and submitted again and
/// again (`kvxfer_agent_submit_prepared`) without peer, registry or key
/// lookups. Its local regions stay held (deregistration refused) until it
/// is freed. Thread-safe; free once, after the last submission.
pub struct kvxfer_prepared {
    prepared: kvxfer_core::PreparedTransfer,
}

/// Outcomes of the transfers it watches (`kvxfer_cq_watch`), in the order
/// they finished; its descriptor (`kvxfer_cq_fd`) is readable while any is
/// ready, for event loops. Thread-safe; free once, after the last call.
pub struct kvxfer_cq {
    cq: CompletionQueue,
}

/// One finished transfer, as a completion queue reports it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvxfer_completion {
    /// The token it was watched with.
    pub token: u64,
    /// `KVXFER_OK`, or the transfer's error code.
    pub outcome: kvxfer_result,
}

/// A completion callback (`kvxfer_status_on_complete`): the `user_data`
/// given, and the transfer's outcome (`KVXFER_OK` or its error code).
pub type kvxfer_complete_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, outcome: kvxfer_result)>;

/// A batch of received sync messages, read-only: safe to read from several
/// threads; free once.
pub struct kvxfer_messages {
    items: Vec<(CString, Vec<u8>)>,
}

// ---------------------------------------------------------------------------
// Handles, errors, the panic boundary.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Agent,
    Status,
    Cq,
    Messages,
    Prepared,
    CacheSender,
    CacheReceiver,
    CacheHandle,
    Pool,
}

fn handles() -> std::sync::MutexGuard<'static, HashMap<usize, Kind>> {
    static H: OnceLock<Mutex<HashMap<usize, Kind>>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn issue<T>(b: Box<T>, kind: Kind) -> *mut T {
    let p = Box::into_raw(b);
    handles().insert(p as usize, kind);
    p
}

/// Issues `b` as a handle of `kind` and writes it to `*out`.
///
/// # Safety
/// `out` is non-null and valid for a write.
unsafe fn hand_out<T>(out: *mut *mut T, b: Box<T>, kind: Kind) -> Result<kvxfer_result, Fail> {
    let p = issue(b, kind);
    // SAFETY: forwarded contract.
    unsafe { *out = p };
    Ok(KVXFER_OK)
}

struct Fail {
    code: kvxfer_result,
    msg: String,
}

impl Fail {
    fn new(code: kvxfer_result, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::InvalidDescriptor { .. } => KVXFER_ERR_INVALID_DESCRIPTOR,
            Error::Overlap { .. } => KVXFER_ERR_OVERLAP,
            Error::UnsupportedMemoryType { .. } => KVXFER_ERR_UNSUPPORTED_MEMORY_TYPE,
            Error::NotRegistered { .. } | Error::NotARegistration { .. } => {
                KVXFER_ERR_NOT_REGISTERED
            }
            Error::RegionBusy { .. } => KVXFER_ERR_REGION_BUSY,
            Error::UnknownAgent(_) => KVXFER_ERR_UNKNOWN_AGENT,
            Error::RemoteRangeNotExported { .. } => KVXFER_ERR_REMOTE_RANGE,
            Error::InvalidRequest(_)
            | Error::InvalidConfig(_)
            | Error::InvalidConnectionInfo { .. } => KVXFER_ERR_INVALID_ARGUMENT,
            Error::InvalidAgentDesc(_) => KVXFER_ERR_INVALID_AGENT_DESC,
            Error::BackendUnavailable { .. } => KVXFER_ERR_BACKEND_UNAVAILABLE,
            Error::RemoteRejected { .. } => KVXFER_ERR_REMOTE_REJECTED,
            Error::StaleAgent { .. } => KVXFER_ERR_STALE_AGENT,
            Error::ProtocolViolation { .. } => KVXFER_ERR_PROTOCOL,
            Error::ConnectionLost { .. } => KVXFER_ERR_CONNECTION_LOST,
            Error::Connect { .. } => KVXFER_ERR_CONNECT,
            Error::PeerTimedOut { .. } => KVXFER_ERR_PEER_TIMEOUT,
            Error::StillLanding { .. } => KVXFER_ERR_UNSETTLED,
            Error::Timeout { .. } => KVXFER_ERR_TIMEOUT,
            Error::Closed => KVXFER_ERR_CLOSED,
            Error::WouldBlock { .. } => KVXFER_ERR_WOULD_BLOCK,
            Error::Aborted => KVXFER_ERR_ABORTED,
            Error::TransportRequired { .. } => KVXFER_ERR_TRANSPORT_REQUIRED,
            Error::Rdma { .. } | Error::RdmaCompletion { .. } => KVXFER_ERR_RDMA,
            Error::AuthFailed { .. } => KVXFER_ERR_AUTH,
            Error::Credential(_) => KVXFER_ERR_INVALID_ARGUMENT,
            Error::Misaligned { .. } => KVXFER_ERR_INVALID_DESCRIPTOR,
            Error::Storage { .. } | Error::Io(_) => KVXFER_ERR_IO,
            Error::PeerGone { .. } => KVXFER_ERR_PEER_GONE,
            Error::MetadataStore { .. } => KVXFER_ERR_METADATA_STORE,
            Error::NameTaken { .. } => KVXFER_ERR_NAME_TAKEN,
            Error::Gpu(_) => KVXFER_ERR_GPU,
            Error::Integrity { .. } => KVXFER_ERR_INTEGRITY,
            Error::IntegrityUnsupported { .. } => KVXFER_ERR_INTEGRITY_UNSUPPORTED,
            Error::Object(_) => KVXFER_ERR_OBJECT_STORE,
            _ => KVXFER_ERR_IO,
        };
        Fail::new(code, e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs `f` behind the panic boundary, recording a failure's message.
fn boundary(f: impl FnOnce() -> Result<kvxfer_result, Fail>) -> kvxfer_result {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(fail)) => {
            set_last_error(&fail.msg);
            fail.code
        }
        Err(_) => {
            set_last_error("internal error: a panic was caught at the C boundary");
            KVXFER_ERR_PANIC
        }
    }
}

/// The live object behind `p`, checked against the handle table.
///
/// # Safety
/// A handle found in the table points to a live `T` of that kind: handles
/// are inserted when boxed and removed before being freed.
unsafe fn live<'a, T>(p: *const T, kind: Kind, what: &str) -> Result<&'a T, Fail> {
    if p.is_null() {
        return Err(Fail::new(
            KVXFER_ERR_NULL_ARGUMENT,
            format!("{what} is NULL"),
        ));
    }
    if handles().get(&(p as usize)) != Some(&kind) {
        return Err(Fail::new(
            KVXFER_ERR_INVALID_HANDLE,
            format!("{what} is not a live {kind:?} handle (never issued, or already freed)"),
        ));
    }
    // SAFETY: per this function's contract, a registered pointer of this
    // kind is a live, boxed T.
    Ok(unsafe { &*p })
}

/// Removes a handle from the table and frees it. NULL is a no-op.
///
/// # Safety
/// As [`live`].
unsafe fn free_handle<T>(p: *mut T, kind: Kind, what: &str) -> Result<kvxfer_result, Fail> {
    if p.is_null() {
        return Ok(KVXFER_OK);
    }
    let known = handles().remove(&(p as usize));
    if known != Some(kind) {
        if let Some(k) = known {
            handles().insert(p as usize, k);
        }
        return Err(Fail::new(
            KVXFER_ERR_INVALID_HANDLE,
            format!("{what} is not a live {kind:?} handle (never issued, or already freed)"),
        ));
    }
    // SAFETY: the pointer came from `Box::into_raw` in `issue` and was just
    // removed from the table, so it is freed exactly once.
    drop(unsafe { Box::from_raw(p) });
    Ok(KVXFER_OK)
}

fn non_null<T>(p: *const T, what: &str) -> Result<(), Fail> {
    if p.is_null() {
        Err(Fail::new(
            KVXFER_ERR_NULL_ARGUMENT,
            format!("{what} is NULL"),
        ))
    } else {
        Ok(())
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    non_null(p, what)?;
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Fail::new(KVXFER_ERR_INVALID_ARGUMENT, format!("{what} is not UTF-8")))
}

/// # Safety
/// `p` is valid for reads of `n` elements when `n > 0`.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    non_null(p, what)?;
    // SAFETY: non-null, and valid for `n` reads per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

fn mem_type(t: kvxfer_mem_type) -> Result<MemoryType, Fail> {
    Ok(match t {
        KVXFER_MEM_DRAM => MemoryType::Dram,
        KVXFER_MEM_VRAM => MemoryType::Vram,
        KVXFER_MEM_BLK => MemoryType::Blk,
        KVXFER_MEM_OBJ => MemoryType::Obj,
        KVXFER_MEM_FILE => MemoryType::File,
        other => {
            return Err(Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("unknown memory type {other}"),
            ));
        }
    })
}

/// # Safety
/// As [`slice`].
unsafe fn descs(
    t: kvxfer_mem_type,
    p: *const kvxfer_mem_desc,
    n: usize,
    what: &str,
) -> Result<MemoryDescs, Fail> {
    // SAFETY: forwarded contract.
    let raw = unsafe { slice(p, n, what)? };
    Ok(MemoryDescs::new(
        mem_type(t)?,
        raw.iter()
            .map(|d| MemoryDesc::new(d.addr, d.len, d.device_id))
            .collect(),
    ))
}

/// Copies `bytes` (plus a NUL when `nul`) into `buf`, writing the needed
/// length (without NUL) to `out_len`.
///
/// # Safety
/// `buf` is valid for `cap` writes when non-NULL; `out_len` is NULL or valid.
unsafe fn write_out(
    bytes: &[u8],
    nul: bool,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> Result<kvxfer_result, Fail> {
    if !out_len.is_null() {
        // SAFETY: non-null and valid per the contract.
        unsafe { *out_len = bytes.len() };
    }
    let need = bytes.len() + usize::from(nul);
    if buf.is_null() || cap < need {
        return Err(Fail::new(
            KVXFER_ERR_BUFFER_TOO_SMALL,
            format!("output needs {need} bytes, buffer has {cap}"),
        ));
    }
    // SAFETY: `buf` holds at least `need` bytes; the regions are distinct.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
        if nul {
            *buf.add(bytes.len()) = 0;
        }
    }
    Ok(KVXFER_OK)
}

// ---------------------------------------------------------------------------
// Library-wide.
// ---------------------------------------------------------------------------

/// The library version, a static NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn kvxfer_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The name of a result code (e.g. `"KVXFER_ERR_UNKNOWN_AGENT"`), a static
/// NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn kvxfer_result_name(code: kvxfer_result) -> *const c_char {
    macro_rules! names {
        ($($v:ident),*) => {
            match code { $( $v => concat!(stringify!($v), "\0"), )* }
        };
    }
    let s: &'static str = names!(
        KVXFER_OK,
        KVXFER_IN_PROGRESS,
        KVXFER_ERR_NULL_ARGUMENT,
        KVXFER_ERR_INVALID_HANDLE,
        KVXFER_ERR_INVALID_ARGUMENT,
        KVXFER_ERR_BUFFER_TOO_SMALL,
        KVXFER_ERR_INVALID_DESCRIPTOR,
        KVXFER_ERR_OVERLAP,
        KVXFER_ERR_UNSUPPORTED_MEMORY_TYPE,
        KVXFER_ERR_NOT_REGISTERED,
        KVXFER_ERR_REGION_BUSY,
        KVXFER_ERR_UNKNOWN_AGENT,
        KVXFER_ERR_REMOTE_RANGE,
        KVXFER_ERR_INVALID_AGENT_DESC,
        KVXFER_ERR_BACKEND_UNAVAILABLE,
        KVXFER_ERR_REMOTE_REJECTED,
        KVXFER_ERR_STALE_AGENT,
        KVXFER_ERR_PROTOCOL,
        KVXFER_ERR_CONNECTION_LOST,
        KVXFER_ERR_CONNECT,
        KVXFER_ERR_PEER_TIMEOUT,
        KVXFER_ERR_TIMEOUT,
        KVXFER_ERR_CLOSED,
        KVXFER_ERR_IO,
        KVXFER_ERR_RDMA,
        KVXFER_ERR_AUTH,
        KVXFER_ERR_WOULD_BLOCK,
        KVXFER_ERR_CANCELLED,
        KVXFER_ERR_ABORTED,
        KVXFER_ERR_TRANSPORT_REQUIRED,
        KVXFER_ERR_PEER_GONE,
        KVXFER_ERR_METADATA_STORE,
        KVXFER_ERR_NAME_TAKEN,
        KVXFER_ERR_GPU,
        KVXFER_ERR_UNSETTLED,
        KVXFER_ERR_INTEGRITY,
        KVXFER_ERR_INTEGRITY_UNSUPPORTED,
        KVXFER_ERR_OBJECT_STORE,
        KVXFER_ERR_PANIC
    );
    s.as_ptr().cast()
}

/// Copies the message of the last failed call on this thread into `buf`
/// (NUL-terminated, truncated to `cap - 1` bytes) and returns its full
/// length. `buf` may be NULL when `cap` is 0, to ask for the length.
///
/// # Safety
/// `buf` is valid for `cap` writes when `cap > 0`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_last_error(buf: *mut c_char, cap: usize) -> usize {
    LAST_ERROR.with(|l| {
        let l = l.borrow();
        let bytes = l.as_bytes();
        if !buf.is_null() && cap > 0 {
            let n = bytes.len().min(cap - 1);
            // SAFETY: `buf` holds `cap > n` bytes per the contract.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        bytes.len()
    })
}
