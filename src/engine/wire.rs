//! TCP framing: a fixed 40-byte little-endian header per frame, optionally
//! followed by a body (`aux` bytes of control data, or `len` bytes of
//! payload). Pure encode/decode; no I/O. Layout in `docs/wire-format.md`.

#![forbid(unsafe_code)]

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::memory::MemoryType;
use crate::proto::TransportKind;

/// Size of every frame header.
pub const HEADER_LEN: usize = 40;
/// Protocol version carried in `Hello`.
pub const PROTOCOL_VERSION: u16 = 7;

/// Longest transport name an `Attach` frame carries.
pub const ATTACH_NAME_MAX: u8 = 32;
/// Longest transport message an `Attach` or `Attached` frame carries.
pub const ATTACH_MAX: u32 = 4096;
/// Largest control body (agent name, sync message, descriptor) accepted.
pub const MAX_CONTROL_BODY: u32 = 16 << 20;

/// The flags of `AuthHello` / `AuthChallenge`: bit 0 keyed, bit 1
/// encrypt.
fn auth_flags(keyed: bool, encrypt: bool) -> u8 {
    u8::from(keyed) | u8::from(encrypt) << 1
}

/// The raw header, as it sits on the wire.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct RawHeader {
    kind: u8,
    flags: u8,
    status: U16,
    aux: U32,
    id: U64,
    addr: U64,
    len: U64,
    key: U64,
}

const _: () = assert!(std::mem::size_of::<RawHeader>() == HEADER_LEN);

/// Status codes carried in `HelloAck`, `ReadData` and `Ack`.
pub mod status {
    /// Success.
    pub const OK: u16 = 0;
    // 1..=9 and 18..=21 are `RejectReason` codes (see `crate::proto::RejectReason`).
    /// Hello: the target is not the instance the initiator expected.
    pub const STALE_INSTANCE: u16 = 10;
    /// Hello: protocol version not supported.
    pub const BAD_VERSION: u16 = 11;
    /// Attach: the target does not offer that transport (an RDMA link to
    /// a target without a device).
    pub const NO_TRANSPORT: u16 = 12;
    /// Attach: the target's transport failed to set its side up (RDMA:
    /// creating or connecting its queue pair).
    pub const ATTACH_FAILED: u16 = 13;
    /// Cross-memory `Delegate`: the target does not copy for this
    /// initiator (it declines delegated copies, or cannot reach the
    /// initiator's memory); the initiator copies itself and commits.
    pub const DELEGATE_REFUSED: u16 = 14;
    /// Cross-memory `Delegate`: the target's copy failed part-way.
    pub const DELEGATE_FAILED: u16 = 15;
    /// AuthChallenge: the target requires a cluster credential and the
    /// initiator has none.
    pub const AUTH_REQUIRED: u16 = 16;
    /// AuthResult: the initiator's proof did not check out.
    pub const AUTH_FAILED: u16 = 17;
    /// Settled: the session's streams had not all ended within the
    /// target's I/O timeout (a stream busy landing a frame); ask again.
    pub const STILL_LANDING: u16 = 22;
}

const K_HELLO: u8 = 1;
const K_HELLO_ACK: u8 = 2;
const K_DESC_REQUEST: u8 = 3;
const K_DESC_REPLY: u8 = 4;
const K_WRITE: u8 = 5;
const K_READ_REQ: u8 = 6;
const K_READ_DATA: u8 = 7;
const K_COMMIT: u8 = 8;
const K_ACK: u8 = 9;
const K_FENCE: u8 = 10;
// 11, 12 and 16 were the cross-memory frames before protocol version 5;
// they travel as `Transport` frames now.
const K_ATTACH: u8 = 13;
const K_ATTACHED: u8 = 14;
const K_WRITE_LIST: u8 = 15;
const K_AUTH_HELLO: u8 = 17;
const K_AUTH_CHALLENGE: u8 = 18;
const K_AUTH_PROOF: u8 = 19;
const K_AUTH_RESULT: u8 = 20;
const K_ABORT: u8 = 21;
const K_KEEPALIVE: u8 = 22;
const K_CLOSING: u8 = 23;
const K_TRANSPORT: u8 = 24;
const K_SETTLE: u8 = 25;
const K_SETTLED: u8 = 26;

/// Largest `AuthHello` / `AuthChallenge` body: nonce, MAC, longest name.
pub const MAX_AUTH_BODY: u32 =
    (crate::proto::NONCE_LEN + crate::proto::MAC_LEN + crate::desc::MAX_AGENT_NAME) as u32;

/// Longest host id a `DescRequest` carries.
pub const MAX_HOST_ID: u32 = 256;

/// Most pieces in one [`Frame::WriteList`].
pub const WRITE_LIST_MAX: u32 = 1024;
/// Bytes per entry of a write list's table: address and length, u64 LE.
pub const WRITE_LIST_ENTRY: usize = 16;

/// Direction of a committed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitOp {
    /// Data flowed initiator → target.
    Write,
    /// Data flowed target → initiator.
    Read,
}

/// A decoded frame header. Bodies are read separately: `aux` bytes for
/// `Hello`, `DescReply` and `Commit`, `len` bytes of payload for `Write`
/// and `ReadData`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// First frame of a data stream: who connects, and whom it expects.
    Hello {
        /// Initiator's instance id.
        instance: u64,
        /// Target instance expected (0: any).
        expect: u64,
        /// Protocol version.
        version: u16,
        /// Initiator-chosen id of the connection set this stream belongs to.
        link: u64,
        /// Index of this stream among the link's streams.
        stream: u32,
        /// Length of the agent name that follows.
        name_len: u32,
    },
    /// Answer to `Hello`.
    HelloAck {
        /// Target's instance id.
        instance: u64,
        /// `status::OK` or why the hello was refused.
        status: u16,
        /// A random ticket naming this connection's session at the target:
        /// an initiator on the same host presents it on the target's local
        /// socket to prove which process it is (delegated copies).
        ticket: u128,
        /// The target's I/O timeout in milliseconds (0: none): it closes
        /// a data stream on which no whole frame came for that long, and
        /// releases a request's grants that long after granting them. The
        /// initiator sends [`Frame::Keepalive`] on idle streams well within
        /// it, and ends its direct copies of a granted request before it.
        idle_ms: u32,
    },
    /// First frame of every connection: the initiator's nonce and agent
    /// name follow (`body_len` bytes: [`crate::proto::NONCE_LEN`] of nonce,
    /// then the name).
    AuthHello {
        /// Whether the initiator holds a cluster credential.
        keyed: bool,
        /// Whether the initiator asks for the connection to be encrypted
        /// (keyed only).
        encrypt: bool,
        /// Body length.
        body_len: u32,
    },
    /// The target's answer to `AuthHello`: when `status` is OK, its nonce,
    /// its MAC (keyed only) and its agent name follow (`body_len` bytes).
    AuthChallenge {
        /// `status::OK` or `status::AUTH_REQUIRED` (no body).
        status: u16,
        /// Whether the target holds a cluster credential (and a MAC
        /// follows its nonce).
        keyed: bool,
        /// Whether the connection is encrypted once the handshake has
        /// succeeded (keyed only).
        encrypt: bool,
        /// Body length.
        body_len: u32,
    },
    /// The initiator's MAC ([`crate::proto::MAC_LEN`] bytes follow).
    AuthProof,
    /// The target's verdict on `AuthProof`.
    AuthResult {
        /// `status::OK` or `status::AUTH_FAILED`.
        status: u16,
    },
    /// Asks for the target's encoded `AgentDesc`; a requester that could
    /// open CUDA IPC handles sends its host id (the body) to get them.
    DescRequest {
        /// Length of the requester's host id that follows (0: it asks for
        /// no GPU handles).
        host_len: u32,
    },
    /// The encoded descriptor follows (`body_len` bytes).
    DescReply {
        /// Body length.
        body_len: u32,
    },
    /// `len` payload bytes follow, to land at `addr` in the target's region
    /// keyed `key`.
    Write {
        /// Request id.
        req: u64,
        /// Memory type of the destination.
        mem_type: MemoryType,
        /// The storage handle (FILE and BLK regions; 0 for memory).
        device: u32,
        /// Destination address (storage: offset) at the target.
        addr: u64,
        /// Payload length.
        len: u64,
        /// Region access key.
        key: u64,
        /// End-to-end integrity: the header carries its seal ([`seal`]) and
        /// a CRC32C of the payload follows it ([`TRAILER_LEN`] bytes).
        checked: bool,
    },
    /// Asks the target to send `len` bytes from `addr`.
    ReadReq {
        /// Request id.
        req: u64,
        /// Memory type of the source.
        mem_type: MemoryType,
        /// The storage handle (FILE and BLK regions; 0 for memory).
        device: u32,
        /// Source address (storage: offset) at the target.
        addr: u64,
        /// Length.
        len: u64,
        /// Region access key.
        key: u64,
        /// End-to-end integrity: the answer carries a CRC32C of the bytes.
        checked: bool,
    },
    /// Reply to the next outstanding `ReadReq` of this stream; `len` payload
    /// bytes follow when `status` is OK.
    ReadData {
        /// Request id.
        req: u64,
        /// Payload length.
        len: u64,
        /// `status::OK` or a reject code.
        status: u16,
        /// A CRC32C of the payload follows it ([`TRAILER_LEN`] bytes;
        /// with `status::OK` only).
        checked: bool,
    },
    /// Closes a request: `segments` data frames were sent for it across all
    /// streams; a sync message of `sync_len` bytes follows.
    Commit {
        /// Request id.
        req: u64,
        /// Direction.
        op: CommitOp,
        /// Total data segments of the request, over every stream.
        segments: u64,
        /// Length of the sync message body (0: none).
        sync_len: u32,
        /// Whether a sync message is present (it may be empty).
        has_sync: bool,
        /// The target makes the request's storage writes durable
        /// (`fdatasync` of each file written) before it acknowledges.
        durable: bool,
        /// End-to-end integrity of a request whose data moved beside the
        /// stream (`segments` 0: the cross-memory path): a table of this
        /// many [`CHECK_ENTRY`]-byte entries follows the sync message, each
        /// a range of the target's memory and the CRC32C the initiator
        /// computed over its side of it, checked by the target before it
        /// finishes the request. At most [`MAX_CHECKS`].
        checks: u32,
        /// The CRC32C of the sync message, which the target checks before
        /// it delivers it (a mismatch refuses the request: status 21).
        /// Carried in `key` with bit 32 set; `None` (0) from a sender that
        /// computes none.
        sync_crc: Option<u32>,
    },
    /// `count` small WRITE segments in one frame: a table of `count`
    /// (address, length) pairs (16 bytes each, little-endian) follows, then
    /// their payloads back to back, `total` bytes, all to the region keyed
    /// `key`. The target lands them with one scatter read; they count as
    /// `count` segments.
    WriteList {
        /// Request id.
        req: u64,
        /// Memory type of the destinations.
        mem_type: MemoryType,
        /// Pieces (2 to [`WRITE_LIST_MAX`]).
        count: u32,
        /// Payload bytes in all.
        total: u64,
        /// Region access key.
        key: u64,
        /// End-to-end integrity: the header carries the seal of itself and
        /// the table ([`seal`]), and a CRC32C of the payloads, back to
        /// back, follows them ([`TRAILER_LEN`] bytes).
        checked: bool,
    },
    /// Counts as one segment of request `req` once everything sent before it
    /// on this stream has been processed: orders a data-less request after
    /// earlier requests' data on every stream.
    Fence {
        /// Request id.
        req: u64,
    },
    /// The initiator aborted request `req`: `segments` of its segments will
    /// not come (they count as arrived, refused); the request fails with
    /// `RejectReason::Aborted` once the rest and its commit are in, and
    /// its sync message is dropped.
    Abort {
        /// Request id.
        req: u64,
        /// Segments that will not be sent (0: none, the request still
        /// fails).
        segments: u64,
    },
    /// Initiator → target on a data stream that has been idle: keeps the
    /// target from closing it (see `HelloAck::idle_ms`).
    Keepalive,
    /// Target → initiator: the target closes this stream on its own
    /// accord, for `status` (a `RejectReason` code, `Overloaded`); the link
    /// fails its requests with that reason.
    Closing {
        /// Why (a `RejectReason` code).
        status: u16,
    },
    /// First frame after the handshake of a side connection: ends the
    /// session `(instance, link)` of the agent the connection
    /// authenticated as (a link of its that broke with requests whose data
    /// the target may still be reading). The target lands nothing more of
    /// that session's streams and answers [`Frame::Settled`] once they all
    /// ended.
    Settle {
        /// The initiator's instance id (as in its `Hello`).
        instance: u64,
        /// The link's id (as in its `Hello`).
        link: u64,
    },
    /// Answer to [`Frame::Settle`]: `status::OK` when no stream of the
    /// session is left (or it never existed), so nothing of it lands any
    /// more; `status::STILL_LANDING` when one had not ended in time.
    Settled {
        /// The target's instance id: one other than the link's target
        /// means that agent is gone.
        instance: u64,
        /// `status::OK` or `status::STILL_LANDING`.
        status: u16,
    },
    /// A frame of one transport's own, on the control stream of that
    /// transport's link (the cross-memory path's grants and delegated
    /// copies, and their answers): the engine reads the transport's code
    /// (`flags`) and hands the rest of the header to that transport, which
    /// reads any body itself.
    Transport {
        /// Whose frame it is.
        transport: TransportKind,
        /// The rest of the header, the transport's to read.
        head: TransportHead,
    },
    /// A link's transport sets itself up beside this connection (RDMA: a
    /// queue pair): the transport's name (`name_len` bytes, the name every
    /// status reports) follows, then its own message (`len` bytes), which
    /// only that transport reads.
    Attach {
        /// Length of the transport's name (1..=[`ATTACH_NAME_MAX`]).
        name_len: u8,
        /// Length of the transport's message (at most [`ATTACH_MAX`]).
        len: u32,
    },
    /// Answer to `Attach`: the target transport's message (`len` bytes),
    /// or a refusal status with no body.
    Attached {
        /// `status::OK`, or why the target refused.
        status: u16,
        /// Length of the answer (0 with a refusal).
        len: u32,
    },
    /// The target finished a committed request.
    Ack {
        /// Request id.
        req: u64,
        /// `status::OK` or a reject code.
        status: u16,
        /// With a reject code: what of the data landed
        /// ([`Landed::code`](crate::proto::Landed); 0 unknown).
        landed: u32,
    },
}

/// The fields of a [`Frame::Transport`] header after its kind and
/// transport code, as they sit on the wire; what they mean is the
/// transport's (`docs/wire-format.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportHead {
    /// Bytes 2..4.
    pub status: u16,
    /// Bytes 4..8.
    pub aux: u32,
    /// Bytes 8..16.
    pub id: u64,
    /// Bytes 16..24.
    pub addr: u64,
    /// Bytes 24..32.
    pub len: u64,
    /// Bytes 32..40.
    pub key: u64,
}

/// A header that cannot be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Unknown memory type code.
    #[error("unknown memory type code {0}")]
    UnknownMemoryType(u8),
    /// Body larger than allowed.
    #[error("control body of {0} bytes exceeds the limit")]
    BodyTooLarge(u32),
    /// A field out of range for this frame.
    #[error("bad field: {0}")]
    BadField(&'static str),
}

/// The code of memory type `t` on the wire.
pub(crate) fn mem_code(t: MemoryType) -> u8 {
    match t {
        MemoryType::Dram => 0,
        MemoryType::Vram => 1,
        MemoryType::Blk => 2,
        MemoryType::Obj => 3,
        MemoryType::File => 4,
    }
}

/// The memory type of wire code `c`.
pub(crate) fn mem_from_code(c: u8) -> Result<MemoryType, WireError> {
    Ok(match c {
        0 => MemoryType::Dram,
        1 => MemoryType::Vram,
        2 => MemoryType::Blk,
        3 => MemoryType::Obj,
        4 => MemoryType::File,
        _ => return Err(WireError::UnknownMemoryType(c)),
    })
}

/// `flags` bit of `Write`, `WriteList`, `ReadReq` and `ReadData`: the
/// frame is checked end to end (a seal in the header, a CRC32C trailer
/// after the payload).
const CHECKED: u8 = 0x80;

/// Marks a `Commit`'s `key` as carrying its sync message's CRC32C (in
/// the low 32 bits).
const SYNC_CRC: u64 = 1 << 32;

/// Length of the CRC32C trailer after a checked frame's payload.
pub const TRAILER_LEN: usize = 4;

fn trailer(checked: bool) -> u64 {
    if checked { TRAILER_LEN as u64 } else { 0 }
}

/// Offset of the `status` field in a header: a checked `Write`, `ReadReq`
/// or `WriteList` ([`seal_seq`]), and every `Commit`, carries its seal
/// there.
const SEAL_AT: std::ops::Range<usize> = 2..4;

/// Offset of the `key` field: an `Ack` carries its seal there.
const KEY_AT: std::ops::Range<usize> = 32..40;

/// Where a header carries its seal.
enum Seal {
    /// The low 16 bits of the CRC32C of the header in `status`
    /// ([`seal`]).
    Status,
    /// The CRC32C of the header (`key` zero) in `key`.
    Key,
}

/// The headers [`Frame::encode`] seals and [`Frame::decode`] checks:
/// every `Commit` (a damaged segment count would finish a request early)
/// and every `Ack` (a damaged status would report a refused request
/// complete). Checked data frames carry seals that also cover their order
/// ([`seal_seq`], [`seal_read_data`]), which only their stream knows: its
/// two ends seal and check them.
fn sealed_kind(h: &[u8; HEADER_LEN]) -> Option<Seal> {
    match h[0] {
        K_COMMIT => Some(Seal::Status),
        K_ACK => Some(Seal::Key),
        _ => None,
    }
}

/// The seal of a checked `Write` or `WriteList` header: the low 16 bits of
/// the CRC32C of the header (seal field zero) and of `table` (a write
/// list's table; empty for a `Write`). The target checks it before it
/// lands a byte, so a damaged address, length, key or table is refused
/// instead of written elsewhere.
fn seal_of(header: &[u8; HEADER_LEN], table: &[u8], seq: Option<u32>) -> u16 {
    let mut h = *header;
    h[SEAL_AT].fill(0);
    let mut crc = crate::integrity::Crc32c::new();
    crc.update(&h);
    crc.update(table);
    if let Some(seq) = seq {
        crc.update(&seq.to_le_bytes());
    }
    crc.finish() as u16
}

/// Seals an encoded `Commit` header (see [`seal_of`]).
fn seal(header: &mut [u8; HEADER_LEN]) {
    let s = seal_of(header, &[], None);
    header[SEAL_AT].copy_from_slice(&s.to_le_bytes());
}

/// Seals a checked `Write`, `WriteList` or `ReadReq` header (with a write
/// list's `table`) as the `seq`-th checked frame of its request on its
/// stream: the order is part of the seal, so a frame repeated, lost or
/// moved within a request fails it where it arrives.
pub fn seal_seq(header: &mut [u8; HEADER_LEN], table: &[u8], seq: u32) {
    let s = seal_of(header, table, Some(seq));
    header[SEAL_AT].copy_from_slice(&s.to_le_bytes());
}

/// Whether a checked frame's header (and table) carries the seal of the
/// `seq`-th checked frame of its request on its stream.
pub fn sealed_seq(header: &[u8; HEADER_LEN], table: &[u8], seq: u32) -> bool {
    header[SEAL_AT] == seal_of(header, table, Some(seq)).to_le_bytes()
}

/// Offset of the `aux` field: a checked `ReadData` carries its seal there.
const AUX_AT: std::ops::Range<usize> = 4..8;

/// The seal of a checked `ReadData` answering the `seq`-th checked
/// `ReadReq` of its request on its stream: the CRC32C of the header (`aux`
/// zero) and `seq`.
fn read_data_seal(header: &[u8; HEADER_LEN], seq: u32) -> [u8; 4] {
    let mut h = *header;
    h[AUX_AT].fill(0);
    let mut crc = crate::integrity::Crc32c::new();
    crc.update(&h);
    crc.update(&seq.to_le_bytes());
    crc.finish().to_le_bytes()
}

/// Seals a checked `ReadData` header answering read `seq`.
pub fn seal_read_data(header: &mut [u8; HEADER_LEN], seq: u32) {
    let s = read_data_seal(header, seq);
    header[AUX_AT].copy_from_slice(&s);
}

/// Whether a checked `ReadData` header answers read `seq`, undamaged.
pub fn read_data_sealed(header: &[u8; HEADER_LEN], seq: u32) -> bool {
    header[AUX_AT] == read_data_seal(header, seq)
}

/// `flags` of `Commit` (and of the cross-memory `Delegate`): the direction
/// in the low bits, bit 7 when a sync message follows.
pub(crate) fn op_flags(op: CommitOp, has_sync: bool) -> u8 {
    (match op {
        CommitOp::Write => 1,
        CommitOp::Read => 2,
    }) | if has_sync { 0x80 } else { 0 }
}

/// `flags` bit of `Commit`: make the request's storage writes durable.
const DURABLE: u8 = 0x40;

/// `flags` bit of `Commit`: a table of checks follows the sync message
/// (`addr` = how many).
const CHECKS: u8 = 0x20;

/// Bytes of one check of a `Commit`: address, length and region key (u64
/// each) and CRC32C (u32), little-endian.
pub const CHECK_ENTRY: usize = 28;

/// Most checks one `Commit` carries (14 MiB of table).
pub const MAX_CHECKS: u32 = 1 << 19;

/// Appends one check to a `Commit`'s table: the target's range
/// `remote..remote + len` of the region with access key `key`, and the
/// CRC32C the initiator computed over its side of it.
pub(crate) fn push_check(table: &mut Vec<u8>, remote: u64, len: u64, key: u64, crc: u32) {
    table.extend_from_slice(&remote.to_le_bytes());
    table.extend_from_slice(&len.to_le_bytes());
    table.extend_from_slice(&key.to_le_bytes());
    table.extend_from_slice(&crc.to_le_bytes());
}

/// The direction in `flags` made by [`op_flags`].
pub(crate) fn flags_op(flags: u8) -> Option<CommitOp> {
    match flags & 0x1f {
        1 => Some(CommitOp::Write),
        2 => Some(CommitOp::Read),
        _ => None,
    }
}

impl Frame {
    /// Bytes that follow this header on the stream (its body, when the
    /// frame is well formed): a target gives a body time in proportion.
    pub fn body_len(&self) -> u64 {
        match *self {
            Frame::Hello { name_len: n, .. }
            | Frame::AuthHello { body_len: n, .. }
            | Frame::AuthChallenge { body_len: n, .. }
            | Frame::DescReply { body_len: n }
            | Frame::DescRequest { host_len: n } => u64::from(n),
            Frame::Commit {
                sync_len, checks, ..
            } => u64::from(sync_len) + u64::from(checks) * CHECK_ENTRY as u64,
            Frame::AuthProof => crate::proto::MAC_LEN as u64,
            Frame::Write { len, checked, .. } | Frame::ReadData { len, checked, .. } => {
                len.saturating_add(trailer(checked))
            }
            Frame::WriteList {
                count,
                total,
                checked,
                ..
            } => total
                .saturating_add(u64::from(count) * WRITE_LIST_ENTRY as u64)
                .saturating_add(trailer(checked)),
            Frame::Attach { name_len, len } => u64::from(name_len) + u64::from(len),
            Frame::Attached { len, .. } => u64::from(len),
            _ => 0,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = RawHeader::default();
        match *self {
            Frame::Hello {
                instance,
                expect,
                version,
                link,
                stream,
                name_len,
            } => {
                h.kind = K_HELLO;
                h.id = instance.into();
                h.addr = expect.into();
                h.status = version.into();
                h.len = link.into();
                h.key = u64::from(stream).into();
                h.aux = name_len.into();
            }
            Frame::HelloAck {
                instance,
                status,
                ticket,
                idle_ms,
            } => {
                h.kind = K_HELLO_ACK;
                h.id = instance.into();
                h.status = status.into();
                h.addr = (ticket as u64).into();
                h.len = ((ticket >> 64) as u64).into();
                h.aux = idle_ms.into();
            }
            Frame::Keepalive => h.kind = K_KEEPALIVE,
            Frame::Closing { status } => {
                h.kind = K_CLOSING;
                h.status = status.into();
            }
            Frame::Settle { instance, link } => {
                h.kind = K_SETTLE;
                h.id = instance.into();
                h.len = link.into();
            }
            Frame::Settled { instance, status } => {
                h.kind = K_SETTLED;
                h.id = instance.into();
                h.status = status.into();
            }
            Frame::AuthHello {
                keyed,
                encrypt,
                body_len,
            } => {
                h.kind = K_AUTH_HELLO;
                h.flags = auth_flags(keyed, encrypt);
                h.aux = body_len.into();
            }
            Frame::AuthChallenge {
                status,
                keyed,
                encrypt,
                body_len,
            } => {
                h.kind = K_AUTH_CHALLENGE;
                h.flags = auth_flags(keyed, encrypt);
                h.status = status.into();
                h.aux = body_len.into();
            }
            Frame::AuthProof => {
                h.kind = K_AUTH_PROOF;
                h.aux = (crate::proto::MAC_LEN as u32).into();
            }
            Frame::AuthResult { status } => {
                h.kind = K_AUTH_RESULT;
                h.status = status.into();
            }
            Frame::DescRequest { host_len } => {
                h.kind = K_DESC_REQUEST;
                h.aux = host_len.into();
            }
            Frame::DescReply { body_len } => {
                h.kind = K_DESC_REPLY;
                h.aux = body_len.into();
            }
            Frame::Write {
                req,
                mem_type,
                device,
                addr,
                len,
                key,
                checked,
            }
            | Frame::ReadReq {
                req,
                mem_type,
                device,
                addr,
                len,
                key,
                checked,
            } => {
                h.kind = if matches!(self, Frame::Write { .. }) {
                    K_WRITE
                } else {
                    K_READ_REQ
                };
                h.flags = mem_code(mem_type) | if checked { CHECKED } else { 0 };
                h.aux = device.into();
                h.id = req.into();
                h.addr = addr.into();
                h.len = len.into();
                h.key = key.into();
            }
            Frame::ReadData {
                req,
                len,
                status,
                checked,
            } => {
                h.kind = K_READ_DATA;
                h.flags = if checked { CHECKED } else { 0 };
                h.id = req.into();
                h.len = len.into();
                h.status = status.into();
            }
            Frame::Commit {
                req,
                op,
                segments,
                sync_len,
                has_sync,
                durable,
                checks,
                sync_crc,
            } => {
                h.kind = K_COMMIT;
                h.flags = op_flags(op, has_sync)
                    | if durable { DURABLE } else { 0 }
                    | if checks > 0 { CHECKS } else { 0 };
                h.id = req.into();
                h.len = segments.into();
                h.aux = sync_len.into();
                h.addr = u64::from(checks).into();
                h.key = sync_crc.map_or(0, |c| SYNC_CRC | u64::from(c)).into();
            }
            Frame::Fence { req } => {
                h.kind = K_FENCE;
                h.id = req.into();
            }
            Frame::Abort { req, segments } => {
                h.kind = K_ABORT;
                h.id = req.into();
                h.len = segments.into();
            }
            Frame::WriteList {
                req,
                mem_type,
                count,
                total,
                key,
                checked,
            } => {
                h.kind = K_WRITE_LIST;
                h.flags = mem_code(mem_type) | if checked { CHECKED } else { 0 };
                h.id = req.into();
                h.aux = count.into();
                h.len = total.into();
                h.key = key.into();
            }
            Frame::Transport { transport, head } => {
                h.kind = K_TRANSPORT;
                h.flags = transport.code();
                h.status = head.status.into();
                h.aux = head.aux.into();
                h.id = head.id.into();
                h.addr = head.addr.into();
                h.len = head.len.into();
                h.key = head.key.into();
            }
            Frame::Attach { name_len, len } => {
                h.kind = K_ATTACH;
                h.flags = name_len;
                h.aux = len.into();
            }
            Frame::Attached { status, len } => {
                h.kind = K_ATTACHED;
                h.status = status.into();
                h.aux = len.into();
            }
            Frame::Ack {
                req,
                status,
                landed,
            } => {
                h.kind = K_ACK;
                h.id = req.into();
                h.status = status.into();
                h.aux = landed.into();
            }
        }
        let mut out = [0u8; HEADER_LEN];
        out.copy_from_slice(h.as_bytes());
        match sealed_kind(&out) {
            Some(Seal::Status) => seal(&mut out),
            Some(Seal::Key) => {
                let s = crate::integrity::crc32c(&out);
                out[KEY_AT].copy_from_slice(&u64::from(s).to_le_bytes());
            }
            None => {}
        }
        out
    }

    /// Decodes a header.
    ///
    /// # Errors
    /// A [`WireError`] for unknown kinds, unknown memory types, oversized
    /// control bodies and fields that make no sense for the kind.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Frame, WireError> {
        match sealed_kind(bytes) {
            Some(Seal::Status) if bytes[SEAL_AT] != seal_of(bytes, &[], None).to_le_bytes() => {
                return Err(WireError::BadField("header seal"));
            }
            Some(Seal::Key) => {
                let mut h = *bytes;
                h[KEY_AT].fill(0);
                if bytes[KEY_AT] != u64::from(crate::integrity::crc32c(&h)).to_le_bytes() {
                    return Err(WireError::BadField("header seal"));
                }
            }
            _ => {}
        }
        let h = RawHeader::read_from_bytes(bytes).expect("exact size");
        let aux = h.aux.get();
        let body_limit = |n: u32| {
            if n > MAX_CONTROL_BODY {
                Err(WireError::BodyTooLarge(n))
            } else {
                Ok(n)
            }
        };
        Ok(match h.kind {
            K_HELLO => Frame::Hello {
                instance: h.id.get(),
                expect: h.addr.get(),
                version: h.status.get(),
                link: h.len.get(),
                stream: u32::try_from(h.key.get()).map_err(|_| WireError::BadField("stream"))?,
                name_len: body_limit(aux)?,
            },
            K_HELLO_ACK => Frame::HelloAck {
                instance: h.id.get(),
                status: h.status.get(),
                ticket: u128::from(h.addr.get()) | u128::from(h.len.get()) << 64,
                idle_ms: aux,
            },
            K_KEEPALIVE => Frame::Keepalive,
            K_CLOSING => Frame::Closing {
                status: h.status.get(),
            },
            K_SETTLE => Frame::Settle {
                instance: h.id.get(),
                link: h.len.get(),
            },
            K_SETTLED => Frame::Settled {
                instance: h.id.get(),
                status: h.status.get(),
            },
            K_AUTH_HELLO | K_AUTH_CHALLENGE => {
                // Bit 0: keyed; bit 1: encrypt, only with bit 0.
                if h.flags > 3 || h.flags == 2 {
                    return Err(WireError::BadField("auth flags"));
                }
                if aux > MAX_AUTH_BODY {
                    return Err(WireError::BodyTooLarge(aux));
                }
                let (keyed, encrypt) = (h.flags & 1 != 0, h.flags & 2 != 0);
                if h.kind == K_AUTH_HELLO {
                    if (aux as usize) < crate::proto::NONCE_LEN {
                        return Err(WireError::BadField("auth hello body length"));
                    }
                    Frame::AuthHello {
                        keyed,
                        encrypt,
                        body_len: aux,
                    }
                } else {
                    let st = h.status.get();
                    let min =
                        crate::proto::NONCE_LEN + if keyed { crate::proto::MAC_LEN } else { 0 };
                    if st == status::OK && (aux as usize) < min || st != status::OK && aux != 0 {
                        return Err(WireError::BadField("auth challenge body length"));
                    }
                    Frame::AuthChallenge {
                        status: st,
                        keyed,
                        encrypt,
                        body_len: aux,
                    }
                }
            }
            K_AUTH_PROOF => {
                if aux as usize != crate::proto::MAC_LEN {
                    return Err(WireError::BadField("auth proof length"));
                }
                Frame::AuthProof
            }
            K_AUTH_RESULT => Frame::AuthResult {
                status: h.status.get(),
            },
            K_DESC_REQUEST => {
                if aux > MAX_HOST_ID {
                    return Err(WireError::BodyTooLarge(aux));
                }
                Frame::DescRequest { host_len: aux }
            }
            K_DESC_REPLY => Frame::DescReply {
                body_len: body_limit(aux)?,
            },
            K_WRITE | K_READ_REQ => {
                let mem_type = mem_from_code(h.flags & !CHECKED)?;
                let checked = h.flags & CHECKED != 0;
                let (req, addr, len, key) = (h.id.get(), h.addr.get(), h.len.get(), h.key.get());
                if len == 0 {
                    return Err(WireError::BadField("zero-length segment"));
                }
                if addr.checked_add(len).is_none() {
                    return Err(WireError::BadField("segment wraps the address space"));
                }
                let device = aux;
                if h.kind == K_WRITE {
                    Frame::Write {
                        req,
                        mem_type,
                        device,
                        addr,
                        len,
                        key,
                        checked,
                    }
                } else {
                    Frame::ReadReq {
                        req,
                        mem_type,
                        device,
                        addr,
                        len,
                        key,
                        checked,
                    }
                }
            }
            K_READ_DATA => {
                if h.flags & !CHECKED != 0 {
                    return Err(WireError::BadField("read data flags"));
                }
                Frame::ReadData {
                    req: h.id.get(),
                    len: h.len.get(),
                    status: h.status.get(),
                    checked: h.flags & CHECKED != 0,
                }
            }
            K_COMMIT => Frame::Commit {
                req: h.id.get(),
                op: flags_op(h.flags).ok_or(WireError::BadField("commit op"))?,
                segments: h.len.get(),
                sync_len: body_limit(aux)?,
                has_sync: h.flags & 0x80 != 0,
                durable: h.flags & DURABLE != 0,
                checks: if h.flags & CHECKS == 0 {
                    0
                } else {
                    u32::try_from(h.addr.get())
                        .ok()
                        .filter(|n| (1..=MAX_CHECKS).contains(n))
                        .ok_or(WireError::BadField("commit checks"))?
                },
                sync_crc: match h.key.get() {
                    0 => None,
                    k if k >> 32 == SYNC_CRC >> 32 && h.flags & 0x80 != 0 => Some(k as u32),
                    _ => return Err(WireError::BadField("commit sync checksum")),
                },
            },
            K_FENCE => Frame::Fence { req: h.id.get() },
            K_ABORT => Frame::Abort {
                req: h.id.get(),
                segments: h.len.get(),
            },
            K_WRITE_LIST => {
                let count = h.aux.get();
                if !(2..=WRITE_LIST_MAX).contains(&count) {
                    return Err(WireError::BadField("write list length"));
                }
                if h.len.get() == 0 {
                    return Err(WireError::BadField("empty write list"));
                }
                Frame::WriteList {
                    req: h.id.get(),
                    mem_type: mem_from_code(h.flags & !CHECKED)?,
                    count,
                    total: h.len.get(),
                    key: h.key.get(),
                    checked: h.flags & CHECKED != 0,
                }
            }
            K_TRANSPORT => Frame::Transport {
                transport: TransportKind::from_code(h.flags)
                    .ok_or(WireError::BadField("transport code"))?,
                head: TransportHead {
                    status: h.status.get(),
                    aux,
                    id: h.id.get(),
                    addr: h.addr.get(),
                    len: h.len.get(),
                    key: h.key.get(),
                },
            },
            K_ATTACH => {
                if !(1..=ATTACH_NAME_MAX).contains(&h.flags) {
                    return Err(WireError::BadField("attach name length"));
                }
                if aux > ATTACH_MAX {
                    return Err(WireError::BadField("attach message length"));
                }
                Frame::Attach {
                    name_len: h.flags,
                    len: aux,
                }
            }
            K_ATTACHED => {
                let st = h.status.get();
                if aux > ATTACH_MAX || (st != status::OK && aux != 0) {
                    return Err(WireError::BadField("attach answer length"));
                }
                Frame::Attached {
                    status: st,
                    len: aux,
                }
            }
            K_ACK => Frame::Ack {
                req: h.id.get(),
                status: h.status.get(),
                landed: h.aux.get(),
            },
            k => return Err(WireError::UnknownKind(k)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello {
                instance: 1,
                expect: 2,
                version: PROTOCOL_VERSION,
                link: 44,
                stream: 3,
                name_len: 5,
            },
            Frame::HelloAck {
                instance: 9,
                status: status::STALE_INSTANCE,
                ticket: u128::MAX - 5,
                idle_ms: 30_000,
            },
            Frame::Keepalive,
            Frame::Closing { status: 19 },
            Frame::Settle {
                instance: 7,
                link: u64::MAX,
            },
            Frame::Settled {
                instance: 9,
                status: status::STILL_LANDING,
            },
            Frame::AuthHello {
                keyed: true,
                encrypt: false,
                body_len: 40,
            },
            Frame::AuthHello {
                keyed: true,
                encrypt: true,
                body_len: 40,
            },
            Frame::AuthChallenge {
                status: status::OK,
                keyed: false,
                encrypt: false,
                body_len: 37,
            },
            Frame::AuthChallenge {
                status: status::OK,
                keyed: true,
                encrypt: true,
                body_len: 70,
            },
            Frame::AuthChallenge {
                status: status::AUTH_REQUIRED,
                keyed: false,
                encrypt: false,
                body_len: 0,
            },
            Frame::AuthProof,
            Frame::AuthResult {
                status: status::AUTH_FAILED,
            },
            Frame::DescRequest { host_len: 0 },
            Frame::DescRequest { host_len: 36 },
            Frame::DescReply { body_len: 77 },
            Frame::Write {
                req: u64::MAX,
                mem_type: MemoryType::Dram,
                device: 0,
                addr: 0x7fff_0000,
                len: 65536,
                key: 0xabcdef,
                checked: false,
            },
            Frame::ReadReq {
                req: 4,
                mem_type: MemoryType::Vram,
                device: 3,
                addr: 8,
                len: 1,
                key: 1,
                checked: false,
            },
            Frame::ReadReq {
                req: 4,
                mem_type: MemoryType::Dram,
                device: 0,
                addr: 8,
                len: 1,
                key: 1,
                checked: true,
            },
            Frame::ReadData {
                req: 4,
                len: 1,
                status: 0,
                checked: false,
            },
            Frame::ReadData {
                req: 4,
                len: 1,
                status: 0,
                checked: true,
            },
            Frame::Commit {
                req: 12,
                op: CommitOp::Read,
                segments: 10_000,
                sync_len: 0,
                has_sync: true,
                durable: false,
                checks: 0,
                sync_crc: None,
            },
            Frame::Commit {
                req: 12,
                op: CommitOp::Read,
                segments: 0,
                sync_len: 3,
                has_sync: true,
                durable: false,
                checks: MAX_CHECKS,
                sync_crc: Some(0),
            },
            Frame::Write {
                req: 5,
                mem_type: MemoryType::Blk,
                device: u32::MAX,
                addr: 1 << 40,
                len: 4096,
                key: 3,
                checked: false,
            },
            Frame::Write {
                req: 6,
                mem_type: MemoryType::Dram,
                device: 0,
                addr: 1 << 40,
                len: 4096,
                key: 3,
                checked: true,
            },
            Frame::Commit {
                req: 5,
                op: CommitOp::Write,
                segments: 1,
                sync_len: 9,
                has_sync: true,
                durable: true,
                checks: 1,
                sync_crc: Some(u32::MAX),
            },
            Frame::Fence { req: 13 },
            Frame::Abort {
                req: 13,
                segments: 7,
            },
            Frame::WriteList {
                req: 16,
                mem_type: MemoryType::Dram,
                count: 3,
                total: 3 << 14,
                key: 0xabc,
                checked: false,
            },
            Frame::WriteList {
                req: 16,
                mem_type: MemoryType::Dram,
                count: 3,
                total: 3 << 14,
                key: 0xabc,
                checked: true,
            },
            Frame::Transport {
                transport: TransportKind::Shm,
                head: TransportHead {
                    status: 0x8101,
                    aux: 4096,
                    id: 15,
                    addr: 0x7fff_0000_1000,
                    len: u64::MAX,
                    key: 0xdead_beef_cafe,
                },
            },
            Frame::Transport {
                transport: TransportKind::Fabric,
                head: TransportHead::default(),
            },
            Frame::Attach {
                name_len: 4,
                len: 28,
            },
            Frame::Attached {
                status: status::OK,
                len: ATTACH_MAX,
            },
            Frame::Attached {
                status: status::NO_TRANSPORT,
                len: 0,
            },
            Frame::Ack {
                req: 12,
                status: 2,
                landed: 2,
            },
        ]
    }

    #[test]
    fn round_trip() {
        for f in samples() {
            assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
        }
    }

    #[test]
    fn rejects_nonsense() {
        let mut h = Frame::Ack {
            req: 1,
            status: 0,
            landed: 0,
        }
        .encode();
        h[0] = 200;
        assert_eq!(Frame::decode(&h), Err(WireError::UnknownKind(200)));
        let mut w = Frame::Write {
            req: 1,
            mem_type: MemoryType::Dram,
            device: 0,
            addr: 0,
            len: 1,
            key: 0,
            checked: false,
        }
        .encode();
        w[1] = 9;
        assert_eq!(Frame::decode(&w), Err(WireError::UnknownMemoryType(9)));
        let wrap = Frame::Write {
            req: 1,
            mem_type: MemoryType::Dram,
            device: 0,
            addr: u64::MAX,
            len: 2,
            key: 0,
            checked: false,
        }
        .encode();
        assert!(matches!(Frame::decode(&wrap), Err(WireError::BadField(_))));
        let big = Frame::DescReply {
            body_len: MAX_CONTROL_BODY + 1,
        }
        .encode();
        assert!(matches!(
            Frame::decode(&big),
            Err(WireError::BodyTooLarge(_))
        ));
        let mut unknown = Frame::Transport {
            transport: TransportKind::Shm,
            head: TransportHead::default(),
        }
        .encode();
        for code in [0, 7, 255] {
            unknown[1] = code;
            assert_eq!(
                Frame::decode(&unknown),
                Err(WireError::BadField("transport code"))
            );
        }
    }

    #[test]
    fn a_checked_frame_counts_its_trailer_and_carries_its_seal() {
        let w = Frame::Write {
            req: 9,
            mem_type: MemoryType::Dram,
            device: 0,
            addr: 0x1000,
            len: 100,
            key: 77,
            checked: true,
        };
        assert_eq!(w.body_len(), 100 + TRAILER_LEN as u64);
        let mut h = w.encode();
        seal_seq(&mut h, &[], 7);
        assert!(sealed_seq(&h, &[], 7));
        // Another place in the request's order is another seal.
        assert!(!sealed_seq(&h, &[], 6) && !sealed_seq(&h, &[], 8));
        // The seal does not change what the header says.
        assert_eq!(Frame::decode(&h).unwrap(), w);
        // Any one flipped bit outside the seal itself is seen.
        for bit in 0..HEADER_LEN * 8 {
            if SEAL_AT.contains(&(bit / 8)) {
                continue;
            }
            let mut bad = h;
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(!sealed_seq(&bad, &[], 7), "bit {bit}");
        }
        // A write list's seal covers its table too.
        let table: Vec<u8> = (0..48u8).collect();
        let l = Frame::WriteList {
            req: 9,
            mem_type: MemoryType::Dram,
            count: 3,
            total: 300,
            key: 77,
            checked: true,
        };
        assert_eq!(l.body_len(), 300 + 48 + TRAILER_LEN as u64);
        let mut h = l.encode();
        seal_seq(&mut h, &table, 0);
        assert!(sealed_seq(&h, &table, 0));
        for bit in 0..table.len() * 8 {
            let mut bad = table.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(!sealed_seq(&h, &bad, 0), "table bit {bit}");
        }
        // A commit's checks follow its sync message; too many, or the flag
        // with none, are refused.
        let c = Frame::Commit {
            req: 1,
            op: CommitOp::Write,
            segments: 0,
            sync_len: 5,
            has_sync: true,
            durable: false,
            checks: 3,
            sync_crc: None,
        };
        assert_eq!(c.body_len(), 5 + 3 * CHECK_ENTRY as u64);
        let mut h = c.encode();
        h[16..24].copy_from_slice(&u64::from(MAX_CHECKS + 1).to_le_bytes());
        assert!(Frame::decode(&h).is_err());
        h[16..24].copy_from_slice(&0u64.to_le_bytes());
        assert!(Frame::decode(&h).is_err());
        // Unchecked frames carry no trailer.
        // Unchecked frames carry no trailer; a checked answer to a read
        // carries the seal of its place in the request's reads.
        let r = Frame::ReadData {
            req: 1,
            len: 10,
            status: status::OK,
            checked: false,
        };
        assert_eq!(r.body_len(), 10);
        let mut h = Frame::ReadData {
            req: 1,
            len: 10,
            status: status::OK,
            checked: true,
        }
        .encode();
        seal_read_data(&mut h, 3);
        assert!(read_data_sealed(&h, 3) && !read_data_sealed(&h, 4));
        // Commits and acknowledgements are sealed as they are encoded.
        let mut a = Frame::Ack {
            req: 9,
            status: 1,
            landed: 1,
        }
        .encode();
        assert!(Frame::decode(&a).is_ok());
        a[2] ^= 1; // status 1 (refused) read as 0 (complete)
        assert_eq!(Frame::decode(&a), Err(WireError::BadField("header seal")));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in prop::array::uniform32(any::<u8>()), tail in prop::array::uniform8(any::<u8>())) {
            let mut h = [0u8; HEADER_LEN];
            h[..32].copy_from_slice(&bytes);
            h[32..].copy_from_slice(&tail);
            if let Ok(f) = Frame::decode(&h) {
                // Whatever decodes re-encodes to something that decodes the same.
                prop_assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
            }
        }
    }
}
