//! The RDMA link's small-request paths: a request planned once and posted
//! again (a prepared transfer's plan, and the last small request this
//! link took, remembered), and the post of a planned request (through the
//! express lane when it fits, else the pending table and the send queue).
//!
//! The engine names none of this: it hands requests to the link
//! ([`Link::submit`]), asks the peer's link to post a request again
//! ([`Link::resubmit`]), and posts prepared transfers through
//! [`Prepared`]. Why the remembered request and the lane exist, and what
//! they were measured to save, is in `docs/architecture.md`.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::agent::{Progress, TransferOp, TransferRequest, TransferStatus};
use crate::engine::ctx::Ctx;
use crate::engine::rdma::RdmaLink;
use crate::engine::socket_link::Pending;
use crate::engine::{Peer, rdma};
use crate::error::Error;
use crate::memory::MemoryDescs;
use crate::registry::{LocalRegion, RegionGuard};
use crate::small::Few;
use crate::status::Prepared;

/// Largest request (in descriptors) a link remembers: remembering is for
/// latency-bound requests sent again and again; comparing a large request
/// costs what resolving it does.
pub(in crate::engine) const REMEMBER_MAX_DESCS: usize = 4;

/// The resolution of the last small request a link took, reused when the
/// next request to the same peer is the same (same operation and
/// descriptors) and still valid: the link not broken, no deregistration
/// since (the registry's generation). What a caller resubmitting one
/// request gets from a prepared transfer, without preparing; unlike a
/// prepared transfer it holds no region.
pub(crate) struct Remembered {
    op: TransferOp,
    local: MemoryDescs,
    remote: MemoryDescs,
    /// Registry generation read before the regions were resolved.
    generation: u64,
    regions: Few<Arc<LocalRegion>>,
    /// Shared with the submissions in flight: a hit takes one reference
    /// (no copy of the work requests) and lets the entry go.
    planned: Arc<Planned>,
}

impl Remembered {
    fn matches(&self, req: &TransferRequest) -> bool {
        self.op == req.op && self.local == req.local && self.remote == req.remote
    }
}

/// A request's work requests on one link, ready to post again.
pub(in crate::engine) struct Planned {
    pub(in crate::engine) op: TransferOp,
    pub(in crate::engine) wrs: Few<rdma::Wr>,
    /// `Some` for requests whose waiters poll the completion queue.
    pub(in crate::engine) driver: Option<Weak<dyn Progress>>,
}

/// What an RDMA prepared transfer keeps: the plan on one link of one peer
/// entry, and holds on the local regions (registered, their keys valid,
/// while it lives).
pub(in crate::engine) struct PreparedRdma {
    pub(in crate::engine) peer: Arc<Peer>,
    pub(in crate::engine) link: Arc<RdmaLink>,
    pub(in crate::engine) planned: Planned,
    pub(in crate::engine) guards: Few<RegionGuard>,
}

impl Prepared for PreparedRdma {
    fn post(&self, sync: Option<&[u8]>, _durable: bool) -> Option<Result<TransferStatus, Error>> {
        // Still valid: the peer entry not replaced or invalidated, the
        // link not broken.
        if self.peer.retired.load(Ordering::Acquire) || self.link.is_broken() {
            return None;
        }
        let p = &self.planned;
        Some(self.link.post_planned(
            p.op,
            Cow::Borrowed(&p.wrs),
            sync.map(<[u8]>::to_vec),
            self.guards.clone(),
            &p.driver,
        ))
    }
}

/// A [`RdmaLink::post_express`] hold for holds already taken: moves `taken`
/// into the lane's list.
fn hold_all(into: &mut Few<RegionGuard>, taken: &mut Few<RegionGuard>) -> bool {
    std::mem::swap(into, taken);
    true
}

impl RdmaLink {
    /// Keeps `req`'s resolution for the next identical request (in the
    /// entry's own allocations when there is one). `guards`: its holds,
    /// taken after the registry's `generation` was read.
    pub(in crate::engine) fn remember(
        &self,
        req: &TransferRequest,
        generation: u64,
        guards: &[RegionGuard],
        planned: Planned,
    ) {
        let Ok(mut slot) = self.parts.remembered.try_lock() else {
            return;
        };
        let regions = guards.iter().map(|g| Arc::clone(g.region())).collect();
        match slot.as_deref_mut() {
            Some(c) => {
                c.op = req.op;
                c.local.mem_type = req.local.mem_type;
                c.local.descs.clone_from(&req.local.descs);
                c.remote.mem_type = req.remote.mem_type;
                c.remote.descs.clone_from(&req.remote.descs);
                c.generation = generation;
                c.regions = regions;
                c.planned = Arc::new(planned);
            }
            None => {
                *slot = Some(Box::new(Remembered {
                    op: req.op,
                    local: req.local.clone(),
                    remote: req.remote.clone(),
                    generation,
                    regions,
                    planned: Arc::new(planned),
                }))
            }
        }
    }

    /// Posts `req` again when it is the request this link remembers, still
    /// valid; `None`, with nothing held or claimed: resolve it in full.
    ///
    /// The latency-bound case goes in one pass: one data work request
    /// without a sync message, taken by the express lane. The region holds
    /// go straight into the lane, and nothing of this layer's error type
    /// travels through the general path's calls (which on soft-RoCE's
    /// 8-byte ping-pong was a fifth of the library's instructions before
    /// the post). A remembered request the lane turns away (taken by
    /// another request) is posted the ordinary way.
    pub(in crate::engine) fn resubmit_remembered(
        &self,
        cx: Ctx<'_>,
        req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        if req.local.descs.len() > REMEMBER_MAX_DESCS
            || req
                .sync_message
                .as_ref()
                .is_some_and(|m| m.len() > rdma::SYNC_MSG_MAX)
        {
            return None;
        }
        let slot = self.parts.remembered.try_lock().ok()?;
        let c = slot
            .as_deref()
            .filter(|c| c.matches(req) && !self.is_broken())?;
        let registry = &cx.registry();
        let p = &c.planned;
        if let (None, Some(driver), [wr]) = (&req.sync_message, &p.driver, p.wrs.as_slice()) {
            let id = self.in_flight.next_id();
            let hold = |g: &mut Few<RegionGuard>| registry.hold_into(&c.regions, c.generation, g);
            if let Some(completion) = self.post_express(id, req.op, wr, hold, driver) {
                return Some(Ok(TransferStatus::new(
                    id,
                    completion,
                    Arc::clone(&self.path),
                )));
            }
        }
        let guards = registry.hold_current(&c.regions, c.generation)?;
        // Posted with the entry still locked (no reference on the plan
        // taken and dropped): nothing on the posting path takes this lock,
        // and a thread that finds it taken meanwhile resolves in full.
        let r = self.post_planned(
            req.op,
            Cow::Borrowed(&p.wrs),
            req.sync_message.clone(),
            guards,
            &p.driver,
        );
        drop(slot);
        Some(r)
    }

    /// Posts planned work requests as a new request: its status, whose
    /// waiters drive `driver` (`None`: the progress thread completes it).
    pub(in crate::engine) fn post_planned(
        &self,
        op: TransferOp,
        wrs: Cow<'_, Few<rdma::Wr>>,
        sync: Option<Vec<u8>>,
        mut guards: Few<RegionGuard>,
        driver: &Option<Weak<dyn Progress>>,
    ) -> Result<TransferStatus, Error> {
        let id = self.in_flight.next_id();
        if let (None, Some(d), [wr]) = (&sync, driver, wrs.as_slice())
            && let Some(c) = self.post_express(id, op, wr, |g| hold_all(g, &mut guards), d)
        {
            // No clock touched: the link's idle check watches the table,
            // which express requests stay out of (their queue pair's own
            // timeouts fail them).
            return Ok(TransferStatus::new(id, c, Arc::clone(&self.path)));
        }
        let driven = driver.is_some();
        let bytes = wrs.iter().map(|w| w.len).sum();
        let completion = self
            .in_flight
            .completion(driver.clone(), &self.meter, bytes);
        // A sync message is two events: its SEND's completion, and the
        // target's acknowledgement that it delivered it.
        let events = wrs.len() + 2 * usize::from(sync.is_some());
        if events == 0 {
            completion.complete(Ok(()));
            return Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)));
        }
        let pending = Arc::new(Pending {
            completion: Arc::clone(&completion),
            outstanding: AtomicUsize::new(events),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            guards: Mutex::new(guards),
            undriven: (!driven).then(|| Arc::clone(&self.parts.undriven)),
        });
        self.insert(id, Arc::clone(&pending))?;
        self.clock.touch();
        if !driven {
            // Counted before posting: the progress threads must be on
            // the completion queue by the time it completes.
            self.parts.undriven.fetch_add(1, Ordering::AcqRel);
            self.wake_progress();
        }
        self.post_rdma(id, op, wrs.into_owned(), sync, &pending);
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }
}
