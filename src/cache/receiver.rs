//! The generation side's driver: [`CacheReceiver`] runs a
//! [`ReceiverMachine`] over a [`TransferAgent`] — the agent's sync
//! messages in (stamped on arrival), the machine's messages out — on one
//! thread per receiver (the receiver owns its agent's notifications).
//! `request` sends its request infos from the caller's thread.
//!
//! A request's outcome is reported once nothing more of it can land in its
//! blocks (see [the machine](super::machine::ReceiverMachine)), except an
//! [`Unsettled`](CacheError::Unsettled) one, after which
//! [`RecvHandle::wait_settled`] says when the blocks are safe to reuse.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::{ReceiverConfig, RecvRequest};
use super::machine::{ReceiverEvent, ReceiverMachine};
use super::sender::{Cell, lock, next_messages};
use super::stats::{Metrics, SessionStats};
use super::timings::record_timings;
use super::wire::Reassembler;
use super::{CacheError, CacheState};
use crate::agent::TransferAgent;

/// One request's layers as they land.
#[derive(Default)]
struct Progress {
    state: Mutex<Landings>,
    cv: Condvar,
}

#[derive(Default)]
struct Landings {
    /// Runs of layers that landed, in order, with when.
    runs: Vec<(Range<u32>, Instant)>,
    /// The request ended.
    ended: bool,
    /// Nothing more of it can land: it ended and every rank writing it
    /// stopped (`Some(Ok)`), or it was forgotten with ranks unconfirmed
    /// (`Some(Err)`).
    settled: Option<Result<(), CacheError>>,
}

impl Progress {
    fn landed(&self, layers: Range<u32>, at: Instant) {
        lock(&self.state).runs.push((layers, at));
        self.cv.notify_all();
    }

    fn ended(&self) {
        lock(&self.state).ended = true;
        self.cv.notify_all();
    }

    /// Waits up to `timeout` until `done` holds: the state, or `None` when
    /// the time ran out first.
    fn wait_for(
        &self,
        timeout: Duration,
        mut done: impl FnMut(&Landings) -> bool,
    ) -> Option<std::sync::MutexGuard<'_, Landings>> {
        let deadline = Instant::now() + timeout;
        let mut g = lock(&self.state);
        while !done(&g) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Some(g)
    }

    fn settled(&self, outcome: Result<(), CacheError>) {
        lock(&self.state).settled.get_or_insert(outcome);
        self.cv.notify_all();
    }
}

/// Handle on one request being received.
#[derive(Clone)]
pub struct RecvHandle {
    request_id: u64,
    cell: Arc<Cell<SessionStats>>,
    progress: Arc<Progress>,
    /// The model layers this rank holds.
    held: Range<u32>,
}

impl RecvHandle {
    /// The request.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// Whether the request finished (received, failed or cancelled).
    pub fn is_done(&self) -> bool {
        self.cell.get().is_some()
    }

    /// Waits until every share landed.
    ///
    /// Any outcome but [`CacheError::Unsettled`] (and this wait's own
    /// `Timeout`) means that nothing of the request can land any more: the
    /// blocks may be reused at once. After `Unsettled`, they may be reused
    /// once [`wait_settled`](Self::wait_settled) returns `Ok`.
    ///
    /// # Errors
    /// `Timeout` when `timeout` passes first; `Cancelled` when the context
    /// side cancelled; `Unsettled` when a context rank did not confirm that
    /// it stopped writing; the request's failure.
    pub fn wait(&self, timeout: Duration) -> Result<SessionStats, CacheError> {
        self.cell.wait(timeout, "cache receive")
    }

    /// Waits until nothing of the request can land in its blocks any more:
    /// it completed, or it ended otherwise and every context rank that
    /// writes them delivered its share or confirmed that it stopped. After
    /// `Ok` the blocks may be reused.
    ///
    /// # Errors
    /// `Timeout` when `timeout` passes first (the request may still be
    /// open, or ranks unconfirmed); the request's
    /// [`Unsettled`](CacheError::Unsettled) outcome when it was forgotten
    /// (one receiver timeout after that outcome) with ranks still
    /// unconfirmed: whether they write is not known.
    pub fn wait_settled(&self, timeout: Duration) -> Result<(), CacheError> {
        let g = self
            .progress
            .wait_for(timeout, |g| g.settled.is_some())
            .ok_or_else(|| CacheError::Timeout {
                what: format!("request {} settling", self.request_id),
                after: timeout,
            })?;
        g.settled.clone().expect("settled")
    }

    /// The runs of this rank's layers that landed whole so far (every
    /// context rank writing them reported them), in the order they did,
    /// each with when its report reached this agent. A sender that sends
    /// the whole request at once reports its layers together at the end.
    pub fn layers_landed(&self) -> Vec<(Range<u32>, Instant)> {
        lock(&self.progress.state).runs.clone()
    }

    /// Waits until every layer in `layers` landed (or the request
    /// completed).
    ///
    /// # Errors
    /// [`CacheError::LayersOutOfRange`] when `layers` is empty or not
    /// within this rank's layers; `Timeout` when `timeout` passes first;
    /// the request's failure when it ended without them.
    pub fn wait_layers(&self, layers: Range<u32>, timeout: Duration) -> Result<(), CacheError> {
        super::check_within(&layers, self.held.clone())?;
        let landed = |g: &Landings| {
            let mut want: Vec<bool> = vec![true; layers.len()];
            for (run, _) in &g.runs {
                for l in run.start.max(layers.start)..run.end.min(layers.end) {
                    want[(l - layers.start) as usize] = false;
                }
            }
            !want.contains(&true)
        };
        let g = self
            .progress
            .wait_for(timeout, |g| g.ended || landed(g))
            .ok_or_else(|| CacheError::Timeout {
                what: format!("layers {layers:?} of request {}", self.request_id),
                after: timeout,
            })?;
        if landed(&g) {
            return Ok(());
        }
        drop(g);
        self.wait(Duration::ZERO).map(|_| ())
    }
}

/// What a cancel waiting for its request to settle hears: settled, or the
/// request's `Unsettled` outcome.
type SettleWaiter = crossbeam_channel::Sender<Result<(), CacheError>>;

/// The machine and what waits on its outcomes.
struct Core {
    m: ReceiverMachine,
    cells: HashMap<u64, (Arc<Cell<SessionStats>>, Arc<Progress>)>,
    /// Requests reported `Unsettled`, until they settle or are forgotten.
    unsettled: HashMap<u64, (Arc<Progress>, CacheError)>,
    settle_waiters: HashMap<u64, Vec<SettleWaiter>>,
}

struct Shared {
    agent: Arc<dyn TransferAgent>,
    rank: u32,
    timings_dir: Option<PathBuf>,
    timeout: Duration,
    settle_timeout: Duration,
    /// Partial messages the protocol thread's reassembler dropped.
    partials_dropped: AtomicU64,
    /// Lock order: `sending` before `core`.
    core: Mutex<Core>,
    /// Held while the machine's messages are sent, so that they go out in
    /// its order.
    sending: Mutex<()>,
    stop: AtomicBool,
}

impl Shared {
    /// Runs `f` on the machine, then hands its outcomes to the handles and
    /// cancel waiters.
    fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        let mut rows = Vec::new();
        let out = {
            let mut c = lock(&self.core);
            let out = f(&mut c);
            while let Some(ev) = c.m.poll_event() {
                match ev {
                    ReceiverEvent::Finished {
                        request_id,
                        outcome,
                    } => {
                        let unsettled = match &outcome {
                            Err(e @ CacheError::Unsettled { .. }) => Some(e.clone()),
                            _ => None,
                        };
                        if let Some(e) = &unsettled {
                            for w in c.settle_waiters.remove(&request_id).into_iter().flatten() {
                                let _ = w.send(Err(e.clone()));
                            }
                        }
                        if let Some((cell, progress)) = c.cells.remove(&request_id) {
                            if let (Ok(stats), Some(_)) = (&outcome, &self.timings_dir) {
                                rows.push(stats.clone());
                            }
                            match unsettled {
                                Some(e) => {
                                    c.unsettled.insert(request_id, (Arc::clone(&progress), e));
                                }
                                None => progress.settled(Ok(())),
                            }
                            cell.set(outcome);
                            progress.ended();
                        }
                    }
                    ReceiverEvent::LayersLanded {
                        request_id,
                        layers,
                        at,
                    } => {
                        if let Some((_, progress)) = c.cells.get(&request_id) {
                            progress.landed(layers, at);
                        }
                    }
                    ReceiverEvent::Settled { request_id } => {
                        for w in c.settle_waiters.remove(&request_id).into_iter().flatten() {
                            let _ = w.send(Ok(()));
                        }
                        if let Some((progress, _)) = c.unsettled.remove(&request_id) {
                            progress.settled(Ok(()));
                        }
                    }
                    ReceiverEvent::Forgotten { request_id } => {
                        if let Some((progress, e)) = c.unsettled.remove(&request_id) {
                            progress.settled(Err(e));
                        }
                    }
                }
            }
            out
        };
        record_timings(self.timings_dir.as_deref(), self.rank, "recv", &rows);
        out
    }

    /// Sends the machine's messages, in its order.
    fn flush(&self) {
        let _order = lock(&self.sending);
        loop {
            let Some(t) = lock(&self.core).m.poll_transmit() else {
                return;
            };
            for chunk in t.msg.encode() {
                if let Err(e) = self.agent.notify_sync_message(&t.to, chunk) {
                    self.with_core(|c| {
                        c.m.handle_transmit_failed(&t.to, &t.msg, e, Instant::now());
                    });
                    break;
                }
            }
        }
    }
}

/// The generation side of the KV-cache protocol for one rank.
pub struct CacheReceiver {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl CacheReceiver {
    /// A receiver for `rank` of an executor with `state`, whose pools are
    /// registered with `agent` (it takes over the agent's sync messages).
    /// The context executor is `ctx_state`, its ranks reachable at
    /// `ctx_connections` (connection info by context rank: the `CommState`),
    /// which are loaded now.
    ///
    /// # Errors
    /// An invalid or incompatible state, a wrong number of connections, or
    /// a context agent that cannot be loaded.
    pub fn new(
        agent: Arc<dyn TransferAgent>,
        state: CacheState,
        rank: u32,
        ctx_state: CacheState,
        ctx_connections: &[String],
        config: ReceiverConfig,
    ) -> Result<Self, CacheError> {
        ctx_state.check_compatible(&state)?;
        if ctx_connections.len() != ctx_state.world_size() as usize {
            return Err(CacheError::InvalidState(format!(
                "{} context connections for {} context ranks",
                ctx_connections.len(),
                ctx_state.world_size()
            )));
        }
        if rank >= state.world_size() {
            return Err(CacheError::InvalidState(format!(
                "rank {rank} outside TP {} × PP {}",
                state.tp, state.pp
            )));
        }
        let ctx_agents = ctx_connections
            .iter()
            .map(|c| agent.load_remote_agent_by_connection(c))
            .collect::<Result<Vec<_>, _>>()?;
        let timings_dir = config.timings_dir.clone();
        let (timeout, settle_timeout) = (config.timeout, config.settle_timeout);
        let connection = agent.local_connection_info();
        let mut m = ReceiverMachine::new(state, rank, ctx_state, ctx_agents, connection, config)?;
        m.set_stopwatch(Instant::now);
        let shared = Arc::new(Shared {
            agent,
            rank,
            timings_dir,
            timeout,
            settle_timeout,
            partials_dropped: AtomicU64::new(0),
            core: Mutex::new(Core {
                m,
                cells: HashMap::new(),
                unsettled: HashMap::new(),
                settle_waiters: HashMap::new(),
            }),
            sending: Mutex::new(()),
            stop: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-cache-recv-{rank}"))
            .spawn(move || run(&s))
            .map_err(|e| CacheError::Transfer(crate::Error::Io(Arc::new(e))))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks the context ranks for `req`'s cache. Returns at once.
    ///
    /// # Errors
    /// A duplicate id, a mapping error, or the first context rank asked
    /// that cannot be reached. A later rank that cannot be reached
    /// withdraws the request from the ones already asked, and the handle
    /// fails with it once they confirmed (they may have begun writing).
    pub fn request(&self, req: RecvRequest) -> Result<RecvHandle, CacheError> {
        let s = &self.shared;
        if s.stop.load(Ordering::Relaxed) {
            return Err(CacheError::Closed);
        }
        let request_id = req.request_id;
        let cell = Cell::new();
        let progress = Arc::new(Progress::default());
        let held = lock(&s.core).m.held_layers();
        s.with_core(|c| {
            c.m.request(req, Instant::now())?;
            c.cells
                .insert(request_id, (Arc::clone(&cell), Arc::clone(&progress)));
            Ok::<_, CacheError>(())
        })?;
        s.flush();
        // A receiver makes no transfers: a transport error this early means
        // a request info could not be sent (and the request was withdrawn).
        if let Some(Err(e @ CacheError::Transfer(_))) = cell.get() {
            return Err(e);
        }
        s.with_core(|c| c.m.handle_request_sent(request_id, Instant::now()));
        // The protocol thread now waits for this request's deadline too.
        s.agent.wake_sync_waiters();
        Ok(RecvHandle {
            request_id,
            cell,
            progress,
            held,
        })
    }

    /// Requests and waits.
    ///
    /// # Errors
    /// As [`request`](Self::request) and [`RecvHandle::wait`].
    pub fn request_blocking(
        &self,
        req: RecvRequest,
        timeout: Duration,
    ) -> Result<SessionStats, CacheError> {
        self.request(req)?.wait(timeout)
    }

    /// Totals over the requests this receiver finished (and the partial
    /// messages it dropped).
    pub fn metrics(&self) -> Metrics {
        let mut m = lock(&self.shared.core).m.metrics();
        m.partials_dropped = self.shared.partials_dropped.load(Ordering::Relaxed);
        m
    }

    /// Cancels a request: every context rank asked is told, and this
    /// returns once each rank that sends has answered (`Cancelled` after
    /// its posted writes finished, or `Done`): nothing can still land in
    /// the destination blocks, which may be reused at once. The request's
    /// handle fails with `Cancelled` (unless it had completed or failed).
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`]; [`CacheError::Unsettled`] when a
    /// context rank does not answer within the settle timeout (then its
    /// writes may still land: the blocks must not be reused before
    /// [`RecvHandle::wait_settled`] returns `Ok`).
    pub fn cancel(&self, request_id: u64) -> Result<(), CacheError> {
        let s = &self.shared;
        let (tx, rx) = crossbeam_channel::bounded(1);
        s.with_core(|c| {
            c.settle_waiters.entry(request_id).or_default().push(tx);
            let r = c.m.cancel(request_id, Instant::now());
            if r.is_err() {
                c.settle_waiters.remove(&request_id);
            }
            r
        })?;
        s.flush();
        s.agent.wake_sync_waiters();
        // The machine reports the request settled or `Unsettled` within the
        // settle timeout; the margin only bounds this wait.
        let bound = s.settle_timeout + s.timeout;
        rx.recv_timeout(bound).unwrap_or_else(|_| {
            Err(CacheError::Timeout {
                what: format!("context ranks acknowledging the cancel of request {request_id}"),
                after: bound,
            })
        })
    }
}

impl Drop for CacheReceiver {
    /// Stops and joins the thread; open requests fail with `Closed`
    /// (`Unsettled`, caused by `Closed`, where a context rank may still
    /// write: their `wait_settled` then fails).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.agent.wake_sync_waiters();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.shared.with_core(|c| c.m.close());
    }
}

/// The protocol thread: messages in (stamped on arrival, so a share's
/// timings do not depend on when this thread got to them), deadlines. What
/// the machine asks to send goes out as soon as it asks: a failure found
/// at a deadline reaches the context ranks at once.
fn run(s: &Shared) {
    let mut reasm = Reassembler::default();
    while !s.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let mut gone = Vec::new();
        let due = s.with_core(|c| {
            if c.m.poll_timeout().is_some_and(|t| t <= now) {
                c.m.handle_timeout(now);
            }
            // A context rank the agent no longer knows left (its metadata
            // store entry went): its requests fail now, not at their
            // deadline.
            for a in c.m.awaited_agents() {
                if let Err(crate::Error::UnknownAgent(_)) = s.agent.remote_transport(&a) {
                    let e = crate::Error::PeerGone { remote: a.clone() };
                    c.m.handle_peer_gone(&a, e, now);
                    gone.push(a);
                }
            }
            c.m.poll_timeout()
        });
        s.flush();
        // Partial messages of ranks that left.
        for a in &gone {
            reasm.forget(a);
        }
        let msgs = next_messages(s.agent.as_ref(), &mut reasm, due, &s.partials_dropped);
        if !msgs.is_empty() {
            s.with_core(|c| {
                for (from, m, at) in msgs {
                    c.m.handle_message(&from, m, at);
                }
            });
        }
        s.flush();
    }
}
