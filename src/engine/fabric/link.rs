//! A libfabric link to one peer: its address in the endpoint's address
//! vector and the control stream that carries its requests' commits.
//!
//! A request's operations are posted from the submitting thread while the
//! endpoint's queues have room, else queued for the progress thread, which
//! posts them as completions free room (a submission never waits for the
//! peer); each carries an [`OpCtx`] the provider hands back in its
//! completion, and the request's [`Group`] counts them. Completions are
//! read by the progress thread, or by a thread waiting on a request of at
//! most [`DRIVE_MAX_BYTES`], which polls the queue itself while the
//! progress thread stands aside (except on providers over kernel
//! sockets). When the last one has completed (a write: delivered,
//! `FI_DELIVERY_COMPLETE`; a read: landed here) the request's
//! commit (its sync message) goes to the target on the control stream, and
//! the target's acknowledgement completes the status, as on the other
//! socket links. Until then the request is not in the link's table: a link
//! that breaks fails it only after its operations have completed, so its
//! memory is never touched after its status reports. A link whose
//! operations make no progress for the I/O timeout fails with
//! `PeerTimedOut`; its peer's address leaves the address vector, which
//! cancels its operations in flight.

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvxfer_fabric as ffi;

use super::{Fabric, FabricError, Shared, WAIT_MS, check, fabric_err, strerror, waiters_poll};
use crate::agent::{DataPath, TransferOp, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::socket_link::{
    Frames, Job, Pending, Segs, SocketLink, SocketPath, Tail, connect_streams,
};
use crate::engine::transport::Submission;
use crate::engine::{Inner, attach, lock, status};
use crate::error::Error;
use crate::status::{DRIVE_MAX_BYTES, Progress};

/// A libfabric link.
pub(in crate::engine) type FabricLink = SocketLink<FabricParts>;

/// What a libfabric link adds to the control stream.
pub(in crate::engine) struct FabricParts {
    shared: Arc<Shared>,
    /// The peer's endpoint in the address vector.
    addr: ffi::fi_addr_t,
    /// Set when the address has left the address vector.
    removed: AtomicBool,
    /// When one of its operations last completed, or the first of those in
    /// flight began (what the watch over stalled links reads).
    last_progress: Mutex<Instant>,
    /// Largest operation.
    max_msg: u64,
    /// Remote addresses are virtual addresses (else offsets in the region).
    virt: bool,
    /// Requests whose operations have not all completed, and the fenced
    /// notifications waiting for them.
    open: Mutex<Open>,
    /// What a thread waiting on a small request polls (the endpoint's
    /// completion queue) rather than wait for the progress thread; `None`
    /// on providers over kernel sockets (see [`super::waiters_poll`]).
    driver: Option<Weak<dyn Progress>>,
}

#[derive(Default)]
struct Open {
    groups: usize,
    fenced: Vec<Frames>,
}

impl FabricParts {
    /// Takes the peer's address out of the address vector (once): the
    /// provider cancels the operations still in flight to it.
    fn remove_peer(&self) {
        if !self.removed.swap(true, Ordering::AcqRel) {
            self.shared.ep.remove(self.addr);
        }
    }
}

impl Drop for FabricParts {
    fn drop(&mut self) {
        self.remove_peer();
    }
}

impl SocketPath for FabricParts {
    type Job = std::convert::Infallible;

    fn submit(link: Arc<FabricLink>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        submit(link, sub)
    }

    fn run_job(
        _: &SocketLink<Self>,
        _: std::os::fd::RawFd,
        job: Self::Job,
    ) -> Result<Option<Frames>, Error> {
        match job {}
    }

    /// A broken link (its control stream lost, a stall, the agent's drop)
    /// takes its peer's address out of the address vector, on which the
    /// provider cancels what is still in flight to it (`tcp;ofi_rxm`,
    /// `verbs;ofi_rxm`), so that its requests report now rather than when
    /// the peer answers.
    fn on_fail(&self) {
        self.remove_peer();
    }
}

impl FabricLink {
    /// Opens the control stream to `peer` and, over it, fetches its
    /// endpoint's address.
    pub(in crate::engine) fn open(
        inner: &Inner,
        fabric: &Fabric,
        peer: &AgentDesc,
    ) -> Result<Arc<Self>, Error> {
        let cfg = &inner.config;
        let mut addr = None;
        let streams = connect_streams(inner, peer, 1, |_, sock, clock, _| {
            let mine = fabric
                .shared
                .ep
                .name()
                .map_err(|e| fabric_err(&peer.name, e))?;
            let answer = attach::attach(
                &peer.name,
                sock,
                clock,
                cfg.connect_timeout,
                TransportKind::Fabric,
                &mine,
            )?;
            match answer {
                Ok(name) => {
                    let a = fabric.shared.ep.insert(&name);
                    addr = Some(a.map_err(|e| fabric_err(&peer.name, e))?);
                    Ok(())
                }
                Err(st) => Err(Error::BackendUnavailable {
                    backend: "fabric",
                    reason: format!(
                        "remote agent {:?} refused the attach ({})",
                        peer.name,
                        if st == status::NO_TRANSPORT {
                            "it has no libfabric endpoint"
                        } else {
                            "it could not answer"
                        }
                    ),
                }),
            }
        })?;
        let addr = addr.ok_or(Error::Closed)?;
        let parts = FabricParts {
            shared: Arc::clone(&fabric.shared),
            addr,
            removed: AtomicBool::new(false),
            last_progress: Mutex::new(Instant::now()),
            max_msg: fabric.max_msg,
            virt: fabric.shared.ep.mr_mode & u64::from(ffi::FI_MR_VIRT_ADDR) != 0,
            open: Mutex::new(Open::default()),
            driver: waiters_poll(&fabric.offer.provider).then(|| {
                let strong: Arc<dyn Progress> = Arc::clone(&fabric.shared) as Arc<dyn Progress>;
                Arc::downgrade(&strong)
            }),
        };
        let path = DataPath {
            transport: TransportKind::Fabric,
            device: Some(format!("{}/{}", fabric.offer.provider, fabric.domain)),
            mechanism: "one-sided fi_write/fi_read on a reliable-datagram endpoint, zero copy; the notification after delivery completion",
        };
        let link = Self::start(inner, peer, streams, parts, path)?;
        let mut links = lock(&fabric.shared.links);
        links.retain(|l| l.strong_count() > 0);
        links.push(Arc::downgrade(&link));
        Ok(link)
    }
}

/// One operation: where it reads or writes here, and there.
struct Op {
    local: u64,
    desc: u64,
    remote: u64,
    key: u64,
    len: u64,
}

/// A request's operations in flight, and what follows them.
struct Group {
    link: Arc<FabricLink>,
    req: u64,
    op: TransferOp,
    pending: Arc<Pending>,
    sync: Mutex<Option<Vec<u8>>>,
    fence: bool,
    /// Operations not completed, plus one held by the poster until it has
    /// posted them all.
    remaining: AtomicUsize,
    /// Whether one failed (its error is in `pending`).
    failed: AtomicBool,
}

impl Group {
    /// Its commit: no segments (its data moved beside the stream), its
    /// sync message.
    fn commit_frames(&self, sync: Option<Vec<u8>>) -> Frames {
        Frames {
            req: self.req,
            op: self.op,
            segs: Segs::none(),
            tail: Tail::Commit {
                segments: 0,
                sync,
                durable: false,
            },
            pending: Arc::clone(&self.pending),
            aborted: false,
        }
    }

    /// One of its operations completed with `result`; the last one commits
    /// the request, or fails it.
    fn done(self: &Arc<Self>, result: Result<(), Error>) {
        if let Err(e) = result {
            // A link that broke (a stall, a lost peer): its cause rather
            // than what the provider made of it.
            let e = lock(&self.link.pending).broken.clone().unwrap_or(e);
            if !self.failed.swap(true, Ordering::AcqRel) {
                // Recorded for the status; the count of events is the
                // acknowledgement's, which now never comes.
                lock(&self.pending.error).get_or_insert(e);
                self.pending.failed.store(true, Ordering::Release);
            }
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let link = &self.link;
        let mut open = lock(&link.parts.open);
        open.groups -= 1;
        let release = if open.groups == 0 {
            std::mem::take(&mut open.fenced)
        } else {
            Vec::new()
        };
        drop(open);
        if !self.failed.load(Ordering::Acquire) && self.pending.completion.abort_requested() {
            // Aborted while its operations were in flight: they have all
            // completed; no commit (the target drops nothing: it never
            // heard of the request).
            lock(&self.pending.error).get_or_insert(Error::Aborted);
            self.pending.failed.store(true, Ordering::Release);
            self.failed.store(true, Ordering::Release);
        }
        let sync = lock(&self.sync).take();
        if self.failed.load(Ordering::Acquire) || (sync.is_none() && !self.fence) {
            // Failed; or done: every write delivered, every read landed,
            // and no message for the target to deliver after them.
            if self.pending.event(Ok(())) {
                self.pending.finish(None);
            }
        } else {
            commit(link, self.commit_frames(sync));
        }
        for f in release {
            commit(link, f);
        }
    }
}

/// Sends a request's commit (the request joins the link's table, whose
/// reader completes it on the target's acknowledgement).
fn commit(link: &FabricLink, frames: Frames) {
    let pending = Arc::clone(&frames.pending);
    if let Err(e) = link.insert(frames.req, Arc::clone(&pending)) {
        if pending.event(Err(e)) {
            pending.finish(None);
        }
        return;
    }
    link.clock.touch();
    if link.streams[0].tx.send(Job::Frames(frames)).is_err() {
        link.fail(Error::Closed);
    }
}

/// [`Link::submit`](crate::engine::transport::Link::submit) on a libfabric
/// link.
fn submit(link: Arc<FabricLink>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
    let Submission {
        req,
        resolved,
        sync,
        fence,
        ..
    } = sub;
    let parts = &link.parts;
    let mut ops = Vec::new();
    for ((l, &desc), (r, rk)) in req
        .local
        .descs
        .iter()
        .zip(&resolved.local_keys)
        .zip(req.remote.descs.iter().zip(&resolved.remote_keys))
    {
        let remote = if parts.virt { r.addr } else { r.addr - rk.base };
        let mut off = 0;
        while off < l.len {
            let len = (l.len - off).min(parts.max_msg);
            ops.push(Op {
                local: l.addr + off,
                desc,
                remote: remote + off,
                key: rk.key,
                len,
            });
            off += len;
        }
    }
    let bytes = req.local.total_len();
    // A small request's waiter polls the queue itself (no hand-over from
    // the progress thread); a large one leaves the CPU to that thread.
    let driver = parts.driver.clone().filter(|_| bytes <= DRIVE_MAX_BYTES);
    let id = link.in_flight.next_id();
    let completion = link.in_flight.completion(driver, &link.meter, bytes);
    let pending = Pending::new(&completion, 1, resolved.guards, None);
    let status = TransferStatus::new(id, completion, Arc::clone(&link.path));
    let group = Arc::new(Group {
        link: Arc::clone(&link),
        req: id,
        op: req.op,
        pending,
        sync: Mutex::new(sync),
        fence,
        remaining: AtomicUsize::new(ops.len() + 1),
        failed: AtomicBool::new(false),
    });
    {
        let mut open = lock(&parts.open);
        if group.fence && ops.is_empty() && open.groups > 0 {
            // A notification ordered after the requests still in flight:
            // sent when the last of them has completed.
            open.fenced
                .push(group.commit_frames(lock(&group.sync).take()));
            return Ok(status);
        }
        open.groups += 1;
    }
    if !ops.is_empty() {
        *lock(&parts.last_progress) = Instant::now();
    }
    let shared = &parts.shared;
    let mut queued = false;
    for op in ops {
        // Behind what already waits, or when the queues are full: for the
        // progress thread.
        if queued || !lock(&shared.backlog).is_empty() || !shared.credits.try_take() {
            lock(&shared.backlog).push_back(Queued {
                group: Arc::clone(&group),
                op,
            });
            queued = true;
            continue;
        }
        match post(&link, &group, &op) {
            Ok(true) => {}
            Ok(false) => {
                shared.credits.give(1);
                lock(&shared.backlog).push_back(Queued {
                    group: Arc::clone(&group),
                    op,
                });
                queued = true;
            }
            Err(e) => {
                shared.credits.give(1);
                group.done(Err(fabric_err(&link.remote, e)));
            }
        }
    }
    if queued || !shared.ep.waits {
        // Operations for the progress thread to post; or, without a wait
        // object, to read the completions of: it may be pausing.
        shared.wake();
    }
    // The poster's own hold.
    group.done(Ok(()));
    Ok(status)
}

/// What the provider hands back with an operation's completion: room for
/// its own use (`FI_CONTEXT2`), then the operation's group. Boxed per
/// operation; freed when its completion is read.
#[repr(C)]
struct OpCtx {
    provider: [*mut c_void; 8],
    group: Arc<Group>,
}

/// An operation waiting for room in the endpoint's queues.
pub(super) struct Queued {
    group: Arc<Group>,
    op: Op,
}

/// Posts `op` of `group` on the link's endpoint: `Ok(false)` when the
/// provider has no room for it now (`-FI_EAGAIN`).
fn post(link: &FabricLink, group: &Arc<Group>, op: &Op) -> Result<bool, FabricError> {
    let parts = &link.parts;
    let ctx = Box::into_raw(Box::new(OpCtx {
        provider: [ptr::null_mut(); 8],
        group: Arc::clone(group),
    }));
    let iov = ffi::iovec {
        iov_base: op.local as *mut c_void,
        iov_len: op.len as usize,
    };
    let mut desc = op.desc as *mut c_void;
    let rma = ffi::fi_rma_iov {
        addr: op.remote,
        len: op.len as usize,
        key: op.key,
    };
    let msg = ffi::fi_msg_rma {
        msg_iov: &iov,
        desc: &mut desc,
        iov_count: 1,
        addr: parts.addr,
        rma_iov: &rma,
        rma_iov_count: 1,
        context: ctx.cast(),
        data: 0,
    };
    let ep = parts.shared.ep.ep;
    // SAFETY: the local range lies in a region held by the request (its
    // guards, released only when the request finishes, after this
    // operation's completion); the context lives until the completion is
    // read (`complete`).
    let rc = unsafe {
        match group.op {
            TransferOp::Write => ffi::fi_writemsg(
                ep,
                &msg,
                u64::from(ffi::FI_COMPLETION | ffi::FI_DELIVERY_COMPLETE),
            ),
            TransferOp::Read => ffi::fi_readmsg(ep, &msg, u64::from(ffi::FI_COMPLETION)),
        }
    };
    let call = match group.op {
        TransferOp::Write => "fi_writemsg",
        TransferOp::Read => "fi_readmsg",
    };
    if rc == 0 {
        return Ok(true);
    }
    // SAFETY: not posted: the context is still this function's.
    drop(unsafe { Box::from_raw(ctx) });
    if rc == -(ffi::FI_EAGAIN as isize) {
        return Ok(false);
    }
    check(call, rc as i64).map(|_| false)
}

/// Posts what waits in the backlog while there is room; drops (as done)
/// the operations of requests that failed, were aborted, or whose link
/// broke.
fn drain(shared: &Shared) {
    loop {
        let Some(q) = lock(&shared.backlog).pop_front() else {
            return;
        };
        let g = &q.group;
        if g.failed.load(Ordering::Acquire) || g.link.broken.load(Ordering::Acquire) {
            g.done(Err(Error::Closed));
            continue;
        }
        if g.pending.completion.abort_requested() {
            g.done(Err(Error::Aborted));
            continue;
        }
        if !shared.credits.try_take() {
            lock(&shared.backlog).push_front(q);
            return;
        }
        match post(&g.link, g, &q.op) {
            Ok(true) => {}
            Ok(false) => {
                shared.credits.give(1);
                lock(&shared.backlog).push_front(q);
                return;
            }
            Err(e) => {
                shared.credits.give(1);
                let remote = g.link.remote.clone();
                g.done(Err(fabric_err(&remote, e)));
            }
        }
    }
}

/// Fails the links whose operations have made no progress for their I/O
/// timeout: `PeerTimedOut`, and their peers' addresses out of the address
/// vector so that the provider cancels what is in flight.
fn watch(shared: &Shared) {
    let links: Vec<_> = lock(&shared.links)
        .iter()
        .filter_map(|l| l.upgrade())
        .collect();
    for link in links {
        let parts = &link.parts;
        if lock(&parts.open).groups == 0 || link.broken.load(Ordering::Acquire) {
            continue;
        }
        let idle = lock(&parts.last_progress).elapsed();
        if idle > link.io_timeout {
            tracing::warn!(remote = %link.remote, ?idle, "libfabric operations stalled; link declared dead");
            link.fail(Error::PeerTimedOut {
                remote: link.remote.clone(),
                idle,
            });
            parts.remove_peer();
        }
    }
}

/// The completion of the operation with context `ctx`.
///
/// # Safety
/// `ctx` is the context of a posted operation (made by `post`), whose
/// completion is read once.
unsafe fn complete(ctx: *mut c_void, result: Result<(), FabricError>) {
    // SAFETY: by the caller: made by Box::into_raw in `post`, taken once.
    let op = unsafe { Box::from_raw(ctx.cast::<OpCtx>()) };
    *lock(&op.group.link.parts.last_progress) = Instant::now();
    let remote = op.group.link.remote.clone();
    op.group.done(result.map_err(|e| fabric_err(&remote, e)));
}

/// Completions read from the queue at once.
const BATCH: usize = 64;

/// Reads the completions ready in the endpoint's queue (blocking up to
/// [`WAIT_MS`] for one when `block`) and completes their operations; how
/// many it read (an error entry counts one).
fn reap(shared: &Shared, buf: &mut [ffi::fi_cq_entry; BATCH], block: bool) -> usize {
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
        for e in &buf[..n as usize] {
            // SAFETY: every operation is posted with an OpCtx, and each
            // completion is read once.
            unsafe { complete(e.op_context, Ok(())) };
        }
        shared.credits.give(n as usize);
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
    unsafe { complete(err.op_context, Err(e)) };
    shared.credits.give(1);
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
            && (credits.in_flight() == 0 || t.elapsed() > Duration::from_secs(5))
        {
            return;
        }
        // Operations waiting to be posted count as work too: room may come
        // back without a completion (a provider still reaching its peer),
        // and some providers' blocking reads ignore their timeout.
        let busy = credits.in_flight() > 0
            || active.is_some_and(|t| t.elapsed() < SPIN_AFTER)
            || !lock(&shared.backlog).is_empty();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_context_leaves_the_provider_its_room_first() {
        assert_eq!(std::mem::offset_of!(OpCtx, provider), 0);
        assert!(std::mem::size_of::<[*mut c_void; 8]>() >= std::mem::size_of::<ffi::fi_context2>());
    }
}
