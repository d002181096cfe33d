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
    RecvHandle, RecvRequest, SendHandle, SenderConfig, distinct_heads, rank_slice,
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
    /// Backend: auto, tcp, shm, rdma, fabric, inproc.
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Measured requests (each followed by a raw round; medians reported).
    #[arg(long, default_value_t = 9)]
    iters: u32,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Fill the context pools with the deterministic pattern and check
    /// every received element (slow for large models).
    #[arg(long)]
    verify: bool,
    /// shm: every copy by the initiator, never by the target (the
    /// library's default lets the side whose memory is contiguous copy).
    #[arg(long)]
    no_shm_delegate: bool,
    /// Bytes per posted write batch of a sender (default: the library's).
    #[arg(long, value_parser = crate::parse_size)]
    batch_bytes: Option<u64>,
    /// Write batches in flight per peer (default: the library's).
    #[arg(long)]
    batches_in_flight: Option<usize>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Where the pools live: dram, or vram (GPU memory on `--gpu`).
    #[arg(long, default_value = "dram", value_parser = ["dram", "vram"])]
    memory: String,
    /// The GPU (device ordinal) of `--memory vram` pools.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Layer-wise: a simulated prefill makes one layer ready every
    /// `--layer-compute-ms`; each round sends the request whole after the
    /// last layer and layer by layer as they are ready, side by side, and
    /// reports the exposed transfer time (last layer ready to KV complete)
    /// of both.
    #[arg(long)]
    layerwise: bool,
    /// The simulated compute time of one layer, in ms (default: twice the
    /// whole request's transfer time over its layers, measured first:
    /// compute and transfer comparable, the link not saturated — at
    /// exactly one layer's transfer time every hiccup adds to a queue that
    /// never drains).
    #[arg(long)]
    layer_compute_ms: Option<f64>,
    /// With `--layerwise`: draw one round's timeline in both modes to this
    /// SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Injected failures: N requests, each cancelled at a pseudo-random
    /// point by one party (a context rank and a generation rank in turn);
    /// reports p50 and p99 of the time from the cancel to the last
    /// party's terminal outcome.
    #[arg(long, default_value_t = 0)]
    failures: u32,
    /// End-to-end integrity: the receivers ask for it
    /// (`ReceiverConfig::integrity`), so every KV write carries a CRC32C
    /// per piece, checked where it lands (the raw rounds stay unchecked).
    #[arg(long)]
    integrity: bool,
    /// Host pools are shared pools (`SharedPool`, registered with
    /// `register_shared_pool`): on shm, every copy goes through the
    /// target's pool mapped in the initiator.
    #[arg(long)]
    shared_pool: bool,
}

/// A rank's block pool: host memory, or GPU memory.
enum Pool {
    Host(Vec<u8>),
    Gpu(kvxfer::gpu::DeviceBuffer),
    Shared(kvxfer::SharedPool),
}

impl Pool {
    fn new(memory: &str, gpu: u32, len: u64, shared: bool) -> Result<Self> {
        Ok(if shared && memory != "vram" {
            let p = kvxfer::SharedPool::new(usize::try_from(len)?)?;
            // SAFETY: the pool is this rank's alone until registered.
            unsafe { std::ptr::write_bytes(p.as_ptr(), 0x5a, len as usize) };
            Pool::Shared(p)
        } else if memory == "vram" {
            let b = kvxfer::gpu::DeviceBuffer::new(gpu, len).context("allocating a GPU pool")?;
            b.write(0, &vec![0x5au8; len as usize])?;
            Pool::Gpu(b)
        } else {
            Pool::Host(vec![0x5au8; len as usize])
        })
    }

    fn addr(&self) -> u64 {
        match self {
            Pool::Host(v) => v.as_ptr() as u64,
            Pool::Gpu(b) => b.addr(),
            Pool::Shared(p) => p.as_ptr() as u64,
        }
    }

    fn len(&self) -> u64 {
        match self {
            Pool::Host(v) => v.len() as u64,
            Pool::Gpu(b) => b.len(),
            Pool::Shared(p) => p.len() as u64,
        }
    }

    fn mem_type(&self) -> MemoryType {
        match self {
            Pool::Host(_) | Pool::Shared(_) => MemoryType::Dram,
            Pool::Gpu(_) => MemoryType::Vram,
        }
    }

    fn device(&self) -> u32 {
        match self {
            Pool::Host(_) | Pool::Shared(_) => 0,
            Pool::Gpu(b) => b.device(),
        }
    }

    fn descs(&self) -> MemoryDescs {
        MemoryDescs::new(
            self.mem_type(),
            vec![MemoryDesc::new(self.addr(), self.len(), self.device())],
        )
    }

    /// Writes `data` at `at`.
    fn write(&mut self, at: usize, data: &[u8]) -> Result<()> {
        match self {
            Pool::Host(v) => v[at..at + data.len()].copy_from_slice(data),
            Pool::Gpu(b) => b.write(at as u64, data)?,
            Pool::Shared(p) => {
                assert!(at + data.len() <= p.len());
                // SAFETY: inside the pool (checked); no transfer is in
                // flight while the benchmark fills or reads its pools.
                unsafe {
                    std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(at), data.len())
                }
            }
        }
        Ok(())
    }

    /// `len` bytes from `at`.
    fn read(&self, at: usize, len: usize) -> Result<Vec<u8>> {
        Ok(match self {
            Pool::Host(v) => v[at..at + len].to_vec(),
            Pool::Shared(p) => {
                assert!(at + len <= p.len());
                // SAFETY: as in `write`.
                unsafe { std::slice::from_raw_parts(p.as_ptr().add(at), len) }.to_vec()
            }
            Pool::Gpu(b) => {
                let mut out = vec![0u8; len];
                b.read(at as u64, &mut out)?;
                out
            }
        })
    }
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

pub(crate) struct Rank {
    agent: Arc<dyn TransferAgent>,
    slice: RankSlice,
    pool: Pool,
}

impl Rank {
    fn new(name: String, a: &KvArgs, slice: RankSlice, blocks: u32) -> Result<Self> {
        let backend: Backend = a.backend.parse()?;
        let cfg = AgentConfig::new(name).with_shm_delegate(!a.no_shm_delegate);
        let agent: Arc<dyn TransferAgent> = Arc::from(make_transfer_agent(backend, cfg)?);
        let len = slice.block_bytes() * u64::from(blocks);
        let pool = Pool::new(&a.memory, a.gpu, len, a.shared_pool)?;
        match &pool {
            Pool::Shared(p) => {
                agent.register_shared_pool(p, kvxfer::PoolAccess::ReadWrite)?;
            }
            // SAFETY: the pool lives in `Rank` with the agent; senders and
            // receivers using the agent are dropped before the ranks.
            _ => unsafe { agent.register_memory(&pool.descs())? },
        }
        Ok(Self { agent, slice, pool })
    }

    pub(crate) fn addr(&self, b: u32) -> u64 {
        self.pool.addr() + u64::from(b) * self.slice.block_bytes()
    }
}

/// Runs the benchmark and prints its result.
pub fn run(a: &KvArgs) -> Result<()> {
    let ctx_s = preset(a, a.ctx_tp, a.ctx_pp)?;
    let gen_s = preset(a, a.gen_tp, a.gen_pp)?;
    ctx_s.check_compatible(&gen_s)?;
    let d = distinct_heads(&ctx_s, &gen_s);
    let n = a.tokens.div_ceil(a.tokens_per_block);
    let ctx: Vec<Rank> = (0..ctx_s.world_size())
        .map(|r| {
            let s = rank_slice(&ctx_s, r, d);
            Rank::new(format!("kv-ctx{r}"), a, s, n)
        })
        .collect::<Result<_>>()?;
    let gen_ranks: Vec<Rank> = (0..gen_s.world_size())
        .map(|r| {
            let s = rank_slice(&gen_s, r, d);
            Rank::new(format!("kv-gen{r}"), a, s, n)
        })
        .collect::<Result<_>>()?;
    let mut ctx = ctx;
    if a.verify {
        for k in &mut ctx {
            let bb = k.slice.block_bytes() as usize;
            let slice = k.slice;
            let mut blk = vec![0u8; bb];
            for b in 0..n {
                fill_block(&ctx_s, &slice, &mut blk, b);
                k.pool.write(b as usize * bb, &blk)?;
            }
        }
    }
    let mem_type = if a.memory == "vram" {
        MemoryType::Vram
    } else {
        MemoryType::Dram
    };
    let mut sc = SenderConfig {
        mem_type,
        ..SenderConfig::default()
    };
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
                ReceiverConfig {
                    mem_type,
                    integrity: a.integrity,
                    ..ReceiverConfig::default()
                },
            )
        })
        .collect::<Result<_, _>>()?;
    // KV and raw rounds alternate, so that both see the same machine.
    for k in &ctx {
        for g in &gen_ranks {
            k.agent.load_remote_agent(&g.agent.local_agent_desc())?;
        }
    }
    if a.layerwise || a.failures > 0 {
        let x = crate::layerwise::Executors {
            senders: &senders,
            receivers: &receivers,
            ctx: &ctx,
            gen_ranks: &gen_ranks,
            n,
            layers: ctx_s.num_layers(),
        };
        let r = if a.layerwise {
            run_layerwise(a, &x)
        } else {
            run_failures(a, &x)
        };
        drop(receivers);
        drop(senders);
        return r;
    }
    let (mut kv_times, mut raw_times, mut batched_times) = (Vec::new(), Vec::new(), Vec::new());
    // Receiver's per-peer durations over the sender's, each round.
    let mut peer_ratios = Vec::new();
    let batching = a.batch_bytes.map(|b| {
        let d = kvxfer::cache::SenderConfig::default();
        (b, a.batches_in_flight.unwrap_or(d.batches_in_flight))
    });
    let (mut per_iter, mut frags, mut coalesced, mut copies) = (0, 0, 0, 0);
    let total = a.warmup + a.iters.max(1);
    for i in 0..total {
        let id = u64::from(i) + 1;
        let staged = kvxfer::gpu::staging_copies().0;
        let t = Instant::now();
        let mut it = kv_round(&senders, &receivers, &ctx, &gen_ranks, n, id)?;
        let kv_t = t.elapsed().as_secs_f64();
        // GPU memory over TCP is staged: counted by the library.
        it.copies += kvxfer::gpu::staging_copies().0 - staged;
        per_iter = it.bytes;
        if a.verify && i + 1 == total {
            verify(&gen_ranks, &gen_s, n, a.tokens)?;
        }
        let raw_t = raw_round(&ctx, &gen_ranks, &ctx_s, &gen_s, it.bytes, None)?;
        // With small batches, also the raw agents moving the same bytes in
        // the same batches, as many in flight: what the protocol adds.
        let batched_t = match batching {
            Some(b) => Some(raw_round(
                &ctx,
                &gen_ranks,
                &ctx_s,
                &gen_s,
                it.bytes,
                Some(b),
            )?),
            None => None,
        };
        if i >= a.warmup {
            if it.peer_secs.0 > 0.0 {
                peer_ratios.push(it.peer_secs.1 / it.peer_secs.0);
            }
            kv_times.push(kv_t);
            raw_times.push(raw_t);
            batched_times.extend(batched_t);
            frags = it.fragments;
            coalesced = it.coalesced;
            copies += it.copies;
        }
    }
    drop(receivers);
    drop(senders);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.total_cmp(y));
        v[v.len() / 2]
    };
    let kv_gbps = per_iter as f64 / median(&mut kv_times) / 1e9;
    let raw_gbps = per_iter as f64 / median(&mut raw_times) / 1e9;
    let batched_gbps =
        (!batched_times.is_empty()).then(|| per_iter as f64 / median(&mut batched_times) / 1e9);
    let peer_ratio = if peer_ratios.is_empty() {
        0.0
    } else {
        median(&mut peer_ratios)
    };
    let transport = ctx[0]
        .agent
        .remote_transport(&gen_agent_name(&gen_ranks, 0))
        .unwrap_or("unknown");
    let figures = Figures {
        transport,
        per_iter,
        kv_gbps,
        raw_gbps,
        batched_gbps,
        peer_ratio,
        frags,
        coalesced,
        copies,
    };
    report(a, &figures);
    Ok(())
}

/// One KV round's sender statistics, summed over the context ranks.
struct RoundStats {
    bytes: u64,
    fragments: u64,
    coalesced: u64,
    copies: u64,
    /// Per-peer durations summed over the shares, as each side measured
    /// them (seconds): sender, receiver.
    peer_secs: (f64, f64),
}

/// One KV transfer of `n` blocks as request `id`: every generation rank
/// asks, every context rank sends, all waited for.
fn kv_round(
    senders: &[CacheSender],
    receivers: &[CacheReceiver],
    ctx: &[Rank],
    gen_ranks: &[Rank],
    n: u32,
    id: u64,
) -> Result<RoundStats> {
    let wait = Duration::from_secs(300);
    let (send, recv) = start_request(senders, receivers, ctx, gen_ranks, n, id)?;
    let mut it = RoundStats {
        bytes: 0,
        fragments: 0,
        coalesced: 0,
        copies: 0,
        peer_secs: (0.0, 0.0),
    };
    let sum =
        |p: &[kvxfer::cache::PeerMeasure]| p.iter().map(|m| m.duration.as_secs_f64()).sum::<f64>();
    for h in send {
        let st = h.wait(wait)?;
        it.peer_secs.0 += sum(&st.peers);
        it.bytes += st.bytes;
        it.fragments += st.fragments;
        it.coalesced += st.fragments_coalesced;
        it.copies += st.staging_copies;
    }
    for h in recv {
        it.peer_secs.1 += sum(&h.wait(wait)?.peers);
    }
    Ok(it)
}

/// Request `id` of `n` blocks started on every rank: every generation rank
/// asks, every context rank sends; their handles.
pub(crate) fn start_request(
    senders: &[CacheSender],
    receivers: &[CacheReceiver],
    ctx: &[Rank],
    gen_ranks: &[Rank],
    n: u32,
    id: u64,
) -> Result<(Vec<SendHandle>, Vec<RecvHandle>)> {
    let recv = receivers
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
    let send = senders
        .iter()
        .enumerate()
        .map(|(c, s)| s.send(id, (0..n).map(|b| ctx[c].addr(b)).collect()))
        .collect::<Result<_, _>>()?;
    Ok((send, recv))
}

/// Checks every generation rank's blocks element by element.
fn verify(gen_ranks: &[Rank], gen_s: &CacheState, n: u32, tokens: u32) -> Result<()> {
    for (g, k) in gen_ranks.iter().enumerate() {
        let bb = k.slice.block_bytes() as usize;
        for b in 0..n {
            let blk = k.pool.read(b as usize * bb, bb)?;
            if let Some(m) = check_block(gen_s, &k.slice, &blk, b, tokens) {
                bail!("generation rank {g}: {m}");
            }
        }
    }
    Ok(())
}

/// What a KV run measured.
struct Figures<'a> {
    transport: &'a str,
    per_iter: u64,
    kv_gbps: f64,
    raw_gbps: f64,
    /// The raw agents in the sender's batches, when `--batch-bytes` is set.
    batched_gbps: Option<f64>,
    /// The receivers' per-peer durations over the senders' (median of the
    /// rounds): both measure a share from its first byte to its last.
    peer_ratio: f64,
    frags: u64,
    coalesced: u64,
    copies: u64,
}

/// Prints a KV run's figures (one JSON line with `--json`).
fn report(a: &KvArgs, f: &Figures<'_>) {
    let Figures {
        transport,
        per_iter,
        kv_gbps,
        raw_gbps,
        batched_gbps,
        peer_ratio,
        frags,
        coalesced,
        copies,
    } = *f;
    let batched_json = batched_gbps.map_or(String::new(), |b| {
        format!(
            ",\"raw_batched_gb_per_s\":{b:.4},\"ratio_batched\":{:.4}",
            kv_gbps / b
        )
    });
    let batched_text = batched_gbps.map_or(String::new(), |b| {
        format!(
            ", raw agents in the same batches {b:.3} GB/s (ratio {:.3})",
            kv_gbps / b
        )
    });
    if a.json {
        println!(
            "{{{},\"tokens_per_block\":{},\"iters\":{},\"bytes\":{per_iter},\"gb_per_s\":{kv_gbps:.4},\"raw_gb_per_s\":{raw_gbps:.4},\"ratio\":{:.4},\"fragments\":{},\"fragments_coalesced\":{},\"staging_copies\":{copies},\"peer_duration_ratio\":{peer_ratio:.3}{batched_json}}}",
            run_json(a, "kv", transport),
            a.tokens_per_block,
            a.iters,
            kv_gbps / raw_gbps,
            frags,
            coalesced,
        );
    } else {
        println!(
            "{}: {:.1} MiB per request, KV {kv_gbps:.3} GB/s, raw agents {raw_gbps:.3} GB/s, ratio {:.3}{batched_text}; {} fragments ({} after coalescing), {copies} staging copies; per-peer durations receiver/sender {peer_ratio:.2}",
            run_text(a, transport),
            per_iter as f64 / (1 << 20) as f64,
            kv_gbps / raw_gbps,
            frags,
            coalesced,
        );
    }
}

/// `--failures`: one whole request timed (after the warm-up), then the
/// injected cancels; prints p50 and p99 of the time to the last party's
/// outcome.
fn run_failures(a: &KvArgs, x: &crate::layerwise::Executors<'_>) -> Result<()> {
    let mut whole = Duration::MAX;
    for i in 0..a.warmup.max(1) + 1 {
        let t = Instant::now();
        kv_round(
            x.senders,
            x.receivers,
            x.ctx,
            x.gen_ranks,
            x.n,
            u64::from(i) + 1,
        )?;
        whole = whole.min(t.elapsed());
    }
    let mut p = crate::failures::run(x, a.failures, whole, 1_000)?;
    let transport = x.ctx[0]
        .agent
        .remote_transport(&gen_agent_name(x.gen_ranks, 0))
        .unwrap_or("unknown");
    let cut = p.last_outcome.len();
    if cut == 0 {
        bail!("every request completed before its cancel took");
    }
    p.last_outcome.sort_by(|x, y| x.total_cmp(y));
    let pct = |q: f64| p.last_outcome[((cut as f64 * q).ceil() as usize).clamp(1, cut) - 1] * 1e3;
    let (p50, p99, max) = (pct(0.5), pct(0.99), p.last_outcome[cut - 1] * 1e3);
    if a.json {
        println!(
            "{{{},\"failures\":{},\"cut\":{cut},\"completed_first\":{},\"whole_ms\":{:.3},\"last_outcome_p50_ms\":{p50:.3},\"last_outcome_p99_ms\":{p99:.3},\"last_outcome_max_ms\":{max:.3}}}",
            run_json(a, "kv-failures", transport),
            a.failures,
            p.completed_first,
            whole.as_secs_f64() * 1e3,
        );
    } else {
        println!(
            "{}: {} injected cancels ({cut} cut mid-request, {} completed first; a whole request {:.1} ms): cancel to the last party's outcome p50 {p50:.2} ms, p99 {p99:.2} ms, max {max:.2} ms",
            run_text(a, transport),
            a.failures,
            p.completed_first,
            whole.as_secs_f64() * 1e3,
        );
    }
    Ok(())
}

/// The run's model, layouts and prompt as the start of a JSON object's
/// fields.
fn run_json(a: &KvArgs, kind: &str, transport: &str) -> String {
    format!(
        "\"kind\":\"{kind}\",\"model\":\"{}\",\"backend\":\"{transport}\",\"ctx_tp\":{},\"ctx_pp\":{},\"gen_tp\":{},\"gen_pp\":{},\"tokens\":{}",
        a.model, a.ctx_tp, a.ctx_pp, a.gen_tp, a.gen_pp, a.tokens
    )
}

/// The run's model, layouts and prompt, in words.
fn run_text(a: &KvArgs, transport: &str) -> String {
    format!(
        "{} ctx TP{} PP{} -> gen TP{} PP{}, {} tokens over {transport}",
        a.model, a.ctx_tp, a.ctx_pp, a.gen_tp, a.gen_pp, a.tokens
    )
}

fn gen_agent_name(gen_ranks: &[Rank], g: usize) -> String {
    gen_ranks[g].agent.name().to_owned()
}

/// Seconds for one round in which the context ranks together write
/// `bytes` to the generation ranks as plain WRITEs of 1 MiB descriptors:
/// each context rank its equal share, dealt over the generation ranks
/// round-robin by 1 MiB chunk, each generation pool filled from its start.
/// With `batching` = (bytes, n): chunks of that size, each its own request,
/// each context rank keeping `n` in flight (as the KV sender's batches).
fn raw_round(
    ctx: &[Rank],
    gen_ranks: &[Rank],
    ctx_s: &CacheState,
    gen_s: &CacheState,
    bytes: u64,
    batching: Option<(u64, usize)>,
) -> Result<f64> {
    let chunk_len = batching.map_or(1 << 20, |b| b.0.max(1));
    let senders = u64::from(ctx_s.world_size()).max(1);
    let gens = gen_s.world_size() as usize;
    let share = bytes / senders;
    // (context rank, generation rank) -> (local, remote) descriptors.
    let mut plan: Vec<Vec<(Vec<MemoryDesc>, Vec<MemoryDesc>)>> =
        vec![vec![(Vec::new(), Vec::new()); gens]; ctx.len()];
    let mut cursor = vec![0u64; gens];
    for (c, k) in ctx.iter().enumerate() {
        let mut off = 0;
        let mut turn = c;
        while off < share.min(k.pool.len()) {
            let len = chunk_len.min(share - off).min(k.pool.len() - off);
            let g = turn % gens;
            turn += 1;
            let pool = &gen_ranks[g].pool;
            if cursor[g] + len > pool.len() {
                cursor[g] = 0;
            }
            plan[c][g]
                .0
                .push(MemoryDesc::new(k.pool.addr() + off, len, k.pool.device()));
            plan[c][g]
                .1
                .push(MemoryDesc::new(pool.addr() + cursor[g], len, pool.device()));
            cursor[g] += len;
            off += len;
        }
    }
    let t = Instant::now();
    if let Some((_, in_flight)) = batching {
        std::thread::scope(|s| {
            let workers: Vec<_> = plan
                .into_iter()
                .enumerate()
                .map(|(c, per_gen)| {
                    let (ctx, gen_ranks) = (&ctx, &gen_ranks);
                    s.spawn(move || -> Result<()> {
                        let mut open = std::collections::VecDeque::new();
                        for (g, (l, r)) in per_gen.into_iter().enumerate() {
                            for (l, r) in l.into_iter().zip(r) {
                                if open.len() >= in_flight.max(1) {
                                    let st: kvxfer::TransferStatus =
                                        open.pop_front().expect("non-empty");
                                    st.wait_success(Duration::from_secs(300))
                                        .context("raw transfer")?;
                                }
                                let req = TransferRequest::write(
                                    MemoryDescs::new(ctx[c].pool.mem_type(), vec![l]),
                                    MemoryDescs::new(gen_ranks[g].pool.mem_type(), vec![r]),
                                    gen_ranks[g].agent.name(),
                                );
                                open.push_back(ctx[c].agent.submit_transfer(&req)?);
                            }
                        }
                        for st in open {
                            st.wait_success(Duration::from_secs(300))
                                .context("raw transfer")?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("raw worker panicked"))
        })?;
        return Ok(t.elapsed().as_secs_f64());
    }
    let mut sts = Vec::new();
    for (c, per_gen) in plan.into_iter().enumerate() {
        for (g, (l, r)) in per_gen.into_iter().enumerate() {
            if l.is_empty() {
                continue;
            }
            let req = TransferRequest::write(
                MemoryDescs::new(ctx[c].pool.mem_type(), l),
                MemoryDescs::new(gen_ranks[g].pool.mem_type(), r),
                gen_ranks[g].agent.name(),
            );
            sts.push(ctx[c].agent.submit_transfer(&req)?);
        }
    }
    for st in sts {
        st.wait_success(Duration::from_secs(300))
            .context("raw transfer")?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// `--layerwise`: rounds of both modes behind a simulated prefill.
fn run_layerwise(a: &KvArgs, x: &crate::layerwise::Executors<'_>) -> Result<()> {
    use crate::layerwise::{Mode, median, round};
    let mut id = 0u64;
    let mut next = || {
        id += 1;
        id
    };
    let layers = x.layers;
    let mut go = |mode, compute| round(x, mode, compute, next());
    let compute = match a.layer_compute_ms {
        Some(ms) => Duration::from_secs_f64(ms / 1e3),
        None => {
            // The whole request with no compute before it: its transfer
            // time, spread over the layers, twice.
            go(Mode::Whole, Duration::ZERO)?;
            let mut t: Vec<Duration> = (0..3)
                .map(|_| go(Mode::Whole, Duration::ZERO).map(|tl| tl.exposed()))
                .collect::<Result<_>>()?;
            median(&mut t) * 2 / layers
        }
    };
    for _ in 0..a.warmup {
        go(Mode::Whole, compute)?;
        go(Mode::Layerwise, compute)?;
    }
    let (mut we, mut le, mut w2e, mut l2e) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    for i in 0..a.iters.max(1) {
        // Alternating which goes first.
        let (w, l) = if i % 2 == 0 {
            let w = go(Mode::Whole, compute)?;
            (w, go(Mode::Layerwise, compute)?)
        } else {
            let l = go(Mode::Layerwise, compute)?;
            (go(Mode::Whole, compute)?, l)
        };
        we.push(w.exposed());
        le.push(l.exposed());
        w2e.push(w.end_to_end());
        l2e.push(l.end_to_end());
        last = Some((w, l));
    }
    let whole_exposed = median(&mut we);
    let layerwise_exposed = median(&mut le);
    let one_layer = whole_exposed / layers;
    let f = crate::layerwise::Figures {
        compute,
        one_layer,
        whole_exposed,
        layerwise_exposed,
        whole_e2e: median(&mut w2e),
        layerwise_e2e: median(&mut l2e),
    };
    let transport = x.ctx[0]
        .agent
        .remote_transport(&gen_agent_name(x.gen_ranks, 0))
        .unwrap_or("unknown");
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let over_layer = ms(f.layerwise_exposed) / ms(f.one_layer).max(1e-9);
    let gain = ms(f.whole_exposed) / ms(f.layerwise_exposed).max(1e-9);
    if a.json {
        println!(
            "{{{},\"layers\":{layers},\"iters\":{},\"compute_ms_per_layer\":{:.3},\"one_layer_ms\":{:.3},\"whole_exposed_ms\":{:.3},\"layerwise_exposed_ms\":{:.3},\"layerwise_over_one_layer\":{over_layer:.3},\"whole_over_layerwise\":{gain:.3},\"whole_e2e_ms\":{:.3},\"layerwise_e2e_ms\":{:.3}}}",
            run_json(a, "kv-layerwise", transport),
            a.iters,
            ms(f.compute),
            ms(f.one_layer),
            ms(f.whole_exposed),
            ms(f.layerwise_exposed),
            ms(f.whole_e2e),
            ms(f.layerwise_e2e),
        );
    } else {
        println!(
            "{}, {layers} layers of {:.2} ms compute: exposed transfer whole {:.2} ms, layer by layer {:.2} ms ({over_layer:.2}x one layer's {:.2} ms; {gain:.1}x lower); end to end {:.2} ms vs {:.2} ms",
            run_text(a, transport),
            ms(f.compute),
            ms(f.whole_exposed),
            ms(f.layerwise_exposed),
            ms(f.one_layer),
            ms(f.whole_e2e),
            ms(f.layerwise_e2e),
        );
    }
    if let (Some(path), Some((w, l))) = (&a.plot, last) {
        let title = format!(
            "{} TP{}→TP{}, {} tokens over {transport}: one request, both modes",
            a.model, a.ctx_tp, a.gen_tp, a.tokens
        );
        crate::plot::timeline(path, &title, &w, &l)?;
    }
    Ok(())
}
