//! Waiting on many transfers at once: a [`CompletionQueue`] collects the
//! outcomes of the statuses it watches as they finish (each a callback of
//! [`TransferStatus::on_complete`], no polling), hands them out in the
//! order they finished, and offers a file descriptor that is readable
//! while any is ready, for event loops (`epoll`, `poll`, Python's asyncio
//! `add_reader`, libuv).

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{EventfdFlags, eventfd};

use crate::error::Error;
use crate::status::TransferStatus;

/// A finished transfer as a [`CompletionQueue`] reports it: the caller's
/// token, and the outcome.
pub type Finished = (u64, Result<(), Error>);

/// Outcomes of watched transfers, in the order they finished.
///
/// ```
/// # use std::time::Duration;
/// # fn f(a: &dyn kvxfer::TransferAgent, reqs: &[kvxfer::TransferRequest]) -> Result<(), kvxfer::Error> {
/// let cq = kvxfer::CompletionQueue::new()?;
/// for (i, r) in reqs.iter().enumerate() {
///     cq.watch(&a.submit_transfer(r)?, i as u64);
/// }
/// let mut left = reqs.len();
/// while left > 0 {
///     for (token, outcome) in cq.wait(Duration::from_secs(10)) {
///         outcome?;
///         left -= 1;
///         let _ = token;
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CompletionQueue {
    inner: Arc<Queue>,
}

#[derive(Debug)]
struct Queue {
    ready: Mutex<VecDeque<Finished>>,
    cv: Condvar,
    /// An eventfd, non-zero exactly while `ready` holds something (written
    /// when it becomes non-empty, read when it is emptied, both under
    /// `ready`'s lock).
    fd: OwnedFd,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Finished>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, f: Finished) {
        let mut ready = self.lock();
        if ready.is_empty() {
            // Cannot fail short of a counter at its maximum (never: it
            // only ever holds 0 or 1).
            let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
        }
        ready.push_back(f);
        self.cv.notify_all();
    }

    /// Takes up to `max` of `ready` (the lock held).
    fn drain(&self, ready: &mut VecDeque<Finished>, max: usize) -> Vec<Finished> {
        if ready.is_empty() || max == 0 {
            return Vec::new();
        }
        let n = max.min(ready.len());
        if n == ready.len() {
            let mut b = [0u8; 8];
            // Resets the counter (non-blocking: nothing to read is harmless).
            let _ = rustix::io::read(&self.fd, &mut b);
        }
        ready.drain(..n).collect()
    }
}

impl CompletionQueue {
    /// An empty queue.
    ///
    /// # Errors
    /// [`Error::Io`] when the kernel gives no eventfd (out of descriptors).
    pub fn new() -> Result<Self, Error> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| Error::Io(Arc::new(e.into())))?;
        Ok(Self {
            inner: Arc::new(Queue {
                ready: Mutex::new(VecDeque::new()),
                cv: Condvar::new(),
                fd,
            }),
        })
    }

    /// Reports `status`'s outcome here, with `token`, once it finishes (at
    /// once when it has).
    pub fn watch(&self, status: &TransferStatus, token: u64) {
        let q = Arc::clone(&self.inner);
        status.watch_inline(move |outcome| q.push((token, outcome)));
    }

    /// Takes every outcome ready now (none: empty).
    pub fn try_take(&self) -> Vec<Finished> {
        let mut ready = self.inner.lock();
        self.inner.drain(&mut ready, usize::MAX)
    }

    /// Waits until at least one outcome is ready, or `timeout` passes,
    /// then takes every one ready (none on timeout).
    pub fn wait(&self, timeout: Duration) -> Vec<Finished> {
        self.wait_max(timeout, usize::MAX)
    }

    /// As [`wait`](Self::wait), taking at most `max` (the rest stay ready,
    /// the descriptor readable).
    pub fn wait_max(&self, timeout: Duration, max: usize) -> Vec<Finished> {
        let deadline = Instant::now().checked_add(timeout);
        let mut ready = self.inner.lock();
        while ready.is_empty() {
            let left = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                break;
            }
            ready = self
                .inner
                .cv
                .wait_timeout(ready, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.inner.drain(&mut ready, max)
    }

    /// Outcomes ready now.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    /// Whether none is ready now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Readable (`POLLIN`) while an outcome is ready; take them with
/// [`CompletionQueue::try_take`], which makes it unreadable again. Never
/// read it directly.
impl AsFd for CompletionQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }
}

impl AsRawFd for CompletionQueue {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd.as_raw_fd()
    }
}
