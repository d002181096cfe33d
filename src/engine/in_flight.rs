//! The agent's request ids and its count of requests in flight: shared by
//! the engine (which refuses a request past the limit) and its links
//! (which start requests, also for prepared transfers posted again without
//! the engine).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use crate::agent::{Completion, Progress};
use crate::metrics::Meter;

/// Request ids and the count of requests whose outcome is not in.
pub(in crate::engine) struct InFlight {
    next: AtomicU64,
    /// Raised by each request's completion when made, lowered when it
    /// finishes (the completion holds it).
    count: Arc<AtomicUsize>,
}

impl InFlight {
    pub(in crate::engine) fn new() -> Arc<Self> {
        Arc::new(Self {
            next: AtomicU64::new(1),
            count: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// A new request id (never 0).
    pub(in crate::engine) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Requests in flight now.
    pub(in crate::engine) fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// A request's status, counted in flight and, once it finishes, in
    /// `meter` (a request of `bytes`); its waiters drive `driver` (`None`:
    /// the link's threads complete it).
    pub(in crate::engine) fn completion(
        &self,
        driver: Option<Weak<dyn Progress>>,
        meter: &Arc<Meter>,
        bytes: u64,
    ) -> Arc<Completion> {
        Completion::counted(driver, Some(&self.count)).metered(Some(meter), bytes)
    }

    /// A new request: its id and its status, driven by nothing (see
    /// [`completion`](Self::completion)).
    pub(in crate::engine) fn start(
        &self,
        meter: &Arc<Meter>,
        bytes: u64,
    ) -> (u64, Arc<Completion>) {
        (self.next_id(), self.completion(None, meter, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_differ_and_the_count_follows_completions() {
        let f = InFlight::new();
        let meter = crate::metrics::Metrics::new("t", &Default::default())
            .meter(crate::agent::TransportKind::Tcp, "p");
        let (a, ca) = f.start(&meter, 8);
        let (b, cb) = f.start(&meter, 8);
        assert_ne!(a, b);
        assert_ne!(a, 0);
        assert_eq!(f.count(), 2);
        ca.complete(Ok(()));
        assert_eq!(f.count(), 1);
        cb.complete(Err(crate::error::Error::Closed));
        assert_eq!(f.count(), 0);
    }
}
