//! KV-cache transfer between a context (prefill) executor and a generation
//! (decode) executor with different parallel layouts (issue 4).
//!
//! This first part holds the pure logic both sides run: each side's
//! [`CacheState`], the compatibility check between two states, the rank
//! mapping (which peer ranks a rank exchanges cache with, which of
//! duplicate replicas sends) and the fragment mapping (which bytes of which
//! context block land where in which generation block, coalesced, with no
//! staging buffer). The sender/receiver protocol builds on it.
//!
//! # Block layout
//!
//! Both sides' pools hold blocks of `tokens_per_block` tokens, each block
//! laid out as `[layer][k|v][head][token][dim]`, C order, for the layers
//! and heads of the rank that holds it:
//!
//! - `layer`: the rank's PP stage's layers, in model order;
//! - `k|v`: the attention's K/V factor (2: K then V; MLA: 1 or 2);
//! - `head`: the rank's KV heads per layer ([`CacheState::heads_per_rank`]);
//! - `token`: `tokens_per_block` slots;
//! - `dim`: `head_size` elements of `dtype`.
//!
//! A block is thus `layers × kv_factor × heads × tokens_per_block ×
//! head_size × dtype size` bytes ([`RankSlice::block_bytes`]) and starts at
//! the address given for it. A transfer moves whole token rows: every
//! `tokens_per_block` slot of each block, including the slots past the
//! prompt's last token in its last block. **Those padding slots of the
//! destination's last block are overwritten** with whatever the context
//! side's block holds there; the generation engine must not keep data in
//! them (it writes the next tokens there anyway).

mod fragments;
mod lookup;
pub mod machine;
mod mapping;
pub mod pattern;
mod receiver;
mod sender;
mod state;
mod stats;
pub mod wire;

pub use fragments::{
    Fragment, FragmentStats, RankSlice, distinct_heads, map_blocks, map_layers, rank_slice,
};
pub use lookup::{BlockLookup, MemBlockLookup};
#[cfg(feature = "fuzzing")]
pub use machine::context_plan;
pub use machine::{ReceiverEvent, ReceiverMachine, SenderEvent, SenderMachine};
pub use mapping::{TargetRanks, needs_send, recv_ranks, target_ranks};
pub use receiver::{CacheReceiver, ReceiverConfig, RecvHandle, RecvRequest};
pub use sender::{CacheSender, SendHandle, SenderConfig};
pub use state::{Attention, AttentionDp, CacheState, DataType};
pub use stats::{Metrics, PeerMeasure, SessionStats};

/// `layers` as a non-empty part of the model layers a rank holds (`held`).
///
/// # Errors
/// [`CacheError::LayersOutOfRange`] otherwise.
pub(crate) fn check_within(
    layers: &std::ops::Range<u32>,
    held: std::ops::Range<u32>,
) -> Result<(), CacheError> {
    if layers.is_empty() || layers.start < held.start || layers.end > held.end {
        return Err(CacheError::LayersOutOfRange {
            layers: layers.clone(),
            held,
        });
    }
    Ok(())
}

/// Errors of the KV-cache layer.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// A cache state is inconsistent on its own.
    #[error("invalid cache state: {0}")]
    InvalidState(String),
    /// The two sides' cache states cannot be mapped onto each other.
    #[error("context and generation caches differ in {field}: {context} vs {generation}")]
    Incompatible {
        /// The field that differs.
        field: &'static str,
        /// Its value on the context side.
        context: String,
        /// Its value on the generation side.
        generation: String,
    },
    /// A peer sent something this protocol cannot accept.
    #[error("protocol violation by {peer}: {detail}")]
    Protocol {
        /// The peer's agent name.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// A wait ran out.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The timeout.
        after: std::time::Duration,
    },
    /// The request was cancelled (by either side) before it completed.
    #[error("request {request_id} cancelled: {reason}")]
    Cancelled {
        /// The request.
        request_id: u64,
        /// Who cancelled, or why.
        reason: String,
    },
    /// A request id already in use on this side.
    #[error("request {0} is already in progress")]
    DuplicateRequest(u64),
    /// A request id this side does not know.
    #[error("unknown request {0}")]
    UnknownRequest(u64),
    /// The block lookup does not know a key (partial reuse).
    #[error("no block with key {0:#x} in the block lookup")]
    UnknownBlockKey(u64),
    /// The transport failed.
    #[error("transfer failed: {0}")]
    Transfer(#[from] crate::Error),
    /// Layers named that this rank does not hold (or an empty range).
    #[error("layers {layers:?} are not a non-empty part of this rank's layers {held:?}")]
    LayersOutOfRange {
        /// The layers named.
        layers: std::ops::Range<u32>,
        /// The model layers this rank holds.
        held: std::ops::Range<u32>,
    },
    /// The sender or receiver is shut down.
    #[error("the cache sender or receiver is closed")]
    Closed,
}
