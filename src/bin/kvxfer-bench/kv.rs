//! `kvxfer-bench kv`: one request's KV cache from a context executor to a
//! generation executor, every rank its own agent in this process, against
//! the raw agent bandwidth for the same bytes on the same agents.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args as ClapArgs;
use kvxfer::cache::pattern::{check_block, fill_block};
use kvxfer::cache::{
    Attention, CacheReceiver, CacheSender, CacheState, DataType, RankSlice, ReceiverConfig,
    RecvRequest, SenderConfig, distinct_heads, rank_slice,
};
use kvxfer::{
    AgentConfig, Backend, MemoryDesc, MemoryDescs, MemoryType, TransferAgent, TransferRequest,
    make_transfer_agent,
};

/// Flags of `kvxfer-bench kv`.
#[derive(ClapArgs, Debug, Clone)]
pub struct KvArgs {
    /// Model preset: llama3-8b, llama3-70b, deepseek-v3.
    #[arg(long, default_value = "llama3-8b")]
    model: String,
    /// Context (prefill) tensor parallelism.
    #[arg(long, default_value_t = 2)]
    ctx_tp: u32,
    /// Context pipeline parallelism.
    #[arg(long, default_value_t = 1)]
    ctx_pp: u32,
    /// Generation (decode) tensor parallelism.
    #[arg(long, default_value_t = 1)]
    gen_tp: u32,
    /// Generation pipeline parallelism.
    #[arg(long, default_value_t = 1)]
    gen_pp: u32,
    /// Prompt tokens.
    #[arg(long, default_value_t = 4096)]
    tokens: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    tokens_per_block: u32,
    /// Backend: auto, tcp, shm, rdma.
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Measured requests.
    #[arg(long, default_value_t = 5)]
    iters: u32,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Fill the context pools with the deterministic pattern and check
    /// every received element (slow for large models).
    #[arg(long)]
    verify: bool,
    /// Bytes per posted write batch of a sender (default: the library's).
    #[arg(long, value_parser = crate::parse_size)]
    batch_bytes: Option<u64>,
    /// Write batches in flight per peer (default: the library's).
    #[arg(long)]
    batches_in_flight: Option<usize>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

fn preset(a: &KvArgs, tp: u32, pp: u32) -> Result<CacheState> {
    let (layers, heads, head, attention) = match a.model.as_str() {
        "llama3-8b" => (32, 8, 128, Attention::Default),
        "llama3-70b" => (80, 8, 128, Attention::Default),
        "deepseek-v3" => (61, 1, 576, Attention::Mla { kv_factor: 1 }),
        other => bail!("unknown model {other:?} (llama3-8b, llama3-70b, deepseek-v3)"),
    };
    let per_rank = if attention == Attention::Default {
        (heads / tp).max(1)
    } else {
        1
    };
    let s = CacheState::new(
        layers,
        per_rank,
        head,
        a.tokens_per_block,
        DataType::Bf16,
        attention,
        tp,
        pp,
    );
    s.validate()?;
    Ok(s)
}

struct Rank {
    agent: Arc<dyn TransferAgent>,
    slice: RankSlice,
    pool: Vec<u8>,
}

impl Rank {
    fn new(name: String, backend: Backend, slice: RankSlice, blocks: u32) -> Result<Self> {
        let agent: Arc<dyn TransferAgent> =
            Arc::from(make_transfer_agent(backend, AgentConfig::new(name))?);
        let pool = vec![0x5au8; (slice.block_bytes() * u64::from(blocks)) as usize];
        // SAFETY: the pool lives in `Rank` with the agent; senders and
        // receivers using the agent are dropped before the ranks.
        unsafe { agent.register_memory(&MemoryDescs::dram(&pool))? };
        Ok(Self { agent, slice, pool })
    }

    fn addr(&self, b: u32) -> u64 {
        self.pool.as_ptr() as u64 + u64::from(b) * self.slice.block_bytes()
    }
}

/// Runs the benchmark and prints its result.
pub fn run(a: &KvArgs) -> Result<()> {
    let backend: Backend = a.backend.parse()?;
    let ctx_s = preset(a, a.ctx_tp, a.ctx_pp)?;
    let gen_s = preset(a, a.gen_tp, a.gen_pp)?;
    ctx_s.check_compatible(&gen_s)?;
    let d = distinct_heads(&ctx_s, &gen_s);
    let n = a.tokens.div_ceil(a.tokens_per_block);
    let ctx: Vec<Rank> = (0..ctx_s.world_size())
        .map(|r| Rank::new(format!("kv-ctx{r}"), backend, rank_slice(&ctx_s, r, d), n))
        .collect::<Result<_>>()?;
    let mut gen_ranks: Vec<Rank> = (0..gen_s.world_size())
        .map(|r| Rank::new(format!("kv-gen{r}"), backend, rank_slice(&gen_s, r, d), n))
        .collect::<Result<_>>()?;
    let mut ctx = ctx;
    if a.verify {
        for k in &mut ctx {
            let bb = k.slice.block_bytes() as usize;
            let slice = k.slice;
            for b in 0..n {
                let blk = &mut k.pool[b as usize * bb..(b as usize + 1) * bb];
                fill_block(&ctx_s, &slice, blk, b);
            }
        }
    }
    let mut sc = SenderConfig::default();
    if let Some(b) = a.batch_bytes {
        sc.batch_bytes = b;
    }
    if let Some(n) = a.batches_in_flight {
        sc.batches_in_flight = n;
    }
    let senders: Vec<CacheSender> = ctx
        .iter()
        .enumerate()
        .map(|(r, k)| {
            CacheSender::new(
                Arc::clone(&k.agent),
                ctx_s.clone(),
                r as u32,
                None,
                sc.clone(),
            )
        })
        .collect::<Result<_, _>>()?;
    let conns: Vec<String> = ctx
        .iter()
        .map(|k| k.agent.local_connection_info())
        .collect();
    let receivers: Vec<CacheReceiver> = gen_ranks
        .iter()
        .enumerate()
        .map(|(r, k)| {
            CacheReceiver::new(
                Arc::clone(&k.agent),
                gen_s.clone(),
                r as u32,
                ctx_s.clone(),
                &conns,
                ReceiverConfig::default(),
            )
        })
        .collect::<Result<_, _>>()?;
    let wait = Duration::from_secs(300);
    let (mut kv_time, mut bytes, mut frags, mut coalesced, mut copies) = (0.0, 0, 0, 0, 0);
    for i in 0..a.warmup + a.iters {
        let id = u64::from(i) + 1;
        let t = Instant::now();
        let recv: Vec<_> = receivers
            .iter()
            .enumerate()
            .map(|(g, r)| {
                r.request(RecvRequest {
                    request_id: id,
                    ctx_dp_rank: 0,
                    blocks: (0..n).map(|b| gen_ranks[g].addr(b)).collect(),
                    last_block_key: None,
                })
            })
            .collect::<Result<_, _>>()?;
        let send: Vec<_> = senders
            .iter()
            .enumerate()
            .map(|(c, s)| s.send(id, (0..n).map(|b| ctx[c].addr(b)).collect()))
            .collect::<Result<_, _>>()?;
        let mut it_bytes = 0;
        for h in send {
            let st = h.wait(wait)?;
            it_bytes += st.bytes;
            if i >= a.warmup {
                frags += st.fragments;
                coalesced += st.fragments_coalesced;
                copies += st.staging_copies;
            }
        }
        for h in recv {
            h.wait(wait)?;
        }
        if i >= a.warmup {
            kv_time += t.elapsed().as_secs_f64();
            bytes += it_bytes;
        }
    }
    if a.verify {
        for (g, k) in gen_ranks.iter_mut().enumerate() {
            let bb = k.slice.block_bytes() as usize;
            for b in 0..n {
                let blk = &k.pool[b as usize * bb..(b as usize + 1) * bb];
                if let Some(m) = check_block(&gen_s, &k.slice, blk, b, a.tokens) {
                    bail!("generation rank {g}: {m}");
                }
            }
        }
    }
    drop(receivers);
    drop(senders);
    // The raw agent figure: the same bytes between the same agents, each
    // context rank writing its share's byte count to the generation rank it
    // sends most to, as whole contiguous blocks (no layout mapping).
    let per_iter = bytes / u64::from(a.iters.max(1));
    let raw_time = raw(
        &ctx,
        &gen_ranks,
        &ctx_s,
        &gen_s,
        per_iter,
        a.iters.max(1),
        a.warmup,
    )?;
    let kv_gbps = bytes as f64 / kv_time / 1e9;
    let raw_gbps = per_iter as f64 * f64::from(a.iters.max(1)) / raw_time / 1e9;
    let transport = ctx[0]
        .agent
        .remote_transport(&gen_agent_name(&gen_ranks, 0))
        .unwrap_or("unknown");
    if a.json {
        println!(
            "{{\"kind\":\"kv\",\"model\":\"{}\",\"backend\":\"{transport}\",\"ctx_tp\":{},\"ctx_pp\":{},\"gen_tp\":{},\"gen_pp\":{},\"tokens\":{},\"tokens_per_block\":{},\"iters\":{},\"bytes\":{per_iter},\"gb_per_s\":{kv_gbps:.4},\"raw_gb_per_s\":{raw_gbps:.4},\"ratio\":{:.4},\"fragments\":{},\"fragments_coalesced\":{},\"staging_copies\":{copies}}}",
            a.model,
            a.ctx_tp,
            a.ctx_pp,
            a.gen_tp,
            a.gen_pp,
            a.tokens,
            a.tokens_per_block,
            a.iters,
            kv_gbps / raw_gbps,
            frags / u64::from(a.iters.max(1)),
            coalesced / u64::from(a.iters.max(1)),
        );
    } else {
        println!(
            "{} ctx TP{} PP{} -> gen TP{} PP{}, {} tokens over {transport}: {:.1} MiB per request, KV {kv_gbps:.3} GB/s, raw agents {raw_gbps:.3} GB/s, ratio {:.3}; {} fragments ({} after coalescing), {copies} staging copies",
            a.model,
            a.ctx_tp,
            a.ctx_pp,
            a.gen_tp,
            a.gen_pp,
            a.tokens,
            per_iter as f64 / (1 << 20) as f64,
            kv_gbps / raw_gbps,
            frags / u64::from(a.iters.max(1)),
            coalesced / u64::from(a.iters.max(1)),
        );
    }
    Ok(())
}

fn gen_agent_name(gen_ranks: &[Rank], g: usize) -> String {
    gen_ranks[g].agent.name().to_owned()
}

/// Seconds for `iters` rounds in which context ranks together write
/// `bytes` to the generation ranks as plain WRITEs of whole blocks.
fn raw(
    ctx: &[Rank],
    gen_ranks: &[Rank],
    ctx_s: &CacheState,
    gen_s: &CacheState,
    bytes: u64,
    iters: u32,
    warmup: u32,
) -> Result<f64> {
    for k in ctx {
        for g in gen_ranks {
            k.agent.load_remote_agent(&g.agent.local_agent_desc())?;
        }
    }
    let senders = ctx_s.world_size() as u64;
    let share = bytes / senders.max(1);
    let mut total = 0.0;
    for i in 0..warmup + iters {
        let t = Instant::now();
        let mut sts = Vec::new();
        for (c, k) in ctx.iter().enumerate() {
            let g = &gen_ranks[c % gen_s.world_size() as usize];
            // This sender's slot of the destination pool.
            let room = g.pool.len() as u64 / senders;
            let len = share.min(room).min(k.pool.len() as u64);
            if len == 0 {
                continue;
            }
            let slot = (c as u64 / gen_s.world_size() as u64) * room;
            let req = TransferRequest::write(
                MemoryDescs::new(MemoryType::Dram, chunks(k.pool.as_ptr() as u64, len)),
                MemoryDescs::new(MemoryType::Dram, chunks(g.pool.as_ptr() as u64 + slot, len)),
                g.agent.name(),
            );
            sts.push(k.agent.submit_transfer(req)?);
        }
        for st in sts {
            st.wait_success(Duration::from_secs(300))
                .context("raw transfer")?;
        }
        if i >= warmup {
            total += t.elapsed().as_secs_f64();
        }
    }
    Ok(total)
}

/// `[addr, addr + len)` as 1 MiB descriptors.
fn chunks(addr: u64, len: u64) -> Vec<MemoryDesc> {
    let step = 1 << 20;
    (0..len.div_ceil(step))
        .map(|i| MemoryDesc::new(addr + i * step, step.min(len - i * step), 0))
        .collect()
}
