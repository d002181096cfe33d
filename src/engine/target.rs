//! The target side: accept loop, authentication and `Hello`, and the
//! per-connection service that lands WRITE payloads, answers READs, admits
//! cross-memory grants, copies delegated requests for a proven initiator,
//! accepts RDMA queue pairs, and acknowledges each request once all its
//! segments are processed (its sync message delivered first).

use super::*;

/// One initiator's link as seen by the target.
pub(in crate::engine) struct Session {
    pub(in crate::engine) remote: String,
    pub(in crate::engine) table: Mutex<RequestTable<HeldSync>>,
    /// Cross-memory grants held until each request's commit.
    pub(in crate::engine) grants: Mutex<HashMap<u64, Grants>>,
    pub(in crate::engine) streams: AtomicUsize,
    /// Names this session on the local proof socket (see [`local_proof`]).
    pub(in crate::engine) ticket: u128,
    /// The process proven to be this session's initiator, once it has
    /// presented the ticket on the local socket: the only process a
    /// delegated copy may touch.
    pub(in crate::engine) proven: Mutex<Option<local_proof::ProvenPeer>>,
    /// Whether this agent copies for the initiator (`Delegate`): the
    /// initiator's (pid, probe address, instance) and the probe's verdict,
    /// decided on its first delegated request.
    pub(in crate::engine) delegate: Mutex<Option<(u32, u64, u64, bool)>>,
}

#[derive(Default)]
pub(in crate::engine) struct Grants {
    pub(in crate::engine) seen: u32,
    pub(in crate::engine) guards: Vec<RegionGuard>,
    /// The admitted ranges, `(addr, len)`: a delegated copy may write (or
    /// read) only inside them.
    pub(in crate::engine) spans: Vec<(u64, u64)>,
    pub(in crate::engine) refused: Option<RejectReason>,
}

pub(in crate::engine) struct ServerIdle<'a> {
    pub(in crate::engine) inner: &'a Inner,
    pub(in crate::engine) clock: &'a ProgressClock,
}

impl IdlePolicy for ServerIdle<'_> {
    fn on_idle(&mut self, mid_frame: bool) -> io::Result<()> {
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "agent closing",
            ));
        }
        if mid_frame && self.clock.idle() > self.inner.config.io_timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "initiator stalled in the middle of a frame",
            ));
        }
        Ok(())
    }
}

/// A sync message as the target holds it until its request finishes: the
/// bytes, and their room in the inbox.
pub(in crate::engine) type HeldSync = (Vec<u8>, Reservation);

/// The sync message a `Commit` or `Delegate` announced.
pub(in crate::engine) enum SyncBody {
    /// None announced.
    None,
    /// Read, with room in the inbox.
    Held(HeldSync),
    /// Skipped: no room for it (the request fails with this reason).
    Refused(RejectReason),
}

/// Reads the sync message a `Commit` or `Delegate` announces (none: no
/// body allowed) into room reserved for it in `inbox`; without room, skips
/// it.
pub(in crate::engine) fn read_sync(
    reader: &mut FrameReader<'_>,
    inbox: &Arc<Inbox>,
    from: &str,
    has_sync: bool,
    sync_len: u32,
    idle: &mut dyn IdlePolicy,
) -> io::Result<SyncBody> {
    if !has_sync {
        return if sync_len != 0 {
            Err(violation("a body without a sync message"))
        } else {
            Ok(SyncBody::None)
        };
    }
    match inbox.reserve(from, u64::from(sync_len)) {
        Ok(room) => Ok(SyncBody::Held((
            reader.read_vec(sync_len as usize, idle)?,
            room,
        ))),
        Err(reason) => {
            tracing::debug!(remote = %from, sync_len, %reason, "refused a sync message");
            reader.discard(u64::from(sync_len), idle)?;
            Ok(SyncBody::Refused(reason))
        }
    }
}

/// Records the commit of `req` with its sync message.
pub(in crate::engine) fn commit(
    session: &Session,
    req: u64,
    segments: u64,
    sync: SyncBody,
) -> io::Result<Option<Finished<HeldSync>>> {
    let mut table = lock(&session.table);
    let sync = match sync {
        SyncBody::None => None,
        SyncBody::Held(h) => Some(h),
        SyncBody::Refused(reason) => {
            table.segments(req, 0, Err(reason)).map_err(violation)?;
            None
        }
    };
    table.commit(req, segments, sync).map_err(violation)
}

pub(in crate::engine) fn violation(detail: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail.into())
}

/// Sends header-only frames.
pub(in crate::engine) fn send_frames(
    sock: &TcpStream,
    frames: &[[u8; HEADER_LEN]],
    clock: &ProgressClock,
    io_timeout: Duration,
) -> io::Result<()> {
    let mut iovs: Vec<_> = frames.iter().map(|f| iov(f.as_ptr(), HEADER_LEN)).collect();
    // SAFETY: the iovecs point into `frames`, alive for the call.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs, clock, io_timeout) }
}

impl Inner {
    pub(in crate::engine) fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        // A descriptor kept in reserve: when the process runs out, it is
        // given up to accept and close the waiting connection (its peer
        // learns at once instead of timing out), then taken again.
        let mut reserve = std::fs::File::open("/dev/null").ok();
        for conn in listener.incoming() {
            if self.closing.load(Ordering::SeqCst) {
                break;
            }
            let sock = match conn {
                Ok(s) => s,
                Err(e) => {
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    tracing::warn!(agent = %self.config.name, error = %e, "accept failed");
                    if out_of_fds && reserve.take().is_some() {
                        drop(listener.accept());
                        reserve = std::fs::File::open("/dev/null").ok();
                    } else {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    continue;
                }
            };
            let mut server = lock(&self.server);
            server.threads.retain(|t| !t.is_finished());
            if server.socks.len() >= self.config.limits.max_incoming_connections {
                tracing::warn!(agent = %self.config.name, limit = self.config.limits.max_incoming_connections, peer = ?sock.peer_addr().ok(), "too many incoming connections; closing a new one");
                continue;
            }
            if self.unauthenticated.fetch_add(1, Ordering::SeqCst)
                >= self.config.limits.max_unauthenticated
            {
                self.unauthenticated.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(agent = %self.config.name, limit = self.config.limits.max_unauthenticated, peer = ?sock.peer_addr().ok(), "too many connections still authenticating; closing a new one");
                continue;
            }
            let pending_auth = Unauthenticated(Arc::clone(&self.unauthenticated));
            let id = server.next_id;
            server.next_id += 1;
            let Ok(clone) = sock.try_clone() else {
                continue;
            };
            server.socks.insert(id, clone);
            let me = Arc::clone(&self);
            let spawned = std::thread::Builder::new()
                .name(format!("kvxfer-serve-{}", self.config.name))
                .spawn(move || {
                    if let Err(e) = me.serve(&sock, pending_auth) {
                        tracing::debug!(agent = %me.config.name, error = %e, "incoming connection ended");
                    }
                    lock(&me.server).socks.remove(&id);
                });
            match spawned {
                Ok(t) => server.threads.push(t),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot spawn connection thread");
                    server.socks.remove(&id);
                }
            }
        }
    }

    pub(in crate::engine) fn serve(
        &self,
        sock: &TcpStream,
        pending_auth: Unauthenticated,
    ) -> io::Result<()> {
        sock.set_nodelay(true)?;
        sock.set_read_timeout(Some(tick(self.config.io_timeout)))?;
        sock.set_write_timeout(Some(tick(self.config.io_timeout)))?;
        let clock = ProgressClock::new();
        let mut idle = ServerIdle {
            inner: self,
            clock: &clock,
        };
        let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
        // Nothing is answered before the initiator has authenticated, and
        // it must do so within the connect timeout.
        let stop = || self.closing.load(Ordering::Relaxed);
        reader.set_deadline(Some(
            std::time::Instant::now() + self.config.connect_timeout,
        ));
        let verdict = handshake::respond(
            sock.as_fd(),
            &mut reader,
            &stop,
            self.config.security.credential.as_ref(),
            &self.config.name,
            &clock,
            self.config.io_timeout,
        );
        reader.set_deadline(None);
        drop(pending_auth);
        let authenticated = match verdict? {
            handshake::Verdict::Accepted(name) => name,
            handshake::Verdict::Refused(why) => {
                tracing::warn!(agent = %self.config.name, peer = ?sock.peer_addr().ok(), %why, "refused an unauthenticated connection");
                return Ok(());
            }
        };
        loop {
            let Some(raw) = reader.next_header(&mut idle)? else {
                return Ok(());
            };
            match Frame::decode(&raw).map_err(|e| violation(e.to_string()))? {
                Frame::DescRequest => {
                    let body = self.local_desc().encode();
                    let hdr = Frame::DescReply {
                        body_len: body.len() as u32,
                    }
                    .encode();
                    let mut iovs = [
                        iov(hdr.as_ptr(), HEADER_LEN),
                        iov(body.as_ptr(), body.len()),
                    ];
                    // SAFETY: both iovecs point into live locals.
                    unsafe {
                        writev_all(sock.as_raw_fd(), &mut iovs, &clock, self.config.io_timeout)?
                    };
                }
                Frame::Hello {
                    instance,
                    expect,
                    version,
                    link,
                    stream: _,
                    name_len,
                } => {
                    let name = reader.read_vec(name_len as usize, &mut idle)?;
                    if name != authenticated.as_bytes() {
                        return Err(violation(format!(
                            "hello names agent {:?}, but the connection authenticated as {authenticated:?}",
                            String::from_utf8_lossy(&name)
                        )));
                    }
                    let st = if version != PROTOCOL_VERSION {
                        status::BAD_VERSION
                    } else if expect != 0 && expect != self.instance {
                        status::STALE_INSTANCE
                    } else {
                        status::OK
                    };
                    let hello_ack = |status, ticket| {
                        send_frames(
                            sock,
                            &[Frame::HelloAck {
                                instance: self.instance,
                                status,
                                ticket,
                            }
                            .encode()],
                            &clock,
                            self.config.io_timeout,
                        )
                    };
                    if st != status::OK {
                        return hello_ack(st, 0);
                    }
                    let key = (instance, link);
                    let session = {
                        let mut sessions = lock(&self.sessions);
                        let s = sessions.entry(key).or_insert_with(|| {
                            Arc::new(Session {
                                remote: authenticated.clone(),
                                table: Mutex::new(RequestTable::default()),
                                grants: Mutex::new(HashMap::new()),
                                streams: AtomicUsize::new(0),
                                ticket: u128::from_le_bytes(crate::auth::random_bytes()),
                                proven: Mutex::new(None),
                                delegate: Mutex::new(None),
                            })
                        });
                        // Another agent's session: a connection joins only
                        // the sessions of the agent it authenticated as.
                        if s.remote != authenticated {
                            let owner = s.remote.clone();
                            drop(sessions);
                            return Err(violation(format!(
                                "{authenticated:?} tried to join a session of {owner:?}"
                            )));
                        }
                        s.streams.fetch_add(1, Ordering::SeqCst);
                        Arc::clone(s)
                    };
                    if let Err(e) = hello_ack(status::OK, session.ticket) {
                        if session.streams.fetch_sub(1, Ordering::SeqCst) == 1 {
                            lock(&self.sessions).remove(&key);
                        }
                        return Err(e);
                    }
                    let r = self.serve_data(sock, &mut reader, &mut idle, &session);
                    if session.streams.fetch_sub(1, Ordering::SeqCst) == 1 {
                        lock(&self.sessions).remove(&key);
                    }
                    return r;
                }
                other => return Err(violation(format!("unexpected first frame {other:?}"))),
            }
        }
    }

    pub(in crate::engine) fn serve_data(
        &self,
        sock: &TcpStream,
        reader: &mut FrameReader<'_>,
        idle: &mut ServerIdle<'_>,
        session: &Session,
    ) -> io::Result<()> {
        let clock = idle.clock;
        // RDMA receive threads of this connection; stopped and joined when it
        // ends (dropping them).
        let mut rdma_receivers: Vec<RdmaReceiver> = Vec::new();
        loop {
            let Some(raw) = reader.next_header(idle)? else {
                return Ok(());
            };
            let finished = match Frame::decode(&raw).map_err(|e| violation(e.to_string()))? {
                Frame::Write {
                    req,
                    mem_type,
                    addr,
                    len,
                    key,
                } => {
                    let result = match self.registry.admit_remote(mem_type, addr, len, key) {
                        Ok(guard) => {
                            // SAFETY: `[addr, addr + len)` lies inside a region
                            // registered with this agent, whose registrant
                            // promised it stays valid for writes while
                            // registered; `guard` keeps it from being
                            // deregistered until the payload has landed.
                            unsafe { reader.read_into(addr as *mut u8, len as usize, idle)? };
                            drop(guard);
                            Ok(())
                        }
                        Err(reason) => {
                            tracing::debug!(remote = %session.remote, addr, len, %reason, "refused write segment");
                            reader.discard(len, idle)?;
                            Err(reason)
                        }
                    };
                    lock(&session.table)
                        .segment(req, result)
                        .map_err(violation)?
                }
                Frame::ReadReq {
                    req,
                    mem_type,
                    addr,
                    len,
                    key,
                } => {
                    let result = match self.registry.admit_remote(mem_type, addr, len, key) {
                        Ok(guard) => {
                            let hdr = Frame::ReadData {
                                req,
                                len,
                                status: status::OK,
                            }
                            .encode();
                            let mut iovs = [
                                iov(hdr.as_ptr(), HEADER_LEN),
                                iov(addr as *const u8, len as usize),
                            ];
                            // SAFETY: the payload range lies inside a region
                            // registered here and held by `guard`; the header
                            // is a live local.
                            unsafe {
                                writev_all(
                                    sock.as_raw_fd(),
                                    &mut iovs,
                                    clock,
                                    self.config.io_timeout,
                                )?
                            };
                            drop(guard);
                            Ok(())
                        }
                        Err(reason) => {
                            send_frames(
                                sock,
                                &[Frame::ReadData {
                                    req,
                                    len: 0,
                                    status: reason.code(),
                                }
                                .encode()],
                                clock,
                                self.config.io_timeout,
                            )?;
                            Err(reason)
                        }
                    };
                    lock(&session.table)
                        .segment(req, result)
                        .map_err(violation)?
                }
                Frame::Fence { req } => lock(&session.table)
                    .segment(req, Ok(()))
                    .map_err(violation)?,
                Frame::Abort { req, segments } => lock(&session.table)
                    .segments(req, segments, Err(RejectReason::Aborted))
                    .map_err(violation)?,
                Frame::WriteList {
                    req,
                    mem_type,
                    count,
                    total,
                    key,
                } => {
                    let table =
                        reader.read_vec_mid_frame(count as usize * WRITE_LIST_ENTRY, idle)?;
                    let WriteListTable { pieces, lo, hi } =
                        write_list_pieces(&table, total).map_err(violation)?;
                    // One admission for the span: a key names one region,
                    // so the span inside it puts every piece inside it.
                    let result = match self.registry.admit_remote(mem_type, lo, hi - lo, key) {
                        Ok(guard) => {
                            // SAFETY: every piece lies inside the admitted
                            // span of a registered region, writable while
                            // registered; `guard` holds the registration
                            // until the payload has landed.
                            unsafe { reader.read_into_many(&pieces, idle)? };
                            drop(guard);
                            Ok(())
                        }
                        Err(reason) => {
                            tracing::debug!(remote = %session.remote, lo, hi, %reason, "refused write list");
                            reader.discard(total, idle)?;
                            Err(reason)
                        }
                    };
                    lock(&session.table)
                        .segments(req, u64::from(count), result)
                        .map_err(violation)?
                }
                Frame::QpConnect { qpn, psn, mtu } => {
                    let gid: [u8; 16] = reader
                        .read_vec(16, idle)?
                        .try_into()
                        .map_err(|_| violation("short GID"))?;
                    let remote = QpInfo { qpn, psn, gid, mtu };
                    match self.accept_qp(&remote, &session.remote, sock) {
                        Ok((info, receiver)) => {
                            let hdr = Frame::QpAccept {
                                qpn: info.qpn,
                                psn: info.psn,
                                mtu: info.mtu,
                                status: status::OK,
                            }
                            .encode();
                            let mut iovs =
                                [iov(hdr.as_ptr(), HEADER_LEN), iov(info.gid.as_ptr(), 16)];
                            // SAFETY: both iovecs point into live locals.
                            unsafe {
                                writev_all(
                                    sock.as_raw_fd(),
                                    &mut iovs,
                                    clock,
                                    self.config.io_timeout,
                                )?
                            };
                            rdma_receivers.push(receiver);
                        }
                        Err(st) => send_frames(
                            sock,
                            &[Frame::QpAccept {
                                qpn: 0,
                                psn: 0,
                                mtu: 0,
                                status: st,
                            }
                            .encode()],
                            clock,
                            self.config.io_timeout,
                        )?,
                    }
                    None
                }
                Frame::Grant {
                    req,
                    mem_type,
                    addr,
                    len,
                    key,
                    total,
                } => {
                    let admitted = self.registry.admit_remote(mem_type, addr, len, key);
                    let answer = {
                        let mut grants = lock(&session.grants);
                        let g = grants.entry(req).or_default();
                        g.seen += 1;
                        match admitted {
                            Ok(guard) => {
                                g.guards.push(guard);
                                g.spans.push((addr, len));
                            }
                            Err(r) => {
                                g.refused.get_or_insert(r);
                            }
                        }
                        if g.seen < total {
                            None
                        } else if let Some(r) = g.refused {
                            grants.remove(&req);
                            Some(r.code())
                        } else {
                            Some(status::OK)
                        }
                    };
                    if let Some(st) = answer {
                        send_frames(
                            sock,
                            &[Frame::Granted { req, status: st }.encode()],
                            clock,
                            self.config.io_timeout,
                        )?;
                    }
                    None
                }
                Frame::Delegate {
                    req,
                    op,
                    count,
                    pid,
                    probe_addr,
                    instance,
                    sync_len,
                    has_sync,
                } => {
                    // The sync message may follow: no header read-ahead.
                    let table =
                        reader.read_vec_mid_frame(count as usize * wire::DELEGATE_ENTRY, idle)?;
                    let sync = read_sync(
                        reader,
                        &self.inbox,
                        &session.remote,
                        has_sync,
                        sync_len,
                        idle,
                    )?;
                    let answer = |st| {
                        send_frames(
                            sock,
                            &[Frame::Granted { req, status: st }.encode()],
                            clock,
                            self.config.io_timeout,
                        )
                    };
                    if !self.may_copy_for(session, pid, probe_addr, instance) {
                        answer(status::DELEGATE_REFUSED)?;
                        None
                    } else {
                        let spans = lock(&session.grants)
                            .get(&req)
                            .map(|g| g.spans.clone())
                            .unwrap_or_default();
                        let pieces = delegated_pieces(&table, &spans).map_err(violation)?;
                        let dir = match op {
                            CommitOp::Write => shm::Direction::Read,
                            CommitOp::Read => shm::Direction::Write,
                        };
                        // SAFETY: every local range lies inside a span granted
                        // for this request (checked above), in a region this
                        // agent registered, whose registrant promised it stays
                        // valid while registered; the request's grant guards
                        // keep it registered until the commit below.
                        let copied = unsafe {
                            shm::copy_parallel(
                                pid,
                                dir,
                                &pieces,
                                self.config.shm.copy_threads,
                                PARALLEL_COPY_MIN,
                                &|| false,
                            )
                        };
                        match copied {
                            Ok(_) => {
                                self.delegated_copies.fetch_add(1, Ordering::Relaxed);
                                answer(status::OK)?;
                                commit(session, req, 0, sync)?
                            }
                            Err(e) => {
                                tracing::warn!(agent = %self.config.name, remote = %session.remote, req, error = %e, "delegated cross-memory copy failed");
                                lock(&session.grants).remove(&req);
                                answer(status::DELEGATE_FAILED)?;
                                None
                            }
                        }
                    }
                }
                Frame::Commit {
                    req,
                    op: _,
                    segments,
                    sync_len,
                    has_sync,
                } => {
                    let sync = read_sync(
                        reader,
                        &self.inbox,
                        &session.remote,
                        has_sync,
                        sync_len,
                        idle,
                    )?;
                    commit(session, req, segments, sync)?
                }
                other => return Err(violation(format!("unexpected frame {other:?}"))),
            };
            if let Some(f) = finished {
                self.finish(sock, session, f, clock)?;
            }
        }
    }

    /// Whether this agent copies for the initiator of `session`, which says
    /// it is process `pid` with `instance` readable at `probe_addr`: only
    /// when delegation is on, the kernel proved on the local socket that
    /// `pid` is the session's initiator and it still lives, it is another
    /// process than this one, and the probe shows this process can reach it
    /// (decided once per session). A pid taken from the frame alone is
    /// never trusted: the copy runs with this process's privileges.
    pub(in crate::engine) fn may_copy_for(
        &self,
        session: &Session,
        pid: u32,
        probe_addr: u64,
        instance: u64,
    ) -> bool {
        if !self.config.shm.delegate {
            return false;
        }
        let proven = lock(&session.proven).as_ref().and_then(|p| p.live_pid());
        if pid == std::process::id() {
            tracing::warn!(agent = %self.config.name, remote = %session.remote, "refused a delegated copy into this very process");
            return false;
        }
        if proven != Some(pid) {
            tracing::warn!(agent = %self.config.name, remote = %session.remote, claimed = pid, ?proven, "refused a delegated copy: the initiator did not prove it is that process");
            return false;
        }
        let mut d = lock(&session.delegate);
        if let Some((p, a, i, ok)) = *d
            && (p, a, i) == (pid, probe_addr, instance)
        {
            return ok;
        }
        let access = LocalAccess {
            host: self.host.clone(),
            pid,
            probe_addr,
        };
        let ok = match shm::probe(&access, instance, &self.host) {
            Ok(()) => true,
            Err(why) => {
                tracing::info!(agent = %self.config.name, remote = %session.remote, %why, "not copying for this initiator; it copies itself");
                false
            }
        };
        *d = Some((pid, probe_addr, instance, ok));
        ok
    }

    /// Serves the local proof socket until the agent closes: a ticket binds
    /// the connecting process to its session, once.
    pub(in crate::engine) fn serve_local_proofs(&self, listener: &local_proof::Listener) {
        let stop = || self.closing.load(Ordering::SeqCst);
        listener.serve(self.config.connect_timeout, &stop, &|ticket, peer| {
            let session = lock(&self.sessions)
                .values()
                .find(|s| s.ticket == ticket)
                .cloned();
            let Some(session) = session else {
                return false;
            };
            let mut proven = lock(&session.proven);
            if proven.is_some() {
                return false;
            }
            tracing::debug!(agent = %self.config.name, remote = %session.remote, pid = ?peer.live_pid(), "initiator process proven");
            *proven = Some(peer);
            true
        });
    }

    pub(in crate::engine) fn finish(
        &self,
        sock: &TcpStream,
        session: &Session,
        f: Finished<HeldSync>,
        clock: &ProgressClock,
    ) -> io::Result<()> {
        // The initiator's direct copies are over: unpin before telling anyone.
        lock(&session.grants).remove(&f.req);
        if let (Ok(()), Some((msg, room))) = (&f.outcome, f.sync) {
            self.inbox.deliver(room, msg);
        }
        let st = match f.outcome {
            Ok(()) => status::OK,
            Err(r) => r.code(),
        };
        send_frames(
            sock,
            &[Frame::Ack {
                req: f.req,
                status: st,
            }
            .encode()],
            clock,
            self.config.io_timeout,
        )
    }

    /// Target side of `QpConnect`: a queue pair connected to the
    /// initiator's, receive buffers posted, and a thread that delivers the
    /// sync messages arriving as SENDs.
    pub(in crate::engine) fn accept_qp(
        &self,
        remote: &QpInfo,
        remote_name: &str,
        sock: &TcpStream,
    ) -> Result<(QpInfo, RdmaReceiver), u16> {
        let Some(dev) = self.device.as_ref() else {
            return Err(status::NO_RDMA);
        };
        let sink = SyncSink {
            inbox: Arc::clone(&self.inbox),
            remote: remote_name.to_owned(),
            sock: sock.try_clone().map_err(|_| status::QP_FAILED)?,
            io_timeout: self.config.io_timeout,
        };
        let refused = |e: crate::verbs::VerbsError| {
            tracing::warn!(remote = %remote_name, error = %e, "cannot accept an RDMA connection");
            status::QP_FAILED
        };
        if let Some(rx) = self.srq_receiver(dev) {
            let mut qp = dev.create_rc_on_srq(&rx.shared.srq).map_err(refused)?;
            qp.set_ack_timeout(ack_timeout(&self.config));
            qp.connect(remote).map_err(refused)?;
            let info = qp.info();
            lock(&rx.shared.conns).insert(info.qpn, Arc::new(sink));
            return Ok((
                info,
                RdmaReceiver::Shared {
                    qpn: info.qpn,
                    _qp: qp,
                    rx,
                },
            ));
        }
        let ack_timeout = ack_timeout(&self.config);
        let setup =
            || -> Result<(crate::verbs::RcQueuePair, rdma::MsgRing), crate::verbs::VerbsError> {
                // Receive events: the thread sleeps until a SEND lands.
                let mut qp = dev.create_rc_with_events(rdma::WINDOW, false, true)?;
                qp.set_ack_timeout(ack_timeout);
                qp.connect(remote)?;
                let ring = rdma::MsgRing::new(dev, rdma::RING)?;
                for slot in 0..rdma::RING {
                    // SAFETY: the ring lives in the receiver thread with the queue
                    // pair, and is dropped after it.
                    unsafe { qp.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX))? };
                }
                Ok((qp, ring))
            };
        let (qp, ring) = setup().map_err(refused)?;
        let info = qp.info();
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = ReceiverCtx {
            sink,
            stop: Arc::clone(&stop),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-rdma-recv-{remote_name}"))
            .spawn(move || ctx.run(qp, ring))
            .map_err(|_| status::QP_FAILED)?;
        Ok((
            info,
            RdmaReceiver::Own {
                stop,
                thread: Some(thread),
            },
        ))
    }

    /// The agent's shared receive queue and thread, made on first use;
    /// `None` when connections receive on their own queues (configuration,
    /// or a device that cannot make one: logged once).
    pub(in crate::engine) fn srq_receiver(&self, dev: &Arc<Device>) -> Option<Arc<SrqReceiver>> {
        let mut st = lock(&self.srq_rx);
        match &*st {
            SrqState::Ready(rx) => return Some(Arc::clone(rx)),
            SrqState::PerQueuePair => return None,
            SrqState::Untried => {}
        }
        if !self.config.rdma.srq {
            *st = SrqState::PerQueuePair;
            return None;
        }
        match SrqReceiver::start(dev, &self.config.name) {
            Ok(rx) => {
                tracing::info!(device = %dev.name(), depth = rx.shared.srq.depth(), "RDMA connections share one receive queue");
                *st = SrqState::Ready(Arc::clone(&rx));
                Some(rx)
            }
            Err(e) => {
                tracing::info!(device = %dev.name(), error = %e, "no shared receive queue; each RDMA connection posts its own receive buffers");
                *st = SrqState::PerQueuePair;
                None
            }
        }
    }
}
