//! The RDMA link's progress threads, one per queue pair: they drain its
//! completion queue whenever no waiter does (large requests), keep out of
//! the way of waiters that poll it themselves (small ones), and leave once
//! the link is broken and nothing is posted.

use crate::engine::rdma;
use crate::engine::rdma::RdmaLink;
use crate::engine::rdma::recv::Backoff;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl RdmaLink {
    /// The progress thread: drains the completion queue whenever nobody
    /// waiting on a request does, so requests complete without waiters
    /// too. Exits when the link is broken and nothing is posted.
    /// `adaptive`: poll, rather than sleep on the completion channel,
    /// while work requests are posted ([`RdmaProgress::Adaptive`](crate::RdmaProgress::Adaptive)).
    pub(in crate::engine) fn run_rdma_progress(self: Arc<Self>, index: usize, adaptive: bool) {
        let Some(conn) = self.parts.qps.get(index) else {
            self.thread_exit();
            return;
        };
        let mut backoff = Backoff::new();
        // The drain count at the last look while parked for waiters.
        let mut seen = u64::MAX;
        loop {
            if self.drain_rdma(conn, false) > 0 {
                // Its own drains are not the waiters'.
                seen = conn.drains.load(Ordering::Relaxed);
                backoff.reset();
                continue;
            }
            if self.is_broken() {
                self.pump(conn);
                if conn.posted.load(Ordering::Acquire) == 0 {
                    break;
                }
            }
            // Read without the queue's lock: the submitting thread holds it
            // across its post, and a progress thread blocking on it there
            // cost both a futex round trip.
            if self.parts.undriven.load(Ordering::Acquire) == 0
                && conn.waiting.load(Ordering::Acquire) == 0
            {
                // Only requests whose waiters poll the completion queue
                // themselves (or none): keep out of their way — a woken
                // progress thread took the CPU from them (soft-RoCE
                // ping-pong 420 µs with it, 200-225 µs without, see
                // docs/benchmarks.md history). Look in every millisecond while work
                // is posted and nobody drained since the last look (a
                // waiter may have given up), every 20 ms while waiters
                // drain (a latency-bound caller: one request, wait, the
                // next) or nothing is posted; submitting a large request
                // wakes the thread at once.
                let drains = conn.drains.load(Ordering::Relaxed);
                let waiters_drain = drains != std::mem::replace(&mut seen, drains);
                let posted = conn.posted.load(Ordering::Acquire) > 0;
                let ms = if posted && !waiters_drain { 1 } else { 20 };
                std::thread::park_timeout(Duration::from_millis(ms));
                backoff.reset();
                continue;
            }
            let posted = conn.posted.load(Ordering::Acquire) > 0;
            match &conn.events {
                // Adaptive: poll while a large request's work is posted.
                Some(_) if adaptive && posted => backoff.wait(true),
                Some(ev) => {
                    // Arm, then poll once more: a completion that came
                    // before arming raises no event.
                    if let Err(e) = ev.arm() {
                        self.fail(rdma::rdma_err(&self.remote, e));
                        backoff.wait(false);
                        continue;
                    }
                    if self.drain_rdma(conn, true) > 0 {
                        continue;
                    }
                    // Bounded, so a broken link is noticed.
                    if let Err(e) = ev.wait(Duration::from_millis(20)) {
                        self.fail(rdma::rdma_err(&self.remote, e));
                        backoff.wait(false);
                    }
                }
                None => backoff.wait(posted),
            }
        }
        self.thread_exit();
    }
}
