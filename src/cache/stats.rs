//! Per-request timings of a transfer session, and their export as CSV in
//! the reference transceiver's layout (`rank_<r>_send.csv` /
//! `rank_<r>_recv.csv`: `RequestID` then `Delay(ms),Duration(ms),
//! Bandwidth(Gbps)` per peer).

#![forbid(unsafe_code)]

use std::io::Write;
use std::path::Path;
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

/// Appends a row per session to `<dir>/rank_<rank>_<side>.csv` when `dir`
/// is set; a failure is logged, not returned (timings never fail a
/// transfer).
pub(crate) fn record_timings(dir: Option<&Path>, rank: u32, side: &str, rows: &[SessionStats]) {
    let Some(dir) = dir else {
        return;
    };
    for stats in rows {
        if let Err(e) = append_csv(dir, rank, side, stats) {
            tracing::warn!(%e, side, "cannot write timings");
        }
    }
}

/// Appends one row for `s` to `<dir>/rank_<rank>_<side>.csv`, writing the
/// header first when the file is empty.
///
/// # Errors
/// The file's I/O error.
pub(crate) fn append_csv(
    dir: &Path,
    rank: u32,
    side: &str,
    s: &SessionStats,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("rank_{rank}_{side}.csv"));
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)?;
    let mut out = String::new();
    if f.metadata()?.len() == 0 {
        out.push_str("RequestID");
        for _ in &s.peers {
            out.push_str(",Delay(ms),Duration(ms),Bandwidth(Gbps)");
        }
        out.push('\n');
    }
    out.push_str(&s.request_id.to_string());
    for p in &s.peers {
        out.push_str(&format!(
            ",{:.3},{:.3},{:.3}",
            p.delay.as_secs_f64() * 1e3,
            p.duration.as_secs_f64() * 1e3,
            p.gbps()
        ));
    }
    out.push('\n');
    f.write_all(out.as_bytes())?;
    f.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_has_the_reference_layout() {
        let dir = std::env::temp_dir().join(format!("kvxfer-csv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut s = SessionStats {
            request_id: 7,
            ..Default::default()
        };
        s.peers = vec![
            PeerMeasure {
                peer_rank: 0,
                delay: Duration::from_millis(2),
                duration: Duration::from_millis(8),
                bytes: 1_000_000,
            };
            2
        ];
        append_csv(&dir, 3, "send", &s).unwrap();
        s.request_id = 8;
        append_csv(&dir, 3, "send", &s).unwrap();
        let text = std::fs::read_to_string(dir.join("rank_3_send.csv")).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "RequestID,Delay(ms),Duration(ms),Bandwidth(Gbps),Delay(ms),Duration(ms),Bandwidth(Gbps)"
        );
        assert_eq!(lines[1], "7,2.000,8.000,1.000,2.000,8.000,1.000");
        assert!(lines[2].starts_with("8,"));
        assert_eq!(lines.len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
