//! `kvxfer-bench kv --failures N`: how fast a failure reaches every party of
//! a KV-cache request. Each round starts a request on every rank, lets it
//! run for a pseudo-random part of a whole request's time, then one party
//! cancels it — a context rank and a generation rank in turn — and times
//! from the cancel call to the last terminal outcome among all the
//! request's handles (each awaited on a thread of its own). Rounds whose
//! request completed before the cancel took are counted apart.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use kvxfer::cache::CacheError;

use crate::layerwise::Executors;

/// What the failure rounds measured.
pub(crate) struct Propagation {
    /// Seconds from the cancel to the last party's outcome, per cut round.
    pub(crate) last_outcome: Vec<f64>,
    /// Rounds whose request completed before the cancel took.
    pub(crate) completed_first: u32,
}

/// A small deterministic generator (the injection points of a run are the
/// same every time).
fn next(seed: &mut u64) -> f64 {
    *seed = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*seed >> 11) as f64 / (1u64 << 53) as f64
}

/// Runs `rounds` injected cancels; `whole` is one whole request's time.
pub(crate) fn run(
    x: &Executors<'_>,
    rounds: u32,
    whole: Duration,
    first_id: u64,
) -> Result<Propagation> {
    let wait = Duration::from_secs(120);
    let mut seed = 0x006b_7678_6661_696c_u64;
    let mut out = Propagation {
        last_outcome: Vec::new(),
        completed_first: 0,
    };
    for i in 0..rounds {
        let id = first_id + u64::from(i);
        let (send, recv) =
            crate::kv::start_request(x.senders, x.receivers, x.ctx, x.gen_ranks, x.n, id)?;
        std::thread::sleep(whole.mul_f64(next(&mut seed)));
        let (ends, t0, cancelled) = std::thread::scope(|sc| {
            let mut waits = Vec::new();
            for h in &send {
                waits.push(sc.spawn(move || (h.wait(wait).is_err(), Instant::now())));
            }
            for h in &recv {
                waits.push(sc.spawn(move || (h.wait(wait).is_err(), Instant::now())));
            }
            let t0 = Instant::now();
            let r = if i % 2 == 0 {
                x.senders[0].cancel(id)
            } else {
                x.receivers[0].cancel(id)
            };
            let ends: Vec<(bool, Instant)> = waits
                .into_iter()
                .map(|w| w.join().expect("a waiter"))
                .collect();
            (ends, t0, r)
        });
        match cancelled {
            Ok(()) | Err(CacheError::UnknownRequest(_)) => {}
            Err(e) => bail!("round {i}: the cancel failed: {e}"),
        }
        if ends.iter().all(|(failed, _)| !failed) {
            out.completed_first += 1;
            continue;
        }
        let last = ends.iter().map(|(_, t)| *t).max().expect("handles");
        out.last_outcome
            .push(last.saturating_duration_since(t0).as_secs_f64());
    }
    Ok(out)
}
