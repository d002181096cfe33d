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

mod config;
mod error;
mod fragments;
mod lookup;
pub mod machine;
mod mapping;
pub mod pattern;
mod receiver;
mod sender;
mod state;
mod stats;
mod timings;
pub mod wire;

pub use config::{ReceiverConfig, RecvRequest, SenderConfig};
pub use error::CacheError;
pub(crate) use error::check_within;
pub use fragments::{
    Fragment, FragmentStats, RankSlice, distinct_heads, map_blocks, map_layers, rank_slice,
};
pub use lookup::{BlockLookup, MemBlockLookup};
#[cfg(any(test, feature = "fuzzing"))]
pub use machine::context_plan;
pub use machine::{ReceiverEvent, ReceiverMachine, SenderEvent, SenderMachine};
pub use mapping::{TargetRanks, needs_send, recv_ranks, target_ranks};
pub use receiver::{CacheReceiver, RecvHandle};
pub use sender::{CacheSender, SendHandle};
pub use state::{Attention, AttentionDp, CacheState, DataType};
pub use stats::{Metrics, PeerMeasure, SessionStats};
