//! `kvxfer-bench kv --layerwise`: one request's KV cache behind a
//! simulated prefill that makes one layer ready every `compute` (model
//! order), sent two ways side by side in each round — whole (`send` after
//! the last layer) and layer by layer (`begin`, then `layers_ready` as each
//! layer is computed) — timed from the last layer ready to the KV complete
//! on the generation side (the *exposed* transfer time).

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvxfer::cache::{CacheReceiver, CacheSender, RecvRequest};

use crate::kv::Rank;

const WAIT: Duration = Duration::from_secs(300);

/// How a round sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `send` once the last layer is ready.
    Whole,
    /// `begin`, then each layer as it is ready.
    Layerwise,
}

/// What one round saw.
pub(crate) struct Timeline {
    pub(crate) mode: Mode,
    pub(crate) t0: Instant,
    /// When each model layer was ready.
    pub(crate) ready: Vec<Instant>,
    /// Per generation rank: runs of its layers as they landed.
    pub(crate) landed: Vec<Vec<(Range<u32>, Instant)>>,
    /// The last report on any generation rank: the KV complete there.
    pub(crate) complete: Instant,
}

impl Timeline {
    /// From the last layer ready to the KV complete.
    pub(crate) fn exposed(&self) -> Duration {
        let last = *self.ready.last().expect("a layer");
        self.complete.saturating_duration_since(last)
    }

    /// From the prefill's start to the KV complete.
    pub(crate) fn end_to_end(&self) -> Duration {
        self.complete.saturating_duration_since(self.t0)
    }
}

/// The two executors of a layer-wise run.
pub(crate) struct Executors<'a> {
    pub(crate) senders: &'a [CacheSender],
    pub(crate) receivers: &'a [CacheReceiver],
    pub(crate) ctx: &'a [Rank],
    pub(crate) gen_ranks: &'a [Rank],
    /// Blocks per request.
    pub(crate) n: u32,
    /// Model layers.
    pub(crate) layers: u32,
}

/// One round: the generation ranks ask for request `id` at once, the
/// prefill runs (`x.layers` layers, `compute` each), and the context
/// ranks send as `mode` says.
pub(crate) fn round(x: &Executors<'_>, mode: Mode, compute: Duration, id: u64) -> Result<Timeline> {
    let Executors {
        senders,
        receivers,
        ctx,
        gen_ranks,
        n,
        layers,
    } = *x;
    let blocks = |k: &Rank| (0..n).map(|b| k.addr(b)).collect::<Vec<u64>>();
    let t0 = Instant::now();
    let recv: Vec<_> = receivers
        .iter()
        .zip(gen_ranks)
        .map(|(r, k)| {
            r.request(RecvRequest {
                request_id: id,
                ctx_dp_rank: 0,
                blocks: blocks(k),
                last_block_key: None,
            })
        })
        .collect::<Result<_, _>>()?;
    let mut send = Vec::new();
    if mode == Mode::Layerwise {
        for (s, k) in senders.iter().zip(ctx) {
            send.push(s.begin(id, blocks(k))?);
        }
    }
    let held: Vec<Range<u32>> = senders.iter().map(CacheSender::held_layers).collect();
    let mut ready = Vec::with_capacity(layers as usize);
    for l in 0..layers {
        // The layer's compute.
        let due = t0 + compute * (l + 1);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        ready.push(Instant::now());
        if mode == Mode::Layerwise {
            for (s, h) in senders.iter().zip(&held) {
                if h.contains(&l) {
                    s.layers_ready(id, l..l + 1)?;
                }
            }
        }
    }
    if mode == Mode::Whole {
        for (s, k) in senders.iter().zip(ctx) {
            send.push(s.send(id, blocks(k))?);
        }
    }
    for h in send {
        h.wait(WAIT).context("the context side")?;
    }
    let mut landed = Vec::new();
    for h in recv {
        h.wait(WAIT).context("the generation side")?;
        landed.push(h.layers_landed());
    }
    let complete = landed
        .iter()
        .flatten()
        .map(|(_, at)| *at)
        .max()
        .context("no layer reported")?;
    Ok(Timeline {
        mode,
        t0,
        ready,
        landed,
        complete,
    })
}

/// The rounds' figures: medians over the measured rounds.
pub(crate) struct Figures {
    pub(crate) compute: Duration,
    /// The whole request's transfer time over the layers.
    pub(crate) one_layer: Duration,
    pub(crate) whole_exposed: Duration,
    pub(crate) layerwise_exposed: Duration,
    pub(crate) whole_e2e: Duration,
    pub(crate) layerwise_e2e: Duration,
}

/// The median of `v`.
pub(crate) fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}
