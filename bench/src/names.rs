//! `kvxfer-bench names --metadata etcd://host:port`: what finding peers by
//! name costs. (1) Resolve-and-connect: `--peers` target agents created in
//! turn, each found by name by one initiator (etcd lookup, side-channel
//! descriptor fetch, connection) and written to once (4 KiB), timed from
//! the lookup to the write's completion; p50, p99, max. (2) `--burst`
//! agents created at once, each publishing itself (lease grant and
//! put-if-absent); per-agent creation p50, p99, and the whole burst.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args as ClapArgs;
use kvxfer::{AgentConfig, Backend, MemoryDescs, TransferRequest, make_transfer_agent};

/// Flags of `kvxfer-bench names`.
#[derive(ClapArgs, Debug, Clone)]
pub struct NamesArgs {
    /// The store: `etcd://host:port[,host:port...]`.
    #[arg(long)]
    metadata: String,
    /// New peers found by name in turn.
    #[arg(long, default_value_t = 1000)]
    peers: usize,
    /// Agents publishing at once.
    #[arg(long, default_value_t = 256)]
    burst: usize,
    /// Key prefix (default: one of this run's own).
    #[arg(long)]
    prefix: Option<String>,
    /// One JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs both measurements.
pub fn run(a: &NamesArgs) -> Result<()> {
    let prefix = a
        .prefix
        .clone()
        .unwrap_or_else(|| format!("/kvxfer-bench-{}", std::process::id()));
    let etcd = crate::etcd_config(&a.metadata)?.with_prefix(prefix);
    let cfg = |name: String| AgentConfig::new(name).with_etcd(etcd.clone());

    // (1) Resolve-and-connect to new peers, one after another.
    let init = make_transfer_agent(Backend::Tcp, cfg("bench-init".into()))?;
    let src = vec![7u8; 4096];
    // SAFETY: `src` outlives `init` (dropped at the end of this function).
    unsafe { init.register_memory(&MemoryDescs::dram(&src))? };
    let dst = vec![0u8; 4096];
    let mut first = Vec::with_capacity(a.peers);
    for i in 0..a.peers {
        let name = format!("bench-peer-{i}");
        let peer = make_transfer_agent(Backend::Tcp, cfg(name.clone()))?;
        // SAFETY: `dst` outlives `peer` (dropped below, each round).
        unsafe { peer.register_memory(&MemoryDescs::dram(&dst))? };
        let t0 = Instant::now();
        init.load_remote_agent_by_name(&name)?;
        let req = TransferRequest::write(MemoryDescs::dram(&src), MemoryDescs::dram(&dst), &name);
        init.submit_transfer(&req)?
            .wait_success(Duration::from_secs(30))?;
        first.push(t0.elapsed());
        init.invalidate_remote_agent(&name)?;
        peer.deregister_memory(&MemoryDescs::dram(&dst))?;
        drop(peer);
    }
    first.sort();

    // (2) Many agents publishing at once.
    let t0 = Instant::now();
    let threads: Vec<_> = (0..a.burst)
        .map(|i| {
            let c = cfg(format!("bench-burst-{i}"));
            std::thread::spawn(
                move || -> Result<(Duration, Box<dyn kvxfer::TransferAgent>)> {
                    let t = Instant::now();
                    let agent = make_transfer_agent(Backend::Tcp, c)?;
                    Ok((t.elapsed(), agent))
                },
            )
        })
        .collect();
    let mut each = Vec::with_capacity(a.burst);
    let mut agents = Vec::with_capacity(a.burst);
    for t in threads {
        let (d, agent) = t.join().expect("publishing thread")?;
        each.push(d);
        agents.push(agent);
    }
    let burst = t0.elapsed();
    each.sort();
    drop(agents);
    drop(init);

    if a.json {
        println!(
            "{{\"peers\":{},\"first_transfer_p50_ms\":{:.3},\"first_transfer_p99_ms\":{:.3},\"first_transfer_max_ms\":{:.3},\"burst\":{},\"publish_p50_ms\":{:.3},\"publish_p99_ms\":{:.3},\"burst_ms\":{:.3}}}",
            a.peers,
            ms(percentile(&first, 0.5)),
            ms(percentile(&first, 0.99)),
            ms(first.last().copied().unwrap_or_default()),
            a.burst,
            ms(percentile(&each, 0.5)),
            ms(percentile(&each, 0.99)),
            ms(burst),
        );
    } else {
        println!(
            "resolve-and-connect + first 4 KiB write, {} new peers in turn: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            a.peers,
            ms(percentile(&first, 0.5)),
            ms(percentile(&first, 0.99)),
            ms(first.last().copied().unwrap_or_default())
        );
        println!(
            "{} agents publishing at once: each p50 {:.2} ms, p99 {:.2} ms; all in {:.2} ms",
            a.burst,
            ms(percentile(&each, 0.5)),
            ms(percentile(&each, 0.99)),
            ms(burst)
        );
    }
    Ok(())
}
