//! The KV-cache layer's error, and the check of a layer range it names.

#![forbid(unsafe_code)]

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
    /// End-to-end integrity ([`ReceiverConfig::integrity`](crate::cache::ReceiverConfig::integrity)):
    /// a context rank's write did not match its checksum where it landed.
    /// The request failed; its blocks hold bytes that must not be used.
    #[error("request {request_id} failed its integrity check: {reason}")]
    Integrity {
        /// The request.
        request_id: u64,
        /// Which context agent, and what failed.
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
    Transfer(#[from] crate::error::Error),
    /// Layers named that this rank does not hold (or an empty range).
    #[error("layers {layers:?} are not a non-empty part of this rank's layers {held:?}")]
    LayersOutOfRange {
        /// The layers named.
        layers: std::ops::Range<u32>,
        /// The model layers this rank holds.
        held: std::ops::Range<u32>,
    },
    /// The request failed or was cancelled (`cause`), and context ranks
    /// that write into its blocks did not confirm that they stopped within
    /// the settle timeout (they stopped answering, or left the cluster):
    /// their writes may still land. The blocks must not be reused until
    /// [`RecvHandle::wait_settled`](crate::cache::RecvHandle::wait_settled)
    /// returns `Ok`.
    #[error(
        "request {request_id} ended ({cause}), but context ranks {ranks:?} did not confirm they stopped writing: its blocks are not safe to reuse yet"
    )]
    Unsettled {
        /// The request.
        request_id: u64,
        /// The context ranks that may still write.
        ranks: Vec<u32>,
        /// Why the request ended.
        #[source]
        cause: Box<CacheError>,
    },
    /// The sender or receiver is shut down.
    #[error("the cache sender or receiver is closed")]
    Closed,
}
