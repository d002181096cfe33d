//! The KV-cache protocol run deterministically: every rank of both
//! executors is a machine, wired to the others in memory ([`Pair`]), with
//! simulated time, pools as plain vectors, messages that take
//! [`LATENCY`] and writes that take [`WRITE_TIME`]. No socket, thread or
//! clock: a run is a function of its inputs, so every step can be cut by
//! a cancel, a lost peer or a deadline, and checked.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use super::{
    ReceiverEvent, ReceiverMachine, SenderEvent, SenderMachine, TransferAction, TransferId,
    Transmit,
};
use crate::cache::pattern::{check_block, fill_block};
use crate::cache::wire::{Msg, Reassembler, RequestInfo};
use crate::cache::{
    Attention, CacheError, CacheState, DataType, RankSlice, ReceiverConfig, RecvRequest,
    SenderConfig, distinct_heads, rank_slice,
};
use crate::proto::TransferRequest;

/// One message's flight.
const LATENCY: Duration = Duration::from_millis(2);
/// One posted write, from post to completion.
const WRITE_TIME: Duration = Duration::from_millis(3);
/// Both sides' request timeout.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long the receiver waits for the ranks of a failed request to
/// confirm that they stopped.
const SETTLE: Duration = Duration::from_secs(1);
/// Blocks per pool.
const POOL_BLOCKS: u32 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Side {
    Ctx,
    Gen,
}

fn name(side: Side, i: usize) -> String {
    match side {
        Side::Ctx => format!("ctx{i}"),
        Side::Gen => format!("gen{i}"),
    }
}

/// Where a node's pool sits in the simulated address space.
fn base(side: Side, i: usize) -> u64 {
    let k = match side {
        Side::Ctx => 1 + i as u64,
        Side::Gen => 64 + i as u64,
    };
    k << 36
}

struct Node {
    slice: RankSlice,
    pool: Vec<u8>,
    dead: bool,
}

enum Item {
    Deliver {
        from: String,
        to: (Side, usize),
        chunks: Vec<Vec<u8>>,
    },
    WriteEnds {
        ctx: usize,
        id: TransferId,
    },
}

/// Decides whether a message (from, to, what) is lost.
type LoseFn = dyn FnMut(&str, &str, &Msg) -> bool;

struct Posted {
    request: TransferRequest,
    aborted: bool,
}

/// How posted writes behave.
#[derive(Clone, Copy, PartialEq)]
enum Writes {
    /// They complete after [`WRITE_TIME`].
    Complete,
    /// They never complete unless aborted.
    Hang,
}

/// The two executors, wired in memory.
struct Pair {
    t0: Instant,
    now: Instant,
    ctx_state: CacheState,
    gen_state: CacheState,
    senders: Vec<SenderMachine>,
    receivers: Vec<ReceiverMachine>,
    ctx: Vec<Node>,
    gen_nodes: Vec<Node>,
    /// Pending deliveries and completions: (due, sequence) → item.
    queue: BTreeMap<(Instant, u64), Item>,
    seq: u64,
    posted: BTreeMap<(usize, TransferId), Posted>,
    reasm: BTreeMap<(Side, usize), Reassembler>,
    /// Every event: when, which rank, what.
    ctx_events: Vec<(Instant, usize, SenderEvent)>,
    gen_events: Vec<(Instant, usize, ReceiverEvent)>,
    /// Every write that landed: when, from which context rank, into which
    /// generation rank.
    landed: Vec<(Instant, usize, usize)>,
    /// Transfers in flight on a context rank when it reported an outcome.
    inflight_at_finish: Vec<usize>,
    writes: Writes,
    /// Messages for which this returns true are lost.
    lose: Box<LoseFn>,
    /// Per context rank: the layers marked ready (every write posted must
    /// read only those).
    ready: Vec<BTreeSet<u32>>,
    /// Aborts come too late: a posted write completes whole anyway.
    late_aborts: bool,
    /// Per context rank: the indices (in posting order) of its writes that
    /// the target refuses (nothing of them lands, no sync message).
    refused: Vec<BTreeSet<usize>>,
    /// Per context rank: writes posted so far.
    posts: Vec<usize>,
    /// Posted writes the target refuses.
    refusing: BTreeSet<(usize, TransferId)>,
    /// (context rank, generation rank) whose `Done` was delivered.
    dones: BTreeSet<(usize, usize)>,
    /// Per generation rank: its request reported an outcome other than
    /// `Unsettled` (until it asks again).
    gen_ended: Vec<bool>,
}

fn state(tp: u32, pp: u32) -> CacheState {
    CacheState::new(4, 4 / tp, 8, 4, DataType::Bf16, Attention::Default, tp, pp)
}

fn sender_config() -> SenderConfig {
    SenderConfig {
        timeout: TIMEOUT,
        // Several batches per share, two in flight: cancels land between
        // them.
        batch_bytes: 512,
        batches_in_flight: 2,
        ..SenderConfig::default()
    }
}

impl Pair {
    fn new(ctx_state: CacheState, gen_state: CacheState) -> Self {
        Self::with_receiver_timeout(ctx_state, gen_state, TIMEOUT)
    }

    fn with_receiver_timeout(ctx_state: CacheState, gen_state: CacheState, t: Duration) -> Self {
        let t0 = Instant::now();
        let d = distinct_heads(&ctx_state, &gen_state);
        let node = |s: &CacheState, r: u32| {
            let slice = rank_slice(s, r, d);
            Node {
                slice,
                pool: vec![0; (slice.block_bytes() * u64::from(POOL_BLOCKS)) as usize],
                dead: false,
            }
        };
        let ctx: Vec<Node> = (0..ctx_state.world_size())
            .map(|r| node(&ctx_state, r))
            .collect();
        let gen_nodes: Vec<Node> = (0..gen_state.world_size())
            .map(|r| node(&gen_state, r))
            .collect();
        let senders = (0..ctx.len())
            .map(|r| {
                SenderMachine::new(ctx_state.clone(), r as u32, None, sender_config()).unwrap()
            })
            .collect();
        let ctx_names: Vec<String> = (0..ctx.len()).map(|i| name(Side::Ctx, i)).collect();
        let receivers = (0..gen_nodes.len())
            .map(|r| {
                ReceiverMachine::new(
                    gen_state.clone(),
                    r as u32,
                    ctx_state.clone(),
                    ctx_names.clone(),
                    name(Side::Gen, r),
                    ReceiverConfig {
                        timeout: t,
                        settle_timeout: SETTLE,
                        ..ReceiverConfig::default()
                    },
                )
                .unwrap()
            })
            .collect();
        Self {
            t0,
            now: t0,
            ctx_state,
            gen_state,
            senders,
            receivers,
            queue: BTreeMap::new(),
            seq: 0,
            posted: BTreeMap::new(),
            reasm: BTreeMap::new(),
            ctx_events: Vec::new(),
            gen_events: Vec::new(),
            landed: Vec::new(),
            inflight_at_finish: Vec::new(),
            writes: Writes::Complete,
            lose: Box::new(|_, _, _| false),
            ready: vec![BTreeSet::new(); ctx.len()],
            late_aborts: false,
            refused: vec![BTreeSet::new(); ctx.len()],
            posts: vec![0; ctx.len()],
            refusing: BTreeSet::new(),
            dones: BTreeSet::new(),
            gen_ended: vec![false; gen_nodes.len()],
            gen_nodes,
            ctx,
        }
    }

    /// The model layers a piece of context rank `c`'s pool spans.
    fn layers_of(&self, c: usize, addr: u64, len: u64) -> Range<u32> {
        let s = &self.ctx[c].slice;
        let per_layer = u64::from(s.kv_factor) * u64::from(s.heads_in_block) * s.head_bytes;
        let layer = |a: u64| {
            let off = (a - base(Side::Ctx, c)) % s.block_bytes();
            s.first_layer + (off / per_layer) as u32
        };
        layer(addr)..layer(addr + len - 1) + 1
    }

    /// Context rank `c` begins request `id` (blocks `0..n`), no layer
    /// ready.
    fn begin(&mut self, c: usize, id: u64, n: u32) {
        let blocks = (0..n).map(|b| self.block_addr(Side::Ctx, c, b)).collect();
        self.senders[c].begin(id, blocks, self.now).unwrap();
        self.drain_ctx(c);
    }

    /// Context rank `c` marks `layers` of request `id` ready.
    fn mark(&mut self, c: usize, id: u64, layers: Range<u32>) -> Result<(), CacheError> {
        let r = self.senders[c].layers_ready(id, layers.clone(), self.now);
        if r.is_ok() {
            self.ready[c].extend(layers);
        }
        self.drain_ctx(c);
        r
    }

    /// Runs until nothing is queued (deadlines aside): what was posted
    /// landed, what was sent arrived.
    fn settle(&mut self) {
        while !self.queue.is_empty() {
            self.step();
        }
    }

    /// Generation rank `g`'s layer reports: when, which run.
    fn layer_reports(&self, g: usize) -> Vec<(Instant, Range<u32>)> {
        self.gen_events
            .iter()
            .filter(|e| e.1 == g)
            .filter_map(|(t, _, e)| match e {
                ReceiverEvent::LayersLanded { layers, at, .. } => {
                    assert_eq!(at, t, "stamped with the arrival");
                    Some((*t, layers.clone()))
                }
                _ => None,
            })
            .collect()
    }

    fn block_addr(&self, side: Side, i: usize, b: u32) -> u64 {
        let n = match side {
            Side::Ctx => &self.ctx[i],
            Side::Gen => &self.gen_nodes[i],
        };
        base(side, i) + u64::from(b) * n.slice.block_bytes()
    }

    /// Fills every context rank's blocks `0..n` with the pattern.
    fn prefill(&mut self, n: u32) {
        for k in &mut self.ctx {
            let bb = k.slice.block_bytes() as usize;
            for b in 0..n {
                let blk = &mut k.pool[b as usize * bb..(b as usize + 1) * bb];
                fill_block(&self.ctx_state, &k.slice, blk, b);
            }
        }
    }

    /// Every generation rank asks for request `id` (blocks `0..n`), every
    /// context rank sends it (blocks `0..n`).
    fn start(&mut self, id: u64, n: u32) {
        self.prefill(n);
        for g in 0..self.receivers.len() {
            self.request(g, id, n);
        }
        for c in 0..self.senders.len() {
            self.send(c, id, n);
        }
    }

    fn request(&mut self, g: usize, id: u64, n: u32) {
        let blocks = (0..n).map(|b| self.block_addr(Side::Gen, g, b)).collect();
        let req = RecvRequest {
            request_id: id,
            ctx_dp_rank: 0,
            blocks,
            last_block_key: None,
        };
        self.receivers[g].request(req, self.now).unwrap();
        self.gen_ended[g] = false;
        self.drain_gen(g);
    }

    fn send(&mut self, c: usize, id: u64, n: u32) {
        let blocks = (0..n).map(|b| self.block_addr(Side::Ctx, c, b)).collect();
        self.senders[c].send(id, blocks, self.now).unwrap();
        self.ready[c].extend(self.senders[c].held_layers());
        self.drain_ctx(c);
    }

    fn cancel_ctx(&mut self, c: usize, id: u64) -> Result<(), CacheError> {
        let r = self.senders[c].cancel(id, self.now);
        self.drain_ctx(c);
        r
    }

    fn cancel_gen(&mut self, g: usize, id: u64) -> Result<(), CacheError> {
        let r = self.receivers[g].cancel(id, self.now);
        self.drain_gen(g);
        r
    }

    fn push(&mut self, at: Instant, item: Item) {
        self.seq += 1;
        self.queue.insert((at, self.seq), item);
    }

    fn transmit(&mut self, from: &str, t: Transmit) {
        if (self.lose)(from, &t.to, &t.msg) {
            return;
        }
        let to = node_of(&t.to);
        let chunks = t.msg.encode();
        self.push(
            self.now + LATENCY,
            Item::Deliver {
                from: from.to_owned(),
                to,
                chunks,
            },
        );
    }

    fn drain_ctx(&mut self, c: usize) {
        let me = name(Side::Ctx, c);
        while let Some(t) = self.senders[c].poll_transmit() {
            self.transmit(&me, t);
        }
        while let Some(a) = self.senders[c].poll_transfer() {
            match a {
                TransferAction::Post { id, request } => {
                    for d in &request.local.descs {
                        let layers = self.layers_of(c, d.addr, d.len);
                        assert!(
                            layers.clone().all(|l| self.ready[c].contains(&l)),
                            "context rank {c} posted layers {layers:?}, ready: {:?}",
                            self.ready[c]
                        );
                    }
                    if self.refused[c].contains(&self.posts[c]) {
                        self.refusing.insert((c, id));
                    }
                    self.posts[c] += 1;
                    let posted = Posted {
                        request,
                        aborted: false,
                    };
                    self.posted.insert((c, id), posted);
                    if self.writes == Writes::Complete {
                        self.push(self.now + WRITE_TIME, Item::WriteEnds { ctx: c, id });
                    }
                }
                TransferAction::Abort { .. } if self.late_aborts => {}
                TransferAction::Abort { id } => {
                    // Nothing of an aborted write moves any more: it ends
                    // at once, untouched.
                    let p = self
                        .posted
                        .get_mut(&(c, id))
                        .expect("abort of a posted write");
                    assert!(!p.aborted, "aborted twice");
                    p.aborted = true;
                    self.push(self.now, Item::WriteEnds { ctx: c, id });
                }
            }
        }
        while let Some(e) = self.senders[c].poll_event() {
            self.inflight_at_finish
                .push(self.senders[c].transfers_in_flight());
            self.ctx_events.push((self.now, c, e));
        }
    }

    fn drain_gen(&mut self, g: usize) {
        let me = name(Side::Gen, g);
        while let Some(t) = self.receivers[g].poll_transmit() {
            self.transmit(&me, t);
        }
        while let Some(e) = self.receivers[g].poll_event() {
            if let ReceiverEvent::Finished { outcome, .. } = &e
                && !matches!(outcome, Err(CacheError::Unsettled { .. }))
            {
                self.gen_ended[g] = true;
            }
            self.gen_events.push((self.now, g, e));
        }
    }

    fn deliver(&mut self, from: &str, to: (Side, usize), msg: Msg) {
        match to {
            (Side::Ctx, c) if !self.ctx[c].dead => {
                self.senders[c].handle_message(from, msg, self.now);
                self.drain_ctx(c);
            }
            (Side::Gen, g) if !self.gen_nodes[g].dead => {
                if let (Msg::Done { .. }, Some(c)) = (&msg, from.strip_prefix("ctx")) {
                    self.dones.insert((c.parse().expect("a context rank"), g));
                }
                self.receivers[g].handle_message(from, msg, self.now);
                self.drain_gen(g);
            }
            _ => {}
        }
    }

    /// A write ends: aborted (nothing moved), failed (its target is
    /// dead), or landed — data first, then its sync message.
    fn write_ends(&mut self, c: usize, id: TransferId) {
        let Some(p) = self.posted.remove(&(c, id)) else {
            // Aborted: it ended then, not at its scheduled end.
            return;
        };
        let (_, g) = node_of(&p.request.remote_agent);
        let outcome = if p.aborted {
            Err(crate::Error::Aborted)
        } else if self.refusing.remove(&(c, id)) {
            Err(crate::Error::RemoteRejected {
                remote: name(Side::Gen, g),
                reason: crate::error::RejectReason::NotRegistered,
                landed: crate::error::Landed::Nothing,
            })
        } else if self.gen_nodes[g].dead {
            Err(crate::Error::Closed)
        } else {
            // Fail closed: once a generation rank reported a request ended
            // (anything but `Unsettled`), nothing of it lands there.
            assert!(
                !self.gen_ended[g],
                "context rank {c} wrote into generation rank {g} after its outcome"
            );
            for (l, r) in p.request.local.descs.iter().zip(&p.request.remote.descs) {
                assert_eq!(l.len, r.len);
                let src = (l.addr - base(Side::Ctx, c)) as usize;
                let dst = (r.addr - base(Side::Gen, g)) as usize;
                let n = l.len as usize;
                let bytes = self.ctx[c].pool[src..src + n].to_vec();
                self.gen_nodes[g].pool[dst..dst + n].copy_from_slice(&bytes);
            }
            self.landed.push((self.now, c, g));
            if let Some(chunk) = p.request.sync_message {
                let m = Reassembler::default()
                    .feed(&name(Side::Ctx, c), &chunk, self.now)
                    .unwrap()
                    .expect("one chunk");
                self.deliver(&name(Side::Ctx, c), (Side::Gen, g), m);
            }
            Ok(())
        };
        if !self.ctx[c].dead {
            self.senders[c].handle_transfer_done(id, outcome, self.now);
            self.drain_ctx(c);
        }
    }

    /// The next instant something happens: a delivery, a write's end, a
    /// machine's deadline.
    fn next_due(&self) -> Option<Instant> {
        let q = self.queue.keys().next().map(|k| k.0);
        let s = self
            .senders
            .iter()
            .zip(&self.ctx)
            .filter(|(_, n)| !n.dead)
            .filter_map(|(m, _)| m.poll_timeout());
        let r = self
            .receivers
            .iter()
            .zip(&self.gen_nodes)
            .filter(|(_, n)| !n.dead)
            .filter_map(|(m, _)| m.poll_timeout());
        q.into_iter().chain(s).chain(r).min()
    }

    /// Runs the next step; false when nothing is left to happen.
    fn step(&mut self) -> bool {
        let Some(at) = self.next_due() else {
            return false;
        };
        self.now = self.now.max(at);
        if let Some((&key, _)) = self.queue.iter().next()
            && key.0 <= self.now
        {
            match self.queue.remove(&key).expect("present") {
                Item::Deliver { from, to, chunks } => {
                    let now = self.now;
                    let r = self.reasm.entry(to).or_default();
                    let mut msg = None;
                    for c in &chunks {
                        msg = r.feed(&from, c, now).unwrap();
                    }
                    self.deliver(&from, to, msg.expect("a whole message"));
                }
                Item::WriteEnds { ctx, id } => self.write_ends(ctx, id),
            }
            return true;
        }
        for c in 0..self.senders.len() {
            if !self.ctx[c].dead
                && self.senders[c]
                    .poll_timeout()
                    .is_some_and(|t| t <= self.now)
            {
                self.senders[c].handle_timeout(self.now);
                self.drain_ctx(c);
            }
        }
        for g in 0..self.receivers.len() {
            if !self.gen_nodes[g].dead
                && self.receivers[g]
                    .poll_timeout()
                    .is_some_and(|t| t <= self.now)
            {
                self.receivers[g].handle_timeout(self.now);
                self.drain_gen(g);
            }
        }
        true
    }

    /// Runs until nothing is left to happen; returns the steps taken.
    fn run(&mut self) -> usize {
        let mut n = 0;
        while self.step() {
            n += 1;
            assert!(n < 1_000_000, "the protocol does not settle");
        }
        n
    }

    fn elapsed(&self, at: Instant) -> Duration {
        at - self.t0
    }

    fn ctx_outcomes(&self, c: usize) -> Vec<(Instant, Result<u64, CacheError>)> {
        self.ctx_events
            .iter()
            .filter(|e| e.1 == c)
            .map(|(t, _, e)| {
                let SenderEvent::Finished { outcome, .. } = e;
                (*t, outcome.as_ref().map(|s| s.bytes).map_err(Clone::clone))
            })
            .collect()
    }

    fn gen_outcomes(&self, g: usize) -> Vec<(Instant, Result<u64, CacheError>)> {
        self.gen_events
            .iter()
            .filter(|e| e.1 == g)
            .filter_map(|(t, _, e)| match e {
                ReceiverEvent::Finished { outcome, .. } => {
                    Some((*t, outcome.as_ref().map(|s| s.bytes).map_err(Clone::clone)))
                }
                ReceiverEvent::Settled { .. }
                | ReceiverEvent::Forgotten { .. }
                | ReceiverEvent::LayersLanded { .. } => None,
            })
            .collect()
    }

    fn settled(&self, g: usize) -> Vec<Instant> {
        self.gen_events
            .iter()
            .filter(|e| e.1 == g && matches!(e.2, ReceiverEvent::Settled { .. }))
            .map(|e| e.0)
            .collect()
    }

    /// Every generation rank's blocks `0..n` hold the request's cache.
    fn check_landed(&self, n: u32, tokens: u32) {
        for g in 0..self.gen_nodes.len() {
            self.check_landed_on(g, n, tokens);
        }
    }

    /// Generation rank `g`'s blocks `0..n` hold the request's cache.
    fn check_landed_on(&self, g: usize, n: u32, tokens: u32) {
        {
            let k = &self.gen_nodes[g];
            let bb = k.slice.block_bytes() as usize;
            for b in 0..n {
                let blk = &k.pool[b as usize * bb..(b as usize + 1) * bb];
                if let Some(m) = check_block(&self.gen_state, &k.slice, blk, b, tokens) {
                    panic!("generation rank {g}, block {b}: {m}");
                }
            }
        }
    }

    /// Nothing is open or in flight anywhere.
    fn assert_quiet(&self) {
        assert!(self.posted.is_empty(), "writes still posted");
        for (c, s) in self.senders.iter().enumerate() {
            assert!(self.ctx[c].dead || s.is_idle(), "context rank {c} not idle");
            assert_eq!(s.transfers_in_flight(), 0);
        }
        for (g, r) in self.receivers.iter().enumerate() {
            assert!(
                self.gen_nodes[g].dead || r.open_requests() == 0,
                "generation rank {g} still has open requests"
            );
        }
    }
}

fn node_of(agent: &str) -> (Side, usize) {
    if let Some(i) = agent.strip_prefix("ctx") {
        (Side::Ctx, i.parse().unwrap())
    } else {
        (
            Side::Gen,
            agent.strip_prefix("gen").unwrap().parse().unwrap(),
        )
    }
}

const ID: u64 = 0xfeed_0000_0001;

#[test]
fn shares_land_and_both_sides_agree_across_layouts() {
    let layouts = [
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((2, 2), (1, 2)),
        ((1, 2), (2, 1)),
        ((4, 1), (2, 2)),
        ((1, 1), (1, 1)),
    ];
    for ((ct, cp), (gt, gp)) in layouts {
        let tag = format!("TP{ct}/PP{cp} -> TP{gt}/PP{gp}");
        let mut p = Pair::new(state(ct, cp), state(gt, gp));
        // 10 tokens in blocks of 4: three blocks, the last one partial.
        p.start(ID, 3);
        p.run();
        p.check_landed(3, 10);
        let sent: u64 = (0..p.senders.len())
            .map(|c| {
                let o = p.ctx_outcomes(c);
                assert_eq!(o.len(), 1, "{tag}");
                o[0].1.clone().unwrap()
            })
            .sum();
        let got: u64 = (0..p.receivers.len())
            .map(|g| {
                let o = p.gen_outcomes(g);
                assert_eq!(o.len(), 1, "{tag}");
                o[0].1.clone().unwrap()
            })
            .sum();
        assert!(sent > 0, "{tag}");
        assert_eq!(sent, got, "{tag}");
        assert!(
            p.inflight_at_finish.iter().all(|&n| n == 0),
            "{tag}: a context rank finished with writes in flight"
        );
        for s in &p.senders {
            assert_eq!(s.metrics().completed, 1, "{tag}");
        }
        for r in &p.receivers {
            let m = r.metrics();
            assert_eq!((m.completed, m.failed, m.cancelled), (1, 0, 0), "{tag}");
        }
        p.assert_quiet();
    }
}

#[test]
fn timings_follow_simulated_time_exactly() {
    // TP1 → TP1, one share of three blocks in one batch.
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.senders[0] = SenderMachine::new(
        state(1, 1),
        0,
        None,
        SenderConfig {
            timeout: TIMEOUT,
            ..SenderConfig::default()
        },
    )
    .unwrap();
    p.start(ID, 3);
    p.run();
    // The request reaches the context rank after one latency; the write
    // starts then and completes WRITE_TIME later, and `Done` goes then,
    // reaching the receiver one latency later; `Ready` reaches the receiver
    // one latency after the start.
    let (t, bytes) = p.ctx_outcomes(0)[0].clone();
    assert_eq!(p.elapsed(t), LATENCY + WRITE_TIME);
    let (tg, _) = p.gen_outcomes(0)[0].clone();
    assert_eq!(p.elapsed(tg), 2 * LATENCY + WRITE_TIME);
    let SenderEvent::Finished { outcome, .. } = &p.ctx_events[0].2;
    let st = outcome.as_ref().unwrap();
    assert_eq!(st.request_info, LATENCY);
    assert_eq!(st.peers.len(), 1);
    assert_eq!(st.peers[0].duration, WRITE_TIME);
    assert_eq!(st.bytes, bytes.unwrap());
    let rs = p
        .gen_events
        .iter()
        .find_map(|e| match &e.2 {
            ReceiverEvent::Finished { outcome, .. } => Some(outcome.as_ref().unwrap()),
            _ => None,
        })
        .expect("an outcome");
    // From `Ready` (one latency after the write began) to `Done` (one
    // latency after it completed).
    assert_eq!(rs.transmission, WRITE_TIME);
    assert_eq!(rs.peers[0].delay, 2 * LATENCY);
}

/// Which side cancels.
#[derive(Clone, Copy, Debug)]
enum Canceller {
    Context,
    Generation,
}

#[test]
fn a_cancel_at_every_step_quiesces_both_sides() {
    // TP2 → TP1: two shares, each several batches, two in flight.
    let baseline = {
        let mut p = Pair::new(state(2, 1), state(1, 1));
        p.start(ID, 3);
        p.run()
    };
    assert!(baseline > 10, "too few steps to cut: {baseline}");
    for who in [Canceller::Context, Canceller::Generation] {
        for k in 0..=baseline {
            let tag = format!("{who:?} cancels after {k} steps");
            let mut p = Pair::new(state(2, 1), state(1, 1));
            p.start(ID, 3);
            for _ in 0..k {
                p.step();
            }
            let t_cancel = p.now;
            let r = match who {
                Canceller::Context => p.cancel_ctx(0, ID),
                Canceller::Generation => p.cancel_gen(0, ID),
            };
            p.run();
            // Exactly one outcome per rank; each context rank's only once
            // nothing it posted is in flight.
            for c in 0..2 {
                assert_eq!(p.ctx_outcomes(c).len(), 1, "{tag}");
            }
            assert!(p.inflight_at_finish.iter().all(|&n| n == 0), "{tag}");
            let g = p.gen_outcomes(0);
            assert_eq!(g.len(), 1, "{tag}");
            let completed = g[0].1.is_ok();
            match who {
                Canceller::Context => {
                    if r.is_err() {
                        // Already finished: it had completed.
                        assert!(matches!(r, Err(CacheError::UnknownRequest(_))), "{tag}");
                        assert!(completed, "{tag}");
                    }
                    // Nothing context rank 0 posted lands after its outcome.
                    let (t_out, o) = p.ctx_outcomes(0)[0].clone();
                    assert!(
                        p.landed.iter().all(|&(t, c, _)| c != 0 || t <= t_out),
                        "{tag}"
                    );
                    if o.is_err() {
                        assert!(!completed, "{tag}: receiver completed a cancelled share");
                        assert!(
                            matches!(&g[0].1, Err(CacheError::Cancelled { .. })),
                            "{tag}: {:?}",
                            g[0].1
                        );
                    }
                }
                Canceller::Generation => {
                    let settled = p.settled(0);
                    if r.is_err() {
                        assert!(completed, "{tag}");
                        assert!(settled.is_empty(), "{tag}");
                    } else {
                        // The cancel settles, and nothing lands after it.
                        assert_eq!(settled.len(), 1, "{tag}");
                        assert!(settled[0] >= t_cancel, "{tag}");
                        assert!(p.landed.iter().all(|&(t, _, _)| t <= settled[0]), "{tag}");
                        if !completed {
                            assert!(
                                matches!(&g[0].1, Err(CacheError::Cancelled { .. })),
                                "{tag}"
                            );
                        }
                    }
                }
            }
            // Long before any deadline.
            assert!(p.elapsed(p.now) < TIMEOUT, "{tag}: waited for a timeout");
            let m = p.receivers[0].metrics();
            assert_eq!(m.completed + m.cancelled + m.failed, 1, "{tag}: {m:?}");
            p.assert_quiet();
        }
    }
}

#[test]
fn a_rank_that_never_asks_times_out_the_context_side_at_its_deadline() {
    // TP1 → TP2: generation rank 1 never asks; rank 0 would wait longer.
    let mut p = Pair::with_receiver_timeout(state(1, 1), state(2, 1), 2 * TIMEOUT);
    p.prefill(3);
    p.request(0, ID, 3);
    p.send(0, ID, 3);
    p.run();
    let o = p.ctx_outcomes(0);
    assert_eq!(o.len(), 1);
    assert_eq!(p.elapsed(o[0].0), TIMEOUT);
    match &o[0].1 {
        Err(CacheError::Timeout { what, .. }) => assert!(what.contains("[1]"), "{what}"),
        other => panic!("{other:?}"),
    }
    // The rank that asked is told, as a failure, one latency later; no
    // write was posted.
    let g = p.gen_outcomes(0);
    assert_eq!(g.len(), 1);
    assert_eq!(p.elapsed(g[0].0), TIMEOUT + LATENCY);
    assert!(matches!(&g[0].1, Err(CacheError::Cancelled { .. })));
    assert!(p.landed.is_empty());
    assert_eq!(p.receivers[0].metrics().failed, 1);
    assert_eq!(p.senders[0].metrics().failed, 1);
    p.assert_quiet();
}

#[test]
fn a_lost_context_rank_times_the_receiver_out_and_is_forgotten() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.ctx[0].dead = true;
    p.request(0, ID, 2);
    // Run to the deadline only.
    while p.gen_outcomes(0).is_empty() {
        assert!(p.step());
    }
    // The deadline passes, the rank is told to stop and never confirms:
    // the outcome says so after the settle timeout.
    let g = p.gen_outcomes(0);
    assert_eq!(p.elapsed(g[0].0), TIMEOUT + SETTLE);
    match &g[0].1 {
        Err(CacheError::Unsettled { ranks, cause, .. }) => {
            assert_eq!(ranks, &[0]);
            assert!(matches!(**cause, CacheError::Timeout { .. }), "{cause}");
        }
        other => panic!("{other:?}"),
    }
    // Still open: a late write could land. A cancel cannot settle (no one
    // answers); the request is forgotten one timeout after the outcome.
    assert_eq!(p.receivers[0].open_requests(), 1);
    let t_out = g[0].0;
    p.cancel_gen(0, ID).unwrap();
    p.run();
    assert!(p.settled(0).is_empty());
    assert_eq!(p.receivers[0].open_requests(), 0);
    assert_eq!(p.now, t_out + TIMEOUT);
    assert!(
        p.gen_events
            .iter()
            .any(|e| matches!(e.2, ReceiverEvent::Forgotten { .. }) && e.0 == p.now)
    );
    assert_eq!(p.gen_outcomes(0).len(), 1);
    let m = p.receivers[0].metrics();
    assert_eq!((m.failed, m.unsettled), (1, 1));
}

/// A context rank that left the agent's metadata store (its process died
/// or hung): the request waiting on its share fails at once with the cause,
/// not at its deadline, as `Unsettled` (the rank never confirmed that it
/// stopped); it is then awaited no more, and forgotten one timeout later.
#[test]
fn a_context_rank_that_leaves_fails_the_request_at_once() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.ctx[0].dead = true;
    p.request(0, ID, 2);
    let ctx0 = name(Side::Ctx, 0);
    assert_eq!(p.receivers[0].awaited_agents(), vec![ctx0.clone()]);
    // Another agent leaving changes nothing.
    let gone = |r: &str| crate::Error::PeerGone { remote: r.into() };
    p.receivers[0].handle_peer_gone("someone-else", gone("someone-else"), p.now);
    p.drain_gen(0);
    assert!(p.gen_outcomes(0).is_empty());
    p.receivers[0].handle_peer_gone(&ctx0, gone(&ctx0), p.now);
    p.drain_gen(0);
    let g = p.gen_outcomes(0);
    assert_eq!(g.len(), 1);
    assert_eq!(p.elapsed(g[0].0), Duration::ZERO);
    assert!(
        matches!(
            &g[0].1,
            Err(CacheError::Unsettled { ranks, cause, .. })
                if ranks == &[0]
                    && matches!(**cause, CacheError::Transfer(crate::Error::PeerGone { .. }))
        ),
        "{:?}",
        g[0].1
    );
    assert!(p.receivers[0].awaited_agents().is_empty());
    assert_eq!(p.receivers[0].open_requests(), 1);
    p.run();
    assert_eq!(p.receivers[0].open_requests(), 0);
    assert_eq!(p.gen_outcomes(0).len(), 1);
    assert_eq!(p.receivers[0].metrics().failed, 1);
}

#[test]
fn a_lost_generation_rank_fails_the_writes_at_once() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.start(ID, 3);
    // Until the first write is posted, then the generation rank dies.
    while p.posted.is_empty() {
        assert!(p.step());
    }
    p.gen_nodes[0].dead = true;
    p.run();
    let o = p.ctx_outcomes(0);
    assert_eq!(o.len(), 1);
    assert!(
        matches!(&o[0].1, Err(CacheError::Transfer(crate::Error::Closed))),
        "{:?}",
        o[0].1
    );
    // Within the writes' time, not at a deadline.
    assert!(p.elapsed(o[0].0) < TIMEOUT / 10);
    assert_eq!(p.senders[0].metrics().failed, 1);
    p.assert_quiet();
}

#[test]
fn writes_that_hang_are_aborted_at_the_deadline() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.writes = Writes::Hang;
    p.start(ID, 3);
    p.run();
    let o = p.ctx_outcomes(0);
    assert_eq!(o.len(), 1);
    // The deadline counts from `send`; the aborted writes end at once.
    assert_eq!(p.elapsed(o[0].0), TIMEOUT);
    match &o[0].1 {
        Err(CacheError::Timeout { what, .. }) => assert!(what.contains("writes"), "{what}"),
        other => panic!("{other:?}"),
    }
    assert!(p.landed.is_empty());
    assert_eq!(p.inflight_at_finish, vec![0]);
    // The receiver hears of it (or times out itself, at the same instant
    // give or take a latency): either way it ends.
    assert_eq!(p.gen_outcomes(0).len(), 1);
    p.assert_quiet();
}

#[test]
fn lost_messages_end_in_timeouts_not_hangs() {
    for lost in ["Request", "Ready", "Cancelled"] {
        let mut p = Pair::new(state(2, 1), state(1, 1));
        p.lose = Box::new(move |_, _, m| {
            let kind = match m {
                Msg::Request(_) => "Request",
                Msg::Ready { .. } => "Ready",
                Msg::Cancelled { .. } => "Cancelled",
                _ => "",
            };
            kind == lost
        });
        p.start(ID, 3);
        if lost == "Cancelled" {
            p.step();
            p.cancel_gen(0, ID).unwrap();
        }
        p.run();
        for c in 0..2 {
            assert_eq!(p.ctx_outcomes(c).len(), 1, "{lost}");
        }
        assert_eq!(p.gen_outcomes(0).len(), 1, "{lost}");
        assert!(p.elapsed(p.now) <= 2 * TIMEOUT + LATENCY, "{lost}");
        p.assert_quiet();
    }
}

/// A lost `Cancel`, or a lost `Cancelled`, costs a resend, not the
/// settle timeout: the generation side asks the ranks that have not
/// confirmed again (a fifth of the settle timeout later), and each
/// answers once its writes ended. Only the rank that lost a message is
/// asked again. A confirmation lost after the outcome was reported
/// `Unsettled` (every answer lost until then) still settles the request
/// later.
#[test]
fn a_lost_confirmation_is_asked_for_again() {
    let every = SETTLE / 5;
    for lost in ["Cancel", "Cancelled"] {
        let mut p = Pair::new(state(2, 1), state(1, 1));
        let first = std::cell::Cell::new(true);
        p.lose = Box::new(move |from, to, m| {
            let hit = match (lost, m) {
                ("Cancel", Msg::Cancel { .. }) => to == name(Side::Ctx, 1),
                ("Cancelled", Msg::Cancelled { .. }) => from == name(Side::Ctx, 1),
                _ => false,
            };
            hit && first.replace(false)
        });
        // Writes end only when aborted: a rank that missed the cancel
        // never delivers, so only a confirmation can settle it.
        p.writes = Writes::Hang;
        p.start(ID, 3);
        p.step();
        let t_cancel = p.now;
        p.cancel_gen(0, ID).unwrap();
        p.run();
        let g = p.gen_outcomes(0);
        assert_eq!(g.len(), 1, "{lost}");
        assert!(
            matches!(g[0].1, Err(CacheError::Cancelled { .. })),
            "{lost}: {:?}",
            g[0].1
        );
        let took = g[0].0 - t_cancel;
        assert!(
            took >= every && took < every + Duration::from_millis(50),
            "{lost}: settled {took:?} after the cancel"
        );
        assert_eq!(p.settled(0).len(), 1, "{lost}");
        let m = p.receivers[0].metrics();
        assert_eq!((m.unsettled, m.cancels_resent), (0, 1), "{lost}");
        p.assert_quiet();
    }

    // Every confirmation from rank 1 lost until after the settle timeout.
    let mut p = Pair::new(state(2, 1), state(1, 1));
    let t0 = p.t0;
    let until = t0 + TIMEOUT;
    let clock = std::rc::Rc::new(std::cell::Cell::new(t0));
    let seen = std::rc::Rc::clone(&clock);
    p.lose = Box::new(move |from, _, m| {
        matches!(m, Msg::Cancelled { .. }) && from == name(Side::Ctx, 1) && seen.get() < until
    });
    p.writes = Writes::Hang;
    p.start(ID, 3);
    p.step();
    p.cancel_gen(0, ID).unwrap();
    while p.step() {
        clock.set(p.now);
    }
    let g = p.gen_outcomes(0);
    assert!(
        matches!(&g[0].1, Err(CacheError::Unsettled { ranks, .. }) if ranks == &[1]),
        "{:?}",
        g[0].1
    );
    let settled = p.settled(0);
    assert_eq!(settled.len(), 1, "a late confirmation settles it");
    assert!(settled[0] >= until && settled[0] < until + every + Duration::from_millis(50));
    p.assert_quiet();
}

#[test]
fn a_request_for_a_finished_id_is_refused_and_ids_can_be_reused() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.start(ID, 2);
    p.run();
    assert!(p.gen_outcomes(0)[0].1.is_ok());
    // A late duplicate ask is answered at once, as a failure.
    p.request(0, ID, 2);
    p.run();
    let g = p.gen_outcomes(0);
    assert_eq!(g.len(), 2);
    assert!(
        matches!(&g[1].1, Err(CacheError::Cancelled { reason, .. }) if reason.contains("already finished"))
    );
    // `send` with the id again starts it anew.
    p.request(0, ID, 2);
    p.send(0, ID, 2);
    p.run();
    assert!(p.gen_outcomes(0)[2].1.is_ok());
    assert!(p.ctx_outcomes(0)[1].1.is_ok());
    p.assert_quiet();
}

/// A request the generation side cancels before the context rank has
/// called `send`: that later `send` ends at once with the cancel, writes
/// nothing, and the id stays finished (a late ask is refused).
#[test]
fn a_send_after_the_generation_side_ended_the_request_ends_at_once() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.prefill(2);
    p.request(0, ID, 2);
    // The request info reaches the context rank.
    assert!(p.step());
    p.cancel_gen(0, ID).unwrap();
    p.run();
    assert!(matches!(
        &p.gen_outcomes(0)[0].1,
        Err(CacheError::Cancelled { .. })
    ));
    // The context rank heard of it (with no `send`, a driver has no
    // handle to report it to).
    let before = p.ctx_outcomes(0).len();
    let t = p.now;
    p.send(0, ID, 2);
    p.run();
    let o = p.ctx_outcomes(0);
    assert_eq!(o.len(), before + 1);
    let (at, outcome) = &o[before];
    assert_eq!(*at, t, "at once, not at the deadline");
    assert!(
        matches!(outcome, Err(CacheError::Cancelled { .. })),
        "{outcome:?}"
    );
    assert!(p.landed.is_empty());
    p.request(0, ID, 2);
    p.run();
    let g = p.gen_outcomes(0);
    assert!(
        matches!(&g[g.len() - 1].1, Err(CacheError::Cancelled { reason, .. }) if reason.contains("already finished"))
    );
    p.assert_quiet();
}

#[test]
fn api_misuse_is_typed_and_changes_nothing() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    let now = p.now;
    assert!(matches!(
        p.senders[0].cancel(7, now),
        Err(CacheError::UnknownRequest(7))
    ));
    assert!(matches!(
        p.receivers[0].cancel(7, now),
        Err(CacheError::UnknownRequest(7))
    ));
    p.send(0, ID, 2);
    assert!(matches!(
        p.senders[0].send(ID, vec![1], now),
        Err(CacheError::DuplicateRequest(ID))
    ));
    p.request(0, ID, 2);
    let dup = RecvRequest {
        request_id: ID,
        ctx_dp_rank: 0,
        blocks: vec![1],
        last_block_key: None,
    };
    assert!(matches!(
        p.receivers[0].request(dup.clone(), now),
        Err(CacheError::DuplicateRequest(ID))
    ));
    let empty = RecvRequest {
        request_id: 9,
        blocks: vec![],
        ..dup
    };
    assert!(matches!(
        p.receivers[0].request(empty, now),
        Err(CacheError::InvalidState(_))
    ));
    // The original request still completes.
    p.prefill(2);
    p.run();
    assert!(p.gen_outcomes(0)[0].1.is_ok());
    p.check_landed(2, 8);
    p.assert_quiet();
}

/// A generation state that is admissible but maps one context rank onto
/// 131,072 generation ranks (TP 4,096 × PP 32, one head each) is refused
/// at its first request, before any planning, with a typed failure; a
/// request of a sane layout is then served as usual.
#[test]
fn a_layout_mapping_onto_too_many_ranks_is_refused_before_planning() {
    let ctx = CacheState::new(32, 8, 128, 16, DataType::Bf16, Attention::Default, 1, 1);
    let hostile = CacheState::new(32, 1, 128, 16, DataType::Bf16, Attention::Default, 4096, 32);
    assert!(ctx.check_compatible(&hostile).is_ok());
    let mut s = SenderMachine::new(ctx, 0, None, SenderConfig::default()).unwrap();
    let now = Instant::now();
    let info = RequestInfo {
        request_id: 5,
        gen_rank: 0,
        gen_dp_rank: 0,
        gen_state: hostile,
        connection: "gen".into(),
        index_from_end: 0,
        last_block_key: None,
        blocks: vec![0x1000_0000],
        pool_mem_type: crate::memory::MemoryType::Dram,
        integrity: false,
    };
    s.handle_message("gen", Msg::Request(info), now);
    let msg = s.poll_transmit().expect("an answer").msg;
    assert!(
        matches!(&msg, Msg::Cancelled { request_id: 5, reason, failure: true, .. } if reason.contains("131072 generation ranks")),
        "{msg:?}"
    );
    assert!(s.is_idle());
}

/// Every layer of generation rank `g` reported once, runs disjoint.
fn assert_each_layer_once(p: &Pair, g: usize, tag: &str) {
    let mine = p.receivers[g].held_layers();
    let mut seen: Vec<u32> = p
        .layer_reports(g)
        .into_iter()
        .flat_map(|(_, r)| r)
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, mine.collect::<Vec<_>>(), "{tag}");
}

#[test]
fn a_whole_request_is_one_layer_group() {
    let mut p = Pair::new(state(2, 1), state(1, 1));
    p.start(ID, 3);
    p.run();
    // Both context ranks' `Done`: the layers land with the last one, just
    // before the outcome.
    let reports = p.layer_reports(0);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].1, 0..4);
    let (t_done, o) = p.gen_outcomes(0)[0].clone();
    assert!(o.is_ok());
    assert_eq!(reports[0].0, t_done);
    let pos = |f: &dyn Fn(&ReceiverEvent) -> bool| p.gen_events.iter().position(|e| f(&e.2));
    assert!(
        pos(&|e| matches!(e, ReceiverEvent::LayersLanded { .. }))
            < pos(&|e| matches!(e, ReceiverEvent::Finished { .. }))
    );
}

#[test]
fn layer_groups_stream_as_they_become_ready_in_any_order_across_layouts() {
    let layouts = [
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((2, 2), (1, 2)),
        ((1, 2), (2, 1)),
        ((1, 1), (1, 2)),
        ((4, 1), (2, 2)),
    ];
    // Single layers and a pair, out of order.
    let order: [Range<u32>; 3] = [3..4, 0..2, 2..3];
    for ((ct, cp), (gt, gp)) in layouts {
        let tag = format!("TP{ct}/PP{cp} -> TP{gt}/PP{gp}");
        let mut p = Pair::new(state(ct, cp), state(gt, gp));
        p.prefill(3);
        for g in 0..p.receivers.len() {
            p.request(g, ID, 3);
        }
        for c in 0..p.senders.len() {
            p.begin(c, ID, 3);
        }
        p.settle();
        // Asked and begun, nothing ready: nothing moved.
        assert!(p.landed.is_empty(), "{tag}");
        let mut marked = BTreeSet::new();
        for group in &order {
            let t_mark = p.now;
            for c in 0..p.senders.len() {
                let held = p.senders[c].held_layers();
                let part = group.start.max(held.start)..group.end.min(held.end);
                if !part.is_empty() {
                    p.mark(c, ID, part).unwrap();
                }
            }
            marked.extend(group.clone());
            p.settle();
            // Each generation rank now has every marked layer it holds
            // reported, and only those; the reports came after the mark.
            for g in 0..p.receivers.len() {
                let mine = p.receivers[g].held_layers();
                let got: BTreeSet<u32> = p
                    .layer_reports(g)
                    .into_iter()
                    .flat_map(|(_, r)| r)
                    .collect();
                let want: BTreeSet<u32> = mine.filter(|l| marked.contains(l)).collect();
                assert_eq!(got, want, "{tag}: after marking {group:?}");
                assert!(
                    p.layer_reports(g)
                        .iter()
                        .filter(|(_, r)| group.contains(&r.start))
                        .all(|(t, _)| *t > t_mark),
                    "{tag}"
                );
            }
        }
        p.run();
        p.check_landed(3, 10);
        for g in 0..p.receivers.len() {
            assert_each_layer_once(&p, g, &tag);
            let o = p.gen_outcomes(g);
            assert_eq!(o.len(), 1, "{tag}");
            assert!(o[0].1.is_ok(), "{tag}: {:?}", o[0].1);
        }
        let sent: u64 = (0..p.senders.len())
            .map(|c| p.ctx_outcomes(c)[0].1.clone().unwrap())
            .sum();
        let got: u64 = (0..p.receivers.len())
            .map(|g| p.gen_outcomes(g)[0].1.clone().unwrap())
            .sum();
        assert_eq!(sent, got, "{tag}");
        assert!(p.inflight_at_finish.iter().all(|&n| n == 0), "{tag}");
        p.assert_quiet();
    }
}

#[test]
fn a_late_generation_side_gets_the_ready_layers_at_once() {
    // TP2 → TP1: the prefill has produced layers 0..3 before the
    // generation side asks.
    let mut p = Pair::new(state(2, 1), state(1, 1));
    p.prefill(3);
    for c in 0..2 {
        p.begin(c, ID, 3);
        p.mark(c, ID, 0..3).unwrap();
    }
    p.settle();
    assert!(p.landed.is_empty());
    let t_ask = p.now;
    p.request(0, ID, 3);
    p.settle();
    let reports = p.layer_reports(0);
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].1, 0..3);
    // The request's flight, then the writes at once: each share is 3
    // layers × 3 blocks × 256 bytes, 5 batches of 512 bytes, two in
    // flight: three rounds; then the report's flight.
    assert_eq!(reports[0].0 - t_ask, 2 * LATENCY + 3 * WRITE_TIME);
    assert!(p.gen_outcomes(0).is_empty());
    for c in 0..2 {
        p.mark(c, ID, 3..4).unwrap();
    }
    p.run();
    assert_eq!(p.layer_reports(0).len(), 2);
    assert!(p.gen_outcomes(0)[0].1.is_ok());
    p.check_landed(3, 10);
    p.assert_quiet();
}

#[test]
fn a_cancel_between_groups_quiesces_both_sides() {
    for who in [Canceller::Context, Canceller::Generation] {
        let tag = format!("{who:?}");
        let mut p = Pair::new(state(2, 1), state(1, 1));
        p.prefill(3);
        p.request(0, ID, 3);
        for c in 0..2 {
            p.begin(c, ID, 3);
            p.mark(c, ID, 0..2).unwrap();
        }
        p.settle();
        assert_eq!(p.layer_reports(0).len(), 1, "{tag}");
        let landed = p.landed.len();
        match who {
            Canceller::Context => p.cancel_ctx(1, ID).unwrap(),
            Canceller::Generation => p.cancel_gen(0, ID).unwrap(),
        }
        p.settle();
        // The layers that become ready after the cancel are not written;
        // a cancelled request takes them as a no-op.
        for c in 0..2 {
            p.mark(c, ID, 2..4).unwrap();
        }
        p.run();
        assert_eq!(p.landed.len(), landed, "{tag}: written after the cancel");
        for c in 0..2 {
            let o = p.ctx_outcomes(c);
            assert_eq!(o.len(), 1, "{tag}");
            assert!(
                matches!(o[0].1, Err(CacheError::Cancelled { .. })),
                "{tag}: {:?}",
                o[0].1
            );
        }
        let g = p.gen_outcomes(0);
        assert_eq!(g.len(), 1, "{tag}");
        assert!(
            matches!(g[0].1, Err(CacheError::Cancelled { .. })),
            "{tag}: {:?}",
            g[0].1
        );
        assert_eq!(
            p.layer_reports(0).len(),
            1,
            "{tag}: a report after the cancel"
        );
        if let Canceller::Generation = who {
            assert_eq!(p.settled(0).len(), 1, "{tag}");
        }
        assert!(p.elapsed(p.now) < TIMEOUT, "{tag}: waited for a timeout");
        p.assert_quiet();
    }
}

#[test]
fn a_context_rank_that_dies_mid_stream_fails_the_request_at_once() {
    let mut p = Pair::new(state(2, 1), state(1, 1));
    p.prefill(3);
    p.request(0, ID, 3);
    for c in 0..2 {
        p.begin(c, ID, 3);
        p.mark(c, ID, 0..1).unwrap();
    }
    p.settle();
    assert_eq!(p.layer_reports(0).len(), 1);
    // Context rank 1 dies; rank 0 goes on producing layers.
    p.ctx[1].dead = true;
    p.mark(0, ID, 1..3).unwrap();
    p.settle();
    // Half of layers 1..3 landed: nothing more is reported.
    assert_eq!(p.layer_reports(0).len(), 1);
    let ctx1 = name(Side::Ctx, 1);
    let gone = crate::Error::PeerGone {
        remote: ctx1.clone(),
    };
    let t_gone = p.now;
    p.receivers[0].handle_peer_gone(&ctx1, gone, p.now);
    p.drain_gen(0);
    // The receiver tells rank 0 to stop at once, and reports the outcome
    // once it confirmed (one round trip): only the rank that left is
    // unconfirmed.
    assert!(p.gen_outcomes(0).is_empty());
    p.settle();
    let g = p.gen_outcomes(0);
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].0, t_gone + 2 * LATENCY);
    assert!(
        matches!(
            &g[0].1,
            Err(CacheError::Unsettled { ranks, cause, .. })
                if ranks == &[1]
                    && matches!(**cause, CacheError::Transfer(crate::Error::PeerGone { .. }))
        ),
        "{:?}",
        g[0].1
    );
    // Rank 0's next layer is not written, and it ends the request as
    // cancelled by the generation side.
    let landed = p.landed.len();
    p.mark(0, ID, 3..4).unwrap();
    p.run();
    assert_eq!(p.landed.len(), landed);
    assert_eq!(p.layer_reports(0).len(), 1);
    let o = p.ctx_outcomes(0);
    assert_eq!(o.len(), 1);
    assert!(
        matches!(&o[0].1, Err(CacheError::Cancelled { reason, .. }) if reason.contains("gen0")),
        "{:?}",
        o[0].1
    );
    assert_eq!(p.receivers[0].open_requests(), 0);
}

#[test]
fn layers_never_ready_time_out_at_the_deadline() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.prefill(2);
    p.request(0, ID, 2);
    p.begin(0, ID, 2);
    p.mark(0, ID, 0..3).unwrap();
    p.run();
    let o = p.ctx_outcomes(0);
    assert_eq!(o.len(), 1);
    assert_eq!(p.elapsed(o[0].0), TIMEOUT);
    assert!(
        matches!(o[0].1, Err(CacheError::Timeout { .. })),
        "{:?}",
        o[0].1
    );
    let g = p.gen_outcomes(0);
    assert_eq!(g.len(), 1);
    assert!(g[0].1.is_err());
    assert_eq!(p.layer_reports(0).len(), 1);
    p.assert_quiet();
}

#[test]
fn layer_marks_that_are_wrong_are_typed_and_change_nothing() {
    // PP2: context rank 1 holds layers 2..4.
    let mut p = Pair::new(state(1, 2), state(1, 1));
    let now = p.now;
    assert!(matches!(
        p.senders[1].layers_ready(ID, 2..3, now),
        Err(CacheError::UnknownRequest(ID))
    ));
    p.prefill(2);
    p.request(0, ID, 2);
    // A peer's request alone does not begin it.
    p.settle();
    assert!(matches!(
        p.senders[1].layers_ready(ID, 2..3, now),
        Err(CacheError::UnknownRequest(ID))
    ));
    p.begin(0, ID, 2);
    p.begin(1, ID, 2);
    for bad in [0..3, 1..2, 3..5, 2..2] {
        assert!(
            matches!(
                p.senders[1].layers_ready(ID, bad.clone(), p.now),
                Err(CacheError::LayersOutOfRange { held, .. }) if held == (2..4)
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        p.senders[0].begin(ID, vec![1], p.now),
        Err(CacheError::DuplicateRequest(ID))
    ));
    p.settle();
    assert!(p.landed.is_empty());
    // Marking a layer twice is harmless.
    p.mark(1, ID, 2..4).unwrap();
    p.mark(1, ID, 3..4).unwrap();
    p.mark(0, ID, 0..2).unwrap();
    p.run();
    assert!(p.gen_outcomes(0)[0].1.is_ok());
    p.check_landed(2, 8);
    assert_each_layer_once(&p, 0, "PP2 -> PP1");
    // A request that ended takes a mark as a no-op.
    p.mark(1, ID, 2..3).unwrap();
    p.assert_quiet();
}

#[test]
fn a_cancel_racing_the_last_write_ends_alike_on_both_sides() {
    // Aborts that come too late: whatever was posted lands whole. Cut by a
    // cancel of either side at every step, both ends agree on each share:
    // a generation rank completes exactly when every share written to it
    // was delivered, a context rank exactly when every share it writes
    // was (TP1 <-> TP2: every context rank writes to every generation
    // rank here).
    for (ct, gt) in [(1, 1), (2, 1), (1, 2)] {
        let baseline = {
            let mut p = Pair::new(state(ct, 1), state(gt, 1));
            p.start(ID, 3);
            p.run()
        };
        for who in [Canceller::Context, Canceller::Generation] {
            for k in 0..=baseline {
                let tag = format!("TP{ct} -> TP{gt}, {who:?} cancels after {k} steps");
                let mut p = Pair::new(state(ct, 1), state(gt, 1));
                p.late_aborts = true;
                p.start(ID, 3);
                for _ in 0..k {
                    p.step();
                }
                // Every rank of the cancelling side cancels; a rank that
                // already ended takes it as a no-op.
                match who {
                    Canceller::Context => {
                        for c in 0..p.senders.len() {
                            p.cancel_ctx(c, ID).unwrap();
                        }
                    }
                    Canceller::Generation => {
                        for g in 0..p.receivers.len() {
                            let r = p.cancel_gen(g, ID);
                            // A receiver forgets a completed request.
                            assert!(r.is_ok() || p.gen_outcomes(g)[0].1.is_ok(), "{tag}");
                        }
                    }
                }
                p.run();
                let (nc, ng) = (p.senders.len(), p.receivers.len());
                for c in 0..nc {
                    let o = p.ctx_outcomes(c);
                    assert_eq!(o.len(), 1, "{tag}");
                    let all = (0..ng).all(|g| p.dones.contains(&(c, g)));
                    assert_eq!(o[0].1.is_ok(), all, "{tag}: context rank {c}: {:?}", o[0].1);
                }
                for g in 0..ng {
                    let o = p.gen_outcomes(g);
                    assert_eq!(o.len(), 1, "{tag}");
                    let all = (0..nc).all(|c| p.dones.contains(&(c, g)));
                    assert_eq!(
                        o[0].1.is_ok(),
                        all,
                        "{tag}: generation rank {g}: {:?}",
                        o[0].1
                    );
                }
                p.assert_quiet();
            }
        }
    }
}

/// A generation deadline reaches every context rank at once (one message
/// flight, no timer tick), and the generation side reports it once they
/// confirmed they stopped: one round trip after the deadline.
#[test]
fn a_deadline_reaches_every_rank_at_once_and_reports_once_quiesced() {
    let mut p = Pair::with_receiver_timeout(state(2, 1), state(1, 1), TIMEOUT / 2);
    p.writes = Writes::Hang;
    p.start(ID, 3);
    p.run();
    let deadline = TIMEOUT / 2;
    for c in 0..2 {
        let o = p.ctx_outcomes(c);
        assert_eq!(o.len(), 1);
        assert_eq!(p.elapsed(o[0].0), deadline + LATENCY, "context rank {c}");
        assert!(
            matches!(&o[0].1, Err(CacheError::Cancelled { reason, .. }) if reason.contains("gen0")),
            "{:?}",
            o[0].1
        );
    }
    let g = p.gen_outcomes(0);
    assert_eq!(g.len(), 1);
    assert_eq!(p.elapsed(g[0].0), deadline + 2 * LATENCY);
    assert!(
        matches!(&g[0].1, Err(CacheError::Timeout { .. })),
        "{:?}",
        g[0].1
    );
    assert_eq!(p.settled(0), vec![g[0].0]);
    p.assert_quiet();
}

/// One context rank cancels while the other's writes still move and its
/// aborts come too late (each posted write lands whole): the generation
/// side reports the cancel only after the last of them landed, and
/// nothing lands after that (checked on every write by the pair).
#[test]
fn a_cancelled_request_reports_only_after_the_other_ranks_stopped() {
    for k in 0..40 {
        let mut p = Pair::new(state(2, 1), state(1, 1));
        p.late_aborts = true;
        p.start(ID, 3);
        for _ in 0..k {
            p.step();
        }
        let _ = p.cancel_ctx(0, ID);
        p.run();
        let g = p.gen_outcomes(0);
        assert_eq!(g.len(), 1, "after {k} steps");
        if g[0].1.is_err() {
            assert!(
                p.landed.iter().all(|&(t, _, _)| t <= g[0].0),
                "after {k} steps: a write landed after the outcome"
            );
            assert_eq!(p.settled(0).len(), 1, "after {k} steps");
        }
        p.assert_quiet();
    }
}

/// Messages about a request from agents that are not its parties are
/// dropped and counted, never acted on: a `Cancelled`, `Landed` or `Done`
/// from a stranger does not fail or complete the request, and a `Cancel`
/// from a stranger does not stop a context rank; the request then
/// completes.
#[test]
fn strangers_cannot_move_a_request() {
    let mut p = Pair::new(state(2, 1), state(1, 1));
    p.start(ID, 3);
    p.step();
    p.step();
    let forged = [
        Msg::Cancelled {
            request_id: ID,
            reason: "forged".into(),
            failure: true,
            integrity: false,
        },
        Msg::Landed {
            request_id: ID,
            first_layer: 0,
            layers: 1,
        },
        Msg::Done {
            request_id: ID,
            bytes: 1,
            fragments: 1,
            fragments_coalesced: 1,
        },
    ];
    for m in forged {
        p.deliver("mallory", (Side::Gen, 0), m);
    }
    for c in 0..2 {
        p.deliver("mallory", (Side::Ctx, c), Msg::Cancel { request_id: ID });
    }
    p.run();
    p.check_landed(3, 10);
    assert!(p.gen_outcomes(0)[0].1.is_ok());
    for c in 0..2 {
        assert!(p.ctx_outcomes(c)[0].1.is_ok());
        assert_eq!(p.senders[c].metrics().strangers, 1);
    }
    assert_eq!(p.receivers[0].metrics().strangers, 3);
    p.assert_quiet();
}

/// A request info from another agent for a generation rank that already
/// asked is dropped: the writes go where the first one asked.
#[test]
fn a_second_agent_asking_as_a_rank_is_dropped() {
    let mut p = Pair::new(state(1, 1), state(1, 1));
    p.prefill(2);
    let mut info = None;
    p.lose = Box::new(|_, _, _| false);
    p.request(0, ID, 2);
    // Capture the request info as it flies: the first queued delivery.
    if let Some(Item::Deliver { chunks, .. }) = p.queue.values().next() {
        let mut r = Reassembler::default();
        for c in chunks {
            info = r.feed("gen0", c, p.now).unwrap();
        }
    }
    let Some(Msg::Request(mut forged)) = info else {
        panic!("no request info in flight");
    };
    forged.connection = "gen9".into();
    // The real one arrives first; the forged one while the request is open.
    p.step();
    p.deliver("gen9", (Side::Ctx, 0), Msg::Request(forged));
    p.send(0, ID, 2);
    p.run();
    p.check_landed(2, 8);
    assert!(p.ctx_outcomes(0)[0].1.is_ok());
    assert!(p.gen_outcomes(0)[0].1.is_ok());
    assert_eq!(p.senders[0].metrics().strangers, 1);
    p.assert_quiet();
}

/// A write the target refuses (nothing of it lands) fails the request on
/// every side, whichever of a share's writes it is — also when the share's
/// later writes, the one carrying `Done` among them, land: a generation
/// rank never reports landed a share with a hole in it. Layer by layer
/// too, for the layers reported landed.
#[test]
fn a_refused_write_is_never_reported_landed() {
    for ((ct, cp), (gt, gp)) in [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 2), (2, 1))] {
        let writes = {
            let mut p = Pair::new(state(ct, cp), state(gt, gp));
            p.start(ID, 3);
            p.run();
            p.posts.clone()
        };
        for (c, k, late) in (0..writes.len())
            .flat_map(|c| (0..writes[c]).map(move |k| (c, k)))
            .flat_map(|(c, k)| [(c, k, false), (c, k, true)])
        {
            {
                let tag = format!(
                    "TP{ct}/PP{cp} -> TP{gt}/PP{gp}: context rank {c}'s write {k}, late aborts {late}"
                );
                let mut p = Pair::new(state(ct, cp), state(gt, gp));
                // Aborts that come too late: the writes in flight beside
                // the refused one land whole.
                p.late_aborts = late;
                p.refused[c].insert(k);
                p.start(ID, 3);
                p.run();
                assert!(p.ctx_outcomes(c)[0].1.is_err(), "{tag}");
                for g in 0..p.receivers.len() {
                    let o = p.gen_outcomes(g);
                    assert_eq!(o.len(), 1, "{tag}");
                    if o[0].1.is_ok() {
                        p.check_landed_on(g, 3, 10);
                    }
                }
                // The context rank that wrote into the hole reports it to
                // the ranks it wrote to: none of them completed.
                let hit: Vec<usize> = (0..p.receivers.len())
                    .filter(|&g| p.gen_outcomes(g)[0].1.is_err())
                    .collect();
                assert!(!hit.is_empty(), "{tag}");
                p.assert_quiet();
            }
        }
    }
}

/// Closing a receiver with a request whose context ranks may still write
/// says so (`Unsettled`, caused by `Closed`, then forgotten); one no rank
/// writes any more is simply `Closed`.
#[test]
fn closing_a_receiver_says_which_requests_may_still_be_written() {
    let mut p = Pair::new(state(2, 1), state(1, 1));
    p.prefill(3);
    p.request(0, ID, 3);
    // Context rank 0 delivers its share; rank 1 is still writing.
    p.send(0, ID, 3);
    p.begin(1, ID, 3);
    p.mark(1, ID, 0..1).unwrap();
    p.settle();
    p.request(0, ID + 1, 3);
    p.receivers[0].close();
    p.drain_gen(0);
    let finished: Vec<_> = p
        .gen_events
        .iter()
        .filter_map(|e| match &e.2 {
            ReceiverEvent::Finished {
                request_id,
                outcome,
            } => Some((*request_id, outcome.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(finished.len(), 2);
    match &finished[0] {
        (ID, Err(CacheError::Unsettled { ranks, cause, .. })) => {
            assert_eq!(ranks, &[1]);
            assert!(matches!(**cause, CacheError::Closed));
        }
        other => panic!("{other:?}"),
    }
    // Nobody was asked for the second yet: ranks may still write into it
    // once they get the request info, so it is unsettled as well.
    assert!(matches!(
        finished[1],
        (_, Err(CacheError::Unsettled { .. }))
    ));
    let forgotten = p
        .gen_events
        .iter()
        .filter(|e| matches!(e.2, ReceiverEvent::Forgotten { .. }))
        .count();
    assert_eq!(forgotten, 2);
    assert_eq!(p.receivers[0].open_requests(), 0);
}

/// A small deterministic generator for the fault storm.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Faults drawn from a seed, hundreds of times: layouts, whole or
/// layer-wise requests, lost messages, writes the target refuses, aborts
/// that come too late, a cancel by either side, a context rank that dies
/// (and leaves the store a while later) or a generation rank that dies, at
/// a drawn step. After each run: nothing landed in a generation rank after
/// it reported an outcome other than `Unsettled` (checked on every write);
/// every live rank reported exactly one outcome, within its bounds; a
/// generation rank that reported its request complete holds exactly the
/// source's cache; and where every rank lived, the machines are idle and
/// the next request completes.
#[test]
fn a_seeded_fault_storm_fails_closed() {
    let layouts = [
        ((1, 1), (1, 1)),
        ((2, 1), (1, 1)),
        ((1, 1), (2, 1)),
        ((2, 2), (1, 2)),
        ((1, 2), (2, 1)),
    ];
    // Generation outcomes seen: completed, failed, unsettled.
    let mut seen = [0u32; 3];
    for seed in 0..400u64 {
        let mut rng = Lcg(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed);
        let ((ct, cp), (gt, gp)) = layouts[rng.below(layouts.len() as u64) as usize];
        let mut p = Pair::new(state(ct, cp), state(gt, gp));
        let (nc, ng) = (p.senders.len(), p.receivers.len());
        p.late_aborts = rng.chance(30);
        for c in 0..nc {
            if rng.chance(20) {
                let k = rng.below(12) as usize;
                p.refused[c].insert(k);
            }
        }
        let loss = if rng.chance(30) { rng.below(10) } else { 0 };
        let mut lose_rng = Lcg(seed ^ 0x1055);
        p.lose = Box::new(move |_, _, _| lose_rng.chance(loss));
        let layerwise = rng.chance(50);
        let tag = format!(
            "seed {seed}: TP{ct}/PP{cp} -> TP{gt}/PP{gp}, layer-wise {layerwise}, loss {loss}%, late aborts {}, refused {:?}",
            p.late_aborts, p.refused
        );
        p.prefill(3);
        for g in 0..ng {
            p.request(g, ID, 3);
        }
        for c in 0..nc {
            if layerwise {
                p.begin(c, ID, 3);
            } else {
                p.send(c, ID, 3);
            }
        }
        let steps = rng.below(40);
        for _ in 0..steps {
            if !p.step() {
                break;
            }
        }
        if layerwise {
            for c in 0..nc {
                let held = p.senders[c].held_layers();
                let _ = p.mark(c, ID, held);
            }
        }
        let (mut dead_ctx, mut dead_gen) = (None, None);
        match rng.below(6) {
            0 => {
                let c = rng.below(nc as u64) as usize;
                let _ = p.cancel_ctx(c, ID);
            }
            1 => {
                let g = rng.below(ng as u64) as usize;
                let _ = p.cancel_gen(g, ID);
            }
            2 => {
                let c = rng.below(nc as u64) as usize;
                p.ctx[c].dead = true;
                dead_ctx = Some(c);
            }
            3 => {
                let g = rng.below(ng as u64) as usize;
                p.gen_nodes[g].dead = true;
                dead_gen = Some(g);
            }
            _ => {}
        }
        // A dead context rank leaves the store a while later.
        if let Some(c) = dead_ctx {
            for _ in 0..rng.below(20) {
                if !p.step() {
                    break;
                }
            }
            let who = name(Side::Ctx, c);
            for g in 0..ng {
                let e = crate::Error::PeerGone {
                    remote: who.clone(),
                };
                p.receivers[g].handle_peer_gone(&who, e, p.now);
                p.drain_gen(g);
            }
        }
        p.run();
        let bound = TIMEOUT + SETTLE + 8 * LATENCY;
        for c in (0..nc).filter(|&c| Some(c) != dead_ctx) {
            let o = p.ctx_outcomes(c);
            assert_eq!(o.len(), 1, "{tag}: context rank {c}");
            assert!(p.elapsed(o[0].0) <= bound, "{tag}: context rank {c} late");
        }
        for g in (0..ng).filter(|&g| Some(g) != dead_gen) {
            let o = p.gen_outcomes(g);
            assert_eq!(o.len(), 1, "{tag}: generation rank {g}");
            assert!(
                p.elapsed(o[0].0) <= bound,
                "{tag}: generation rank {g} late"
            );
            match &o[0].1 {
                Ok(_) => {
                    seen[0] += 1;
                    p.check_landed_on(g, 3, 10);
                }
                Err(CacheError::Unsettled { .. }) => seen[2] += 1,
                Err(_) => seen[1] += 1,
            }
        }
        if dead_ctx.is_some() || dead_gen.is_some() {
            continue;
        }
        // Every rank lived: all idle, and the next request completes.
        p.assert_quiet();
        p.lose = Box::new(|_, _, _| false);
        p.late_aborts = false;
        for r in &mut p.refused {
            r.clear();
        }
        let next = ID + 1;
        for g in 0..ng {
            p.request(g, next, 3);
        }
        for c in 0..nc {
            p.send(c, next, 3);
        }
        p.run();
        for g in 0..ng {
            assert!(p.gen_outcomes(g)[1].1.is_ok(), "{tag}: the next request");
        }
        p.check_landed(3, 10);
        p.assert_quiet();
    }
    // The storm reached every kind of outcome.
    assert!(seen.iter().all(|&n| n >= 10), "{seen:?}");
}
