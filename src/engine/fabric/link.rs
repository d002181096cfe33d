//! A libfabric link to one peer: its lanes (pairs of this agent's rail and
//! the peer's, each with the peer endpoint's address in the rail's address
//! vector) and the control stream that carries its requests' commits.
//!
//! A request's descriptors are cut into operations (on a link of several
//! lanes, a large descriptor into one piece per lane) and each operation
//! given to the lane with the fewest bytes in flight (`stripe::plan`): a
//! slower rail drains its credits later and takes less. Its commit waits
//! for all of them, on every lane. An operation that fails on one lane of
//! several is posted again on another, and its lane rests out of service
//! (`failover`).
//!
//! A request's operations are posted from the submitting thread while the
//! endpoint's queues, and the link's share of them, have room, else queued
//! for the progress thread, which posts them as completions free room, one
//! per link in turn (a submission never waits for the peer; a peer that
//! stops taking data holds up no other, see [`Backlog`]); each carries an [`OpCtx`] the provider hands back in its
//! completion, and the request's [`Group`] counts them. Completions are
//! read by the progress thread, or by a thread waiting on a request of at
//! most [`DRIVE_MAX_BYTES`], which polls the queue itself while the
//! progress thread stands aside (except on providers over kernel
//! sockets). When the last one has completed (a write: delivered,
//! `FI_DELIVERY_COMPLETE`; a read: landed here) the request's
//! commit (its sync message) goes to the target on the control stream, and
//! the target's acknowledgement completes the status, as on the other
//! socket links. Until then the request is not in the link's table. A link
//! that breaks fails its WRITEs at once, its READs only after their
//! operations have completed (or the endpoint has closed), so that a
//! READ's memory is never written after its status reports (see
//! `on_fail`, and `Fabric::shut` for `shm`). A link whose operations make
//! no progress for the I/O timeout fails with `PeerTimedOut`. Before
//! serving requests a link reads its peer's probe (`warm`). What of this
//! needs no libfabric — a request's operations by lane, how it ends, where
//! a failed operation goes — is in `tally`, tested alone.

use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvxfer_fabric as ffi;

use super::region::{DescTable, Seal};
use super::stripe::{Op, lanes_on_rail, plan};
use super::tally::{self, Ending, Failover, Posted, Turn};
use super::{Answer, Credits, Fabric, FabricError, Shared, check, fabric_err, waiters_poll};
use crate::agent::{DataPath, TransferOp, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::socket_link::{
    Checks, Frames, Job, Pending, SocketLink, SocketPath, connect_streams,
};
use crate::engine::target::attach;
use crate::engine::transport::Submission;
use crate::engine::{lock, status};
use crate::error::Error;
use crate::registry::RegionGuard;
use crate::small::{FastHash, Few};
use crate::status::{Completion, DRIVE_MAX_BYTES, Progress};

/// A libfabric link.
pub(in crate::engine) type FabricLink = SocketLink<FabricParts>;

/// What a libfabric link adds to the control stream.
pub(in crate::engine) struct FabricParts {
    /// Its lanes: lane `i` joins this agent's rail `i mod L` and the peer's
    /// rail `i mod R` (`L`, `R`: their counts of rails), for `max(L, R)`
    /// lanes, so every rail of either side carries a share. Never empty.
    pub(super) lanes: Vec<Lane>,
    /// This agent's count of rails (`L`).
    pub(super) local_rails: usize,
    /// The peer's (`R`).
    pub(super) remote_rails: usize,
    /// The peer's seal: opens the keys its descriptor publishes.
    pub(super) seal: Seal,
    /// The local descriptors of regions registered with several rails.
    pub(super) descs: Arc<DescTable>,
    /// Where the next lane search starts among equally loaded lanes.
    pub(super) turn: AtomicUsize,
    /// Lanes (by bit) taken out of service: an operation on each failed,
    /// and was moved to another lane (see [`failover`]). New operations
    /// avoid them, unless every lane is down, until `lane_rest` after the
    /// last lane went down.
    pub(super) down: AtomicU32,
    /// When the last lane went out of service.
    pub(super) down_since: Mutex<Instant>,
    /// How long lanes stay out of service ([`FabricConfig::lane_rest`]).
    ///
    /// [`FabricConfig::lane_rest`]: crate::FabricConfig::lane_rest
    pub(super) lane_rest: Duration,
    /// When one of its operations last completed, or the first of those in
    /// flight began (what the watch over stalled links reads).
    last_progress: Mutex<Instant>,
    /// Largest operation.
    pub(super) max_msg: u64,
    /// Remote addresses are virtual addresses (else offsets in the region).
    pub(super) virt: bool,
    /// Requests whose operations have not all completed, and the fenced
    /// notifications waiting for them.
    open: Mutex<Open>,
    /// What a thread waiting on a small request polls (the endpoint's
    /// completion queue) rather than wait for the progress thread; `None`
    /// on providers over kernel sockets (see [`super::waiters_poll`]).
    driver: Option<Weak<dyn Progress>>,
}

/// A pair of rails, this agent's and the peer's, that a link's operations
/// take.
pub(super) struct Lane {
    /// This agent's rail.
    pub(super) shared: Arc<Shared>,
    /// The peer's rail: its place among the peer's.
    pub(super) remote: usize,
    /// The peer's endpoint on that rail, in the address vector of this
    /// agent's (released when the link is dropped: no operation of it is
    /// in flight then).
    addr: ffi::fi_addr_t,
    /// The lane's share of its rail's credits (`Credits::share`: the
    /// link's half of the rail, split among its lanes there): what its
    /// operations in the provider's hands may hold at most.
    pub(super) credits: Credits,
}

#[derive(Default)]
struct Open {
    /// By request id.
    groups: HashMap<u64, Weak<Group>, FastHash>,
    fenced: Vec<Frames>,
}

impl Drop for FabricParts {
    fn drop(&mut self) {
        for lane in &self.lanes {
            lane.shared.release_peer(lane.addr);
        }
    }
}

impl SocketPath for FabricParts {
    type Job = std::convert::Infallible;

    /// The provider moves the data, outside the link's session.
    const SESSION_SETTLES: bool = false;

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

    /// A broken link (its control stream lost, a stall, the agent's
    /// close) fails its requests now rather than when the peer answers,
    /// where that is safe for this agent: its WRITEs still in flight (an
    /// operation that moves later only reads this agent's memory, whose
    /// regions stay held until it is given back, see `Group::kept`; the
    /// target never hears of the request, though a target that resumes may
    /// still receive the data) and its notifications fenced behind them.
    /// Its READs
    /// still in flight finish when their operations complete, or when the
    /// agent closes its endpoint: until then the provider may still write
    /// their data here. The peer's address stays in the address vector
    /// until the link is dropped, which is after every operation of it has
    /// completed: leaving it cancels nothing on `shm` and `ofi_rxm` (unless
    /// `FI_AV_REMOVE_CLEANUP=1`), and `shm` (libfabric 1.17) crashes on a
    /// later completion for a removed peer.
    fn on_fail(&self) {
        let (writes, fenced) = self.take_open(true);
        for g in writes {
            let cause = lock(&g.link.pending)
                .broken
                .clone()
                .unwrap_or(Error::Closed);
            g.link.unsettle(&g.pending);
            g.abandon(cause);
        }
        fail_frames(fenced, &Error::Closed);
    }
}

impl FabricParts {
    /// Its requests with operations in flight (only the WRITEs when
    /// `writes_only`), and its fenced notifications, taken out.
    fn take_open(&self, writes_only: bool) -> (Vec<Arc<Group>>, Vec<Frames>) {
        let mut open = lock(&self.open);
        let groups = open
            .groups
            .values()
            .filter_map(Weak::upgrade)
            .filter(|g| !writes_only || g.op == TransferOp::Write)
            .collect();
        (groups, std::mem::take(&mut open.fenced))
    }
}

/// Fails fenced notifications that will not be sent.
fn fail_frames(frames: Vec<Frames>, cause: &Error) {
    for f in frames {
        if f.pending.event(Err(cause.clone())) {
            f.pending.finish(None);
        }
    }
}

impl FabricLink {
    /// Opens the control stream to `peer` and, over it, fetches the
    /// addresses of its endpoints (one per rail).
    pub(in crate::engine) fn open(
        cx: Ctx<'_>,
        fabric: &Fabric,
        peer: &AgentDesc,
    ) -> Result<Arc<Self>, Error> {
        let cfg = &cx.config();
        let rails = &fabric.rails.all;
        let mut lanes = None;
        let mut probes = Vec::new();
        let mut seal = None;
        let streams = connect_streams(cx, peer, 1, |_, sock, clock, _| {
            let mine = super::answer_of(rails, None).map_err(|e| fabric_err(&peer.name, e))?;
            let answer = attach::attach(
                &peer.name,
                sock,
                clock,
                cfg.connect_timeout,
                TransportKind::Fabric,
                &mine.encode(),
            )?;
            match answer {
                Ok(answer) => {
                    let len = answer.len();
                    let answer = Answer::decode(&answer)
                        .filter(|a| a.seal.is_some())
                        .ok_or_else(|| Error::ProtocolViolation {
                            remote: peer.name.clone(),
                            detail: format!(
                                "a libfabric attach answer of {len} bytes that does not decode (1 to {} rails, each with an address, and a seal)",
                                super::MAX_RAILS
                            ),
                        })?;
                    seal = answer.seal.map(Seal::from_bytes);
                    lanes = Some(lanes_to(rails, &answer).map_err(|e| fabric_err(&peer.name, e))?);
                    probes = answer
                        .rails
                        .iter()
                        .map(|r| (r.probe_addr, r.probe_key))
                        .collect();
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
        let (Some(lanes), Some(seal)) = (lanes, seal) else {
            return Err(Error::Closed);
        };
        let parts = FabricParts {
            lanes,
            seal,
            local_rails: rails.len(),
            remote_rails: probes.len(),
            descs: Arc::clone(&fabric.rails.descs),
            turn: AtomicUsize::new(0),
            down: AtomicU32::new(0),
            down_since: Mutex::new(Instant::now()),
            lane_rest: cfg.fabric.lane_rest,
            last_progress: Mutex::new(Instant::now()),
            max_msg: fabric.max_msg,
            virt: fabric.offer.mr_mode & u64::from(ffi::FI_MR_VIRT_ADDR) != 0,
            open: Mutex::new(Open::default()),
            driver: waiters_poll(&fabric.offer.provider).then(|| {
                let strong: Arc<dyn Progress> = Arc::clone(&fabric.rails) as Arc<dyn Progress>;
                Arc::downgrade(&strong)
            }),
        };
        let path = DataPath {
            transport: TransportKind::Fabric,
            device: Some(format!("{}/{}", fabric.offer.provider, fabric.domain)),
            mechanism: "one-sided fi_write/fi_read on a reliable-datagram endpoint, zero copy; the notification after delivery completion",
        };
        let link = Self::start(cx, peer, streams, parts, path)?;
        for shared in rails {
            let mut links = lock(&shared.links);
            links.retain(|l| l.strong_count() > 0);
            links.push(Arc::downgrade(&link));
        }
        if let Err(e) = warm(&link, &probes, cfg.connect_timeout) {
            link.fail(e.clone());
            return Err(e);
        }
        Ok(link)
    }
}

/// The lanes of a link from this agent's `rails` to a peer that answered
/// `answer`: `max(L, R)` of them, lane `i` from rail `i mod L` to the
/// peer's rail `i mod R`, each with the peer's address inserted in its
/// rail's address vector (released again if one fails).
fn lanes_to(rails: &[Arc<Shared>], answer: &Answer) -> Result<Vec<Lane>, FabricError> {
    let (l, r) = (rails.len(), answer.rails.len());
    let n = l.max(r);
    let mut lanes: Vec<Lane> = Vec::with_capacity(n);
    for i in 0..n {
        let shared = &rails[i % l];
        // The link's lanes on this rail (more than one when the peer has
        // more rails): they split the link's share of it.
        let ways = lanes_on_rail(i % l, l, n);
        match shared.insert_peer(&answer.rails[i % r].name) {
            Ok(addr) => lanes.push(Lane {
                shared: Arc::clone(shared),
                remote: i % r,
                addr,
                credits: shared.credits.share(ways),
            }),
            Err(e) => {
                for lane in lanes {
                    lane.shared.release_peer(lane.addr);
                }
                return Err(e);
            }
        }
    }
    Ok(lanes)
}

/// A link's first operation, before it serves requests: an 8-byte READ of
/// the peer's probe (at `probe`: its address and key) into this agent's,
/// within `timeout`. The provider sets up its connection to the peer now
/// rather than on the first request (`ofi_rxm`'s handshake), and on `shm`
/// the peer has taken this endpoint in once it completes: libfabric 1.17's
/// `shm` crashes a target that takes in a peer whose endpoint has closed
/// meanwhile, and an operation posted and abandoned (the agent dropped
/// while its target is stopped) would otherwise leave exactly that behind.
fn warm(link: &Arc<FabricLink>, probes: &[(u64, u64)], timeout: Duration) -> Result<(), Error> {
    let parts = &link.parts;
    // One READ on every lane: each rail's connection is set up.
    let ops: Vec<Op> = parts
        .lanes
        .iter()
        .enumerate()
        .map(|(i, lane)| {
            let mine = &lane.shared.probe;
            let (addr, key) = probes[lane.remote];
            Op {
                lane: i,
                local: mine.addr(),
                desc: mine.region.desc,
                remote: if parts.virt { addr } else { 0 },
                key,
                len: 8,
                // The probe of this lane's rails: it stays on its lane.
                alt: None,
                failed_on: 0,
            }
        })
        .collect();
    // Uncounted: not a request of the agent's.
    let completion = Completion::counted(parts.driver.clone(), None);
    let id = link.in_flight.next_id();
    let group = Group::new(
        link,
        id,
        TransferOp::Read,
        Pending::new(&completion, 1, Few::new(), None),
        None,
        false,
        ops.len(),
    );
    lock(&parts.open).groups.insert(id, Arc::downgrade(&group));
    launch(link, &group, ops);
    let status = TransferStatus::new(id, completion, Arc::clone(&link.path));
    status.wait_success(timeout).map_err(|e| match e {
        Error::Timeout { .. } => Error::PeerTimedOut {
            remote: link.remote.clone(),
            idle: timeout,
        },
        e => e,
    })
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
    /// Set by whoever finishes the request: its last operation's
    /// completion (`done`) or the transport's close (`abandon`).
    settled: AtomicBool,
    /// One of its operations failed on every lane (the request's fault,
    /// not the lanes'): its other operations' failures take no lane out
    /// of service (see [`failover`]). Written under the link's
    /// `down_since`.
    refused: AtomicBool,
    /// Its operations handed to the provider and not completed, whose
    /// credits (see `Credits`) they hold.
    posted: Mutex<Posted>,
    /// Once it is abandoned with operations still in the provider's hands:
    /// the holds on its regions, taken from its status, so that they stay
    /// registered (deregistration refused, `RegionBusy`) until the last of
    /// those operations is given back and this group is dropped with its
    /// context. A provider may still read (a WRITE) or write (a READ at
    /// close) their memory until then.
    kept: Mutex<Few<RegionGuard>>,
    /// End-to-end integrity: what its commit tells the target to check.
    checks: Mutex<Option<Checks>>,
}

impl Group {
    /// A request `req` of `ops` operations on `link`, with its sync message
    /// and whether that is fenced (ordered after the link's other
    /// requests); its count holds one more, the poster's (see [`launch`]).
    fn new(
        link: &Arc<FabricLink>,
        req: u64,
        op: TransferOp,
        pending: Arc<Pending>,
        sync: Option<Vec<u8>>,
        fence: bool,
        ops: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            link: Arc::clone(link),
            req,
            op,
            pending,
            sync: Mutex::new(sync),
            fence,
            remaining: AtomicUsize::new(ops + 1),
            failed: AtomicBool::new(false),
            settled: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            posted: Mutex::new(Posted::new(link.parts.lanes.len())),
            kept: Mutex::default(),
            checks: Mutex::new(None),
        })
    }

    /// Its commit: no segments (its data moved beside the stream), its
    /// sync message, and the table of its checks (a checked request's).
    fn commit_frames(&self, sync: Option<Vec<u8>>, checks: Vec<u8>) -> Frames {
        let pending = Arc::clone(&self.pending);
        Frames::commit_beside(self.req, self.op, sync, checks, pending, false)
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
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1
            || self.settled.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let link = &self.link;
        let mut open = lock(&link.parts.open);
        open.groups.remove(&self.req);
        let release = if open.groups.is_empty() {
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
        let checks = lock(&self.checks).take();
        let failed = self.failed.load(Ordering::Acquire);
        if tally::ending(failed, sync.is_some(), self.fence, checks.is_some()) == Ending::Report {
            // Failed; or done: every write delivered, every read landed,
            // and no message for the target to deliver after them nor
            // anything to check.
            if self.pending.event(Ok(())) {
                self.pending.finish(None);
            }
        } else {
            // SAFETY: every operation completed (a READ's data is in);
            // the request's regions are held by its pending state until
            // it finishes, which its commit's answer does.
            let table = checks
                .map(|c| unsafe { c.into_table() })
                .unwrap_or_default();
            commit(link, self.commit_frames(sync, table));
        }
        for f in release {
            commit(link, f);
        }
    }

    /// Counts an operation of `len` bytes on `lane` about to be handed to
    /// the provider; false when the request was abandoned (nothing more of
    /// it is posted).
    fn hold(&self, lane: usize, len: u64) -> bool {
        if !lock(&self.posted).hold(lane, len) {
            return false;
        }
        let shared = &self.link.parts.lanes[lane].shared;
        shared.held.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// An operation of `len` bytes on `lane` is back from the provider
    /// (completed, or not taken): whether its credits are to be given back
    /// (not when the request was abandoned, which gave them back).
    fn release(&self, lane: usize, len: u64) -> bool {
        let shared = &self.link.parts.lanes[lane].shared;
        shared.held.fetch_sub(1, Ordering::AcqRel);
        lock(&self.posted).release(lane, len)
    }

    /// Fails the request with `cause` without waiting for its operations
    /// (unless it has finished): its link failed, or the endpoint closed.
    fn abandon(&self, cause: Error) {
        if self.settled.swap(true, Ordering::AcqRel) {
            return;
        }
        // Its operations will not complete (or complete late, giving
        // nothing back): their credits are free for the other links.
        let lanes = lock(&self.posted).abandon();
        let mut ops = 0;
        for (lane, &(n, bytes)) in lanes.iter().enumerate() {
            give(&self.link, lane, n, bytes);
            ops += n;
        }
        if ops > 0 {
            // The status reports now, its memory stays held (see `kept`).
            *lock(&self.kept) = std::mem::take(&mut *lock(&self.pending.guards));
        }
        lock(&self.link.parts.open).groups.remove(&self.req);
        if self.pending.event(Err(cause)) {
            self.pending.finish(None);
        }
    }
}

/// Fails with `cause` every request of the endpoint's links whose
/// operations are still in flight, and their fenced notifications
/// (at the transport's close, once nothing of theirs can move any more).
pub(super) fn abandon_all(shared: &Shared, cause: &Error) {
    for link in shared.live_links() {
        let (groups, fenced) = link.parts.take_open(false);
        for g in groups {
            g.abandon(cause.clone());
        }
        fail_frames(fenced, cause);
    }
}

/// System error numbers with which providers complete operations on a
/// connection that is gone (`ECANCELED`: `verbs` flushes the operations of
/// a queue pair in error, as when its peer's process died).
const LOST: [i32; 8] = [
    libc::ECANCELED,
    libc::ECONNRESET,
    libc::ECONNABORTED,
    libc::ENOTCONN,
    libc::EPIPE,
    libc::ESHUTDOWN,
    libc::ECONNREFUSED,
    libc::EHOSTUNREACH,
];

/// `ConnectionLost` if the peer has closed the link's control stream (its
/// process ended), or closes it within `wait`: asked when an operation
/// of a request fails first, so that a dead peer's requests fail as on
/// the other transports, whichever of its sockets the kernel closed first
/// and whatever the provider made of it; waiting [`LOST_WAIT`] when the
/// operation completed with a lost connection (`ofi_rxm` over `tcp`
/// cancels with `ENOTCONN` when the peer dies, and also when the peer
/// refuses a key), not at all otherwise.
fn stream_lost(link: &FabricLink, wait: Duration) -> Option<Error> {
    let mut pfd = libc::pollfd {
        fd: link.streams[0].sock.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    let wait = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one pollfd, on the link's socket, open while the link lives.
    let n = unsafe { libc::poll(&mut pfd, 1, wait) };
    let gone = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
    (n > 0 && pfd.revents & gone != 0).then(|| Error::ConnectionLost {
        remote: link.remote.clone(),
        cause: Arc::new(std::io::ErrorKind::ConnectionReset.into()),
    })
}

/// How long a failed operation's completion waits for the control stream
/// to show the peer gone (once per request).
const LOST_WAIT: Duration = Duration::from_millis(50);

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
    let ops = plan(
        &link,
        &req.local.descs,
        &resolved.local_keys,
        &req.remote.descs,
        &resolved.remote_keys,
    )?;
    let bytes = req.local.total_len();
    // A small request's waiter polls the queue itself (no hand-over from
    // the progress thread); a large one leaves the CPU to that thread.
    let driver = parts.driver.clone().filter(|_| bytes <= DRIVE_MAX_BYTES);
    let id = link.in_flight.next_id();
    let completion = link.in_flight.completion(driver, &link.meter, bytes);
    let pending = Pending::new(&completion, 1, resolved.guards, None);
    let status = TransferStatus::new(id, completion, Arc::clone(&link.path));
    let group = Group::new(&link, id, req.op, pending, sync, fence, ops.len());
    if req.integrity {
        *lock(&group.checks) = Some(Checks::new(req, &resolved.keys));
    }
    {
        let mut open = lock(&parts.open);
        if group.fence && ops.is_empty() && !open.groups.is_empty() {
            // A notification ordered after the requests still in flight:
            // sent when the last of them has completed.
            open.fenced
                .push(group.commit_frames(lock(&group.sync).take(), Vec::new()));
            return Ok(status);
        }
        open.groups.insert(id, Arc::downgrade(&group));
    }
    launch(&link, &group, ops);
    Ok(status)
}

/// Posts `ops` of `group` (counted in its `remaining`, with one more that
/// this call gives up when done), or queues them for the progress thread
/// when the endpoint has no room or others wait.
fn launch(link: &Arc<FabricLink>, group: &Arc<Group>, ops: Vec<Op>) {
    let parts = &link.parts;
    if !ops.is_empty() {
        *lock(&parts.last_progress) = Instant::now();
    }
    // Lanes (by bit) with operations queued for their rail's progress
    // thread.
    let mut queued: u32 = 0;
    let mut posted: u32 = 0;
    for op in ops {
        let bit = 1 << op.lane;
        let shared = &parts.lanes[op.lane].shared;
        // Behind what of this lane already waits, or when the queues (or
        // the lane's share of them) are full: for the progress thread.
        let wait = queued & bit != 0
            || lock(&shared.backlog).holds(link, op.lane)
            || take(link, op.lane, op.len).is_err();
        let op = if wait {
            op
        } else {
            match post(link, group, op) {
                Post::Done => {
                    posted |= bit;
                    continue;
                }
                Post::Full(op) => op,
                Post::Failed(op, e) => {
                    let e = fabric_err(&link.remote, e);
                    if !failover(group, op, &e) {
                        group.done(Err(e));
                    }
                    continue;
                }
            }
        };
        let lane = op.lane;
        lock(&shared.backlog).push(
            link,
            lane,
            Queued {
                group: Arc::clone(group),
                op,
            },
        );
        queued |= bit;
    }
    for (i, lane) in parts.lanes.iter().enumerate() {
        let bit = 1 << i;
        if queued & bit != 0 || (posted & bit != 0 && !lane.shared.ep.waits) {
            // Operations for the progress thread to post; or, without a
            // wait object, to read the completions of: it may be pausing.
            lane.shared.wake();
        }
    }
    // The poster's own hold.
    group.done(Ok(()));
}

/// What the provider hands back with an operation's completion: room for
/// its own use (`FI_CONTEXT2`), then the operation's group. Boxed per
/// operation; freed when its completion is read.
#[repr(C)]
struct OpCtx {
    provider: [*mut c_void; 8],
    group: Arc<Group>,
    /// The operation (posted again on another lane if it fails, see
    /// [`failover`]).
    op: Op,
}

/// An operation waiting for room in the endpoint's queues.
pub(super) struct Queued {
    group: Arc<Group>,
    op: Op,
}

/// What became of an operation handed to [`post`].
enum Post {
    /// Posted: the provider holds it until its completion.
    Done,
    /// Given back: the provider has no room for it now (`-FI_EAGAIN`).
    Full(Op),
    /// Given back: refused.
    Failed(Op, FabricError),
}

/// Posts `op` of `group` on the link's endpoint (its context then owns
/// it), or gives it back.
fn post(link: &FabricLink, group: &Arc<Group>, op: Op) -> Post {
    let lane = &link.parts.lanes[op.lane];
    // Before the call: its completion may come before it returns.
    if !group.hold(op.lane, op.len) {
        give(link, op.lane, 1, op.len);
        return Post::Failed(op, FabricError::Closed);
    }
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
    let (at, len) = (op.lane, op.len);
    let ctx = Box::into_raw(Box::new(OpCtx {
        provider: [ptr::null_mut(); 8],
        group: Arc::clone(group),
        op,
    }));
    let msg = ffi::fi_msg_rma {
        msg_iov: &iov,
        desc: &mut desc,
        iov_count: 1,
        addr: lane.addr,
        rma_iov: &rma,
        rma_iov_count: 1,
        context: ctx.cast(),
        data: 0,
    };
    // SAFETY: the local range lies in a region held by the request (its
    // guards, released only when the request finishes: after this
    // operation's completion, or once the endpoint is closed, see
    // `abandon`); the context lives until the completion is read
    // (`complete`), or is leaked; the endpoint is open (`with_ep`).
    let rc = lane.shared.ep.with_ep(|ep| unsafe {
        match group.op {
            TransferOp::Write => ffi::fi_writemsg(
                ep,
                &msg,
                u64::from(ffi::FI_COMPLETION | ffi::FI_DELIVERY_COMPLETE),
            ),
            TransferOp::Read => ffi::fi_readmsg(ep, &msg, u64::from(ffi::FI_COMPLETION)),
        }
    });
    let rc = rc.unwrap_or_else(|_| -(ffi::FI_ESHUTDOWN as isize));
    let call = match group.op {
        TransferOp::Write => "fi_writemsg",
        TransferOp::Read => "fi_readmsg",
    };
    if rc == 0 {
        return Post::Done;
    }
    // SAFETY: not posted: the context is still this function's.
    let OpCtx { op, .. } = *unsafe { Box::from_raw(ctx) };
    if group.release(at, len) {
        give(link, at, 1, len);
    }
    if rc == -(ffi::FI_EAGAIN as isize) {
        return Post::Full(op);
    }
    match check(call, rc as i64) {
        Ok(_) => Post::Full(op),
        Err(e) => Post::Failed(op, e),
    }
}

/// Takes the credits of an operation of `len` bytes on `lane` of `link`:
/// the lane's share and its rail's; `Err` (nothing taken) says which is
/// full.
fn take(link: &FabricLink, lane: usize, len: u64) -> Result<(), Turn> {
    let lane = &link.parts.lanes[lane];
    if !lane.credits.try_take(len) {
        return Err(Turn::Full);
    }
    if lane.shared.credits.try_take(len) {
        return Ok(());
    }
    lane.credits.give(1, len);
    Err(Turn::Stop)
}

/// Gives back the credits of `ops` operations of `bytes` on `lane` of
/// `link`.
fn give(link: &FabricLink, lane: usize, ops: usize, bytes: u64) {
    let lane = &link.parts.lanes[lane];
    lane.credits.give(ops, bytes);
    lane.shared.credits.give(ops, bytes);
}

/// A rail's operations waiting to be posted, by a link's lane on the rail
/// (see [`tally::Backlog`]).
pub(super) type Backlog = tally::Backlog<FabricLink, Queued>;

/// Posts what waits in the backlog while there is room, one operation per
/// link in turn ([`tally::drain`]); drops (as done) the operations of
/// requests that failed, were aborted, or whose link broke.
pub(super) fn drain(shared: &Shared) {
    tally::drain(&shared.backlog, drain_one);
}

/// One turn of [`drain`] on queued operation `q`; `q` back when it is still
/// to be posted.
fn drain_one(q: Queued) -> (Turn, Option<Queued>) {
    let g = &q.group;
    if g.failed.load(Ordering::Acquire) || g.link.broken.load(Ordering::Acquire) {
        g.done(Err(Error::Closed));
        return (Turn::Moved, None);
    }
    if g.pending.completion.abort_requested() {
        g.done(Err(Error::Aborted));
        return (Turn::Moved, None);
    }
    if let Err(full) = take(&g.link, q.op.lane, q.op.len) {
        return (full, Some(q));
    }
    let Queued { group, op } = q;
    match post(&group.link, &group, op) {
        Post::Done => (Turn::Moved, None),
        Post::Full(op) => (Turn::Stop, Some(Queued { group, op })),
        Post::Failed(op, e) => {
            let e = fabric_err(&group.link.remote, e);
            if !failover(&group, op, &e) {
                group.done(Err(e));
            }
            (Turn::Moved, None)
        }
    }
}

/// Fails the links whose operations have made no progress for their I/O
/// timeout: `PeerTimedOut` (see `on_fail`).
pub(super) fn watch(shared: &Shared) {
    for link in shared.live_links() {
        let parts = &link.parts;
        if lock(&parts.open).groups.is_empty() || link.broken.load(Ordering::Acquire) {
            continue;
        }
        let idle = lock(&parts.last_progress).elapsed();
        if idle > link.io_timeout {
            tracing::warn!(remote = %link.remote, ?idle, "libfabric operations stalled; link declared dead");
            link.fail(Error::PeerTimedOut {
                remote: link.remote.clone(),
                idle,
            });
        }
    }
}

/// The completion of the operation with context `ctx`; the credits it
/// gives back (operations, bytes).
///
/// # Safety
/// `ctx` is the context of a posted operation (made by `post`), whose
/// completion is read once.
pub(super) unsafe fn complete(ctx: *mut c_void, result: Result<(), FabricError>) -> (usize, u64) {
    // SAFETY: by the caller: made by Box::into_raw in `post`, taken once.
    let ctx = unsafe { Box::from_raw(ctx.cast::<OpCtx>()) };
    let OpCtx { group, op, .. } = *ctx;
    let lane = &group.link.parts.lanes[op.lane];
    *lock(&group.link.parts.last_progress) = Instant::now();
    if result.is_ok() {
        lane.shared.moved.fetch_add(op.len, Ordering::Relaxed);
    }
    let back = if group.release(op.lane, op.len) {
        lane.credits.give(1, op.len);
        (1, op.len)
    } else {
        (0, 0)
    };
    let link = &group.link;
    let result = result.map_err(|e| {
        let lost = matches!(&e, FabricError::Completion { code, prov, .. }
            if LOST.contains(code) || LOST.contains(prov));
        let first = !group.failed.load(Ordering::Acquire);
        let wait = if lost { LOST_WAIT } else { Duration::ZERO };
        if first
            && !link.broken.load(Ordering::Acquire)
            && let Some(gone) = stream_lost(link, wait)
        {
            return gone;
        }
        fabric_err(&link.remote, e)
    });
    if let Err(e) = &result
        && failover(&group, op, e)
    {
        return back;
    }
    group.done(result);
    back
}

/// Moves `op` of `group`, which failed on its lane with `cause`, to
/// another lane of its link, and takes the failed lane out of service
/// (new operations avoid it, see [`plan`]): on a link of several lanes, a
/// rail that fails (a NIC, its port, its path to the peer) costs its
/// operations a second post rather than their requests. Whether it did:
/// not when the link has one lane, the operation is its probe, or its
/// request is over (failed, aborted, abandoned, its link broken: the
/// peer gone); nor once it has failed on every lane, which puts those
/// lanes back in service (the fault was the request's), nor once another
/// operation of its request has (its failure is the request's too).
///
/// The failed operation's count in the group carries over to the one
/// posted in its place, whose memory is moved again whole (a WRITE that
/// failed part-way is written again, a READ read again) before the
/// request's commit. The lane is back in service after the link's
/// `lane_rest`.
fn failover(group: &Arc<Group>, mut op: Op, cause: &Error) -> bool {
    let link = &group.link;
    let parts = &link.parts;
    let n = parts.lanes.len();
    if op.alt.is_none()
        || group.failed.load(Ordering::Acquire)
        || group.settled.load(Ordering::Acquire)
        || link.broken.load(Ordering::Acquire)
        || group.pending.completion.abort_requested()
        || matches!(
            cause,
            Error::ConnectionLost { .. } | Error::PeerTimedOut { .. }
        )
    {
        return false;
    }
    let from = op.lane;
    let bit = 1u32 << from;
    if let Failover::Refused { failed_on } = tally::failover(n, from, op.failed_on, 0) {
        // It failed on every lane: its request's fault rather than theirs
        // (a key the peer refuses on every rail), and those it took out of
        // service go back.
        let _since = lock(&parts.down_since);
        group.refused.store(true, Ordering::Release);
        parts.down.fetch_and(!failed_on, Ordering::AcqRel);
        return false;
    }
    let mut since = lock(&parts.down_since);
    if group.refused.load(Ordering::Acquire) {
        // Another of its operations failed on every lane, and the lanes
        // went back in service: this failure is the request's too (checked
        // under the lock, so that it never takes a lane out after that).
        return false;
    }
    let fresh = parts.down.fetch_or(bit, Ordering::AcqRel) & bit == 0;
    if fresh {
        *since = Instant::now();
    }
    let down = parts.down.load(Ordering::Acquire);
    drop(since);
    if fresh {
        let lane = &parts.lanes[from];
        lane.shared.failovers.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(remote = %link.remote, lane = from, rail = lane.shared.rail, domain = %lane.shared.domain, peer_rail = lane.remote, error = %cause, "libfabric lane failed: taken out of service, its operations moved to the link's other lanes");
    }
    // The next lane in service that it has not failed on, else the next
    // it has not failed on.
    let Failover::Move { to, failed_on } = tally::failover(n, from, op.failed_on, down) else {
        return false;
    };
    op.failed_on = failed_on;
    op.onto(&parts.lanes, to);
    // `launch`'s own hold, which it gives up when done.
    group.remaining.fetch_add(1, Ordering::AcqRel);
    launch(link, group, vec![op]);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_context_leaves_the_provider_its_room_first() {
        assert_eq!(std::mem::offset_of!(OpCtx, provider), 0);
        assert!(std::mem::size_of::<[*mut c_void; 8]>() >= std::mem::size_of::<ffi::fi_context2>());
    }
}
