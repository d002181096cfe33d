//! A TCP proxy for tests that flips one bit of what crosses it, on demand:
//! a peer's data damaged on the way, for the end-to-end integrity tests;
//! it also keeps what it carried each way (the first [`CAPTURE_MAX`]
//! bytes), as a capture on the wire would.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use kvxfer::{AgentConfig, Backend, TransferAgent, make_transfer_agent};

/// Which way the proxy damages.
#[derive(Clone, Copy, Debug, PartialEq)]
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
    /// Holds what it carries in its direction (see [`Hold`]).
    pub hold: Arc<Hold>,
    /// What it carried initiator → target, and target → initiator, all
    /// connections together (the first [`CAPTURE_MAX`] bytes each).
    pub captured: [Arc<Mutex<Vec<u8>>>; 2],
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

/// Most bytes a proxy keeps of what it carried each way.
pub const CAPTURE_MAX: usize = 64 << 20;

/// Stops a proxy's carrying in its direction once a set number of bytes
/// went through, until released: a sender held mid-request, observably.
#[derive(Default)]
pub struct Hold {
    /// (bytes after which to hold, 0 for never; holding now; released).
    state: Mutex<(u64, bool, bool)>,
    cv: Condvar,
}

impl Hold {
    /// Holds once `bytes` more went through (from the next read on).
    pub fn after(&self, bytes: u64) {
        *self.state.lock().unwrap() = (bytes, false, false);
    }

    /// Waits until it holds.
    pub fn wait_held(&self) {
        let g = self.state.lock().unwrap();
        let (_g, t) = self
            .cv
            .wait_timeout_while(g, std::time::Duration::from_secs(60), |s| !s.1)
            .unwrap();
        assert!(!t.timed_out(), "the proxy never held");
    }

    /// Lets it carry on.
    pub fn release(&self) {
        let mut s = self.state.lock().unwrap();
        s.2 = true;
        self.cv.notify_all();
    }

    /// Of `n` bytes read, how many to carry before holding (then holds
    /// until released); `n` when not holding.
    fn take(&self, n: usize, armed_at: &mut Option<u64>, seen: u64) -> usize {
        let s = self.state.lock().unwrap();
        if s.0 == 0 || s.1 {
            *armed_at = None;
            return n;
        }
        let at = *armed_at.get_or_insert(seen + s.0);
        if seen + n as u64 <= at {
            return n;
        }
        (at - seen) as usize
    }

    fn hold(&self) {
        let mut s = self.state.lock().unwrap();
        s.1 = true;
        self.cv.notify_all();
        while !s.2 {
            s = self.cv.wait(s).unwrap();
        }
        s.0 = 0;
    }
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
        let hold = Arc::new(Hold::default());
        let h = Arc::clone(&hold);
        let (a, f, n, s) = (
            Arc::clone(&armed),
            Arc::clone(&flipped),
            Arc::clone(&accepted),
            Arc::clone(&stop),
        );
        let upstream = Arc::new(Mutex::new(None));
        let to = Arc::clone(&upstream);
        let captured: [Arc<Mutex<Vec<u8>>>; 2] = Default::default();
        let cap = captured.clone();
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
                let pump = |from: TcpStream, to: TcpStream, flip: bool, cap: &Arc<_>| {
                    let (a, f, h) = (Arc::clone(&a), Arc::clone(&f), Arc::clone(&h));
                    let cap = Arc::clone(cap);
                    std::thread::spawn(move || {
                        pump(
                            from,
                            to,
                            flip.then_some((at, a, f)),
                            flip.then_some(h),
                            &cap,
                        )
                    })
                };
                pump(
                    down.try_clone().unwrap(),
                    up.try_clone().unwrap(),
                    dir == Dir::Up,
                    &cap[0],
                );
                pump(up, down, dir == Dir::Down, &cap[1]);
            }
        });
        Proxy {
            addr,
            upstream,
            armed,
            flipped,
            accepted,
            hold,
            captured,
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

/// Copies `from` to `to` until either ends, keeping what it carried in
/// `capture` (up to [`CAPTURE_MAX`]); with `flip`, once armed, flips bit 3
/// of the byte `at` bytes after the first one read since (disarming it);
/// with `hold`, holds where it says.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    flip: Option<(u64, Arc<AtomicBool>, Arc<AtomicUsize>)>,
    hold: Option<Arc<Hold>>,
    capture: &Mutex<Vec<u8>>,
) {
    let mut buf = vec![0u8; 256 << 10];
    let (mut seen, mut start, mut hold_at) = (0u64, None, None);
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut c = capture.lock().unwrap();
            let room = CAPTURE_MAX.saturating_sub(c.len()).min(n);
            c.extend_from_slice(&buf[..room]);
        }
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
        if let Some(h) = &hold {
            let first = h.take(n, &mut hold_at, seen);
            if first < n {
                if to.write_all(&buf[..first]).is_err() {
                    break;
                }
                h.hold();
                hold_at = None;
                if to.write_all(&buf[first..n]).is_err() {
                    break;
                }
                seen += n as u64;
                continue;
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

/// Two TCP agents of this process, the initiator reaching the target only
/// through a [`Proxy`].
pub struct Pair {
    pub init: Box<dyn TransferAgent>,
    pub target: Box<dyn TransferAgent>,
    /// The target's name.
    pub name: String,
    pub proxy: Proxy,
}

impl Pair {
    /// The agents of `init` and `target`, and a proxy to the target that
    /// damages in `dir` at `at` when armed.
    pub fn start(init: AgentConfig, target: AgentConfig, dir: Dir, at: u64) -> Pair {
        let target = make_transfer_agent(Backend::Tcp, target).unwrap();
        let init = make_transfer_agent(Backend::Tcp, init).unwrap();
        let desc = target.local_agent_desc();
        let proxy = Proxy::start(dir, at);
        proxy.forward_to(desc.endpoints[0].parse().unwrap());
        Pair {
            init,
            target,
            name: desc.name,
            proxy,
        }
    }

    /// Loads the target's descriptor (its regions registered by now) into
    /// the initiator, with the proxy as its endpoint.
    pub fn load(&self) {
        let mut desc = self.target.local_agent_desc();
        desc.endpoints = vec![self.proxy.addr.to_string()];
        self.init.load_remote_agent(&desc).unwrap();
    }
}
