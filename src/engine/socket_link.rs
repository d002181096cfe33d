//! The link of the socket transports: TCP streams to one peer, which carry
//! the data (`tcp`), or the control beside cross-memory copies (`shm`) or
//! RDMA queue pairs (`rdma`). The link's state (streams, the table of
//! requests in flight, its threads) lives here; each transport's submit and
//! progress live in its own module (`tcp_stream`, `cma`, `rdma::link`).

use super::*;

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
    /// Cross-memory path: the target's answer to the request's grants
    /// (made on first use: a channel is several allocations, which the
    /// other paths need not pay).
    pub(in crate::engine) granted: OnceLock<(Sender<u16>, Receiver<u16>)>,
    /// RDMA requests no waiter polls for (see [`SocketLink::undriven`]): the
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
            granted: OnceLock::new(),
            undriven,
        })
    }

    pub(in crate::engine) fn granted(&self) -> &(Sender<u16>, Receiver<u16>) {
        self.granted.get_or_init(|| crossbeam_channel::bounded(1))
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
    pub(in crate::engine) pending: Arc<Pending>,
}

#[derive(Clone, Copy)]
pub(in crate::engine) struct Seg {
    pub(in crate::engine) mem_type: MemoryType,
    pub(in crate::engine) local: u64,
    pub(in crate::engine) remote: u64,
    pub(in crate::engine) len: u64,
    pub(in crate::engine) key: u64,
}

pub(in crate::engine) enum Tail {
    None,
    Commit {
        segments: u64,
        sync: Option<Vec<u8>>,
    },
    Fence,
}

/// A range the target must grant for a cross-memory request.
pub(in crate::engine) struct GrantRange {
    pub(in crate::engine) mem_type: MemoryType,
    pub(in crate::engine) addr: u64,
    pub(in crate::engine) len: u64,
    pub(in crate::engine) key: u64,
}

/// How a cross-memory request goes on after its grants and copy.
pub(in crate::engine) enum CmaOutcome {
    /// Commit it (after an `Abort` frame when `aborted`: its copy stopped
    /// or never began, and the target releases its grants and drops its
    /// sync message).
    Commit { aborted: bool },
    /// Nothing more to send: it has finished (refused, aborted before
    /// anything was sent), or the target copies and commits it.
    Done,
}

pub(in crate::engine) enum Job {
    /// Cross-memory request: grants, direct copy, commit.
    Cma {
        req: u64,
        op: TransferOp,
        pid: u32,
        pieces: Vec<Piece>,
        grants: Vec<GrantRange>,
        sync: Option<Vec<u8>>,
        /// Ask the target to copy (see [`should_delegate`]).
        delegate: bool,
        pending: Arc<Pending>,
    },
    Frames {
        req: u64,
        op: TransferOp,
        segs: Vec<Seg>,
        tail: Tail,
        pending: Arc<Pending>,
    },
    Stop,
}

pub(in crate::engine) struct StreamHandle {
    pub(in crate::engine) tx: Sender<Job>,
    pub(in crate::engine) reads: Mutex<VecDeque<ReadSlot>>,
    pub(in crate::engine) sock: TcpStream,
}

#[derive(Default)]
pub(in crate::engine) struct PendingTable {
    pub(in crate::engine) map: HashMap<u64, Arc<Pending>, FastHash>,
    pub(in crate::engine) broken: Option<Error>,
}

/// The connections from this agent to one remote agent.
pub(in crate::engine) struct SocketLink {
    /// RDMA path: the queue pairs and their posting state (no queue pair
    /// on the other paths).
    pub(in crate::engine) rdma: rdma::RdmaParts,
    /// Cross-memory path: copy threads and delegation.
    pub(in crate::engine) cma: CmaParts,
    pub(in crate::engine) remote: String,
    pub(in crate::engine) io_timeout: Duration,
    /// The agent's count of requests in flight.
    pub(in crate::engine) in_flight: Arc<AtomicUsize>,
    /// What carries this link's requests (every status reports it).
    pub(in crate::engine) path: Arc<crate::agent::DataPath>,
    pub(in crate::engine) streams: Vec<StreamHandle>,
    pub(in crate::engine) pending: Mutex<PendingTable>,
    /// Set (under `pending`'s lock) when `pending.broken` is: a request's
    /// path reads it without the lock.
    pub(in crate::engine) broken: AtomicBool,
    pub(in crate::engine) clock: ProgressClock,
    pub(in crate::engine) alive: AtomicUsize,
    pub(in crate::engine) threads: Mutex<Vec<JoinHandle<()>>>,
}

impl SocketLink {
    /// Opens `streams_per_peer` connections to `peer` and starts their
    /// threads.
    pub(in crate::engine) fn open(
        inner: &Inner,
        peer: &AgentDesc,
        n_streams: usize,
        path: Path,
    ) -> Result<Arc<SocketLink>, Error> {
        let cfg = &inner.config;
        let use_rdma = path == Path::Rdma;
        let link_id = random_u64();
        let mut may_delegate = false;
        let mut streams = Vec::with_capacity(n_streams);
        let mut receivers = Vec::with_capacity(n_streams);
        let mut rdma_conns = Vec::new();
        for i in 0..n_streams {
            // Each stream: connected, authenticated and greeted within the
            // connect timeout, however slowly the peer answers.
            let deadline = std::time::Instant::now() + cfg.connect_timeout;
            let sock = connect_any(&peer.endpoints, deadline)?;
            let clock = ProgressClock::new();
            let ticket = handshake(inner, peer, &sock, link_id, i as u32, &clock, deadline)?;
            // A target in this very process never copies for it: no proof,
            // no delegation asked.
            let other_process = !matches!(path, Path::Cma { pid } if pid == std::process::id());
            if i == 0 && matches!(path, Path::Cma { .. }) && cfg.shm.delegate && other_process {
                // The target copies for this process only once the kernel
                // has told it on its local socket that this is the process.
                match local_proof::prove(peer.instance, ticket, cfg.connect_timeout) {
                    Ok(()) => may_delegate = true,
                    Err(e) => {
                        tracing::debug!(remote = %peer.name, error = %e, "no local proof; the target will not copy for this agent")
                    }
                }
            }
            if i == 0 && use_rdma {
                for k in 0..cfg.rdma.qps_per_peer {
                    rdma_conns.push(rdma_connect(inner, peer, &sock, &clock, k)?);
                }
            }
            sock.set_read_timeout(Some(tick(cfg.io_timeout)))?;
            sock.set_write_timeout(Some(tick(cfg.io_timeout)))?;
            let (tx, rx) = crossbeam_channel::unbounded();
            streams.push(StreamHandle {
                tx,
                reads: Mutex::new(VecDeque::new()),
                sock,
            });
            receivers.push(rx);
        }
        let n_qps = rdma_conns.len();
        let (device, mechanism) = match path {
            Path::Tcp => (
                streams[0].sock.peer_addr().ok().map(|a| a.to_string()),
                "TCP streams; the kernel copies between socket and registered memory",
            ),
            Path::Cma { .. } => (
                None,
                "cross-memory attach (process_vm_writev/readv), one copy",
            ),
            Path::Rdma => (
                inner.device.as_ref().map(|d| d.name().to_owned()),
                "one-sided RDMA WRITE/READ on RC queue pairs, zero copy",
            ),
            Path::InProcess => unreachable!("an in-process peer's link is a LocalLink"),
        };
        let data_path = Arc::new(DataPath {
            transport: path.kind(),
            device,
            mechanism,
        });
        let link = Arc::new(SocketLink {
            rdma: rdma::RdmaParts::new(rdma_conns),
            cma: CmaParts {
                copy_threads: cfg.shm.copy_threads,
                delegate_probe: cfg
                    .shm
                    .delegate
                    .then_some((&*inner.probe_word as *const u64 as u64, inner.instance)),
                delegate_ok: AtomicBool::new(may_delegate),
            },
            remote: peer.name.clone(),
            io_timeout: cfg.io_timeout,
            in_flight: Arc::clone(&inner.in_flight),
            path: data_path,
            alive: AtomicUsize::new(2 * streams.len() + n_qps),
            streams,
            pending: Mutex::new(PendingTable::default()),
            broken: AtomicBool::new(false),
            clock: ProgressClock::new(),
            threads: Mutex::new(Vec::new()),
        });
        let mut threads = Vec::new();
        for (i, rx) in receivers.into_iter().enumerate() {
            let l = Arc::clone(&link);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvxfer-send-{}-{i}", peer.name))
                    .spawn(move || l.run_sender(i, rx))?,
            );
            let l = Arc::clone(&link);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvxfer-recv-{}-{i}", peer.name))
                    .spawn(move || l.run_reader(i))?,
            );
        }
        let mut progress = Vec::new();
        let adaptive = cfg.rdma.progress == crate::agent::RdmaProgress::Adaptive;
        for k in 0..n_qps {
            let l = Arc::clone(&link);
            let t = std::thread::Builder::new()
                .name(format!("kvxfer-rdma-{}-{k}", peer.name))
                .spawn(move || l.run_rdma_progress(k, adaptive))?;
            progress.push(t.thread().clone());
            threads.push(t);
        }
        let _ = link.rdma.progress_threads.set(progress);
        *lock(&link.threads) = threads;
        tracing::debug!(remote = %peer.name, streams = link.streams.len(), "link open");
        Ok(link)
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
        for r in &self.rdma.qps {
            // Flush every posted work request; the progress threads drain
            // the completions and exit when none is left.
            let _ = lock(&r.qp).set_error();
        }
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
            p.finish(Some(cause.clone()));
        }
        self.finish_express(Err(cause), true);
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

impl Link for SocketLink {
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
        match sub.peer.path {
            Path::Tcp => self.submit_streams(sub),
            Path::Cma { pid } => self.submit_cma(pid, sub),
            Path::Rdma => self.submit_rdma(sub),
            Path::InProcess => unreachable!("an in-process peer's link is a LocalLink"),
        }
    }

    fn prepare(
        self: Arc<Self>,
        engine: &Engine,
        peer: Arc<Peer>,
        req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<Box<dyn std::any::Any + Send + Sync>, Error> {
        if peer.path == Path::Rdma {
            return Ok(Box::new(self.prepare_rdma(engine, peer, req, resolved)?));
        }
        // The socket paths keep only the holds on the local regions: the
        // request was checked now, and is validated in full on every
        // submission.
        Ok(PreparedHold::keep(resolved))
    }
}
