//! A peer's requests to this agent's storage (FILE, BLK and OBJ regions),
//! on the TCP path: the agent reads and writes its files on the peer's
//! behalf through a bounce buffer (the one copy here: a file is not memory
//! the socket can land in), checking each segment first — region and key,
//! direct-I/O alignment, the file not shrunk under the region — and
//! records the files each request wrote, to sync them before the
//! acknowledgement of a durable request.
//!
//! Objects are written whole: a peer's WRITE to an object lands in an
//! assembly buffer here (within `Limits::max_object_assembly` over all
//! peers), and when its request commits with every byte from offset 0 to
//! its end in place, the object is PUT (multipart above the store's part
//! size) before the acknowledgement; a request that fails stores nothing.
//! A READ is a ranged GET into the bounce buffer, sent as it comes.

use std::os::unix::fs::FileExt;

use crate::storage::StorageFile;

use crate::engine::sock::{ProgressClock, iov, writev_all};
use crate::engine::target::{Conn, Session};
use crate::engine::wire::{Frame, status};
use crate::engine::{Inner, lock};
use crate::error::RejectReason;
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use crate::storage::obj::pool::{ObjBatch, ObjOp};
use rustix::fd::AsRawFd;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Most bytes of one segment read or written at a time (a multiple of every
/// direct-I/O block size).
const BOUNCE_MAX: usize = 1 << 20;

/// Alignment of the bounce buffer: enough for direct I/O on any device.
const BOUNCE_ALIGN: usize = 4096;

/// A connection's bounce buffer, allocated on its first storage segment.
#[derive(Default)]
pub(in crate::engine) struct Bounce(Vec<u8>);

impl Bounce {
    /// `len` (at most [`BOUNCE_MAX`]) bytes of it, aligned to
    /// [`BOUNCE_ALIGN`].
    fn get(&mut self, len: usize) -> &mut [u8] {
        if self.0.is_empty() {
            self.0 = vec![0; BOUNCE_MAX + BOUNCE_ALIGN];
        }
        let start = self.0.as_ptr().align_offset(BOUNCE_ALIGN);
        &mut self.0[start..start + len]
    }
}

/// The storage a session's requests wrote, by request, and whether each
/// asked for durability: synced when the request finishes.
#[derive(Default)]
pub(in crate::engine) struct StorageWrites {
    durable: bool,
    files: Vec<Arc<StorageFile>>,
    /// Objects being written, PUT when the request finishes well.
    objects: Vec<Assembly>,
}

/// An object a peer's request is writing, assembled here.
///
/// Drop order: the buffer, then its room in the agent's budget, then the
/// hold on the region.
struct Assembly {
    handle: u32,
    object: Arc<crate::storage::OpenObject>,
    /// The object's bytes from offset 0; as long as the furthest segment's
    /// end.
    bytes: Vec<u8>,
    /// Bytes landed (segments do not overlap in a well-formed request).
    landed: u64,
    /// Its share of `Inner::assembling`, given back when it drops.
    room: Room,
    _guard: RegionGuard,
}

/// Bytes counted in an agent-wide budget, given back when dropped.
struct Room {
    bytes: u64,
    total: Arc<AtomicU64>,
}

impl Room {
    /// Grows the room by `n` bytes, if the budget `max` allows.
    fn grow(&mut self, n: u64, max: u64) -> bool {
        let ok = self
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                t.checked_add(n).filter(|&t| t <= max)
            })
            .is_ok();
        if ok {
            self.bytes += n;
        }
        ok
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        self.total.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl Session {
    fn wrote(&self, req: u64, file: &Arc<StorageFile>) {
        let mut map = lock(&self.storage);
        let w = map.entry(req).or_default();
        if !w.files.iter().any(|f| f.handle == file.handle) {
            w.files.push(Arc::clone(file));
        }
    }

    /// Records that `req`'s commit asked for durability.
    pub(in crate::engine) fn durable(&self, req: u64) {
        lock(&self.storage).entry(req).or_default().durable = true;
    }

    /// Forgets the files finished request `req` wrote, syncing them first
    /// when it succeeded (`ok`) and asked for durability; PUTs the objects
    /// it wrote when it succeeded, waiting at most `put_within`.
    pub(in crate::engine) fn sync_storage(
        &self,
        req: u64,
        ok: bool,
        put_within: Duration,
    ) -> Result<(), RejectReason> {
        let Some(w) = lock(&self.storage).remove(&req) else {
            return Ok(());
        };
        if !ok {
            return Ok(());
        }
        for a in w.objects {
            put_object(&self.remote, a, put_within)?;
        }
        if !w.durable {
            return Ok(());
        }
        for f in &w.files {
            f.file().sync_data().map_err(|e| {
                tracing::warn!(handle = f.handle, path = %f.path.display(), error = %e, "fdatasync for a peer failed");
                RejectReason::storage_io(&e)
            })?;
        }
        Ok(())
    }
}

impl Inner {
    /// The object range `[addr, addr + len)` of `handle`, checked for a
    /// peer: admitted (held while the guard lives), and its open object.
    fn admit_object(
        &self,
        handle: u32,
        (addr, len): (u64, u64),
        key: u64,
    ) -> Result<(RegionGuard, Arc<crate::storage::OpenObject>), RejectReason> {
        let guard = self.registry.admit_object(handle, addr, len, key)?;
        let object = self
            .storage
            .object(&crate::memory::MemoryDesc::new(0, 0, handle))
            .map_err(|_| RejectReason::NotRegistered)?;
        Ok((guard, object))
    }

    /// Lands a `Write` frame's payload in the assembly of the object
    /// `handle` for request `req`: straight from the socket into place; the
    /// payload skipped when the segment is refused (not a registered
    /// object range, past the assembly budget).
    pub(in crate::engine) fn land_object_write(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        handle: u32,
        (addr, len): (u64, u64),
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        let refuse = |c: &mut Conn<'_, '_, '_>, reason: RejectReason| {
            tracing::debug!(remote = %c.session.remote, handle, addr, len, %reason, "refused object write");
            c.reader.discard(len, c.idle)?;
            Ok(Err(reason))
        };
        let (guard, object) = match self.admit_object(handle, (addr, len), key) {
            Ok(admitted) => admitted,
            Err(reason) => return refuse(c, reason),
        };
        let Some(end) = addr.checked_add(len) else {
            return refuse(c, RejectReason::Malformed);
        };
        let max = self.config.limits.max_object_assembly;
        let mut writes = lock(&c.session.storage);
        let w = writes.entry(req).or_default();
        let i = match w.objects.iter().position(|a| a.handle == handle) {
            Some(i) => i,
            None => {
                w.objects.push(Assembly {
                    handle,
                    object,
                    bytes: Vec::new(),
                    landed: 0,
                    room: Room {
                        bytes: 0,
                        total: Arc::clone(&self.assembling),
                    },
                    _guard: guard,
                });
                w.objects.len() - 1
            }
        };
        let a = &mut w.objects[i];
        let have = a.bytes.len() as u64;
        if end > have {
            if !a.room.grow(end - have, max) {
                drop(writes);
                return refuse(c, RejectReason::ObjectAssemblyFull);
            }
            a.bytes.resize(end as usize, 0);
        }
        // Read straight into place, holding the session's table of writes:
        // the other streams of the session wait for this segment only
        // when they land a storage segment of their own.
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(BOUNCE_MAX as u64);
            let at = (addr + done) as usize;
            c.reader
                .read_chunk(&mut a.bytes[at..at + n as usize], done + n < len, c.idle)?;
            done += n;
        }
        a.landed += len;
        Ok(Ok(()))
    }

    /// Answers a `ReadReq` of an object range: ranged GETs of at most the
    /// bounce buffer each, sent behind one `ReadData` header. A GET that
    /// fails after the header went out sends zeros for the rest (the
    /// frame's length is promised) and fails the segment.
    pub(in crate::engine) fn send_object_read(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        handle: u32,
        (addr, len): (u64, u64),
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        let io_timeout = self.config.io_timeout;
        let (guard, object) = match self.admit_object(handle, (addr, len), key) {
            Ok(a) => a,
            Err(reason) => return refuse_read(c, req, reason, io_timeout),
        };
        let outcome = send_through_bounce(c, req, len, io_timeout, |buf, done| {
            let deadline = Some(Instant::now() + io_timeout);
            object
                .store
                .inner
                .get_range(&object.key, addr + done, buf, deadline)
                .map_err(|e| {
                    tracing::warn!(handle, offset = addr + done, error = %e, "object GET for a peer failed");
                    RejectReason::ObjectStore
                })
        })?;
        drop(guard);
        Ok(outcome)
    }

    /// The storage region `[addr, addr + len)` of handle `device`, checked
    /// for a peer: admitted (held while the guard lives), aligned for
    /// direct I/O, inside the file as it is now (a `write` to a file
    /// opened to grow may reach past its end).
    fn admit_storage(
        &self,
        write: bool,
        mem_type: MemoryType,
        device: u32,
        (addr, len): (u64, u64),
        key: u64,
    ) -> Result<(RegionGuard, Arc<StorageFile>), RejectReason> {
        let guard = self
            .registry
            .admit_storage(mem_type, device, addr, len, key)?;
        // Registered regions keep their storage open.
        let file = self
            .storage
            .get(device)
            .ok_or(RejectReason::NotRegistered)?;
        let align = u64::from(file.align);
        if !addr.is_multiple_of(align) || !len.is_multiple_of(align) {
            return Err(RejectReason::Misaligned);
        }
        if !(write && file.grow) {
            let size = file.size().map_err(|e| RejectReason::storage_io(&e))?;
            if addr + len > size {
                return Err(RejectReason::PastEnd);
            }
        }
        Ok((guard, file))
    }

    /// Lands a `Write` frame's payload in storage: read from the socket a
    /// piece at a time and written at its offset; the rest of the payload
    /// skipped once a write fails or when the segment is refused.
    pub(in crate::engine) fn land_storage_write(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        (mem_type, device): (MemoryType, u32),
        (addr, len): (u64, u64),
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        let (guard, file) = match self.admit_storage(true, mem_type, device, (addr, len), key) {
            Ok(admitted) => admitted,
            Err(reason) => {
                tracing::debug!(remote = %c.session.remote, device, addr, len, %reason, "refused storage write");
                c.reader.discard(len, c.idle)?;
                return Ok(Err(reason));
            }
        };
        c.session.wrote(req, &file);
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(BOUNCE_MAX as u64);
            let buf = c.bounce.get(n as usize);
            c.reader.read_chunk(buf, done + n < len, c.idle)?;
            if let Err(e) = file.file().write_all_at(buf, addr + done) {
                tracing::warn!(remote = %c.session.remote, handle = device, offset = addr + done, error = %e, "storage write for a peer failed");
                c.reader.discard(len - done - n, c.idle)?;
                return Ok(Err(RejectReason::storage_io(&e)));
            }
            done += n;
        }
        drop(guard);
        Ok(Ok(()))
    }

    /// Answers a `ReadReq` from storage: the range read a piece at a time
    /// and sent behind one `ReadData` header. A read that fails after the
    /// header went out sends zeros for the rest (the frame's length is
    /// promised) and fails the segment.
    pub(in crate::engine) fn send_storage_read(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        (mem_type, device): (MemoryType, u32),
        (addr, len): (u64, u64),
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        let io_timeout = self.config.io_timeout;
        let (guard, file) = match self.admit_storage(false, mem_type, device, (addr, len), key) {
            Ok(admitted) => admitted,
            Err(reason) => return refuse_read(c, req, reason, io_timeout),
        };
        let outcome = send_through_bounce(c, req, len, io_timeout, |buf, done| {
            file.file().read_exact_at(buf, addr + done).map_err(|e| {
                tracing::warn!(handle = device, offset = addr + done, error = %e, "storage read for a peer failed");
                RejectReason::storage_io(&e)
            })
        })?;
        drop(guard);
        Ok(outcome)
    }
}

/// PUTs an assembled object whole, once every byte of it landed; waits
/// for the store within `within`.
fn put_object(remote: &str, a: Assembly, within: Duration) -> Result<(), RejectReason> {
    let Assembly {
        handle,
        object,
        bytes,
        landed,
        room,
        _guard,
    } = a;
    let len = bytes.len() as u64;
    if landed != len {
        tracing::debug!(%remote, handle, landed, len, "an object WRITE left holes");
        return Err(RejectReason::Malformed);
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    let buf = bytes.as_ptr() as u64;
    let key = Arc::clone(&object.key);
    let batch = ObjBatch {
        ops: vec![ObjOp {
            store: Arc::clone(&object.store.inner),
            key: Arc::clone(&object.key),
            write: true,
            buf,
            len,
            offset: 0,
            device: None,
        }],
        deadline: Some(Instant::now() + within),
        // The buffer, its room and the region's hold go when the batch has
        // reported, whoever still waits for it.
        done: Box::new(move |r| {
            drop((bytes, room, _guard));
            let _ = tx.send(r);
        }),
        stop: Box::new(|| false),
    };
    // SAFETY: the op's memory is the assembly's buffer, owned by the
    // batch's `done`, which runs only once no unit touches it any more.
    if let Err(e) = unsafe { crate::storage::obj::pool::submit(batch) } {
        tracing::warn!(%remote, handle, error = %e, "object PUT for a peer could not start");
        return Err(RejectReason::ObjectStore);
    }
    match rx.recv_timeout(within + Duration::from_secs(1)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            tracing::warn!(%remote, handle, %key, error = %e, "object PUT for a peer failed");
            Err(RejectReason::ObjectStore)
        }
        Err(_) => {
            tracing::warn!(%remote, handle, %key, "object PUT for a peer did not end in time");
            Err(RejectReason::ObjectStore)
        }
    }
}

/// Answers a `ReadReq` refused for `reason` (an empty `ReadData` with it).
fn refuse_read(
    c: &mut Conn<'_, '_, '_>,
    req: u64,
    reason: RejectReason,
    io_timeout: Duration,
) -> io::Result<Result<(), RejectReason>> {
    let refusal = Frame::ReadData {
        req,
        len: 0,
        status: reason.code(),
        checked: false,
    };
    c.send(&[refusal.encode()], io_timeout)?;
    Ok(Err(reason))
}

/// Sends `len` bytes behind one `ReadData` header, each piece of at most
/// the bounce buffer filled by `fill(piece, offset)` first. Once a fill
/// fails, the rest is sent as zeros (the frame's length is promised) and
/// the failure is the segment's outcome.
fn send_through_bounce(
    c: &mut Conn<'_, '_, '_>,
    req: u64,
    len: u64,
    io_timeout: Duration,
    mut fill: impl FnMut(&mut [u8], u64) -> Result<(), RejectReason>,
) -> io::Result<Result<(), RejectReason>> {
    let hdr = Frame::ReadData {
        req,
        len,
        status: status::OK,
        checked: false,
    }
    .encode();
    send_bytes(c.sock, &hdr, c.idle.clock, io_timeout)?;
    let mut outcome = Ok(());
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(BOUNCE_MAX as u64);
        let buf = c.bounce.get(n as usize);
        if outcome.is_ok()
            && let Err(reason) = fill(buf, done)
        {
            outcome = Err(reason);
        }
        if outcome.is_err() {
            buf.fill(0);
        }
        send_bytes(c.sock, buf, c.idle.clock, io_timeout)?;
        // Each piece is progress (a GET may take a while).
        c.idle.clock.touch();
        done += n;
    }
    Ok(outcome)
}

/// Sends `bytes` on the connection.
fn send_bytes(
    sock: &TcpStream,
    bytes: &[u8],
    clock: &ProgressClock,
    io_timeout: Duration,
) -> io::Result<()> {
    let mut iovs = [iov(bytes.as_ptr(), bytes.len())];
    // SAFETY: the iovec points into `bytes`, borrowed for the call.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs, clock, io_timeout) }
}
