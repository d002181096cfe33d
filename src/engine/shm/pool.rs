//! Shared pools on the shm transport: the channel on which a target hands
//! its registered pools ([`crate::pool`]) to a proven same-host initiator,
//! and revokes them.
//!
//! The channel is the initiator's local proof connection
//! (`local_proof::prove_and_keep`), kept open after the target bound it to
//! the session: the kernel has told the target which process holds it, so
//! a pool's descriptor given on it reaches that process only. Both sides
//! send 32-byte frames ([`Msg`]):
//!
//! - the initiator asks for a region by its access key (`Ask`); the target
//!   answers `Give` with the pool's file descriptor (`SCM_RIGHTS`: read-only
//!   for a pool shared for READ only) and where the region lies, or `Plain`
//!   (not a pool: the cross-memory path moves it). The initiator maps the
//!   file once, and copies each granted request with plain loads and
//!   stores through its mapping (the grants still hold the region for the
//!   copy, exactly as for a cross-memory one).
//! - when the pool is deregistered (no request holds it then), the target
//!   sends `Drop`; the initiator unmaps it once no copy of its own uses
//!   it, and answers `Dropped`. Deregistration returns after every answer,
//!   or after the agent's I/O timeout, when it shuts a silent channel
//!   down.
//!
//! A channel that ends takes every mapping made through it with it, on
//! both sides' terms: the initiator unmaps all it mapped; the target
//! forgets what it handed out.
//!
//! Threads: one per channel on each side, reading; writes are serialized
//! by a lock. The target's `Ask` answers and its `Drop`s go out under that
//! lock with the registry lookup, so a `Drop` never overtakes the `Give` it
//! revokes.

use crate::engine::lock;
use crate::memory::Piece;
use crate::pool::Mapping;
use crate::registry::Registry;
use crossbeam_channel::{Receiver, Sender};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
use std::collections::{HashMap, HashSet};
use std::io::{self, IoSlice, Write};
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes of one frame.
const FRAME: usize = 32;

/// Most regions one request may ask for at once (the rest go the
/// cross-memory way until a later request asks again).
const ASK_MAX: usize = 64;

/// A channel frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Msg {
    /// Initiator: the region with this access key, if it is a pool.
    Ask { key: u64 },
    /// Target: the region `key` is a pool at `addr` (in the target),
    /// `len` bytes, its file's descriptor attached (mapped from offset 0).
    Give {
        key: u64,
        addr: u64,
        len: u64,
        writable: bool,
    },
    /// Target: the region `key` is not a pool (or not registered).
    Plain { key: u64 },
    /// Target: the pool `key` was deregistered: unmap it.
    Drop { key: u64 },
    /// Initiator: the pool `key` is unmapped.
    Dropped { key: u64 },
    /// Initiator: the VMM GPU allocation of the region with this access
    /// key.
    AskGpu { key: u64 },
    /// Target: the region `key` is VMM GPU memory in an allocation of
    /// `len` bytes, its descriptor attached.
    GiveGpu { key: u64, len: u64 },
}

impl Msg {
    fn encode(self) -> [u8; FRAME] {
        let (tag, flags, key, a, b) = match self {
            Msg::Ask { key } => (1u8, 0u8, key, 0, 0),
            Msg::Give {
                key,
                addr,
                len,
                writable,
            } => (2, u8::from(writable), key, addr, len),
            Msg::Plain { key } => (3, 0, key, 0, 0),
            Msg::Drop { key } => (4, 0, key, 0, 0),
            Msg::Dropped { key } => (5, 0, key, 0, 0),
            Msg::AskGpu { key } => (6, 0, key, 0, 0),
            Msg::GiveGpu { key, len } => (7, 0, key, 0, len),
        };
        let mut f = [0u8; FRAME];
        f[0] = tag;
        f[1] = flags;
        f[8..16].copy_from_slice(&key.to_le_bytes());
        f[16..24].copy_from_slice(&a.to_le_bytes());
        f[24..32].copy_from_slice(&b.to_le_bytes());
        f
    }

    fn decode(f: &[u8; FRAME]) -> io::Result<Self> {
        let word = |i: usize| u64::from_le_bytes(f[i..i + 8].try_into().expect("8 bytes"));
        let key = word(8);
        Ok(match (f[0], f[1]) {
            (1, 0) => Msg::Ask { key },
            (2, w @ (0 | 1)) => Msg::Give {
                key,
                addr: word(16),
                len: word(24),
                writable: w == 1,
            },
            (3, 0) => Msg::Plain { key },
            (4, 0) => Msg::Drop { key },
            (5, 0) => Msg::Dropped { key },
            (6, 0) => Msg::AskGpu { key },
            (7, 0) => Msg::GiveGpu { key, len: word(24) },
            _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "bad pool frame")),
        })
    }
}

/// Sends `msg` on `sock`, with `fd` attached when given.
fn send(sock: &UnixStream, msg: Msg, fd: Option<&OwnedFd>) -> io::Result<()> {
    let bytes = msg.encode();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd.as_fd()];
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let sent = sendmsg(
        sock,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    (&*sock).write_all(&bytes[sent..])
}

/// Reads one frame from `sock` and the descriptor sent with it, if any
/// (others are closed). `Ok(None)` at the end of the stream.
fn recv(sock: &UnixStream) -> io::Result<Option<(Msg, Option<OwnedFd>)>> {
    let mut f = [0u8; FRAME];
    match super::proof::recv_full(sock, &mut f, None)? {
        Some(fd) => Ok(Some((Msg::decode(&f)?, fd))),
        None => Ok(None),
    }
}

// ---- the target's side ---------------------------------------------------

/// What the target's side of a channel knows: the pools it handed out
/// (and not yet revoked), the revocations answered, whether it ended.
#[derive(Default)]
struct Handed {
    given: HashSet<u64>,
    dropped: HashSet<u64>,
    closed: bool,
}

/// The target's side of a session's channel.
///
/// Drop order: [`close`](Self::close) shuts the socket down and joins the
/// reading thread (the session does it when it closes); dropping without
/// it leaves the thread to end at the socket's end.
pub(in crate::engine) struct Served {
    sock: UnixStream,
    /// Held while a frame is written, and across an `Ask`'s registry
    /// lookup and answer.
    write: Mutex<()>,
    handed: Mutex<Handed>,
    changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Served {
    /// Serves `conn`, proven to belong to the session's initiator, as its
    /// channel: `Ask`s answered from `registry`; writes bounded by
    /// `io_timeout`.
    pub(in crate::engine) fn start(
        conn: UnixStream,
        registry: Arc<Registry>,
        agent: &str,
        io_timeout: Duration,
    ) -> io::Result<Arc<Self>> {
        conn.set_read_timeout(None)?;
        conn.set_write_timeout(Some(io_timeout))?;
        let reader = conn.try_clone()?;
        let me = Arc::new(Self {
            sock: conn,
            write: Mutex::new(()),
            handed: Mutex::default(),
            changed: Condvar::new(),
            thread: Mutex::new(None),
        });
        let served = Arc::clone(&me);
        let agent = agent.to_owned();
        let t = std::thread::Builder::new()
            .name(format!("kvxfer-pools-{agent}"))
            .spawn(move || {
                if let Err(e) = served.serve(&reader, &registry) {
                    tracing::debug!(%agent, error = %e, "pool channel ended");
                }
                lock(&served.handed).closed = true;
                served.changed.notify_all();
            })?;
        *lock(&me.thread) = Some(t);
        Ok(me)
    }

    /// Reads the initiator's frames until the channel ends.
    fn serve(&self, reader: &UnixStream, registry: &Registry) -> io::Result<()> {
        while let Some((msg, _)) = recv(reader)? {
            match msg {
                Msg::Ask { key } => {
                    let _w = lock(&self.write);
                    match registry.shared(key) {
                        Some((desc, share)) => {
                            let fd = share.descriptor()?;
                            lock(&self.handed).given.insert(key);
                            let give = Msg::Give {
                                key,
                                addr: desc.addr,
                                len: desc.len,
                                writable: share.writable,
                            };
                            send(&self.sock, give, Some(&fd))?;
                        }
                        None => send(&self.sock, Msg::Plain { key }, None)?,
                    }
                }
                Msg::Dropped { key } => {
                    lock(&self.handed).dropped.insert(key);
                    self.changed.notify_all();
                }
                Msg::AskGpu { key } => {
                    let _w = lock(&self.write);
                    match registry.vmm_share(key) {
                        Some(v) => {
                            let give = Msg::GiveGpu { key, len: v.size };
                            send(&self.sock, give, Some(&v.fd))?;
                        }
                        None => send(&self.sock, Msg::Plain { key }, None)?,
                    }
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected pool frame {other:?}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Revokes the pool `key` (deregistered: no request holds it) if this
    /// channel handed it out: waits until the initiator has unmapped it, or
    /// until `timeout`, when the channel is shut down.
    pub(in crate::engine) fn revoke(&self, key: u64, timeout: Duration) -> bool {
        {
            let _w = lock(&self.write);
            let mut h = lock(&self.handed);
            if !h.given.remove(&key) || h.closed {
                return true;
            }
            h.dropped.remove(&key);
            drop(h);
            if send(&self.sock, Msg::Drop { key }, None).is_err() {
                let _ = self.sock.shutdown(Shutdown::Both);
                return false;
            }
        }
        let deadline = Instant::now() + timeout;
        let mut h = lock(&self.handed);
        loop {
            if h.dropped.remove(&key) {
                return true;
            }
            if h.closed {
                return false;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                drop(h);
                let _ = self.sock.shutdown(Shutdown::Both);
                return false;
            }
            h = self
                .changed
                .wait_timeout(h, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Ends the channel and its thread.
    pub(in crate::engine) fn close(&self) {
        let _ = self.sock.shutdown(Shutdown::Both);
        let t = lock(&self.thread).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

// ---- the initiator's side ------------------------------------------------

/// A target's pool as this process maps it.
pub(in crate::engine) struct PeerPool {
    /// Where the region lies in the target.
    addr: u64,
    len: u64,
    writable: bool,
    /// The mapping; `None` once revoked. A copy holds it read while it
    /// runs; the revocation takes it for writing.
    map: RwLock<Option<Mapping>>,
}

impl PeerPool {
    /// Unmaps it, once no copy uses it.
    fn unmap(&self) {
        *self.map.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// What this side knows of one of the target's regions.
#[derive(Clone)]
enum Known {
    Pool(Arc<PeerPool>),
    Plain,
}

/// State shared between a link's copies and its channel's reading thread.
#[derive(Default)]
struct Maps {
    regions: HashMap<u64, Known>,
    /// VMM GPU allocations' descriptors given, until their asker takes
    /// them (with the allocation's size).
    gpu: HashMap<u64, (OwnedFd, u64)>,
}

/// The initiator's side of a link's shared pools: the channel to the
/// target (opened at the first request that could use one), the target's
/// regions known to be pools (mapped) or not.
///
/// Drop order: the channel's socket is shut down and its thread joined
/// (which unmaps every pool), then the maps go.
pub(in crate::engine) struct Pools {
    /// The target's instance and the session's ticket (for the proof).
    instance: u64,
    ticket: u128,
    timeout: Duration,
    maps: Arc<Mutex<Maps>>,
    chan: Mutex<Chan>,
}

/// The channel, while it is open; `Failed` when it could not be opened (a
/// target in another network namespace, or one without pools): the link
/// asks no more.
enum Chan {
    Closed,
    Open {
        sock: Arc<UnixStream>,
        answers: Receiver<u64>,
        thread: JoinHandle<()>,
    },
    Failed,
}

impl Pools {
    /// The pools of the target `instance`, reached with the session
    /// `ticket`; every wait bounded by `timeout`.
    ///
    /// `proved`: the connection of the proof this link made as it opened
    /// (for delegated copies), kept as the channel: one proof connection
    /// per session, so no older one can take the channel's place at the
    /// target after a newer one.
    pub(in crate::engine) fn new(
        instance: u64,
        ticket: u128,
        timeout: Duration,
        proved: Option<UnixStream>,
    ) -> Self {
        let me = Self {
            instance,
            ticket,
            timeout,
            maps: Arc::default(),
            chan: Mutex::new(Chan::Closed),
        };
        if let Some(sock) = proved {
            let chan = me.start(sock).unwrap_or_else(|e| {
                tracing::debug!(error = %e, "no pool channel; copies go the cross-memory way");
                Chan::Failed
            });
            *lock(&me.chan) = chan;
        }
        me
    }

    /// The local pieces with their remote sides moved into this process's
    /// mappings of the target's pools, when every remote side (in the
    /// region of the same index in `keys`) lies in a pool mapped with the
    /// access `write` needs; and the holds on those mappings, which the
    /// copy keeps while it runs. Regions not seen before are asked for
    /// first (once per region). `None`: the request goes the cross-memory
    /// way.
    pub(in crate::engine) fn resolve(
        &self,
        pieces: &[Piece],
        keys: &[u64],
        write: bool,
    ) -> Option<Resolved> {
        if pieces.is_empty() || keys.len() != pieces.len() {
            return None;
        }
        if !keys.iter().all(|&k| crate::pool::is_pool_key(k)) {
            // A region that is no pool: the request goes the cross-memory
            // way, nothing to ask (and no lock taken).
            return None;
        }
        let unknown: Vec<u64> = {
            let maps = lock(&self.maps);
            let mut seen = HashSet::new();
            keys.iter()
                .copied()
                .filter(|k| !maps.regions.contains_key(k) && seen.insert(*k))
                .take(ASK_MAX)
                .collect()
        };
        if !unknown.is_empty() {
            self.ask(&unknown, |key| Msg::Ask { key });
        }
        let maps = lock(&self.maps);
        let mut pools: Vec<Arc<PeerPool>> = Vec::new();
        let mut of = Vec::with_capacity(pieces.len());
        for (p, k) in pieces.iter().zip(keys) {
            let Some(Known::Pool(pool)) = maps.regions.get(k) else {
                return None;
            };
            let inside = p.remote >= pool.addr
                && p.remote
                    .checked_add(p.len)
                    .is_some_and(|end| end <= pool.addr + pool.len);
            if !inside || (write && !pool.writable) {
                return None;
            }
            let i = match pools.iter().rposition(|l| Arc::ptr_eq(l, pool)) {
                Some(i) => i,
                None => {
                    pools.push(Arc::clone(pool));
                    pools.len() - 1
                }
            };
            of.push(i);
        }
        Some(Resolved { pools, of })
    }

    /// The descriptor of the target's VMM GPU allocation holding its region
    /// `key`, and the allocation's size, asked for on the channel; `None`
    /// when the target gives none (not VMM memory, no channel, no answer
    /// within the timeout).
    pub(in crate::engine) fn vmm(&self, key: u64) -> Option<(OwnedFd, u64)> {
        self.ask(&[key], |key| Msg::AskGpu { key });
        lock(&self.maps).gpu.remove(&key)
    }

    /// Asks the target about `keys` (each in the frame `ask` makes),
    /// waiting (within the timeout) for the answers; the reading thread
    /// records them.
    fn ask(&self, keys: &[u64], ask: fn(u64) -> Msg) {
        let mut chan = lock(&self.chan);
        if matches!(*chan, Chan::Closed) {
            *chan = match self.open() {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "no pool channel; copies go the cross-memory way");
                    Chan::Failed
                }
            };
        }
        let Chan::Open { sock, answers, .. } = &*chan else {
            return;
        };
        // Answers left over from an ask that timed out.
        while answers.try_recv().is_ok() {}
        for &key in keys {
            if send(sock, ask(key), None).is_err() {
                return;
            }
        }
        let deadline = Instant::now() + self.timeout;
        let mut left: HashSet<u64> = keys.iter().copied().collect();
        while !left.is_empty() {
            match answers.recv_deadline(deadline) {
                Ok(k) => {
                    left.remove(&k);
                }
                Err(_) => return,
            }
        }
    }

    /// Opens the channel: proves this process to the target and starts the
    /// reading thread.
    fn open(&self) -> io::Result<Chan> {
        let sock = super::proof::prove_and_keep(self.instance, self.ticket, self.timeout)?;
        self.start(sock)
    }

    /// Serves `sock`, a proven connection, as the channel: its reading
    /// thread started.
    fn start(&self, sock: UnixStream) -> io::Result<Chan> {
        sock.set_read_timeout(None)?;
        sock.set_write_timeout(Some(self.timeout))?;
        let sock = Arc::new(sock);
        let (tx, rx) = crossbeam_channel::unbounded();
        let (reader, maps) = (Arc::clone(&sock), Arc::clone(&self.maps));
        let thread = std::thread::Builder::new()
            .name("kvxfer-pool-maps".into())
            .spawn(move || {
                if let Err(e) = read_channel(&reader, &maps, &tx) {
                    tracing::debug!(error = %e, "pool channel ended");
                }
                // Nothing more can be revoked on it: every mapping goes.
                let gone: Vec<Known> = lock(&maps).regions.drain().map(|(_, k)| k).collect();
                for k in gone {
                    if let Known::Pool(p) = k {
                        p.unmap();
                    }
                }
            })?;
        Ok(Chan::Open {
            sock,
            answers: rx,
            thread,
        })
    }
}

/// The initiator's reading thread: records answers (telling the asker of
/// each) and carries out revocations, until the channel ends.
fn read_channel(sock: &UnixStream, maps: &Mutex<Maps>, answers: &Sender<u64>) -> io::Result<()> {
    while let Some((msg, fd)) = recv(sock)? {
        match msg {
            Msg::Give {
                key,
                addr,
                len,
                writable,
            } => {
                // Only a file sealed against shrinking: a mapping past the
                // end of a file faults the process.
                let fd = fd.filter(|fd| crate::pool::sealed(fd, len));
                let known = match fd.map(|fd| {
                    let n = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidData)?;
                    Mapping::map(fd, 0, n, writable)
                }) {
                    Some(Ok(map)) if addr.checked_add(len).is_some() => {
                        Known::Pool(Arc::new(PeerPool {
                            addr,
                            len,
                            writable,
                            map: RwLock::new(Some(map)),
                        }))
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "could not map a target's pool; it goes the cross-memory way");
                        Known::Plain
                    }
                    _ => Known::Plain,
                };
                lock(maps).regions.insert(key, known);
                let _ = answers.send(key);
            }
            Msg::Plain { key } => {
                lock(maps).regions.insert(key, Known::Plain);
                let _ = answers.send(key);
            }
            Msg::GiveGpu { key, len } => {
                if let Some(fd) = fd {
                    lock(maps).gpu.insert(key, (fd, len));
                }
                let _ = answers.send(key);
            }
            Msg::Drop { key } => {
                let gone = lock(maps).regions.remove(&key);
                if let Some(Known::Pool(p)) = gone {
                    p.unmap();
                }
                send(sock, Msg::Dropped { key }, None)?;
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected pool frame {other:?}"),
                ));
            }
        }
    }
    Ok(())
}

impl Drop for Pools {
    fn drop(&mut self) {
        let chan = std::mem::replace(
            self.chan.get_mut().unwrap_or_else(|p| p.into_inner()),
            Chan::Closed,
        );
        if let Chan::Open { sock, thread, .. } = chan {
            let _ = sock.shutdown(Shutdown::Both);
            let _ = thread.join();
        }
    }
}

/// Holds on the mappings of a request's pools while its copy runs, and
/// the pieces' remote sides in this process.
pub(in crate::engine) struct Mapped<'a> {
    _held: Vec<RwLockReadGuard<'a, Option<Mapping>>>,
    /// The pieces, remote sides moved into the mappings.
    pub(in crate::engine) pieces: Vec<Piece>,
}

/// A request's pools, each once, and each piece's pool among them.
pub(in crate::engine) struct Resolved {
    pools: Vec<Arc<PeerPool>>,
    of: Vec<usize>,
}

impl Resolved {
    /// Holds the pools (each once) and moves each piece's remote side into
    /// its pool's mapping; `None` when one was revoked meanwhile.
    pub(in crate::engine) fn hold(&self, pieces: &[Piece]) -> Option<Mapped<'_>> {
        let held: Vec<_> = self
            .pools
            .iter()
            .map(|p| p.map.read().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let mut out = Vec::with_capacity(pieces.len());
        for (p, &i) in pieces.iter().zip(&self.of) {
            let base = held[i].as_ref()?.addr();
            out.push(Piece {
                local: p.local,
                remote: base + (p.remote - self.pools[i].addr),
                len: p.len,
            });
        }
        Some(Mapped {
            _held: held,
            pieces: out,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryType;
    use crate::pool::{Share, SharedPool};

    /// A registry with `pool` registered as a pool; its key.
    fn registered(pool: &SharedPool, writable: bool) -> (Arc<Registry>, u64) {
        let r = Arc::new(Registry::default());
        let share = Share {
            pool: Arc::clone(pool.mapping()),
            writable,
        };
        // SAFETY: the share holds the pool's mapping while registered.
        unsafe {
            r.register(
                &pool.descs(),
                &[MemoryType::Dram],
                "t",
                &[],
                &[],
                Some(&share),
            )
            .unwrap()
        };
        let key = r.acquire_local(&pool.descs()).unwrap()[0].region().key;
        (r, key)
    }

    /// A channel between a target serving `registry` (writes bounded by
    /// `timeout`) and an initiator's reading thread.
    struct Wired {
        served: Arc<Served>,
        /// The initiator's end, to send on.
        b: Arc<UnixStream>,
        maps: Arc<Mutex<Maps>>,
        /// The keys answered, as the reading thread tells them.
        rx: Receiver<u64>,
        t: JoinHandle<io::Result<()>>,
    }

    fn wired(registry: Arc<Registry>, timeout: Duration) -> Wired {
        let (a, b) = UnixStream::pair().unwrap();
        let served = Served::start(a, registry, "t", timeout).unwrap();
        let b = Arc::new(b);
        let maps: Arc<Mutex<Maps>> = Arc::default();
        let (tx, rx) = crossbeam_channel::unbounded();
        let t = {
            let (b, maps) = (Arc::clone(&b), Arc::clone(&maps));
            std::thread::spawn(move || read_channel(&b, &maps, &tx))
        };
        Wired {
            served,
            b,
            maps,
            rx,
            t,
        }
    }

    /// Asked for a pool, the target gives its file; asked for anything
    /// else, it says `Plain`. Deregistered, the pool is revoked: an honest
    /// initiator's thread unmaps it and answers before `revoke` returns.
    #[test]
    fn pools_are_given_then_revoked_from_an_honest_initiator() {
        let pool = SharedPool::new(8192).unwrap();
        // SAFETY: the pool's bytes are ours; nothing else touches them yet.
        unsafe { pool.as_ptr().add(5).write(9) };
        let (registry, key) = registered(&pool, true);
        let Wired {
            served,
            b,
            maps,
            rx,
            t,
        } = wired(Arc::clone(&registry), Duration::from_secs(5));
        send(&b, Msg::Ask { key }, None).unwrap();
        send(&b, Msg::Ask { key: key ^ 1 }, None).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), key);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), key ^ 1);
        let mapped = match lock(&maps).regions.get(&key) {
            Some(Known::Pool(p)) => Arc::clone(p),
            _ => panic!("not mapped"),
        };
        assert!(matches!(
            lock(&maps).regions.get(&(key ^ 1)),
            Some(Known::Plain)
        ));
        let at = mapped.map.read().unwrap().as_ref().unwrap().addr();
        // SAFETY: the mapping is 8192 bytes, held (`mapped` is alive and
        // not revoked yet).
        assert_eq!(unsafe { *((at + 5) as *const u8) }, 9, "the same memory");
        assert_eq!((mapped.addr, mapped.len), (pool.as_ptr() as u64, 8192));

        registry.deregister(&pool.descs()).unwrap();
        assert!(served.revoke(key, Duration::from_secs(5)));
        assert!(
            mapped.map.read().unwrap().is_none(),
            "unmapped before revoke returned"
        );
        assert!(!lock(&maps).regions.contains_key(&key));
        // Revoked once: a second revocation has nothing to do.
        assert!(served.revoke(key, Duration::from_millis(1)));
        served.close();
        t.join().unwrap().unwrap();
    }

    /// Asked for a VRAM region's VMM allocation, the target gives the
    /// allocation's descriptor (the same file) and size; asked for a
    /// region that has none, it says `Plain` and nothing is kept.
    #[test]
    fn a_vmm_allocation_is_given_as_its_descriptor() {
        use crate::registry::{GpuRegion, VmmShare};
        use std::os::fd::AsRawFd;
        let file = rustix::fs::memfd_create("vmm", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let r = Arc::new(Registry::default());
        let desc = crate::memory::MemoryDescs::new(
            MemoryType::Vram,
            vec![crate::memory::MemoryDesc::new(0x7000_0000_1000, 4096, 0)],
        );
        let gpu = GpuRegion {
            device: 0,
            base: 0x7000_0000_0000,
            offset: 0x1000,
            ipc: None,
            vmm: Some(Arc::new(VmmShare {
                fd: file.try_clone().unwrap(),
                size: 2 << 20,
            })),
        };
        // SAFETY: nothing dereferences the range (no registrar, no copy).
        unsafe { r.register(&desc, &[MemoryType::Vram], "t", &[], &[gpu], None) }.unwrap();
        let key = r.acquire_local(&desc).unwrap()[0].region().key;
        let Wired {
            served,
            b,
            maps,
            rx,
            t,
        } = wired(r, Duration::from_secs(5));
        send(&b, Msg::AskGpu { key }, None).unwrap();
        send(&b, Msg::AskGpu { key: key ^ 2 }, None).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), key);
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), key ^ 2);
        let (fd, size) = lock(&maps).gpu.remove(&key).expect("given");
        assert_eq!(size, 2 << 20);
        let ino = |fd: i32| std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(ino(fd.as_raw_fd()).ino(), ino(file.as_raw_fd()).ino());
        assert!(lock(&maps).gpu.is_empty(), "nothing kept for the other");
        served.close();
        t.join().unwrap().unwrap();
    }

    /// A revocation waits for a copy that holds the mapping: the
    /// initiator unmaps, and answers, only once the copy lets go.
    #[test]
    fn a_revocation_waits_for_the_copy_in_flight() {
        let pool = SharedPool::new(4096).unwrap();
        let (registry, key) = registered(&pool, true);
        let Wired {
            served,
            b,
            maps,
            rx,
            t,
        } = wired(Arc::clone(&registry), Duration::from_secs(30));
        send(&b, Msg::Ask { key }, None).unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let piece = [Piece {
            local: 0,
            remote: pool.as_ptr() as u64 + 100,
            len: 8,
        }];
        let pools = Pools::new(0, 0, Duration::from_secs(1), None);
        // The channel's maps, as a link's copies see them.
        let resolved = {
            let known = lock(&maps).regions.clone();
            lock(&pools.maps).regions = known;
            pools.resolve(&piece, &[key], true).unwrap()
        };
        let copy = resolved.hold(&piece).unwrap();
        registry.deregister(&pool.descs()).unwrap();
        let revoking = {
            let served = Arc::clone(&served);
            std::thread::spawn(move || served.revoke(key, Duration::from_secs(30)))
        };
        // The initiator has taken the pool out of its maps (it got the
        // `Drop`); its unmapping waits for the copy, and so does the answer.
        while lock(&maps).regions.contains_key(&key) {
            std::thread::yield_now();
        }
        assert!(!revoking.is_finished(), "revoked under a copy");
        drop(copy);
        assert!(revoking.join().unwrap());
        assert!(resolved.hold(&piece).is_none(), "unmapped");
        served.close();
        t.join().unwrap().unwrap();
    }

    /// An initiator that does not answer a revocation within the timeout
    /// has its channel shut down (which an honest one reads as the end of
    /// every mapping); a read-only pool's descriptor cannot be mapped
    /// writable.
    #[test]
    fn a_silent_initiator_is_cut_off() {
        let pool = SharedPool::new(4096).unwrap();
        let (registry, key) = registered(&pool, false);
        let (a, b) = UnixStream::pair().unwrap();
        let served = Served::start(a, Arc::clone(&registry), "t", Duration::from_secs(5)).unwrap();
        send(&b, Msg::Ask { key }, None).unwrap();
        let (msg, fd) = recv(&b).unwrap().unwrap();
        assert!(
            matches!(
                msg,
                Msg::Give {
                    writable: false,
                    len: 4096,
                    ..
                }
            ),
            "{msg:?}"
        );
        let fd = fd.unwrap();
        assert!(crate::pool::sealed(&fd, 4096));
        assert!(Mapping::map(fd, 0, 4096, true).is_err(), "read-only");
        registry.deregister(&pool.descs()).unwrap();
        assert!(!served.revoke(key, Duration::from_millis(100)));
        assert!(matches!(recv(&b).unwrap(), Some((Msg::Drop { key: k }, None)) if k == key));
        assert!(recv(&b).unwrap().is_none(), "shut down");
        served.close();
    }

    #[test]
    fn frames_round_trip_and_junk_is_refused() {
        for m in [
            Msg::Ask { key: 7 },
            Msg::Give {
                key: 1,
                addr: 2,
                len: 3,
                writable: true,
            },
            Msg::Plain { key: u64::MAX },
            Msg::Drop { key: 9 },
            Msg::Dropped { key: 9 },
            Msg::AskGpu { key: 4 },
            Msg::GiveGpu {
                key: 4,
                len: 2 << 20,
            },
        ] {
            assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
        }
        let mut f = Msg::Ask { key: 1 }.encode();
        f[0] = 9;
        assert!(Msg::decode(&f).is_err());
        f[0] = 2;
        f[1] = 2;
        assert!(Msg::decode(&f).is_err());
    }
}
