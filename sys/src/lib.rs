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
#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

mod cache;
mod pool;
mod storage;
pub use cache::*;
pub use pool::*;
pub use storage::*;

use kvxfer_core::{
    AgentConfig, Backend, CompletionQueue, Error, MemoryDesc, MemoryDescs, MemoryType,
    TransferAgent, TransferRequest, TransferState, TransferStatus,
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

// ---------------------------------------------------------------------------
// Agents.
// ---------------------------------------------------------------------------

/// Creates an agent called `name` on `backend` (`"auto"`, `"tcp"`, `"shm"`,
/// `"rdma"`, `"fabric"`, or `"inproc"`: agents of this process only, each transfer a
/// copy done before `kvxfer_submit` returns),
/// with optional settings (`options` may be NULL).
///
/// # Safety
/// Strings are NUL-terminated; `options` is NULL or points at
/// `options->struct_size` readable bytes; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_new(
    name: *const c_char,
    backend: *const c_char,
    options: *const kvxfer_options,
    out: *mut *mut kvxfer_agent,
) -> kvxfer_result {
    boundary(|| {
        non_null(out, "out")?;
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { text(name, "name")? };
        // SAFETY: as above.
        let backend: Backend = unsafe { text(backend, "backend")? }.parse()?;
        let mut cfg = AgentConfig::new(name);
        if !options.is_null() {
            // SAFETY: non-null; the caller's struct holds `struct_size` bytes,
            // and we read only fields that fit in it.
            let size = unsafe { (*options).struct_size };
            let has = |end: usize| size >= end;
            let o = options;
            macro_rules! field {
                ($f:ident: $t:ty) => {{
                    let end = std::mem::offset_of!(kvxfer_options, $f) + std::mem::size_of::<$t>();
                    if has(end) {
                        // SAFETY: the field lies within the `struct_size`
                        // bytes the caller provides; no reference to the
                        // (possibly shorter) struct is formed.
                        Some(unsafe { std::ptr::addr_of!((*o).$f).read_unaligned() })
                    } else {
                        None
                    }
                }};
            }
            if let Some(p) = field!(listen: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                let s = unsafe { text(p, "options.listen")? };
                cfg = cfg.with_listen(s.parse().map_err(|e| {
                    Fail::new(
                        KVXFER_ERR_INVALID_ARGUMENT,
                        format!("options.listen {s:?}: {e}"),
                    )
                })?);
            }
            if let Some(p) = field!(advertise: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                cfg = cfg.with_advertise(unsafe { text(p, "options.advertise")? });
            }
            if let Some(n) = field!(streams_per_peer: u32).filter(|&n| n > 0) {
                cfg = cfg.with_streams_per_peer(n as usize);
            }
            if let Some(ms) = field!(io_timeout_ms: u32).filter(|&n| n > 0) {
                cfg = cfg.with_io_timeout(Duration::from_millis(ms.into()));
            }
            if let Some(ms) = field!(connect_timeout_ms: u32).filter(|&n| n > 0) {
                cfg = cfg.with_connect_timeout(Duration::from_millis(ms.into()));
            }
            if let Some(n) = field!(rdma_qps_per_peer: u32).filter(|&n| n > 0) {
                cfg = cfg.with_rdma_qps_per_peer(n as usize);
            }
            if let Some(n) = field!(rdma_ack_timeout: u32).filter(|&n| n > 0) {
                // Out of range (including > 255): the agent's validation
                // names the field.
                cfg = cfg.with_rdma_ack_timeout(u8::try_from(n).unwrap_or(u8::MAX));
            }
            if let Some(n) = field!(rdma_no_shared_receive_queue: u32) {
                cfg = cfg.with_rdma_srq(n == 0);
            }
            if let Some(p) = field!(secret_file: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                let path = unsafe { text(p, "options.secret_file")? };
                cfg = cfg.with_credential(
                    kvxfer_core::Credential::from_file(path).map_err(Error::from)?,
                );
            }
            if let Some(n) = field!(insecure: u32) {
                cfg = cfg.with_insecure(n != 0);
            }
            if let Some(p) = field!(require_dram_transport: *const c_char).filter(|p| !p.is_null())
            {
                // SAFETY: NUL-terminated per the contract.
                let t = unsafe { text(p, "options.require_dram_transport")? };
                let kind: kvxfer_core::TransportKind =
                    t.parse().map_err(kvxfer_core::Error::from)?;
                cfg = cfg.with_required_transport(MemoryType::Dram, kind);
            }
            if let Some(p) = field!(etcd_endpoints: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                let eps = unsafe { text(p, "options.etcd_endpoints")? };
                let mut etcd = kvxfer_core::EtcdConfig::new(eps.split(',').map(str::trim));
                if let Some(p) = field!(etcd_prefix: *const c_char).filter(|p| !p.is_null()) {
                    // SAFETY: NUL-terminated per the contract.
                    etcd = etcd.with_prefix(unsafe { text(p, "options.etcd_prefix")? });
                }
                if let Some(s) = field!(etcd_lease_ttl_s: u32).filter(|&s| s > 0) {
                    etcd = etcd.with_lease_ttl(Duration::from_secs(s.into()));
                }
                if let Some(p) = field!(etcd_ca_file: *const c_char).filter(|p| !p.is_null()) {
                    // SAFETY: NUL-terminated per the contract.
                    let mut tls =
                        kvxfer_core::EtcdTls::new(unsafe { text(p, "options.etcd_ca_file")? });
                    let cert = field!(etcd_cert_file: *const c_char).filter(|p| !p.is_null());
                    let key = field!(etcd_key_file: *const c_char).filter(|p| !p.is_null());
                    if let (Some(c), Some(k)) = (cert, key) {
                        // SAFETY: NUL-terminated per the contract.
                        let (c, k) = unsafe {
                            (
                                text(c, "options.etcd_cert_file")?,
                                text(k, "options.etcd_key_file")?,
                            )
                        };
                        tls = tls.with_client_cert(c, k);
                    }
                    etcd = etcd.with_tls(tls);
                }
                cfg = cfg.with_etcd(etcd);
            }
        }
        let agent = kvxfer_core::make_transfer_agent(backend, cfg)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe {
            hand_out(
                out,
                Box::new(kvxfer_agent {
                    agent: agent.into(),
                    stores: Default::default(),
                }),
                Kind::Agent,
            )
        }
    })
}

/// Destroys an agent: closes its connections, fails its transfers in
/// flight, joins its threads. NULL is a no-op.
///
/// # Safety
/// No other call on `agent` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_free(agent: *mut kvxfer_agent) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(agent, Kind::Agent, "agent") })
}

/// Registers `count` descriptors of type `mem_type` (all or none).
///
/// # Safety
/// `descs` is valid for `count` reads. Every range must stay allocated
/// while registered, and not be accessed by the caller while a transfer
/// that names it is in flight.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_register_memory(
    agent: *const kvxfer_agent,
    mem_type: kvxfer_mem_type,
    descs: *const kvxfer_mem_desc,
    count: usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: `descs` is valid for `count` reads.
        let d = unsafe { self::descs(mem_type, descs, count, "descs")? };
        // SAFETY: the caller upholds the registration contract above.
        unsafe { a.agent.register_memory(&d)? };
        Ok(KVXFER_OK)
    })
}

/// Deregisters descriptors, each exactly as registered (all or none).
///
/// # Safety
/// `descs` is valid for `count` reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_deregister_memory(
    agent: *const kvxfer_agent,
    mem_type: kvxfer_mem_type,
    descs: *const kvxfer_mem_desc,
    count: usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: `descs` is valid for `count` reads.
        let d = unsafe { self::descs(mem_type, descs, count, "descs")? };
        a.agent.deregister_memory(&d)?;
        Ok(KVXFER_OK)
    })
}

/// Writes the encoded local agent descriptor into `buf` and its length to
/// `out_len` (also when the buffer is too small: call with `cap = 0` to
/// learn the size).
///
/// # Safety
/// `buf` is valid for `cap` writes (or NULL); `out_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_local_desc(
    agent: *const kvxfer_agent,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        let bytes = a.agent.local_agent_desc().encode();
        // SAFETY: forwarded contract.
        unsafe { write_out(&bytes, false, buf, cap, out_len) }
    })
}

/// Loads a remote agent from an encoded descriptor; writes its name
/// (NUL-terminated) to `name_buf` when that is non-NULL. When `name_buf`
/// is too small nothing is loaded: the call returns
/// `KVXFER_ERR_BUFFER_TOO_SMALL` with the name's length in `name_len`.
///
/// # Safety
/// `desc` is valid for `len` reads; `name_buf` is NULL or valid for
/// `name_cap` writes; `name_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_load_remote(
    agent: *const kvxfer_agent,
    desc: *const u8,
    len: usize,
    name_buf: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: `desc` is valid for `len` reads.
        let bytes = unsafe { slice(desc, len, "desc")? };
        let d = kvxfer_core::AgentDesc::decode(bytes).map_err(Error::from)?;
        name_fits(&d.name, name_buf, name_cap, name_len)?;
        a.agent.load_remote_agent(&d)?;
        // SAFETY: forwarded contract.
        unsafe { name_out(&d.name, name_buf, name_cap, name_len) }
    })
}

/// Finds the agent `name` in the metadata store (`options.etcd_endpoints`
/// or `KVXFER_ETCD`), fetches its descriptor from it and loads it; watched
/// from then on (its requests fail with `KVXFER_ERR_PEER_GONE` once it
/// leaves the store, and it is resolved again on the next request).
///
/// # Safety
/// `name` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_load_remote_by_name(
    agent: *const kvxfer_agent,
    name: *const c_char,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { text(name, "name")? };
        a.agent.load_remote_agent_by_name(name)?;
        Ok(KVXFER_OK)
    })
}

/// Fails with `KVXFER_ERR_BUFFER_TOO_SMALL` (the length in `len`) when
/// `name` and its NUL do not fit a non-NULL `buf` of `cap` bytes: checked
/// before anything is done, so a too-small buffer changes nothing.
fn name_fits(name: &str, buf: *mut c_char, cap: usize, len: *mut usize) -> Result<(), Fail> {
    if buf.is_null() || cap > name.len() {
        return Ok(());
    }
    if !len.is_null() {
        // SAFETY: non-null and valid per the callers' contract.
        unsafe { *len = name.len() };
    }
    Err(Fail::new(
        KVXFER_ERR_BUFFER_TOO_SMALL,
        format!(
            "the name needs {} bytes, buffer has {cap}; nothing was loaded",
            name.len() + 1
        ),
    ))
}

/// Writes the agent name an encoded descriptor carries (NUL-terminated),
/// without loading it.
///
/// # Safety
/// `desc` is valid for `len` reads; `name_buf` is NULL or valid for
/// `name_cap` writes; `name_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_desc_name(
    desc: *const u8,
    len: usize,
    name_buf: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: `desc` is valid for `len` reads.
        let bytes = unsafe { slice(desc, len, "desc")? };
        let d = kvxfer_core::AgentDesc::decode(bytes).map_err(Error::from)?;
        // SAFETY: forwarded contract.
        unsafe { name_out(&d.name, name_buf, name_cap, name_len) }
    })
}

/// Fetches a remote agent's encoded descriptor from its connection info
/// (`host:port`) without loading it; `kvxfer_agent_load_remote` loads it.
/// Writes the needed length to `out_len` (with `KVXFER_ERR_BUFFER_TOO_SMALL`
/// when `buf` is NULL or smaller).
///
/// # Safety
/// `connection_info` is NUL-terminated; `buf` is NULL or valid for `cap`
/// writes; `out_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_fetch_remote_desc(
    agent: *const kvxfer_agent,
    connection_info: *const c_char,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let info = unsafe { text(connection_info, "connection_info")? };
        let d = a.agent.fetch_remote_agent_desc(info)?;
        // SAFETY: forwarded contract.
        unsafe { write_out(&d.encode(), false, buf, cap, out_len) }
    })
}

/// # Safety
/// As `write_out`; a NULL `buf` means "not wanted".
unsafe fn name_out(
    name: &str,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> Result<kvxfer_result, Fail> {
    if buf.is_null() {
        if !len.is_null() {
            // SAFETY: non-null and valid per the contract.
            unsafe { *len = name.len() };
        }
        return Ok(KVXFER_OK);
    }
    // SAFETY: forwarded contract.
    unsafe { write_out(name.as_bytes(), true, buf.cast(), cap, len) }
}

/// Fetches a remote agent's descriptor from its connection info
/// (`host:port`) and loads it; writes its name as `kvxfer_agent_load_remote`
/// (a too-small `name_buf` loads nothing).
///
/// # Safety
/// As `kvxfer_agent_load_remote`; `connection_info` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_load_remote_by_connection(
    agent: *const kvxfer_agent,
    connection_info: *const c_char,
    name_buf: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let info = unsafe { text(connection_info, "connection_info")? };
        let d = a.agent.fetch_remote_agent_desc(info)?;
        name_fits(&d.name, name_buf, name_cap, name_len)?;
        a.agent.load_remote_agent(&d)?;
        // SAFETY: forwarded contract.
        unsafe { name_out(&d.name, name_buf, name_cap, name_len) }
    })
}

/// Forgets a remote agent; its transfers in flight fail.
///
/// # Safety
/// `name` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_invalidate_remote(
    agent: *const kvxfer_agent,
    name: *const c_char,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { text(name, "name")? };
        a.agent.invalidate_remote_agent(name)?;
        Ok(KVXFER_OK)
    })
}

/// Writes the agent's connection info (`host:port`, NUL-terminated).
///
/// # Safety
/// `buf` is valid for `cap` writes (or NULL); `out_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_connection_info(
    agent: *const kvxfer_agent,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        let info = a.agent.local_connection_info();
        // SAFETY: forwarded contract.
        unsafe { write_out(info.as_bytes(), true, buf.cast(), cap, out_len) }
    })
}

/// Validates and submits a transfer; on success `*out` is a status handle
/// to free with `kvxfer_status_free`.
///
/// # Safety
/// `request` and the arrays and strings it points to are valid for the call
/// (the library copies what it keeps); `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_submit(
    agent: *const kvxfer_agent,
    request: *const kvxfer_request,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    // SAFETY: forwarded contract.
    unsafe { kvxfer_agent_submit_flags(agent, request, 0, out) }
}

/// `kvxfer_agent_submit` with `flags` (`KVXFER_SUBMIT_*`, or-ed; 0 is
/// `kvxfer_agent_submit`).
///
/// # Safety
/// As `kvxfer_agent_submit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_submit_flags(
    agent: *const kvxfer_agent,
    request: *const kvxfer_request,
    flags: kvxfer_submit_flags,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(request, "request")?;
        non_null(out, "out")?;
        if flags & !(KVXFER_SUBMIT_DURABLE | KVXFER_SUBMIT_INTEGRITY) != 0 {
            return Err(Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("unknown submit flags {flags:#x}"),
            ));
        }
        // SAFETY: non-null and valid per the contract.
        let mut req = unsafe { request_from(&*request)? };
        req.durable = flags & KVXFER_SUBMIT_DURABLE != 0;
        req.integrity = flags & KVXFER_SUBMIT_INTEGRITY != 0;
        let status = a.agent.submit_transfer(&req)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_status { status }), Kind::Status) }
    })
}

/// The Rust request a C request describes.
///
/// # Safety
/// As `kvxfer_agent_submit`'s `request`.
unsafe fn request_from(r: &kvxfer_request) -> Result<TransferRequest, Fail> {
    // SAFETY: the arrays are valid for their counts.
    let local = unsafe { descs(r.local_type, r.local, r.local_count, "request.local")? };
    // SAFETY: as above.
    let remote = unsafe { descs(r.remote_type, r.remote, r.remote_count, "request.remote")? };
    // SAFETY: NUL-terminated per the contract.
    let name = unsafe { text(r.remote_agent, "request.remote_agent")? };
    let mut req = match r.op {
        KVXFER_OP_WRITE => TransferRequest::write(local, remote, name),
        KVXFER_OP_READ => TransferRequest::read(local, remote, name),
        other => {
            return Err(Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("unknown operation {other}"),
            ));
        }
    };
    if !r.sync_message.is_null() {
        // SAFETY: valid for `sync_message_len` reads.
        let m = unsafe { slice(r.sync_message, r.sync_message_len, "request.sync_message")? };
        req = req.with_sync_message(m.to_vec());
    }
    Ok(req)
}

/// Resolves a request once for repeated submission: checked now (local
/// registration, remote agent and exported range), its local regions held
/// until `kvxfer_prepared_free`.
///
/// # Safety
/// As `kvxfer_agent_submit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_prepare(
    agent: *const kvxfer_agent,
    request: *const kvxfer_request,
    out: *mut *mut kvxfer_prepared,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(request, "request")?;
        non_null(out, "out")?;
        // SAFETY: non-null and valid per the contract.
        let req = unsafe { request_from(&*request)? };
        let prepared = a.agent.prepare_transfer(&req)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_prepared { prepared }), Kind::Prepared) }
    })
}

/// Submits a prepared transfer (of this agent) once more; `out` receives
/// its status as `kvxfer_agent_submit`'s.
///
/// # Safety
/// `prepared` is a handle from `kvxfer_agent_prepare` (checked); `out` is
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_submit_prepared(
    agent: *const kvxfer_agent,
    prepared: *const kvxfer_prepared,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: checked against the handle table.
        let p = unsafe { live(prepared, Kind::Prepared, "prepared")? };
        non_null(out, "out")?;
        let status = a.agent.submit_prepared(&p.prepared)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_status { status }), Kind::Status) }
    })
}

/// Frees a prepared transfer, releasing its hold on the local regions
/// (statuses of its submissions stay valid). NULL is a no-op.
///
/// # Safety
/// `prepared` is NULL or a handle from `kvxfer_agent_prepare` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_prepared_free(prepared: *mut kvxfer_prepared) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(prepared, Kind::Prepared, "prepared") })
}

/// Sends a sync message not tied to a transfer, ordered after the data of
/// every transfer submitted earlier to `remote`. `out` may be NULL (fire and
/// forget); otherwise it receives a status that completes on delivery.
///
/// # Safety
/// `remote` is NUL-terminated; `msg` is valid for `len` reads; `out` is NULL
/// or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_notify(
    agent: *const kvxfer_agent,
    remote: *const c_char,
    msg: *const u8,
    len: usize,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let remote = unsafe { text(remote, "remote")? };
        // SAFETY: valid for `len` reads.
        let m = unsafe { slice(msg, len, "msg")? }.to_vec();
        let status = a.agent.notify_sync_message(remote, m)?;
        if !out.is_null() {
            let p = issue(Box::new(kvxfer_status { status }), Kind::Status);
            // SAFETY: non-null and valid for a write.
            unsafe { *out = p };
        }
        Ok(KVXFER_OK)
    })
}

fn messages_handle(m: kvxfer_core::SyncMessages) -> *mut kvxfer_messages {
    let mut groups: Vec<_> = m.into_iter().collect();
    groups.sort_by(|a, b| a.0.cmp(&b.0));
    let items = groups
        .into_iter()
        .flat_map(|(from, msgs)| {
            let from = CString::new(from).unwrap_or_default();
            msgs.into_iter().map(move |m| (from.clone(), m))
        })
        .collect();
    issue(Box::new(kvxfer_messages { items }), Kind::Messages)
}

/// Takes every sync message received so far (possibly none) as a batch:
/// grouped by sending agent (agents in name order), each group in arrival
/// order.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_take_messages(
    agent: *const kvxfer_agent,
    out: *mut *mut kvxfer_messages,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(out, "out")?;
        let h = messages_handle(a.agent.take_sync_messages());
        // SAFETY: non-null and valid for a write.
        unsafe { *out = h };
        Ok(KVXFER_OK)
    })
}

/// As `kvxfer_agent_take_messages`, first waiting up to `timeout_ms` for at
/// least one message (a negative value: until one arrives, or
/// `kvxfer_agent_wake_waiters` is called). Timeouts are `int64_t`
/// milliseconds throughout the API.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_wait_messages(
    agent: *const kvxfer_agent,
    timeout_ms: i64,
    out: *mut *mut kvxfer_messages,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(out, "out")?;
        let timeout = u64::try_from(timeout_ms).map_or(Duration::MAX, Duration::from_millis);
        let m = a.agent.wait_sync_messages(timeout);
        let h = messages_handle(m);
        // SAFETY: non-null and valid for a write.
        unsafe { *out = h };
        Ok(KVXFER_OK)
    })
}

/// Makes every thread now blocked in `kvxfer_agent_wait_messages` on this
/// agent return at once, with what has arrived (possibly nothing); a wait
/// that starts later is not affected. For an event loop that sleeps in
/// `kvxfer_agent_wait_messages` and also takes work from other threads:
/// they call this after queueing work. Thread-safe; `KVXFER_OK` or
/// `KVXFER_ERR_NULL_ARGUMENT` / `KVXFER_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `agent` is a handle from `kvxfer_agent_new` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_wake_waiters(agent: *const kvxfer_agent) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        a.agent.wake_sync_waiters();
        Ok(KVXFER_OK)
    })
}

/// Whether every descriptor lies in a region `remote` exported (false for
/// an unknown agent), written to `*out`.
///
/// # Safety
/// `remote` is NUL-terminated; `descs` is valid for `count` reads; `out` is
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_check_remote_descs(
    agent: *const kvxfer_agent,
    remote: *const c_char,
    mem_type: kvxfer_mem_type,
    descs: *const kvxfer_mem_desc,
    count: usize,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(out, "out")?;
        // SAFETY: NUL-terminated per the contract.
        let remote = unsafe { text(remote, "remote")? };
        // SAFETY: valid for `count` reads.
        let d = unsafe { self::descs(mem_type, descs, count, "descs")? };
        let ok = a.agent.check_remote_descs(remote, &d);
        // SAFETY: non-null and valid for a write.
        unsafe { *out = ok };
        Ok(KVXFER_OK)
    })
}

// ---------------------------------------------------------------------------
// Statuses.
// ---------------------------------------------------------------------------

/// Writes whether the transfer has finished (successfully or not).
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_is_completed(
    status: *const kvxfer_status,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = s.status.is_completed() };
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (a negative value: until the transfer ends,
/// which the agent's I/O timeout bounds). Returns `KVXFER_OK` on success,
/// `KVXFER_IN_PROGRESS` if still running, or the transfer's error code
/// (message in `kvxfer_last_error`). May be called again after any result.
///
/// # Safety
/// None beyond a valid or NULL handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_wait(
    status: *const kvxfer_status,
    timeout_ms: i64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let state = if timeout_ms < 0 {
            loop {
                if let TransferState::Completed = s.status.wait(Duration::from_secs(3600))? {
                    break TransferState::Completed;
                }
            }
        } else {
            s.status.wait(Duration::from_millis(timeout_ms as u64))?
        };
        Ok(match state {
            TransferState::Completed => KVXFER_OK,
            TransferState::InProgress => KVXFER_IN_PROGRESS,
        })
    })
}

/// Writes whether the transfer finished and no byte of it can land any
/// more, in either agent's memory: false while it runs, and after a
/// failure that broke the connection (`KVXFER_ERR_PEER_TIMEOUT`,
/// `KVXFER_ERR_CONNECTION_LOST`, ...) until `kvxfer_status_wait_settled`
/// proved it. Until then, treat a WRITE's destination as still being
/// written.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_is_settled(
    status: *const kvxfer_status,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = s.status.is_settled() };
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (at least 0) in all for the transfer to finish
/// and for proof that no byte of it can land any more: after a failure
/// that broke the connection, the target is asked to end the broken
/// link's streams. Returns `KVXFER_OK` once settled, whatever the
/// transfer's outcome; `KVXFER_ERR_TIMEOUT` when the transfer or the
/// target's answer did not come in time (a stopped target);
/// `KVXFER_ERR_UNSETTLED` on libfabric while the target still runs; the
/// error of reaching the target otherwise. May be called again.
///
/// # Safety
/// None beyond a valid or NULL handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_wait_settled(
    status: *const kvxfer_status,
    timeout_ms: i64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let timeout = u64::try_from(timeout_ms)
            .map_err(|_| Error::InvalidRequest("timeout_ms must be at least 0".into()))?;
        s.status.wait_settled(Duration::from_millis(timeout))?;
        Ok(KVXFER_OK)
    })
}

/// Asks for the transfer to be aborted and writes whether it was still
/// running (`*out`: true; false when it had already finished, its outcome
/// standing). Does not block: nothing more of the request is sent, its
/// sync message is not delivered, READ data still arriving is dropped;
/// `kvxfer_status_wait` then returns `KVXFER_ERR_ABORTED` once what was
/// already sent is done, after which no byte of the transfer changes in
/// either agent's memory (or `KVXFER_OK`, when everything had been sent
/// before the abort).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_abort(
    status: *const kvxfer_status,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let running = s.status.abort();
        if !out.is_null() {
            // SAFETY: non-null and valid for a write (contract).
            unsafe { *out = running };
        }
        Ok(KVXFER_OK)
    })
}

/// Writes the transport that carries (or carried) the transfer: a static
/// NUL-terminated `"tcp"`, `"shm"`, `"rdma"`, `"fabric"` or `"inproc"`.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_transport(
    status: *const kvxfer_status,
    out: *mut *const c_char,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        let name: &'static CStr = match s.status.data_path().transport {
            kvxfer_core::TransportKind::Tcp => c"tcp",
            kvxfer_core::TransportKind::Shm => c"shm",
            kvxfer_core::TransportKind::Rdma => c"rdma",
            kvxfer_core::TransportKind::Fabric => c"fabric",
            kvxfer_core::TransportKind::InProcess => c"inproc",
            kvxfer_core::TransportKind::Storage => c"storage",
            // The enum is non-exhaustive: one this library does not know yet.
            _ => c"unknown",
        };
        // SAFETY: non-null and valid for a write.
        unsafe { *out = name.as_ptr() };
        Ok(KVXFER_OK)
    })
}

/// Writes the request id (unique per agent).
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_id(
    status: *const kvxfer_status,
    out: *mut u64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = s.status.id() };
        Ok(KVXFER_OK)
    })
}

/// The outcome code of a finished transfer.
fn outcome_code(outcome: Result<(), Error>) -> kvxfer_result {
    match outcome {
        Ok(()) => KVXFER_OK,
        Err(e) => Fail::from(e).code,
    }
}

/// Calls `callback(user_data, outcome)` once when the transfer finishes
/// (at once when it already has), on the process's callback thread, never
/// on a thread of the library: one that blocks holds up the callbacks
/// after it, not the transfers. Keep it short (post to an event loop,
/// write to a pipe, signal a condition). The status handle may be freed
/// before it runs.
///
/// # Safety
/// `callback` is safe to call from any thread with `user_data`, which must
/// stay valid until it has run.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_on_complete(
    status: *const kvxfer_status,
    callback: kvxfer_complete_fn,
    user_data: *mut c_void,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let Some(cb) = callback else {
            return Err(Fail::new(KVXFER_ERR_NULL_ARGUMENT, "callback is NULL"));
        };
        // Carried as an integer: the caller vouches for it on any thread.
        let data = user_data as usize;
        s.status.on_complete(move |outcome| {
            let code = outcome_code(outcome);
            // A panic (or unwinding callback) must not cross into the
            // completing thread's caller.
            let _ = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the caller's contract: `cb` may be called from
                // any thread with `user_data`, still valid.
                unsafe { cb(data as *mut c_void, code) }
            }));
        });
        Ok(KVXFER_OK)
    })
}

/// Makes an empty completion queue.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_new(out: *mut *mut kvxfer_cq) -> kvxfer_result {
    boundary(|| {
        non_null(out, "out")?;
        let cq = CompletionQueue::new()?;
        // SAFETY: non-null and valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_cq { cq }), Kind::Cq) }
    })
}

/// Reports `status`'s outcome on `cq`, with `token`, once it finishes (at
/// once when it has). The status handle may be freed meanwhile.
///
/// # Safety
/// None beyond valid or NULL handles.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_watch(
    cq: *const kvxfer_cq,
    status: *const kvxfer_status,
    token: u64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let q = unsafe { live(cq, Kind::Cq, "cq")? };
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        q.cq.watch(&s.status, token);
        Ok(KVXFER_OK)
    })
}

/// Writes the queue's file descriptor: readable (`POLLIN`) while an
/// outcome is ready. Owned by the queue: poll it, never read or close it.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_fd(cq: *const kvxfer_cq, out: *mut i32) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let q = unsafe { live(cq, Kind::Cq, "cq")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = std::os::fd::AsRawFd::as_raw_fd(&q.cq) };
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (0: do not wait; negative: an hour) for at
/// least one outcome, then writes up to `cap` of them to `out` and their
/// number to `*count` (0 on timeout); the rest stay ready.
///
/// # Safety
/// `out` is valid for `cap` writes; `count` for one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_wait(
    cq: *const kvxfer_cq,
    timeout_ms: i64,
    out: *mut kvxfer_completion,
    cap: usize,
    count: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let q = unsafe { live(cq, Kind::Cq, "cq")? };
        non_null(count, "count")?;
        if cap > 0 {
            non_null(out, "out")?;
        }
        let timeout = if timeout_ms < 0 {
            Duration::from_secs(3600)
        } else {
            Duration::from_millis(timeout_ms as u64)
        };
        let got = q.cq.wait_max(timeout, cap);
        for (i, (token, outcome)) in got.iter().enumerate() {
            let c = kvxfer_completion {
                token: *token,
                outcome: outcome_code(outcome.clone()),
            };
            // SAFETY: `i < got.len() <= cap`: inside the caller's array.
            unsafe { *out.add(i) = c };
        }
        // SAFETY: non-null and valid for a write.
        unsafe { *count = got.len() };
        Ok(KVXFER_OK)
    })
}

/// Frees a completion queue handle (outcomes of transfers it still
/// watches are dropped as they come). NULL is a no-op.
///
/// # Safety
/// No other call on `cq` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_free(cq: *mut kvxfer_cq) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(cq, Kind::Cq, "cq") })
}

/// Frees a status handle (does not cancel the transfer). NULL is a no-op.
///
/// # Safety
/// No other call on `status` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_free(status: *mut kvxfer_status) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(status, Kind::Status, "status") })
}

// ---------------------------------------------------------------------------
// Message batches.
// ---------------------------------------------------------------------------

/// Writes the number of messages in the batch.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_messages_count(
    messages: *const kvxfer_messages,
    out: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let m = unsafe { live(messages, Kind::Messages, "messages")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = m.items.len() };
        Ok(KVXFER_OK)
    })
}

/// Message `index`: the sending agent's name (NUL-terminated) and the
/// bytes. The pointers stay valid until the batch is freed.
///
/// # Safety
/// The output pointers are valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_messages_get(
    messages: *const kvxfer_messages,
    index: usize,
    agent_name: *mut *const c_char,
    data: *mut *const u8,
    len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let m = unsafe { live(messages, Kind::Messages, "messages")? };
        non_null(agent_name, "agent_name")?;
        non_null(data, "data")?;
        non_null(len, "len")?;
        let (from, bytes) = m.items.get(index).ok_or_else(|| {
            Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("index {index} out of range ({} messages)", m.items.len()),
            )
        })?;
        // SAFETY: all three are non-null and valid for a write.
        unsafe {
            *agent_name = from.as_ptr();
            *data = bytes.as_ptr();
            *len = bytes.len();
        }
        Ok(KVXFER_OK)
    })
}

/// Frees a message batch. NULL is a no-op.
///
/// # Safety
/// No other call on `messages` may run concurrently or follow, and pointers
/// obtained from it are no longer used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_messages_free(messages: *mut kvxfer_messages) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(messages, Kind::Messages, "messages") })
}
