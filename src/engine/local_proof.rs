//! Which process is this initiator? The kernel's answer, for delegated
//! cross-memory copies.
//!
//! A target that copies on an initiator's behalf (`Delegate`) moves bytes
//! between its own exported regions and another process's memory with its
//! own privileges; the process must be the initiator itself, never one a
//! frame names. So an initiator on the same host connects to the target's
//! local socket — abstract Unix socket `kvxfer-<target instance, 16 hex>`,
//! bound before the target's descriptor is published — and presents the
//! 16-byte ticket of its authenticated session (from `HelloAck`). The
//! target takes the pid from the socket's `SO_PEERCRED` (set by the kernel
//! at `connect`), opens a pidfd on it, and binds that process to the
//! session, once. Delegated copies for the session then go to that process
//! only, and only while the pidfd says it is alive (a pid is not reused
//! while its process lives).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

/// The answer byte: the ticket named a session, now bound to the caller.
const BOUND: u8 = 0;
/// The answer byte: no such session, or it is bound already.
const REFUSED: u8 = 1;

/// The target's local socket name for an agent instance.
fn name(instance: u64) -> String {
    format!("kvxfer-{instance:016x}")
}

/// A process proven to be a session's initiator.
#[derive(Debug)]
pub(super) struct ProvenPeer {
    pid: u32,
    pidfd: OwnedFd,
}

impl ProvenPeer {
    /// The process id, while the process still lives; `None` once it has
    /// exited (its pid may name another process by now).
    pub(super) fn live_pid(&self) -> Option<u32> {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on the stack; a zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        // A pidfd polls readable once its process has exited.
        (n == 0).then_some(self.pid)
    }
}

/// The kernel's word on who is at the other end of `sock`.
fn peer_process(sock: &UnixStream) -> io::Result<ProvenPeer> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes passed.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if cred.pid <= 0 {
        return Err(io::Error::other("the peer's pid is not visible here"));
    }
    // SAFETY: a plain system call with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    Ok(ProvenPeer {
        pid: cred.pid as u32,
        pidfd,
    })
}

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

    /// Serves connections until `stop` says so (checked after each; wake
    /// the loop with [`wake`](Self::wake)). `bind` gets each valid ticket
    /// and the proven process, and says whether it bound them.
    pub(super) fn serve(
        &self,
        timeout: Duration,
        stop: &dyn Fn() -> bool,
        bind: &dyn Fn(u128, ProvenPeer) -> bool,
    ) {
        for conn in self.sock.incoming() {
            if stop() {
                return;
            }
            let Ok(mut conn) = conn else { continue };
            let answer = (|| -> io::Result<u8> {
                conn.set_read_timeout(Some(timeout))?;
                conn.set_write_timeout(Some(timeout))?;
                let mut ticket = [0u8; 16];
                conn.read_exact(&mut ticket)?;
                let peer = peer_process(&conn)?;
                Ok(if bind(u128::from_le_bytes(ticket), peer) {
                    BOUND
                } else {
                    REFUSED
                })
            })();
            match answer {
                Ok(a) => {
                    let _ = conn.write_all(&[a]);
                }
                Err(e) => tracing::debug!(error = %e, "local proof connection dropped"),
            }
        }
    }

    /// Wakes a [`serve`](Self::serve) loop (after its `stop` turned true).
    pub(super) fn wake(&self) {
        if let Ok(addr) = SocketAddr::from_abstract_name(name(self.instance)) {
            let _ = UnixStream::connect_addr(&addr);
        }
    }
}

/// The initiator's side: proves this process is the initiator of the
/// session `ticket` names at target `instance`.
///
/// # Errors
/// Why not (no local socket: another host or network namespace; refused;
/// timed out).
pub(super) fn prove(instance: u64, ticket: u128, timeout: Duration) -> io::Result<()> {
    let addr = SocketAddr::from_abstract_name(name(instance))?;
    let mut s = UnixStream::connect_addr(&addr)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(&ticket.to_le_bytes())?;
    let mut a = [REFUSED];
    s.read_exact(&mut a)?;
    if a[0] == BOUND {
        Ok(())
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

    #[test]
    fn binds_the_connecting_process_and_only_a_known_ticket() {
        let instance = crate::auth::random_u64();
        let l = Arc::new(Listener::bind(instance).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        type Seen = Vec<(u128, Option<u32>)>;
        let seen: Arc<Mutex<Seen>> = Arc::default();
        let t = {
            let (l, stop, seen) = (Arc::clone(&l), Arc::clone(&stop), Arc::clone(&seen));
            std::thread::spawn(move || {
                l.serve(
                    Duration::from_secs(5),
                    &|| stop.load(Ordering::SeqCst),
                    &|ticket, peer| {
                        seen.lock().unwrap().push((ticket, peer.live_pid()));
                        ticket == 42
                    },
                )
            })
        };
        prove(instance, 42, Duration::from_secs(5)).unwrap();
        let e = prove(instance, 7, Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        // No listener for another instance.
        assert!(prove(instance ^ 2, 42, Duration::from_secs(1)).is_err());
        stop.store(true, Ordering::SeqCst);
        l.wake();
        t.join().unwrap();
        let me = Some(std::process::id());
        assert_eq!(*seen.lock().unwrap(), vec![(42, me), (7, me)]);
    }

    #[test]
    fn an_exited_process_is_not_live() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // SAFETY: a plain system call with integer arguments.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor nothing else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let p = ProvenPeer { pid, pidfd };
        child.wait().unwrap();
        assert_eq!(p.live_pid(), None);
    }
}
