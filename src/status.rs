//! Transfer statuses: the completion cell every data path completes (one
//! atomic state, a condition variable for sleepers, a driver a waiter may
//! poll), [`TransferStatus`] with its deadlines and abort, the
//! [`DataPath`] every status reports, and [`PreparedTransfer`].

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::agent::TransferRequest;
use crate::error::Error;
pub use crate::proto::TransportKind;

/// Progress of a transfer, as `wait` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferState {
    /// Not finished yet.
    InProgress,
    /// Finished successfully.
    Completed,
}

/// [`Completion::state`]: no outcome yet.
const PENDING: u8 = 0;
/// [`Completion::state`]: finished successfully.
const SUCCEEDED: u8 = 1;
/// [`Completion::state`]: failed; the error is in [`Completion::error`].
const FAILED: u8 = 2;

/// Shared completion cell behind a [`TransferStatus`]. Backends complete it
/// once; later completions are ignored (first outcome wins). A success is
/// one compare-and-swap, read with one load: no lock on the path every
/// request takes. A failure's error sits behind the lock, which is also
/// the condition variable's.
pub(crate) struct Completion {
    /// [`PENDING`], then [`SUCCEEDED`] or [`FAILED`], set once.
    state: AtomicU8,
    /// The error of a failed transfer (stored before `state` says
    /// [`FAILED`]); the lock sleepers wait under.
    error: Mutex<Option<Error>>,
    cv: Condvar,
    /// Threads asleep (or about to be) on `cv`; counted under `error`'s
    /// lock before they look at `state`. Completing notifies only when
    /// there are any (taking the lock first, so that none is between its
    /// look and its sleep): a notification is a system call, paid on every
    /// request otherwise.
    sleepers: AtomicUsize,
    /// The backend's completion source (an RDMA completion queue), polled
    /// by a waiting thread itself: the completion then costs no thread
    /// wake-up. `Weak`: a status must not keep a connection alive.
    driver: Option<Weak<dyn Progress>>,
    /// The agent's count of requests in flight, which this completion
    /// counts in while it is pending (see
    /// [`Limits::max_requests_in_flight`](crate::Limits::max_requests_in_flight)).
    in_flight: Option<Arc<AtomicUsize>>,
    /// Set by [`TransferStatus::abort`]: the backend sends nothing more of
    /// the request and fails it with [`Error::Aborted`] once what it did
    /// send is done.
    abort: AtomicBool,
    /// Where the outcome is counted (the request's transport and peer).
    meter: Option<Metered>,
    /// Called once with the outcome ([`TransferStatus::on_complete`]):
    /// taken out under this lock by whoever fires them, so each runs once.
    watchers: Mutex<Vec<Watcher>>,
    /// Whether `watchers` may hold any; set (sequentially consistent)
    /// after one is added, read after the outcome is in: either the
    /// completer sees it, or the watcher's adder sees the outcome. A
    /// request nobody watches pays one load.
    watched: AtomicBool,
    /// Set before a failure whose request may still land at the target
    /// (its link broke): how to prove it no longer can
    /// ([`TransferStatus::wait_settled`]).
    unsettled: OnceLock<Arc<dyn Settles>>,
}

/// Proof, for requests a broken link failed, that nothing of them lands
/// at the target any more (see `engine::settle`).
pub(crate) trait Settles: Send + Sync {
    /// Whether it was proved.
    fn is_settled(&self) -> bool;
    /// Proves it within `timeout` (asking the target), or says why not.
    fn settle(&self, timeout: Duration) -> Result<(), Error>;
}

/// A completion callback.
type Watcher = Box<dyn FnOnce(Result<(), Error>) + Send>;

/// A request's place in the agent's metrics.
#[derive(Debug)]
struct Metered {
    meter: Arc<crate::metrics::Meter>,
    bytes: u64,
    /// When it was submitted, when latency is recorded.
    started: Option<Instant>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("state", &self.state)
            .field("abort", &self.abort)
            .finish_non_exhaustive()
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if *self.state.get_mut() == PENDING
            && let Some(n) = &self.in_flight
        {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Something a waiting thread can drive: a completion queue it may poll in
/// place of the backend's progress thread.
pub(crate) trait Progress: Send + Sync {
    /// Processes whatever completions are ready (without blocking); true
    /// when there were some.
    fn progress(&self) -> bool;
}

/// Largest request whose waiting thread polls its transport's completion
/// queue itself (a [`Progress`] driver); a larger one leaves the CPU to the
/// transport's progress thread.
pub(crate) const DRIVE_MAX_BYTES: u64 = 1 << 20;

/// How long [`TransferStatus::wait`] polls a driver after its last progress
/// before it sleeps on the condition variable (re-polling every
/// [`DRIVE_SLICE`]): small transfers complete inside the window with no
/// wake-up; long ones leave the CPU to the progress thread.
const DRIVE_SPIN: Duration = Duration::from_micros(200);
const DRIVE_SLICE: Duration = Duration::from_millis(1);
/// Idle polls between two clock reads of a driving waiter.
const DRIVE_CLOCK_EVERY: u32 = 16;

/// A wait's deadline, fixed at the first clock read rather than on entry: a
/// wait that finds its outcome at once reads no clock. The wait may then
/// last longer than asked by the time before that first read (a few
/// polls, microseconds), never shorter.
struct Deadline {
    timeout: Duration,
    /// `Some(None)`: no deadline (the timeout overflows `Instant`).
    at: Option<Option<Instant>>,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        Self { timeout, at: None }
    }

    fn at(&mut self, now: Instant) -> Option<Instant> {
        *self.at.get_or_insert_with(|| now.checked_add(self.timeout))
    }

    fn passed(&mut self, now: Instant) -> bool {
        self.at(now).is_some_and(|d| now >= d)
    }

    /// Time left, reading the clock.
    fn left(&mut self) -> Duration {
        let now = Instant::now();
        match self.at(now) {
            Some(d) => d.saturating_duration_since(now),
            None => Duration::from_secs(3600),
        }
    }
}

impl Completion {
    #[cfg(test)]
    pub(crate) fn new() -> Arc<Self> {
        Self::counted(None, None)
    }

    /// A pending completion counted in `in_flight` until its outcome is in
    /// (or it is dropped).
    pub(crate) fn counted(
        driver: Option<Weak<dyn Progress>>,
        in_flight: Option<&Arc<AtomicUsize>>,
    ) -> Arc<Self> {
        if let Some(n) = in_flight {
            n.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(Self {
            state: AtomicU8::new(PENDING),
            error: Mutex::new(None),
            cv: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            driver,
            in_flight: in_flight.cloned(),
            abort: AtomicBool::new(false),
            meter: None,
            watchers: Mutex::new(Vec::new()),
            watched: AtomicBool::new(false),
            unsettled: OnceLock::new(),
        })
    }

    /// Counts the outcome of this (fresh) completion's request of `bytes`
    /// in `meter`.
    pub(crate) fn metered(
        mut self: Arc<Self>,
        meter: Option<&Arc<crate::metrics::Meter>>,
        bytes: u64,
    ) -> Arc<Self> {
        if let (Some(m), Some(me)) = (meter, Arc::get_mut(&mut self)) {
            me.meter = Some(Metered {
                meter: Arc::clone(m),
                bytes,
                started: m.timing().then(Instant::now),
            });
        }
        self
    }

    /// Counts the outcome in the metrics, if metered.
    fn count(&self, outcome: Result<(), &Error>) {
        if let Some(m) = &self.meter {
            m.meter
                .record(outcome, m.bytes, m.started.map(|t| t.elapsed()));
        }
    }

    /// Whether the request's caller asked for it to be aborted.
    pub(crate) fn abort_requested(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) != PENDING
    }

    /// Makes a finished completion pending again, for a new request of
    /// `bytes` (the caller owns it alone: no status refers to it any more).
    pub(crate) fn reset(&mut self, bytes: u64) {
        if *self.state.get_mut() != PENDING
            && let Some(n) = &self.in_flight
        {
            n.fetch_add(1, Ordering::AcqRel);
        }
        *self.state.get_mut() = PENDING;
        *self.error.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
        *self.abort.get_mut() = false;
        self.watchers
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        *self.watched.get_mut() = false;
        self.unsettled.take();
        if let Some(m) = &mut self.meter {
            m.bytes = bytes;
            if m.started.is_some() {
                m.started = Some(Instant::now());
            }
        }
    }

    /// Polls the driver until the outcome is in, the deadline passes, or
    /// nothing has happened for [`DRIVE_SPIN`]. The clock is read only every
    /// [`DRIVE_CLOCK_EVERY`] idle polls (a completion found sooner costs no
    /// clock read at all): where reading it is a system call (a guest on an
    /// emulated HPET: 2.2 µs a read) the reads cost more than the polls.
    fn drive(&self, deadline: &mut Deadline) {
        // Already in (e.g. reaped by the submitting call): no upgrade.
        if self.is_done() {
            return;
        }
        let Some(driver) = self.driver.as_ref().and_then(Weak::upgrade) else {
            return;
        };
        // When the last progress was seen, once the clock has been read
        // after it.
        let mut last: Option<Instant> = None;
        let mut idle = 0u32;
        while !self.is_done() {
            if driver.progress() {
                last = None;
                idle = 0;
                continue;
            }
            idle += 1;
            if idle.is_multiple_of(DRIVE_CLOCK_EVERY) {
                let now = Instant::now();
                if deadline.passed(now) || now - *last.get_or_insert(now) > DRIVE_SPIN {
                    return;
                }
            }
            if idle.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Polls the driver once, if there is one and the outcome is not in.
    fn poke(&self) {
        if self.is_done() {
            return;
        }
        if let Some(driver) = self.driver.as_ref().and_then(Weak::upgrade) {
            driver.progress();
        }
    }

    /// Records, before the failure that follows, that the request may still
    /// land at the target until `settle` proves otherwise. Nothing when the
    /// outcome is already in.
    pub(crate) fn mark_unsettled(&self, settle: &Arc<dyn Settles>) {
        // Set before the outcome is: whoever sees the failure sees it.
        if !self.is_done() {
            let _ = self.unsettled.set(Arc::clone(settle));
        }
    }

    /// Records the outcome; returns false when one was already recorded.
    pub(crate) fn complete(&self, outcome: Result<(), Error>) -> bool {
        let won = match outcome {
            Ok(()) => {
                let won = self
                    .state
                    .compare_exchange(PENDING, SUCCEEDED, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok();
                if won {
                    self.count(Ok(()));
                }
                won
            }
            Err(e) => {
                let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
                if self.state.load(Ordering::Relaxed) != PENDING {
                    return false;
                }
                *slot = Some(e);
                // A success may still win the race (it takes no lock).
                let won = self
                    .state
                    .compare_exchange(PENDING, FAILED, Ordering::SeqCst, Ordering::Relaxed)
                    .is_ok();
                if won {
                    if let Some(e) = slot.as_ref() {
                        self.count(Err(e));
                    }
                } else {
                    *slot = None;
                }
                won
            }
        };
        if won && let Some(n) = &self.in_flight {
            n.fetch_sub(1, Ordering::AcqRel);
        }
        if won && self.watched.load(Ordering::SeqCst) {
            self.fire();
        }
        // Sequentially consistent with a sleeper's count then look: either
        // it saw the outcome, or this sees it counted. The lock, taken and
        // let go, waits out a sleeper between its look and its sleep.
        if won && self.sleepers.load(Ordering::SeqCst) > 0 {
            drop(self.error.lock().unwrap_or_else(|p| p.into_inner()));
            self.cv.notify_all();
        }
        won
    }

    /// Calls `f` with the outcome once it is in: at once (on this thread)
    /// when it is, else on the thread that completes the request.
    pub(crate) fn watch(&self, f: Watcher) {
        {
            let mut w = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
            w.push(f);
            self.watched.store(true, Ordering::SeqCst);
        }
        if self.is_done() {
            self.fire();
        }
    }

    /// Runs the watchers added so far with the outcome (which is in).
    fn fire(&self) {
        let watchers =
            std::mem::take(&mut *self.watchers.lock().unwrap_or_else(|p| p.into_inner()));
        if watchers.is_empty() {
            return;
        }
        let outcome = self.snapshot().map(|_| ());
        for w in watchers {
            w(outcome.clone());
        }
    }

    /// The outcome so far.
    fn snapshot(&self) -> Result<TransferState, Error> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Ok(TransferState::InProgress),
            SUCCEEDED => Ok(TransferState::Completed),
            _ => Err(self
                .error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or(Error::Closed)),
        }
    }
}

/// A transfer request resolved once for repeated submission with
/// [`TransferAgent::submit_prepared`](crate::agent::TransferAgent::submit_prepared) (NIXL's prepared transfer handles,
/// perftest's work request built once): the remote agent, the connection,
/// the local and remote keys and the work requests are looked up when it is
/// made, not on every submission.
///
/// While it lives, the local regions it covers count as in use:
/// deregistering them is refused ([`Error::RegionBusy`]). If the remote
/// agent is loaded again or invalidated, or its connection fails, the next
/// submission resolves the request afresh (as
/// [`submit_transfer`](crate::agent::TransferAgent::submit_transfer) does, reconnecting
/// if need be).
pub struct PreparedTransfer {
    /// The request; made from `indexed` when first asked for.
    request: std::sync::OnceLock<TransferRequest>,
    /// Its pairs, for one made by index.
    pub(crate) indexed: Option<std::sync::Arc<crate::indexed::IndexedPairs>>,
    /// Bytes it moves and pieces after merging.
    size: (u64, usize),
    /// The agent that made it (submitting it to another is refused).
    owner: u64,
    /// The transport's resolution; `None` where it keeps none (each
    /// submission then validates the request in full).
    pub(crate) resolved: Option<Box<dyn Prepared>>,
}

/// What a transport keeps of a [`PreparedTransfer`] (its plan, holds on
/// the local regions), posted again on every submission.
pub(crate) trait Prepared: Send + Sync {
    /// Posts it again as a new request with `sync` as its sync message
    /// (`durable`: the target makes storage writes durable before it
    /// answers). `None` when it no longer holds (the remote agent was
    /// loaded again or invalidated, its connection broke) or the transport
    /// keeps no plan: the caller then resolves the request afresh.
    fn post(&self, sync: Option<&[u8]>, durable: bool) -> Option<Result<TransferStatus, Error>>;
}

impl PreparedTransfer {
    pub(crate) fn new(
        request: TransferRequest,
        owner: u64,
        resolved: Option<Box<dyn Prepared>>,
    ) -> Self {
        let size = (request.local.total_len(), request.local.descs.len());
        Self {
            request: std::sync::OnceLock::from(request),
            indexed: None,
            size,
            owner,
            resolved,
        }
    }

    /// One made by index: `pairs` (`size`: its bytes and pieces).
    pub(crate) fn indexed(
        pairs: std::sync::Arc<crate::indexed::IndexedPairs>,
        size: (u64, usize),
        owner: u64,
        resolved: Box<dyn Prepared>,
    ) -> Self {
        Self {
            request: std::sync::OnceLock::new(),
            indexed: Some(pairs),
            size,
            owner,
            resolved: Some(resolved),
        }
    }

    /// The request it was made from (for one made by index, its pairs
    /// merged into one: made on the first call).
    pub fn request(&self) -> &TransferRequest {
        self.request.get_or_init(|| {
            let p = self
                .indexed
                .as_ref()
                .expect("a prepared transfer without its request is indexed");
            p.to_request()
        })
    }

    /// The request it was made from, the preparation let go (its holds on
    /// the local regions released).
    pub fn into_request(self) -> TransferRequest {
        self.request();
        let Self { request, .. } = self;
        request.into_inner().expect("made above")
    }

    /// The indexed request it was made from, for one made by index.
    pub fn indexed_request(&self) -> Option<&crate::indexed::IndexedRequest> {
        self.indexed.as_ref().map(|p| &p.req)
    }

    /// The indexed request it was made from, the preparation let go (its
    /// holds released); `None` for one not made by index (see
    /// [`into_request`](Self::into_request)).
    pub fn into_indexed_request(self) -> Option<crate::indexed::IndexedRequest> {
        let p = self.indexed?;
        Some(std::sync::Arc::try_unwrap(p).map_or_else(|p| p.req.clone(), |p| p.req))
    }

    /// Bytes it moves.
    pub fn total_bytes(&self) -> u64 {
        self.size.0
    }

    /// Pieces it moves (descriptors after merging).
    pub fn desc_count(&self) -> usize {
        self.size.1
    }

    /// Its sync message.
    pub fn sync_message(&self) -> Option<&[u8]> {
        match &self.indexed {
            Some(p) => p.req.sync_message.as_deref(),
            None => self.request().sync_message.as_deref(),
        }
    }

    pub(crate) fn owner(&self) -> u64 {
        self.owner
    }
}

impl std::fmt::Debug for PreparedTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedTransfer")
            .field("request", &self.request.get())
            .field("indexed", &self.indexed.as_ref().map(|p| p.pairs()))
            .field("resolved", &self.resolved.is_some())
            .finish()
    }
}

/// What carried a transfer: the transport, the device, and how the bytes
/// moved — so that a transfer that took a slower path than expected says
/// so (see also [`AgentConfig::with_required_transport`](crate::config::AgentConfig::with_required_transport)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataPath {
    /// The transport.
    pub transport: TransportKind,
    /// The RDMA device (`rxe0`, `mlx5_0`, ...) on RDMA; the provider and
    /// domain (`efa/rdmap0s6-rdm`) on libfabric; the peer's endpoint
    /// (`host:port`) on TCP; `None` on shm.
    pub device: Option<String>,
    /// How the bytes moved, in words.
    pub mechanism: &'static str,
}

/// Handle on a submitted transfer. Cheap to clone; every clone observes the
/// same outcome. Dropping it does not cancel the transfer.
#[derive(Clone, Debug)]
pub struct TransferStatus {
    id: u64,
    completion: Arc<Completion>,
    path: Arc<DataPath>,
}

impl TransferStatus {
    pub(crate) fn new(id: u64, completion: Arc<Completion>, path: Arc<DataPath>) -> Self {
        Self {
            id,
            completion,
            path,
        }
    }

    /// The data path that carries (or carried) the transfer.
    pub fn data_path(&self) -> &DataPath {
        &self.path
    }

    /// The request id (unique per agent, 64-bit).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the transfer has finished, successfully or not. On RDMA, a
    /// small request's completion queue is polled once first (nobody else
    /// may be polling it: see [`wait`](Self::wait)).
    pub fn is_completed(&self) -> bool {
        self.completion.poke();
        self.completion.is_done()
    }

    /// The state now, without blocking (polling the completion queue once,
    /// as [`is_completed`](Self::is_completed)).
    ///
    /// # Errors
    /// The transfer's failure, if it failed.
    pub fn poll(&self) -> Result<TransferState, Error> {
        self.completion.poke();
        self.completion.snapshot()
    }

    /// Blocks until the transfer finishes or `timeout` elapses. Returns
    /// `Ok(InProgress)` when the timeout elapsed first.
    ///
    /// # Errors
    /// The transfer's failure, if it failed.
    pub fn wait(&self, timeout: Duration) -> Result<TransferState, Error> {
        let c = &*self.completion;
        let mut deadline = Deadline::new(timeout);
        let driven = c.driver.is_some();
        loop {
            if driven {
                c.drive(&mut deadline);
            }
            match c.state.load(Ordering::Acquire) {
                SUCCEEDED => return Ok(TransferState::Completed),
                FAILED => return c.snapshot(),
                _ => {}
            }
            let mut left = deadline.left();
            if left.is_zero() {
                return c.snapshot();
            }
            if driven {
                left = left.min(DRIVE_SLICE);
            }
            let guard = c.error.lock().unwrap_or_else(|p| p.into_inner());
            // Counted before the look (see `complete`).
            c.sleepers.fetch_add(1, Ordering::SeqCst);
            if c.state.load(Ordering::SeqCst) == PENDING {
                drop(
                    c.cv.wait_timeout(guard, left)
                        .unwrap_or_else(|p| p.into_inner()),
                );
            } else {
                drop(guard);
            }
            c.sleepers.fetch_sub(1, Ordering::Relaxed);
            if c.is_done() {
                return c.snapshot();
            }
        }
    }

    /// Asks for the transfer to be aborted; returns false when it had
    /// already finished (its outcome stands).
    ///
    /// Nothing of the request that has not yet been handed to the network
    /// (or, on the cross-memory path, copied) is sent, its sync message is
    /// not delivered, and the data of a READ still arriving is dropped
    /// rather than written to local memory. The transfer then finishes
    /// with [`Error::Aborted`] — only once what was already sent has been
    /// written and acknowledged, so that when [`wait`](Self::wait) reports
    /// it, no byte of the transfer will change in either agent's memory
    /// any more (the regions may be reused or deregistered). A transfer
    /// whose data had all been sent by then completes as usual
    /// ([`TransferState::Completed`], sync message delivered). Parts the
    /// abort skipped leave the destination's bytes as they were; parts
    /// already sent land.
    ///
    /// Never blocks; wait for the outcome with [`wait`](Self::wait) (it
    /// comes at the pace of the work in flight, bounded by the I/O
    /// timeout). A small RDMA request posted at submission (one work
    /// request, no sync message) is on the wire at once: it completes.
    ///
    /// How much lands after the call, at most: over TCP, per stream, the
    /// frames under way when the abort is seen (at most 4 MiB of payload:
    /// streams look between frames, and no frame is larger) plus what the
    /// kernel's socket buffers already hold; on the cross-memory path one
    /// system call (4 MiB) per copying thread; over RDMA the work requests
    /// already posted (`RdmaConfig::max_inflight`).
    pub fn abort(&self) -> bool {
        let c = &*self.completion;
        if c.is_done() {
            return false;
        }
        c.abort.store(true, Ordering::Relaxed);
        true
    }

    /// Calls `f` once with the transfer's outcome when it finishes (at
    /// once when it already has), on the process's callback thread: never
    /// on a thread of the library, in the order the outcomes came in.
    /// Callbacks added to one status run in the order they were added. A
    /// callback that panics is caught, logged and counted
    /// (`kvxfer_callback_panics_total`); one that blocks holds up the
    /// callbacks after it (keep them short: set a flag, send on a channel,
    /// wake a task), never a transfer. No polling: a finished transfer
    /// wakes whoever waits. For the lowest latency,
    /// [`CompletionQueue`](crate::CompletionQueue) is told on the
    /// completing thread itself. Statuses of a [`PreparedTransfer`]
    /// submission are their own: a callback fires for the submission it
    /// was added to.
    pub fn on_complete(&self, f: impl FnOnce(Result<(), Error>) + Send + 'static) {
        self.completion.watch(Box::new(move |outcome| {
            crate::callbacks::run(Box::new(move || f(outcome)))
        }));
    }

    /// As [`on_complete`](Self::on_complete), on the thread that completes
    /// the transfer (or this one, when it has): for the library's own
    /// watchers, which are short, never block and never panic.
    pub(crate) fn watch_inline(&self, f: impl FnOnce(Result<(), Error>) + Send + 'static) {
        self.completion.watch(Box::new(f));
    }

    /// Whether the transfer finished and no byte of it can land any more,
    /// in either agent's memory. False while it runs; true for every
    /// outcome but one: a failure that broke the
    /// connection ([`Error::PeerTimedOut`], [`Error::ConnectionLost`],
    /// [`Error::Closed`] with the agent closing, ...). The initiator's own
    /// memory is quiet then, but bytes it handed to the kernel may still
    /// be in the target's socket buffers: a target that was stopped, not
    /// dead, lands them when it resumes. Until this says true (or
    /// [`wait_settled`](Self::wait_settled) returned `Ok`), treat the
    /// destination of a WRITE as still being written, and do not tell the
    /// target's owner that it may reuse it.
    pub fn is_settled(&self) -> bool {
        if !self.completion.is_done() {
            return false;
        }
        self.completion
            .unsettled
            .get()
            .is_none_or(|s| s.is_settled())
    }

    /// Waits (up to `timeout` in all) for the transfer to finish and for
    /// proof that no byte of it can land any more (see
    /// [`is_settled`](Self::is_settled)). After a failure that broke the
    /// connection, it asks the target, over a new authenticated
    /// connection, to end the broken link's streams: the target drops what
    /// of them it had not read yet, and answers once they ended. A target
    /// that no longer listens where it did (it closed, or its process is
    /// gone), or that is another instance of the agent, holds nothing of
    /// the link either. A target that is stopped does not answer: this
    /// returns its error and may be called again.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the transfer did not finish, or the target
    /// did not answer, within `timeout`; the error of the attempt to reach
    /// the target otherwise. Never the transfer's own failure: `Ok` means
    /// settled, whatever the outcome.
    pub fn wait_settled(&self, timeout: Duration) -> Result<(), Error> {
        let start = Instant::now();
        if self
            .wait(timeout)
            .is_ok_and(|s| s == TransferState::InProgress)
        {
            return Err(Error::Timeout {
                what: "transfer",
                after: timeout,
            });
        }
        match self.completion.unsettled.get() {
            None => Ok(()),
            Some(s) => s.settle(timeout.saturating_sub(start.elapsed())),
        }
    }

    /// Like [`wait`](Self::wait), but a transfer still running at the
    /// timeout is an [`Error::Timeout`].
    ///
    /// # Errors
    /// The transfer's failure, or `Timeout`.
    pub fn wait_success(&self, timeout: Duration) -> Result<(), Error> {
        match self.wait(timeout)? {
            TransferState::Completed => Ok(()),
            TransferState::InProgress => Err(Error::Timeout {
                what: "transfer",
                after: timeout,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each transport has one wire code and one name; names parse back
    /// (any case) except the agent's own storage, and an unknown name's
    /// error lists the others.
    #[test]
    fn transport_codes_and_names_round_trip() {
        let mut codes: Vec<u8> = TransportKind::ALL.iter().map(|t| t.code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), TransportKind::ALL.len());
        for t in TransportKind::ALL {
            assert_eq!(TransportKind::from_code(t.code()), Some(t));
            assert_eq!(t.as_cstr().to_str().unwrap(), t.as_str(), "one name for C");
            assert!(!t.as_str().is_empty() && !t.as_str().contains('\0'));
            let parsed = t.as_str().to_ascii_uppercase().parse::<TransportKind>();
            match t {
                TransportKind::Storage => assert!(parsed.is_err()),
                _ => assert_eq!(parsed.unwrap(), t),
            }
        }
        assert_eq!(TransportKind::from_code(0), None);
        assert_eq!(TransportKind::from_code(7), None);
        let e = "ucx".parse::<TransportKind>().unwrap_err().to_string();
        assert!(e.contains("tcp, shm, rdma, fabric, inproc"), "{e}");
    }

    fn test_path() -> Arc<DataPath> {
        Arc::new(DataPath {
            transport: TransportKind::Tcp,
            device: None,
            mechanism: "test",
        })
    }

    #[test]
    fn first_outcome_wins_and_is_kept() {
        let c = Completion::new();
        let st = TransferStatus::new(1, Arc::clone(&c), test_path());
        assert_eq!(st.poll().unwrap(), TransferState::InProgress);
        assert!(c.complete(Err(Error::Closed)));
        assert!(!c.complete(Ok(())));
        assert!(!c.complete(Err(Error::UnknownAgent("x".into()))));
        assert!(matches!(st.poll(), Err(Error::Closed)));
        assert!(matches!(st.wait(Duration::ZERO), Err(Error::Closed)));
        let ok = Completion::new();
        assert!(ok.complete(Ok(())));
        assert!(!ok.complete(Err(Error::Closed)));
        let st = TransferStatus::new(2, ok, test_path());
        assert_eq!(st.wait(Duration::ZERO).unwrap(), TransferState::Completed);
        assert!(st.is_completed());
    }

    #[test]
    fn callbacks_fire_once_with_the_outcome_before_or_after_it_is_in() {
        use std::sync::mpsc;
        let c = Completion::new();
        let st = TransferStatus::new(1, Arc::clone(&c), test_path());
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        let wait = Duration::from_secs(60);
        st.on_complete(move |r| t.send(("early", r.is_ok())).unwrap());
        assert!(rx.try_recv().is_err(), "fired before the outcome");
        assert!(c.complete(Err(Error::Closed)));
        assert_eq!(rx.recv_timeout(wait).unwrap(), ("early", false));
        // Added after the outcome: at once (on the callback thread).
        st.on_complete(move |r| {
            assert!(matches!(r, Err(Error::Closed)));
            tx.send(("late", false)).unwrap()
        });
        assert_eq!(rx.recv_timeout(wait).unwrap(), ("late", false));
        // Each once: nothing more on later (ignored) outcomes.
        assert!(!c.complete(Ok(())));
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    }

    /// A callback added while the outcome comes in on another thread runs
    /// exactly once (the completer or the adder runs it, never both, never
    /// neither).
    #[test]
    fn a_callback_racing_the_outcome_runs_exactly_once() {
        for _ in 0..2000 {
            let c = Completion::new();
            let st = TransferStatus::new(1, Arc::clone(&c), test_path());
            let runs = Arc::new(AtomicUsize::new(0));
            let completer = std::thread::spawn(move || c.complete(Ok(())));
            let r = Arc::clone(&runs);
            st.watch_inline(move |o| {
                assert!(o.is_ok());
                r.fetch_add(1, Ordering::SeqCst);
            });
            assert!(completer.join().unwrap());
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        }
    }

    #[test]
    fn a_completion_queue_reports_in_finishing_order_and_its_fd_tracks_readiness() {
        let cq = crate::CompletionQueue::new().unwrap();
        let readable = |cq: &crate::CompletionQueue| {
            use std::os::fd::AsFd;
            let fd = cq.as_fd();
            let mut fds = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            rustix::event::poll(&mut fds, Some(&rustix::event::Timespec::default())).unwrap() == 1
        };
        let cs: Vec<_> = (0..3).map(|_| Completion::new()).collect();
        for (i, c) in cs.iter().enumerate() {
            cq.watch(
                &TransferStatus::new(i as u64, Arc::clone(c), test_path()),
                10 + i as u64,
            );
        }
        assert!(cq.is_empty() && !readable(&cq));
        assert!(cq.wait(Duration::from_millis(1)).is_empty());
        cs[2].complete(Ok(()));
        cs[0].complete(Err(Error::Closed));
        assert!(readable(&cq));
        let got = cq.wait(Duration::from_secs(10));
        assert_eq!(got.iter().map(|f| f.0).collect::<Vec<_>>(), [12, 10]);
        assert!(got[0].1.is_ok() && matches!(got[1].1, Err(Error::Closed)));
        assert!(!readable(&cq), "readable with nothing ready");
        // A waiter wakes when another thread completes.
        let c1 = Arc::clone(&cs[1]);
        let t = std::thread::spawn(move || c1.complete(Ok(())));
        let got = cq.wait(Duration::from_secs(60));
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, 11);
        t.join().unwrap();
        assert!(cq.try_take().is_empty() && !readable(&cq));
    }

    #[test]
    fn racing_outcomes_record_exactly_one() {
        for round in 0..200 {
            let c = Completion::new();
            let won = std::thread::scope(|s| {
                let a = s.spawn(|| c.complete(Ok(())));
                let b = s.spawn(|| c.complete(Err(Error::Closed)));
                [a.join().unwrap(), b.join().unwrap()]
            });
            assert_eq!(won.iter().filter(|w| **w).count(), 1, "round {round}");
            let st = TransferStatus::new(round, c, test_path());
            match (won[0], st.poll()) {
                (true, Ok(TransferState::Completed)) | (false, Err(Error::Closed)) => {}
                (w, other) => panic!("round {round}: success won {w}, status {other:?}"),
            }
        }
    }

    #[test]
    fn sleepers_wake_on_an_outcome_recorded_without_the_lock() {
        for round in 0..50 {
            let c = Completion::new();
            let st = TransferStatus::new(round, Arc::clone(&c), test_path());
            std::thread::scope(|s| {
                let w = s.spawn(|| {
                    let t = Instant::now();
                    (st.wait(Duration::from_secs(20)), t.elapsed())
                });
                if round % 2 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                c.complete(Ok(()));
                let (state, took) = w.join().unwrap();
                assert_eq!(state.unwrap(), TransferState::Completed);
                // A lost wake-up sleeps out the whole timeout.
                assert!(
                    took < Duration::from_secs(10),
                    "round {round}: woke after {took:?}"
                );
            });
        }
        let c = Completion::new();
        let st = TransferStatus::new(0, Arc::clone(&c), test_path());
        let t = Instant::now();
        assert_eq!(
            st.wait(Duration::from_millis(30)).unwrap(),
            TransferState::InProgress
        );
        assert!(t.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn a_reset_completion_is_pending_again() {
        let mut c = Completion::new();
        assert!(c.complete(Err(Error::Closed)));
        Arc::get_mut(&mut c).unwrap().reset(0);
        assert!(!c.is_done());
        assert!(c.complete(Ok(())));
        assert_eq!(
            TransferStatus::new(0, c, test_path()).poll().unwrap(),
            TransferState::Completed
        );
    }
}
