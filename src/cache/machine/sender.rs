//! The context side's protocol: wait until every generation rank that
//! needs part of a request has asked for it and the serving engine has
//! called `send` (or `begin`), then write each share from the context pool
//! straight into the generation pool, in batches, and send `Done` once
//! every write of the share completed — never while one of them failed or
//! is still in flight, so a share with a hole in it is never reported
//! landed.
//!
//! Layer-wise: after `begin`, the engine marks layers ready as its prefill
//! produces them (`layers_ready`); each newly ready run of layers is a
//! group whose writes are queued as soon as the share is planned; `Landed`
//! (or `Done`, for the share's last group) goes once the group's writes
//! and every earlier one of the share completed. `send` is `begin` with
//! every layer ready: one group.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cache::config::SenderConfig;
use crate::cache::error::{CacheError, check_within};
use crate::cache::fragments::{FragmentStats, RankSlice, distinct_heads, map_layers, rank_slice};
use crate::cache::lookup::{BlockLookup, walk_back};
use crate::cache::machine::{Stopwatch, TransferAction, TransferId, Transmit, lap};
use crate::cache::mapping::{needs_send, recv_ranks, target_ranks};
use crate::cache::state::CacheState;
use crate::cache::stats::{Metrics, PeerMeasure, SessionStats};
use crate::cache::wire::{Msg, RequestInfo};
use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryDescs};
use crate::proto::TransferRequest;
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
    /// The context blocks it reads (the request's last ones, or found by
    /// key).
    src_blocks: Vec<u64>,
    /// What the two ranks hold of a block: (context, generation).
    slices: (RankSlice, RankSlice),
    /// The model layers both ranks hold: what it moves.
    layers: Range<u32>,
    /// Layers of `layers` whose writes were queued.
    released: u32,
    queued: VecDeque<TransferRequest>,
    inflight: Vec<TransferId>,
    /// Writes queued so far (a write's sequence number is its place in
    /// this count).
    batches: u64,
    /// Writes posted so far.
    posted: u64,
    /// Writes completed, from the first, with none missing before them.
    acked: u64,
    /// Writes completed beyond `acked`.
    acked_beyond: BTreeSet<u64>,
    /// Reports (`Landed`, `Done`) waiting for `acked` to reach the write
    /// count before them.
    reports: VecDeque<(u64, Msg)>,
    /// Abort was asked for what is in flight.
    aborted: bool,
    /// It completed: `Done` was sent once every write of the share had
    /// completed.
    delivered: bool,
    /// Counts of what was queued so far.
    planned: FragmentStats,
    start: Option<Instant>,
    end: Option<Instant>,
}

impl Share {
    /// Every layer's writes were queued (`Done` follows the last).
    fn all_released(&self) -> bool {
        self.released as usize >= self.layers.len()
    }

    /// Nothing is queued or posted.
    fn drained(&self) -> bool {
        self.queued.is_empty() && self.inflight.is_empty()
    }
}

#[derive(Default)]
struct Req {
    /// The request's blocks, once `begin` (or `send`) was called.
    blocks: Option<Vec<u64>>,
    /// This rank's layers (index from its first) the engine marked ready.
    ready: Vec<bool>,
    /// Of those, the ones whose writes were queued.
    released: Vec<bool>,
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
    /// Requests of `finished` that ended before this rank had their blocks
    /// (the generation side cancelled or failed them first), with how: a
    /// later `send` or `begin` of one ends so at once.
    ended_unsent: HashMap<u64, CacheError>,
    /// Posted transfer → its request, share and sequence number there.
    transfers: HashMap<TransferId, (u64, usize, u64), FastHash>,
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
            ended_unsent: HashMap::new(),
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

    /// Whether request `request_id` is open here (begun, or asked for,
    /// and not finished).
    pub fn is_open(&self, request_id: u64) -> bool {
        self.reqs.contains_key(&request_id)
    }

    /// Transfers posted and not yet reported done.
    pub fn transfers_in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// The request's KV cache is in `blocks` (start addresses in the
    /// registered pool, oldest first), every layer of it computed: each
    /// counterpart gets its share once it has asked. The request fails
    /// with a timeout when they have not all asked, or the writes have not
    /// all landed, within `config.timeout`. A request the generation side
    /// already cancelled or failed (before this call) ends so at once,
    /// with nothing written.
    ///
    /// # Errors
    /// [`CacheError::DuplicateRequest`] when `send` or `begin` was already
    /// called for this id and it has not finished.
    pub fn send(
        &mut self,
        request_id: u64,
        blocks: Vec<u64>,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.open(request_id, blocks, true, now)
    }

    /// Layer-wise sending: the request's KV cache will be in `blocks` (as
    /// in [`send`](Self::send)), its layers written as the prefill
    /// produces them; [`layers_ready`](Self::layers_ready) says which
    /// are. Nothing of a layer is written before it is marked ready. The
    /// timeout (`config.timeout`) counts from this call.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn begin(
        &mut self,
        request_id: u64,
        blocks: Vec<u64>,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.open(request_id, blocks, false, now)
    }

    /// Model layers `layers` of a request given to [`begin`](Self::begin)
    /// hold their final KV values: their writes are queued as soon as the
    /// counterparts have asked (at once when they have). Layers already
    /// marked are skipped; a request that already ended (a replica with
    /// nothing to send, a failure, a cancel) takes this as a no-op.
    ///
    /// # Errors
    /// [`CacheError::LayersOutOfRange`] when `layers` is empty or not
    /// within this rank's layers; [`CacheError::UnknownRequest`] when
    /// `begin` was not called for it. Neither changes anything.
    pub fn layers_ready(
        &mut self,
        request_id: u64,
        layers: Range<u32>,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.check_layers(request_id, &layers)?;
        let held = self.held_layers();
        let Some(r) = self.reqs.get_mut(&request_id) else {
            // It already ended.
            return Ok(());
        };
        let from = (layers.start - held.start) as usize;
        let to = (layers.end - held.start) as usize;
        r.ready[from..to].fill(true);
        self.release(request_id, now);
        self.progress(request_id, now);
        Ok(())
    }

    /// Whether [`layers_ready`](Self::layers_ready) would take `layers`
    /// of `request_id`, without marking them.
    ///
    /// # Errors
    /// As [`layers_ready`](Self::layers_ready).
    pub fn check_layers(&self, request_id: u64, layers: &Range<u32>) -> Result<(), CacheError> {
        check_within(layers, self.held_layers())?;
        match self.reqs.get(&request_id) {
            Some(r) if r.blocks.is_some() => Ok(()),
            None if self.finished_set.contains(&request_id) => Ok(()),
            _ => Err(CacheError::UnknownRequest(request_id)),
        }
    }

    /// Fails an open request with `why` (as a cancel does: nothing new is
    /// posted, what is posted is aborted, the counterparts are told);
    /// unknown ids are ignored.
    pub fn fail(&mut self, request_id: u64, why: CacheError, now: Instant) {
        self.cancel_with(request_id, why, now);
    }

    /// The model layers this rank holds.
    pub fn held_layers(&self) -> Range<u32> {
        self.state.layer_range(self.state.coords(self.rank).1)
    }

    fn open(
        &mut self,
        request_id: u64,
        blocks: Vec<u64>,
        all_ready: bool,
        now: Instant,
    ) -> Result<(), CacheError> {
        let n = self.held_layers().len();
        if let Some(why) = self.ended_unsent.remove(&request_id) {
            // The generation side ended it before this rank had its
            // blocks: it ends so now, with nothing written (the finished
            // id stays known, so a late request info is refused).
            self.events.push_back(SenderEvent::Finished {
                request_id,
                outcome: Err(why),
            });
            return Ok(());
        }
        if self.finished_set.remove(&request_id) {
            self.finished.retain(|&f| f != request_id);
        }
        let r = self.reqs.entry(request_id).or_default();
        if r.blocks.is_some() {
            return Err(CacheError::DuplicateRequest(request_id));
        }
        r.blocks = Some(blocks);
        r.ready = vec![all_ready; n];
        r.released = vec![false; n];
        r.t_send = Some(now);
        r.stats.request_id = request_id;
        r.deadline = Some(now + self.config.timeout);
        self.try_start(request_id, now);
        Ok(())
    }

    /// Cancels a request: nothing new is posted, what is posted is
    /// aborted; it finishes (`Cancelled`) once nothing posted is left, and
    /// then the counterparts are told. A request whose every share was
    /// delivered before the aborts took finishes completed instead, as its
    /// counterparts saw it; one that already ended (another rank's cancel
    /// reached it through the generation side, or it completed) takes the
    /// cancel as a no-op.
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`] for an id this rank never had (or
    /// finished long ago).
    pub fn cancel(&mut self, request_id: u64, now: Instant) -> Result<(), CacheError> {
        if !self.reqs.contains_key(&request_id) {
            if self.finished_set.contains(&request_id) {
                return Ok(());
            }
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
    /// the writes and answers go there. A `Cancel` from an agent that did
    /// not ask for the request is dropped and counted
    /// ([`Metrics::strangers`]), as is a request info for a generation rank
    /// that another agent already asked as.
    pub fn handle_message(&mut self, from: &str, msg: Msg, now: Instant) {
        match msg {
            Msg::Request(info) => self.request_info(from, info, now),
            Msg::Cancel { request_id } => {
                // Whether `from` asked for it, when this rank has it.
                let asked = self
                    .reqs
                    .get(&request_id)
                    .map(|r| r.asked.values().any(|(a, _)| a == from));
                match asked {
                    Some(true) => {
                        let why = CacheError::Cancelled {
                            request_id,
                            reason: format!("cancelled by generation agent {from}"),
                        };
                        self.cancel_with(request_id, why, now);
                    }
                    Some(false) => {
                        self.metrics.strangers += 1;
                        tracing::warn!(
                            remote = from,
                            request = request_id,
                            "dropping a cancel from an agent that did not ask for the request"
                        );
                    }
                    // Nothing of it is (or will be) in flight here.
                    None => self.transmit(
                        from,
                        Msg::Cancelled {
                            request_id,
                            reason: "not in progress on the context side".into(),
                            failure: false,
                            integrity: false,
                        },
                    ),
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
        outcome: Result<(), Error>,
        now: Instant,
    ) {
        let Some((request_id, share, seq)) = self.transfers.remove(&id) else {
            return;
        };
        if let Some(r) = self.reqs.get_mut(&request_id) {
            if let Some(s) = r.shares.as_mut().and_then(|v| v.get_mut(share)) {
                s.inflight.retain(|&t| t != id);
                if outcome.is_ok() {
                    s.acked_beyond.insert(seq);
                    while s.acked_beyond.remove(&s.acked) {
                        s.acked += 1;
                    }
                }
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
                    integrity: is_integrity(why),
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
                integrity: false,
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
                integrity: is_integrity(c),
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
        if r.asked.get(&info.gen_rank).is_some_and(|(a, _)| a != agent) {
            // Someone else already asked as this rank: the first one's
            // request stands; this one moves nothing.
            self.metrics.strangers += 1;
            tracing::warn!(
                remote = agent,
                request = id,
                gen_rank = info.gen_rank,
                "dropping a request info for a rank another agent asked as"
            );
            return;
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
            ) {
                Ok(share) => shares.push(share),
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
        // The layers ready so far (mapping time counted by `release`).
        self.release(id, now);
        self.progress(id, now);
    }

    /// Queues the writes of the layers marked ready and not yet queued,
    /// once the shares are planned: per share, each run of such layers
    /// is a group followed by `Landed`, or `Done` when it completes the
    /// share (sent once its writes completed).
    fn release(&mut self, id: u64, now: Instant) {
        let first = self.held_layers().start;
        let t0 = lap(self.stopwatch, now);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.cancelled.is_some() {
            return;
        }
        let Some(shares) = r.shares.as_mut() else {
            return;
        };
        let mut runs = Vec::new();
        let mut l = 0;
        while l < r.ready.len() {
            if !r.ready[l] || r.released[l] {
                l += 1;
                continue;
            }
            let start = l;
            while l < r.ready.len() && r.ready[l] && !r.released[l] {
                r.released[l] = true;
                l += 1;
            }
            runs.push(first + start as u32..first + l as u32);
        }
        for s in shares.iter_mut() {
            let info = &r.asked[&s.rank].1;
            for run in &runs {
                let part = run.start.max(s.layers.start)..run.end.min(s.layers.end);
                if part.is_empty() {
                    continue;
                }
                s.released += part.len() as u32;
                let st = queue_group(info, &self.config, s, part);
                r.stats.fragments += st.fragments;
                r.stats.fragments_coalesced += st.coalesced;
            }
        }
        let t1 = lap(self.stopwatch, now);
        r.stats.mapping += t1.saturating_duration_since(t0);
    }

    /// Sends the reports whose writes, and every earlier one of their
    /// share, completed (each arrives after their data, which has landed);
    /// posts queued batches up to the window, aborts what is posted once
    /// the request is cancelled, finishes the request when nothing is
    /// queued or posted.
    fn progress(&mut self, id: u64, now: Instant) {
        let Self {
            reqs,
            transfers,
            next_transfer,
            actions,
            config,
            transmits,
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
            while s.reports.front().is_some_and(|(end, _)| *end <= s.acked) {
                let (_, msg) = s.reports.pop_front().expect("present");
                s.delivered |= matches!(msg, Msg::Done { .. });
                transmits.push_back(Transmit {
                    to: s.agent.clone(),
                    msg,
                });
            }
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
                transfers.insert(t, (id, i, s.posted));
                s.posted += 1;
                s.inflight.push(t);
                s.start.get_or_insert(now);
                actions.push_back(TransferAction::Post { id: t, request });
            }
            if s.drained() && s.all_released() && s.end.is_none() {
                s.end = Some(now);
            }
        }
        if shares
            .iter()
            .any(|s| !s.drained() || !(stop || s.all_released()))
        {
            return;
        }
        // Nothing queued or posted is left, and nothing more will be.
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
                bytes: s.planned.bytes,
            })
            .collect();
        r.stats.bytes = shares.iter().map(|s| s.planned.bytes).sum();
        r.stats.transmission = match (start, end) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        // A cancel that came after every share's `Done` was delivered
        // changed nothing the generation side saw: the request completed.
        let too_late = !shares.is_empty()
            && shares.iter().all(|s| s.delivered)
            && matches!(
                r.cancelled,
                Some(CacheError::Cancelled { .. } | CacheError::Closed)
            );
        match r.cancelled.clone().filter(|_| !too_late) {
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
        } else if let Err(e) = &outcome {
            self.ended_unsent.insert(id, e.clone());
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
            self.ended_unsent.remove(&old);
        }
    }
}

/// Whether `e` is a write that failed its end-to-end integrity check.
fn is_integrity(e: &CacheError) -> bool {
    matches!(e, CacheError::Transfer(Error::Integrity { .. }))
}

/// One share of a request, planned with nothing queued: its source
/// blocks and the layers both ranks hold, checked against the peer's
/// request (block counts, addresses).
fn plan_share(
    me: &CacheState,
    rank: u32,
    g: u32,
    info: &RequestInfo,
    agent: &str,
    blocks: &[u64],
    lookup: Option<&dyn BlockLookup>,
) -> Result<Share, CacheError> {
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
    let slices = share_slices(me, rank, g, info, agent, &src_blocks)?;
    let mine = me.layer_range(me.coords(rank).1);
    let gen_s = &info.gen_state;
    let theirs = gen_s.layer_range(gen_s.coords(g).1);
    Ok(Share {
        rank: g,
        agent: agent.to_owned(),
        src_blocks,
        slices,
        layers: mine.start.max(theirs.start)..mine.end.min(theirs.end),
        released: 0,
        queued: VecDeque::new(),
        inflight: Vec::new(),
        batches: 0,
        posted: 0,
        acked: 0,
        acked_beyond: BTreeSet::new(),
        reports: VecDeque::new(),
        aborted: false,
        delivered: false,
        planned: FragmentStats::default(),
        start: None,
        end: None,
    })
}

/// Queues the writes of one layer group (`layers`, within the share's) of
/// share `s`, in batches of at most `config.batch_bytes`, and its report —
/// `Done` when the group completes the share, `Landed` otherwise — to be
/// sent once those writes and every earlier one completed. Returns the
/// group's counts.
fn queue_group(
    info: &RequestInfo,
    config: &SenderConfig,
    s: &mut Share,
    layers: Range<u32>,
) -> FragmentStats {
    let mut frags = Vec::new();
    let (src, dst) = &s.slices;
    // The block lists were checked when the share was planned.
    let st = map_layers(
        src,
        dst,
        &s.src_blocks,
        &info.blocks,
        layers.clone(),
        &mut frags,
    )
    .unwrap_or_default();
    s.planned.fragments += st.fragments;
    s.planned.coalesced += st.coalesced;
    s.planned.bytes += st.bytes;
    // Large coalesced fragments are split so that a batch stays within
    // `batch_bytes` (the cancellation granularity).
    let mut batches: Vec<(Vec<MemoryDesc>, Vec<MemoryDesc>)> = Vec::new();
    let mut size = 0u64;
    let cap = config.batch_bytes.max(1);
    for f in frags {
        let mut off = 0;
        while off < f.len {
            if batches.is_empty() || size >= cap {
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
    let last = if s.all_released() {
        Msg::Done {
            request_id: info.request_id,
            bytes: s.planned.bytes,
            fragments: s.planned.fragments,
            fragments_coalesced: s.planned.coalesced,
        }
    } else {
        Msg::Landed {
            request_id: info.request_id,
            first_layer: layers.start,
            layers: layers.end - layers.start,
        }
    };
    for (l, rm) in batches {
        let write = TransferRequest::write(
            MemoryDescs::new(config.mem_type, l),
            MemoryDescs::new(info.pool_mem_type, rm),
            &s.agent,
        );
        s.queued.push_back(if info.integrity {
            write.with_integrity()
        } else {
            write
        });
        s.batches += 1;
    }
    s.reports.push_back((s.batches, last));
    st
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
    needs_send(me, rank, &info.gen_state, info.gen_dp_rank).unwrap_or(false)
        && recv_ranks(&info.gen_state, g, me, ctx_dp).is_ok_and(|v| v.contains(&rank))
}

/// The fragments that move context rank `rank`'s share of blocks
/// `src_blocks` into generation rank `g`'s blocks `info.blocks` (appended
/// to `out`).
///
/// # Errors
/// As [`share_slices`].
#[cfg(any(test, feature = "fuzzing"))]
fn share_fragments(
    me: &CacheState,
    rank: u32,
    g: u32,
    info: &RequestInfo,
    peer: &str,
    src_blocks: &[u64],
    out: &mut Vec<crate::cache::fragments::Fragment>,
) -> Result<FragmentStats, CacheError> {
    let (src, dst) = share_slices(me, rank, g, info, peer, src_blocks)?;
    crate::cache::fragments::map_blocks(&src, &dst, src_blocks, &info.blocks, out)
}

/// What context rank `rank` and generation rank `g` hold of each block,
/// once the peer's request is checked against `src_blocks`.
///
/// # Errors
/// [`CacheError::Protocol`] naming `peer` when the block counts differ, or
/// a destination block's fragments would run past the end of the address
/// space.
fn share_slices(
    me: &CacheState,
    rank: u32,
    g: u32,
    info: &RequestInfo,
    peer: &str,
    src_blocks: &[u64],
) -> Result<(RankSlice, RankSlice), CacheError> {
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
    Ok((src, dst))
}

/// What a context rank computes from a peer's request, without agents or
/// threads (for the fuzz targets): the compatibility check, the expected
/// ranks, and each share's fragments, from source blocks at fixed
/// addresses.
#[cfg(any(test, feature = "fuzzing"))]
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
