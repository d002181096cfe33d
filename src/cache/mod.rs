//! KV-cache transfer between a context (prefill) executor and a generation
//! (decode) executor with different parallel layouts (issue 4).
//!
//! This first part holds the pure logic both sides run: each side's
//! [`CacheState`], the compatibility check between two states, the rank
//! mapping (which peer ranks a rank exchanges cache with, which of
//! duplicate replicas sends) and the fragment mapping (which bytes of which
//! context block land where in which generation block, coalesced, with no
//! staging buffer). The sender/receiver protocol builds on it.

mod fragments;
mod mapping;
mod state;

pub use fragments::{Fragment, FragmentStats, RankSlice, distinct_heads, map_blocks, rank_slice};
pub use mapping::{TargetRanks, needs_send, recv_ranks, target_ranks};
pub use state::{Attention, AttentionDp, CacheState, DataType};

/// Errors of the KV-cache layer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
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
}
