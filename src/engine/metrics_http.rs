//! The metrics endpoint (cargo feature `metrics-endpoint`): a thread that
//! answers `GET /metrics` with the agent's metrics in the Prometheus text
//! format, one request per connection, every read and write bounded by a
//! deadline; stopped when the agent closes.

use std::io::{Read, Write};

use super::*;

/// Longest request head read.
const MAX_HEAD: usize = 8 << 10;

/// The endpoint's thread and where it listens.
pub(in crate::engine) struct MetricsServer {
    pub(in crate::engine) addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` and serves until the agent closes.
    pub(in crate::engine) fn start(inner: &Arc<Inner>, addr: SocketAddr) -> Result<Self, Error> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let me = Arc::downgrade(inner);
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-metrics-{}", inner.config.name))
            .spawn(move || {
                for conn in listener.incoming() {
                    let Some(inner) = me.upgrade() else { return };
                    if inner.closing.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Ok(s) = conn
                        && let Err(e) = answer(&inner, s)
                    {
                        tracing::debug!(error = %e, "metrics request failed");
                    }
                }
            })?;
        tracing::info!(agent = %inner.config.name, %addr, "metrics served at /metrics");
        Ok(MetricsServer {
            addr,
            thread: Some(thread),
        })
    }

    /// Stops the thread (the agent is closing: it sees that once woken).
    pub(in crate::engine) fn stop(&mut self) {
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads one request and answers it.
fn answer(inner: &Inner, mut s: TcpStream) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut buf)?;
        if n == 0 || head.len() + n > MAX_HEAD {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next(), words.next());
    let (status, body) = match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => (
            "200 OK",
            inner
                .metrics
                .render(inner.in_flight.load(Ordering::Relaxed)),
        ),
        _ => ("404 Not Found", "only GET /metrics is served\n".to_owned()),
    };
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(msg.as_bytes())
}
