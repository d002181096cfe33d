//! The generation side: [`CacheReceiver`] asks every context rank that
//! holds part of a request for its share (sending its destination blocks),
//! and completes the request when each rank that sends has reported its
//! share landed (`Done`, delivered after the data).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::sender::Cell;
use super::stats::{Metrics, MetricsCell, PeerMeasure, SessionStats, append_csv};
use super::wire::{Msg, Reassembler, RequestInfo, is_ours};
use super::{CacheError, CacheState, recv_ranks, target_ranks};
use crate::agent::TransferAgent;
use crate::memory::MemoryType;

/// Settings of a [`CacheReceiver`].
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    /// How long a request may take, from `request` to the last share
    /// (default 60 s); also bounds `cancel`.
    pub timeout: Duration,
    /// Directory for `rank_<r>_recv.csv` timings (default none).
    pub timings_dir: Option<PathBuf>,
    /// Memory type of the pool (default DRAM).
    pub mem_type: MemoryType,
}

impl Default for ReceiverConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            timings_dir: None,
            mem_type: MemoryType::Dram,
        }
    }
}

/// One request to receive.
#[derive(Clone, Debug)]
pub struct RecvRequest {
    /// The request id (the context side's).
    pub request_id: u64,
    /// The context side's attention-DP group serving it (0 without DP).
    pub ctx_dp_rank: u32,
    /// Destination blocks in this rank's registered pool, oldest first:
    /// the request's last `blocks.len()` blocks land there (earlier ones
    /// are reused locally). Each block is written whole, in the layout of
    /// the [module docs](super#block-layout), padding slots of the last
    /// block included.
    pub blocks: Vec<u64>,
    /// Key of the sequence's last block, for the context side's block
    /// lookup (partial reuse); `None`: the context side uses the blocks it
    /// was given in `send`.
    pub last_block_key: Option<u64>,
}

/// Handle on one request being received.
#[derive(Clone)]
pub struct RecvHandle {
    request_id: u64,
    cell: Arc<Cell<SessionStats>>,
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
    /// # Errors
    /// `Timeout` when `timeout` passes first; `Cancelled` when the context
    /// side cancelled; the request's failure.
    pub fn wait(&self, timeout: Duration) -> Result<SessionStats, CacheError> {
        self.cell.wait(timeout, "cache receive")
    }
}

struct Req {
    cell: Arc<Cell<SessionStats>>,
    /// Context agents asked (every target rank).
    asked: Vec<String>,
    /// Context agent → its share, for the ranks that send.
    senders: BTreeMap<String, Share>,
    /// Agents that answered `Cancelled` (or `Done`) after a cancel.
    settled: Vec<String>,
    /// Set when this side cancelled: the outcome is `cancel`'s to record.
    cancelling: bool,
    failed: Option<CacheError>,
    start: Instant,
    request_info: Duration,
    mapping: Duration,
    deadline: Instant,
}

/// One context rank's share of a request, as the receiver saw it.
#[derive(Default)]
struct Share {
    rank: u32,
    /// When its `Ready` reached this agent.
    ready: Option<Instant>,
    /// When its `Done` reached this agent (after the share's data).
    done: Option<Instant>,
    bytes: u64,
    fragments: u64,
    fragments_coalesced: u64,
}

struct Shared {
    agent: Arc<dyn TransferAgent>,
    state: CacheState,
    rank: u32,
    ctx_state: CacheState,
    /// Context agent names, by context rank.
    ctx_agents: Vec<String>,
    config: ReceiverConfig,
    reqs: Mutex<HashMap<u64, Req>>,
    stop: AtomicBool,
    metrics: MetricsCell,
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
        if rank >= state.world_size() {
            return Err(CacheError::InvalidState(format!(
                "rank {rank} outside TP {} × PP {}",
                state.tp, state.pp
            )));
        }
        if ctx_connections.len() != ctx_state.world_size() as usize {
            return Err(CacheError::InvalidState(format!(
                "{} context connections for {} context ranks",
                ctx_connections.len(),
                ctx_state.world_size()
            )));
        }
        let ctx_agents = ctx_connections
            .iter()
            .map(|c| agent.load_remote_agent_by_connection(c))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = Arc::new(Shared {
            agent,
            state,
            rank,
            ctx_state,
            ctx_agents,
            config,
            reqs: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            metrics: MetricsCell::default(),
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
    /// A duplicate id, a mapping error, or a context rank that cannot be
    /// reached (the request is then withdrawn from the ones asked).
    pub fn request(&self, req: RecvRequest) -> Result<RecvHandle, CacheError> {
        let s = &self.shared;
        if s.stop.load(Ordering::Relaxed) {
            return Err(CacheError::Closed);
        }
        let start = Instant::now();
        let targets = target_ranks(&s.state, s.rank, &s.ctx_state, req.ctx_dp_rank)?;
        let senders = recv_ranks(&s.state, s.rank, &s.ctx_state, req.ctx_dp_rank)?;
        let mapping = start.elapsed();
        let n = req.blocks.len();
        if n == 0 {
            return Err(CacheError::InvalidState(
                "a request needs at least one block".into(),
            ));
        }
        let info = RequestInfo {
            request_id: req.request_id,
            gen_rank: s.rank,
            gen_dp_rank: s.state.attention_dp.map_or(0, |d| d.rank),
            gen_state: s.state.clone(),
            connection: s.agent.local_connection_info(),
            index_from_end: (n - 1) as u32,
            last_block_key: req.last_block_key,
            blocks: req.blocks,
            pool_mem_type: s.config.mem_type,
        };
        let asked: Vec<String> = targets
            .ranks
            .iter()
            .map(|&c| s.ctx_agents[c as usize].clone())
            .collect();
        let cell = Cell::new();
        {
            let mut reqs = lock(&s.reqs);
            if reqs.contains_key(&req.request_id) {
                return Err(CacheError::DuplicateRequest(req.request_id));
            }
            reqs.insert(
                req.request_id,
                Req {
                    cell: Arc::clone(&cell),
                    asked: asked.clone(),
                    senders: senders
                        .iter()
                        .map(|&c| {
                            let share = Share {
                                rank: c,
                                ..Share::default()
                            };
                            (s.ctx_agents[c as usize].clone(), share)
                        })
                        .collect(),
                    settled: Vec::new(),
                    cancelling: false,
                    failed: None,
                    start,
                    request_info: Duration::ZERO,
                    mapping,
                    deadline: start + s.config.timeout,
                },
            );
        }
        let chunks = Msg::Request(info).encode();
        for (i, a) in asked.iter().enumerate() {
            for c in &chunks {
                if let Err(e) = s.agent.notify_sync_message(a, c.clone()) {
                    lock(&s.reqs).remove(&req.request_id);
                    for b in &asked[..i] {
                        notify(
                            s,
                            b,
                            &Msg::Cancel {
                                request_id: req.request_id,
                            },
                        );
                    }
                    return Err(e.into());
                }
            }
        }
        if let Some(r) = lock(&s.reqs).get_mut(&req.request_id) {
            r.request_info = start.elapsed();
        }
        Ok(RecvHandle {
            request_id: req.request_id,
            cell,
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

    /// Totals over the requests this receiver finished.
    pub fn metrics(&self) -> Metrics {
        self.shared.metrics.snapshot()
    }

    /// Cancels a request: every context rank asked is told, and this
    /// returns once each rank that sends has answered (`Cancelled` after
    /// its posted writes finished, or `Done`): nothing can still land in
    /// the destination blocks, which may be reused at once. The request's
    /// handle fails with `Cancelled` (unless it had completed).
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`]; `Timeout` when a context rank does
    /// not answer within the configured timeout (then its writes may still
    /// land: the blocks must not be reused).
    pub fn cancel(&self, request_id: u64) -> Result<(), CacheError> {
        let s = &self.shared;
        let asked = match lock(&s.reqs).get_mut(&request_id) {
            Some(r) => {
                r.cancelling = true;
                r.asked.clone()
            }
            None => return Err(CacheError::UnknownRequest(request_id)),
        };
        for a in &asked {
            notify(s, a, &Msg::Cancel { request_id });
        }
        let deadline = Instant::now() + s.config.timeout;
        loop {
            {
                let mut reqs = lock(&s.reqs);
                let Some(r) = reqs.get(&request_id) else {
                    return Ok(());
                };
                let open = r
                    .senders
                    .iter()
                    .any(|(a, v)| v.done.is_none() && !r.settled.contains(a));
                if !open {
                    let r = reqs.remove(&request_id).expect("present");
                    if r.cell.get().is_none() {
                        s.metrics.ended(true);
                    }
                    r.cell.set(Err(CacheError::Cancelled {
                        request_id,
                        reason: "cancelled by the generation side".into(),
                    }));
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(CacheError::Timeout {
                    what: format!("context ranks acknowledging the cancel of request {request_id}"),
                    after: s.config.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

impl Drop for CacheReceiver {
    /// Stops and joins the thread; open requests fail with `Closed`.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.agent.wake_sync_waiters();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for (_, r) in lock(&self.shared.reqs).drain() {
            r.cell.set(Err(CacheError::Closed));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn notify(s: &Shared, agent: &str, m: &Msg) {
    for c in m.encode() {
        if let Err(e) = s.agent.notify_sync_message(agent, c) {
            tracing::debug!(remote = agent, %e, "cannot notify a context rank");
            return;
        }
    }
}

fn run(s: &Shared) {
    let mut reasm = Reassembler::default();
    while !s.stop.load(Ordering::Relaxed) {
        // Stamped on arrival: a share's timings do not depend on when
        // this thread got to its messages.
        for (from, msgs) in s.agent.wait_sync_messages_timed(Duration::from_millis(5)) {
            for (chunk, at) in msgs {
                if !is_ours(&chunk) {
                    continue;
                }
                match reasm.feed(&from, &chunk) {
                    Ok(Some(m)) => message(s, &from, m, at),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(%e, "dropping a KV-cache message"),
                }
            }
        }
        // Deadlines; failed requests whose every sender has settled are
        // dropped (a timed-out one stays until `cancel` settles it).
        let now = Instant::now();
        let mut reqs = lock(&s.reqs);
        reqs.retain(|_, r| {
            r.failed.is_none()
                || r.senders
                    .iter()
                    .any(|(a, v)| v.done.is_none() && !r.settled.contains(a))
        });
        let late: Vec<u64> = reqs
            .iter()
            .filter(|(_, r)| now > r.deadline && r.cell.get().is_none())
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(r) = reqs.get(&id) {
                let missing: Vec<u32> = r
                    .senders
                    .values()
                    .filter(|v| v.done.is_none())
                    .map(|v| v.rank)
                    .collect();
                s.metrics.ended(false);
                r.cell.set(Err(CacheError::Timeout {
                    what: format!("request {id}: shares of context ranks {missing:?}"),
                    after: s.config.timeout,
                }));
            }
        }
    }
}

fn message(s: &Shared, from: &str, m: Msg, at: Instant) {
    let id = m.request_id();
    let mut reqs = lock(&s.reqs);
    let Some(r) = reqs.get_mut(&id) else {
        tracing::debug!(
            remote = from,
            request = id,
            "message about an unknown request"
        );
        return;
    };
    match m {
        Msg::Ready { .. } => {
            if let Some(v) = r.senders.get_mut(from) {
                v.ready.get_or_insert(at);
            }
        }
        Msg::Done {
            bytes,
            fragments,
            fragments_coalesced,
            ..
        } => {
            let Some(v) = r.senders.get_mut(from) else {
                r.failed.get_or_insert(CacheError::Protocol {
                    peer: from.to_owned(),
                    detail: format!("a share of request {id} from a rank that should not send"),
                });
                return;
            };
            v.done = Some(at);
            v.bytes = bytes;
            v.fragments = fragments;
            v.fragments_coalesced = fragments_coalesced;
            if r.senders.values().all(|v| v.done.is_some()) && r.failed.is_none() {
                let r = reqs.remove(&id).expect("present");
                complete(s, id, r);
            }
        }
        Msg::Cancelled {
            reason, failure, ..
        } => {
            r.settled.push(from.to_owned());
            // This side's cancel records its own outcome; a replica that
            // never sends has nothing of its own to report while ranks
            // that send exist.
            if r.cancelling || (!r.senders.contains_key(from) && !r.senders.is_empty()) {
                return;
            }
            let e = CacheError::Cancelled {
                request_id: id,
                reason: format!("context agent {from}: {reason}"),
            };
            r.failed.get_or_insert(e.clone());
            if r.cell.get().is_none() {
                // Counted as the context side counts it.
                s.metrics.ended(!failure);
            }
            r.cell.set(Err(e));
        }
        other => tracing::warn!(remote = from, ?other, "unexpected message on a receiver"),
    }
}

fn complete(s: &Shared, id: u64, r: Req) {
    // The last share's arrival (the `Done` that completes the request).
    let end = r
        .senders
        .values()
        .filter_map(|v| v.done)
        .max()
        .unwrap_or_else(Instant::now);
    let first_ready = r.senders.values().filter_map(|v| v.ready).min();
    let peers: Vec<PeerMeasure> = r
        .senders
        .values()
        .map(|v| {
            let a = v.ready.unwrap_or(r.start);
            PeerMeasure {
                peer_rank: v.rank,
                delay: a.saturating_duration_since(r.start),
                duration: v.done.unwrap_or(end).saturating_duration_since(a),
                bytes: v.bytes,
            }
        })
        .collect();
    let stats = SessionStats {
        request_id: id,
        request_info: r.request_info,
        mapping: r.mapping,
        preprocess: Duration::ZERO,
        transmission: end.saturating_duration_since(first_ready.unwrap_or(r.start)),
        postprocess: Duration::ZERO,
        bytes: peers.iter().map(|p| p.bytes).sum(),
        peers,
        fragments: r.senders.values().map(|v| v.fragments).sum(),
        fragments_coalesced: r.senders.values().map(|v| v.fragments_coalesced).sum(),
        staging_copies: 0,
    };
    if let Some(dir) = &s.config.timings_dir
        && let Err(e) = append_csv(dir, s.rank, "recv", &stats)
    {
        tracing::warn!(%e, "cannot write receive timings");
    }
    s.metrics.completed(&stats);
    r.cell.set(Ok(stats));
}
