//! Which process is this initiator? The kernel's answer, for delegated
//! cross-memory copies.
//!
//! A target that copies on an initiator's behalf (`Delegate`) moves bytes
//! between its own exported regions and another process's memory; the
//! process must be the initiator itself, never one a frame names, and the
//! copy must never reach further than that process's owner could reach
//! alone. So an initiator on the same host connects to the target's local
//! socket — abstract Unix socket `kvxfer-<target instance, 16 hex>`, bound
//! before the target's descriptor is published — and sends the 16-byte
//! ticket of its authenticated session (from `HelloAck`) with its own
//! `/proc/self/mem` open for reading (`SCM_RIGHTS`). What the target binds
//! to the session, once:
//!
//! - **the process, not its pid number**: a pidfd of the process that
//!   called `connect`, taken from the socket at accept (`SO_PEERPIDFD`; on
//!   kernels before 6.5 a pidfd opened on the `SO_PEERCRED` pid at once),
//!   so a process that connected, handed its socket on and exited binds
//!   nothing, whoever reuses its pid;
//! - **its owner**: the uid and gid the kernel recorded at `connect`, which
//!   must be this process's own (an agent never copies for another user);
//! - **its program image**: the memory file it sent, which must be
//!   `/proc/<that pid>/mem` on procfs. The process opened it on itself, so
//!   the target uses no privilege of its own for it, and it is bound to the
//!   address space it was opened on: once the process calls `execve`, it
//!   reads nothing.
//!
//! Before each delegated copy [`ProvenPeer::check`] asks the pidfd whether
//! the process still lives and reads the initiator's probe word through
//! the memory file; the copy itself then runs without effective
//! capabilities ([`crate::cross_memory::Unprivileged`]), so whatever happens between
//! the check and the copy, the kernel lets it reach only a process its
//! owner could reach.
//!
//! Connections are served concurrently, each within one deadline from
//! accept to answer, so a process that connects and says nothing delays no
//! other proof.

use std::fs::File;
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, recvmsg, sendmsg,
};

/// The answer byte: the ticket named a session, now bound to the caller.
const BOUND: u8 = 0;
/// The answer byte: no such session, it is bound already, or the caller
/// cannot be bound (another user, exited, memory out of its owner's reach).
const REFUSED: u8 = 1;

/// Proof connections served at once, half of them from one user at most;
/// a new one takes the place of the oldest that has not sent its ticket
/// (see `serve_each`).
const MAX_PENDING: usize = 64;

/// The target's local socket name for an agent instance.
fn name(instance: u64) -> String {
    format!("kvxfer-{instance:016x}")
}

/// Whether the process behind `pidfd` still lives (a pidfd polls readable
/// once its process has exited).
fn alive(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack; a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0
}

/// A process proven to be a session's initiator.
#[derive(Debug)]
pub(super) struct ProvenPeer {
    pid: u32,
    pidfd: OwnedFd,
    /// `/proc/<pid>/mem` as it was at the proof: reads nothing once the
    /// process has run `execve`.
    mem: File,
}

impl ProvenPeer {
    /// The process id, while the proven process lives, still runs the
    /// program it was proven in, and holds `instance` at `probe_addr` (the
    /// initiator's probe word); otherwise why not.
    pub(super) fn check(&self, probe_addr: u64, instance: u64) -> Result<u32, &'static str> {
        if !alive(&self.pidfd) {
            return Err("the proven process has exited");
        }
        let mut word = [0u8; 8];
        match self.mem.read_at(&mut word, probe_addr) {
            Ok(8) if u64::from_ne_bytes(word) == instance => Ok(self.pid),
            Ok(0) => Err("the proven process has run another program since its proof"),
            _ => Err("the initiator's probe word is not in the proven process"),
        }
    }

    /// Whether `other` is this very process (its pid, while this one
    /// lives: a pid names one process while it lives).
    pub(super) fn same_process(&self, other: &ProvenPeer) -> bool {
        self.pid == other.pid && alive(&self.pidfd)
    }

    /// The process id, while the process still lives.
    #[cfg(test)]
    pub(super) fn live_pid(&self) -> Option<u32> {
        alive(&self.pidfd).then_some(self.pid)
    }
}

/// The process that connected a local proof socket, as the kernel recorded
/// it at `connect`.
struct Caller {
    pid: u32,
    uid: u32,
    gid: u32,
    pidfd: OwnedFd,
}

/// An integer socket option of `sock`.
fn sockopt<T>(sock: &UnixStream, opt: libc::c_int, value: &mut T) -> io::Result<()> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` and `len` are live and of the size passed.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (value as *mut T).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<T>() {
        return Err(io::Error::other("short socket option"));
    }
    Ok(())
}

/// Takes ownership of a descriptor a system call returned (or its error).
fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

impl Caller {
    /// The kernel's word on who connected `sock`.
    fn of(sock: &UnixStream) -> io::Result<Self> {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        sockopt(sock, libc::SO_PEERCRED, &mut cred)?;
        if cred.pid <= 0 {
            return Err(io::Error::other("the peer's pid is not visible here"));
        }
        let mut fd: libc::c_int = -1;
        let pidfd = match sockopt(sock, libc::SO_PEERPIDFD, &mut fd) {
            Ok(()) => owned(fd.into())?,
            // Before Linux 6.5: the pid as it is now, as early as possible.
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
                // SAFETY: a plain system call with integer arguments.
                owned(unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid, 0) })?
            }
            Err(e) => return Err(e),
        };
        Ok(Caller {
            pid: cred.pid as u32,
            uid: cred.uid,
            gid: cred.gid,
            pidfd,
        })
    }

    /// Binds what a delegated copy needs of this process, given the memory
    /// file it sent, or says why it cannot be bound.
    fn prove(self, mem: Option<OwnedFd>) -> io::Result<ProvenPeer> {
        let refuse = |why: &str| Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
        // SAFETY: plain system calls without arguments.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        if (self.uid, self.gid) != (uid, gid) {
            return refuse("the process belongs to another user or group");
        }
        let Some(mem) = mem else {
            return refuse("the process sent no memory file");
        };
        // SAFETY: an all-zero statfs is a valid value to be overwritten.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `mem` is an open descriptor, `fs` a live statfs.
        if unsafe { libc::fstatfs(mem.as_raw_fd(), &mut fs) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let path = std::fs::read_link(format!("/proc/self/fd/{}", mem.as_raw_fd()))?;
        let own = format!("/proc/{}/mem", self.pid);
        if fs.f_type != libc::PROC_SUPER_MAGIC || path != Path::new(&own) {
            return refuse("the file sent is not the process's own memory");
        }
        // The name can lie: in a mount namespace of its own, a process may
        // mount another's memory file over its own (`/proc/<pid>/mem`
        // shows then in the file's path). The file must be the very one
        // the kernel names for this pid here (a stat needs no access to
        // the process).
        let sent = File::from(mem.try_clone()?).metadata()?;
        let named = std::fs::metadata(&own)?;
        if (sent.dev(), sent.ino()) != (named.dev(), named.ino()) {
            return refuse(
                "the file sent is another file mounted over the process's memory file's name",
            );
        }
        // Alive now: the pid named this process when it sent the file (a
        // pid is not reused while its process lives).
        if !alive(&self.pidfd) {
            return refuse("the process exited");
        }
        Ok(ProvenPeer {
            pid: self.pid,
            pidfd: self.pidfd,
            mem: File::from(mem),
        })
    }
}

/// Reads all of `buf` from `sock` (by `deadline` when given, however the
/// peer trickles), and the first descriptor sent along (any others are
/// closed). `Ok(None)`: the stream ended before the first byte.
pub(super) fn recv_full(
    sock: &UnixStream,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> io::Result<Option<Option<OwnedFd>>> {
    let (mut got, mut fd) = (0, None);
    while got < buf.len() {
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            sock.set_read_timeout(Some(left))?;
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let r = recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        match r {
            Ok(m) if m.bytes == 0 && got == 0 => return Ok(None),
            Ok(m) if m.bytes == 0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(m) => got += m.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = msg {
                for f in fds {
                    fd.get_or_insert(f);
                }
            }
        }
    }
    Ok(Some(fd))
}

/// Reads the 16-byte ticket from `conn` by `deadline`, however the peer
/// trickles, and the first descriptor sent with it.
fn read_ticket(conn: &UnixStream, deadline: Instant) -> io::Result<([u8; 16], Option<OwnedFd>)> {
    let mut ticket = [0u8; 16];
    match recv_full(conn, &mut ticket, Some(deadline))? {
        Some(fd) => Ok((ticket, fd)),
        None => Err(io::ErrorKind::UnexpectedEof.into()),
    }
}

/// Answers one proof connection: reads the ticket by `deadline`, proves
/// the caller, lets `bind` bind it, and says whether it did.
fn answer(
    mut conn: UnixStream,
    caller: io::Result<Caller>,
    deadline: Instant,
    bind: &Bind<'_>,
    spoke: &dyn Fn(),
) {
    let (ticket, mem) = match read_ticket(&conn, deadline) {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(error = %e, "local proof connection dropped");
            return;
        }
    };
    spoke();
    let bound = match caller.and_then(|c| c.prove(mem)) {
        Ok(peer) => bind(u128::from_le_bytes(ticket), peer),
        Err(e) => {
            tracing::info!(error = %e, "local proof refused: the caller cannot be bound");
            None
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = conn.set_write_timeout(Some(left.max(Duration::from_millis(1))));
    let answered = conn.write_all(&[if bound.is_some() { BOUND } else { REFUSED }]);
    // The proven caller's connection goes on as the session's channel.
    if let (Some(keep), Ok(())) = (bound, answered) {
        keep(conn);
    }
}

/// What a bound proof's connection becomes: the session's channel (see
/// `engine::pool`), which an initiator that wants none just closes.
pub(super) type Keep = Box<dyn FnOnce(UnixStream) + Send>;

/// Binds a ticket's session to a proven process: `Some` (what to do with
/// the connection) when it did, or when the session is bound to that very
/// process already.
pub(super) type Bind<'a> = dyn Fn(u128, ProvenPeer) -> Option<Keep> + Sync + 'a;

/// The target's listener.
pub(super) struct Listener {
    sock: UnixListener,
    instance: u64,
}

impl Listener {
    /// Binds the local socket of agent `instance`.
    pub(super) fn bind(instance: u64) -> io::Result<Self> {
        let addr = SocketAddr::from_abstract_name(name(instance))?;
        Ok(Self {
            sock: UnixListener::bind_addr(&addr)?,
            instance,
        })
    }

    /// Serves connections until `stop` says so (checked after each accept;
    /// wake the loop with [`wake`](Self::wake)), each on a thread of its
    /// own within `timeout` from accept, at most [`MAX_PENDING`] at once
    /// (silent ones giving way to new ones).
    /// `bind` gets each ticket and its proven process, and says whether it
    /// bound them. Returns once every connection has been answered or shut
    /// down.
    pub(super) fn serve(&self, timeout: Duration, stop: &dyn Fn() -> bool, bind: &Bind<'_>) {
        crate::engine::serve_each::serve_each(
            self.sock.incoming(),
            (MAX_PENDING, MAX_PENDING / 2),
            "kvxfer-local-proof",
            stop,
            &|conn: UnixStream, spoke: &dyn Fn()| {
                let deadline = Instant::now() + timeout;
                // Who connected, before anything is read from them.
                let caller = Caller::of(&conn);
                answer(conn, caller, deadline, bind, spoke);
            },
        );
    }

    /// Wakes a [`serve`](Self::serve) loop (after its `stop` turned true):
    /// shutting the listening socket down makes a blocked accept fail at
    /// once (Linux); a connection of our own if it could not be.
    pub(super) fn wake(&self) {
        if socket2::SockRef::from(&self.sock)
            .shutdown(std::net::Shutdown::Both)
            .is_ok()
        {
            return;
        }
        if let Ok(addr) = SocketAddr::from_abstract_name(name(self.instance)) {
            let _ = UnixStream::connect_addr(&addr);
        }
    }
}

/// The initiator's side: proves this process is the initiator of the
/// session `ticket` names at target `instance` (and lets go of the
/// connection; links keep it, [`prove_and_keep`]).
///
/// # Errors
/// Why not (no local socket: another host or network namespace; refused;
/// timed out).
#[cfg(test)]
pub(super) fn prove(instance: u64, ticket: u128, timeout: Duration) -> io::Result<()> {
    prove_and_keep(instance, ticket, timeout).map(drop)
}

/// [`prove`], and the connection after the target's answer: the session's
/// channel (see `engine::pool`), with `timeout` on reads and writes.
pub(super) fn prove_and_keep(
    instance: u64,
    ticket: u128,
    timeout: Duration,
) -> io::Result<UnixStream> {
    let mem = File::open("/proc/self/mem")?;
    let addr = SocketAddr::from_abstract_name(name(instance))?;
    let mut s = UnixStream::connect_addr(&addr)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let bytes = ticket.to_le_bytes();
    let fds = [mem.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    let sent = sendmsg(
        &s,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    s.write_all(&bytes[sent..])?;
    let mut a = [REFUSED];
    s.read_exact(&mut a)?;
    if a[0] == BOUND {
        Ok(s)
    } else {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the target did not bind this process to the session",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    type Seen = Arc<Mutex<Vec<(u128, Option<u32>)>>>;

    /// A listener on its own thread, recording what it binds (tickets
    /// other than 42 are refused).
    struct Served {
        l: Arc<Listener>,
        stop: Arc<AtomicBool>,
        seen: Seen,
        t: Option<std::thread::JoinHandle<()>>,
    }

    impl Served {
        fn start(timeout: Duration) -> Self {
            let l = Arc::new(Listener::bind(crate::auth::random_u64()).unwrap());
            let stop = Arc::new(AtomicBool::new(false));
            let seen: Seen = Arc::default();
            let t = {
                let (l, stop, seen) = (Arc::clone(&l), Arc::clone(&stop), Arc::clone(&seen));
                std::thread::spawn(move || {
                    l.serve(timeout, &|| stop.load(Ordering::SeqCst), &|ticket, peer| {
                        lock_seen(&seen).push((ticket, peer.live_pid()));
                        (ticket == 42).then(|| -> Keep { Box::new(drop) })
                    })
                })
            };
            Self {
                l,
                stop,
                seen,
                t: Some(t),
            }
        }

        fn instance(&self) -> u64 {
            self.l.instance
        }

        fn stop(mut self) -> Vec<(u128, Option<u32>)> {
            self.stop.store(true, Ordering::SeqCst);
            self.l.wake();
            self.t.take().unwrap().join().unwrap();
            lock_seen(&self.seen).clone()
        }
    }

    fn lock_seen(s: &Seen) -> std::sync::MutexGuard<'_, Vec<(u128, Option<u32>)>> {
        s.lock().unwrap()
    }

    /// `/proc/<which>/mem`, open for reading.
    fn mem_of(which: &str) -> OwnedFd {
        File::open(format!("/proc/{which}/mem")).unwrap().into()
    }

    /// This process, as the far end of a socket pair.
    fn own_caller() -> Caller {
        let (_a, b) = UnixStream::pair().unwrap();
        Caller::of(&b).unwrap()
    }

    /// Only the caller's own memory file binds it: not another process's,
    /// not a file elsewhere, not none.
    #[test]
    fn only_the_callers_own_memory_binds_it() {
        let mut other = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let bad: [Option<OwnedFd>; 4] = [
            None,
            Some(mem_of(&other.id().to_string())),
            Some(File::open("/proc/self/status").unwrap().into()),
            Some(File::open("/dev/null").unwrap().into()),
        ];
        for mem in bad {
            let e = own_caller().prove(mem).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
        }
        assert!(own_caller().prove(Some(mem_of("self"))).is_ok());
        other.kill().unwrap();
        other.wait().unwrap();
    }

    #[test]
    fn binds_the_connecting_process_and_only_a_known_ticket() {
        let s = Served::start(Duration::from_secs(5));
        prove(s.instance(), 42, Duration::from_secs(5)).unwrap();
        let e = prove(s.instance(), 7, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        // No listener for another instance.
        assert!(prove(s.instance() ^ 2, 42, Duration::from_secs(1)).is_err());
        let me = Some(std::process::id());
        assert_eq!(s.stop(), vec![(42, me), (7, me)]);
    }

    /// Callers that connect and say nothing (or trickle) delay no other
    /// proof: each is answered on its own, and dropped at its deadline.
    #[test]
    fn silent_callers_delay_no_proof() {
        let s = Served::start(Duration::from_secs(600));
        let addr = SocketAddr::from_abstract_name(name(s.instance())).unwrap();
        let silent: Vec<UnixStream> = (0..8)
            .map(|_| UnixStream::connect_addr(&addr).unwrap())
            .collect();
        let mut trickler = UnixStream::connect_addr(&addr).unwrap();
        trickler.write_all(&[1, 2, 3]).unwrap();
        // Far less than the listener's deadline for the silent ones.
        prove(s.instance(), 42, Duration::from_secs(60)).unwrap();
        drop(silent);
        drop(trickler);
        assert_eq!(s.stop(), vec![(42, Some(std::process::id()))]);
    }

    /// A flood of silent callers (more than the listener serves at once,
    /// from this same user) keeps no proof out: each new caller takes the
    /// place of the oldest silent one, and one that sent its ticket is
    /// answered.
    #[test]
    fn a_flood_of_silent_callers_keeps_no_proof_out() {
        let s = Served::start(Duration::from_secs(600));
        let addr = SocketAddr::from_abstract_name(name(s.instance())).unwrap();
        let mut flood: Vec<UnixStream> = (0..80)
            .map(|_| UnixStream::connect_addr(&addr).unwrap())
            .collect();
        for _ in 0..10 {
            prove(s.instance(), 42, Duration::from_secs(60)).unwrap();
            flood.push(UnixStream::connect_addr(&addr).unwrap());
        }
        // The oldest were closed to make room, unanswered.
        let mut a = [9u8];
        flood[0]
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        assert!(matches!(flood[0].read(&mut a), Ok(0) | Err(_)));
        drop(flood);
        assert_eq!(s.stop().len(), 10);
    }

    /// A stalled connection is dropped unanswered at its deadline, however
    /// it trickles, and stopping the listener shuts pending ones at once.
    #[test]
    fn a_trickled_ticket_is_dropped_at_the_deadline_and_stop_is_prompt() {
        let s = Served::start(Duration::from_millis(300));
        let addr = SocketAddr::from_abstract_name(name(s.instance())).unwrap();
        let mut c = UnixStream::connect_addr(&addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut a = [9u8];
        for b in 0..15u8 {
            if c.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Dropped at the deadline: no answer, whatever came after.
        let _ = c.write_all(&[15]);
        assert!(matches!(c.read(&mut a), Ok(0) | Err(_)));
        // Pending for a long deadline: the stop shuts it down.
        let s2 = Served::start(Duration::from_secs(600));
        let addr2 = SocketAddr::from_abstract_name(name(s2.instance())).unwrap();
        let mut pending = UnixStream::connect_addr(&addr2).unwrap();
        pending
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        assert!(s2.stop().is_empty());
        assert!(matches!(pending.read(&mut a), Ok(0) | Err(_)));
        assert!(s.stop().is_empty());
    }

    /// The binding holds the process, not its pid number: it says the
    /// process has exited once it has, and the probe word reads only while
    /// the process runs the program it was proven in.
    #[test]
    fn a_binding_ends_with_its_process_and_its_program() {
        // This process: the probe word reads back.
        let word = Box::new(0x5eed_1234_u64);
        let probe = &*word as *const u64 as u64;
        let s = Served::start(Duration::from_secs(5));
        prove(s.instance(), 42, Duration::from_secs(5)).unwrap();
        drop(s.stop());
        let me = own_caller().prove(Some(mem_of("self"))).unwrap();
        assert_eq!(me.check(probe, *word), Ok(std::process::id()));
        assert!(me.check(probe, *word ^ 1).is_err());
        // A child that execs: its binding reads nothing after the exec,
        // and says it exited once it has.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read x; exec sh -c 'echo ran; read y'"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        // SAFETY: a plain system call with integer arguments.
        let pidfd = owned(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) }).unwrap();
        let caller = Caller {
            pid,
            // SAFETY: plain system calls without arguments.
            uid: unsafe { libc::getuid() },
            // SAFETY: as above.
            gid: unsafe { libc::getgid() },
            pidfd,
        };
        let peer = caller.prove(Some(mem_of(&pid.to_string()))).unwrap();
        // The shell's memory: any mapped address reads before the exec.
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let start = u64::from_str_radix(maps.split('-').next().unwrap(), 16).unwrap();
        let mut w = [0u8; 8];
        assert_eq!(peer.mem.read_at(&mut w, start).unwrap(), 8);
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        // The new program says so once it runs.
        let mut ran = [0u8; 4];
        child.stdout.take().unwrap().read_exact(&mut ran).unwrap();
        assert_eq!(&ran, b"ran\n");
        assert_eq!(peer.mem.read_at(&mut w, start).unwrap(), 0);
        assert_eq!(
            peer.check(start, u64::from_ne_bytes(w)),
            Err("the proven process has run another program since its proof")
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(peer.check(start, 0), Err("the proven process has exited"));
        assert_eq!(peer.live_pid(), None);
    }
}
