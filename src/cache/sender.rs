//! The context side: [`CacheSender`] waits until every generation rank
//! that needs part of a request has asked for it, then writes each share
//! straight from the context pool into the generation pool, closing it with
//! a `Done` sync message ordered after the data.
//!
//! One thread per sender runs the protocol: it takes the agent's sync
//! messages (the sender owns its agent's notifications), commands from the
//! API, and the completion of the writes it posted.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::lookup::walk_back;
use super::stats::{Metrics, MetricsCell, PeerMeasure, SessionStats, append_csv};
use super::wire::{Msg, Reassembler, RequestInfo, is_ours};
use super::{
    BlockLookup, CacheError, CacheState, distinct_heads, map_blocks, rank_slice, target_ranks,
};
use crate::agent::{TransferAgent, TransferRequest, TransferStatus};
use crate::memory::{MemoryDesc, MemoryDescs, MemoryType};

/// Settings of a [`CacheSender`].
#[derive(Clone, Debug)]
pub struct SenderConfig {
    /// After `send`, how long every counterpart has to ask, and then how
    /// long the writes have to complete (default 60 s).
    pub timeout: Duration,
    /// Bytes per posted write batch (default 64 MiB): cancellation stops
    /// between batches.
    pub batch_bytes: u64,
    /// Write batches in flight per peer (default 4).
    pub batches_in_flight: usize,
    /// Directory for `rank_<r>_send.csv` timings (default none).
    pub timings_dir: Option<PathBuf>,
    /// Memory type of the pool (default DRAM).
    pub mem_type: MemoryType,
}

impl Default for SenderConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            batch_bytes: 64 << 20,
            batches_in_flight: 4,
            timings_dir: None,
            mem_type: MemoryType::Dram,
        }
    }
}

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
        let mut g = self.value.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(v);
            self.cv.notify_all();
        }
    }

    pub(crate) fn get(&self) -> Option<Result<T, CacheError>> {
        self.value.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn wait(&self, timeout: Duration, what: &str) -> Result<T, CacheError> {
        let deadline = Instant::now() + timeout;
        let mut g = self.value.lock().unwrap_or_else(|p| p.into_inner());
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

enum Cmd {
    Send {
        id: u64,
        blocks: Vec<u64>,
        cell: Arc<Cell<SessionStats>>,
    },
    Cancel {
        id: u64,
        reply: Sender<Result<(), CacheError>>,
    },
}

/// One generation rank's share in flight.
struct PeerWrite {
    rank: u32,
    agent: String,
    queued: VecDeque<TransferRequest>,
    inflight: Vec<TransferStatus>,
    bytes: u64,
    start: Option<Instant>,
    end: Option<Instant>,
}

#[derive(Default)]
struct Req {
    blocks: Option<Vec<u64>>,
    cell: Option<Arc<Cell<SessionStats>>>,
    /// Generation rank → (agent name, its request info).
    asked: BTreeMap<u32, (String, RequestInfo)>,
    expected: Option<BTreeSet<u32>>,
    writes: Option<Vec<PeerWrite>>,
    cancelled: Option<CacheError>,
    cancel_waiters: Vec<Sender<Result<(), CacheError>>>,
    t_send: Option<Instant>,
    t_all_asked: Option<Instant>,
    stats: SessionStats,
    deadline: Option<Instant>,
}

struct Shared {
    agent: Arc<dyn TransferAgent>,
    state: CacheState,
    rank: u32,
    lookup: Option<Arc<dyn BlockLookup>>,
    config: SenderConfig,
    stop: AtomicBool,
    metrics: MetricsCell,
}

/// The context side of the KV-cache protocol for one rank.
pub struct CacheSender {
    shared: Arc<Shared>,
    tx: Sender<Cmd>,
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
        state.validate()?;
        if rank >= state.world_size() {
            return Err(CacheError::InvalidState(format!(
                "rank {rank} outside TP {} × PP {}",
                state.tp, state.pp
            )));
        }
        let shared = Arc::new(Shared {
            agent,
            state,
            rank,
            lookup,
            config,
            stop: AtomicBool::new(false),
            metrics: MetricsCell::default(),
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-cache-send-{rank}"))
            .spawn(move || Engine::new(s, rx).run())
            .map_err(|e| CacheError::Transfer(crate::Error::Io(Arc::new(e))))?;
        Ok(Self {
            shared,
            tx,
            thread: Some(thread),
        })
    }

    /// The request's KV cache is in `blocks` (start addresses in the
    /// registered pool, oldest first): send each counterpart its share once
    /// it has asked. Returns at once.
    ///
    /// # Errors
    /// [`CacheError::Closed`] after shutdown.
    pub fn send(&self, request_id: u64, blocks: Vec<u64>) -> Result<SendHandle, CacheError> {
        let cell = Cell::new();
        self.tx
            .send(Cmd::Send {
                id: request_id,
                blocks,
                cell: Arc::clone(&cell),
            })
            .map_err(|_| CacheError::Closed)?;
        // The protocol thread may be waiting for sync messages: have it
        // take the command now.
        self.shared.agent.wake_sync_waiters();
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

    /// Totals over the requests this sender finished.
    pub fn metrics(&self) -> Metrics {
        self.shared.metrics.snapshot()
    }

    /// Cancels a request: no new write is posted; returns once nothing
    /// posted can still read this side's blocks (they may be reused at
    /// once) and the counterparts were told.
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`], or `Timeout` when the posted writes
    /// do not finish within the configured timeout.
    pub fn cancel(&self, request_id: u64) -> Result<(), CacheError> {
        let (reply, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(Cmd::Cancel {
                id: request_id,
                reply,
            })
            .map_err(|_| CacheError::Closed)?;
        self.shared.agent.wake_sync_waiters();
        let t = self.shared.config.timeout;
        rx.recv_timeout(t).unwrap_or(Err(CacheError::Timeout {
            what: format!("cancelling request {request_id}"),
            after: t,
        }))
    }
}

impl Drop for CacheSender {
    /// Stops the thread and joins it; requests still open fail with
    /// `Closed` (after their posted writes finished or timed out).
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.agent.wake_sync_waiters();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The protocol thread's state.
struct Engine {
    s: Arc<Shared>,
    rx: Receiver<Cmd>,
    reqs: HashMap<u64, Req>,
    /// Finished requests, so late messages about them are answered.
    finished: VecDeque<u64>,
    peers: HashMap<String, String>,
    reasm: Reassembler,
}

impl Engine {
    fn new(s: Arc<Shared>, rx: Receiver<Cmd>) -> Self {
        Self {
            s,
            rx,
            reqs: HashMap::new(),
            finished: VecDeque::new(),
            peers: HashMap::new(),
            reasm: Reassembler::default(),
        }
    }

    fn run(mut self) {
        while !self.s.stop.load(Ordering::Relaxed) {
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd);
            }
            let wait = if self.reqs.values().any(|r| r.writes.is_some()) {
                Duration::from_micros(200)
            } else {
                Duration::from_millis(5)
            };
            for (from, msgs) in self.s.agent.wait_sync_messages(wait) {
                for chunk in msgs {
                    if !is_ours(&chunk) {
                        continue;
                    }
                    match self.reasm.feed(&from, &chunk) {
                        Ok(Some(m)) => self.message(&from, m),
                        Ok(None) => {}
                        Err(e) => tracing::warn!(%e, "dropping a KV-cache message"),
                    }
                }
            }
            let ids: Vec<u64> = self.reqs.keys().copied().collect();
            for id in ids {
                self.progress(id);
            }
        }
        // Shutdown: nothing new is posted; wait (bounded) for what is.
        let ids: Vec<u64> = self.reqs.keys().copied().collect();
        for id in ids {
            self.cancel(id, CacheError::Closed);
            let deadline = Instant::now() + self.s.config.timeout;
            while self.reqs.contains_key(&id) && Instant::now() < deadline {
                self.progress(id);
                std::thread::sleep(Duration::from_micros(500));
            }
        }
    }

    fn notify(&self, agent: &str, m: &Msg) {
        for c in m.encode() {
            if let Err(e) = self.s.agent.notify_sync_message(agent, c) {
                tracing::debug!(remote = agent, %e, "cannot notify a generation rank");
                return;
            }
        }
    }

    /// Tells each of `agents` that request `id` is cancelled, and why.
    fn tell_cancelled(&self, agents: &[String], id: u64, why: &CacheError) {
        let m = Msg::Cancelled {
            request_id: id,
            reason: why.to_string(),
            failure: !matches!(why, CacheError::Cancelled { .. }),
        };
        for a in agents {
            self.notify(a, &m);
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Send { id, blocks, cell } => {
                if self.finished.contains(&id) {
                    self.finished.retain(|&f| f != id);
                }
                let r = self.reqs.entry(id).or_default();
                if r.cell.is_some() {
                    cell.set(Err(CacheError::DuplicateRequest(id)));
                    return;
                }
                r.blocks = Some(blocks);
                r.cell = Some(cell);
                r.t_send = Some(Instant::now());
                r.stats.request_id = id;
                r.deadline = Some(Instant::now() + self.s.config.timeout);
                self.try_start(id);
            }
            Cmd::Cancel { id, reply } => match self.reqs.get_mut(&id) {
                Some(r) => {
                    r.cancel_waiters.push(reply);
                    self.cancel(
                        id,
                        CacheError::Cancelled {
                            request_id: id,
                            reason: "cancelled by the context side".into(),
                        },
                    );
                }
                None => {
                    let _ = reply.send(Err(CacheError::UnknownRequest(id)));
                }
            },
        }
    }

    fn message(&mut self, from: &str, m: Msg) {
        match m {
            Msg::Request(info) => self.request_info(from, info),
            Msg::Cancel { request_id } => {
                if self.reqs.contains_key(&request_id) {
                    self.cancel(
                        request_id,
                        CacheError::Cancelled {
                            request_id,
                            reason: format!("cancelled by generation agent {from}"),
                        },
                    );
                } else {
                    // Nothing of it is (or will be) in flight here.
                    self.notify(
                        from,
                        &Msg::Cancelled {
                            request_id,
                            reason: "not in progress on the context side".into(),
                            failure: false,
                        },
                    );
                }
            }
            other => tracing::warn!(remote = from, ?other, "unexpected message on a sender"),
        }
    }

    fn request_info(&mut self, from: &str, info: RequestInfo) {
        let id = info.request_id;
        // The generation agent, loaded once per connection.
        let agent = match self.peers.get(&info.connection) {
            Some(a) => a.clone(),
            None => match self
                .s
                .agent
                .load_remote_agent_by_connection(&info.connection)
            {
                Ok(a) => {
                    self.peers.insert(info.connection.clone(), a.clone());
                    a
                }
                Err(e) => {
                    tracing::warn!(remote = from, %e, "cannot load a generation agent");
                    return;
                }
            },
        };
        if self.finished.contains(&id) {
            self.notify(
                &agent,
                &Msg::Cancelled {
                    request_id: id,
                    reason: "request already finished on the context side".into(),
                    failure: true,
                },
            );
            return;
        }
        if let Err(e) = self.s.state.check_compatible(&info.gen_state) {
            self.notify(
                &agent,
                &Msg::Cancelled {
                    request_id: id,
                    reason: e.to_string(),
                    failure: true,
                },
            );
            return;
        }
        let r = self.reqs.entry(id).or_default();
        r.stats.request_id = id;
        if let Some(c) = &r.cancelled {
            let reason = c.to_string();
            let failure = !matches!(c, CacheError::Cancelled { .. });
            self.notify(
                &agent,
                &Msg::Cancelled {
                    request_id: id,
                    reason,
                    failure,
                },
            );
            return;
        }
        if r.expected.is_none() {
            match expected_ranks(&self.s.state, self.s.rank, &info) {
                Ok(e) => r.expected = Some(e),
                Err(e) => {
                    self.notify(
                        &agent,
                        &Msg::Cancelled {
                            request_id: id,
                            reason: e.to_string(),
                            failure: true,
                        },
                    );
                    return;
                }
            }
        }
        r.deadline
            .get_or_insert(Instant::now() + self.s.config.timeout);
        r.asked.insert(info.gen_rank, (agent, info));
        self.try_start(id);
    }

    /// Starts writing once `send` was called and every counterpart asked.
    fn try_start(&mut self, id: u64) {
        let s = Arc::clone(&self.s);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.writes.is_some() || r.cancelled.is_some() {
            return;
        }
        let (Some(blocks), Some(expected)) = (&r.blocks, &r.expected) else {
            return;
        };
        if !expected.iter().all(|g| r.asked.contains_key(g)) {
            return;
        }
        let now = Instant::now();
        r.t_all_asked = Some(now);
        r.stats.request_info = now.saturating_duration_since(r.t_send.unwrap_or(now));
        let t_map = Instant::now();
        let mut writes = Vec::new();
        let mut failure = None;
        for (&g, (agent, info)) in &r.asked {
            if !expected.contains(&g) {
                continue;
            }
            if !sends_to(&s.state, s.rank, g, info) {
                continue;
            }
            let want = info.index_from_end as usize + 1;
            let src_blocks = match (info.last_block_key, &s.lookup) {
                (Some(key), Some(l)) => match walk_back(l.as_ref(), key, want) {
                    Some(b) => b,
                    None => {
                        failure = Some(CacheError::UnknownBlockKey(key));
                        break;
                    }
                },
                _ if blocks.len() >= want => blocks[blocks.len() - want..].to_vec(),
                _ => {
                    failure = Some(CacheError::Protocol {
                        peer: agent.clone(),
                        detail: format!("asks for {want} blocks, the request has {}", blocks.len()),
                    });
                    break;
                }
            };
            let mut frags = Vec::new();
            let st =
                match share_fragments(&s.state, s.rank, g, info, agent, &src_blocks, &mut frags) {
                    Ok(st) => st,
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                };
            r.stats.fragments += st.fragments;
            r.stats.fragments_coalesced += st.coalesced;
            // Batches of at most `batch_bytes`; the last carries `Done` as
            // its sync message, so it arrives after all of the share.
            let mut batches: Vec<(Vec<MemoryDesc>, Vec<MemoryDesc>)> = vec![Default::default()];
            let mut size = 0u64;
            let cap = s.config.batch_bytes.max(1);
            for f in frags {
                // Large coalesced fragments are split so that a batch stays
                // within `batch_bytes` (the cancellation granularity).
                let mut off = 0;
                while off < f.len {
                    if size >= cap {
                        batches.push(Default::default());
                        size = 0;
                    }
                    let n = (f.len - off).min(cap - size);
                    let b = batches.last_mut().expect("never empty");
                    b.0.push(MemoryDesc::new(f.src + off, n, 0));
                    b.1.push(MemoryDesc::new(f.dst + off, n, 0));
                    size += n;
                    off += n;
                }
            }
            let done = Msg::Done {
                request_id: id,
                bytes: st.bytes,
                fragments: st.fragments,
                fragments_coalesced: st.coalesced,
            }
            .encode();
            let n = batches.len();
            let queued: VecDeque<TransferRequest> = batches
                .into_iter()
                .enumerate()
                .map(|(i, (l, rm))| {
                    let t = TransferRequest::write(
                        MemoryDescs::new(s.config.mem_type, l),
                        MemoryDescs::new(info.pool_mem_type, rm),
                        agent.clone(),
                    );
                    if i + 1 == n {
                        t.with_sync_message(done[0].clone())
                    } else {
                        t
                    }
                })
                .collect();
            writes.push(PeerWrite {
                rank: g,
                agent: agent.clone(),
                queued,
                inflight: Vec::new(),
                bytes: st.bytes,
                start: None,
                end: None,
            });
        }
        r.stats.mapping = t_map.elapsed();
        if let Some(e) = failure {
            let agents: Vec<String> = r.asked.values().map(|(a, _)| a.clone()).collect();
            self.tell_cancelled(&agents, id, &e);
            self.finish(id, Err(e));
            return;
        }
        let t_pre = Instant::now();
        for w in &writes {
            self.notify(&w.agent, &Msg::Ready { request_id: id });
        }
        if let Some(r) = self.reqs.get_mut(&id) {
            r.stats.preprocess = t_pre.elapsed();
            r.writes = Some(writes);
        }
        self.progress(id);
    }

    /// Posts queued batches, reaps completed ones, finishes the request
    /// when every share landed (or, once cancelled, when nothing posted is
    /// left), enforces the deadline.
    fn progress(&mut self, id: u64) {
        let s = Arc::clone(&self.s);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let Some(writes) = r.writes.as_mut() else {
            if r.cancelled.is_some() {
                let e = r.cancelled.clone().expect("checked");
                self.finish(id, Err(e));
            } else if r.deadline.is_some_and(|d| Instant::now() > d) {
                let missing: Vec<u32> = r
                    .expected
                    .iter()
                    .flatten()
                    .filter(|g| !r.asked.contains_key(g))
                    .copied()
                    .collect();
                let e = CacheError::Timeout {
                    what: format!(
                        "request {id}: generation ranks {missing:?} never asked (or the expected set is unknown)"
                    ),
                    after: s.config.timeout,
                };
                self.cancel(id, e);
            }
            return;
        };
        let mut failed = None;
        for w in writes.iter_mut() {
            let mut i = 0;
            while i < w.inflight.len() {
                match w.inflight[i].poll() {
                    Ok(crate::TransferState::InProgress) => i += 1,
                    Ok(_) => {
                        w.inflight.swap_remove(i);
                    }
                    Err(e) => {
                        w.inflight.swap_remove(i);
                        failed.get_or_insert(CacheError::Transfer(e));
                    }
                }
            }
            if r.cancelled.is_some() || failed.is_some() {
                // Nothing more goes out: what is queued is dropped, what is
                // posted is aborted (it ends once nothing of it moves).
                w.queued.clear();
                for st in &w.inflight {
                    st.abort();
                }
            }
            while w.inflight.len() < s.config.batches_in_flight {
                let Some(req) = w.queued.pop_front() else {
                    break;
                };
                w.start.get_or_insert_with(Instant::now);
                match s.agent.submit_transfer(&req) {
                    Ok(st) => w.inflight.push(st),
                    Err(e) => {
                        failed.get_or_insert(CacheError::Transfer(e));
                        w.queued.clear();
                    }
                }
            }
            if w.queued.is_empty() && w.inflight.is_empty() && w.end.is_none() {
                w.end = Some(Instant::now());
            }
        }
        if let Some(e) = failed
            && r.cancelled.is_none()
        {
            r.cancelled = Some(e);
        }
        let idle = writes
            .iter()
            .all(|w| w.queued.is_empty() && w.inflight.is_empty());
        if !idle {
            if r.deadline.is_some_and(|d| Instant::now() > d) && r.cancelled.is_none() {
                r.cancelled = Some(CacheError::Timeout {
                    what: format!("request {id}: writes"),
                    after: s.config.timeout,
                });
            }
            return;
        }
        let t_post = Instant::now();
        let start = writes.iter().filter_map(|w| w.start).min();
        let end = writes.iter().filter_map(|w| w.end).max();
        let base = r.t_all_asked.unwrap_or(t_post);
        r.stats.peers = writes
            .iter()
            .map(|w| PeerMeasure {
                peer_rank: w.rank,
                delay: w
                    .start
                    .map_or(Duration::ZERO, |t| t.saturating_duration_since(base)),
                duration: match (w.start, w.end) {
                    (Some(a), Some(b)) => b.saturating_duration_since(a),
                    _ => Duration::ZERO,
                },
                bytes: w.bytes,
            })
            .collect();
        r.stats.bytes = writes.iter().map(|w| w.bytes).sum();
        r.stats.transmission = match (start, end) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        match r.cancelled.clone() {
            Some(e) => {
                // Nothing posted is left: tell every counterpart.
                let agents: Vec<String> = r.asked.values().map(|(a, _)| a.clone()).collect();
                self.tell_cancelled(&agents, id, &e);
                self.finish(id, Err(e));
            }
            None => {
                r.stats.postprocess = t_post.elapsed();
                let stats = r.stats.clone();
                if let Some(dir) = &s.config.timings_dir
                    && let Err(e) = append_csv(dir, s.rank, "send", &stats)
                {
                    tracing::warn!(%e, "cannot write send timings");
                }
                self.finish(id, Ok(stats));
            }
        }
    }

    /// Marks a request cancelled; what is queued is dropped by `progress`,
    /// which finishes it once nothing posted is left.
    fn cancel(&mut self, id: u64, why: CacheError) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.cancelled.is_none() {
            r.cancelled = Some(why.clone());
        }
        if r.writes.is_none() {
            let agents: Vec<String> = r.asked.values().map(|(a, _)| a.clone()).collect();
            self.tell_cancelled(&agents, id, &why);
        }
        self.progress(id);
    }

    fn finish(&mut self, id: u64, outcome: Result<SessionStats, CacheError>) {
        let Some(r) = self.reqs.remove(&id) else {
            return;
        };
        for w in r.cancel_waiters {
            let _ = w.send(Ok(()));
        }
        if r.cell.is_some() {
            match &outcome {
                Ok(stats) => self.s.metrics.completed(stats),
                Err(e) => self
                    .s
                    .metrics
                    .ended(matches!(e, CacheError::Cancelled { .. })),
            }
        }
        if let Some(c) = r.cell {
            c.set(outcome);
        }
        self.finished.push_back(id);
        if self.finished.len() > 4096 {
            self.finished.pop_front();
        }
    }
}

/// The generation ranks that must ask context rank `rank` (of `me`) before
/// a request of `info`'s DP group can start: those both sides map onto
/// each other.
///
/// # Errors
/// As [`target_ranks`], for a peer state or rank outside what it can map.
pub(crate) fn expected_ranks(
    me: &CacheState,
    rank: u32,
    info: &RequestInfo,
) -> Result<BTreeSet<u32>, CacheError> {
    let gen_s = &info.gen_state;
    let ctx_dp = me.attention_dp.map_or(0, |d| d.rank);
    target_ranks(me, rank, gen_s, info.gen_dp_rank).map(|t| {
        t.ranks
            .into_iter()
            .filter(|&g| target_ranks(gen_s, g, me, ctx_dp).is_ok_and(|b| b.ranks.contains(&rank)))
            .collect()
    })
}

/// Whether context rank `rank` of `me` writes generation rank `g`'s share
/// (one sender among replicas of the same heads).
pub(crate) fn sends_to(me: &CacheState, rank: u32, g: u32, info: &RequestInfo) -> bool {
    let ctx_dp = me.attention_dp.map_or(0, |d| d.rank);
    super::needs_send(me, rank, &info.gen_state, info.gen_dp_rank).unwrap_or(false)
        && super::recv_ranks(&info.gen_state, g, me, ctx_dp).is_ok_and(|v| v.contains(&rank))
}

/// The fragments that move context rank `rank`'s share of blocks
/// `src_blocks` into generation rank `g`'s blocks `info.blocks` (appended
/// to `out`).
///
/// # Errors
/// [`CacheError::Protocol`] naming `peer` when the block counts differ, or
/// a destination block's fragments would run past the end of the address
/// space.
pub(crate) fn share_fragments(
    me: &CacheState,
    rank: u32,
    g: u32,
    info: &RequestInfo,
    peer: &str,
    src_blocks: &[u64],
    out: &mut Vec<super::Fragment>,
) -> Result<super::FragmentStats, CacheError> {
    let bad = |detail: String| CacheError::Protocol {
        peer: peer.to_owned(),
        detail,
    };
    if info.blocks.len() != src_blocks.len() {
        return Err(bad(format!(
            "{} destination blocks for {}",
            info.blocks.len(),
            src_blocks.len()
        )));
    }
    let d = distinct_heads(me, &info.gen_state);
    let src = rank_slice(me, rank, d);
    let dst = rank_slice(&info.gen_state, g, d);
    if info
        .blocks
        .iter()
        .any(|b| b.checked_add(dst.block_bytes()).is_none())
    {
        return Err(bad(
            "a destination block runs past the end of the address space".into(),
        ));
    }
    map_blocks(&src, &dst, src_blocks, &info.blocks, out)
}

/// What a context rank computes from a peer's request, without agents or
/// threads (for the fuzz targets): the compatibility check, the expected
/// ranks, and each share's fragments, from source blocks at fixed
/// addresses.
#[cfg(feature = "fuzzing")]
pub fn context_plan(me: &CacheState, rank: u32, info: &RequestInfo) {
    if me.check_compatible(&info.gen_state).is_err() {
        return;
    }
    let Ok(expected) = expected_ranks(me, rank, info) else {
        return;
    };
    let src: Vec<u64> = (0..info.blocks.len() as u64)
        .map(|i| 0x1000_0000 + i * (1 << 20))
        .collect();
    for g in expected {
        if sends_to(me, rank, g, info) {
            let mut out = Vec::new();
            let _ = share_fragments(me, rank, g, info, "fuzz", &src, &mut out);
        }
    }
}
