//! Small side listeners (the local proof socket, the metrics endpoint):
//! each connection served on a short-lived thread of its own, so one
//! client that says nothing delays no other; a bounded number at once; and
//! when the listener stops, the connections still being served are shut
//! down, so it returns at once.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// A connection the listener can shut down from another thread.
pub(in crate::engine) trait Connection: Send + Sized {
    /// Another handle on the same connection.
    fn another(&self) -> io::Result<Self>;
    /// Shuts both directions down (the serving thread's I/O then fails).
    fn shut(&self);
}

impl Connection for UnixStream {
    fn another(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Connection for TcpStream {
    fn another(&self) -> io::Result<Self> {
        self.try_clone()
    }

    fn shut(&self) {
        let _ = self.shutdown(Shutdown::Both);
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
/// named `name` of its own, at most `max` at once (one more is closed
/// unanswered), until `stop` says so (asked after each accept: wake the
/// listener, [`wake_listener`]). Then shuts down the connections
/// still being served and returns once their threads have ended. `handle`
/// bounds its own time (a deadline per connection).
pub(in crate::engine) fn serve_each<C: Connection>(
    incoming: impl Iterator<Item = io::Result<C>>,
    max: usize,
    name: &str,
    stop: &dyn Fn() -> bool,
    handle: &(dyn Fn(C) + Sync),
) {
    let open: Mutex<HashMap<u64, C>> = Mutex::default();
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
                let mut open = lock();
                if open.len() >= max {
                    tracing::debug!(
                        listener = name,
                        max,
                        "connection closed: too many being served"
                    );
                    continue;
                }
                let Ok(c) = conn.another() else { continue };
                open.insert(id, c);
            }
            let run = move || {
                handle(conn);
                lock().remove(&id);
            };
            if std::thread::Builder::new()
                .name(name.to_owned())
                .spawn_scoped(s, run)
                .is_err()
            {
                lock().remove(&id);
            }
        }
        for c in lock().values() {
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
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&stop);
            let thread = std::thread::spawn(move || {
                serve_each(
                    l.incoming(),
                    max,
                    "test-serve",
                    &|| flag.load(Ordering::SeqCst),
                    &|mut c: TcpStream| {
                        let mut b = [0u8; 1];
                        if c.read_exact(&mut b).is_ok() {
                            let _ = c.write_all(&b);
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

    /// Past `max` connections being served, one more is closed unanswered.
    #[test]
    fn past_the_bound_a_client_is_closed() {
        let e = Echo::start(2);
        // Accepted in order: the two silent ones take both places.
        let silent: Vec<TcpStream> = (0..2).map(|_| e.connect()).collect();
        assert!(!answered(&mut e.connect()));
        drop(silent);
        e.stop();
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
