//! The context side's protocol: wait until every generation rank that
//! needs part of a request has asked for it and the serving engine has
//! called `send`, then write each share from the context pool straight into
//! the generation pool, in batches, the last one carrying `Done` as its
//! sync message so that it arrives after the share's data.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Stopwatch, TransferAction, TransferId, Transmit, lap};
use crate::agent::TransferRequest;
use crate::cache::lookup::walk_back;
use crate::cache::wire::{Msg, RequestInfo};
use crate::cache::{
    BlockLookup, CacheError, CacheState, Fragment, FragmentStats, Metrics, PeerMeasure,
    SenderConfig, SessionStats, distinct_heads, map_blocks, rank_slice, target_ranks,
};
use crate::memory::{MemoryDesc, MemoryDescs};
use crate::small::FastHash;

/// Finished request ids remembered, so that a late request for one is
/// answered instead of waiting for a `send` that never comes.
const FINISHED_KEPT: usize = 4096;

/// What a [`SenderMachine`] reports to its driver.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum SenderEvent {
    /// A request ended: every share landed (`Ok`, with its measures), or it
    /// was cancelled or failed and nothing posted for it can still read
    /// the context pool (its blocks may be reused). Reported for every
    /// request the machine knew, whether or not `send` was called for it.
    Finished {
        /// The request.
        request_id: u64,
        /// Its outcome.
        outcome: Result<SessionStats, CacheError>,
    },
}

/// One generation rank's share of a request.
struct Share {
    rank: u32,
    agent: String,
    queued: VecDeque<TransferRequest>,
    inflight: Vec<TransferId>,
    /// Abort was asked for what is in flight.
    aborted: bool,
    bytes: u64,
    start: Option<Instant>,
    end: Option<Instant>,
}

#[derive(Default)]
struct Req {
    /// The request's blocks, once `send` was called.
    blocks: Option<Vec<u64>>,
    /// Generation rank → (agent name, its request info).
    asked: BTreeMap<u32, (String, RequestInfo)>,
    expected: Option<BTreeSet<u32>>,
    /// Set once writing started.
    shares: Option<Vec<Share>>,
    cancelled: Option<CacheError>,
    t_send: Option<Instant>,
    t_all_asked: Option<Instant>,
    stats: SessionStats,
    deadline: Option<Instant>,
}

impl Req {
    fn asked_agents(&self) -> Vec<String> {
        self.asked.values().map(|(a, _)| a.clone()).collect()
    }
}

/// The context side of the KV-cache protocol for one rank, without I/O
/// (see the [module docs](super)).
pub struct SenderMachine {
    state: CacheState,
    rank: u32,
    lookup: Option<Arc<dyn BlockLookup>>,
    config: SenderConfig,
    stopwatch: Option<Stopwatch>,
    /// Open requests, by id (ids come from peers: a keyed hash).
    reqs: HashMap<u64, Req>,
    finished: VecDeque<u64>,
    finished_set: HashSet<u64>,
    /// Posted transfer → its request and share.
    transfers: HashMap<TransferId, (u64, usize), FastHash>,
    next_transfer: u64,
    transmits: VecDeque<Transmit>,
    actions: VecDeque<TransferAction>,
    events: VecDeque<SenderEvent>,
    metrics: Metrics,
}

impl SenderMachine {
    /// A machine for `rank` of an executor with `state`; `lookup` resolves
    /// `last_block_key` for partial reuse. `config.timings_dir` is the
    /// driver's business.
    ///
    /// # Errors
    /// [`CacheError::InvalidState`] for an invalid state or rank.
    pub fn new(
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
        Ok(Self {
            state,
            rank,
            lookup,
            config,
            stopwatch: None,
            reqs: HashMap::new(),
            finished: VecDeque::new(),
            finished_set: HashSet::new(),
            transfers: HashMap::default(),
            next_transfer: 0,
            transmits: VecDeque::new(),
            actions: VecDeque::new(),
            events: VecDeque::new(),
            metrics: Metrics::default(),
        })
    }

    /// Measures the durations inside one step with `stopwatch` (statistics
    /// only).
    pub fn set_stopwatch(&mut self, stopwatch: Stopwatch) {
        self.stopwatch = Some(stopwatch);
    }

    /// The settings.
    pub fn config(&self) -> &SenderConfig {
        &self.config
    }

    /// Totals over the requests `send` was called for that finished.
    pub fn metrics(&self) -> Metrics {
        self.metrics
    }

    /// No request is open (after [`close`](Self::close): everything
    /// posted has ended).
    pub fn is_idle(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Transfers posted and not yet reported done.
    pub fn transfers_in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// The request's KV cache is in `blocks` (start addresses in the
    /// registered pool, oldest first): each counterpart gets its share once
    /// it has asked. The request fails with a timeout when they have not
    /// all asked, or the writes have not all landed, within
    /// `config.timeout`.
    ///
    /// # Errors
    /// [`CacheError::DuplicateRequest`] when `send` was already called for
    /// this id and it has not finished.
    pub fn send(
        &mut self,
        request_id: u64,
        blocks: Vec<u64>,
        now: Instant,
    ) -> Result<(), CacheError> {
        if self.finished_set.remove(&request_id) {
            self.finished.retain(|&f| f != request_id);
        }
        let r = self.reqs.entry(request_id).or_default();
        if r.blocks.is_some() {
            return Err(CacheError::DuplicateRequest(request_id));
        }
        r.blocks = Some(blocks);
        r.t_send = Some(now);
        r.stats.request_id = request_id;
        r.deadline = Some(now + self.config.timeout);
        self.try_start(request_id, now);
        Ok(())
    }

    /// Cancels a request: nothing new is posted, what is posted is
    /// aborted; it finishes (`Cancelled`) once nothing posted is left, and
    /// then the counterparts are told.
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`].
    pub fn cancel(&mut self, request_id: u64, now: Instant) -> Result<(), CacheError> {
        if !self.reqs.contains_key(&request_id) {
            return Err(CacheError::UnknownRequest(request_id));
        }
        let why = CacheError::Cancelled {
            request_id,
            reason: "cancelled by the context side".into(),
        };
        self.cancel_with(request_id, why, now);
        Ok(())
    }

    /// Cancels every open request with [`CacheError::Closed`]; the machine
    /// is idle once what they posted has ended.
    pub fn close(&mut self, now: Instant) {
        let ids: Vec<u64> = self.reqs.keys().copied().collect();
        for id in ids {
            self.cancel_with(id, CacheError::Closed, now);
        }
    }

    /// A message from agent `from`. For a [`Msg::Request`], `from` is the
    /// name under which the driver loaded the agent of `info.connection`:
    /// the writes and answers go there.
    pub fn handle_message(&mut self, from: &str, msg: Msg, now: Instant) {
        match msg {
            Msg::Request(info) => self.request_info(from, info, now),
            Msg::Cancel { request_id } => {
                if self.reqs.contains_key(&request_id) {
                    let why = CacheError::Cancelled {
                        request_id,
                        reason: format!("cancelled by generation agent {from}"),
                    };
                    self.cancel_with(request_id, why, now);
                } else {
                    // Nothing of it is (or will be) in flight here.
                    self.transmit(
                        from,
                        Msg::Cancelled {
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

    /// A posted transfer ended (or its submission was refused: `Err`).
    /// Unknown ids are ignored.
    pub fn handle_transfer_done(
        &mut self,
        id: TransferId,
        outcome: Result<(), crate::Error>,
        now: Instant,
    ) {
        let Some((request_id, share)) = self.transfers.remove(&id) else {
            return;
        };
        if let Some(r) = self.reqs.get_mut(&request_id) {
            if let Some(s) = r.shares.as_mut().and_then(|v| v.get_mut(share)) {
                s.inflight.retain(|&t| t != id);
            }
            if let Err(e) = outcome {
                r.cancelled.get_or_insert(CacheError::Transfer(e));
            }
        }
        self.progress(request_id, now);
    }

    /// Time passed: requests past their deadline fail with a timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.cancelled.is_none() && r.deadline.is_some_and(|d| now >= d))
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            let r = &self.reqs[&id];
            let what = if r.shares.is_some() {
                format!("request {id}: writes")
            } else {
                let missing: Vec<u32> = r
                    .expected
                    .iter()
                    .flatten()
                    .filter(|g| !r.asked.contains_key(g))
                    .copied()
                    .collect();
                format!(
                    "request {id}: generation ranks {missing:?} never asked (or the expected set is unknown)"
                )
            };
            let e = CacheError::Timeout {
                what,
                after: self.config.timeout,
            };
            self.cancel_with(id, e, now);
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.reqs
            .values()
            .filter(|r| r.cancelled.is_none())
            .filter_map(|r| r.deadline)
            .min()
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next transfer to post or abort.
    pub fn poll_transfer(&mut self) -> Option<TransferAction> {
        self.actions.pop_front()
    }

    /// The next outcome to report.
    pub fn poll_event(&mut self) -> Option<SenderEvent> {
        self.events.pop_front()
    }

    fn transmit(&mut self, to: &str, msg: Msg) {
        self.transmits.push_back(Transmit {
            to: to.to_owned(),
            msg,
        });
    }

    fn tell_cancelled(&mut self, agents: &[String], id: u64, why: &CacheError) {
        for a in agents {
            self.transmit(
                a,
                Msg::Cancelled {
                    request_id: id,
                    reason: why.to_string(),
                    failure: !matches!(why, CacheError::Cancelled { .. }),
                },
            );
        }
    }

    fn refuse(&mut self, to: &str, id: u64, reason: String) {
        self.transmit(
            to,
            Msg::Cancelled {
                request_id: id,
                reason,
                failure: true,
            },
        );
    }

    fn request_info(&mut self, agent: &str, info: RequestInfo, now: Instant) {
        let id = info.request_id;
        if self.finished_set.contains(&id) {
            self.refuse(
                agent,
                id,
                "request already finished on the context side".into(),
            );
            return;
        }
        if let Err(e) = self.state.check_compatible(&info.gen_state) {
            self.refuse(agent, id, e.to_string());
            return;
        }
        let r = self.reqs.entry(id).or_default();
        r.stats.request_id = id;
        if let Some(c) = &r.cancelled {
            let m = Msg::Cancelled {
                request_id: id,
                reason: c.to_string(),
                failure: !matches!(c, CacheError::Cancelled { .. }),
            };
            self.transmit(agent, m);
            return;
        }
        if r.expected.is_none() {
            // Each generation rank this rank serves costs a plan of its
            // own: a layout that maps it onto too many (a hostile
            // generation state can name millions) is refused before any.
            let peers = target_ranks(&self.state, self.rank, &info.gen_state, info.gen_dp_rank)
                .map_or(0, |t| t.ranks.len());
            if peers > self.config.max_peer_ranks {
                let max = self.config.max_peer_ranks;
                self.reqs.remove(&id);
                self.refuse(
                    agent,
                    id,
                    format!("the layout maps this context rank onto {peers} generation ranks (at most {max})"),
                );
                return;
            }
            match expected_ranks(&self.state, self.rank, &info) {
                Ok(e) => r.expected = Some(e),
                Err(e) => {
                    self.refuse(agent, id, e.to_string());
                    return;
                }
            }
        }
        r.deadline.get_or_insert(now + self.config.timeout);
        r.asked.insert(info.gen_rank, (agent.to_owned(), info));
        self.try_start(id, now);
    }

    /// Starts writing once `send` was called and every counterpart asked.
    fn try_start(&mut self, id: u64, now: Instant) {
        let t_map = lap(self.stopwatch, now);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.shares.is_some() || r.cancelled.is_some() {
            return;
        }
        let (Some(blocks), Some(expected)) = (&r.blocks, &r.expected) else {
            return;
        };
        if !expected.iter().all(|g| r.asked.contains_key(g)) {
            return;
        }
        r.t_all_asked = Some(now);
        r.stats.request_info = now.saturating_duration_since(r.t_send.unwrap_or(now));
        let mut shares = Vec::new();
        let mut failure = None;
        for (&g, (agent, info)) in &r.asked {
            if !expected.contains(&g) || !sends_to(&self.state, self.rank, g, info) {
                continue;
            }
            match plan_share(
                &self.state,
                self.rank,
                g,
                info,
                agent,
                blocks,
                self.lookup.as_deref(),
                &self.config,
            ) {
                Ok((share, st)) => {
                    r.stats.fragments += st.fragments;
                    r.stats.fragments_coalesced += st.coalesced;
                    shares.push(share);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let t_pre = lap(self.stopwatch, now);
        r.stats.mapping = t_pre.saturating_duration_since(t_map);
        if let Some(e) = failure {
            let agents = r.asked_agents();
            self.tell_cancelled(&agents, id, &e);
            self.finish(id, Err(e));
            return;
        }
        let ready: Vec<String> = shares.iter().map(|s| s.agent.clone()).collect();
        r.shares = Some(shares);
        for a in ready {
            self.transmit(&a, Msg::Ready { request_id: id });
        }
        let t_end = lap(self.stopwatch, now);
        if let Some(r) = self.reqs.get_mut(&id) {
            r.stats.preprocess = t_end.saturating_duration_since(t_pre);
        }
        self.progress(id, now);
    }

    /// Posts queued batches up to the window, aborts what is posted once
    /// the request is cancelled, finishes the request when nothing is
    /// queued or posted.
    fn progress(&mut self, id: u64, now: Instant) {
        let Self {
            reqs,
            transfers,
            next_transfer,
            actions,
            config,
            ..
        } = self;
        let Some(r) = reqs.get_mut(&id) else {
            return;
        };
        let Some(shares) = r.shares.as_mut() else {
            if let Some(e) = r.cancelled.clone() {
                self.finish(id, Err(e));
            }
            return;
        };
        let stop = r.cancelled.is_some();
        for (i, s) in shares.iter_mut().enumerate() {
            if stop {
                s.queued.clear();
                if !s.aborted {
                    s.aborted = true;
                    for &t in &s.inflight {
                        actions.push_back(TransferAction::Abort { id: t });
                    }
                }
            }
            while s.inflight.len() < config.batches_in_flight.max(1) {
                let Some(request) = s.queued.pop_front() else {
                    break;
                };
                let t = TransferId(*next_transfer);
                *next_transfer += 1;
                transfers.insert(t, (id, i));
                s.inflight.push(t);
                s.start.get_or_insert(now);
                actions.push_back(TransferAction::Post { id: t, request });
            }
            if s.queued.is_empty() && s.inflight.is_empty() && s.end.is_none() {
                s.end = Some(now);
            }
        }
        if shares
            .iter()
            .any(|s| !s.queued.is_empty() || !s.inflight.is_empty())
        {
            return;
        }
        // Nothing queued or posted is left.
        let t_post = lap(self.stopwatch, now);
        let stopwatch = self.stopwatch;
        let r = self.reqs.get_mut(&id).expect("present");
        let shares = r.shares.as_ref().expect("present");
        let start = shares.iter().filter_map(|s| s.start).min();
        let end = shares.iter().filter_map(|s| s.end).max();
        let base = r.t_all_asked.unwrap_or(now);
        r.stats.peers = shares
            .iter()
            .map(|s| PeerMeasure {
                peer_rank: s.rank,
                delay: s
                    .start
                    .map_or(Duration::ZERO, |t| t.saturating_duration_since(base)),
                duration: match (s.start, s.end) {
                    (Some(a), Some(b)) => b.saturating_duration_since(a),
                    _ => Duration::ZERO,
                },
                bytes: s.bytes,
            })
            .collect();
        r.stats.bytes = shares.iter().map(|s| s.bytes).sum();
        r.stats.transmission = match (start, end) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        match r.cancelled.clone() {
            Some(e) => {
                let agents = r.asked_agents();
                self.tell_cancelled(&agents, id, &e);
                self.finish(id, Err(e));
            }
            None => {
                r.stats.postprocess = lap(stopwatch, now).saturating_duration_since(t_post);
                let stats = r.stats.clone();
                self.finish(id, Ok(stats));
            }
        }
    }

    /// Marks a request cancelled (the first reason wins); `progress`
    /// finishes it once nothing posted is left.
    fn cancel_with(&mut self, id: u64, why: CacheError, now: Instant) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        r.cancelled.get_or_insert(why.clone());
        if r.shares.is_none() {
            let agents = r.asked_agents();
            self.tell_cancelled(&agents, id, &why);
        }
        self.progress(id, now);
    }

    fn finish(&mut self, id: u64, outcome: Result<SessionStats, CacheError>) {
        let Some(r) = self.reqs.remove(&id) else {
            return;
        };
        if r.blocks.is_some() {
            match &outcome {
                Ok(stats) => self.metrics.record_completed(stats),
                Err(e) => self
                    .metrics
                    .record_ended(matches!(e, CacheError::Cancelled { .. })),
            }
        }
        self.events.push_back(SenderEvent::Finished {
            request_id: id,
            outcome,
        });
        if self.finished_set.insert(id) {
            self.finished.push_back(id);
        }
        if self.finished.len() > FINISHED_KEPT
            && let Some(old) = self.finished.pop_front()
        {
            self.finished_set.remove(&old);
        }
    }
}

/// One share's writes: the fragments of context rank `rank`'s part of the
/// request for generation rank `g`, in batches of at most
/// `config.batch_bytes`, the last carrying `Done`.
#[allow(clippy::too_many_arguments)]
fn plan_share(
    me: &CacheState,
    rank: u32,
    g: u32,
    info: &RequestInfo,
    agent: &str,
    blocks: &[u64],
    lookup: Option<&dyn BlockLookup>,
    config: &SenderConfig,
) -> Result<(Share, FragmentStats), CacheError> {
    let want = info.index_from_end as usize + 1;
    let src_blocks = match (info.last_block_key, lookup) {
        (Some(key), Some(l)) => walk_back(l, key, want).ok_or(CacheError::UnknownBlockKey(key))?,
        _ if blocks.len() >= want => blocks[blocks.len() - want..].to_vec(),
        _ => {
            return Err(CacheError::Protocol {
                peer: agent.to_owned(),
                detail: format!("asks for {want} blocks, the request has {}", blocks.len()),
            });
        }
    };
    let mut frags = Vec::new();
    let st = share_fragments(me, rank, g, info, agent, &src_blocks, &mut frags)?;
    // Large coalesced fragments are split so that a batch stays within
    // `batch_bytes` (the cancellation granularity).
    let mut batches: Vec<(Vec<MemoryDesc>, Vec<MemoryDesc>)> = vec![Default::default()];
    let mut size = 0u64;
    let cap = config.batch_bytes.max(1);
    for f in frags {
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
        request_id: info.request_id,
        bytes: st.bytes,
        fragments: st.fragments,
        fragments_coalesced: st.coalesced,
    }
    .encode();
    let n = batches.len();
    let queued = batches
        .into_iter()
        .enumerate()
        .map(|(i, (l, rm))| {
            let t = TransferRequest::write(
                MemoryDescs::new(config.mem_type, l),
                MemoryDescs::new(info.pool_mem_type, rm),
                agent,
            );
            if i + 1 == n {
                t.with_sync_message(done[0].clone())
            } else {
                t
            }
        })
        .collect();
    let share = Share {
        rank: g,
        agent: agent.to_owned(),
        queued,
        inflight: Vec::new(),
        aborted: false,
        bytes: st.bytes,
        start: None,
        end: None,
    };
    Ok((share, st))
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
    crate::cache::needs_send(me, rank, &info.gen_state, info.gen_dp_rank).unwrap_or(false)
        && crate::cache::recv_ranks(&info.gen_state, g, me, ctx_dp).is_ok_and(|v| v.contains(&rank))
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
    out: &mut Vec<Fragment>,
) -> Result<FragmentStats, CacheError> {
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
