//! Per-request timings written as CSV files (`timings_dir`) in the
//! reference transceiver's layout (`rank_<r>_send.csv` /
//! `rank_<r>_recv.csv`: `RequestID` then `Delay(ms),Duration(ms),
//! Bandwidth(Gbps)` per peer).

use std::io::Write;
use std::path::Path;

use crate::cache::stats::SessionStats;

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
    use std::time::Duration;

    use super::*;
    use crate::cache::stats::PeerMeasure;

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
