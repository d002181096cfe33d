//! The metrics endpoint (cargo feature `metrics-endpoint`): a listener
//! that answers `GET /metrics` with the agent's metrics in the Prometheus
//! text format, one request per connection, each connection on a thread of
//! its own (at most [`MAX_CLIENTS`] at once, shared fairly between
//! addresses, silent clients giving way to new ones) within one deadline from
//! accept to the last byte of the answer, so a client that trickles its
//! request delays no other scrape; stopped when the agent closes.

use std::io::{Read, Write};
use std::time::Instant;

use crate::engine::{Inner, serve_each};
use crate::error::Error;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest request head read.
const MAX_HEAD: usize = 8 << 10;
/// Clients served at once (half of them from one address at most); a
/// new one takes the place of the oldest that has not sent its request
/// (see `serve_each`).
const MAX_CLIENTS: usize = 16;
/// From accept to the last byte of the answer.
const DEADLINE: Duration = Duration::from_secs(2);

/// The endpoint's thread and where it listens.
pub(in crate::engine) struct MetricsServer {
    pub(in crate::engine) addr: SocketAddr,
    /// Another handle on the listening socket, to wake its loop.
    wake: Option<TcpListener>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` and serves until the agent closes.
    pub(in crate::engine) fn start(inner: &Arc<Inner>, addr: SocketAddr) -> Result<Self, Error> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let wake = listener.try_clone().ok();
        let me = Arc::downgrade(inner);
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-metrics-{}", inner.config.name))
            .spawn(move || {
                let stop = || {
                    me.upgrade()
                        .is_none_or(|i| i.closing.load(Ordering::SeqCst))
                };
                serve_each::serve_each(
                    listener.incoming(),
                    (MAX_CLIENTS, MAX_CLIENTS / 2),
                    "kvxfer-metrics-client",
                    &stop,
                    &|s: TcpStream, spoke: &dyn Fn()| {
                        let Some(inner) = me.upgrade() else { return };
                        if let Err(e) = answer(&inner, s, Instant::now() + DEADLINE, spoke) {
                            tracing::debug!(error = %e, "metrics request failed");
                        }
                    },
                );
            })?;
        tracing::info!(agent = %inner.config.name, %addr, "metrics served at /metrics");
        Ok(MetricsServer {
            addr,
            wake,
            thread: Some(thread),
        })
    }

    /// Stops the thread (the agent is closing: it sees that once woken).
    pub(in crate::engine) fn stop(&mut self) {
        serve_each::wake_listener(self.wake.as_ref(), self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What is left until `deadline`; an error once it has passed.
fn left(deadline: Instant) -> io::Result<Option<Duration>> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    Ok(Some(left))
}

/// Reads one request and answers it, all by `deadline`.
fn answer(inner: &Inner, mut s: TcpStream, deadline: Instant, spoke: &dyn Fn()) -> io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        s.set_read_timeout(left(deadline)?)?;
        let n = s.read(&mut buf)?;
        if n == 0 || head.len() + n > MAX_HEAD {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    spoke();
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, path) = (words.next(), words.next());
    let (status, body) = match (method, path) {
        (Some(b"GET"), Some(b"/metrics")) => ("200 OK", inner.render_metrics()),
        _ => ("404 Not Found", "only GET /metrics is served\n".to_owned()),
    };
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut out = msg.as_bytes();
    while !out.is_empty() {
        s.set_write_timeout(left(deadline)?)?;
        match s.write(out) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => out = &out[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
