//! The agent's metrics for operators: per transport and peer, requests
//! finished by outcome (success, or the failure's cause), bytes moved, and
//! (when timing is on, [`AgentConfig::metrics`](crate::AgentConfig)) a
//! histogram of request latency from submission to completion; rendered in
//! the Prometheus text exposition format
//! ([`TransferAgent::metrics_text`](crate::TransferAgent::metrics_text)),
//! and served over HTTP at `/metrics` when
//! [`MetricsConfig::listen`] is set (cargo feature `metrics-endpoint`).
//!
//! Counters are relaxed atomic additions on the completion path; latency
//! costs two clock reads a request, so it is recorded only when asked for.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::agent::TransportKind;
use crate::error::Error;

/// What the agent measures and where it serves the figures.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct MetricsConfig {
    /// Record each request's latency (two clock reads a request). Counters
    /// are always kept. Default off; on when `listen` is set.
    pub timing: bool,
    /// Serve the Prometheus text at `http://<listen>/metrics` (feature
    /// `metrics-endpoint`). Default none.
    pub listen: Option<SocketAddr>,
}

/// Upper bounds of the latency buckets, in seconds.
const BOUNDS: [f64; 18] = [
    5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
    100e-3, 250e-3, 500e-3, 1.0, 5.0,
];

/// Failure causes, as the `outcome` label names them.
const CAUSES: [&str; 11] = [
    "rejected",
    "peer_gone",
    "connection_lost",
    "timeout",
    "aborted",
    "closed",
    "rdma",
    "storage",
    "io",
    "other",
    "integrity",
];

/// The `outcome` label of a failure.
fn cause(e: &Error) -> usize {
    match e {
        Error::RemoteRejected { .. } => 0,
        Error::PeerGone { .. } => 1,
        Error::ConnectionLost { .. } | Error::Connect { .. } | Error::StaleAgent { .. } => 2,
        Error::Timeout { .. } | Error::PeerTimedOut { .. } => 3,
        Error::Aborted => 4,
        Error::Closed => 5,
        Error::Rdma { .. } | Error::RdmaCompletion { .. } => 6,
        Error::Storage { .. } | Error::Misaligned { .. } => 7,
        Error::Io(_) => 8,
        Error::Integrity { .. } => 10,
        _ => 9,
    }
}

/// The figures of one (transport, peer).
#[derive(Debug)]
pub(crate) struct Meter {
    transport: TransportKind,
    peer: String,
    ok: AtomicU64,
    bytes: AtomicU64,
    failed: [AtomicU64; CAUSES.len()],
    /// Per bucket (the last: above every bound).
    buckets: [AtomicU64; BOUNDS.len() + 1],
    sum_ns: AtomicU64,
    timing: bool,
}

impl Meter {
    /// Whether requests should note their start time for it.
    pub(crate) fn timing(&self) -> bool {
        self.timing
    }

    /// Records a finished request: its outcome, its bytes, and its
    /// latency when timed.
    pub(crate) fn record(&self, outcome: Result<(), &Error>, bytes: u64, took: Option<Duration>) {
        match outcome {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                self.bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            Err(e) => {
                self.failed[cause(e)].fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(d) = took {
            let s = d.as_secs_f64();
            let i = BOUNDS.iter().position(|&b| s <= b).unwrap_or(BOUNDS.len());
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
            self.sum_ns.fetch_add(
                d.as_nanos().min(u128::from(u64::MAX)) as u64,
                Ordering::Relaxed,
            );
        }
    }
}

/// A counter a transport keeps of its own, rendered with the agent's
/// label.
pub(crate) struct Counter {
    /// Its metric name (`kvxfer_..._total`).
    pub(crate) name: &'static str,
    /// Its help text.
    pub(crate) help: &'static str,
    /// Its value now.
    pub(crate) value: u64,
    /// Labels beside the agent's (`name`, value), for counters kept per
    /// device; counters of one name come one after another.
    pub(crate) labels: Vec<(&'static str, String)>,
}

/// An agent's meters, one per (transport, peer) it has sent requests on.
#[derive(Debug)]
pub(crate) struct Metrics {
    agent: String,
    timing: bool,
    meters: Mutex<Vec<Arc<Meter>>>,
    /// Checked WRITE pieces landed here (as a target) whose bytes did not
    /// match their CRC32C; an initiator counts its failed requests under
    /// the `integrity` outcome.
    pub(crate) integrity_failures: AtomicU64,
}

/// A label value escaped for the text format.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    pub(crate) fn new(agent: &str, cfg: &MetricsConfig) -> Self {
        Metrics {
            agent: agent.to_owned(),
            timing: cfg.timing || cfg.listen.is_some(),
            meters: Mutex::new(Vec::new()),
            integrity_failures: AtomicU64::new(0),
        }
    }

    /// The meter of (`transport`, `peer`), made on first use.
    pub(crate) fn meter(&self, transport: TransportKind, peer: &str) -> Arc<Meter> {
        let mut m = self.meters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = m
            .iter()
            .find(|x| x.transport == transport && x.peer == peer)
        {
            return Arc::clone(found);
        }
        let new = Arc::new(Meter {
            transport,
            peer: peer.to_owned(),
            ok: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            failed: Default::default(),
            buckets: Default::default(),
            sum_ns: AtomicU64::new(0),
            timing: self.timing,
        });
        m.push(Arc::clone(&new));
        new
    }

    /// Everything, in the Prometheus text exposition format (0.0.4);
    /// `in_flight`: the agent's requests not finished; `counters`: those
    /// its transports keep of their own.
    pub(crate) fn render(&self, in_flight: usize, counters: &[Counter]) -> String {
        let meters = self
            .meters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let agent = esc(&self.agent);
        let mut o = String::new();
        let _ = writeln!(
            o,
            "# HELP kvxfer_requests_in_flight Requests submitted and not finished.\n\
             # TYPE kvxfer_requests_in_flight gauge\n\
             kvxfer_requests_in_flight{{agent=\"{agent}\"}} {in_flight}"
        );
        let (copies, bytes) = crate::gpu::staging_copies();
        let _ = writeln!(
            o,
            "# HELP kvxfer_gpu_staging_copies_total Copies between GPU memory and pinned host \
             buffers (GPU memory moved over TCP), in this process.\n\
             # TYPE kvxfer_gpu_staging_copies_total counter\n\
             kvxfer_gpu_staging_copies_total {copies}\n\
             # HELP kvxfer_gpu_staging_bytes_total Bytes of those copies.\n\
             # TYPE kvxfer_gpu_staging_bytes_total counter\n\
             kvxfer_gpu_staging_bytes_total {bytes}"
        );
        let _ = writeln!(
            o,
            "# HELP kvxfer_callback_panics_total Completion callbacks (on_complete) that \
             panicked, in this process: caught and logged, the library goes on.\n\
             # TYPE kvxfer_callback_panics_total counter\n\
             kvxfer_callback_panics_total {}",
            crate::callbacks::panics()
        );
        let _ = writeln!(
            o,
            "# HELP kvxfer_integrity_failures_total Checked WRITE pieces (end-to-end integrity) \
             landed here whose bytes did not match their CRC32C; the initiator's requests \
             fail with the outcome integrity.\n\
             # TYPE kvxfer_integrity_failures_total counter\n\
             kvxfer_integrity_failures_total{{agent=\"{agent}\"}} {}",
            self.integrity_failures.load(Ordering::Relaxed)
        );
        let mut named = None;
        for c in counters {
            if named != Some(c.name) {
                let _ = writeln!(
                    o,
                    "# HELP {n} {h}\n# TYPE {n} counter",
                    n = c.name,
                    h = c.help
                );
                named = Some(c.name);
            }
            let mut labels = String::new();
            for (k, v) in &c.labels {
                let _ = write!(labels, ",{k}=\"{}\"", esc(v));
            }
            let _ = writeln!(
                o,
                "{n}{{agent=\"{agent}\"{labels}}} {v}",
                n = c.name,
                v = c.value
            );
        }
        let _ = writeln!(
            o,
            "# HELP kvxfer_requests_total Requests finished, by transport, peer and outcome \
             (ok, or the failure's cause).\n# TYPE kvxfer_requests_total counter"
        );
        for m in &meters {
            let l = format!(
                "agent=\"{agent}\",transport=\"{}\",peer=\"{}\"",
                m.transport,
                esc(&m.peer)
            );
            let _ = writeln!(
                o,
                "kvxfer_requests_total{{{l},outcome=\"ok\"}} {}",
                m.ok.load(Ordering::Relaxed)
            );
            for (i, c) in CAUSES.iter().enumerate() {
                let n = m.failed[i].load(Ordering::Relaxed);
                if n > 0 {
                    let _ = writeln!(o, "kvxfer_requests_total{{{l},outcome=\"{c}\"}} {n}");
                }
            }
        }
        let _ = writeln!(
            o,
            "# HELP kvxfer_bytes_total Bytes of the requests that succeeded.\n\
             # TYPE kvxfer_bytes_total counter"
        );
        for m in &meters {
            let _ = writeln!(
                o,
                "kvxfer_bytes_total{{agent=\"{agent}\",transport=\"{}\",peer=\"{}\"}} {}",
                m.transport,
                esc(&m.peer),
                m.bytes.load(Ordering::Relaxed)
            );
        }
        if self.timing {
            let _ = writeln!(
                o,
                "# HELP kvxfer_request_duration_seconds Submission to completion.\n\
                 # TYPE kvxfer_request_duration_seconds histogram"
            );
            for m in &meters {
                let l = format!(
                    "agent=\"{agent}\",transport=\"{}\",peer=\"{}\"",
                    m.transport,
                    esc(&m.peer)
                );
                let mut cum = 0;
                for (i, b) in BOUNDS.iter().enumerate() {
                    cum += m.buckets[i].load(Ordering::Relaxed);
                    let _ = writeln!(
                        o,
                        "kvxfer_request_duration_seconds_bucket{{{l},le=\"{b:e}\"}} {cum}"
                    );
                }
                cum += m.buckets[BOUNDS.len()].load(Ordering::Relaxed);
                let _ = writeln!(
                    o,
                    "kvxfer_request_duration_seconds_bucket{{{l},le=\"+Inf\"}} {cum}\n\
                     kvxfer_request_duration_seconds_sum{{{l}}} {}\n\
                     kvxfer_request_duration_seconds_count{{{l}}} {cum}",
                    m.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
                );
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let m = Metrics::new(
            "a\"b",
            &MetricsConfig {
                timing: true,
                listen: None,
            },
        );
        let t = m.meter(TransportKind::Tcp, "peer-1");
        t.record(Ok(()), 100, Some(Duration::from_micros(3)));
        t.record(Ok(()), 50, Some(Duration::from_millis(2)));
        t.record(Err(&Error::Aborted), 7, Some(Duration::from_secs(9)));
        assert!(Arc::ptr_eq(&t, &m.meter(TransportKind::Tcp, "peer-1")));
        let text = m.render(
            2,
            &[
                Counter {
                    name: "kvxfer_test_things_total",
                    help: "Things.",
                    value: 5,
                    labels: Vec::new(),
                },
                Counter {
                    name: "kvxfer_test_rail_total",
                    help: "By rail.",
                    value: 1,
                    labels: vec![("rail", "0".into())],
                },
                Counter {
                    name: "kvxfer_test_rail_total",
                    help: "By rail.",
                    value: 2,
                    labels: vec![("rail", "1\"".into())],
                },
            ],
        );
        assert_eq!(text.matches("# TYPE kvxfer_test_rail_total").count(), 1);
        let l = "agent=\"a\\\"b\",transport=\"tcp\",peer=\"peer-1\"";
        for line in [
            "kvxfer_requests_in_flight{agent=\"a\\\"b\"} 2".to_owned(),
            "# TYPE kvxfer_test_things_total counter".to_owned(),
            "kvxfer_test_things_total{agent=\"a\\\"b\"} 5".to_owned(),
            "kvxfer_test_rail_total{agent=\"a\\\"b\",rail=\"0\"} 1".to_owned(),
            "kvxfer_test_rail_total{agent=\"a\\\"b\",rail=\"1\\\"\"} 2".to_owned(),
            format!("kvxfer_requests_total{{{l},outcome=\"ok\"}} 2"),
            format!("kvxfer_requests_total{{{l},outcome=\"aborted\"}} 1"),
            format!("kvxfer_bytes_total{{{l}}} 150"),
            format!("kvxfer_request_duration_seconds_bucket{{{l},le=\"5e-6\"}} 1"),
            format!("kvxfer_request_duration_seconds_bucket{{{l},le=\"2.5e-3\"}} 2"),
            format!("kvxfer_request_duration_seconds_bucket{{{l},le=\"5e0\"}} 2"),
            format!("kvxfer_request_duration_seconds_bucket{{{l},le=\"+Inf\"}} 3"),
            format!("kvxfer_request_duration_seconds_count{{{l}}} 3"),
        ] {
            assert!(text.lines().any(|x| x == line), "{line}\n{text}");
        }
        // Without timing, no histogram.
        let plain = Metrics::new("x", &MetricsConfig::default());
        plain
            .meter(TransportKind::Rdma, "p")
            .record(Ok(()), 1, None);
        assert!(!plain.render(0, &[]).contains("duration"));
    }
}
