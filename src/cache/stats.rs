//! Per-request timings of a transfer session (written as CSV by
//! `timings`).

#![forbid(unsafe_code)]

use std::time::Duration;

/// One peer's share of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerMeasure {
    /// The peer's rank on the other side.
    pub peer_rank: u32,
    /// From the session's start to this peer's first byte posted (sender)
    /// or its `Ready` (receiver).
    pub delay: Duration,
    /// From then to the last byte landing (sender: the completion of the
    /// last write; receiver: the `Done` message).
    pub duration: Duration,
    /// Bytes of the share.
    pub bytes: u64,
}

impl PeerMeasure {
    /// Gbit/s over `duration`.
    pub fn gbps(&self) -> f64 {
        let s = self.duration.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 * 8.0 / s / 1e9
        } else {
            0.0
        }
    }
}

/// What one side measured for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionStats {
    /// The request.
    pub request_id: u64,
    /// Sender: from `send` until every counterpart's request info had
    /// arrived (zero when they came first). Receiver: from `request` until
    /// every request info was handed to the transport.
    pub request_info: Duration,
    /// Time spent computing the rank and fragment mapping.
    pub mapping: Duration,
    /// Sender: loading peers and announcing `Ready`. Receiver: zero.
    pub preprocess: Duration,
    /// From the first byte posted (or the first `Ready`) to the last share
    /// landing.
    pub transmission: Duration,
    /// Bookkeeping after the last share (completing the handle).
    pub postprocess: Duration,
    /// Per peer.
    pub peers: Vec<PeerMeasure>,
    /// Bytes moved (sum over peers).
    pub bytes: u64,
    /// Fragments before coalescing.
    pub fragments: u64,
    /// Fragments posted (after coalescing).
    pub fragments_coalesced: u64,
    /// Copies of KV bytes the library made (staging buffers): always 0 on
    /// these paths, which write pool to pool; counted so that a path that
    /// copies would show.
    pub staging_copies: u64,
}

/// Running totals of one sender or receiver, for a metrics exporter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Requests completed.
    pub completed: u64,
    /// Requests cancelled (by either side).
    pub cancelled: u64,
    /// Requests failed otherwise (timeouts, transport errors).
    pub failed: u64,
    /// Bytes moved by completed requests.
    pub bytes: u64,
    /// Fragments before coalescing.
    pub fragments: u64,
    /// Fragments posted.
    pub fragments_coalesced: u64,
    /// Staging copies of KV bytes (0 on every path so far).
    pub staging_copies: u64,
    /// Messages about a request from an agent that is not one of its
    /// parties (a context rank that does not send or was not asked, a
    /// generation agent that did not ask for it): dropped, never acted on.
    pub strangers: u64,
    /// Partial messages (of several chunks) dropped unfinished: expired,
    /// evicted for a fair share of the reassembly budget, or malformed.
    pub partials_dropped: u64,
    /// Requests whose failure or cancel was reported
    /// [`Unsettled`](crate::cache::CacheError::Unsettled): a context rank
    /// did not confirm in time that it stopped writing.
    pub unsettled: u64,
    /// `Cancel`s sent again to context ranks that had not confirmed that
    /// they stopped (the first, or its answer, may have been lost).
    pub cancels_resent: u64,
}

impl Metrics {
    /// Counts a completed request.
    pub(crate) fn record_completed(&mut self, s: &SessionStats) {
        self.completed += 1;
        self.bytes += s.bytes;
        self.fragments += s.fragments;
        self.fragments_coalesced += s.fragments_coalesced;
        self.staging_copies += s.staging_copies;
    }

    /// Counts a request that ended without completing: cancelled or
    /// failed.
    pub(crate) fn record_ended(&mut self, cancelled: bool) {
        if cancelled {
            self.cancelled += 1;
        } else {
            self.failed += 1;
        }
    }
}
