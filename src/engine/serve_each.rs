//! Small side listeners (the local proof socket, the metrics endpoint):
//! each connection served on a short-lived thread of its own, so one
//! client that says nothing delays no other; a bounded number at once,
//! shared fairly between sources; and when the listener stops, the
//! connections still being served are shut down, so it returns at once.
//!
//! Room is made for a new connection by evicting a silent one (accepted,
//! its request not read yet): the oldest of its own source when that
//! source holds its share, else the oldest of the source holding the most
//! silent connections once all are taken. A connection whose request was
//! read is never evicted: it is being answered, within its deadline. So a
//! flood of idle connections, even from the address or user of a
//! legitimate client, takes from that client only the time between its
//! connect and its request.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// Where a connection comes from, for fair shares: an IP address, or the
/// user of a local process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(in crate::engine) enum Source {
    Ip(IpAddr),
    Uid(u32),
    /// Not known (the kernel would not say).
    Unknown,
}

/// A connection the listener can shut down from another thread.
pub(in crate::engine) trait Connection: Send + Sized {
    /// Another handle on the same connection.
    fn another(&self) -> io::Result<Self>;
    /// Shuts both directions down (the serving thread's I/O then fails).
    fn shut(&self);
    /// Where it comes from.
    fn source(&self) -> Source;
}

impl Connection for UnixStream {
    fn another(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }

    fn source(&self) -> Source {
        rustix::net::sockopt::socket_peercred(self)
            .map_or(Source::Unknown, |c| Source::Uid(c.uid.as_raw()))
    }
}

impl Connection for TcpStream {
    fn another(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }

    fn source(&self) -> Source {
        self.peer_addr()
            .map_or(Source::Unknown, |a| Source::Ip(a.ip()))
    }
}

/// What a listener admits a new connection with.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::engine) enum Admit {
    /// Room was free.
    Free,
    /// The silent connection with this id makes room (it is forgotten).
    Evict(u64),
    /// No silent connection can make room: the new one is closed.
    Full,
}

/// The connections a listener serves, by id (ids grow, so the map's order
/// is their age): where each comes from, and whether its request was read.
/// Free of I/O.
#[derive(Debug, Default)]
pub(in crate::engine) struct Room {
    conns: BTreeMap<u64, (Source, bool)>,
}

impl Room {
    /// Admits connection `id` from `src` within `per_source` and `total`
    /// (both at least 1); see the module docs.
    pub(in crate::engine) fn admit(
        &mut self,
        id: u64,
        src: Source,
        per_source: usize,
        total: usize,
    ) -> Admit {
        let silent =
            |s: Source| move |(_, (from, spoke)): &(&u64, &(Source, bool))| *from == s && !*spoke;
        let mine = self.conns.values().filter(|(from, _)| *from == src).count();
        let admit = if mine >= per_source {
            self.conns
                .iter()
                .find(silent(src))
                .map_or(Admit::Full, |(&v, _)| Admit::Evict(v))
        } else if self.conns.len() >= total {
            let mut counts: HashMap<Source, usize> = HashMap::new();
            for (from, spoke) in self.conns.values() {
                if !spoke {
                    *counts.entry(*from).or_default() += 1;
                }
            }
            // The source holding most silent ones; among equals, the one
            // whose oldest silent one is oldest.
            let most = counts.values().copied().max().unwrap_or(0);
            self.conns
                .iter()
                .find(|(_, (from, spoke))| !spoke && counts.get(from) == Some(&most))
                .map_or(Admit::Full, |(&v, _)| Admit::Evict(v))
        } else {
            Admit::Free
        };
        if let Admit::Evict(v) = admit {
            self.conns.remove(&v);
        }
        if admit != Admit::Full {
            self.conns.insert(id, (src, false));
        }
        admit
    }

    /// Connection `id`'s request was read: it is no longer evicted.
    pub(in crate::engine) fn spoke(&mut self, id: u64) {
        if let Some((_, spoke)) = self.conns.get_mut(&id) {
            *spoke = true;
        }
    }

    /// Forgets `id` (served, or evicted already).
    pub(in crate::engine) fn remove(&mut self, id: u64) {
        self.conns.remove(&id);
    }
}

/// Wakes the accept loop of `listener` (another handle on the socket
/// whose loop waits in `accept`, at `addr`): shutting the listening socket
/// down makes a blocked accept fail at once (Linux), however loaded the
/// host; a connection of its own if it could not be shut down.
pub(in crate::engine) fn wake_listener(
    listener: Option<&std::net::TcpListener>,
    addr: std::net::SocketAddr,
) {
    if listener.is_some_and(|l| socket2::SockRef::from(l).shutdown(Shutdown::Both).is_ok()) {
        return;
    }
    let mut wake = addr;
    if wake.ip().is_unspecified() {
        wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let _ = TcpStream::connect_timeout(&wake, std::time::Duration::from_secs(1));
}

/// Serves each connection `incoming` yields with `handle`, on a thread
/// named `name` of its own, at most `max` at once and `per_source` from
/// one source (room made by evicting a silent one: see the module docs;
/// with none to evict, the new one is closed unanswered), until `stop`
/// says so (asked after each accept: wake the listener,
/// [`wake_listener`]). `handle` gets the connection and a call that marks
/// its request read, and bounds its own time (a deadline per
/// connection). Then shuts down the connections still being served and
/// returns once their threads have ended.
pub(in crate::engine) fn serve_each<C: Connection>(
    incoming: impl Iterator<Item = io::Result<C>>,
    (max, per_source): (usize, usize),
    name: &str,
    stop: &dyn Fn() -> bool,
    handle: &(dyn Fn(C, &dyn Fn()) + Sync),
) {
    let open: Mutex<(HashMap<u64, C>, Room)> = Mutex::default();
    let lock = || open.lock().unwrap_or_else(PoisonError::into_inner);
    let serial = AtomicU64::new(0);
    std::thread::scope(|s| {
        for conn in incoming {
            if stop() {
                break;
            }
            let Ok(conn) = conn else { continue };
            let id = serial.fetch_add(1, Ordering::Relaxed);
            {
                let Ok(c) = conn.another() else { continue };
                // A system call: asked before the lock, not under it.
                let source = conn.source();
                let mut guard = lock();
                let (handles, room) = &mut *guard;
                match room.admit(id, source, per_source, max) {
                    Admit::Full => {
                        tracing::debug!(
                            listener = name,
                            max,
                            "connection closed: too many being answered"
                        );
                        continue;
                    }
                    Admit::Evict(old) => {
                        tracing::debug!(listener = name, "closed the oldest silent connection");
                        if let Some(old) = handles.remove(&old) {
                            old.shut();
                        }
                    }
                    Admit::Free => {}
                }
                handles.insert(id, c);
            }
            let run = move || {
                handle(conn, &|| lock().1.spoke(id));
                let mut guard = lock();
                guard.0.remove(&id);
                guard.1.remove(id);
            };
            if std::thread::Builder::new()
                .name(name.to_owned())
                .spawn_scoped(s, run)
                .is_err()
            {
                let mut guard = lock();
                guard.0.remove(&id);
                guard.1.remove(id);
            }
        }
        for c in lock().0.values() {
            c.shut();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    /// A listener serving with `serve_each` on its own thread; each
    /// connection reads one byte and echoes it. Stopped (and its thread
    /// left to end) on drop, so a failed assertion never hangs the test.
    struct Echo {
        addr: SocketAddr,
        stop: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Echo {
        fn start(max: usize) -> Self {
            Self::start_shared(max, max)
        }

        /// Echoes one byte (marking the request read), then holds the
        /// connection until the client closes it.
        fn start_shared(max: usize, per_source: usize) -> Self {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&stop);
            let thread = std::thread::spawn(move || {
                serve_each(
                    l.incoming(),
                    (max, per_source),
                    "test-serve",
                    &|| flag.load(Ordering::SeqCst),
                    &|mut c: TcpStream, spoke: &dyn Fn()| {
                        let mut b = [0u8; 1];
                        if c.read_exact(&mut b).is_ok() {
                            spoke();
                            let _ = c.write_all(&b);
                            let _ = c.read_to_end(&mut Vec::new());
                        }
                    },
                )
            });
            Self {
                addr,
                stop,
                thread: Some(thread),
            }
        }

        fn connect(&self) -> TcpStream {
            let c = TcpStream::connect(self.addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            c
        }

        /// Stops the listener and waits for it.
        fn stop(mut self) {
            self.wake();
            self.thread.take().unwrap().join().unwrap();
        }

        fn wake(&self) {
            self.stop.store(true, Ordering::SeqCst);
            let _ = TcpStream::connect(self.addr);
        }
    }

    impl Drop for Echo {
        fn drop(&mut self) {
            if self.thread.is_some() {
                self.wake();
            }
        }
    }

    /// Whether the server answers `c`'s byte (an echo) rather than closing.
    fn answered(c: &mut TcpStream) -> bool {
        let _ = c.write_all(b"y");
        matches!(c.read(&mut [0u8; 1]), Ok(1))
    }

    /// Silent clients hold threads, not the listener: another client is
    /// answered meanwhile; stopping shuts the silent ones down.
    #[test]
    fn silent_clients_delay_nobody_and_stop_is_prompt() {
        let e = Echo::start(4);
        let silent: Vec<TcpStream> = (0..3).map(|_| e.connect()).collect();
        assert!(answered(&mut e.connect()));
        e.stop();
        for mut c in silent {
            assert!(matches!(c.read(&mut [0u8; 1]), Ok(0) | Err(_)));
        }
    }

    /// Whether the server closed `c` without a word.
    fn closed(c: &mut TcpStream) -> bool {
        matches!(c.read(&mut [0u8; 1]), Ok(0) | Err(_))
    }

    /// Past `max` connections, a new client is answered: the oldest
    /// silent one gives way (closed unanswered).
    #[test]
    fn past_the_bound_the_oldest_silent_client_gives_way() {
        let e = Echo::start(2);
        let mut silent: Vec<TcpStream> = (0..2).map(|_| e.connect()).collect();
        assert!(answered(&mut e.connect()));
        assert!(closed(&mut silent[0]), "the oldest silent client was kept");
        assert!(
            answered(&mut silent[1]),
            "a younger silent client was closed"
        );
        e.stop();
    }

    /// Clients whose requests are being answered are never evicted: with
    /// every place taken by them, one more is closed unanswered.
    #[test]
    fn clients_being_answered_are_never_evicted() {
        let e = Echo::start(2);
        let mut busy: Vec<TcpStream> = (0..2).map(|_| e.connect()).collect();
        for c in &mut busy {
            assert!(answered(c));
        }
        assert!(!answered(&mut e.connect()));
        e.stop();
    }

    /// The share of one source, and fairness between sources: a source at
    /// its share evicts its own oldest silent connection; with all places
    /// taken, the source holding most silent ones gives way; connections
    /// that spoke stay.
    #[test]
    fn room_is_shared_between_sources() {
        let (a, b) = (Source::Uid(1), Source::Uid(2));
        let mut r = Room::default();
        for id in 0..3 {
            assert_eq!(r.admit(id, a, 3, 4), Admit::Free);
        }
        assert_eq!(r.admit(3, a, 3, 4), Admit::Evict(0));
        assert_eq!(r.admit(4, b, 3, 4), Admit::Free);
        // Full: `a` holds three silent, `b` one.
        assert_eq!(r.admit(5, b, 3, 4), Admit::Evict(1));
        r.spoke(2);
        r.spoke(3);
        // `a` holds two that spoke; `b` two silent: `b` gives way.
        assert_eq!(r.admit(6, a, 3, 4), Admit::Evict(4));
        r.spoke(5);
        r.spoke(6);
        // Nobody silent is left.
        assert_eq!(r.admit(7, b, 3, 4), Admit::Full);
        r.remove(2);
        assert_eq!(r.admit(8, Source::Unknown, 3, 4), Admit::Free);
    }

    /// Waking a listener needs no connection: its loop returns even where
    /// one could not be made (here, to a port nothing listens on).
    #[test]
    fn a_listener_wakes_without_a_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let handle = listener.try_clone().unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let nowhere = closed.local_addr().unwrap();
        drop(closed);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let r = listener.accept().map(|_| ());
            tx.send(r.is_err()).unwrap();
        });
        wake_listener(Some(&handle), nowhere);
        let failed = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the accept loop woke");
        assert!(failed, "woken by an error, not a connection");
        t.join().unwrap();
    }
}
