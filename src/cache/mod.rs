//! KV-cache transfer between a context (prefill) executor and a generation
//! (decode) executor with different parallel layouts (issue 4).
//!
//! This first part holds the pure logic both sides run: each side's
//! [`CacheState`], the compatibility check between two states, and the
//! rank mapping (which peer ranks a rank exchanges cache with, which of
//! duplicate replicas sends). The fragment mapping and the sender/receiver
//! protocol build on it.

mod mapping;
mod state;

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
