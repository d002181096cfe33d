//! The KV-cache protocol end to end: every rank of both executors is its
//! own agent (threads of this process), on the backend `KVXFER_TEST_BACKEND`
//! names (default tcp). Every element of every received block is checked
//! against the deterministic pattern.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::cache::pattern::{check_block, fill_block};
use kvxfer::cache::{
    Attention, CacheError, CacheReceiver, CacheSender, CacheState, DataType, MemBlockLookup,
    RankSlice, ReceiverConfig, RecvRequest, SenderConfig, distinct_heads, rank_slice,
};
use kvxfer::{AgentConfig, MemoryDescs, TransferAgent};

const WAIT: Duration = Duration::from_secs(60);

/// One rank: its agent and its block pool (registered).
struct Rank {
    agent: Arc<dyn TransferAgent>,
    slice: RankSlice,
    pool: Vec<u8>,
}

impl Rank {
    fn new(name: String, slice: RankSlice, blocks: u32) -> Self {
        let agent: Arc<dyn TransferAgent> =
            Arc::from(common::local_agent(&name, |c: AgentConfig| {
                c.with_streams_per_peer(1)
            }));
        let pool = vec![0u8; (slice.block_bytes() * u64::from(blocks)) as usize];
        // SAFETY: the pool outlives the agent's use of it: `Rank` drops the
        // agent handle first, and the senders/receivers holding clones are
        // dropped before the ranks in every test.
        unsafe { agent.register_memory(&MemoryDescs::dram(&pool)).unwrap() };
        Self { agent, slice, pool }
    }

    fn block_addr(&self, b: u32) -> u64 {
        self.pool.as_ptr() as u64 + u64::from(b) * self.slice.block_bytes()
    }

    fn block_mut(&mut self, b: u32) -> &mut [u8] {
        let bb = self.slice.block_bytes() as usize;
        &mut self.pool[b as usize * bb..(b as usize + 1) * bb]
    }

    fn block(&self, b: u32) -> &[u8] {
        let bb = self.slice.block_bytes() as usize;
        &self.pool[b as usize * bb..(b as usize + 1) * bb]
    }
}

struct Cluster {
    ctx_state: CacheState,
    gen_state: CacheState,
    // Declared first: dropped (threads joined) before the ranks' pools.
    senders: Vec<CacheSender>,
    receivers: Vec<CacheReceiver>,
    lookups: Vec<Arc<MemBlockLookup>>,
    ctx: Vec<Rank>,
    gen_ranks: Vec<Rank>,
    pool_blocks: u32,
    /// Attention DP on the context side: only this rank sends.
    send_only: Option<u32>,
    /// Layer-wise: the context ranks `begin`, then mark one layer ready at
    /// a time (last first), each waited for on the generation side before
    /// the next is marked.
    layerwise: bool,
}

fn cluster(
    tag: &str,
    ctx_state: &CacheState,
    gen_state: &CacheState,
    pool_blocks: u32,
    sc: SenderConfig,
    rc: ReceiverConfig,
) -> Cluster {
    let d = distinct_heads(ctx_state, gen_state);
    let ctx: Vec<Rank> = (0..ctx_state.world_size())
        .map(|r| {
            Rank::new(
                format!("{tag}-ctx{r}"),
                rank_slice(ctx_state, r, d),
                pool_blocks,
            )
        })
        .collect();
    let gen_ranks: Vec<Rank> = (0..gen_state.world_size())
        .map(|r| {
            Rank::new(
                format!("{tag}-gen{r}"),
                rank_slice(gen_state, r, d),
                pool_blocks,
            )
        })
        .collect();
    let lookups: Vec<Arc<MemBlockLookup>> = ctx
        .iter()
        .map(|_| Arc::new(MemBlockLookup::new()))
        .collect();
    let senders = ctx
        .iter()
        .enumerate()
        .map(|(r, k)| {
            let l: Arc<dyn kvxfer::cache::BlockLookup> = lookups[r].clone();
            CacheSender::new(
                Arc::clone(&k.agent),
                ctx_state.clone(),
                r as u32,
                Some(l),
                sc.clone(),
            )
            .unwrap()
        })
        .collect();
    let conns: Vec<String> = ctx
        .iter()
        .map(|k| k.agent.local_connection_info())
        .collect();
    let receivers = gen_ranks
        .iter()
        .enumerate()
        .map(|(r, k)| {
            CacheReceiver::new(
                Arc::clone(&k.agent),
                gen_state.clone(),
                r as u32,
                ctx_state.clone(),
                &conns,
                rc.clone(),
            )
            .unwrap()
        })
        .collect();
    Cluster {
        ctx_state: ctx_state.clone(),
        gen_state: gen_state.clone(),
        senders,
        receivers,
        lookups,
        ctx,
        gen_ranks,
        pool_blocks,
        send_only: None,
        layerwise: false,
    }
}

/// Block keys of request `id`: one per logical block.
fn key(id: u64, block: u32) -> u64 {
    id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ u64::from(block)
}

impl Cluster {
    /// The context blocks of a request: scattered over the pool.
    fn ctx_blocks(&self, n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| (i * 3 + salt) % self.pool_blocks).collect()
    }

    /// Fills the context side's blocks for request `id` and records them in
    /// the block lookups.
    fn prefill(&mut self, id: u64, ids: &[u32]) {
        let keys: Vec<u64> = (0..ids.len() as u32).map(|b| key(id, b)).collect();
        for (r, k) in self.ctx.iter_mut().enumerate() {
            let slice = k.slice;
            for (lb, &b) in ids.iter().enumerate() {
                fill_block(&self.ctx_state, &slice, k.block_mut(b), lb as u32);
            }
            let addrs: Vec<u64> = ids.iter().map(|&b| k.block_addr(b)).collect();
            self.lookups[r].insert_sequence(&keys, &addrs);
        }
    }

    /// Runs one request end to end: `gen_ids` are the destination blocks
    /// of the request's last `gen_ids.len()` blocks; `gen_filter` picks the
    /// generation ranks taking part (attention DP: one group).
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        id: u64,
        tokens: u32,
        ctx_ids: &[u32],
        gen_ids: &[u32],
        by_key: Option<u64>,
        ctx_dp_rank: u32,
        gen_filter: impl Fn(u32) -> bool,
    ) -> Vec<kvxfer::cache::SessionStats> {
        let n = ctx_ids.len() as u32;
        let first = n - gen_ids.len() as u32;
        let mut recv = Vec::new();
        for (g, r) in self.receivers.iter().enumerate() {
            if !gen_filter(g as u32) {
                continue;
            }
            let blocks = gen_ids
                .iter()
                .map(|&b| self.gen_ranks[g].block_addr(b))
                .collect();
            recv.push(
                r.request(RecvRequest {
                    request_id: id,
                    ctx_dp_rank,
                    blocks,
                    last_block_key: by_key.map(|seq| key(seq, n - 1)),
                })
                .unwrap(),
            );
        }
        let mut send = Vec::new();
        let mut sending = Vec::new();
        for (c, s) in self.senders.iter().enumerate() {
            if self.send_only.is_some_and(|o| o != c as u32) {
                continue;
            }
            let blocks = ctx_ids.iter().map(|&b| self.ctx[c].block_addr(b)).collect();
            send.push(if self.layerwise {
                s.begin(id, blocks).unwrap()
            } else {
                s.send(id, blocks).unwrap()
            });
            sending.push(s);
        }
        if self.layerwise {
            let gen_layers: Vec<_> = (0..self.gen_state.world_size())
                .filter(|&g| gen_filter(g))
                .map(|g| self.gen_state.layer_range(self.gen_state.coords(g).1))
                .collect();
            for l in (0..self.ctx_state.num_layers()).rev() {
                for s in &sending {
                    if s.held_layers().contains(&l) {
                        s.layers_ready(id, l..l + 1).unwrap();
                    }
                }
                // The layer lands before the next one is ready: streamed.
                for (h, held) in recv.iter().zip(&gen_layers) {
                    if held.contains(&l) {
                        h.wait_layers(l..l + 1, WAIT).unwrap();
                        assert!(
                            !h.is_done() || l == held.start,
                            "{id}: done before layer {l}"
                        );
                    }
                }
            }
        }
        let mut stats = Vec::new();
        for h in send {
            stats.push(h.wait(WAIT).unwrap());
        }
        let mut rstats = Vec::new();
        for (g, h) in recv.into_iter().enumerate() {
            rstats.push(h.wait(WAIT).unwrap());
            // Every layer reported landed once, the last with the outcome.
            let mut seen: Vec<u32> = h.layers_landed().into_iter().flat_map(|(r, _)| r).collect();
            seen.sort_unstable();
            let held = self
                .gen_state
                .layer_range(self.gen_state.coords(g as u32).1);
            if gen_filter(g as u32) && self.send_only.is_none() {
                assert_eq!(
                    seen,
                    held.collect::<Vec<_>>(),
                    "request {id}, generation rank {g}"
                );
            }
        }
        // The receivers account for what the senders sent: bytes and
        // fragments, each share timed from its `Ready` to its `Done` as
        // they reached the agent, within the request's transmission.
        let total = |v: &[kvxfer::cache::SessionStats],
                     f: fn(&kvxfer::cache::SessionStats) -> u64| {
            v.iter().map(f).sum::<u64>()
        };
        if self.send_only.is_none() {
            assert_eq!(total(&rstats, |s| s.bytes), total(&stats, |s| s.bytes));
            assert_eq!(
                total(&rstats, |s| s.fragments),
                total(&stats, |s| s.fragments)
            );
            assert_eq!(
                total(&rstats, |s| s.fragments_coalesced),
                total(&stats, |s| s.fragments_coalesced)
            );
        }
        for r in &rstats {
            assert!(r.fragments > 0 && r.fragments_coalesced > 0, "{r:?}");
            for p in &r.peers {
                assert!(
                    p.duration > Duration::ZERO && p.duration <= r.transmission,
                    "{r:?}"
                );
            }
        }
        for (g, k) in self.gen_ranks.iter().enumerate() {
            if !gen_filter(g as u32) {
                continue;
            }
            for (i, &b) in gen_ids.iter().enumerate() {
                if let Some(m) = check_block(
                    &self.gen_state,
                    &k.slice,
                    k.block(b),
                    first + i as u32,
                    tokens,
                ) {
                    panic!("request {id}, generation rank {g}: {m}");
                }
            }
        }
        stats
    }
}

fn state(layers: u32, heads: u32, tp: u32, pp: u32, dtype: DataType) -> CacheState {
    CacheState::new(
        layers,
        (heads / tp).max(1),
        8,
        16,
        dtype,
        Attention::Default,
        tp,
        pp,
    )
}

/// Two rounds: every prompt length, then the same prompts again with the
/// generation side reusing all but the last two blocks (found by key).
fn run_case(tag: &str, ctx: &CacheState, gen_s: &CacheState) {
    run_case_as(tag, ctx, gen_s, false);
}

/// As [`run_case`], the whole request at once or layer by layer.
fn run_case_as(tag: &str, ctx: &CacheState, gen_s: &CacheState, layerwise: bool) {
    let mut c = cluster(
        tag,
        ctx,
        gen_s,
        16,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    c.layerwise = layerwise;
    let mut moved = 0u64;
    for (i, tokens) in [10u32, 30, 60, 80].into_iter().enumerate() {
        let id = (i as u64) << 40 | 0xfff; // ids past 12 bits
        let n = tokens.div_ceil(16);
        let ctx_ids = c.ctx_blocks(n, i as u32);
        c.prefill(id, &ctx_ids);
        let gen_ids: Vec<u32> = (0..n).map(|b| 15 - b).collect();
        let stats = c.transfer(id, tokens, &ctx_ids, &gen_ids, None, 0, |_| true);
        assert!(stats.iter().all(|s| s.staging_copies == 0));
        let bytes: u64 = stats.iter().map(|s| s.bytes).sum();
        assert!(bytes > 0, "{tag}: nothing moved");
        moved += bytes;
        // Second round: prefix reused, the last two blocks move.
        let keep = n.saturating_sub(2);
        let gen2: Vec<u32> = (keep..n).map(|b| b - keep).collect();
        let stats = c.transfer(id + 1, tokens, &ctx_ids, &gen2, Some(id), 0, |_| true);
        moved += stats.iter().map(|s| s.bytes).sum::<u64>();
    }
    let m: Vec<_> = c.senders.iter().map(|s| s.metrics()).collect();
    assert!(
        m.iter()
            .all(|m| m.completed == 8 && m.staging_copies == 0 && m.failed == 0)
    );
    assert_eq!(m.iter().map(|m| m.bytes).sum::<u64>(), moved);
    let r: Vec<_> = c.receivers.iter().map(|r| r.metrics()).collect();
    assert!(r.iter().all(|m| m.completed == 8));
}

#[test]
fn tp_pp_matrix() {
    let layouts = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)];
    let dtypes = [DataType::F32, DataType::Bf16, DataType::I8];
    let mut k = 0;
    for &(ct, cp) in &layouts {
        for &(gt, gp) in &layouts {
            let dt = dtypes[k % 3];
            k += 1;
            run_case(
                &format!("m{ct}{cp}{gt}{gp}"),
                &state(4, 4, ct, cp, dt),
                &state(4, 4, gt, gp, dt),
            );
        }
    }
    // The larger layouts, each on both sides at least once.
    for ((ct, cp), (gt, gp)) in [
        ((4, 2), (2, 4)),
        ((2, 4), (4, 2)),
        ((4, 4), (1, 1)),
        ((1, 1), (4, 4)),
    ] {
        run_case(
            &format!("m{ct}{cp}{gt}{gp}"),
            &state(4, 4, ct, cp, DataType::Bf16),
            &state(4, 4, gt, gp, DataType::Bf16),
        );
    }
}

/// Context-side attention DP (each context rank its own group): request i
/// is served by context group i % 2 alone; every generation rank asks it.
#[test]
fn context_attention_dp_routing() {
    let dp = |d: u32| {
        CacheState::new(4, 4, 8, 16, DataType::F32, Attention::Default, 2, 1)
            .with_attention_dp(d, 2)
    };
    let gen_s = state(4, 4, 2, 1, DataType::F32);
    let mut c = cluster(
        "cdp",
        &dp(0),
        &gen_s,
        8,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    // Each context rank's sender knows its own group.
    let l: Arc<dyn kvxfer::cache::BlockLookup> = c.lookups[1].clone();
    c.senders[1] = CacheSender::new(
        Arc::clone(&c.ctx[1].agent),
        dp(1),
        1,
        Some(l),
        SenderConfig::default(),
    )
    .unwrap();
    for i in 0..4u64 {
        let group = (i % 2) as u32;
        let ids = c.ctx_blocks(3, i as u32);
        c.prefill(100 + i, &ids);
        c.send_only = Some(group);
        c.transfer(100 + i, 40, &ids, &[5, 6, 7], None, group, |_| true);
    }
    assert_eq!(c.senders[0].metrics().completed, 2);
    assert_eq!(c.senders[1].metrics().completed, 2);
}

#[test]
fn uneven_pp_and_duplicate_heads() {
    run_case(
        "uneven",
        &state(10, 4, 1, 4, DataType::F32),
        &state(10, 4, 2, 2, DataType::F32),
    );
    // 2 KV heads over TP4: each head on two context ranks, one sends.
    let dup = CacheState::new(4, 1, 8, 16, DataType::Bf16, Attention::Default, 4, 1);
    run_case("dup-a", &dup, &state(4, 2, 1, 2, DataType::Bf16));
    run_case("dup-b", &state(4, 2, 2, 1, DataType::Bf16), &dup);
}

/// Layer by layer, each layer landing before the next is ready:
/// heterogeneous TP/PP, uneven PP, duplicate heads, MLA, prefix reuse.
#[test]
fn layer_wise_streaming_across_layouts() {
    let f = DataType::F32;
    run_case_as("lw-a", &state(4, 4, 2, 1, f), &state(4, 4, 1, 2, f), true);
    run_case_as("lw-b", &state(4, 4, 1, 2, f), &state(4, 4, 2, 2, f), true);
    run_case_as(
        "lw-uneven",
        &state(10, 4, 1, 4, f),
        &state(10, 4, 2, 2, f),
        true,
    );
    let dup = CacheState::new(4, 1, 8, 16, DataType::Bf16, Attention::Default, 4, 1);
    run_case_as("lw-dup", &dup, &state(4, 2, 1, 2, DataType::Bf16), true);
    run_case_as("lw-mla", &mla(4, 1), &mla(1, 2), true);
}

fn mla(tp: u32, pp: u32) -> CacheState {
    CacheState::new(
        6,
        1,
        32,
        16,
        DataType::Bf16,
        Attention::Mla { kv_factor: 1 },
        tp,
        pp,
    )
}

#[test]
fn mla_and_attention_dp() {
    run_case("mla-a", &mla(4, 1), &mla(1, 2));
    run_case("mla-b", &mla(2, 2), &mla(4, 1));
    // Generation with attention DP (each rank its own group): request i
    // goes to group i % 2 only.
    let ctx = mla(2, 1);
    let gen0 = mla(2, 1).with_attention_dp(0, 2);
    let mut c = cluster(
        "dp",
        &ctx,
        &gen0,
        8,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    // Each generation rank's receiver must know its own DP rank.
    c.receivers.clear();
    let conns: Vec<String> = c
        .ctx
        .iter()
        .map(|k| k.agent.local_connection_info())
        .collect();
    for g in 0..2u32 {
        let st = mla(2, 1).with_attention_dp(g, 2);
        c.receivers.push(
            CacheReceiver::new(
                Arc::clone(&c.gen_ranks[g as usize].agent),
                st,
                g,
                ctx.clone(),
                &conns,
                ReceiverConfig::default(),
            )
            .unwrap(),
        );
    }
    for i in 0..4u64 {
        let ids = c.ctx_blocks(2, i as u32);
        c.prefill(i, &ids);
        let group = (i % 2) as u32;
        c.transfer(i, 30, &ids, &[4, 5], None, 0, |g| g == group);
    }
}

/// A context rank that cannot find the request's blocks (a lookup miss)
/// fails the request, and both sides count it as failed, not cancelled;
/// the generation side's error names a rank that sends.
#[test]
fn a_block_lookup_miss_fails_on_both_sides() {
    let s = state(2, 2, 1, 1, DataType::F32);
    let mut c = cluster(
        "miss",
        &s,
        &s,
        4,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    c.prefill(1, &[0, 1]);
    let h = c.receivers[0]
        .request(RecvRequest {
            request_id: 9,
            ctx_dp_rank: 0,
            blocks: vec![c.gen_ranks[0].block_addr(0)],
            // A sequence never prefilled: no block has this key.
            last_block_key: Some(key(77, 0)),
        })
        .unwrap();
    let sent = c.senders[0].send(9, vec![c.ctx[0].block_addr(0)]).unwrap();
    let err = sent.wait(WAIT).unwrap_err();
    assert!(matches!(err, CacheError::UnknownBlockKey(_)), "{err}");
    let err = h.wait(WAIT).unwrap_err();
    assert!(
        matches!(&err, CacheError::Cancelled { request_id: 9, reason } if reason.contains("block")),
        "{err}"
    );
    let (sm, rm) = (c.senders[0].metrics(), c.receivers[0].metrics());
    assert_eq!((sm.failed, sm.cancelled), (1, 0), "{sm:?}");
    assert_eq!((rm.failed, rm.cancelled), (1, 0), "{rm:?}");
}

#[test]
fn cancel_before_ready_reaches_the_receiver() {
    let s = state(2, 2, 1, 1, DataType::F32);
    let c = cluster(
        "cb",
        &s,
        &s,
        4,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    let h = c.receivers[0]
        .request(RecvRequest {
            request_id: 5,
            ctx_dp_rank: 0,
            blocks: vec![c.gen_ranks[0].block_addr(0)],
            last_block_key: None,
        })
        .unwrap();
    // The context side never had it ready: wait until its request info
    // arrived, then cancel.
    let deadline = Instant::now() + WAIT;
    loop {
        match c.senders[0].cancel(5) {
            Ok(()) => break,
            Err(CacheError::UnknownRequest(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("{e}"),
        }
    }
    let err = h.wait(WAIT).unwrap_err();
    assert!(
        matches!(err, CacheError::Cancelled { request_id: 5, .. }),
        "{err}"
    );
}

/// A large request cancelled in flight, from either side: cancel returns
/// only when nothing more can land, so the destination pool stays as it
/// is afterwards.
#[test]
fn cancel_in_flight_from_either_side() {
    for side in ["context", "generation"] {
        let s = CacheState::new(8, 8, 128, 64, DataType::F32, Attention::Default, 1, 1);
        let sc = SenderConfig {
            batch_bytes: 64 << 10,
            batches_in_flight: 1,
            ..Default::default()
        };
        let mut c = cluster(
            &format!("ci-{side}"),
            &s,
            &s,
            32,
            sc,
            ReceiverConfig::default(),
        );
        let ids: Vec<u32> = (0..32).collect();
        c.prefill(9, &ids);
        let gen_addrs: Vec<u64> = ids.iter().map(|&b| c.gen_ranks[0].block_addr(b)).collect();
        let h = c.receivers[0]
            .request(RecvRequest {
                request_id: 9,
                ctx_dp_rank: 0,
                blocks: gen_addrs,
                last_block_key: None,
            })
            .unwrap();
        let ctx_addrs: Vec<u64> = ids.iter().map(|&b| c.ctx[0].block_addr(b)).collect();
        let sh = c.senders[0].send(9, ctx_addrs).unwrap();
        // Let some of it move, then cancel.
        let deadline = Instant::now() + WAIT;
        while c.gen_ranks[0].pool[..64].iter().all(|&b| b == 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        match side {
            "context" => c.senders[0].cancel(9).unwrap(),
            _ => c.receivers[0].cancel(9).unwrap(),
        }
        let snapshot = c.gen_ranks[0].pool.clone();
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            c.gen_ranks[0].pool == snapshot,
            "{side}: the pool changed after cancel returned"
        );
        let complete = check_block(
            &s,
            &c.gen_ranks[0].slice,
            c.gen_ranks[0].block(31),
            31,
            32 * 64,
        )
        .is_none();
        assert!(
            !complete,
            "{side}: the transfer finished before the cancel (make it larger)"
        );
        let err = h.wait(WAIT).unwrap_err();
        assert!(matches!(err, CacheError::Cancelled { .. }), "{err}");
        if side == "generation" {
            // Its own cancel, not a context rank's answer to it.
            assert!(
                err.to_string().contains("cancelled by the generation side"),
                "{err}"
            );
        }
        assert!(matches!(sh.wait(WAIT), Err(CacheError::Cancelled { .. })));
        // A cancel is counted as one on both sides, whoever asked.
        let (sm, rm) = (c.senders[0].metrics(), c.receivers[0].metrics());
        assert_eq!((sm.cancelled, sm.failed), (1, 0), "{side}: {sm:?}");
        assert_eq!((rm.cancelled, rm.failed), (1, 0), "{side}: {rm:?}");
    }
}

#[test]
fn missing_counterpart_times_out_and_dead_peer_is_survived() {
    let ctx = state(2, 2, 1, 1, DataType::F32);
    let gen_s = state(2, 2, 2, 1, DataType::F32);
    let short = Duration::from_millis(500);
    let mut c = cluster(
        "to",
        &ctx,
        &gen_s,
        4,
        SenderConfig {
            timeout: short,
            ..Default::default()
        },
        ReceiverConfig {
            timeout: 4 * short,
            ..Default::default()
        },
    );
    c.prefill(1, &[0]);
    // Only generation rank 0 asks; rank 1 never does.
    let h = c.receivers[0]
        .request(RecvRequest {
            request_id: 1,
            ctx_dp_rank: 0,
            blocks: vec![c.gen_ranks[0].block_addr(0)],
            last_block_key: None,
        })
        .unwrap();
    let sh = c.senders[0].send(1, vec![c.ctx[0].block_addr(0)]).unwrap();
    let e = sh.wait(WAIT).unwrap_err();
    assert!(matches!(e, CacheError::Timeout { .. }), "{e}");
    let e = h.wait(WAIT).unwrap_err();
    assert!(matches!(e, CacheError::Cancelled { .. }), "{e}");
    // The context rank dies: a request to it times out, and dropping the
    // receiver still returns promptly.
    c.senders.clear();
    drop(c.lookups.drain(..));
    let dead = c.ctx.remove(0);
    drop(dead.agent);
    let h = c.receivers[1].request(RecvRequest {
        request_id: 2,
        ctx_dp_rank: 0,
        blocks: vec![c.gen_ranks[1].block_addr(0)],
        last_block_key: None,
    });
    // Whether the request info reached the dying agent is a race: the
    // notify fails at once (the link saw the close), or it was written into
    // a socket the peer was closing. Then the rank is asked, never answers
    // and never confirms that it stopped: the request times out, and since
    // nothing proves the rank stopped writing, it ends `Unsettled` (caused
    // by the timeout) after the settle timeout, which is the fail-closed
    // answer.
    if let Ok(h) = h {
        let e = h.wait(WAIT).unwrap_err();
        match &e {
            CacheError::Timeout { .. } => {}
            CacheError::Unsettled { ranks, cause, .. } => {
                assert_eq!(ranks, &[0], "{e}");
                assert!(matches!(**cause, CacheError::Timeout { .. }), "{e}");
            }
            _ => panic!("request 2 to a dead rank: {e}"),
        }
    }
    let t = Instant::now();
    c.receivers.clear();
    assert!(t.elapsed() < Duration::from_secs(5));
}

/// A peer that sent the first part of a KV message of several and whose
/// connection then ended: its partial message goes at once (counted), not
/// at the reassembler's expiry ten seconds on.
#[test]
fn a_partial_message_goes_when_its_connection_ends() {
    if common::expected_transport() == "inproc" {
        println!(
            "SKIPPED: agents of one process reach each other without a connection (the same test runs on tcp, shm, fabric and rdma)"
        );
        return;
    }
    let st = state(2, 2, 1, 1, DataType::F32);
    let c = cluster(
        "pd",
        &st,
        &st,
        1,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    let stranger = common::local_agent("pd-stranger", |c| c);
    let gen_name = stranger
        .load_remote_agent_by_connection(&c.gen_ranks[0].agent.local_connection_info())
        .unwrap();
    let chunks = kvxfer::cache::wire::Msg::Cancelled {
        request_id: 7,
        reason: "x".repeat(3 * kvxfer::cache::wire::CHUNK_MAX),
        failure: true,
        integrity: false,
    }
    .encode();
    assert!(chunks.len() > 1);
    let st0 = stranger
        .notify_sync_message(&gen_name, chunks[0].clone())
        .unwrap();
    st0.wait(WAIT).unwrap();
    assert_eq!(c.receivers[0].metrics().partials_dropped, 0);
    let t = Instant::now();
    drop(stranger);
    while c.receivers[0].metrics().partials_dropped == 0 {
        assert!(
            t.elapsed() < kvxfer::cache::wire::PARTIAL_TTL / 2,
            "the partial message was not dropped when its connection ended"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(c.receivers[0].metrics().partials_dropped, 1);
}

#[test]
fn mismatched_cache_state_is_a_typed_error() {
    let a = state(4, 4, 1, 1, DataType::F32);
    let b = state(4, 4, 1, 1, DataType::Bf16);
    // The receiver checks what it believes of the context side.
    let k = Rank::new("mm-gen".into(), rank_slice(&b, 0, 4), 1);
    let e = CacheReceiver::new(
        k.agent.clone(),
        b.clone(),
        0,
        a.clone(),
        &[String::new()],
        ReceiverConfig::default(),
    )
    .err()
    .unwrap();
    assert!(
        matches!(e, CacheError::Incompatible { field: "dtype", .. }),
        "{e}"
    );
    // A receiver wrong about the context side is refused by the sender.
    let mut c = cluster(
        "mm",
        &a,
        &a,
        2,
        SenderConfig::default(),
        ReceiverConfig::default(),
    );
    let conns: Vec<String> = c
        .ctx
        .iter()
        .map(|k| k.agent.local_connection_info())
        .collect();
    let liar = CacheReceiver::new(
        k.agent.clone(),
        b.clone(),
        0,
        b.clone(),
        &conns,
        ReceiverConfig::default(),
    )
    .unwrap();
    let h = liar
        .request(RecvRequest {
            request_id: 3,
            ctx_dp_rank: 0,
            blocks: vec![k.block_addr(0)],
            last_block_key: None,
        })
        .unwrap();
    match h.wait(WAIT) {
        Err(CacheError::Cancelled { reason, .. }) => assert!(reason.contains("dtype"), "{reason}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(liar);
    c.receivers.clear();
}

/// The context rank of `context_rank_in_another_process`, when this binary
/// is re-executed with `KVXFER_CACHE_PEER=1`: prints its connection info,
/// then for each `send <id> <blocks>` line on stdin fills that many blocks
/// and sends them, answering `OK <bytes>` or `ERR <error>`.
fn cache_peer_main(s: &CacheState) -> ! {
    use std::io::{BufRead, Write};
    let mut k = Rank::new(
        "proc-ctx0".into(),
        rank_slice(s, 0, distinct_heads(s, s)),
        8,
    );
    let sender = CacheSender::new(
        Arc::clone(&k.agent),
        s.clone(),
        0,
        None,
        SenderConfig::default(),
    )
    .unwrap();
    println!("READY {}", k.agent.local_connection_info());
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        let (id, n): (u64, u32) = (w[1].parse().unwrap(), w[2].parse().unwrap());
        let slice = k.slice;
        for b in 0..n {
            fill_block(s, &slice, k.block_mut(b), b);
        }
        let addrs = (0..n).map(|b| k.block_addr(b)).collect();
        match sender.send_blocking(id, addrs, WAIT) {
            Ok(st) => println!("OK {}", st.bytes),
            Err(e) => println!("ERR {e}"),
        }
        std::io::stdout().flush().unwrap();
    }
    drop(sender);
    std::process::exit(0)
}

#[test]
fn context_rank_in_another_process() {
    use std::io::{BufRead, BufReader, Write};
    if common::backend() == kvxfer::Backend::InProcess {
        println!(
            "SKIPPED context_rank_in_another_process: the inproc backend reaches agents of this \
             process only (the test runs on tcp, shm, auto and, in the soft-RoCE guest, rdma)"
        );
        return;
    }
    let s = state(4, 4, 1, 1, DataType::Bf16);
    if std::env::var_os("KVXFER_CACHE_PEER").is_some() {
        cache_peer_main(&s);
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "context_rank_in_another_process", "--nocapture"])
        .env("KVXFER_CACHE_PEER", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let mut line = String::new();
    let conn = loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "peer exited");
        if let Some(c) = line.trim().strip_prefix("READY ") {
            break c.to_owned();
        }
    };
    let mut g = Rank::new(
        "proc-gen0".into(),
        rank_slice(&s, 0, distinct_heads(&s, &s)),
        8,
    );
    let recv = CacheReceiver::new(
        Arc::clone(&g.agent),
        s.clone(),
        0,
        s.clone(),
        &[conn],
        ReceiverConfig::default(),
    )
    .unwrap();
    for (id, tokens) in [(1u64 << 33, 30u32), (7, 80)] {
        let n = tokens.div_ceil(16);
        g.pool.iter_mut().for_each(|b| *b = 0);
        let blocks = (0..n).map(|b| g.block_addr(7 - b)).collect();
        let h = recv
            .request(RecvRequest {
                request_id: id,
                ctx_dp_rank: 0,
                blocks,
                last_block_key: None,
            })
            .unwrap();
        writeln!(stdin, "send {id} {n}").unwrap();
        line.clear();
        out.read_line(&mut line).unwrap();
        assert!(line.starts_with("OK "), "{line}");
        let st = h.wait(WAIT).unwrap();
        assert_eq!(line.trim(), format!("OK {}", st.bytes));
        for b in 0..n {
            if let Some(m) = check_block(&s, &g.slice, g.block(7 - b), b, tokens) {
                panic!("request {id}: {m}");
            }
        }
    }
    drop(stdin);
    assert!(child.wait().unwrap().success());
    drop(recv);
}

/// Cancelled between layer groups, from either side: both sides end the
/// request as cancelled, the layers not yet ready are never written (the
/// destination keeps them as they were), and marking them afterwards is a
/// no-op.
#[test]
fn cancel_between_layer_groups_from_either_side() {
    for side in ["context", "generation"] {
        // TP2 -> TP1: the other context rank is told through the receiver.
        let ctx_s = state(4, 4, 2, 1, DataType::F32);
        let gen_s = state(4, 4, 1, 1, DataType::F32);
        let mut c = cluster(
            &format!("cl-{side}"),
            &ctx_s,
            &gen_s,
            4,
            SenderConfig::default(),
            ReceiverConfig::default(),
        );
        let ids: Vec<u32> = (0..4).collect();
        c.prefill(3, &ids);
        let h = c.receivers[0]
            .request(RecvRequest {
                request_id: 3,
                ctx_dp_rank: 0,
                blocks: ids.iter().map(|&b| c.gen_ranks[0].block_addr(b)).collect(),
                last_block_key: None,
            })
            .unwrap();
        let sends: Vec<_> = (0..2)
            .map(|r| {
                let blocks = ids.iter().map(|&b| c.ctx[r].block_addr(b)).collect();
                c.senders[r].begin(3, blocks).unwrap()
            })
            .collect();
        for s in &c.senders {
            s.layers_ready(3, 0..2).unwrap();
        }
        h.wait_layers(0..2, WAIT).unwrap();
        for bad in [0..5, 2..2] {
            assert!(matches!(
                h.wait_layers(bad, WAIT),
                Err(CacheError::LayersOutOfRange { .. })
            ));
        }
        match side {
            "context" => c.senders[0].cancel(3).unwrap(),
            _ => c.receivers[0].cancel(3).unwrap(),
        }
        for s in &sends {
            let e = s.wait(WAIT).unwrap_err();
            assert!(matches!(e, CacheError::Cancelled { .. }), "{side}: {e}");
        }
        let e = h.wait(WAIT).unwrap_err();
        assert!(matches!(e, CacheError::Cancelled { .. }), "{side}: {e}");
        // Every rank has ended it: a mark or a second cancel is a no-op.
        for s in &c.senders {
            s.layers_ready(3, 2..4).unwrap();
            s.cancel(3).unwrap();
        }
        // Layers 2 and 3 were never written: the destination holds zeros
        // there (a layer is 4 heads x 16 tokens x 8 dims x 4 bytes x K/V).
        let layer = 2 * 4 * 16 * 8 * 4;
        for &b in &ids {
            let blk = c.gen_ranks[0].block(b);
            assert!(
                blk[2 * layer..].iter().all(|&x| x == 0),
                "{side}: block {b}"
            );
            assert!(
                blk[..2 * layer].iter().any(|&x| x != 0),
                "{side}: block {b}"
            );
        }
    }
}

/// Fail closed: TP2 → TP1, context rank 0 cancels while rank 1 still
/// writes its share. The generation handle reports the cancel only once
/// rank 1 has stopped too, so the generation pool does not change after
/// the handle ended (the blocks could go to the next request at once).
/// Whole requests and layer by layer.
#[test]
fn nothing_lands_after_the_receiver_reports_a_cancel() {
    let ctx_s = CacheState::new(8, 4, 128, 64, DataType::F32, Attention::Default, 2, 1);
    let gen_s = CacheState::new(8, 8, 128, 64, DataType::F32, Attention::Default, 1, 1);
    for layerwise in [false, true] {
        let mut cut = false;
        for round in 0..3 {
            let tag = format!("fc-{}-{round}", u8::from(layerwise));
            // 64 MiB a rank in 1 MiB batches, two in flight: rank 1 is
            // still writing when rank 0's cancel reaches the receiver.
            let sc = SenderConfig {
                batch_bytes: 1 << 20,
                batches_in_flight: 2,
                ..Default::default()
            };
            let mut c = cluster(&tag, &ctx_s, &gen_s, 32, sc, ReceiverConfig::default());
            let ids: Vec<u32> = (0..32).collect();
            c.prefill(4, &ids);
            let h = c.receivers[0]
                .request(RecvRequest {
                    request_id: 4,
                    ctx_dp_rank: 0,
                    blocks: ids.iter().map(|&b| c.gen_ranks[0].block_addr(b)).collect(),
                    last_block_key: None,
                })
                .unwrap();
            let sends: Vec<_> = (0..2)
                .map(|r| {
                    let blocks = ids.iter().map(|&b| c.ctx[r].block_addr(b)).collect();
                    if layerwise {
                        let h = c.senders[r].begin(4, blocks).unwrap();
                        for l in c.senders[r].held_layers() {
                            c.senders[r].layers_ready(4, l..l + 1).unwrap();
                        }
                        h
                    } else {
                        c.senders[r].send(4, blocks).unwrap()
                    }
                })
                .collect();
            // Let some of it move, then rank 0 cancels.
            let deadline = Instant::now() + WAIT;
            while c.gen_ranks[0].pool.iter().step_by(4096).all(|&b| b == 0)
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_micros(200));
            }
            c.senders[0].cancel(4).unwrap();
            let outcome = h.wait(WAIT);
            // A byte every KiB (every write is a run of whole fragments,
            // 128 KiB here): taken in microseconds, so a write that lands
            // just after the outcome shows.
            let sample = |p: &[u8]| p.iter().step_by(1024).copied().collect::<Vec<u8>>();
            let snapshot = sample(&c.gen_ranks[0].pool);
            for s in &sends {
                let _ = s.wait(WAIT);
            }
            std::thread::sleep(Duration::from_millis(300));
            let changed = sample(&c.gen_ranks[0].pool)
                .iter()
                .zip(&snapshot)
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(
                changed, 0,
                "{tag}: {changed} KiB of the generation pool changed after the handle reported {outcome:?}"
            );
            match outcome {
                Err(CacheError::Cancelled { .. }) => {
                    h.wait_settled(Duration::ZERO).unwrap();
                    cut = true;
                    break;
                }
                // Every share landed before the cancel took: try again.
                Ok(_) => continue,
                Err(e) => panic!("{tag}: {e}"),
            }
        }
        assert!(
            cut,
            "layer-wise {layerwise}: every request completed before its cancel"
        );
    }
}

#[test]
fn integrity_checked_requests_land_where_they_can_be_checked() {
    // With `ReceiverConfig::integrity`, the context ranks write with a
    // CRC32C per piece, checked where it lands: host memory on every
    // transport lands whole, whole and layer by layer (GPU pools refuse:
    // `tests/gpu/suite.rs`, `kv_tp2_to_tp1_vram_pools`).
    let ctx = state(4, 8, 2, 1, DataType::Bf16);
    let gen_s = state(4, 8, 1, 1, DataType::Bf16);
    let rc = ReceiverConfig {
        integrity: true,
        ..ReceiverConfig::default()
    };
    let mut c = cluster("integrity", &ctx, &gen_s, 16, SenderConfig::default(), rc);
    let ctx_ids = c.ctx_blocks(4, 1);
    for layerwise in [false, true] {
        c.layerwise = layerwise;
        let id = 21 + u64::from(layerwise);
        c.prefill(id, &ctx_ids);
        c.transfer(id, 60, &ctx_ids, &[3, 0, 2, 1], None, 0, |_| true);
    }
}

#[test]
fn a_damaged_kv_write_fails_the_request_with_integrity() {
    // A proxy in front of the generation rank's listener flips one bit of
    // what the context rank writes. Whatever the bit hits, the request
    // never completes with bad blocks: a payload bit fails it with
    // `CacheError::Integrity` on the generation side (and the transfer's
    // `Integrity` on the context side); a header bit (rare) breaks the
    // connection. Some offset hits a payload.
    if common::backend() != kvxfer::Backend::Tcp {
        println!(
            "SKIPPED: the proxy sits on the TCP path (backend {:?})",
            common::backend()
        );
        return;
    }
    use common::proxy::{Dir, Proxy};
    let ctx_s = state(32, 8, 1, 1, DataType::Bf16);
    let gen_s = ctx_s.clone();
    let d = distinct_heads(&ctx_s, &gen_s);
    let mut seen_integrity = false;
    for (round, at) in [300u64 << 10, 517 << 10, 701 << 10].into_iter().enumerate() {
        let proxy = Proxy::start(Dir::Up, at);
        // The generation rank listens on a port of its own and advertises
        // the proxy's.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let gen_agent: Arc<dyn TransferAgent> = Arc::from(
            kvxfer::make_transfer_agent(
                kvxfer::Backend::Tcp,
                AgentConfig::new(format!("dmg-gen-{round}"))
                    .with_listen(port)
                    .with_advertise(proxy.addr.to_string()),
            )
            .unwrap(),
        );
        proxy.forward_to(port);
        let ctx_agent: Arc<dyn TransferAgent> = Arc::from(
            kvxfer::make_transfer_agent(
                kvxfer::Backend::Tcp,
                AgentConfig::new(format!("dmg-ctx-{round}")).with_streams_per_peer(1),
            )
            .unwrap(),
        );
        let slice = rank_slice(&ctx_s, 0, d);
        let blocks = 8u32;
        let bb = slice.block_bytes() as usize;
        let mut src = vec![0u8; bb * blocks as usize];
        let gen_pool = vec![0u8; bb * blocks as usize];
        for b in 0..blocks as usize {
            fill_block(&ctx_s, &slice, &mut src[b * bb..(b + 1) * bb], b as u32);
        }
        // SAFETY: both pools outlive the agents' use of them (the sender,
        // receiver and agents are dropped at the end of the round first).
        unsafe {
            ctx_agent.register_memory(&MemoryDescs::dram(&src)).unwrap();
            gen_agent
                .register_memory(&MemoryDescs::dram(&gen_pool))
                .unwrap();
        }
        let sender = CacheSender::new(
            Arc::clone(&ctx_agent),
            ctx_s.clone(),
            0,
            None,
            SenderConfig::default(),
        )
        .unwrap();
        let receiver = CacheReceiver::new(
            Arc::clone(&gen_agent),
            gen_s.clone(),
            0,
            ctx_s.clone(),
            &[ctx_agent.local_connection_info()],
            ReceiverConfig {
                integrity: true,
                ..ReceiverConfig::default()
            },
        )
        .unwrap();
        let at_block = |base: &[u8], b: u32| base.as_ptr() as u64 + u64::from(b) * bb as u64;
        let h = receiver
            .request(RecvRequest {
                request_id: 9,
                ctx_dp_rank: 0,
                blocks: (0..blocks).map(|b| at_block(&gen_pool, b)).collect(),
                last_block_key: None,
            })
            .unwrap();
        proxy
            .armed
            .store(true, std::sync::atomic::Ordering::Release);
        let s = sender
            .send(9, (0..blocks).map(|b| at_block(&src, b)).collect())
            .unwrap();
        let recv = h.wait(WAIT);
        let sent = s.wait(WAIT);
        assert_eq!(proxy.flipped.load(std::sync::atomic::Ordering::Relaxed), 1);
        let e = recv.expect_err("a damaged request never completes");
        assert!(sent.is_err(), "the context side failed too");
        if let CacheError::Integrity { request_id, .. } = &e {
            assert_eq!(*request_id, 9);
            assert!(
                matches!(
                    sent,
                    Err(CacheError::Transfer(kvxfer::Error::Integrity { .. }))
                ),
                "{sent:?}"
            );
            seen_integrity = true;
        }
        drop((sender, receiver));
    }
    assert!(seen_integrity, "no flip landed in a payload");
}
