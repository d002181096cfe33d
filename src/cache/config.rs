//! What the KV-cache sender and receiver are set up with, and what a
//! receive asks for.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use crate::memory::MemoryType;

/// Settings of a [`CacheSender`](crate::cache::CacheSender).
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// After `send`, how long every counterpart has to ask, and then how
    /// long the writes have to complete (default 60 s).
    pub timeout: Duration,
    /// Bytes per posted write batch (default 64 MiB): cancellation stops
    /// between batches.
    pub batch_bytes: u64,
    /// Write batches in flight per peer (default 4).
    pub batches_in_flight: usize,
    /// Directory for `rank_<r>_send.csv` timings (default none).
    pub timings_dir: Option<PathBuf>,
    /// Memory type of the pool (default DRAM).
    pub mem_type: MemoryType,
    /// Most generation ranks one context rank serves for a request
    /// (default 1,024): each costs a plan and writes of its own, so a
    /// request whose layout maps this rank onto more is refused (answered
    /// `Cancelled`, a failure) before any planning.
    pub max_peer_ranks: usize,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            batch_bytes: 64 << 20,
            batches_in_flight: 4,
            timings_dir: None,
            mem_type: MemoryType::Dram,
            max_peer_ranks: 1024,
        }
    }
}

/// Settings of a [`CacheReceiver`](crate::cache::CacheReceiver).
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// How long a request may take, from `request` to the last share
    /// (default 60 s); also bounds `cancel`.
    pub timeout: Duration,
    /// Once a request failed or was cancelled, how long the context ranks
    /// still writing into its blocks have to confirm that they stopped
    /// (default 10 s). Its outcome waits for them; past this it is
    /// reported as [`CacheError::Unsettled`](crate::cache::CacheError::Unsettled)
    /// (the blocks are not yet safe to reuse) and
    /// [`RecvHandle::wait_settled`](crate::cache::RecvHandle::wait_settled)
    /// waits for the rest.
    pub settle_timeout: Duration,
    /// Directory for `rank_<r>_recv.csv` timings (default none).
    pub timings_dir: Option<PathBuf>,
    /// Memory type of the pool (default DRAM).
    pub mem_type: MemoryType,
    /// End-to-end integrity (default off): the context ranks write with a
    /// CRC32C per piece, checked where it lands, before anything is
    /// reported landed; a mismatch fails the request with
    /// [`CacheError::Integrity`](crate::cache::CacheError::Integrity).
    /// Host memory on every transport (see
    /// [`TransferRequest::integrity`](crate::TransferRequest::integrity));
    /// elsewhere the context ranks refuse the request.
    pub integrity: bool,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            settle_timeout: Duration::from_secs(10),
            timings_dir: None,
            mem_type: MemoryType::Dram,
            integrity: false,
        }
    }
}

/// One request to receive.
#[derive(Clone, Debug)]
pub struct RecvRequest {
    /// The request id (the context side's).
    pub request_id: u64,
    /// The context side's attention-DP group serving it (0 without DP).
    pub ctx_dp_rank: u32,
    /// Destination blocks in this rank's registered pool, oldest first:
    /// the request's last `blocks.len()` blocks land there (earlier ones
    /// are reused locally). Each block is written whole, in the layout of
    /// the [module docs](crate::cache#block-layout), padding slots of the last
    /// block included.
    pub blocks: Vec<u64>,
    /// Key of the sequence's last block, for the context side's block
    /// lookup (partial reuse); `None`: the context side uses the blocks it
    /// was given in `send`.
    pub last_block_key: Option<u64>,
}
