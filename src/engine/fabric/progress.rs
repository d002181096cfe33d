//! The endpoint's progress thread, and the reading of the endpoint's
//! completion queue, by that thread or by a thread waiting on a small
//! request. The thread also posts what waits in the links' backlogs
//! (`link::drain`) and runs their stall watch (`link::watch`).

use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvxfer_fabric as ffi;

use super::link::{complete, drain, watch};
use super::{CLOSE_GRACE, FabricError, Rails, Shared, WAIT_MS, strerror};
use crate::engine::lock;
use crate::status::Progress;

/// Completions read from the queue at once.
pub(super) const BATCH: usize = 64;

/// Reads the completions ready in the endpoint's queue (blocking up to
/// [`WAIT_MS`] for one when `block`) and completes their operations; how
/// many it read (an error entry counts one).
pub(super) fn reap(shared: &Shared, buf: &mut [ffi::fi_cq_entry; BATCH], block: bool) -> usize {
    let ep = &*shared.ep;
    // SAFETY: `buf` holds BATCH entries of the queue's format.
    let n = unsafe {
        if block {
            ffi::fi_cq_sread(ep.cq, buf.as_mut_ptr().cast(), BATCH, ptr::null(), WAIT_MS)
        } else {
            ffi::fi_cq_read(ep.cq, buf.as_mut_ptr().cast(), BATCH)
        }
    };
    if n > 0 {
        let (mut ops, mut bytes) = (0, 0);
        for e in &buf[..n as usize] {
            // SAFETY: every operation is posted with an OpCtx, and each
            // completion is read once.
            let (o, b) = unsafe { complete(e.op_context, Ok(())) };
            ops += o;
            bytes += b;
        }
        shared.credits.give(ops, bytes);
        return n as usize;
    }
    if n != -(ffi::FI_EAVAIL as isize) {
        return 0;
    }
    let mut err = ffi::fi_cq_err_entry::default();
    // SAFETY: one error entry into `err`.
    if unsafe { ffi::fi_cq_readerr(ep.cq, &mut err, 0) } != 1 {
        return 0;
    }
    let op = if err.flags & u64::from(ffi::FI_READ) != 0 {
        "READ"
    } else {
        "WRITE"
    };
    let e = FabricError::Completion {
        op,
        code: err.err,
        prov: err.prov_errno,
        text: strerror(i64::from(err.err)),
    };
    // SAFETY: as above.
    let (ops, bytes) = unsafe { complete(err.op_context, Err(e)) };
    shared.credits.give(ops, bytes);
    1
}

/// A thread waiting on a small request of this endpoint reads its
/// completions itself (and so, on providers with manual progress, moves
/// the endpoint's data): one hand-over less than waiting for the progress
/// thread, which stands aside while a waiter polls.
impl Progress for Shared {
    fn progress(&self) -> bool {
        self.driven.fetch_add(1, Ordering::Relaxed);
        let mut buf = [ffi::fi_cq_entry::default(); BATCH];
        reap(self, &mut buf, false) > 0
    }
}

/// A waiting thread polls every rail's queue.
impl Progress for Rails {
    fn progress(&self) -> bool {
        let mut any = false;
        for shared in &self.all {
            any |= shared.progress();
        }
        any
    }
}

/// The endpoint's progress thread: reads completions until `stop`, then
/// for a grace period while operations are still in flight. While this
/// agent's operations are in flight or wait to be posted, and for
/// [`SPIN_AFTER`] after the last completion it read, it polls the queue
/// (which also drives providers with manual progress), yielding instead
/// while a waiting thread polls it; otherwise it blocks in the queue's
/// wait object. A queue without one (`shm`, `efa`: their peers cannot wake
/// this process) is polled without pause also while peers are attached to
/// this endpoint as targets (their operations may need this side's
/// progress, and nothing tells when) or a waiting thread polls it; with
/// none of that there is nothing to poll for, and the thread parks until a
/// submission, a peer attaching or the transport's drop unparks it (or
/// [`WAIT_MS`] passes, for its watch over stalled links).
pub(super) fn progress(shared: &Shared, stop: &AtomicBool) {
    let (ep, credits) = (&*shared.ep, &shared.credits);
    let mut buf = [ffi::fi_cq_entry::default(); BATCH];
    let mut stopping: Option<Instant> = None;
    let mut watched = Instant::now();
    let mut active: Option<Instant> = None;
    let mut seen_driven = 0u64;
    let _ = shared.thread.set(std::thread::current());
    loop {
        drain(shared);
        if watched.elapsed() >= Duration::from_millis(WAIT_MS as u64) {
            watch(shared);
            watched = Instant::now();
        }
        if stopping.is_none() && stop.load(Ordering::Acquire) {
            stopping = Some(Instant::now());
        }
        if let Some(t) = stopping
            && (shared.held.load(Ordering::Acquire) == 0 || t.elapsed() > CLOSE_GRACE)
        {
            return;
        }
        // Operations waiting to be posted count as work too: room may come
        // back without a completion (a provider still reaching its peer),
        // and some providers' blocking reads ignore their timeout.
        // Closing: what the provider still holds, abandoned or not.
        let busy = credits.in_flight() > 0
            || active.is_some_and(|t| t.elapsed() < SPIN_AFTER)
            || !lock(&shared.backlog).is_empty()
            || stopping.is_some();
        let driven = shared.driven.load(Ordering::Relaxed);
        let waiter = driven != seen_driven;
        seen_driven = driven;
        if ep.waits {
            // A waiter polling the queue meanwhile (see `Progress`): it
            // reads the completions; this thread stands aside.
            if busy && waiter {
                std::thread::yield_now();
                continue;
            }
        }
        // Without a wait object, nothing tells this thread when a peer's
        // operation needs this side's progress: while peers are attached it
        // polls without pause, beside a waiter too.
        let busy = busy || (!ep.waits && (waiter || shared.inbound.load(Ordering::Acquire) > 0));
        let n = reap(shared, &mut buf, ep.waits && !busy);
        if n > 0 {
            active = Some(Instant::now());
        } else if busy {
            std::thread::yield_now();
        } else if !ep.waits {
            std::thread::park_timeout(Duration::from_millis(WAIT_MS as u64));
        }
    }
}

/// How long the progress thread keeps polling after the last completion it
/// read.
const SPIN_AFTER: Duration = Duration::from_micros(500);
