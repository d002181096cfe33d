//! What the socket transports' links share: TCP streams to one peer, which
//! carry the data, or the control beside another transport's data path;
//! the table of requests in flight; the stream threads. It names no
//! transport: each is its own link type ([`SocketLink<P>`] with a part `P`
//! of its own, behind [`SocketPath`]), opened, submitted to and driven by
//! its own module.
//!
//! Files: this one (the link, its table of requests, connecting its
//! streams, settling) and `streams` (the sender and reader threads of
//! every stream).

mod streams;

use crate::agent::{Completion, DataPath, TransferOp, TransferRequest, TransferStatus};
use crate::auth::random_u64;
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::indexed::IndexedSegs;
use crate::engine::peer::connect_any;
use crate::engine::peer::handshake;
use crate::engine::plan::Seg;
use crate::engine::settle::Settle;
use crate::engine::sock::ProgressClock;
use crate::engine::transport::{Link, Submission};
use crate::engine::transport::{PreparedHold, Resolved};
use crate::engine::{Peer, in_flight, lock, tick, wire};
use crate::error::Error;
use crate::registry::RegionGuard;
use crate::small::{FastHash, Few};
use crate::status::{Prepared, Settles};
use crossbeam_channel::{Receiver, Sender};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// One outstanding request at the initiator. It completes when every
/// expected event (one acknowledgement, plus one per READ segment) has
/// arrived, so a failed request no longer touches local memory either.
pub(in crate::engine) struct Pending {
    pub(in crate::engine) completion: Arc<Completion>,
    pub(in crate::engine) outstanding: AtomicUsize,
    pub(in crate::engine) error: Mutex<Option<Error>>,
    /// Whether `error` holds one (set after it): finishing a request that
    /// did not fail takes no lock for it.
    pub(in crate::engine) failed: AtomicBool,
    pub(in crate::engine) guards: Mutex<Few<RegionGuard>>,
    /// RDMA requests no waiter polls for (see `RdmaParts::undriven`): the
    /// link's count, decremented when this one finishes.
    pub(in crate::engine) undriven: Option<Arc<AtomicUsize>>,
}

impl Pending {
    /// A request awaiting `outstanding` events, holding `guards`.
    pub(in crate::engine) fn new(
        completion: &Arc<Completion>,
        outstanding: usize,
        guards: Few<RegionGuard>,
        undriven: Option<Arc<AtomicUsize>>,
    ) -> Arc<Self> {
        Arc::new(Pending {
            completion: Arc::clone(completion),
            outstanding: AtomicUsize::new(outstanding),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            guards: Mutex::new(guards),
            undriven,
        })
    }

    /// Records `e` as the request's outcome (unless one was recorded
    /// first) without counting an event.
    pub(in crate::engine) fn note_error(&self, e: Error) {
        lock(&self.error).get_or_insert(e);
        self.failed.store(true, Ordering::Release);
    }

    /// Records one event; returns true when it was the last.
    pub(in crate::engine) fn event(&self, result: Result<(), Error>) -> bool {
        if let Err(e) = result {
            lock(&self.error).get_or_insert(e);
            self.failed.store(true, Ordering::Release);
        }
        self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1
    }

    pub(in crate::engine) fn finish(&self, forced: Option<Error>) {
        lock(&self.guards).clear();
        let recorded = || {
            self.failed
                .load(Ordering::Acquire)
                .then(|| lock(&self.error).take())
                .flatten()
        };
        let outcome = match forced.or_else(recorded) {
            Some(e) => Err(e),
            None => Ok(()),
        };
        if self.completion.complete(outcome)
            && let Some(n) = &self.undriven
        {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

pub(in crate::engine) struct ReadSlot {
    pub(in crate::engine) req: u64,
    pub(in crate::engine) dst: u64,
    pub(in crate::engine) len: u64,
    /// The device of a GPU destination (its data is staged).
    pub(in crate::engine) gpu: Option<u32>,
    pub(in crate::engine) pending: Arc<Pending>,
    /// Its data comes with a CRC32C, checked once landed, and its answer
    /// is sealed as the read of this place in its request's reads on the
    /// stream (see `wire::read_data_sealed`).
    pub(in crate::engine) checked: Option<u32>,
}

/// A request's segments on one stream: planned (shared with the prepared
/// transfer that planned them, when it is one), or a share of a transfer
/// made by index, found by the sender.
#[derive(Clone)]
pub(in crate::engine) enum Segs {
    Planned(Arc<Vec<Seg>>),
    Indexed {
        segs: Arc<IndexedSegs>,
        cut: crate::indexed::Cut,
        count: usize,
    },
}

impl Segs {
    /// None.
    pub(in crate::engine) fn none() -> Self {
        Segs::Planned(Arc::default())
    }

    /// How many.
    pub(in crate::engine) fn len(&self) -> usize {
        match self {
            Segs::Planned(v) => v.len(),
            Segs::Indexed { count, .. } => *count,
        }
    }

    /// Whether there are none.
    pub(in crate::engine) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The segments (those of an indexed share found into `scratch`).
    pub(in crate::engine) fn get<'a>(&'a self, scratch: &'a mut Vec<Seg>) -> &'a [Seg] {
        match self {
            Segs::Planned(v) => v,
            Segs::Indexed { segs, cut, count } => {
                segs.expand(*cut, *count, scratch);
                scratch
            }
        }
    }
}

pub(in crate::engine) enum Tail {
    None,
    Commit {
        segments: u64,
        sync: Option<Vec<u8>>,
        /// The target syncs the storage it wrote before acknowledging.
        durable: bool,
        /// End-to-end integrity of data moved beside the stream: the
        /// checks table ([`wire::CHECK_ENTRY`] bytes each) that follows the
        /// sync message.
        checks: Vec<u8>,
    },
    Fence,
}

/// A checked request's checks, for a transport whose data moves beside the
/// stream (the target checks them when the request commits, see
/// [`wire::push_check`]).
pub(in crate::engine) enum Checks {
    /// A WRITE's table, summed over the source before it was posted.
    Ready(Vec<u8>),
    /// A READ's ranges (local address, remote address, length, access
    /// key), summed over the destination once every operation completed.
    AfterRead(Vec<(u64, u64, u64, u64)>),
}

impl Checks {
    /// The ranges of a checked request's descriptors, one access key per
    /// remote descriptor; a WRITE's source summed now.
    pub(in crate::engine) fn new(req: &TransferRequest, keys: &[u64]) -> Self {
        let ranges: Vec<(u64, u64, u64, u64)> = req
            .local
            .descs
            .iter()
            .zip(&req.remote.descs)
            .zip(keys)
            .map(|((l, r), &key)| (l.addr, r.addr, l.len, key))
            .collect();
        match req.op {
            // SAFETY: the source regions are registered and held by the
            // request's guards (the caller's) until it completes.
            TransferOp::Write => Checks::Ready(unsafe { table(ranges.iter().copied()) }),
            TransferOp::Read => Checks::AfterRead(ranges),
        }
    }

    /// The table to commit.
    ///
    /// # Safety
    /// A READ's destination ranges must be readable: every operation of it
    /// completed, its regions still held.
    pub(in crate::engine) unsafe fn into_table(self) -> Vec<u8> {
        match self {
            Checks::Ready(t) => t,
            // SAFETY: forwarded to the caller.
            Checks::AfterRead(ranges) => unsafe { table(ranges.iter().copied()) },
        }
    }
}

/// The checks of `ranges` (local address, remote address, length, access
/// key), each summed over the local side.
///
/// # Safety
/// Every local range must be readable for the call.
pub(in crate::engine) unsafe fn table(
    ranges: impl ExactSizeIterator<Item = (u64, u64, u64, u64)>,
) -> Vec<u8> {
    let mut t = Vec::with_capacity(ranges.len() * wire::CHECK_ENTRY);
    for (local, remote, len, key) in ranges {
        // SAFETY: forwarded to the caller.
        let bytes = unsafe { std::slice::from_raw_parts(local as *const u8, len as usize) };
        wire::push_check(&mut t, remote, len, key, crate::integrity::crc32c(bytes));
    }
    t
}

/// Work for a stream's sender thread.
pub(in crate::engine) enum Job<X> {
    /// Frames to write (a request's segments, its tail).
    Frames(Frames),
    /// The transport's own work (a cross-memory request's grants and
    /// copy), which may end in frames to write.
    Path(X),
    Stop,
}

/// A request's frames on one stream.
pub(in crate::engine) struct Frames {
    pub(in crate::engine) req: u64,
    pub(in crate::engine) op: TransferOp,
    /// Its segments on this stream.
    pub(in crate::engine) segs: Segs,
    pub(in crate::engine) tail: Tail,
    pub(in crate::engine) pending: Arc<Pending>,
    /// Its data was aborted before the frames were made (an `Abort` frame
    /// goes before the tail).
    pub(in crate::engine) aborted: bool,
    /// End-to-end integrity: its data frames carry seals and CRC32Cs.
    pub(in crate::engine) checked: bool,
}

impl Frames {
    /// The commit of request `req`, whose data moved beside the stream (no
    /// segments): its sync message and the table of its checks (empty when
    /// unchecked), after an `Abort` frame when `aborted`.
    pub(in crate::engine) fn commit_beside(
        req: u64,
        op: TransferOp,
        sync: Option<Vec<u8>>,
        checks: Vec<u8>,
        pending: Arc<Pending>,
        aborted: bool,
    ) -> Self {
        Frames {
            req,
            op,
            segs: Segs::none(),
            tail: Tail::Commit {
                segments: 0,
                sync,
                durable: false,
                checks,
            },
            pending,
            aborted,
            checked: false,
        }
    }
}

pub(in crate::engine) struct StreamHandle<X> {
    pub(in crate::engine) tx: Sender<Job<X>>,
    pub(in crate::engine) reads: Mutex<VecDeque<ReadSlot>>,
    pub(in crate::engine) sock: TcpStream,
}

#[derive(Default)]
pub(in crate::engine) struct PendingTable {
    pub(in crate::engine) map: HashMap<u64, Arc<Pending>, FastHash>,
    pub(in crate::engine) broken: Option<Error>,
}

/// What one socket transport adds to the link it shares with the others:
/// its own state, how it submits (and prepares) a request, its own work for
/// the first stream's sender thread, and what it does when the link breaks
/// and when its last thread has left. Each transport is its own link type
/// ([`TcpLink`], [`CmaLink`], [`RdmaLink`]), its behaviour in its module.
pub(in crate::engine) trait SocketPath: Send + Sync + Sized + 'static {
    /// The transport's own jobs ([`Job::Path`]).
    type Job: Send + 'static;

    /// Whether the target ending a broken link's session (its streams)
    /// proves that nothing more of the link's requests lands there (see
    /// [`Settle`]): false where a provider outside the session moves the
    /// data, which only the target's close or exit stops.
    const SESSION_SETTLES: bool = true;

    /// [`Link::submit`] on a link of this transport.
    fn submit(link: Arc<SocketLink<Self>>, sub: Submission<'_>) -> Result<TransferStatus, Error>;

    /// [`Link::resubmit`] on a link of this transport; `None` by default.
    fn resubmit(
        _link: &SocketLink<Self>,
        _cx: Ctx<'_>,
        _req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        None
    }

    /// [`Link::forget`] on a link of this transport.
    fn forget(&self) {}

    /// [`Link::prepare`] on a link of this transport: by default the holds
    /// on the local regions only (the request is checked now and validated
    /// in full on every submission).
    fn prepare(
        _link: Arc<SocketLink<Self>>,
        _cx: Ctx<'_>,
        _peer: Arc<Peer>,
        _req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<Box<dyn Prepared>, Error> {
        Ok(PreparedHold::keep(resolved))
    }

    /// As [`Link::prepare_indexed`]; `None` by default.
    fn prepare_indexed(
        _link: Arc<SocketLink<Self>>,
        _peer: Arc<Peer>,
        _segs: &Arc<IndexedSegs>,
        _bytes: u64,
        _guards: Few<RegionGuard>,
    ) -> Option<(Box<dyn Prepared>, usize)> {
        None
    }

    /// Threads of its own the link counts before it ends.
    fn threads(&self) -> usize {
        0
    }

    /// Does one of its jobs on stream `fd` (of the sender thread that runs
    /// it); returns the frames to write after it, if any. `Err`: the link
    /// is broken.
    fn run_job(
        link: &SocketLink<Self>,
        fd: std::os::fd::RawFd,
        job: Self::Job,
    ) -> Result<Option<Frames>, Error>;

    /// The link broke: unblocks what the transport has beside the streams.
    fn on_fail(&self) {}

    /// One of the transport's own frames ([`Frame::Transport`], its
    /// transport fields `head`) came from the target on a stream. By
    /// default it takes none. `Err`: the link is broken.
    fn on_frame(link: &SocketLink<Self>, _head: &wire::TransportHead) -> Result<(), Error> {
        Err(link.violation("unexpected transport frame"))
    }

    /// The link's last thread is leaving: settles what the transport holds
    /// outside the table of requests.
    fn on_closed(&self, _cause: Error) {}
}

/// The connections from this agent to one remote agent over one of the
/// socket transports (`P`: the transport's own part).
pub(in crate::engine) struct SocketLink<P: SocketPath> {
    /// The transport's own state.
    pub(in crate::engine) parts: P,
    pub(in crate::engine) remote: String,
    pub(in crate::engine) io_timeout: Duration,
    /// The target's I/O timeout, as it announced it (`None`: it has
    /// none): idle streams send it a keepalive every quarter of it, and a
    /// cross-memory copy stops before its grants expire.
    pub(in crate::engine) target_timeout: Option<Duration>,
    /// The staging ring's shape, for GPU memory.
    pub(in crate::engine) gpu_staging: crate::gpu::StagingShape,
    /// The agent's request ids and count of requests in flight.
    pub(in crate::engine) in_flight: Arc<in_flight::InFlight>,
    /// Where its requests' outcomes are counted.
    pub(in crate::engine) meter: Arc<crate::metrics::Meter>,
    /// What carries this link's requests (every status reports it).
    pub(in crate::engine) path: Arc<crate::agent::DataPath>,
    pub(in crate::engine) streams: Vec<StreamHandle<P::Job>>,
    pub(in crate::engine) pending: Mutex<PendingTable>,
    /// Set (under `pending`'s lock) when `pending.broken` is: a request's
    /// path reads it without the lock.
    pub(in crate::engine) broken: AtomicBool,
    pub(in crate::engine) clock: ProgressClock,
    pub(in crate::engine) alive: AtomicUsize,
    pub(in crate::engine) threads: Mutex<Vec<JoinHandle<()>>>,
    /// How its requests, failed by its break, are proved settled (`None`:
    /// the address it connected to is unknown; they are reported settled).
    settle: Option<Arc<dyn Settles>>,
}

/// A link's streams, connected, authenticated and greeted, with the
/// receiving ends of their job channels.
pub(in crate::engine) struct Streams<X> {
    pub(in crate::engine) handles: Vec<StreamHandle<X>>,
    pub(in crate::engine) jobs: Vec<Receiver<Job<X>>>,
    /// The target's I/O timeout (the shortest its streams announced).
    pub(in crate::engine) target_timeout: Option<Duration>,
    /// The link's id, as its `Hello`s named it.
    pub(in crate::engine) link_id: u64,
    /// The address the first stream connected to.
    pub(in crate::engine) addr: Option<std::net::SocketAddr>,
}

/// Opens `n` streams to `peer`. `on_stream(i, sock, clock, ticket)` runs on
/// each after its handshake (the transports set up their own channels on
/// the first), before the stream's timeouts are set.
pub(in crate::engine) fn connect_streams<X>(
    cx: Ctx<'_>,
    peer: &AgentDesc,
    n: usize,
    mut on_stream: impl FnMut(usize, &TcpStream, &ProgressClock, u128) -> Result<(), Error>,
) -> Result<Streams<X>, Error> {
    let inner = cx.state();
    let cfg = &inner.config;
    let link_id = random_u64();
    let mut streams = Streams {
        handles: Vec::with_capacity(n),
        jobs: Vec::with_capacity(n),
        target_timeout: None,
        link_id,
        addr: None,
    };
    for i in 0..n {
        // Each stream: connected, authenticated and greeted within the
        // connect timeout, however slowly the peer answers.
        let deadline = std::time::Instant::now() + cfg.connect_timeout;
        let sock = connect_any(&peer.endpoints, deadline)?;
        if streams.addr.is_none() {
            streams.addr = sock.peer_addr().ok();
        }
        let clock = ProgressClock::new();
        let (ticket, target_timeout) =
            handshake(inner, peer, &sock, link_id, i as u32, &clock, deadline)?;
        streams.target_timeout = match (streams.target_timeout, target_timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        on_stream(i, &sock, &clock, ticket)?;
        sock.set_read_timeout(Some(tick(cfg.io_timeout)))?;
        sock.set_write_timeout(Some(tick(cfg.io_timeout)))?;
        let (tx, rx) = crossbeam_channel::unbounded();
        streams.handles.push(StreamHandle {
            tx,
            reads: Mutex::new(VecDeque::new()),
            sock,
        });
        streams.jobs.push(rx);
    }
    Ok(streams)
}

impl<P: SocketPath> SocketLink<P> {
    /// The link over `streams` with the transport's `parts`, its stream
    /// threads started (the transport starts its own, counted in
    /// [`SocketPath::threads`], once this returns).
    pub(in crate::engine) fn start(
        cx: Ctx<'_>,
        peer: &AgentDesc,
        streams: Streams<P::Job>,
        parts: P,
        path: DataPath,
    ) -> Result<Arc<Self>, Error> {
        let inner = cx.state();
        let Streams {
            handles,
            jobs,
            target_timeout,
            link_id,
            addr,
        } = streams;
        let settle = addr.map(|addr| -> Arc<dyn Settles> {
            Settle::new(
                &inner.config,
                inner.instance,
                &peer.name,
                peer.instance,
                addr,
                link_id,
                P::SESSION_SETTLES,
            )
        });
        let link = Arc::new(SocketLink {
            alive: AtomicUsize::new(2 * handles.len() + parts.threads()),
            parts,
            remote: peer.name.clone(),
            io_timeout: inner.config.io_timeout,
            target_timeout,
            gpu_staging: inner.config.gpu.shape(),
            in_flight: Arc::clone(&inner.in_flight),
            meter: inner.metrics.meter(path.transport, &peer.name),
            path: Arc::new(path),
            streams: handles,
            pending: Mutex::new(PendingTable::default()),
            broken: AtomicBool::new(false),
            clock: ProgressClock::new(),
            threads: Mutex::new(Vec::new()),
            settle,
        });
        for (i, rx) in jobs.into_iter().enumerate() {
            let (send, recv) = (Arc::clone(&link), Arc::clone(&link));
            let started = link
                .spawn(format!("kvxfer-send-{}-{i}", peer.name), move || {
                    send.run_sender(i, rx)
                })
                .and_then(|_| {
                    link.spawn(format!("kvxfer-recv-{}-{i}", peer.name), move || {
                        recv.run_reader(i)
                    })
                });
            if let Err(e) = started {
                // The threads already started end; the link is dropped.
                link.fail(Error::Closed);
                link.join();
                return Err(e);
            }
        }
        tracing::debug!(remote = %peer.name, streams = link.streams.len(), transport = %link.path.transport, "link open");
        Ok(link)
    }

    /// Starts one of the link's threads (joined by [`join`](Self::join)).
    pub(in crate::engine) fn spawn(
        &self,
        name: String,
        f: impl FnOnce() + Send + 'static,
    ) -> Result<std::thread::Thread, Error> {
        let t = std::thread::Builder::new().name(name).spawn(f)?;
        let handle = t.thread().clone();
        lock(&self.threads).push(t);
        Ok(handle)
    }

    pub(in crate::engine) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    pub(in crate::engine) fn insert(&self, id: u64, p: Arc<Pending>) -> Result<(), Error> {
        let mut t = lock(&self.pending);
        if let Some(e) = &t.broken {
            return Err(e.clone());
        }
        t.map.insert(id, p);
        Ok(())
    }

    /// Marks the link broken (first cause wins), unblocks its threads. The
    /// last thread to exit fails the requests still outstanding, so none
    /// completes while a thread may still touch its memory.
    pub(in crate::engine) fn fail(&self, cause: Error) {
        {
            let mut t = lock(&self.pending);
            if t.broken.is_some() {
                return;
            }
            tracing::debug!(remote = %self.remote, %cause, "link failed");
            t.broken = Some(cause);
            self.broken.store(true, Ordering::Release);
        }
        self.parts.on_fail();
        for s in &self.streams {
            let _ = s.sock.shutdown(Shutdown::Both);
            let _ = s.tx.send(Job::Stop);
        }
    }

    pub(in crate::engine) fn thread_exit(&self) {
        if self.alive.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let (pending, cause) = {
            let mut t = lock(&self.pending);
            let cause = t.broken.clone().unwrap_or(Error::Closed);
            (std::mem::take(&mut t.map), cause)
        };
        for s in &self.streams {
            lock(&s.reads).clear();
        }
        for (_, p) in pending {
            self.unsettle(&p);
            p.finish(Some(cause.clone()));
        }
        self.parts.on_closed(cause);
    }

    /// Marks `p`, about to fail for the link's break, unsettled: bytes of
    /// it may still be on their way to the target until the link's
    /// [`Settle`] proves otherwise.
    pub(in crate::engine) fn unsettle(&self, p: &Pending) {
        if let Some(settle) = &self.settle {
            p.completion.mark_unsettled(settle);
        }
    }

    pub(in crate::engine) fn join(&self) {
        let threads = std::mem::take(&mut *lock(&self.threads));
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }

    pub(in crate::engine) fn io_error(&self, e: io::Error) -> Error {
        if e.kind() == io::ErrorKind::TimedOut {
            Error::PeerTimedOut {
                remote: self.remote.clone(),
                idle: self.io_timeout,
            }
        } else if e.kind() == io::ErrorKind::InvalidData {
            Error::ProtocolViolation {
                remote: self.remote.clone(),
                detail: e.to_string(),
            }
        } else {
            Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(e),
            }
        }
    }

    pub(in crate::engine) fn complete_event(
        &self,
        req: u64,
        p: &Pending,
        result: Result<(), Error>,
    ) {
        if p.event(result) {
            lock(&self.pending).map.remove(&req);
            p.finish(None);
        }
    }
}

impl<P: SocketPath> Link for SocketLink<P> {
    fn is_broken(&self) -> bool {
        SocketLink::is_broken(self)
    }

    fn fail(&self, cause: Error) {
        SocketLink::fail(self, cause);
    }

    fn join(&self) {
        SocketLink::join(self);
    }

    fn submit(self: Arc<Self>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        P::submit(self, sub)
    }

    fn resubmit(
        &self,
        cx: Ctx<'_>,
        req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        P::resubmit(self, cx, req)
    }

    fn forget(&self) {
        self.parts.forget();
    }

    fn prepare(
        self: Arc<Self>,
        cx: Ctx<'_>,
        peer: Arc<Peer>,
        req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<Box<dyn Prepared>, Error> {
        P::prepare(self, cx, peer, req, resolved)
    }

    fn prepare_indexed(
        self: Arc<Self>,
        peer: Arc<Peer>,
        segs: &Arc<IndexedSegs>,
        bytes: u64,
        guards: Few<RegionGuard>,
    ) -> Option<(Box<dyn Prepared>, usize)> {
        P::prepare_indexed(self, peer, segs, bytes, guards)
    }
}
