//! Cross-memory (shm) requests at the initiator: grants, the direct copy
//! (`process_vm_writev`/`readv`, stopped between calls by an abort), and
//! delegating the copy to the target when its side is the contiguous one.

use super::*;

/// The cross-memory part of a socket link.
pub(in crate::engine) struct CmaParts {
    /// The target's process.
    pub(in crate::engine) pid: u32,
    /// Threads a large copy is split over.
    pub(in crate::engine) copy_threads: usize,
    /// This agent's probe address and instance, sent with `Delegate` so the
    /// target can prove it reaches this process; `None`: never delegate.
    pub(in crate::engine) delegate_probe: Option<(u64, u64)>,
    /// Cleared when the target refuses a delegated copy: later requests do
    /// not ask again.
    pub(in crate::engine) delegate_ok: AtomicBool,
}

/// A cross-memory request for the first stream's sender thread: grants,
/// direct copy (or a delegated one), commit.
pub(in crate::engine) struct CmaJob {
    req: u64,
    op: TransferOp,
    pieces: Vec<Piece>,
    grants: Vec<GrantRange>,
    sync: Option<Vec<u8>>,
    /// Ask the target to copy (see [`should_delegate`]).
    delegate: bool,
    pending: Arc<Pending>,
}

impl SocketPath for CmaParts {
    type Job = CmaJob;

    fn submit(link: Arc<CmaLink>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        link.submit_cma(sub)
    }

    fn run_job(
        link: &CmaLink,
        fd: std::os::fd::RawFd,
        job: CmaJob,
    ) -> Result<Option<Frames>, Error> {
        let CmaJob {
            req,
            op,
            pieces,
            grants,
            sync,
            delegate,
            pending,
        } = job;
        let delegate = delegate.then_some(sync.as_deref());
        Ok(
            match link.run_cma(fd, req, op, &pieces, &grants, delegate, &pending)? {
                CmaOutcome::Commit { aborted } => Some(Frames {
                    req,
                    op,
                    segs: Vec::new(),
                    tail: Tail::Commit {
                        segments: 0,
                        sync,
                        durable: false,
                    },
                    pending,
                    aborted,
                }),
                CmaOutcome::Done => None,
            },
        )
    }
}

impl CmaLink {
    /// Opens the control stream to `peer`, the process `pid` on this host,
    /// and proves this process to it (so that it may copy for this one)
    /// when delegation is on.
    pub(in crate::engine) fn open(
        inner: &Inner,
        peer: &AgentDesc,
        pid: u32,
    ) -> Result<Arc<Self>, Error> {
        let cfg = &inner.config;
        // A target in this very process never copies for it: no proof, no
        // delegation asked.
        let ask = cfg.shm.delegate && pid != std::process::id();
        let mut may_delegate = false;
        let streams = connect_streams(inner, peer, 1, |_, _, _, ticket| {
            if ask {
                // The target copies for this process only once the kernel
                // has told it on its local socket that this is the process.
                match local_proof::prove(peer.instance, ticket, cfg.connect_timeout) {
                    Ok(()) => may_delegate = true,
                    Err(e) => {
                        tracing::debug!(remote = %peer.name, error = %e, "no local proof; the target will not copy for this agent")
                    }
                }
            }
            Ok(())
        })?;
        let parts = CmaParts {
            pid,
            copy_threads: cfg.shm.copy_threads,
            delegate_probe: cfg
                .shm
                .delegate
                .then_some((&*inner.probe_word as *const u64 as u64, inner.instance)),
            delegate_ok: AtomicBool::new(may_delegate),
        };
        let path = DataPath {
            transport: TransportKind::Shm,
            device: None,
            mechanism: "cross-memory attach (process_vm_writev/readv), one copy",
        };
        Self::start(inner, peer, streams, parts, path)
    }

    /// Submits a cross-memory request: the link's first stream grants,
    /// copies (or delegates) and commits it.
    pub(in crate::engine) fn submit_cma(
        self: &Arc<Self>,
        sub: Submission<'_>,
    ) -> Result<TransferStatus, Error> {
        let Submission {
            engine,
            req,
            resolved,
            sync,
            ..
        } = sub;
        let (id, completion) = engine.new_request(&self.meter, req.local.total_len());
        let pending = Pending::new(&completion, 1, resolved.guards, None);
        self.insert(id, Arc::clone(&pending))?;
        self.clock.touch();
        let job = Job::Path(CmaJob {
            req: id,
            op: req.op,
            pieces: req
                .local
                .descs
                .iter()
                .zip(&req.remote.descs)
                .map(|(l, r)| Piece {
                    local: l.addr,
                    remote: r.addr,
                    len: l.len,
                })
                .collect(),
            grants: grant_ranges(&req.remote, &resolved.keys),
            delegate: should_delegate(req),
            sync,
            pending,
        });
        if self.streams[0].tx.send(job).is_err() {
            self.fail(Error::Closed);
        }
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }

    /// Waits for the target's answer to a request's grants (or delegate).
    pub(in crate::engine) fn wait_granted(&self, pending: &Pending) -> Result<u16, Error> {
        loop {
            match pending.granted().1.recv_timeout(tick(self.io_timeout)) {
                Ok(st) => return Ok(st),
                Err(_) => {
                    if let Some(e) = &lock(&self.pending).broken {
                        return Err(e.clone());
                    }
                }
            }
        }
    }

    /// Asks the target to do a granted request's copy and commit it with
    /// `sync`. `Ok(true)`: done (its `Ack` completes the request);
    /// `Ok(false)`: refused, the caller copies and commits (and this link
    /// asks no more); `Err`: the target's copy failed, the link is broken.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::engine) fn run_delegate(
        &self,
        fd: std::os::fd::RawFd,
        req: u64,
        op: TransferOp,
        pieces: &[Piece],
        sync: Option<&[u8]>,
        (probe_addr, instance): (u64, u64),
        pending: &Pending,
    ) -> Result<bool, Error> {
        let mut table = Vec::with_capacity(pieces.len() * wire::DELEGATE_ENTRY);
        for p in pieces {
            table.extend_from_slice(&p.remote.to_le_bytes());
            table.extend_from_slice(&p.local.to_le_bytes());
            table.extend_from_slice(&p.len.to_le_bytes());
        }
        let hdr = Frame::Delegate {
            req,
            op: match op {
                TransferOp::Write => CommitOp::Write,
                TransferOp::Read => CommitOp::Read,
            },
            count: pieces.len() as u32,
            pid: std::process::id(),
            probe_addr,
            instance,
            sync_len: sync.map_or(0, |m| m.len() as u32),
            has_sync: sync.is_some(),
        }
        .encode();
        let body = sync.unwrap_or_default();
        let mut iovs = [
            iov(hdr.as_ptr(), HEADER_LEN),
            iov(table.as_ptr(), table.len()),
            iov(body.as_ptr(), body.len()),
        ];
        // SAFETY: the iovecs point into `hdr`, `table` and `body`, alive for
        // the call.
        unsafe { writev_all(fd, &mut iovs, &self.clock, self.io_timeout) }
            .map_err(|e| self.io_error(e))?;
        match self.wait_granted(pending)? {
            status::OK => {
                self.clock.touch();
                Ok(true)
            }
            status::DELEGATE_REFUSED => {
                tracing::debug!(remote = %self.remote, "target declined delegated copies; copying here");
                self.parts.delegate_ok.store(false, Ordering::Relaxed);
                Ok(false)
            }
            st => Err(Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(io::Error::other(format!(
                    "the target's delegated cross-memory copy failed (status {st})"
                ))),
            }),
        }
    }

    /// Grants and direct copy of a cross-memory request; `Err`: the link is
    /// broken.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::engine) fn run_cma(
        &self,
        fd: std::os::fd::RawFd,
        req: u64,
        op: TransferOp,
        pieces: &[Piece],
        grants: &[GrantRange],
        delegate: Option<Option<&[u8]>>,
        pending: &Pending,
    ) -> Result<CmaOutcome, Error> {
        if pending.completion.abort_requested() {
            // Nothing sent yet: the target never hears of it.
            self.complete_event(req, pending, Err(Error::Aborted));
            return Ok(CmaOutcome::Done);
        }
        if grants.is_empty() {
            return Ok(CmaOutcome::Commit { aborted: false });
        }
        let frames: Vec<[u8; HEADER_LEN]> = grants
            .iter()
            .map(|g| {
                Frame::Grant {
                    req,
                    mem_type: g.mem_type,
                    addr: g.addr,
                    len: g.len,
                    key: g.key,
                    total: grants.len() as u32,
                }
                .encode()
            })
            .collect();
        let mut iovs: Vec<_> = frames.iter().map(|f| iov(f.as_ptr(), HEADER_LEN)).collect();
        // SAFETY: the iovecs point into `frames`, alive for the call.
        unsafe { writev_all(fd, &mut iovs, &self.clock, self.io_timeout) }
            .map_err(|e| self.io_error(e))?;
        let st = self.wait_granted(pending)?;
        if st != status::OK {
            self.complete_event(
                req,
                pending,
                Err(Error::RemoteRejected {
                    remote: self.remote.clone(),
                    reason: RejectReason::from_code(st),
                }),
            );
            return Ok(CmaOutcome::Done);
        }
        if pending.completion.abort_requested() {
            return Ok(CmaOutcome::Commit { aborted: true });
        }
        if let (Some(sync), Some((probe_addr, instance))) = (delegate, self.parts.delegate_probe)
            && self.parts.delegate_ok.load(Ordering::Relaxed)
            && self.run_delegate(fd, req, op, pieces, sync, (probe_addr, instance), pending)?
        {
            return Ok(CmaOutcome::Done);
        }
        let dir = match op {
            TransferOp::Write => Direction::Write,
            TransferOp::Read => Direction::Read,
        };
        let stop = || pending.completion.abort_requested();
        // SAFETY: local pieces lie in regions validated at submit time and
        // held by the request's guards until it completes, which cannot
        // happen before this copy returns (the commit follows it).
        let copied = unsafe {
            shm::copy_parallel(
                self.parts.pid,
                dir,
                pieces,
                self.parts.copy_threads,
                PARALLEL_COPY_MIN,
                &stop,
            )
        }
        .map_err(|e| Error::ConnectionLost {
            remote: self.remote.clone(),
            cause: Arc::new(if e.raw_os_error() == Some(libc::ESRCH) {
                io::Error::new(io::ErrorKind::ConnectionReset, "target process exited")
            } else {
                e
            }),
        })?;
        self.clock.touch();
        Ok(CmaOutcome::Commit { aborted: !copied })
    }
}
