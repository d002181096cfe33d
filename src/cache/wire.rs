//! Control messages of the KV-cache protocol. They travel as the agents'
//! sync messages (so a `Done` that closes a share arrives after that
//! share's data), postcard-encoded behind a 4-byte magic and a version, in
//! chunks of at most [`CHUNK_MAX`] bytes (RDMA sync messages are bounded)
//! that the receiving side reassembles per sending agent (an agent
//! delivers one sender's messages in order).

#![forbid(unsafe_code)]

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{CacheError, CacheState};

const MAGIC: [u8; 4] = *b"KVXC";
const VERSION: u8 = 2;
/// Header: magic, version, chunk index (u16), chunk count (u16).
const HEADER: usize = 4 + 1 + 2 + 2;
/// Largest chunk on the wire, header included.
pub const CHUNK_MAX: usize = 4000;

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
    /// Context → generation: all of this peer's share landed (sent as the
    /// sync message of the last write, so it arrives after the data).
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
    },
    /// Generation → context: cancel this request.
    Cancel {
        /// The request.
        request_id: u64,
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
            | Msg::Cancel { request_id } => *request_id,
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
                c.extend_from_slice(part);
                c
            })
            .collect()
    }
}

/// Whether a sync message belongs to this protocol.
pub fn is_ours(chunk: &[u8]) -> bool {
    chunk.len() >= HEADER && chunk[..4] == MAGIC
}

/// Reassembles chunks per sending agent.
#[derive(Default)]
pub struct Reassembler {
    partial: HashMap<String, (u16, Vec<u8>)>,
}

impl Reassembler {
    /// As [`feed`](Self::feed) for a sync message of any kind: another
    /// protocol's is skipped, a malformed one dropped with a warning.
    pub fn accept(&mut self, from: &str, chunk: &[u8]) -> Option<Msg> {
        if !is_ours(chunk) {
            return None;
        }
        self.feed(from, chunk)
            .inspect_err(|e| tracing::warn!(%e, "dropping a KV-cache message"))
            .ok()
            .flatten()
    }

    /// Feeds one chunk from `from`; returns a whole message when this chunk
    /// completes one.
    ///
    /// # Errors
    /// [`CacheError::Protocol`] for a malformed chunk or message (the
    /// partial message from that sender is dropped).
    pub fn feed(&mut self, from: &str, chunk: &[u8]) -> Result<Option<Msg>, CacheError> {
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
        let idx = u16::from_le_bytes([chunk[5], chunk[6]]);
        let count = u16::from_le_bytes([chunk[7], chunk[8]]);
        let part = &chunk[HEADER..];
        let entry = self.partial.entry(from.to_owned()).or_default();
        if idx != entry.0 || idx >= count {
            self.partial.remove(from);
            return Err(bad(&format!("chunk {idx} of {count} out of order")));
        }
        entry.1.extend_from_slice(part);
        entry.0 += 1;
        if entry.0 < count {
            return Ok(None);
        }
        let (_, body) = self.partial.remove(from).unwrap_or_default();
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
        }
    }

    #[test]
    fn round_trip_small_and_chunked() {
        for n in [1, 300, 4096] {
            let m = Msg::Request(info(n));
            let chunks = m.encode();
            assert!(chunks.iter().all(|c| c.len() <= CHUNK_MAX && is_ours(c)));
            assert_eq!(chunks.len() > 1, n > 300);
            let mut r = Reassembler::default();
            let mut out = None;
            for (i, c) in chunks.iter().enumerate() {
                let got = r.feed("gen0", c).unwrap();
                assert_eq!(got.is_some(), i + 1 == chunks.len());
                out = got;
            }
            assert_eq!(out, Some(m));
        }
    }

    #[test]
    fn interleaved_senders_reassemble_separately() {
        let (a, b) = (Msg::Request(info(1000)), Msg::Request(info(700)));
        let (ca, cb) = (a.encode(), b.encode());
        let mut r = Reassembler::default();
        let mut got = Vec::new();
        for i in 0..ca.len().max(cb.len()) {
            if let Some(c) = ca.get(i) {
                got.extend(r.feed("a", c).unwrap());
            }
            if let Some(c) = cb.get(i) {
                got.extend(r.feed("b", c).unwrap());
            }
        }
        assert!(got.contains(&a) && got.contains(&b));
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        let mut r = Reassembler::default();
        assert!(r.feed("x", b"hello").is_err());
        let mut c = Msg::Ready { request_id: 1 }.encode().remove(0);
        c[4] = 9;
        assert!(r.feed("x", &c).is_err());
        let mut c = Msg::Ready { request_id: 1 }.encode().remove(0);
        c.truncate(HEADER + 1);
        assert!(r.feed("x", &c).is_err());
        // A chunk out of order drops the partial message.
        let chunks = Msg::Request(info(3000)).encode();
        assert!(chunks.len() >= 3);
        assert!(r.feed("y", &chunks[1]).is_err());
        assert!(r.feed("y", &chunks[0]).unwrap().is_none());
        assert!(r.feed("y", &chunks[2]).is_err());
    }
}
