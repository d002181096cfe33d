//! The RDMA link's behaviour at the initiator: opening, submitting,
//! posting (the express lane, a lone work request, the send queue pumped
//! within the window and the multi-queue-pair gate; aborted work skipped)
//! and completions. Its progress threads: `progress`.

use crate::agent::{
    Completion, DataPath, Progress, TransferOp, TransferRequest, TransferStatus, TransportKind,
};
use crate::config::AgentConfig;
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::rdma::RdmaLink;
use crate::engine::rdma::recv::rdma_connect;
use crate::engine::socket_link::{Checks, Frames, Job, Pending, SocketPath, connect_streams};
use crate::engine::transport::Submission;
use crate::engine::transport::{PreparedHold, Resolved};
use crate::engine::{Peer, lock, rdma};
use crate::error::Error;
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use crate::small::Few;
use crate::status::{DRIVE_MAX_BYTES, Prepared};
use crate::verbs::Device;
use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::fast;

impl Progress for RdmaLink {
    fn progress(&self) -> bool {
        // Every queue pair is drained (no short cut at the first with
        // completions).
        self.parts
            .qps
            .iter()
            .map(|c| self.drain_rdma(c, false))
            .sum::<usize>()
            > 0
    }
}

/// A checked request's commit, made on the link's first stream's thread
/// once its data's work requests ended (see
/// [`RdmaLink::submit_checked`]).
pub(in crate::engine) struct CheckedCommit {
    req: u64,
    op: TransferOp,
    checks: Checks,
    sync: Option<Vec<u8>>,
    /// The request's record: one event, the target's answer.
    pending: Arc<Pending>,
    /// How its data's work requests ended.
    data: Result<(), Error>,
}

impl SocketPath for rdma::RdmaParts {
    type Job = CheckedCommit;

    fn submit(link: Arc<RdmaLink>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        link.submit_rdma(sub)
    }

    fn prepare(
        link: Arc<RdmaLink>,
        cx: Ctx<'_>,
        peer: Arc<Peer>,
        req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<Box<dyn Prepared>, Error> {
        if req.integrity {
            // Checked requests are submitted in full each time.
            return Ok(PreparedHold::keep(resolved));
        }
        Ok(Box::new(link.prepare_rdma(cx, peer, req, resolved)?))
    }

    fn resubmit(
        link: &RdmaLink,
        cx: Ctx<'_>,
        req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        link.resubmit_remembered(cx, req)
    }

    fn threads(&self) -> usize {
        // One progress thread per queue pair.
        self.qps.len()
    }

    /// A checked request's data moved: its commit, with the checks of
    /// what it moved (a READ's destination summed now), or its failure
    /// (an abort asked meanwhile takes effect here).
    fn run_job(
        link: &RdmaLink,
        _: std::os::fd::RawFd,
        job: Self::Job,
    ) -> Result<Option<Frames>, Error> {
        let CheckedCommit {
            req,
            op,
            checks,
            sync,
            pending,
            data,
        } = job;
        let data = data.and_then(|()| {
            if pending.completion.abort_requested() {
                Err(Error::Aborted)
            } else {
                Ok(())
            }
        });
        if let Err(e) = data {
            link.complete_event(req, &pending, Err(e));
            return Ok(None);
        }
        // SAFETY: every work request of the data completed; the request's
        // regions are held by `pending` until the target's answer finishes
        // it.
        let checks = unsafe { checks.into_table() };
        Ok(Some(Frames::commit_beside(
            req, op, sync, checks, pending, false,
        )))
    }

    fn on_fail(&self) {
        for r in &self.qps {
            // Flush every posted work request; the progress threads drain
            // the completions and exit when none is left.
            let _ = lock(&r.qp).set_error();
        }
    }

    fn forget(&self) {
        *lock(&self.remembered) = None;
    }

    fn on_closed(&self, cause: Error) {
        self.finish_express(Err(cause), true);
        // Its holds on local regions go with the link.
        self.forget();
    }
}

impl RdmaLink {
    /// Opens the control stream to `peer` and, over it,
    /// [`qps_per_peer`](crate::RdmaConfig::qps_per_peer) queue pairs, with
    /// a progress thread each.
    pub(in crate::engine) fn open(
        cx: Ctx<'_>,
        dev: &Arc<Device>,
        peer: &AgentDesc,
    ) -> Result<Arc<Self>, Error> {
        let cfg = &cx.config();
        let mut qps = Vec::with_capacity(cfg.rdma.qps_per_peer);
        let streams = connect_streams(cx, peer, 1, |_, sock, clock, _| {
            for k in 0..cfg.rdma.qps_per_peer {
                qps.push(rdma_connect(cx, dev, peer, sock, clock, k)?);
            }
            Ok(())
        })?;
        let path = DataPath {
            transport: TransportKind::Rdma,
            device: Some(dev.name().to_owned()),
            mechanism: "one-sided RDMA WRITE/READ on RC queue pairs, zero copy",
        };
        let link = Self::start(cx, peer, streams, rdma::RdmaParts::new(qps), path)?;
        let adaptive = cfg.rdma.progress == crate::agent::RdmaProgress::Adaptive;
        let mut progress = Vec::new();
        for k in 0..link.parts.qps.len() {
            let l = Arc::clone(&link);
            let name = format!("kvxfer-rdma-{}-{k}", peer.name);
            match link.spawn(name, move || l.run_rdma_progress(k, adaptive)) {
                Ok(t) => progress.push(t),
                Err(e) => {
                    link.fail(Error::Closed);
                    link.join();
                    return Err(e);
                }
            }
        }
        let _ = link.parts.progress_threads.set(progress);
        Ok(link)
    }

    /// Submits an RDMA request: its work requests planned on this link's
    /// queue pairs (and a small one remembered for its next submission),
    /// then posted.
    fn submit_rdma(self: Arc<Self>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        let Submission {
            cx,
            req,
            resolved,
            sync,
            fence,
            generation,
            ..
        } = sub;
        let config = &cx.config();
        let wrs = plan_rdma(req, &resolved, &self, config)?;
        if req.integrity && !wrs.is_empty() {
            return self.submit_checked(req, resolved, sync, wrs);
        }
        let driver = small(req).then(|| self.driver());
        if !fence && req.local.descs.len() <= fast::REMEMBER_MAX_DESCS && driver.is_some() {
            let planned = fast::Planned {
                op: req.op,
                wrs: wrs.clone(),
                driver: driver.clone(),
            };
            self.remember(req, generation, &resolved.guards, planned);
        }
        self.post_planned(req.op, Cow::Owned(wrs), sync, resolved.guards, &driver)
    }

    /// Submits a checked request (end-to-end integrity): its work
    /// requests go as a request of their own, without a status or a sync
    /// message; once they ended, the first stream's thread commits the
    /// request over the stream with the CRC32C of each range over this
    /// side (a WRITE's source summed now, before posting; a READ's
    /// destination once it landed) and its sync message, and the target
    /// checks its side before it delivers the message and answers. The
    /// request finishes with that answer. An abort takes effect once the
    /// data's work requests ended (they are not cut short).
    fn submit_checked(
        self: Arc<Self>,
        req: &TransferRequest,
        resolved: Resolved,
        sync: Option<Vec<u8>>,
        wrs: Few<rdma::Wr>,
    ) -> Result<TransferStatus, Error> {
        let checks = Checks::new(req, &resolved.keys);
        let id = self.in_flight.next_id();
        let completion = self
            .in_flight
            .completion(None, &self.meter, req.local.total_len());
        let pending = Pending::new(&completion, 1, resolved.guards, None);
        self.insert(id, Arc::clone(&pending))?;
        // The data: its own record in the table (the link's failure
        // fails it), unmetered, completed by the progress threads.
        let data_id = self.in_flight.next_id();
        let data = crate::agent::Completion::counted(None, None);
        let undriven = Arc::clone(&self.parts.undriven);
        let data_pending = Pending::new(&data, wrs.len(), Few::new(), Some(Arc::clone(&undriven)));
        if let Err(e) = self.insert(data_id, Arc::clone(&data_pending)) {
            self.complete_event(id, &pending, Err(e.clone()));
            return Err(e);
        }
        let tx = self.streams[0].tx.clone();
        let op = req.op;
        let commit = Arc::clone(&pending);
        data.watch(Box::new(move |result| {
            // Short and non-blocking, as a completion's watcher must be:
            // the stream's thread does the rest (when the link broke, that
            // thread is gone and the link's failure fails the request).
            let _ = tx.send(Job::Path(CheckedCommit {
                req: id,
                op,
                checks,
                sync,
                pending: commit,
                data: result,
            }));
        }));
        self.clock.touch();
        // Counted before posting: the progress threads must be on the
        // completion queue by the time it completes.
        undriven.fetch_add(1, Ordering::AcqRel);
        self.wake_progress();
        self.post_rdma(data_id, op, wrs, None, &data_pending);
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }

    /// What a prepared RDMA transfer keeps: its plan on this link and the
    /// holds on its local regions.
    fn prepare_rdma(
        self: Arc<Self>,
        cx: Ctx<'_>,
        peer: Arc<Peer>,
        req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<fast::PreparedRdma, Error> {
        let config = &cx.config();
        let wrs = plan_rdma(req, &resolved, &self, config)?;
        let driver = small(req).then(|| self.driver());
        Ok(fast::PreparedRdma {
            peer,
            link: self,
            planned: fast::Planned {
                op: req.op,
                wrs,
                driver,
            },
            guards: resolved.guards,
        })
    }

    /// What a waiting thread polls for this link's completions (weak: a
    /// status must not keep the link alive).
    fn driver(self: &Arc<Self>) -> std::sync::Weak<dyn Progress> {
        let strong: Arc<dyn Progress> = Arc::clone(self) as Arc<dyn Progress>;
        Arc::downgrade(&strong)
    }

    /// Wakes the RDMA progress threads (parked while no large request is
    /// in flight).
    pub(in crate::engine) fn wake_progress(&self) {
        for t in self.parts.progress_threads.get().into_iter().flatten() {
            t.unpark();
        }
    }

    fn broken_cause(&self) -> Option<Error> {
        if !self.is_broken() {
            return None;
        }
        lock(&self.pending).broken.clone()
    }

    /// Queues a request's work requests (then its sync message as a SEND)
    /// and posts as many as the send window allows; the progress thread
    /// posts the rest as completions free the window. Never blocks.
    pub(in crate::engine) fn post_rdma(
        &self,
        id: u64,
        op: TransferOp,
        wrs: Few<rdma::Wr>,
        sync: Option<Vec<u8>>,
        pending: &Arc<Pending>,
    ) {
        let n = self.parts.qps.len();
        if n == 1 {
            // One queue pair: everything in order on it, no gate.
            let conn = &self.parts.qps[0];
            let mut q = lock(&conn.queue);
            // One data work request, nothing queued before it, room in the
            // window: posted at once, without going through the queue.
            if let ([wr], None) = (wrs.as_slice(), &sync)
                && self.room_alone(conn, &q, wr)
            {
                // SAFETY: the pieces lie in regions held by the request's
                // guards until its completion.
                if let Err(err) = unsafe { self.post_alone(conn, q, id, op, wr) } {
                    self.complete_event(id, pending, Err(err.clone()));
                    self.fail(err);
                }
                return;
            }
            let count = wrs.len() + usize::from(sync.is_some());
            conn.count_queued(count as u64);
            conn.waiting.fetch_add(count, Ordering::SeqCst);
            for wr in wrs {
                q.items
                    .push_back((rdma::Queued::Data { id, op, wr }, Arc::clone(pending)));
            }
            if let Some(msg) = sync {
                let gate = rdma::schedule::Gate::default();
                q.items
                    .push_back((rdma::Queued::Sync { id, msg, gate }, Arc::clone(pending)));
            }
            self.pump_locked(conn, q);
            return;
        }
        // Work requests go round the queue pairs, starting where the
        // previous request left off, so small requests spread too.
        let start = self
            .parts
            .next_stripe
            .fetch_add(wrs.len().max(1), Ordering::Relaxed);
        let mut per_qp: Vec<Vec<rdma::Wr>> = (0..n).map(|_| Vec::new()).collect();
        for (qp, wr) in rdma::schedule::stripe(start, wrs.len(), n).zip(wrs) {
            per_qp[qp].push(wr);
        }
        let mut touched = vec![false; n];
        for ((conn, wrs), t) in self.parts.qps.iter().zip(per_qp).zip(&mut touched) {
            if wrs.is_empty() {
                continue;
            }
            *t = true;
            let mut q = lock(&conn.queue);
            conn.count_queued(wrs.len() as u64);
            conn.waiting.fetch_add(wrs.len(), Ordering::SeqCst);
            for wr in wrs {
                q.items
                    .push_back((rdma::Queued::Data { id, op, wr }, Arc::clone(pending)));
            }
        }
        if let Some(msg) = sync {
            touched[0] = true;
            // After everything queued so far on the other queue pairs
            // (this request's data included): RC orders the SEND only
            // behind its own queue pair's work.
            let gate = rdma::schedule::Gate::behind(
                self.parts.qps[1..]
                    .iter()
                    .map(|c| c.queued.load(Ordering::Acquire)),
            );
            let conn = &self.parts.qps[0];
            let mut q = lock(&conn.queue);
            conn.count_queued(1);
            conn.waiting.fetch_add(1, Ordering::SeqCst);
            q.items
                .push_back((rdma::Queued::Sync { id, msg, gate }, Arc::clone(pending)));
        }
        for (conn, _) in self.parts.qps.iter().zip(touched).filter(|(_, t)| *t) {
            self.pump(conn);
        }
    }

    /// Whether a sync message's gate is open: every work request it waits
    /// for on the other queue pairs has completed.
    fn gate_open(&self, gate: &rdma::schedule::Gate) -> bool {
        gate.open(
            self.parts.qps[1..]
                .iter()
                .map(|c| c.completed.load(Ordering::Acquire)),
        )
    }

    /// Posts queued work requests while the window and the message buffers
    /// allow, in order, up to [`rdma::DOORBELL_BATCH`] per doorbell. On a
    /// broken link, fails every queued one instead (each counts its events,
    /// so requests still complete exactly once).
    pub(in crate::engine) fn pump(&self, conn: &rdma::RdmaConn) {
        self.pump_locked(conn, lock(&conn.queue));
    }

    /// [`pump`](Self::pump) with the send queue's lock already held. Work
    /// of aborted requests met at the head of the queue is not posted: it
    /// counts as done (for the gates of later sync messages) and its events
    /// fail with [`Error::Aborted`], once the lock is let go.
    fn pump_locked<'c>(
        &self,
        conn: &'c rdma::RdmaConn,
        q: std::sync::MutexGuard<'c, rdma::SendQueue>,
    ) {
        let mut skipped = Vec::new();
        self.pump_queue(conn, q, &mut skipped);
        for (item, p) in skipped {
            for _ in 0..item.events() {
                self.complete_event(item.id(), &p, Err(Error::Aborted));
            }
        }
    }

    /// The pump's loop: batches taken from the head of the queue and
    /// posted, one doorbell each, until the queue is empty or the window,
    /// the message buffers or a gate stop it.
    fn pump_queue<'c>(
        &self,
        conn: &'c rdma::RdmaConn,
        mut q: std::sync::MutexGuard<'c, rdma::SendQueue>,
        skipped: &mut Vec<(rdma::Queued, Arc<Pending>)>,
    ) {
        // A basic queue pair may post part of a failed batch: one at a time.
        let batch_max = if conn.batch_is_atomic {
            rdma::DOORBELL_BATCH
        } else {
            1
        };
        loop {
            if q.items.is_empty() {
                return;
            }
            if let Some(cause) = self.broken_cause() {
                self.fail_queued(conn, q, &cause);
                return;
            }
            self.take_batch(conn, &mut q, batch_max, skipped);
            let n = q.batch.len();
            if n == 0 {
                return;
            }
            conn.posted.fetch_add(n, Ordering::AcqRel);
            let r = post_queued_batch(conn, &mut q);
            conn.waiting.fetch_sub(n, Ordering::SeqCst);
            match r {
                // Still holding the lock: go on while work is queued.
                Ok(()) => q.batch.clear(),
                Err(e) => {
                    self.fail_batch(conn, q, e);
                    // The link is broken now: the next pass fails what is
                    // queued.
                    q = lock(&conn.queue);
                }
            }
        }
    }

    /// Fills `q.batch` from the head of the queue, up to `batch_max` work
    /// requests, while the window and the message buffers have room and no
    /// gate is shut ([`rdma::schedule::take_batch`]); aborted requests'
    /// work met on the way goes to `skipped`, counted as done.
    fn take_batch(
        &self,
        conn: &rdma::RdmaConn,
        q: &mut rdma::SendQueue,
        batch_max: usize,
        skipped: &mut Vec<(rdma::Queued, Arc<Pending>)>,
    ) {
        let rdma::SendQueue { items, batch, .. } = q;
        batch.clear();
        let before = skipped.len();
        let needs = |(item, _): &(rdma::Queued, Arc<Pending>)| match item {
            rdma::Queued::Data { wr, .. } => rdma::schedule::Needs::Data(wr.len),
            rdma::Queued::Sync { msg, gate, .. } => rdma::schedule::Needs::Sync {
                len: msg.len() as u64,
                open: self.gate_open(gate),
            },
        };
        let aborted = |(_, p): &(rdma::Queued, Arc<Pending>)| p.completion.abort_requested();
        let mut room = LinkRoom(conn);
        rdma::schedule::take_batch(items, batch, batch_max, needs, aborted, &mut room, skipped);
        // Still counted in `waiting` until posted (the batch) or skipped, so
        // an express request cannot overtake them in between.
        for _ in before..skipped.len() {
            conn.waiting.fetch_sub(1, Ordering::SeqCst);
            conn.count_completed();
        }
    }

    /// The link is broken: every queued work request fails with `cause`
    /// (each counts its events, so requests still complete exactly once).
    fn fail_queued(
        &self,
        conn: &rdma::RdmaConn,
        mut q: std::sync::MutexGuard<'_, rdma::SendQueue>,
        cause: &Error,
    ) {
        let drained: Vec<_> = q.items.drain(..).collect();
        conn.waiting.fetch_sub(drained.len(), Ordering::AcqRel);
        drop(q);
        for (item, p) in drained {
            for _ in 0..item.events() {
                self.complete_event(item.id(), &p, Err(cause.clone()));
            }
        }
    }

    /// A batch the queue pair refused (nothing of it was posted: atomic
    /// batches, or one): its window slots and message buffers given back,
    /// its events failed, the link failed.
    fn fail_batch(
        &self,
        conn: &rdma::RdmaConn,
        mut q: std::sync::MutexGuard<'_, rdma::SendQueue>,
        e: crate::verbs::VerbsError,
    ) {
        let failed = std::mem::take(&mut q.batch);
        // Slots are unwound under the queue's lock, as they were taken.
        for _ in 0..failed.len() {
            conn.unwind_slot();
        }
        drop(q);
        conn.posted.fetch_sub(failed.len(), Ordering::AcqRel);
        let err = rdma::rdma_err(&self.remote, e);
        for ((item, p), slot) in failed.into_iter().rev() {
            if let Some(slot) = slot {
                conn.sends.release(slot);
            }
            for _ in 0..item.events() {
                self.complete_event(item.id(), &p, Err(err.clone()));
            }
        }
        self.fail(err);
    }

    /// Whether `wr` may be posted at once, bypassing the send queue `q`:
    /// nothing queued before it, the link whole, a window slot taken for it.
    fn room_alone(&self, conn: &rdma::RdmaConn, q: &rdma::SendQueue, wr: &rdma::Wr) -> bool {
        q.items.is_empty() && !self.is_broken() && conn.try_take_slot(wr.len)
    }

    /// Posts `wr` as work request `wr_id` with the send queue's lock `q`
    /// held and a window slot taken ([`room_alone`](Self::room_alone)); on
    /// failure gives the slot back and returns the error (the caller fails
    /// the request and the link).
    ///
    /// # Safety
    /// The pieces of `wr` must lie in regions held until its completion.
    unsafe fn post_alone(
        &self,
        conn: &rdma::RdmaConn,
        q: std::sync::MutexGuard<'_, rdma::SendQueue>,
        wr_id: u64,
        op: TransferOp,
        wr: &rdma::Wr,
    ) -> Result<(), Error> {
        conn.count_queued(1);
        conn.posted.fetch_add(1, Ordering::AcqRel);
        let post = rdma::data_post(wr_id, op, wr, &wr.sges);
        // SAFETY: forwarded contract.
        let r = unsafe { lock(&conn.qp).post_batch(std::slice::from_ref(&post)) };
        let Err(e) = r else {
            return Ok(());
        };
        conn.unwind_slot();
        drop(q);
        conn.posted.fetch_sub(1, Ordering::AcqRel);
        Err(rdma::rdma_err(&self.remote, e))
    }

    /// Posts request `id` (one data work request `wr`) in the express lane
    /// when the lane is free, nothing is queued before it and the link is
    /// whole ([`ExpressLane`]); returns its status, or `None` for the
    /// ordinary path. `hold` puts the request's region holds into the
    /// lane's (empty) list once the lane is claimed; false (holds no longer
    /// current, the list left empty) frees the lane again: `None`. Not
    /// called when the lane is not taken.
    pub(in crate::engine) fn post_express(
        &self,
        id: u64,
        op: TransferOp,
        wr: &rdma::Wr,
        hold: impl FnOnce(&mut Few<RegionGuard>) -> bool,
        driver: &std::sync::Weak<dyn Progress>,
    ) -> Option<Arc<Completion>> {
        let [conn] = self.parts.qps.as_slice() else {
            return None;
        };
        let post = rdma::data_post(id | rdma::EXPRESS_FLAG, op, wr, &wr.sges);
        if !crate::verbs::SharedPoster::fits(&post) {
            return None;
        }
        let mut claim = self.parts.express.claim()?;
        // Sequentially consistent with the count a submitter raises before
        // it queues (and the pump lowers only after posting): either this
        // sees that work, or that work comes after this request. (Dropping
        // the claim frees the lane.)
        if conn.waiting.load(Ordering::SeqCst) != 0 || self.is_broken() {
            return None;
        }
        let completion = claim.with_slot(|slot| {
            if !hold(&mut slot.guards) {
                return None;
            }
            let new = || {
                self.in_flight
                    .completion(Some(driver.clone()), &self.meter, wr.len)
            };
            let status = slot.status.get_or_insert_with(new);
            match Arc::get_mut(status) {
                // Unique: the caller dropped the status it was behind.
                Some(c) => c.reset(wr.len),
                None => *status = new(),
            }
            Some(Arc::clone(status))
        })?;
        conn.posted.fetch_add(1, Ordering::AcqRel);
        claim.post();
        // SAFETY: the pieces lie in regions held (in the lane) until the
        // work request's completion is handled; the connection's queue pair
        // is alive (we hold the link); `post` fits (checked above).
        if let Err(e) = unsafe { conn.poster.post(&post) } {
            conn.posted.fetch_sub(1, Ordering::AcqRel);
            let err = rdma::rdma_err(&self.remote, e);
            self.parts.finish_express(Err(err.clone()), false);
            self.fail(err);
        } else if conn.reap.look(id) {
            // A software provider completes it inside the post: reaped
            // here, the caller's wait is one load.
            self.drain_rdma(conn, false);
            conn.reap.record(completion.is_done());
        }
        Some(completion)
    }

    /// Handles one completion of `conn`'s send queue, polled by the holder
    /// of its poll lock: frees its window slot and message buffer, records
    /// its request's event (failing the link on an error completion).
    /// `touched`: whether this drain has told the link's idle clock yet (a
    /// drain of express completions alone reads no clock: the idle check
    /// watches the table, which they stay out of).
    fn on_send_completion(
        &self,
        conn: &rdma::RdmaConn,
        c: &crate::verbs::WorkCompletion,
        touched: &mut bool,
    ) {
        conn.posted.fetch_sub(1, Ordering::AcqRel);
        let express = c.wr_id & rdma::EXPRESS_FLAG != 0;
        if !express {
            // The express lane's work request takes no window slot.
            conn.count_completed();
            conn.release_slot();
            if !std::mem::replace(touched, true) {
                self.clock.touch();
            }
        }
        let (req, slot) = rdma::decode_wr_id(c.wr_id);
        if let Some(slot) = slot {
            conn.sends.release(slot);
        }
        let result = match c.ok() {
            Ok(()) => Ok(()),
            Err(e) => {
                let err = self.broken_cause().unwrap_or_else(|| match e {
                    crate::verbs::VerbsError::WorkCompletion { status_name, .. } => {
                        Error::RdmaCompletion {
                            remote: self.remote.clone(),
                            status: status_name,
                        }
                    }
                    other => rdma::rdma_err(&self.remote, other),
                });
                self.fail(err.clone());
                Err(err)
            }
        };
        if express {
            self.parts.finish_express(result, false);
            return;
        }
        // A request's last event (nothing else can count one then) is
        // taken out of the table under the same lock as the lookup.
        let mut t = lock(&self.pending);
        let found = match t.map.get(&req) {
            Some(p) if p.outstanding.load(Ordering::Acquire) == 1 => {
                t.map.remove(&req).map(|p| (p, true))
            }
            Some(p) => Some((Arc::clone(p), false)),
            None => None,
        };
        drop(t);
        match found {
            Some((p, true)) => {
                // Its count was 1 under the lock: this is its last event.
                p.event(result);
                p.finish(None);
            }
            Some((p, false)) => self.complete_event(req, &p, result),
            None => {}
        }
    }

    /// Drains the send completion queue once: frees window slots and
    /// message buffers, completes request events, fails the link on the
    /// first error completion, then posts what the freed window allows.
    /// Called by the progress thread and by threads waiting on a request
    /// (whoever gets the poll lock; the other returns at once). Returns how
    /// many completions it processed.
    /// `wait_turn`: take the poll lock even when another thread holds it
    /// (the progress thread after arming its completion channel, which
    /// must not miss a completion the other thread polled too early for).
    pub(in crate::engine) fn drain_rdma(&self, conn: &rdma::RdmaConn, wait_turn: bool) -> usize {
        let polling = if wait_turn {
            lock(&conn.polled)
        } else {
            match conn.polled.try_lock() {
                Ok(d) => d,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return 0,
            }
        };
        let mut touched = false;
        let n = match conn
            .cq
            .poll_each(|c| self.on_send_completion(conn, c, &mut touched))
        {
            Ok(n) => n,
            Err(e) => {
                self.fail(rdma::rdma_err(&self.remote, e));
                0
            }
        };
        if n == 0 {
            return 0;
        }
        // Only the holder of `polled` writes it: no read-modify-write.
        conn.drains
            .store(conn.drains.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        drop(polling);
        // The window has room again: post what is queued. (A submitter
        // counts its work in `waiting` before it tries the window; the
        // count, the window's release and its try are sequentially
        // consistent, so either the try found the room, or this sees the
        // count. A message buffer freed above is ordered by the ring's
        // lock in the same way.)
        if conn.waiting.load(Ordering::SeqCst) > 0 {
            self.pump(conn);
        }
        if conn.index != 0 {
            // A sync message on the first queue pair may wait for these.
            self.pump(&self.parts.qps[0]);
        }
        n
    }
}

impl rdma::RdmaParts {
    /// Completes the express request in flight, if any, with `result`:
    /// releases its regions, records the outcome, frees the lane.
    /// `close`: the link's last thread is leaving, no request may take
    /// the lane after this one.
    fn finish_express(&self, result: Result<(), Error>, close: bool) {
        self.express.finish(close, |slot| {
            slot.guards.clear();
            if let Some(c) = &slot.status {
                c.complete(result);
            }
        });
    }
}

/// Posts `q.batch` with one doorbell: every work request's pieces gathered
/// back to back in the queue's scratch (posting allocates nothing), a sync
/// message written into its buffer.
fn post_queued_batch(
    conn: &rdma::RdmaConn,
    q: &mut rdma::SendQueue,
) -> Result<(), crate::verbs::VerbsError> {
    let rdma::SendQueue {
        batch, sges, spans, ..
    } = q;
    sges.clear();
    spans.clear();
    for ((item, _), slot) in batch.iter() {
        let start = sges.len();
        match (item, slot) {
            (rdma::Queued::Data { wr, .. }, _) => sges.extend_from_slice(&wr.sges),
            (rdma::Queued::Sync { id, msg, .. }, Some(slot)) => {
                let len = conn.sends.write_sync(*slot, *id, msg);
                sges.push(conn.sends.sge(*slot, len));
            }
            (rdma::Queued::Sync { .. }, None) => {}
        }
        spans.push(start..sges.len());
    }
    let posts: Few<crate::verbs::Post<'_>> = batch
        .iter()
        .zip(spans.iter())
        .map(|(((item, _), slot), span)| {
            let sg = &sges[span.clone()];
            match item {
                rdma::Queued::Data { id, op, wr } => rdma::data_post(*id, *op, wr, sg),
                rdma::Queued::Sync { id, .. } => crate::verbs::Post {
                    // A sync message always has a buffer (taken with it).
                    wr_id: rdma::SEND_FLAG | ((slot.unwrap_or(0) as u64) << 40) | id,
                    op: crate::verbs::PostOp::Send { imm: 0 },
                    sges: sg,
                    host_source: true,
                },
            }
        })
        .collect();
    // SAFETY: data pieces lie in registered regions held by the requests'
    // guards, which live until every event of a request (these work
    // requests' completions among them) has happened; a message slot is
    // ours until its SEND completes.
    unsafe { lock(&conn.qp).post_batch(&posts) }
}

/// The send schedule's view of a queue pair's resources: its window slots
/// and its message buffers.
struct LinkRoom<'a>(&'a rdma::RdmaConn);

impl rdma::schedule::Room for LinkRoom<'_> {
    fn take_slot(&mut self, len: u64) -> bool {
        self.0.try_take_slot(len)
    }

    fn unwind_slot(&mut self) {
        self.0.unwind_slot();
    }

    fn take_buffer(&mut self) -> Option<usize> {
        self.0.sends.try_acquire()
    }
}

/// `req`'s work requests on `link`'s queue pairs, from its resolved local
/// and remote keys (32-bit: the RDMA transport's handles and its keys in
/// descriptors hold nothing wider).
fn plan_rdma(
    req: &TransferRequest,
    resolved: &Resolved,
    link: &RdmaLink,
    config: &AgentConfig,
) -> Result<Few<rdma::Wr>, Error> {
    let pieces: Few<_> = req
        .local
        .descs
        .iter()
        .zip(&resolved.local_keys)
        .zip(req.remote.descs.iter().zip(&resolved.remote_keys))
        .map(|((l, &lk), (r, rk))| (lk as u32, l.addr, rk.key as u32, r.addr, l.len))
        .collect();
    let conn = link.parts.qps.first().ok_or(Error::Closed)?;
    let mut wrs = rdma::plan_wrs(
        &pieces,
        conn.max_msg.min(config.tcp.segment_size).min(rdma::WR_MAX),
        conn.max_sge,
    );
    if req.local.mem_type == MemoryType::Vram {
        for w in wrs.iter_mut() {
            w.gpu = true;
        }
    }
    Ok(wrs)
}

/// Whether waiting threads poll the completion queue themselves for `req`:
/// only for small, latency-bound requests — on large ones a spinning
/// waiter takes the CPU from the stack that moves the data (measured on
/// soft-RoCE: dropped ACKs and stalls), and saves nothing.
fn small(req: &TransferRequest) -> bool {
    req.local.total_len() <= DRIVE_MAX_BYTES
}
