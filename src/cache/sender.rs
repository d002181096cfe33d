//! The context side's driver: [`CacheSender`] runs a
//! [`SenderMachine`] over a [`TransferAgent`] — the agent's sync messages
//! in, the machine's messages and writes out — on one thread per sender
//! (the sender owns its agent's notifications). API calls act on the
//! machine directly and carry out what it asks at once.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::SenderConfig;
use super::machine::{SenderEvent, SenderMachine, TransferAction, TransferId};
use super::stats::{Metrics, SessionStats};
use super::timings::record_timings;
use super::wire::{Msg, Reassembler};
use super::{BlockLookup, CacheError, CacheState};
use crate::agent::{TransferAgent, TransferState, TransferStatus};
use crate::small::FastHash;

/// Where an asynchronous operation's outcome lands.
pub(crate) struct Cell<T> {
    value: Mutex<Option<Result<T, CacheError>>>,
    cv: Condvar,
}

impl<T: Clone> Cell<T> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            value: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn set(&self, v: Result<T, CacheError>) {
        let mut g = lock(&self.value);
        if g.is_none() {
            *g = Some(v);
            self.cv.notify_all();
        }
    }

    pub(crate) fn get(&self) -> Option<Result<T, CacheError>> {
        lock(&self.value).clone()
    }

    pub(crate) fn wait(&self, timeout: Duration, what: &str) -> Result<T, CacheError> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.value);
        loop {
            if let Some(v) = g.as_ref() {
                return v.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CacheError::Timeout {
                    what: what.to_owned(),
                    after: timeout,
                });
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Handle on one request being sent.
#[derive(Clone)]
pub struct SendHandle {
    request_id: u64,
    cell: Arc<Cell<SessionStats>>,
}

impl SendHandle {
    /// The request.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Whether the request finished (sent, failed or cancelled).
    pub fn is_done(&self) -> bool {
        self.cell.get().is_some()
    }

    /// Waits for the outcome: the session's measures once every share
    /// landed.
    ///
    /// # Errors
    /// `Timeout` when `timeout` passes first; the request's failure.
    pub fn wait(&self, timeout: Duration) -> Result<SessionStats, CacheError> {
        self.cell.wait(timeout, "cache send")
    }
}

/// Longest wait of a protocol thread with no deadline due: messages,
/// finished writes, new requests and shutdown wake it; this only bounds
/// the wait.
pub(crate) const IDLE_WAIT: Duration = Duration::from_secs(1);

/// The machine and what waits on its outcomes.
struct Core {
    m: SenderMachine,
    cells: HashMap<u64, Arc<Cell<SessionStats>>>,
    cancel_waiters: HashMap<u64, Vec<crossbeam_channel::Sender<()>>>,
}

struct Shared {
    agent: Arc<dyn TransferAgent>,
    rank: u32,
    timings_dir: Option<PathBuf>,
    timeout: Duration,
    /// Partial messages the protocol thread's reassembler dropped.
    partials_dropped: AtomicU64,
    /// Lock order: `posted` before `core`.
    core: Mutex<Core>,
    /// The posted writes; held while the machine's actions are carried
    /// out, so that they happen in its order.
    posted: Mutex<HashMap<TransferId, TransferStatus, FastHash>>,
    stop: AtomicBool,
    /// Set by a posted write's completion callback: there is something to
    /// reap (the callback then wakes the protocol thread's wait).
    finished: Arc<AtomicBool>,
    /// Wakes the protocol thread from its wait on the agent's messages.
    waker: crate::agent::SyncWaker,
    /// Layers waiting for a CUDA event, for the thread that waits on them
    /// (started with the first).
    #[cfg(feature = "cuda")]
    gpu_waits: Mutex<Option<crossbeam_channel::Sender<GpuWait>>>,
}

/// Layers to mark ready once a CUDA event completed.
#[cfg(feature = "cuda")]
type GpuWait = (u64, Range<u32>, crate::gpu::CudaEvent);

impl Shared {
    /// Runs `f` on the machine, then hands its outcomes to the handles and
    /// cancel waiters.
    fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let mut rows = Vec::new();
        let out = {
            let mut c = lock(&self.core);
            let out = f(&mut c);
            while let Some(ev) = c.m.poll_event() {
                let SenderEvent::Finished {
                    request_id,
                    outcome,
                } = ev;
                for w in c.cancel_waiters.remove(&request_id).into_iter().flatten() {
                    let _ = w.send(());
                }
                if let Some(cell) = c.cells.remove(&request_id) {
                    if let (Ok(stats), Some(_)) = (&outcome, &self.timings_dir) {
                        rows.push(stats.clone());
                    }
                    cell.set(outcome);
                }
            }
            out
        };
        record_timings(self.timings_dir.as_deref(), self.rank, "send", &rows);
        out
    }

    /// Runs `f` on the machine and carries out what it asks at once; the
    /// protocol thread then watches what was posted.
    fn act<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let r = self.with_core(f);
        self.flush();
        self.agent.wake_sync_waiters();
        r
    }

    /// Carries out what the machine asks — messages, then posts and
    /// aborts — in its order.
    fn flush(&self) {
        let mut posted = lock(&self.posted);
        loop {
            let (transmit, action) = {
                let mut c = lock(&self.core);
                match c.m.poll_transmit() {
                    Some(t) => (Some(t), None),
                    None => (None, c.m.poll_transfer()),
                }
            };
            if let Some(t) = transmit {
                for chunk in t.msg.encode() {
                    if let Err(e) = self.agent.notify_sync_message(&t.to, chunk) {
                        tracing::debug!(remote = t.to, %e, "cannot notify a generation rank");
                        break;
                    }
                }
                continue;
            }
            match action {
                None => return,
                Some(TransferAction::Post { id, request }) => {
                    match self.agent.submit_transfer(&request) {
                        Ok(st) => {
                            let (finished, waker) =
                                (Arc::clone(&self.finished), self.waker.clone());
                            st.watch_inline(move |_| {
                                finished.store(true, Ordering::SeqCst);
                                waker.wake();
                            });
                            posted.insert(id, st);
                        }
                        Err(e) => self.with_core(|c| {
                            c.m.handle_transfer_done(id, Err(e), Instant::now());
                        }),
                    }
                }
                Some(TransferAction::Abort { id }) => {
                    if let Some(st) = posted.get(&id) {
                        st.abort();
                    }
                }
            }
        }
    }

    /// Reports the posted writes that ended; true while some are left.
    fn reap(&self) -> bool {
        let (done, busy) = {
            let mut posted = lock(&self.posted);
            let mut done = Vec::new();
            posted.retain(|&id, st| match st.poll() {
                Ok(TransferState::InProgress) => true,
                Ok(TransferState::Completed) => {
                    done.push((id, Ok(())));
                    false
                }
                Err(e) => {
                    done.push((id, Err(e)));
                    false
                }
            });
            (done, !posted.is_empty())
        };
        if !done.is_empty() {
            let now = Instant::now();
            self.with_core(|c| {
                for (id, outcome) in done {
                    c.m.handle_transfer_done(id, outcome, now);
                }
            });
            self.flush();
        }
        busy
    }
}

/// The context side of the KV-cache protocol for one rank.
pub struct CacheSender {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl CacheSender {
    /// A sender for `rank` of an executor with `state`, writing from pools
    /// registered with `agent` (it takes over the agent's sync messages).
    /// `lookup` resolves `last_block_key` for partial reuse.
    ///
    /// # Errors
    /// [`CacheError::InvalidState`] for an invalid state or rank.
    pub fn new(
        agent: Arc<dyn TransferAgent>,
        state: CacheState,
        rank: u32,
        lookup: Option<Arc<dyn BlockLookup>>,
        config: SenderConfig,
    ) -> Result<Self, CacheError> {
        let timings_dir = config.timings_dir.clone();
        let timeout = config.timeout;
        let mut m = SenderMachine::new(state, rank, lookup, config)?;
        m.set_stopwatch(Instant::now);
        let shared = Arc::new(Shared {
            rank,
            timings_dir,
            timeout,
            partials_dropped: AtomicU64::new(0),
            core: Mutex::new(Core {
                m,
                cells: HashMap::new(),
                cancel_waiters: HashMap::new(),
            }),
            posted: Mutex::new(HashMap::default()),
            stop: AtomicBool::new(false),
            finished: Arc::new(AtomicBool::new(false)),
            waker: agent.sync_waker(),
            #[cfg(feature = "cuda")]
            gpu_waits: Mutex::new(None),
            agent,
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-cache-send-{rank}"))
            .spawn(move || run(&s))
            .map_err(|e| CacheError::Transfer(crate::Error::Io(Arc::new(e))))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// The request's KV cache is in `blocks` (start addresses in the
    /// registered pool, oldest first), every layer computed: send each
    /// counterpart its share once it has asked. Returns at once. A request
    /// the generation side cancelled or failed before this call ends so at
    /// once (the handle's outcome), with nothing written.
    ///
    /// # Errors
    /// [`CacheError::Closed`] after shutdown.
    pub fn send(&self, request_id: u64, blocks: Vec<u64>) -> Result<SendHandle, CacheError> {
        self.open(request_id, blocks, true)
    }

    /// Layer-wise sending: the request's KV cache will be in `blocks` (as
    /// for [`send`](Self::send)) as the prefill computes it; each layer
    /// is written once [`layers_ready`](Self::layers_ready) marks it (and
    /// the counterparts have asked). Returns at once; the handle completes
    /// when every layer landed. The configured timeout counts from here.
    ///
    /// # Errors
    /// [`CacheError::Closed`] after shutdown.
    pub fn begin(&self, request_id: u64, blocks: Vec<u64>) -> Result<SendHandle, CacheError> {
        self.open(request_id, blocks, false)
    }

    /// Model layers `layers` of request `request_id` (given to
    /// [`begin`](Self::begin)) hold their final values: their writes are
    /// posted now, or once the counterparts have asked. Call it after the
    /// layers' compute finished (for GPU memory: after the stream that
    /// computed them was synchronised). Marking a layer twice, or a
    /// request that already ended, is a no-op.
    ///
    /// # Errors
    /// [`CacheError::LayersOutOfRange`] when `layers` is empty or outside
    /// this rank's layers ([`held_layers`](Self::held_layers));
    /// [`CacheError::UnknownRequest`] without `begin`.
    pub fn layers_ready(&self, request_id: u64, layers: Range<u32>) -> Result<(), CacheError> {
        self.shared
            .act(|c| c.m.layers_ready(request_id, layers, Instant::now()))
    }

    /// As [`layers_ready`](Self::layers_ready), once the GPU work
    /// recorded before `event` completed (the layers' compute on the
    /// prefill's stream): returns at once; one thread of this sender waits
    /// on the events, in the order given (`cuEventSynchronize`). A fault in
    /// that work fails the request (`Transfer(Gpu)`). An event that never
    /// completes holds the layers (and those after it) back until the
    /// request's timeout; the waiting thread then ends with the event.
    ///
    /// # Errors
    /// As [`layers_ready`](Self::layers_ready), checked now.
    #[cfg(feature = "cuda")]
    pub fn layers_ready_after(
        &self,
        request_id: u64,
        layers: Range<u32>,
        event: crate::gpu::CudaEvent,
    ) -> Result<(), CacheError> {
        lock(&self.shared.core)
            .m
            .check_layers(request_id, &layers)?;
        let mut waits = lock(&self.shared.gpu_waits);
        if waits.is_none() {
            let (tx, rx) = crossbeam_channel::unbounded::<GpuWait>();
            let s = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name(format!("kvxfer-cache-gpu-{}", s.rank))
                .spawn(move || {
                    for (id, layers, event) in rx {
                        let synced = event.synchronize();
                        s.act(|c| match synced {
                            // The request may have ended meanwhile.
                            Ok(()) => drop(c.m.layers_ready(id, layers, Instant::now())),
                            Err(e) => {
                                let e = CacheError::Transfer(crate::Error::Gpu(e));
                                c.m.fail(id, e, Instant::now());
                            }
                        });
                    }
                })
                .map_err(|e| CacheError::Transfer(crate::Error::Io(Arc::new(e))))?;
            *waits = Some(tx);
        }
        waits
            .as_ref()
            .expect("started")
            .send((request_id, layers, event))
            .map_err(|_| CacheError::Closed)
    }

    /// The model layers this rank holds.
    pub fn held_layers(&self) -> Range<u32> {
        lock(&self.shared.core).m.held_layers()
    }

    fn open(
        &self,
        request_id: u64,
        blocks: Vec<u64>,
        all_ready: bool,
    ) -> Result<SendHandle, CacheError> {
        let s = &self.shared;
        if s.stop.load(Ordering::Relaxed) {
            return Err(CacheError::Closed);
        }
        let cell = Cell::new();
        s.act(|c| {
            let now = Instant::now();
            let r = if all_ready {
                c.m.send(request_id, blocks, now)
            } else {
                c.m.begin(request_id, blocks, now)
            };
            match r {
                Ok(()) => {
                    c.cells.insert(request_id, Arc::clone(&cell));
                }
                Err(e) => cell.set(Err(e)),
            }
        });
        Ok(SendHandle { request_id, cell })
    }

    /// Sends and waits.
    ///
    /// # Errors
    /// As [`SendHandle::wait`].
    pub fn send_blocking(
        &self,
        request_id: u64,
        blocks: Vec<u64>,
        timeout: Duration,
    ) -> Result<SessionStats, CacheError> {
        self.send(request_id, blocks)?.wait(timeout)
    }

    /// Totals over the requests this sender finished (and the partial
    /// messages it dropped).
    pub fn metrics(&self) -> Metrics {
        let mut m = lock(&self.shared.core).m.metrics();
        m.partials_dropped = self.shared.partials_dropped.load(Ordering::Relaxed);
        m
    }

    /// Cancels a request: no new write is posted; returns once nothing
    /// posted can still read this side's blocks (they may be reused at
    /// once) and the counterparts were told. The handle then says how it
    /// ended: `Cancelled`, or completed when every share had been
    /// delivered before the aborts took (as the generation side saw it).
    /// A request that already ended — another rank's cancel reached it
    /// through the generation side, or it completed — takes the cancel as
    /// a no-op.
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`] for an id this rank does not know
    /// (nor recently finished), or `Timeout` when the posted writes do not
    /// finish within the configured timeout.
    pub fn cancel(&self, request_id: u64) -> Result<(), CacheError> {
        let s = &self.shared;
        let waiter = s.with_core(|c| {
            c.m.cancel(request_id, Instant::now())?;
            // A request that already ended (or just did) has nothing left
            // to wait for.
            if !c.m.is_open(request_id) {
                return Ok::<_, CacheError>(None);
            }
            let (tx, rx) = crossbeam_channel::bounded(1);
            c.cancel_waiters.entry(request_id).or_default().push(tx);
            Ok(Some(rx))
        })?;
        s.flush();
        s.agent.wake_sync_waiters();
        if let Some(rx) = waiter {
            rx.recv_timeout(s.timeout)
                .map_err(|_| CacheError::Timeout {
                    what: format!("cancelling request {request_id}"),
                    after: s.timeout,
                })?;
        }
        // The counterparts are told before this returns.
        s.flush();
        Ok(())
    }
}

impl Drop for CacheSender {
    /// Stops the thread and joins it; requests still open fail with
    /// `Closed` (after their posted writes finished or timed out).
    fn drop(&mut self) {
        // The GPU-event thread ends after the waits it has (not joined: a
        // wait on an event that never completes has no end).
        #[cfg(feature = "cuda")]
        lock(&self.shared.gpu_waits).take();
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.agent.wake_sync_waiters();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut c = lock(&self.shared.core);
        for (_, cell) in c.cells.drain() {
            cell.set(Err(CacheError::Closed));
        }
    }
}

/// A protocol thread's wait for the agent's sync messages: drops the
/// partial messages of peers that stopped mid-message (counting every
/// partial message dropped so far in `dropped`) and those of peers whose
/// connection ended (as the wait reports it), then waits until `due`,
/// the next partial message's expiry or [`IDLE_WAIT`], whichever comes
/// first (a message or a wake ends it sooner), and returns each whole KV
/// message with its sender and when it reached the agent.
pub(crate) fn next_messages(
    agent: &dyn TransferAgent,
    reasm: &mut Reassembler,
    due: Option<Instant>,
    dropped: &AtomicU64,
) -> Vec<(String, Msg, Instant)> {
    reasm.expire(Instant::now());
    dropped.store(reasm.dropped(), Ordering::Relaxed);
    let wait = due
        .into_iter()
        .chain(reasm.next_expiry())
        .min()
        .map_or(IDLE_WAIT, |t| {
            t.saturating_duration_since(Instant::now()).min(IDLE_WAIT)
        });
    let mut batch = agent.wait_sync_batch(wait);
    let mut msgs = Vec::new();
    // A peer whose connection ended: its unfinished message goes at that
    // point among its chunks (those after it came on a new connection).
    for (from, chunks) in batch.messages {
        let cut = batch.departed.remove(&from);
        let n = chunks.len();
        for (i, (chunk, at)) in chunks.into_iter().enumerate() {
            if cut == Some(i) {
                reasm.forget(&from);
            }
            if let Some(m) = reasm.accept(&from, &chunk, at) {
                msgs.push((from.clone(), m, at));
            }
        }
        if cut.is_some_and(|c| c >= n) {
            reasm.forget(&from);
        }
    }
    // Departed peers with nothing in this batch.
    for from in batch.departed.keys() {
        reasm.forget(from);
    }
    dropped.store(reasm.dropped(), Ordering::Relaxed);
    msgs
}

/// Locks `m`, taking over a lock poisoned by a panic elsewhere.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The protocol thread: messages in, deadlines, posted writes reaped.
fn run(s: &Shared) {
    let mut reasm = Reassembler::default();
    // Generation agents by connection info, loaded once each.
    let mut peers: HashMap<String, String> = HashMap::new();
    while !s.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let due = s.with_core(|c| {
            if c.m.poll_timeout().is_some_and(|t| t <= now) {
                c.m.handle_timeout(now);
            }
            c.m.poll_timeout()
        });
        s.flush();
        // Posted writes that finished (their callbacks set the flag, then
        // wake the wait below: never lost, the wake outlives a wait that
        // has not begun).
        if s.finished.swap(false, Ordering::SeqCst) {
            s.reap();
        }
        let msgs = next_messages(s.agent.as_ref(), &mut reasm, due, &s.partials_dropped);
        if msgs.is_empty() {
            continue;
        }
        // A request names the agent to write to by connection info: load
        // it (I/O, outside the machine's lock).
        let mut ready = Vec::with_capacity(msgs.len());
        for (from, m, _) in msgs {
            let peer = match &m {
                Msg::Request(info) => match peers.get(&info.connection) {
                    Some(a) => a.clone(),
                    None => match s.agent.load_remote_agent_by_connection(&info.connection) {
                        Ok(a) => {
                            peers.insert(info.connection.clone(), a.clone());
                            a
                        }
                        Err(e) => {
                            tracing::warn!(remote = from, %e, "cannot load a generation agent");
                            continue;
                        }
                    },
                },
                _ => from,
            };
            ready.push((peer, m));
        }
        let now = Instant::now();
        s.with_core(|c| {
            for (peer, m) in ready {
                c.m.handle_message(&peer, m, now);
            }
        });
        s.flush();
    }
    // Shutdown: nothing new is posted; what is posted is aborted and
    // waited for (bounded).
    s.with_core(|c| c.m.close(Instant::now()));
    s.flush();
    let deadline = Instant::now() + s.timeout;
    loop {
        s.finished.store(false, Ordering::SeqCst);
        s.reap();
        let left = deadline.saturating_duration_since(Instant::now());
        if lock(&s.core).m.is_idle() || left.is_zero() {
            break;
        }
        // Woken by the next write that finishes (messages are dropped:
        // the sender is closing).
        if !s.finished.load(Ordering::SeqCst) {
            let _ = s.agent.wait_sync_messages(left);
        }
    }
}
