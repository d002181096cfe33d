//! A TCP proxy for tests that flips one bit of what crosses it, on demand:
//! a peer's data damaged on the way, for the end-to-end integrity tests.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Which way the proxy damages.
#[derive(Clone, Copy, PartialEq)]
pub enum Dir {
    /// Initiator → target (WRITE payloads).
    Up,
    /// Target → initiator (READ data).
    Down,
}

/// A TCP proxy in front of an agent's listener that, once armed, flips one
/// bit `at` bytes into what it carries next in `dir`.
pub struct Proxy {
    /// Where it listens.
    pub addr: SocketAddr,
    upstream: Arc<Mutex<Option<SocketAddr>>>,
    /// Set to flip one bit `at` bytes after the next byte it carries in
    /// its direction; cleared when it has.
    pub armed: Arc<AtomicBool>,
    /// Bits flipped so far.
    pub flipped: Arc<AtomicUsize>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Where the connections it accepts from now on go.
    pub fn forward_to(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = Some(upstream);
    }

    pub fn start(dir: Dir, at: u64) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(false));
        let flipped = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (a, f, n, s) = (
            Arc::clone(&armed),
            Arc::clone(&flipped),
            Arc::clone(&accepted),
            Arc::clone(&stop),
        );
        let upstream = Arc::new(Mutex::new(None));
        let to = Arc::clone(&upstream);
        let accept = std::thread::spawn(move || {
            for down in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(down) = down else { continue };
                let Some(addr) = *to.lock().unwrap() else {
                    continue;
                };
                let Ok(up) = TcpStream::connect(addr) else {
                    continue;
                };
                n.fetch_add(1, Ordering::Relaxed);
                let _ = down.set_nodelay(true);
                let _ = up.set_nodelay(true);
                let pump = |from: TcpStream, to: TcpStream, flip: bool| {
                    let (a, f) = (Arc::clone(&a), Arc::clone(&f));
                    std::thread::spawn(move || pump(from, to, flip.then_some((at, a, f))))
                };
                pump(
                    down.try_clone().unwrap(),
                    up.try_clone().unwrap(),
                    dir == Dir::Up,
                );
                pump(up, down, dir == Dir::Down);
            }
        });
        Proxy {
            addr,
            upstream,
            armed,
            flipped,
            accepted,
            stop,
            accept: Some(accept),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Copies `from` to `to` until either ends; with `flip`, once armed,
/// flips bit 3 of the byte `at` bytes after the first one read since
/// (disarming it).
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    flip: Option<(u64, Arc<AtomicBool>, Arc<AtomicUsize>)>,
) {
    let mut buf = vec![0u8; 256 << 10];
    let (mut seen, mut start) = (0u64, None);
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((at, armed, flipped)) = &flip {
            if !armed.load(Ordering::Acquire) {
                start = None;
            } else if start.is_none() {
                start = Some(seen);
            }
            if let Some(s) = start
                && (seen..seen + n as u64).contains(&(s + at))
                && armed.swap(false, Ordering::AcqRel)
            {
                buf[(s + at - seen) as usize] ^= 1 << 3;
                flipped.fetch_add(1, Ordering::Relaxed);
                start = None;
            }
        }
        seen += n as u64;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
