//! The target side: accept loop, authentication and `Hello`, the sessions
//! of initiators' links (each transport keeps its own state of one,
//! [`SessionState`]), and the per-connection service that lands WRITE
//! payloads, answers READs, hands each transport its own frames (shm's
//! grants and delegated copies), attaches transports beside the stream
//! (RDMA queue pairs), and acknowledges each request once all its segments
//! are processed (its sync message delivered first).
//!
//! Files: this one (accept loop, sessions, the connection's frame loop,
//! commits), `payload` (the data carried in frames: WRITE payloads landed
//! straight into registered memory, READs answered from it, write lists),
//! `storage` (a peer's requests to this agent's FILE, BLK and OBJ regions,
//! through a bounce buffer) and `attach` (a transport's exchange beside the
//! connection, both sides). What a transport is handed here — [`Conn`],
//! [`HeldSync`], [`SessionState`], [`attach::Attachment`] — is defined
//! here, so that the target names no transport.

pub(in crate::engine) mod attach;
mod payload;
mod storage;

use crate::engine::ctx::Ctx;
use crate::engine::pre_auth::PreAuthSlot;
use crate::engine::requests::{Finished, RequestTable};
use crate::engine::sock::{FrameReader, IdlePolicy, ProgressClock, iov, writev_all};
use crate::engine::target::storage::{Bounce, StorageWrites};
use crate::engine::wire::{Frame, HEADER_LEN, PROTOCOL_VERSION, status};
use crate::engine::{Inner, budget, handshake, lock, tick, wire};
use crate::error::RejectReason;
use crate::inbox::{Inbox, Reservation};
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use crate::small::Few;
use rustix::fd::{AsFd, AsRawFd};
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// One initiator's link as seen by the target.
pub(in crate::engine) struct Session {
    pub(in crate::engine) remote: String,
    table: Mutex<RequestTable<HeldSync>>,
    streams: AtomicUsize,
    /// Names this session to its transports, and on the local proof socket
    /// (see [`local_proof`]); sent to the initiator in `HelloAck`.
    pub(in crate::engine) ticket: u128,
    /// What the agent's transports keep for the session
    /// ([`Transport::open_session`]), told when its requests commit and
    /// finish.
    transports: Few<Arc<dyn SessionState>>,
    /// The storage each request wrote, synced before a durable one is
    /// acknowledged (`storage`).
    pub(in crate::engine) storage: Mutex<HashMap<u64, StorageWrites>>,
    /// Requests open in `table` (kept beside it, so that other sessions
    /// read it without its lock).
    open: AtomicUsize,
    /// The agent's count of requests open in all sessions; this session's
    /// are taken off it when it drops.
    open_total: Arc<AtomicUsize>,
    /// Set when the session is to close for holding more than its share of
    /// the open-request budget (see `budget`): its streams end, telling
    /// the initiator `Overloaded`.
    evicted: AtomicBool,
    /// Set when the initiator asked to settle the session (a
    /// [`Frame::Settle`]: its link broke): its streams land nothing more
    /// and end.
    fenced: AtomicBool,
    /// Its streams' connections, by their ids in the agent's table of
    /// incoming connections (whose handles are shut down to wake them
    /// when it is fenced).
    conns: Mutex<Vec<u64>>,
    /// True once the session closed (its last stream ended and its
    /// transports let it go); a fence waits for it.
    gone: Mutex<bool>,
    gone_cv: Condvar,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.open_total
            .fetch_sub(*self.open.get_mut(), Ordering::Relaxed);
    }
}

/// Slowest a frame's body may arrive, on average, beyond the I/O timeout
/// (1 MiB/s): a body of `n` bytes must be in within `io_timeout + n / this`
/// of its header, however the peer trickles it.
const BODY_RATE_FLOOR: u64 = 1 << 20;

/// What a connection's reads wait under: the agent closing, and the
/// deadlines a peer's frames must keep (see [`ServerIdle::on_idle`]).
pub(in crate::engine) struct ServerIdle<'a> {
    inner: &'a Inner,
    pub(in crate::engine) clock: &'a ProgressClock,
    /// Touched when a frame ends and when a header is in: the time the
    /// next header, or the current body, has been awaited.
    mark: ProgressClock,
    /// How long the current frame's body may take (from its header).
    body_allowance: Duration,
    /// The session, once the connection is a data stream: its transports'
    /// holds expire while it waits.
    pub(in crate::engine) session: Option<Arc<Session>>,
    /// When the session's holds were last looked at.
    swept: ProgressClock,
}

/// The error that ends a session told to close for holding more than its
/// share of the open-request budget.
fn overloaded() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "session over its share of the open-request budget",
    )
}

impl ServerIdle<'_> {
    /// A frame ended: the next header is awaited from now.
    fn frame_done(&mut self) {
        self.mark.touch();
        self.sweep();
    }

    /// Expires the holds the session's transports keep longer than the
    /// I/O timeout, looking at most once a second (however busy or idle
    /// the stream).
    fn sweep(&mut self) {
        if let Some(s) = &self.session
            && self.swept.idle() > Duration::from_secs(1)
        {
            self.swept.touch();
            for t in &s.transports {
                t.sweep(self.inner.config.io_timeout);
            }
        }
    }

    /// A header with a body of `body` bytes is in: the body is awaited from
    /// now, for the I/O timeout plus its length at [`BODY_RATE_FLOOR`].
    pub(in crate::engine) fn header_in(&mut self, body: u64) {
        self.mark.touch();
        self.body_allowance = self
            .inner
            .config
            .io_timeout
            .saturating_add(Duration::from_secs(body / BODY_RATE_FLOOR));
    }
}

impl IdlePolicy for ServerIdle<'_> {
    /// Between frames (a header partly read included), the peer must send
    /// a whole header within the I/O timeout of the last frame's end (an
    /// idle initiator sends keepalives); within a body, it must make
    /// progress within the I/O timeout and finish within its allowance.
    /// Holds of the session's transports expire meanwhile.
    fn on_idle(&mut self, mid_frame: bool) -> io::Result<()> {
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "agent closing",
            ));
        }
        let io_timeout = self.inner.config.io_timeout;
        self.sweep();
        if self
            .session
            .as_ref()
            .is_some_and(|s| s.evicted.load(Ordering::Relaxed))
        {
            return Err(overloaded());
        }
        if mid_frame {
            if self.clock.idle() > io_timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "initiator stalled in the middle of a frame",
                ));
            }
            if self.mark.idle() > self.body_allowance {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "initiator trickled a frame's body past its allowance",
                ));
            }
        } else if self.mark.idle() > io_timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no frame from the initiator within the I/O timeout",
            ));
        }
        Ok(())
    }
}

/// What a transport keeps at the target for one initiator's session
/// ([`Transport::open_session`]): the engine tells it when the session's
/// requests commit and finish, and lets its holds expire.
pub(in crate::engine) trait SessionState: Send + Sync {
    /// The refusal `req`'s commit must carry for this transport's part in
    /// it (a hold of it expired), if any.
    fn commit_refusal(&self, _req: u64) -> Option<RejectReason> {
        None
    }

    /// `req` finished (before its sync message is delivered and its
    /// acknowledgement sent): nothing of it is touched any more.
    fn finished(&self, _req: u64) {}

    /// Holds of requests older than `lifetime` expire (called at most
    /// about once a second while a connection of the session lives).
    fn sweep(&self, _lifetime: Duration) {}
}

/// One incoming connection as its handlers see it: the socket (answers go
/// out on it), the frame reader and its idle policy, and the session.
pub(in crate::engine) struct Conn<'c, 'r, 'i> {
    pub(in crate::engine) sock: &'c TcpStream,
    pub(in crate::engine) reader: &'c mut FrameReader<'r>,
    pub(in crate::engine) idle: &'c mut ServerIdle<'i>,
    pub(in crate::engine) session: &'c Session,
    /// Storage segments pass through it.
    pub(in crate::engine) bounce: Bounce,
}

impl Conn<'_, '_, '_> {
    /// Reads the sync message a `Commit` or `Delegate` announced into room
    /// in `inbox` ([`read_sync`]).
    pub(in crate::engine) fn read_sync(
        &mut self,
        inbox: &Arc<Inbox>,
        has_sync: bool,
        sync_len: u32,
    ) -> io::Result<SyncBody> {
        read_sync(
            self.reader,
            inbox,
            &self.session.remote,
            has_sync,
            sync_len,
            self.idle,
        )
    }

    /// Sends header-only frames on the connection.
    pub(in crate::engine) fn send(
        &self,
        frames: &[[u8; HEADER_LEN]],
        io_timeout: Duration,
    ) -> io::Result<()> {
        send_frames(self.sock, frames, self.idle.clock, io_timeout)
    }
}

/// Whether `mem_type` names storage (FILE and BLK regions, reached
/// through this agent).
fn is_storage(mem_type: MemoryType) -> bool {
    matches!(mem_type, MemoryType::File | MemoryType::Blk)
}

/// Segments of `Write` frames received into GPU memory whose copies may
/// still be running, each with its request and the guard that holds its
/// memory registered (`payload`).
pub(in crate::engine) type GpuLandings = crate::gpu::Landings<(u64, RegionGuard)>;

/// Records the outcome of `n` segments of `req`.
pub(in crate::engine) fn segment(
    inner: &Inner,
    session: &Session,
    req: u64,
    n: u64,
    result: Result<(), RejectReason>,
) -> io::Result<Option<Finished<HeldSync>>> {
    session.record(inner, req, |table| {
        table.segments(req, n, result).map_err(violation)
    })
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
    cx: Ctx<'_>,
    session: &Session,
    req: u64,
    segments: u64,
    sync: SyncBody,
) -> io::Result<Option<Finished<HeldSync>>> {
    let inner = cx.state();
    let expired = session
        .transports
        .iter()
        .find_map(|t| t.commit_refusal(req));
    session.record(inner, req, |table| {
        let sync = match sync {
            SyncBody::None => None,
            SyncBody::Held(h) => Some(h),
            SyncBody::Refused(reason) => {
                table.segments(req, 0, Err(reason)).map_err(violation)?;
                None
            }
        };
        if let Some(reason) = expired {
            table.segments(req, 0, Err(reason)).map_err(violation)?;
        }
        table.commit(req, segments, sync).map_err(violation)
    })
}

impl Session {
    /// Runs `f` on the request table once `req` is admitted within the
    /// agent's open-request budget, counting the requests it opens or
    /// finishes.
    fn record<R>(
        &self,
        inner: &Inner,
        req: u64,
        f: impl FnOnce(&mut RequestTable<HeldSync>) -> io::Result<R>,
    ) -> io::Result<R> {
        let mut table = lock(&self.table);
        inner.admit_request(self, &table, req)?;
        let before = table.open_count();
        let r = f(&mut table);
        self.count_open(before, table.open_count());
        r
    }

    /// Counts the change of `table`'s open requests from `before` to
    /// `after`, here and in the agent's total.
    fn count_open(&self, before: usize, after: usize) {
        if after > before {
            self.open.fetch_add(after - before, Ordering::Relaxed);
            self.open_total.fetch_add(after - before, Ordering::Relaxed);
        } else if before > after {
            self.open.fetch_sub(before - after, Ordering::Relaxed);
            self.open_total.fetch_sub(before - after, Ordering::Relaxed);
        }
    }
}

impl Inner {
    /// Whether `session` may open `req` (when it is not open yet in
    /// `table`, that session's table, locked by the caller) within the
    /// agent's open-request budget ([`budget::verdict`]); a refusal closes
    /// the session, telling its initiator `Overloaded`.
    fn admit_request(
        &self,
        session: &Session,
        table: &RequestTable<HeldSync>,
        req: u64,
    ) -> io::Result<()> {
        // A session told to close serves nothing more.
        if session.evicted.load(Ordering::Relaxed) {
            return Err(overloaded());
        }
        if table.is_open(req) {
            return Ok(());
        }
        let limit = self.config.limits.max_open_requests;
        let open = self.open_requests.load(Ordering::Relaxed);
        if open < limit {
            return Ok(());
        }
        // Spent: the share depends on who is alive (no table is locked
        // under the sessions' lock, so taking it here is safe). Sessions
        // already told to close count as gone: their requests go within
        // a tick, and a second session is closed only if the budget is
        // still spent without them.
        let sessions = lock(&self.sessions);
        let closing: usize = sessions
            .values()
            .filter(|s| s.evicted.load(Ordering::Relaxed))
            .map(|s| s.open.load(Ordering::Relaxed))
            .sum();
        let live = sessions
            .values()
            .filter(|s| !s.evicted.load(Ordering::Relaxed))
            .count();
        let own = table.open_count();
        match budget::verdict(limit, open.saturating_sub(closing), own, live) {
            budget::Verdict::Admit => Ok(()),
            budget::Verdict::RefuseSelf => {
                session.evicted.store(true, Ordering::SeqCst);
                Err(overloaded())
            }
            budget::Verdict::EvictLargest => {
                let largest = sessions
                    .values()
                    .filter(|s| {
                        !std::ptr::eq(s.as_ref(), session) && !s.evicted.load(Ordering::Relaxed)
                    })
                    .max_by_key(|s| s.open.load(Ordering::Relaxed));
                if let Some(s) = largest {
                    tracing::warn!(agent = %self.config.name, remote = %s.remote, open = s.open.load(Ordering::Relaxed), "open-request budget spent; closing the session holding the most");
                    s.evicted.store(true, Ordering::SeqCst);
                }
                Ok(())
            }
        }
    }
}

/// The order of the checked frames on one stream: a request's frames come
/// together (its share of the stream), numbered from 0.
#[derive(Default)]
struct Order {
    req: Option<u64>,
    next: u32,
}

impl Order {
    /// The place of the next checked frame, of request `req`.
    fn next(&mut self, req: u64) -> u32 {
        if self.req != Some(req) {
            self.req = Some(req);
            self.next = 0;
        }
        let n = self.next;
        self.next = self.next.wrapping_add(1);
        n
    }
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
            // Looked at again under the lock the closing agent takes its
            // connections under: none is started after it did.
            if self.closing.load(Ordering::SeqCst) {
                break;
            }
            server.threads.retain(|t| !t.is_finished());
            if server.socks.len() >= self.config.limits.max_incoming_connections {
                tracing::warn!(agent = %self.config.name, limit = self.config.limits.max_incoming_connections, peer = ?sock.peer_addr().ok(), "too many incoming connections; closing a new one");
                continue;
            }
            let id = server.next_id;
            server.next_id += 1;
            let Ok(clone) = sock.try_clone() else {
                continue;
            };
            let ip = sock
                .peer_addr()
                .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
            let limits = &self.config.limits;
            let evicted = lock(&self.pre_auth).admit(
                id,
                ip,
                limits.max_unauthenticated_per_source,
                limits.max_unauthenticated,
            );
            if let Some(old) = evicted.and_then(|e| server.socks.get(&e)) {
                tracing::warn!(agent = %self.config.name, limit = limits.max_unauthenticated, per_source = limits.max_unauthenticated_per_source, evicted = ?old.peer_addr().ok(), peer = %ip, "too many connections still authenticating; closing the oldest of the source holding most");
                let _ = old.shutdown(Shutdown::Both);
            }
            let pending_auth = PreAuthSlot {
                table: Arc::clone(&self.pre_auth),
                id,
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

    /// Serves one incoming connection: authenticates it, then answers
    /// descriptor requests until a `Hello` makes it a data stream of a
    /// session.
    fn serve(&self, sock: &TcpStream, pending_auth: PreAuthSlot) -> io::Result<()> {
        let conn_id = pending_auth.id;
        sock.set_nodelay(true)?;
        sock.set_read_timeout(Some(tick(self.config.io_timeout)))?;
        sock.set_write_timeout(Some(tick(self.config.io_timeout)))?;
        let clock = ProgressClock::new();
        let mut idle = ServerIdle {
            inner: self,
            clock: &clock,
            mark: ProgressClock::new(),
            body_allowance: self.config.io_timeout,
            session: None,
            swept: ProgressClock::new(),
        };
        let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
        let Some(authenticated) = self.authenticate(sock, &mut reader, &clock, pending_auth)?
        else {
            return Ok(());
        };
        idle.frame_done();
        loop {
            let Some(raw) = reader.next_header(&mut idle)? else {
                return Ok(());
            };
            let frame = Frame::decode(&raw).map_err(|e| violation(e.to_string()))?;
            idle.header_in(frame.body_len());
            match frame {
                Frame::DescRequest { host_len } => {
                    let host = reader.read_vec(host_len as usize, &mut idle)?;
                    let host = (host_len > 0).then(|| String::from_utf8_lossy(&host).into_owned());
                    self.send_desc(sock, &clock, host.as_deref())?;
                    idle.frame_done();
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
                    let idle_ms =
                        u32::try_from(self.config.io_timeout.as_millis()).unwrap_or(u32::MAX);
                    let hello_ack = |status, ticket| {
                        let ack = Frame::HelloAck {
                            instance: self.instance,
                            status,
                            ticket,
                            idle_ms,
                        };
                        send_frames(sock, &[ack.encode()], &clock, self.config.io_timeout)
                    };
                    if st != status::OK {
                        return hello_ack(st, 0);
                    }
                    let key = (instance, link);
                    let session = self.join_session(key, &authenticated, conn_id)?;
                    idle.session = Some(Arc::clone(&session));
                    let r = hello_ack(status::OK, session.ticket)
                        .and_then(|()| self.serve_data(sock, &mut reader, &mut idle, &session));
                    idle.session = None;
                    self.leave_session(key, &session);
                    if session.evicted.load(Ordering::SeqCst) {
                        // Told why before the close, when the stream still
                        // takes it: its requests fail with this reason.
                        let bye = Frame::Closing {
                            status: RejectReason::Overloaded.code(),
                        };
                        let _ = send_frames(sock, &[bye.encode()], &clock, self.config.io_timeout);
                        tracing::warn!(agent = %self.config.name, remote = %session.remote, "closed a connection over its share of the open-request budget");
                        return Ok(());
                    }
                    return r;
                }
                Frame::Settle { instance, link } => {
                    let status = self.settle_session((instance, link), &authenticated);
                    let answer = Frame::Settled {
                        instance: self.instance,
                        status,
                    };
                    return send_frames(sock, &[answer.encode()], &clock, self.config.io_timeout);
                }
                other => return Err(violation(format!("unexpected first frame {other:?}"))),
            }
        }
    }

    /// Ends the session `key` of `authenticated` for a [`Frame::Settle`]:
    /// its streams land nothing more (each stops before its next frame)
    /// and are shut down; answers once the session closed, or when it did
    /// not within the I/O timeout (`STILL_LANDING`). A session that does
    /// not exist (never opened here, or closed already) is settled, as is
    /// one of another agent (that one's initiator cannot settle it, and
    /// nothing of this one's is in it).
    fn settle_session(&self, key: (u64, u64), authenticated: &str) -> u16 {
        let open = lock(&self.sessions).get(&key).cloned();
        let found = open.or_else(|| lock(&self.leaving).get(&key).cloned());
        let session = match found {
            Some(s) if s.remote == authenticated => s,
            _ => return status::OK,
        };
        session.fenced.store(true, Ordering::SeqCst);
        let conns = lock(&session.conns).clone();
        {
            let server = lock(&self.server);
            for s in conns.iter().filter_map(|id| server.socks.get(id)) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        let deadline = std::time::Instant::now() + self.config.io_timeout;
        let mut gone = lock(&session.gone);
        while !*gone {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(agent = %self.config.name, remote = %session.remote, "a fenced session's streams had not ended within the I/O timeout");
                return status::STILL_LANDING;
            }
            gone = session
                .gone_cv
                .wait_timeout(gone, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        tracing::debug!(agent = %self.config.name, remote = %session.remote, "settled a broken link's session");
        status::OK
    }

    /// The connection's handshake: the name it authenticated as, or `None`
    /// when it was refused (logged). Nothing is answered before the
    /// initiator has authenticated, and it must do so within the connect
    /// timeout.
    fn authenticate(
        &self,
        sock: &TcpStream,
        reader: &mut FrameReader<'_>,
        clock: &ProgressClock,
        pending_auth: PreAuthSlot,
    ) -> io::Result<Option<String>> {
        let stop = || self.closing.load(Ordering::Relaxed);
        let deadline = self
            .config
            .limits
            .auth_timeout
            .min(self.config.connect_timeout);
        reader.set_deadline(Some(std::time::Instant::now() + deadline));
        let verdict = handshake::respond(
            sock.as_fd(),
            reader,
            &stop,
            &self.config.security,
            &self.config.name,
            clock,
            self.config.io_timeout,
        );
        reader.set_deadline(None);
        drop(pending_auth);
        match verdict? {
            handshake::Verdict::Accepted(name) => Ok(Some(name)),
            handshake::Verdict::Refused(why) => {
                tracing::warn!(agent = %self.config.name, peer = ?sock.peer_addr().ok(), %why, "refused an unauthenticated connection");
                Ok(None)
            }
        }
    }

    /// Answers a descriptor request from a requester on host `host`
    /// (`None`: it asked for no GPU handles; see [`Inner::desc_for`]).
    fn send_desc(
        &self,
        sock: &TcpStream,
        clock: &ProgressClock,
        host: Option<&str>,
    ) -> io::Result<()> {
        let body = self.desc_for(host).encode();
        let hdr = Frame::DescReply {
            body_len: body.len() as u32,
        }
        .encode();
        handshake::send(sock.as_fd(), &hdr, &body, clock, self.config.io_timeout)
    }

    /// The session `key` (an initiator's instance and link), made on its
    /// first stream, with this stream counted in it; the caller uncounts it
    /// (and removes the session after its last stream). A connection joins
    /// only the sessions of the agent it authenticated as; `conn` is its id
    /// among the agent's incoming connections.
    fn join_session(
        &self,
        key: (u64, u64),
        authenticated: &str,
        conn: u64,
    ) -> io::Result<Arc<Session>> {
        let mut sessions = lock(&self.sessions);
        let s = sessions.entry(key).or_insert_with(|| {
            let ticket = u128::from_le_bytes(crate::auth::random_bytes());
            Arc::new(Session {
                remote: authenticated.to_owned(),
                table: Mutex::new(RequestTable::default()),
                streams: AtomicUsize::new(0),
                ticket,
                transports: self
                    .transports
                    .iter()
                    .filter_map(|t| t.open_session(ticket, authenticated))
                    .collect(),
                storage: Mutex::new(HashMap::new()),
                open: AtomicUsize::new(0),
                open_total: Arc::clone(&self.open_requests),
                evicted: AtomicBool::new(false),
                fenced: AtomicBool::new(false),
                conns: Mutex::new(Vec::new()),
                gone: Mutex::new(false),
                gone_cv: Condvar::new(),
            })
        });
        if s.evicted.load(Ordering::SeqCst) {
            return Err(violation(
                "the session was closed for holding too many requests",
            ));
        }
        if s.remote != authenticated {
            let owner = s.remote.clone();
            return Err(violation(format!(
                "{authenticated:?} tried to join a session of {owner:?}"
            )));
        }
        if s.fenced.load(Ordering::SeqCst) {
            return Err(violation("the session was settled: its link broke"));
        }
        s.streams.fetch_add(1, Ordering::SeqCst);
        lock(&s.conns).push(conn);
        Ok(Arc::clone(s))
    }

    /// Uncounts a stream of the session `key` (see [`join_session`]);
    /// after its last, the session closes: it is removed, and its
    /// transports let go of what they kept for it. The count and the
    /// removal are one step under the sessions' lock, so a stream that
    /// joins meanwhile opens a new session rather than joining a closed
    /// one.
    ///
    /// [`join_session`]: Self::join_session
    ///
    /// When no other session of its agent is left, the inbox records the
    /// agent's departure (after its transports closed the session, so
    /// after every sync message of it was delivered).
    fn leave_session(&self, key: (u64, u64), session: &Session) {
        let last = {
            let mut sessions = lock(&self.sessions);
            if session.streams.fetch_sub(1, Ordering::SeqCst) != 1 {
                return;
            }
            // Closing until its transports let it go: a fence still
            // finds it, and waits.
            if let Some(s) = sessions.remove(&key) {
                lock(&self.leaving).insert(key, s);
            }
            !sessions.values().any(|s| s.remote == session.remote)
        };
        for t in &self.transports {
            t.close_session(session.ticket);
        }
        if last {
            self.inbox.depart(&session.remote);
        }
        lock(&self.leaving).remove(&key);
        *lock(&session.gone) = true;
        session.gone_cv.notify_all();
    }

    fn serve_data(
        &self,
        sock: &TcpStream,
        reader: &mut FrameReader<'_>,
        idle: &mut ServerIdle<'_>,
        session: &Session,
    ) -> io::Result<()> {
        let clock = idle.clock;
        // What the transports attached to this connection keep (RDMA: the
        // receive threads); stopped and joined when it ends (dropped).
        let mut attached: Vec<attach::Attachment> = Vec::new();
        let mut c = Conn {
            sock,
            reader,
            idle,
            session,
            bounce: Bounce::default(),
        };
        // Dropped first: waits for copies still writing GPU memory before
        // their guards go.
        let mut landings = GpuLandings::new();
        // Where the checked frames of the request in progress on this
        // stream have got to.
        let mut order = Order::default();
        loop {
            if session.evicted.load(Ordering::Relaxed) {
                return Ok(());
            }
            c.idle.frame_done();
            if !landings.is_empty() {
                self.settle_gpu(&mut c, &mut landings)?;
            }
            let Some(raw) = c.reader.next_header(c.idle)? else {
                return Ok(());
            };
            // A settled session, or a closing agent, lands nothing more:
            // what its initiator sent before is dropped unread.
            if session.fenced.load(Ordering::SeqCst) || self.closing.load(Ordering::SeqCst) {
                return Ok(());
            }
            let frame = Frame::decode(&raw).map_err(|e| violation(e.to_string()))?;
            c.idle.header_in(frame.body_len());
            let finished = match frame {
                Frame::Keepalive => None,
                // The TCP path's data (`payload`).
                Frame::Write {
                    req,
                    mem_type,
                    device,
                    addr,
                    len,
                    key,
                    checked,
                } => {
                    let result = if checked {
                        // End-to-end integrity: host memory only, and a
                        // header that fails its seal (damaged, or repeated,
                        // lost or moved within its request) cannot be
                        // trusted to frame what follows: the connection
                        // ends.
                        if mem_type != MemoryType::Dram {
                            return Err(violation("a checked write to memory other than DRAM"));
                        }
                        if !wire::sealed_seq(&raw, &[], order.next(req)) {
                            return Err(violation(
                                "a checked write does not match its seal (damaged, repeated or out of order)",
                            ));
                        }
                        Some(self.land_write_checked(&mut c, addr, len, key)?)
                    } else if mem_type == MemoryType::Obj {
                        // The agent's objects, assembled (`storage`).
                        Some(self.land_object_write(&mut c, req, device, (addr, len), key)?)
                    } else if is_storage(mem_type) {
                        // The agent's files (`storage`).
                        Some(self.land_storage_write(
                            &mut c,
                            req,
                            (mem_type, device),
                            (addr, len),
                            key,
                        )?)
                    } else if mem_type == MemoryType::Vram {
                        // Told once landed, unless refused at once.
                        self.land_gpu(&mut c, &mut landings, (req, addr, len, key))?
                    } else {
                        Some(self.land_write(&mut c, mem_type, addr, len, key)?)
                    };
                    match result {
                        Some(result) => segment(self, session, req, 1, result)?,
                        None => None,
                    }
                }
                Frame::ReadReq {
                    req,
                    mem_type,
                    device,
                    addr,
                    len,
                    key,
                    checked,
                } => {
                    let seq = checked.then(|| order.next(req));
                    if checked && mem_type != MemoryType::Dram {
                        return Err(violation("a checked read of memory other than DRAM"));
                    }
                    if seq.is_some_and(|s| !wire::sealed_seq(&raw, &[], s)) {
                        return Err(violation(
                            "a checked read request does not match its seal (damaged, repeated or out of order)",
                        ));
                    }
                    if mem_type == MemoryType::Vram {
                        // Told in turn, with the reads that follow it.
                        self.send_reads_gpu(&mut c, (req, addr, len, key))?;
                        continue;
                    }
                    let result = if mem_type == MemoryType::Obj {
                        self.send_object_read(&mut c, req, device, (addr, len), key)?
                    } else if is_storage(mem_type) {
                        self.send_storage_read(&mut c, req, (mem_type, device), (addr, len), key)?
                    } else {
                        self.send_read(&mut c, req, mem_type, (addr, len), key, seq)?
                    };
                    segment(self, session, req, 1, result)?
                }
                Frame::WriteList {
                    req,
                    mem_type,
                    count,
                    total,
                    key,
                    checked,
                } => {
                    if checked && mem_type != MemoryType::Dram {
                        return Err(violation("a checked write list to memory other than DRAM"));
                    }
                    let seq = checked.then(|| order.next(req));
                    let result =
                        self.land_write_list(&mut c, &raw, mem_type, (count, total), key, seq)?;
                    segment(self, session, req, u64::from(count), result)?
                }
                Frame::Fence { req } => segment(self, session, req, 1, Ok(()))?,
                // Every socket path: the request's end.
                Frame::Abort { req, segments } => {
                    segment(self, session, req, segments, Err(RejectReason::Aborted))?
                }
                Frame::Commit {
                    req,
                    op: _,
                    segments,
                    sync_len,
                    has_sync,
                    durable,
                    checks,
                    sync_crc,
                } => {
                    if durable {
                        session.durable(req);
                    }
                    let sync = if checks > 0 {
                        // The checks follow the message: no read-ahead.
                        let (inbox, remote, idle) = (&self.inbox, &session.remote, &mut *c.idle);
                        c.reader
                            .mid_frame(|r| read_sync(r, inbox, remote, has_sync, sync_len, idle))?
                    } else {
                        c.read_sync(&self.inbox, has_sync, sync_len)?
                    };
                    // A damaged sync message is never delivered: the
                    // request fails its check.
                    let sync = match (sync, sync_crc) {
                        (SyncBody::Held((m, _)), Some(crc))
                            if crate::integrity::crc32c(&m) != crc =>
                        {
                            tracing::warn!(agent = %self.config.name, remote = %session.remote, req, "a sync message failed its CRC32C: the request is refused");
                            SyncBody::Refused(RejectReason::Integrity)
                        }
                        (s, _) => s,
                    };
                    if checks > 0 {
                        // Data moved beside the stream (its copy is over):
                        // checked here before the request can finish.
                        if segments != 0 {
                            return Err(violation("checks on a commit of data frames"));
                        }
                        let table = c
                            .reader
                            .read_vec(checks as usize * wire::CHECK_ENTRY, c.idle)?;
                        if let Err(reason) = self.check_ranges(session, &table) {
                            segment(self, session, req, 0, Err(reason))?;
                        }
                    }
                    commit(Ctx::of(self), session, req, segments, sync)?
                }
                // A transport's own frame, for that transport to serve
                // (shm's).
                Frame::Transport { transport, head } => {
                    let Some(t) = self.transports.iter().find(|t| t.kind() == transport) else {
                        return Err(violation(format!(
                            "a frame of transport {transport}, which this agent does not offer"
                        )));
                    };
                    t.serve_frame(Ctx::of(self), &mut c, &head)?
                }
                // A transport beside the stream (`attach`): its message to
                // it, its answer back.
                Frame::Attach { name_len, len } => {
                    self.serve_attach(&mut c, (name_len, len), &mut attached)?;
                    None
                }
                other => return Err(violation(format!("unexpected frame {other:?}"))),
            };
            if let Some(f) = finished {
                self.finish(sock, session, f, clock)?;
            }
        }
    }

    /// Checks a commit's table of checks against this agent's memory:
    /// each range admitted as host memory of a region with that key, its
    /// CRC32C computed here; the first refusal or mismatch is the
    /// request's outcome.
    ///
    /// Large tables are summed by `shm.copy_threads` threads: the
    /// initiator waits for the answer meanwhile.
    fn check_ranges(&self, session: &Session, table: &[u8]) -> Result<(), RejectReason> {
        let field =
            |e: &[u8], at: usize| u64::from_le_bytes(e[at..at + 8].try_into().expect("8 bytes"));
        let mut guards = Vec::with_capacity(table.len() / wire::CHECK_ENTRY);
        let mut ranges = Vec::with_capacity(guards.capacity());
        let mut sent = Vec::with_capacity(guards.capacity());
        for e in table.chunks_exact(wire::CHECK_ENTRY) {
            let (addr, len, key) = (field(e, 0), field(e, 8), field(e, 16));
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(RejectReason::Malformed);
            }
            guards.push(
                self.registry
                    .admit_remote(MemoryType::Dram, addr, len, key)?,
            );
            ranges.push(crate::memory::Piece {
                local: addr,
                remote: 0,
                len,
            });
            sent.push(u32::from_le_bytes(e[24..28].try_into().expect("4 bytes")));
        }
        let threads = (
            self.config.shm.copy_threads,
            crate::engine::PARALLEL_COPY_MIN,
        );
        // SAFETY: every range lies inside a region registered here, held
        // registered by `guards` for the call.
        let got = unsafe { crate::cross_memory::sum_parallel(&ranges, threads) };
        drop(guards);
        for ((r, sent), got) in ranges.iter().zip(sent).zip(got) {
            self.check(&session.remote, sent, got, (r.local, r.local + r.len))?;
        }
        Ok(())
    }

    pub(in crate::engine) fn finish(
        &self,
        sock: &TcpStream,
        session: &Session,
        f: Finished<HeldSync>,
        clock: &ProgressClock,
    ) -> io::Result<()> {
        // Nothing touches the request's memory any more (the initiator's
        // direct copies are over): its transports let go of it before
        // anyone is told.
        for t in &session.transports {
            t.finished(f.req);
        }
        // A durable request's storage writes reach the disk before its
        // message and acknowledgement.
        let outcome = session
            .sync_storage(f.req, f.outcome.is_ok(), self.config.io_timeout)
            .and(f.outcome);
        if let (Ok(()), Some((msg, room))) = (&outcome, f.sync) {
            self.inbox.deliver(room, msg);
        }
        let st = match outcome {
            Ok(()) => status::OK,
            Err(r) => r.code(),
        };
        send_frames(
            sock,
            &[Frame::Ack {
                req: f.req,
                status: st,
                landed: f.landed.code(),
            }
            .encode()],
            clock,
            self.config.io_timeout,
        )
    }
}
