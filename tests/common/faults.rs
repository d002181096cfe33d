//! A frame-aware TCP proxy for fault injection: it forwards kvxfer's
//! frames (sized from `docs/wire-format.md` alone, no library code) and,
//! once armed with a [`Plan`], damages one of them — flips a bit of its
//! payload or header, truncates the connection inside it, duplicates it,
//! drops it, delays it, stalls the connection (as a stopped peer would),
//! or kills the connection — then goes on forwarding.
//!
//! A frame whose size it cannot tell (a transport's frame it does not
//! know) makes it forward the rest of that connection as opaque bytes.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Which way a fault applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Initiator → target (WRITE data, read requests, commits).
    Up,
    /// Target → initiator (READ data, acknowledgements, grant answers).
    Down,
}

/// What is done to the chosen frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// One bit of its body (of its header when it has none).
    FlipBody(u64),
    /// One bit of its header.
    FlipHeader(u32),
    /// The connection ends after its header and half its body.
    Truncate,
    /// Sent twice.
    Duplicate,
    /// Not sent.
    Drop,
    /// Sent after a pause (milliseconds).
    Delay(u64),
    /// The connection carries nothing either way for a while (ms), then
    /// goes on: a peer stopped and resumed.
    Stall(u64),
    /// Both directions of the connection end before it.
    Kill,
}

/// One fault: which way, at which frame after arming (counted over every
/// connection in that direction, keepalives not counted), and what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub dir: Dir,
    pub frame: usize,
    pub fault: Fault,
}

impl Plan {
    /// A plan drawn from `seed`: mostly data-bearing directions and early
    /// frames, every kind of fault; stalls and delays short of `io_ms` or
    /// past it.
    pub fn from_seed(seed: u64, io_ms: u64) -> Plan {
        let mut r = Rng(seed ^ 0x5851_f42d_4c95_7f2d);
        let dir = if r.below(4) == 0 { Dir::Down } else { Dir::Up };
        let frame = r.below(6) as usize;
        let fault = match r.below(8) {
            0 => Fault::FlipBody(r.next()),
            1 => Fault::FlipHeader(r.below(320) as u32),
            2 => Fault::Truncate,
            3 => Fault::Duplicate,
            4 => Fault::Drop,
            5 => Fault::Delay(r.below(200)),
            6 => Fault::Stall(if r.below(2) == 0 {
                r.below(io_ms / 2)
            } else {
                io_ms + r.below(io_ms)
            }),
            _ => Fault::Kill,
        };
        Plan { dir, frame, fault }
    }
}

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

struct Shared {
    upstream: Mutex<Option<SocketAddr>>,
    plan: Mutex<Option<Plan>>,
    /// Frames seen in each direction since the plan was armed.
    seen: [AtomicUsize; 2],
    /// Faults applied.
    applied: AtomicUsize,
    stop: AtomicBool,
    /// Every pump thread, joined when the proxy goes.
    pumps: Mutex<Vec<JoinHandle<()>>>,
    /// Every connection, shut down when the proxy goes.
    conns: Mutex<Vec<TcpStream>>,
}

/// The proxy.
pub struct FaultProxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl FaultProxy {
    pub fn start() -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream: Mutex::new(None),
            plan: Mutex::new(None),
            seen: Default::default(),
            applied: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            pumps: Mutex::new(Vec::new()),
            conns: Mutex::new(Vec::new()),
        });
        let sh = Arc::clone(&shared);
        let accept = std::thread::spawn(move || {
            for down in listener.incoming() {
                if sh.stop.load(Ordering::Acquire) {
                    break;
                }
                let Ok(down) = down else { continue };
                let Some(to) = *sh.upstream.lock().unwrap() else {
                    continue;
                };
                let Ok(up) = TcpStream::connect(to) else {
                    continue;
                };
                let _ = down.set_nodelay(true);
                let _ = up.set_nodelay(true);
                {
                    let mut c = sh.conns.lock().unwrap();
                    c.push(down.try_clone().unwrap());
                    c.push(up.try_clone().unwrap());
                }
                let link = Arc::new(Link {
                    a: down.try_clone().unwrap(),
                    b: up.try_clone().unwrap(),
                    stalled: Mutex::new(()),
                });
                let mut pumps = sh.pumps.lock().unwrap();
                for (from, to, dir) in [
                    (down, up.try_clone().unwrap(), Dir::Up),
                    (up, link.a.try_clone().unwrap(), Dir::Down),
                ] {
                    let (sh, link) = (Arc::clone(&sh), Arc::clone(&link));
                    pumps.push(std::thread::spawn(move || pump(&sh, &link, from, to, dir)));
                }
            }
        });
        FaultProxy {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    /// Where accepted connections go from now on.
    pub fn forward_to(&self, upstream: SocketAddr) {
        *self.shared.upstream.lock().unwrap() = Some(upstream);
    }

    /// Arms `plan`: its frame is counted from the next frame in its
    /// direction.
    pub fn arm(&self, plan: Plan) {
        for s in &self.shared.seen {
            s.store(0, Ordering::Release);
        }
        *self.shared.plan.lock().unwrap() = Some(plan);
    }

    /// Disarms a plan not yet applied; whether it had been.
    pub fn disarm(&self) -> bool {
        self.shared.plan.lock().unwrap().take();
        self.shared.applied.swap(0, Ordering::AcqRel) > 0
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for c in self.shared.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        let pumps: Vec<_> = self.shared.pumps.lock().unwrap().drain(..).collect();
        for p in pumps {
            let _ = p.join();
        }
    }
}

/// One proxied connection: its two sockets, and the lock a stall holds so
/// that neither direction moves meanwhile.
struct Link {
    a: TcpStream,
    b: TcpStream,
    stalled: Mutex<()>,
}

impl Link {
    fn kill(&self) {
        let _ = self.a.shutdown(Shutdown::Both);
        let _ = self.b.shutdown(Shutdown::Both);
    }
}

/// The body length of a frame, from its header as `docs/wire-format.md`
/// gives it; `None` for a frame the proxy cannot size.
fn body_len(h: &[u8; 40]) -> Option<u64> {
    let kind = h[0];
    let flags = h[1];
    let status = u16::from_le_bytes([h[2], h[3]]);
    let aux = u64::from(u32::from_le_bytes(h[4..8].try_into().unwrap()));
    let addr = u64::from_le_bytes(h[16..24].try_into().unwrap());
    let len = u64::from_le_bytes(h[24..32].try_into().unwrap());
    let trailer = if flags & 0x80 != 0 { 4 } else { 0 };
    Some(match kind {
        1 | 3 | 4 | 14 | 17 | 18 | 19 => aux,
        2 | 6 | 9 | 10 | 20 | 21 | 22 | 23 => 0,
        5 | 7 => len.checked_add(trailer)?,
        8 => {
            aux + if flags & 0x20 != 0 {
                addr.checked_mul(28)?
            } else {
                0
            }
        }
        13 => u64::from(flags) + aux,
        15 => aux
            .checked_mul(16)?
            .checked_add(len)?
            .checked_add(trailer)?,
        // The shm transport's frames: Grant and Granted have none, a
        // Delegate its table and sync message.
        24 if flags == 2 => match status & 0xff {
            1 | 3 => 0,
            2 => aux.checked_mul(24)?.checked_add(len >> 32)?,
            _ => return None,
        },
        _ => return None,
    })
}

/// Largest body the proxy buffers whole (larger ones: as they come).
const BODY_MAX: u64 = 64 << 20;

fn pump(sh: &Shared, link: &Link, mut from: TcpStream, mut to: TcpStream, dir: Dir) {
    let mut opaque = false;
    let mut buf = vec![0u8; 256 << 10];
    loop {
        if opaque {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let _g = link.stalled.lock().unwrap();
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
            continue;
        }
        let mut h = [0u8; 40];
        if from.read_exact(&mut h).is_err() {
            break;
        }
        let Some(n) = body_len(&h).filter(|&n| n <= BODY_MAX) else {
            opaque = true;
            let _g = link.stalled.lock().unwrap();
            if to.write_all(&h).is_err() {
                break;
            }
            continue;
        };
        let mut body = vec![0u8; n as usize];
        if from.read_exact(&mut body).is_err() {
            break;
        }
        let fault = if h[0] == 22 {
            None
        } else {
            take_fault(sh, dir)
        };
        let mut times = 1;
        match fault {
            None => {}
            Some(Fault::FlipBody(bit)) => {
                if body.is_empty() {
                    h[(bit % 320 / 8) as usize] ^= 1 << (bit % 8);
                } else {
                    let bit = bit % (body.len() as u64 * 8);
                    body[(bit / 8) as usize] ^= 1 << (bit % 8);
                }
            }
            Some(Fault::FlipHeader(bit)) => h[(bit / 8) as usize] ^= 1 << (bit % 8),
            Some(Fault::Truncate) => {
                let _ = to.write_all(&h);
                let _ = to.write_all(&body[..body.len() / 2]);
                link.kill();
                break;
            }
            Some(Fault::Duplicate) => times = 2,
            Some(Fault::Drop) => times = 0,
            Some(Fault::Delay(ms)) => std::thread::sleep(Duration::from_millis(ms)),
            Some(Fault::Stall(ms)) => {
                let _g = link.stalled.lock().unwrap();
                std::thread::sleep(Duration::from_millis(ms));
            }
            Some(Fault::Kill) => {
                link.kill();
                break;
            }
        }
        let _g = link.stalled.lock().unwrap();
        for _ in 0..times {
            if to.write_all(&h).is_err() || to.write_all(&body).is_err() {
                return finish(&from, &to);
            }
        }
    }
    finish(&from, &to);
}

fn finish(from: &TcpStream, to: &TcpStream) {
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

/// The fault for the next frame in `dir`, when the armed plan names it
/// (taking the plan).
fn take_fault(sh: &Shared, dir: Dir) -> Option<Fault> {
    let mut plan = sh.plan.lock().unwrap();
    let p = (*plan)?;
    if p.dir != dir {
        return None;
    }
    let k = sh.seen[dir as usize].fetch_add(1, Ordering::AcqRel);
    if k != p.frame {
        return None;
    }
    *plan = None;
    sh.applied.fetch_add(1, Ordering::AcqRel);
    Some(p.fault)
}
