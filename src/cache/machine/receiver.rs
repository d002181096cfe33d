//! The generation side's protocol: ask every context rank that holds part
//! of a request for its share (sending the destination blocks), and
//! complete the request when each rank that sends has reported its share
//! landed (`Done`, delivered after the data). A layer-wise sender also
//! reports each layer group as it lands (`Landed`); a layer of this rank
//! is reported landed once every rank that sends it has.
//!
//! # Fail closed
//! A request that fails (a deadline, a context rank's cancel or failure, a
//! rank that left, a protocol violation) or is cancelled here reports its
//! outcome only once nothing more can land in its blocks: every rank that
//! writes them has delivered its share (`Done`) or confirmed that it
//! stopped (`Cancelled`, sent after its posted writes ended). The ranks
//! still writing are told to stop the moment the failure is known. Where
//! a rank does not confirm within the settle timeout (it stopped
//! answering), or every rank still open has left the cluster, the outcome
//! is [`CacheError::Unsettled`], which says so; [`ReceiverEvent::Settled`]
//! follows if the rest confirm later.
//!
//! Messages about a request from an agent that is not one of its parties
//! are dropped and counted ([`Metrics::strangers`]), never acted on.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::cache::config::{ReceiverConfig, RecvRequest};
use crate::cache::error::CacheError;
use crate::cache::machine::{Stopwatch, Transmit, lap};
use crate::cache::mapping::{recv_ranks, target_ranks};
use crate::cache::state::CacheState;
use crate::cache::stats::{Metrics, PeerMeasure, SessionStats};
use crate::cache::wire::{Msg, RequestInfo};
use crate::error::Error;

/// What a [`ReceiverMachine`] reports to its driver.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ReceiverEvent {
    /// The request's outcome, reported once: every share landed (`Ok`), a
    /// context rank cancelled or failed it, it timed out, or this side
    /// cancelled it. Any outcome but [`CacheError::Unsettled`] means that
    /// nothing of the request can land any more (see "Fail closed" in the
    /// module docs).
    Finished {
        /// The request.
        request_id: u64,
        /// Its outcome.
        outcome: Result<SessionStats, CacheError>,
    },
    /// A request that ended otherwise than completed, or that this side
    /// cancelled, settled: every rank that sends has answered (`Cancelled`
    /// after its posted writes ended, or `Done`), so nothing can still land
    /// in its blocks. Reported with its `Finished` (after it), or later for
    /// one reported [`CacheError::Unsettled`].
    Settled {
        /// The request.
        request_id: u64,
    },
    /// A request reported [`CacheError::Unsettled`] was forgotten at its
    /// expiry (one timeout later) with ranks still unconfirmed: whether
    /// they write is not known.
    Forgotten {
        /// The request.
        request_id: u64,
    },
    /// Model layers `layers` of this rank landed whole: every context rank
    /// that writes them reported them (`Landed` or `Done`, each delivered
    /// after its data). Reported for each run of layers as it completes,
    /// before the request's `Finished`, and never after a failure or a
    /// cancel was reported.
    LayersLanded {
        /// The request.
        request_id: u64,
        /// The layers (model numbering), a run within this rank's.
        layers: Range<u32>,
        /// When the message that completed them reached this agent.
        at: Instant,
    },
}

/// One context rank's share of a request, as the receiver saw it.
#[derive(Default)]
struct Share {
    rank: u32,
    /// The model layers it writes here (its layers and this rank's).
    layers: Range<u32>,
    /// Those of `layers` it reported landed (index from `layers.start`).
    landed: Vec<bool>,
    /// When its `Ready` reached this agent.
    ready: Option<Instant>,
    /// When its `Done` reached this agent (after the share's data).
    done: Option<Instant>,
    bytes: u64,
    fragments: u64,
    fragments_coalesced: u64,
}

struct Req {
    /// Context agents asked (every target rank).
    asked: Vec<String>,
    /// Context agent → its share, for the ranks that send.
    senders: BTreeMap<String, Share>,
    /// Agents that answered `Cancelled` (or were never sent the request).
    settled: BTreeSet<String>,
    /// Senders that left the cluster without settling.
    gone: BTreeSet<String>,
    /// This side cancelled: the request ends when every sender settled.
    cancelling: bool,
    /// The request failed: its outcome (and whether it counts as a
    /// cancel), reported once every sender settled.
    failure: Option<(CacheError, bool)>,
    /// Once failed or cancelling: when the senders still open are given up
    /// on (the outcome is then reported `Unsettled`).
    settle_by: Option<Instant>,
    /// Once failed or cancelling, while a sender is still open: when the
    /// `Cancel` goes to it again (it, or its `Cancelled`, may have been
    /// lost; a rank answers every `Cancel` once its writes ended).
    resend_at: Option<Instant>,
    /// The outcome was reported.
    reported: bool,
    start: Instant,
    request_info: Duration,
    mapping: Duration,
    deadline: Instant,
    /// After an `Unsettled` outcome: when the request is forgotten even if
    /// a sender never settles.
    expire: Option<Instant>,
    /// Per layer of this rank: senders that write it, and those that
    /// reported it landed.
    need: Vec<u32>,
    got: Vec<u32>,
}

impl Req {
    /// Senders that have neither delivered nor settled: they may write.
    fn open_senders(&self) -> impl Iterator<Item = (&String, &Share)> {
        self.senders
            .iter()
            .filter(|(a, v)| v.done.is_none() && !self.settled.contains(*a))
    }

    /// A rank that sends has neither delivered nor settled.
    fn open(&self) -> bool {
        self.open_senders().next().is_some()
    }

    /// The request ended (failed or cancelled) and waits for its senders
    /// to settle.
    fn ending(&self) -> bool {
        self.cancelling || self.failure.is_some()
    }

    /// Whether `agent` takes part: asked for it, or one of its senders.
    fn party(&self, agent: &str) -> bool {
        self.senders.contains_key(agent) || self.asked.iter().any(|a| a == agent)
    }
}

/// How often an ending request's `Cancel` goes again to the senders that
/// have not confirmed: a fifth of the settle timeout (at least 10 ms, at
/// most 2 s), so a lost message costs a fraction of it.
fn resend_every(settle_timeout: Duration) -> Duration {
    (settle_timeout / 5).clamp(Duration::from_millis(10), Duration::from_secs(2))
}

/// The generation side of the KV-cache protocol for one rank, without I/O
/// (see the [module docs](super)).
pub struct ReceiverMachine {
    state: CacheState,
    rank: u32,
    ctx_state: CacheState,
    /// Context agent names, by context rank.
    ctx_agents: Vec<String>,
    /// This side's connection info, sent in each request.
    connection: String,
    config: ReceiverConfig,
    stopwatch: Option<Stopwatch>,
    /// Open requests, by id.
    reqs: HashMap<u64, Req>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<ReceiverEvent>,
    metrics: Metrics,
}

impl ReceiverMachine {
    /// A machine for `rank` of an executor with `state`; the context
    /// executor is `ctx_state`, its ranks' agents named `ctx_agents` (by
    /// context rank); `connection` is this side's connection info, which
    /// the context ranks load to write here.
    ///
    /// # Errors
    /// An invalid or incompatible state, or a wrong number of agents.
    pub fn new(
        state: CacheState,
        rank: u32,
        ctx_state: CacheState,
        ctx_agents: Vec<String>,
        connection: String,
        config: ReceiverConfig,
    ) -> Result<Self, CacheError> {
        ctx_state.check_compatible(&state)?;
        if rank >= state.world_size() {
            return Err(CacheError::InvalidState(format!(
                "rank {rank} outside TP {} × PP {}",
                state.tp, state.pp
            )));
        }
        if ctx_agents.len() != ctx_state.world_size() as usize {
            return Err(CacheError::InvalidState(format!(
                "{} context agents for {} context ranks",
                ctx_agents.len(),
                ctx_state.world_size()
            )));
        }
        Ok(Self {
            state,
            rank,
            ctx_state,
            ctx_agents,
            connection,
            config,
            stopwatch: None,
            reqs: HashMap::new(),
            transmits: VecDeque::new(),
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
    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    /// Totals over the requests that ended.
    pub fn metrics(&self) -> Metrics {
        self.metrics
    }

    /// Requests still open (including those whose outcome was reported
    /// while writes may still land).
    pub fn open_requests(&self) -> usize {
        self.reqs.len()
    }

    /// Asks the context ranks for `req`'s cache (one [`Msg::Request`] each,
    /// queued for [`poll_transmit`](Self::poll_transmit)). Once the driver
    /// has handed them to the transport it may report
    /// [`handle_request_sent`](Self::handle_request_sent).
    ///
    /// # Errors
    /// A duplicate id, no block, or a mapping error.
    pub fn request(&mut self, req: RecvRequest, now: Instant) -> Result<(), CacheError> {
        let t0 = lap(self.stopwatch, now);
        let targets = target_ranks(&self.state, self.rank, &self.ctx_state, req.ctx_dp_rank)?;
        let senders = recv_ranks(&self.state, self.rank, &self.ctx_state, req.ctx_dp_rank)?;
        let mapping = lap(self.stopwatch, now).saturating_duration_since(t0);
        let n = req.blocks.len();
        if n == 0 {
            return Err(CacheError::InvalidState(
                "a request needs at least one block".into(),
            ));
        }
        if self.reqs.contains_key(&req.request_id) {
            return Err(CacheError::DuplicateRequest(req.request_id));
        }
        let info = RequestInfo {
            request_id: req.request_id,
            gen_rank: self.rank,
            gen_dp_rank: self.state.attention_dp.map_or(0, |d| d.rank),
            gen_state: self.state.clone(),
            connection: self.connection.clone(),
            index_from_end: (n - 1) as u32,
            last_block_key: req.last_block_key,
            blocks: req.blocks,
            pool_mem_type: self.config.mem_type,
            integrity: self.config.integrity,
        };
        let asked: Vec<String> = targets
            .ranks
            .iter()
            .map(|&c| self.ctx_agents[c as usize].clone())
            .collect();
        let mine = self.held_layers();
        let mut need = vec![0u32; mine.len()];
        let senders = senders
            .iter()
            .map(|&c| {
                let theirs = self.ctx_state.layer_range(self.ctx_state.coords(c).1);
                let layers = mine.start.max(theirs.start)..mine.end.min(theirs.end);
                for l in layers.clone() {
                    need[(l - mine.start) as usize] += 1;
                }
                let share = Share {
                    rank: c,
                    landed: vec![false; layers.len()],
                    layers,
                    ..Share::default()
                };
                (self.ctx_agents[c as usize].clone(), share)
            })
            .collect();
        for a in &asked {
            self.transmits.push_back(Transmit {
                to: a.clone(),
                msg: Msg::Request(info.clone()),
            });
        }
        self.reqs.insert(
            req.request_id,
            Req {
                asked,
                senders,
                settled: BTreeSet::new(),
                gone: BTreeSet::new(),
                cancelling: false,
                failure: None,
                settle_by: None,
                resend_at: None,
                reported: false,
                start: now,
                request_info: Duration::ZERO,
                mapping,
                deadline: now + self.config.timeout,
                expire: None,
                got: vec![0; need.len()],
                need,
            },
        );
        Ok(())
    }

    /// The model layers this rank holds.
    pub fn held_layers(&self) -> Range<u32> {
        self.state.layer_range(self.state.coords(self.rank).1)
    }

    /// Every request info of `request_id` was handed to the transport (for
    /// the request's `request_info` measure).
    pub fn handle_request_sent(&mut self, request_id: u64, now: Instant) {
        if let Some(r) = self.reqs.get_mut(&request_id) {
            r.request_info = now.saturating_duration_since(r.start);
        }
    }

    /// The transport refused `msg` for `to`. A request whose request info
    /// could not be sent is withdrawn: the ranks already asked are told to
    /// cancel, the rest are not asked, and it finishes with the error once
    /// the ranks asked settled.
    pub fn handle_transmit_failed(&mut self, to: &str, msg: &Msg, error: Error, now: Instant) {
        let Msg::Request(info) = msg else {
            tracing::debug!(remote = to, %error, "cannot notify a context rank");
            return;
        };
        self.withdraw(info.request_id, to, error, now);
    }

    /// Context agents whose share of an open request has not landed.
    pub fn awaited_agents(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .reqs
            .values()
            .filter(|r| !r.reported)
            .flat_map(|r| {
                r.open_senders()
                    .filter(|(a, _)| !r.gone.contains(*a))
                    .map(|(a, _)| a.clone())
            })
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Context agent `agent` is gone (it left the agent's metadata store:
    /// its process died, hung or restarted): every open request still
    /// waiting on its share fails with `error` at once instead of at its
    /// deadline. Its writes are not known to have stopped: once every
    /// sender still open is gone, the outcome is
    /// [`CacheError::Unsettled`] at once, not after the settle timeout.
    pub fn handle_peer_gone(&mut self, agent: &str, error: Error, now: Instant) {
        let ids: Vec<u64> = self
            .reqs
            .iter()
            .filter(|(_, r)| !r.reported && r.open_senders().any(|(a, _)| a == agent))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            tracing::info!(
                remote = agent,
                request_id = id,
                "a context rank is gone; failing its request"
            );
            if let Some(r) = self.reqs.get_mut(&id) {
                r.gone.insert(agent.to_owned());
            }
            self.fail(id, CacheError::Transfer(error.clone()), false, now);
            self.settle(id, now);
        }
    }

    /// Withdraws request `id`, which could not be sent to `to`: the ranks
    /// not sent it yet are not asked, those already asked are told to
    /// cancel, and it finishes with `error` once they settled (at once
    /// when none was asked).
    fn withdraw(&mut self, id: u64, to: &str, error: Error, now: Instant) {
        let unsent = |t: &Transmit| matches!(&t.msg, Msg::Request(i) if i.request_id == id);
        let pending: Vec<String> = self
            .transmits
            .iter()
            .filter(|t| unsent(t))
            .map(|t| t.to.clone())
            .collect();
        self.transmits.retain(|t| !unsent(t));
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        // Neither `to` nor the ranks still pending got the request: they
        // write nothing.
        r.settled.insert(to.to_owned());
        r.settled.extend(pending);
        self.fail(id, CacheError::Transfer(error), false, now);
    }

    /// Cancels a request: every context rank asked is told; it settles
    /// (`Finished` with `Cancelled` unless it had ended, then
    /// [`ReceiverEvent::Settled`]) once each rank that sends has answered,
    /// or is reported `Unsettled` after the settle timeout.
    ///
    /// # Errors
    /// [`CacheError::UnknownRequest`].
    pub fn cancel(&mut self, request_id: u64, now: Instant) -> Result<(), CacheError> {
        let Some(r) = self.reqs.get_mut(&request_id) else {
            return Err(CacheError::UnknownRequest(request_id));
        };
        r.cancelling = true;
        r.settle_by.get_or_insert(now + self.config.settle_timeout);
        r.resend_at
            .get_or_insert(now + resend_every(self.config.settle_timeout));
        for a in r.asked.clone() {
            if !r.settled.contains(&a) {
                self.transmits.push_back(Transmit {
                    to: a,
                    msg: Msg::Cancel { request_id },
                });
            }
        }
        self.settle(request_id, now);
        Ok(())
    }

    /// Ends every open request with [`CacheError::Closed`] (those whose
    /// outcome was not reported yet) and forgets them. One that a context
    /// rank may still be writing (it has neither delivered nor confirmed
    /// that it stopped) ends [`CacheError::Unsettled`] with `Closed` as the
    /// cause, and is then [`ReceiverEvent::Forgotten`], as is one reported
    /// `Unsettled` before.
    pub fn close(&mut self) {
        let mut ids: Vec<u64> = self.reqs.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let r = self.reqs.remove(&id).expect("listed");
            let mut ranks: Vec<u32> = r.open_senders().map(|(_, v)| v.rank).collect();
            ranks.sort_unstable();
            if !r.reported {
                let outcome = if ranks.is_empty() {
                    CacheError::Closed
                } else {
                    CacheError::Unsettled {
                        request_id: id,
                        ranks: ranks.clone(),
                        cause: Box::new(CacheError::Closed),
                    }
                };
                self.events.push_back(ReceiverEvent::Finished {
                    request_id: id,
                    outcome: Err(outcome),
                });
            }
            if !ranks.is_empty() {
                self.events
                    .push_back(ReceiverEvent::Forgotten { request_id: id });
            }
        }
    }

    /// A message from context agent `from`, which reached this agent at
    /// `now`. One from an agent that is not a party to the request it names
    /// is dropped and counted.
    pub fn handle_message(&mut self, from: &str, msg: Msg, now: Instant) {
        let id = msg.request_id();
        let Some(r) = self.reqs.get_mut(&id) else {
            tracing::debug!(
                remote = from,
                request = id,
                "message about an unknown request"
            );
            return;
        };
        if !r.party(from) {
            self.metrics.strangers += 1;
            tracing::warn!(
                remote = from,
                request = id,
                "dropping a KV-cache message from an agent that is not a party to the request"
            );
            return;
        }
        match msg {
            Msg::Ready { .. } => {
                if let Some(v) = r.senders.get_mut(from) {
                    v.ready.get_or_insert(now);
                }
            }
            Msg::Landed {
                first_layer,
                layers,
                ..
            } => {
                let run = first_layer..first_layer.saturating_add(layers);
                let fits = r.senders.get(from).is_some_and(|v| {
                    !run.is_empty() && v.layers.start <= run.start && run.end <= v.layers.end
                });
                if !fits {
                    let e = CacheError::Protocol {
                        peer: from.to_owned(),
                        detail: format!("layers {run:?} of request {id} it does not write here"),
                    };
                    self.fail(id, e, false, now);
                    return;
                }
                // What lands while a cancel is settling is reported too:
                // the request may yet complete.
                if !r.reported {
                    self.land(id, from, run, now);
                }
            }
            Msg::Done {
                bytes,
                fragments,
                fragments_coalesced,
                ..
            } => {
                let Some(v) = r.senders.get_mut(from) else {
                    let e = CacheError::Protocol {
                        peer: from.to_owned(),
                        detail: format!("a share of request {id} from a rank that should not send"),
                    };
                    self.fail(id, e, false, now);
                    return;
                };
                let all = v.layers.clone();
                if !r.reported {
                    self.land(id, from, all, now);
                }
                let r = self.reqs.get_mut(&id).expect("present");
                let v = r.senders.get_mut(from).expect("present");
                v.done = Some(now);
                v.bytes = bytes;
                v.fragments = fragments;
                v.fragments_coalesced = fragments_coalesced;
                if !r.reported && r.senders.values().all(|v| v.done.is_some()) {
                    // Every share landed, even if a deadline or a cancel
                    // came first: the request completed, as each context
                    // rank that delivered saw it.
                    let r = self.reqs.remove(&id).expect("present");
                    self.complete(id, &r, now);
                    if r.ending() {
                        self.events
                            .push_back(ReceiverEvent::Settled { request_id: id });
                    }
                    return;
                }
            }
            Msg::Cancelled {
                reason,
                failure,
                integrity,
                ..
            } => {
                r.settled.insert(from.to_owned());
                // This side's cancel records its own outcome; a replica
                // that never sends has nothing of its own to report while
                // ranks that send exist.
                if !r.cancelling && (r.senders.contains_key(from) || r.senders.is_empty()) {
                    let reason = format!("context agent {from}: {reason}");
                    let e = if integrity {
                        CacheError::Integrity {
                            request_id: id,
                            reason,
                        }
                    } else {
                        CacheError::Cancelled {
                            request_id: id,
                            reason,
                        }
                    };
                    // Counted as the context side counts it.
                    self.fail(id, e, !failure, now);
                }
            }
            other => tracing::warn!(remote = from, ?other, "unexpected message on a receiver"),
        }
        self.settle(id, now);
    }

    /// Time passed: requests past their deadline fail with a timeout
    /// (reported once their senders settled); failed or cancelled requests
    /// past their settle timeout are reported `Unsettled`; requests past
    /// their expiry are forgotten.
    pub fn handle_timeout(&mut self, now: Instant) {
        let mut ids: Vec<u64> = self.reqs.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let r = &self.reqs[&id];
            if r.expire.is_some_and(|e| now >= e) {
                self.reqs.remove(&id);
                self.events
                    .push_back(ReceiverEvent::Forgotten { request_id: id });
            } else if r.ending() {
                let (resend, late) = (
                    r.resend_at.is_some_and(|t| now >= t),
                    r.settle_by.is_some_and(|t| now >= t),
                );
                if resend {
                    self.ask_again(id, now);
                }
                if late {
                    self.settle(id, now);
                }
            } else if now >= r.deadline {
                let missing: Vec<u32> = r
                    .senders
                    .values()
                    .filter(|v| v.done.is_none())
                    .map(|v| v.rank)
                    .collect();
                let e = CacheError::Timeout {
                    what: format!("request {id}: shares of context ranks {missing:?}"),
                    after: self.config.timeout,
                };
                self.fail(id, e, false, now);
            }
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) is next due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.reqs
            .values()
            .filter_map(|r| {
                let due = if r.reported {
                    r.expire
                } else if r.ending() {
                    r.settle_by
                } else {
                    Some(r.deadline)
                };
                due.into_iter().chain(r.resend_at).min()
            })
            .min()
    }

    /// Sends the `Cancel` of ending request `id` again to every sender
    /// still open (neither delivered nor confirmed, and still in the
    /// cluster): one that lost it, or whose `Cancelled` was lost, answers
    /// now. Again every [`resend_every`] until they settled or the
    /// request is forgotten.
    fn ask_again(&mut self, id: u64, now: Instant) {
        let every = resend_every(self.config.settle_timeout);
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let open: Vec<String> = r
            .open_senders()
            .filter(|(a, _)| !r.gone.contains(*a))
            .map(|(a, _)| a.clone())
            .collect();
        r.resend_at = (!open.is_empty()).then_some(now + every);
        for a in open {
            self.metrics.cancels_resent += 1;
            self.transmits.push_back(Transmit {
                to: a,
                msg: Msg::Cancel { request_id: id },
            });
        }
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next outcome to report.
    pub fn poll_event(&mut self) -> Option<ReceiverEvent> {
        self.events.pop_front()
    }

    /// Sender `from` reports `run` (within its layers) landed: each layer
    /// that every sender of it has now reported joins a run reported as
    /// [`ReceiverEvent::LayersLanded`].
    fn land(&mut self, id: u64, from: &str, run: Range<u32>, now: Instant) {
        let first = self.held_layers().start;
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let Some(v) = r.senders.get_mut(from) else {
            return;
        };
        let mut complete: Vec<u32> = Vec::new();
        for l in run {
            let k = (l - v.layers.start) as usize;
            if v.landed[k] {
                continue;
            }
            v.landed[k] = true;
            let i = (l - first) as usize;
            r.got[i] += 1;
            if r.got[i] == r.need[i] {
                complete.push(l);
            }
        }
        // Consecutive layers completed by this message form one run.
        let mut i = 0;
        while i < complete.len() {
            let start = complete[i];
            let mut end = start + 1;
            while i + 1 < complete.len() && complete[i + 1] == end {
                i += 1;
                end += 1;
            }
            i += 1;
            self.events.push_back(ReceiverEvent::LayersLanded {
                request_id: id,
                layers: start..end,
                at: now,
            });
        }
    }

    /// Records a failure as the request's outcome (the first one wins),
    /// tells the context ranks still writing to stop at once (so that the
    /// whole request quiesces and every rank ends it alike), and reports it
    /// once they settled (see [`settle`](Self::settle)).
    fn fail(&mut self, id: u64, e: CacheError, cancelled: bool, now: Instant) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if r.reported || r.failure.is_some() {
            return;
        }
        r.failure = Some((e, cancelled));
        r.settle_by.get_or_insert(now + self.config.settle_timeout);
        r.resend_at
            .get_or_insert(now + resend_every(self.config.settle_timeout));
        if !r.cancelling {
            for a in &r.asked {
                let delivered = r.senders.get(a).is_some_and(|v| v.done.is_some());
                if !delivered && !r.settled.contains(a) {
                    self.transmits.push_back(Transmit {
                        to: a.clone(),
                        msg: Msg::Cancel { request_id: id },
                    });
                }
            }
        }
        self.settle(id, now);
    }

    /// The outcome of a request that ended without completing, and whether
    /// it counts as a cancel.
    fn ending_outcome(id: u64, r: &Req) -> (CacheError, bool) {
        match &r.failure {
            Some((e, cancelled)) => (e.clone(), *cancelled),
            None => (
                CacheError::Cancelled {
                    request_id: id,
                    reason: "cancelled by the generation side".into(),
                },
                true,
            ),
        }
    }

    /// Reports a failed or cancelled request once nothing can land in its
    /// blocks (every sender delivered or settled), and forgets it; reports
    /// it `Unsettled` instead when its settle timeout passed, or every
    /// sender still open left the cluster (then keeps it until it expires,
    /// for a late `Settled`).
    fn settle(&mut self, id: u64, now: Instant) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if !r.ending() {
            return;
        }
        if r.open() {
            let late = r.settle_by.is_some_and(|t| now >= t);
            let all_gone = r.open_senders().all(|(a, _)| r.gone.contains(a));
            if r.reported || !(late || all_gone) {
                return;
            }
            r.reported = true;
            r.expire = Some(now + self.config.timeout);
            let mut ranks: Vec<u32> = r.open_senders().map(|(_, v)| v.rank).collect();
            ranks.sort_unstable();
            let (cause, cancelled) = Self::ending_outcome(id, r);
            tracing::warn!(
                request_id = id,
                ?ranks,
                %cause,
                "context ranks did not confirm that they stopped writing"
            );
            self.metrics.record_ended(cancelled);
            self.metrics.unsettled += 1;
            self.events.push_back(ReceiverEvent::Finished {
                request_id: id,
                outcome: Err(CacheError::Unsettled {
                    request_id: id,
                    ranks,
                    cause: Box::new(cause),
                }),
            });
            return;
        }
        let r = self.reqs.remove(&id).expect("present");
        if !r.reported {
            let (e, cancelled) = Self::ending_outcome(id, &r);
            self.metrics.record_ended(cancelled);
            self.events.push_back(ReceiverEvent::Finished {
                request_id: id,
                outcome: Err(e),
            });
        }
        self.events
            .push_back(ReceiverEvent::Settled { request_id: id });
    }

    fn complete(&mut self, id: u64, r: &Req, now: Instant) {
        // The last share's arrival (the `Done` that completes the request).
        let end = r
            .senders
            .values()
            .filter_map(|v| v.done)
            .max()
            .unwrap_or(now);
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
        self.metrics.record_completed(&stats);
        self.events.push_back(ReceiverEvent::Finished {
            request_id: id,
            outcome: Ok(stats),
        });
    }
}
