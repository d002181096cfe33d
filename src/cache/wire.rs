//! Control messages of the KV-cache protocol. They travel as the agents'
//! sync messages (so a `Done` that closes a share arrives after that
//! share's data), postcard-encoded behind a 4-byte magic and a version, in
//! chunks of at most [`CHUNK_MAX`] bytes (RDMA sync messages are bounded)
//! that the receiving side reassembles per sending agent (an agent
//! delivers one sender's messages in order).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::cache::error::CacheError;
use crate::cache::state::CacheState;

const MAGIC: [u8; 4] = *b"KVXC";
const VERSION: u8 = 3;
/// Header: magic, version, chunk index (u16), chunk count (u16), and the
/// CRC32C (u32) of the rest of the chunk (header before it, part after
/// it): a message damaged on the way is dropped, never acted on.
const HEADER: usize = 4 + 1 + 2 + 2 + 4;

/// Where the chunk's CRC32C sits in its header.
const CRC_AT: std::ops::Range<usize> = 9..13;

/// The CRC32C of a chunk without its own checksum field.
fn chunk_crc(chunk: &[u8]) -> u32 {
    let mut c = crate::integrity::Crc32c::new();
    c.update(&chunk[..CRC_AT.start]);
    c.update(&chunk[CRC_AT.end..]);
    c.finish()
}
/// Largest chunk on the wire, header included; a larger one is refused.
pub const CHUNK_MAX: usize = 4000;
/// Largest message one sender may have in reassembly (a `Request` naming
/// about two million blocks); a message announcing more is refused at its
/// first chunk.
pub const MESSAGE_MAX: usize = 16 << 20;
/// Most bytes in reassembly from all senders together; past it the chunk
/// that would exceed it is refused and its sender's partial message
/// dropped.
pub const REASSEMBLY_MAX: usize = 64 << 20;

/// What the generation side asks of one context rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestInfo {
    /// The request (64-bit: no wrap-around at 4096 as with 12-bit ids).
    pub request_id: u64,
    /// The generation rank asking.
    pub gen_rank: u32,
    /// Its attention-DP group (0 without attention DP).
    pub gen_dp_rank: u32,
    /// Its cache state.
    pub gen_state: CacheState,
    /// Its agent's connection info, for the context side to load it.
    pub connection: String,
    /// Blocks wanted, counted back from the last one: the context side
    /// sends its last `index_from_end + 1` blocks.
    pub index_from_end: u32,
    /// Key of the sequence's last block, to find the blocks through the
    /// context engine's [`BlockLookup`](super::BlockLookup) (partial reuse).
    pub last_block_key: Option<u64>,
    /// Start addresses of the destination blocks, oldest first
    /// (`index_from_end + 1` of them).
    pub blocks: Vec<u64>,
    /// Memory type of the destination pool.
    pub pool_mem_type: crate::memory::MemoryType,
    /// End-to-end integrity: the context side's writes carry a CRC32C per
    /// piece, checked where they land before they count as landed
    /// ([`TransferRequest::integrity`](crate::TransferRequest::integrity)).
    pub integrity: bool,
}

/// A protocol message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Generation → context: send me my share of this request.
    Request(RequestInfo),
    /// Context → generation: every counterpart asked; data follows.
    Ready {
        /// The request.
        request_id: u64,
    },
    /// Context → generation: all of this peer's share landed (sent once
    /// every write of the share completed, so it arrives after the data;
    /// never after a write of it failed).
    Done {
        /// The request.
        request_id: u64,
        /// Bytes of the share.
        bytes: u64,
        /// Fragments of the share before coalescing.
        fragments: u64,
        /// Fragments written (after coalescing).
        fragments_coalesced: u64,
    },
    /// Context → generation: the request is cancelled; nothing more will
    /// be written and nothing written is still in flight.
    Cancelled {
        /// The request.
        request_id: u64,
        /// Why.
        reason: String,
        /// True when the context side failed (an unknown block, an
        /// incompatible state, a transfer error); false when the request
        /// was cancelled on purpose (by either side). Both sides count it
        /// alike in their metrics.
        failure: bool,
        /// The failure was a write that did not match its checksum where
        /// it landed (end-to-end integrity).
        integrity: bool,
    },
    /// Generation → context: cancel this request.
    Cancel {
        /// The request.
        request_id: u64,
    },
    /// Context → generation: model layers `first_layer..first_layer +
    /// layers` of this peer's share landed (sent once the group's writes
    /// and every earlier one of the share completed). Only
    /// layer-wise sending sends it; `Done` still closes the share. A peer
    /// that does not know it drops it and waits for `Done`.
    Landed {
        /// The request.
        request_id: u64,
        /// First model layer of the group.
        first_layer: u32,
        /// Layers in the group.
        layers: u32,
    },
}

impl Msg {
    /// The request this message is about.
    pub fn request_id(&self) -> u64 {
        match self {
            Msg::Request(r) => r.request_id,
            Msg::Ready { request_id }
            | Msg::Done { request_id, .. }
            | Msg::Cancelled { request_id, .. }
            | Msg::Cancel { request_id }
            | Msg::Landed { request_id, .. } => *request_id,
        }
    }

    /// Encodes into one or more chunks, each at most [`CHUNK_MAX`] bytes.
    pub fn encode(&self) -> Vec<Vec<u8>> {
        let body = postcard::to_allocvec(self).expect("serialising to memory cannot fail");
        let per = CHUNK_MAX - HEADER;
        let count = body.len().div_ceil(per).max(1);
        (0..count)
            .map(|i| {
                let part = &body[(i * per).min(body.len())..((i + 1) * per).min(body.len())];
                let mut c = Vec::with_capacity(HEADER + part.len());
                c.extend_from_slice(&MAGIC);
                c.push(VERSION);
                c.extend_from_slice(&(i as u16).to_le_bytes());
                c.extend_from_slice(&(count as u16).to_le_bytes());
                c.extend_from_slice(&[0; 4]);
                c.extend_from_slice(part);
                let crc = chunk_crc(&c);
                c[CRC_AT].copy_from_slice(&crc.to_le_bytes());
                c
            })
            .collect()
    }
}

/// Makes a chunk's checksum match it (the fuzzer's chunks, so that they
/// reach the decoder behind the check).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn reseal(chunk: &mut [u8]) {
    if chunk.len() >= HEADER {
        let crc = chunk_crc(chunk);
        chunk[CRC_AT].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Whether a sync message belongs to this protocol.
pub fn is_ours(chunk: &[u8]) -> bool {
    chunk.len() >= HEADER && chunk[..4] == MAGIC
}

/// How long one sender's partial message may wait for its next chunk
/// before it is dropped: an agent sends a message's chunks back to back,
/// so a partial message this old belongs to a sender that stopped (died,
/// lost its connection, or holds memory on purpose).
pub const PARTIAL_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// One sender's partial message.
struct Partial {
    /// Chunks received so far.
    next: u16,
    body: Vec<u8>,
    /// When its latest chunk arrived.
    touched: Instant,
    /// Order of arrival of its first chunk (ties between equal holders).
    seq: u64,
}

/// Reassembles chunks per sending agent, within [`MESSAGE_MAX`] per sender
/// and [`REASSEMBLY_MAX`] in all. No sender can keep the others out:
///
/// - a partial message that gets no chunk for [`PARTIAL_TTL`] is dropped
///   ([`expire`](Self::expire));
/// - when a chunk would pass the budget, the sender holding the most is
///   dropped first (oldest first among equals); the chunk is refused only
///   when its own sender is that one, so a sender holding less than an
///   equal share of the budget is never refused;
/// - a sender's partial message goes with [`forget`](Self::forget) (its
///   connection ended, it left the cluster).
///
/// Every partial message dropped is counted ([`dropped`](Self::dropped)).
pub struct Reassembler {
    partial: HashMap<String, Partial>,
    /// Bytes held in `partial`.
    held: usize,
    message_max: usize,
    total_max: usize,
    ttl: std::time::Duration,
    dropped: u64,
    /// Partial messages begun so far.
    begun: u64,
}

impl Default for Reassembler {
    fn default() -> Self {
        Self::with_limits(MESSAGE_MAX, REASSEMBLY_MAX)
    }
}

impl Reassembler {
    /// A reassembler holding at most `message_max` bytes of one sender's
    /// message and `total_max` bytes in all.
    pub fn with_limits(message_max: usize, total_max: usize) -> Self {
        Self {
            partial: HashMap::new(),
            held: 0,
            message_max,
            total_max,
            ttl: PARTIAL_TTL,
            dropped: 0,
            begun: 0,
        }
    }

    /// The same with partial messages kept `ttl` without a chunk.
    pub fn with_ttl(mut self, ttl: std::time::Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Bytes of partial messages held now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Bytes of `from`'s partial message held now.
    pub fn held_from(&self, from: &str) -> usize {
        self.partial.get(from).map_or(0, |p| p.body.len())
    }

    /// Partial messages dropped so far: malformed, expired, evicted for a
    /// fair share of the budget, or forgotten.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// When [`expire`](Self::expire) next has something to drop.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.partial.values().map(|p| p.touched + self.ttl).min()
    }

    /// Drops the partial messages that got no chunk for the TTL; returns
    /// how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let ttl = self.ttl;
        let old: Vec<String> = self
            .partial
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.touched) >= ttl)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &old {
            tracing::debug!(remote = k.as_str(), "a partial KV-cache message expired");
            self.forget(k);
        }
        old.len()
    }

    /// Drops `from`'s partial message, if any (counted).
    pub fn forget(&mut self, from: &str) {
        if self.partial.contains_key(from) {
            self.dropped += 1;
        }
        self.take(from);
    }

    /// Removes `from`'s partial message and gives its body.
    fn take(&mut self, from: &str) -> Vec<u8> {
        let body = self
            .partial
            .remove(from)
            .map(|p| p.body)
            .unwrap_or_default();
        self.held -= body.len();
        body
    }

    /// Makes room for `need` more bytes from `from`: drops the largest
    /// holders (oldest first among equals) while the budget would be
    /// passed. False when `from` itself is the largest holder (then its
    /// partial message was dropped too).
    fn make_room(&mut self, from: &str, need: usize) -> bool {
        while self.held + need > self.total_max {
            let Some(victim) = self
                .partial
                .iter()
                .max_by_key(|(k, p)| {
                    let size = p.body.len() + if k.as_str() == from { need } else { 0 };
                    (size, std::cmp::Reverse(p.seq))
                })
                .map(|(k, _)| k.clone())
            else {
                return false;
            };
            let own = victim == from;
            tracing::debug!(
                remote = victim.as_str(),
                held = self.held,
                "reassembly full: dropping the largest partial KV-cache message"
            );
            self.forget(&victim);
            if own {
                return false;
            }
        }
        true
    }

    /// As [`feed`](Self::feed) for a sync message of any kind: another
    /// protocol's is skipped, a malformed one dropped with a warning.
    pub fn accept(&mut self, from: &str, chunk: &[u8], now: Instant) -> Option<Msg> {
        if !is_ours(chunk) {
            return None;
        }
        self.feed(from, chunk, now)
            .inspect_err(|e| tracing::warn!(%e, "dropping a KV-cache message"))
            .ok()
            .flatten()
    }

    /// Feeds one chunk from `from`, arrived at `now`; returns a whole
    /// message when this chunk completes one.
    ///
    /// # Errors
    /// [`CacheError::Protocol`] for a malformed chunk or message (the
    /// partial message from that sender is dropped), or for a chunk that
    /// does not fit in the budget while its sender holds the most.
    pub fn feed(
        &mut self,
        from: &str,
        chunk: &[u8],
        now: Instant,
    ) -> Result<Option<Msg>, CacheError> {
        let bad = |what: &str| CacheError::Protocol {
            peer: from.to_owned(),
            detail: what.to_owned(),
        };
        if !is_ours(chunk) {
            return Err(bad("not a KV-cache message"));
        }
        if chunk[4] != VERSION {
            return Err(bad(&format!("unsupported version {}", chunk[4])));
        }
        if chunk.len() > CHUNK_MAX {
            self.forget(from);
            return Err(bad(&format!(
                "a chunk of {} bytes (at most {CHUNK_MAX})",
                chunk.len()
            )));
        }
        if chunk.len() < HEADER || chunk[CRC_AT] != chunk_crc(chunk).to_le_bytes() {
            self.forget(from);
            return Err(bad("a chunk that does not match its CRC32C"));
        }
        let idx = u16::from_le_bytes([chunk[5], chunk[6]]);
        let count = u16::from_le_bytes([chunk[7], chunk[8]]);
        let part = &chunk[HEADER..];
        let announced = usize::from(count) * (CHUNK_MAX - HEADER);
        if announced > self.message_max {
            self.forget(from);
            return Err(bad(&format!(
                "a message of {count} chunks (at most {} bytes)",
                self.message_max
            )));
        }
        let expected = self.partial.get(from).map_or(0, |e| e.next);
        if idx != expected || idx >= count {
            self.forget(from);
            return Err(bad(&format!("chunk {idx} of {count} out of order")));
        }
        if count == 1 {
            // A one-chunk message: nothing held.
            return postcard::from_bytes(part)
                .map(Some)
                .map_err(|e| bad(&format!("undecodable message: {e}")));
        }
        if !self.make_room(from, part.len()) {
            return Err(bad(&format!(
                "reassembly full ({} bytes held from all senders, this one the most)",
                self.held
            )));
        }
        let seq = self.begun;
        let entry = self
            .partial
            .entry(from.to_owned())
            .or_insert_with(|| Partial {
                next: 0,
                body: Vec::new(),
                touched: now,
                seq,
            });
        if entry.next == 0 {
            self.begun += 1;
        }
        entry.body.extend_from_slice(part);
        entry.next += 1;
        entry.touched = now;
        self.held += part.len();
        if entry.next < count {
            return Ok(None);
        }
        let body = self.take(from);
        postcard::from_bytes(&body)
            .map(Some)
            .map_err(|e| bad(&format!("undecodable message: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Attention, DataType};

    fn info(blocks: usize) -> RequestInfo {
        RequestInfo {
            request_id: u64::MAX - 7,
            gen_rank: 3,
            gen_dp_rank: 1,
            gen_state: CacheState::new(32, 8, 128, 16, DataType::Bf16, Attention::Default, 1, 1),
            connection: "127.0.0.1:4000".into(),
            index_from_end: blocks as u32 - 1,
            last_block_key: Some(42),
            blocks: (0..blocks as u64)
                .map(|i| 0x7f00_0000_0000 + i * 65536)
                .collect(),
            pool_mem_type: crate::memory::MemoryType::Dram,
            integrity: true,
        }
    }

    #[test]
    fn a_damaged_chunk_is_dropped_not_acted_on() {
        let now = Instant::now();
        let m = Msg::Landed {
            request_id: 7,
            first_layer: 3,
            layers: 2,
        };
        let c = m.encode().remove(0);
        for bit in 0..c.len() * 8 {
            let mut bad = c.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let mut r = Reassembler::default();
            assert!(
                !matches!(r.feed("ctx0", &bad, now), Ok(Some(_))),
                "bit {bit} went unseen"
            );
        }
        assert_eq!(
            Reassembler::default().feed("ctx0", &c, now).unwrap(),
            Some(m)
        );
    }

    #[test]
    fn round_trip_small_and_chunked() {
        let now = Instant::now();
        for n in [1, 300, 4096] {
            let m = Msg::Request(info(n));
            let chunks = m.encode();
            assert!(chunks.iter().all(|c| c.len() <= CHUNK_MAX && is_ours(c)));
            assert_eq!(chunks.len() > 1, n > 300);
            let mut r = Reassembler::default();
            let mut out = None;
            for (i, c) in chunks.iter().enumerate() {
                let got = r.feed("gen0", c, now).unwrap();
                assert_eq!(got.is_some(), i + 1 == chunks.len());
                out = got;
            }
            assert_eq!(out, Some(m));
        }
    }

    #[test]
    fn interleaved_senders_reassemble_separately() {
        let now = Instant::now();
        let (a, b) = (Msg::Request(info(1000)), Msg::Request(info(700)));
        let (ca, cb) = (a.encode(), b.encode());
        let mut r = Reassembler::default();
        let mut got = Vec::new();
        for i in 0..ca.len().max(cb.len()) {
            if let Some(c) = ca.get(i) {
                got.extend(r.feed("a", c, now).unwrap());
            }
            if let Some(c) = cb.get(i) {
                got.extend(r.feed("b", c, now).unwrap());
            }
        }
        assert!(got.contains(&a) && got.contains(&b));
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        let now = Instant::now();
        let mut r = Reassembler::default();
        assert!(r.feed("x", b"hello", now).is_err());
        let mut c = Msg::Ready { request_id: 1 }.encode().remove(0);
        c[4] = 9;
        assert!(r.feed("x", &c, now).is_err());
        let mut c = Msg::Ready { request_id: 1 }.encode().remove(0);
        c.truncate(HEADER + 1);
        assert!(r.feed("x", &c, now).is_err());
        // A chunk out of order drops the partial message.
        let chunks = Msg::Request(info(3000)).encode();
        assert!(chunks.len() >= 3);
        assert!(r.feed("y", &chunks[1], now).is_err());
        assert!(r.feed("y", &chunks[0], now).unwrap().is_none());
        assert!(r.feed("y", &chunks[2], now).is_err());
        assert_eq!(r.held(), 0);
    }

    /// A chunk over the documented size, or a message announcing more than
    /// a sender may have in reassembly, is refused at once, holding
    /// nothing; the same sender's next good message decodes.
    #[test]
    fn oversized_chunks_and_messages_are_refused() {
        let now = Instant::now();
        let mut r = Reassembler::with_limits(64 << 10, 1 << 20);
        let mut huge = Msg::Ready { request_id: 1 }.encode().remove(0);
        huge.resize(16 << 20, 0);
        assert!(r.feed("x", &huge, now).is_err());
        // 64 KiB allows 17 chunks; a message of 100 chunks is refused at
        // its first.
        let big = Msg::Request(info(20_000)).encode();
        assert!(big.len() > 17);
        assert!(r.feed("x", &big[0], now).is_err());
        assert_eq!(r.held(), 0);
        let ok = Msg::Request(info(2_000));
        let mut got = None;
        for c in ok.encode() {
            got = r.feed("x", &c, now).unwrap();
        }
        assert_eq!(got, Some(ok));
        assert_eq!(r.held(), 0);
    }

    /// The senders' partial messages share one budget: a chunk that would
    /// pass it drops the largest holder (the oldest among equals), one-chunk
    /// messages always decode, and the others complete.
    #[test]
    fn reassembly_is_bounded_across_senders() {
        let now = Instant::now();
        let m = Msg::Request(info(2_000));
        let chunks = m.encode();
        assert_eq!(chunks.len(), 4);
        let per = CHUNK_MAX - HEADER;
        // Room for four and a half full chunks in all.
        let mut r = Reassembler::with_limits(1 << 20, 4 * per + per / 2);
        for from in ["a", "b"] {
            for c in &chunks[..2] {
                assert!(r.feed(from, c, now).unwrap().is_none());
            }
        }
        assert_eq!(r.held(), 4 * per);
        // `c` holds least: `a` (as large as `b`, and older) makes room.
        assert!(r.feed("c", &chunks[0], now).unwrap().is_none());
        assert_eq!((r.held_from("a"), r.held_from("c")), (0, per));
        assert_eq!(r.dropped(), 1);
        let small = Msg::Ready { request_id: 9 };
        assert_eq!(r.feed("d", &small.encode()[0], now).unwrap(), Some(small));
        assert!(r.feed("a", &chunks[2], now).is_err(), "its partial is gone");
        assert!(r.feed("b", &chunks[2], now).unwrap().is_none());
        // `b` now holds the most: `c`'s next chunk drops it, and `c`'s
        // message completes.
        assert!(r.feed("c", &chunks[1], now).unwrap().is_none());
        assert_eq!((r.held_from("b"), r.dropped()), (0, 2));
        assert!(r.feed("c", &chunks[2], now).unwrap().is_none());
        assert_eq!(r.feed("c", &chunks[3], now).unwrap(), Some(m));
        assert_eq!(r.held(), 0);
        // The largest holder feeding past the budget is refused.
        for from in ["a", "b"] {
            for c in &chunks[..2] {
                assert!(r.feed(from, c, now).unwrap().is_none());
            }
        }
        assert!(r.feed("b", &chunks[2], now).is_err());
        assert_eq!((r.held_from("a"), r.held_from("b")), (2 * per, 0));
    }

    /// Five senders holding the whole budget in partial messages keep no
    /// one else out: another sender's message of several chunks completes
    /// (the largest holders dropped as it needs room), and a hog that feeds
    /// more while it holds the most is refused.
    #[test]
    fn hogs_cannot_keep_others_out() {
        let now = Instant::now();
        let per = CHUNK_MAX - HEADER;
        let big = Msg::Request(info(20_000)).encode();
        assert!(big.len() > 20);
        let mut r = Reassembler::with_limits(1 << 20, 40 * per);
        for h in 0..5 {
            for c in &big[..8] {
                assert!(r.feed(&format!("hog{h}"), c, now).unwrap().is_none());
            }
        }
        assert_eq!(r.held(), 40 * per);
        let m = Msg::Request(info(2_000));
        let mut got = None;
        for c in m.encode() {
            got = r.feed("honest", &c, now).unwrap();
        }
        assert_eq!(got, Some(m));
        let evicted = (0..5)
            .filter(|h| r.held_from(&format!("hog{h}")) == 0)
            .count();
        assert_eq!(evicted as u64, r.dropped());
        assert!((1..5).contains(&evicted), "{evicted}");
        // A hog that grows past the others is the one dropped.
        let hog = (0..5)
            .map(|h| format!("hog{h}"))
            .find(|h| r.held_from(h) > 0)
            .unwrap();
        let mut refused = false;
        for c in &big[8..] {
            if r.feed(&hog, c, now).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused, "a hog filled the budget alone");
        assert_eq!(r.held_from(&hog), 0);
        assert!(r.held() <= 40 * per);
    }

    /// A partial message that gets no chunk for its TTL is dropped (and its
    /// sender's next chunk is out of order); forgetting a sender drops its.
    #[test]
    fn partial_messages_expire_and_go_with_their_sender() {
        let t0 = Instant::now();
        let ttl = std::time::Duration::from_secs(10);
        let chunks = Msg::Request(info(2_000)).encode();
        let mut r = Reassembler::default().with_ttl(ttl);
        assert_eq!(r.next_expiry(), None);
        assert!(r.feed("a", &chunks[0], t0).unwrap().is_none());
        let t1 = t0 + ttl / 2;
        assert!(r.feed("b", &chunks[0], t1).unwrap().is_none());
        assert!(r.feed("a", &chunks[1], t1).unwrap().is_none());
        assert_eq!(r.next_expiry(), Some(t1 + ttl));
        assert_eq!(r.expire(t1 + ttl / 2), 0);
        assert_eq!(r.expire(t1 + ttl), 2);
        assert_eq!((r.held(), r.dropped()), (0, 2));
        assert!(r.feed("a", &chunks[2], t1 + ttl).is_err());
        assert!(r.feed("c", &chunks[0], t1 + ttl).unwrap().is_none());
        r.forget("c");
        r.forget("nobody");
        assert_eq!((r.held(), r.dropped()), (0, 3));
    }
}
