//! A peer's requests to this agent's storage (FILE and BLK regions), on
//! the TCP path: the agent reads and writes its files on the peer's behalf
//! through a bounce buffer (the one copy here: a file is not memory the
//! socket can land in), checking each segment first — region and key,
//! direct-I/O alignment, the file not shrunk under the region — and
//! records the files each request wrote, to sync them before the
//! acknowledgement of a durable request.

use std::os::unix::fs::FileExt;

use crate::storage::StorageFile;

use crate::engine::sock::{ProgressClock, iov, writev_all};
use crate::engine::target::{Conn, Session};
use crate::engine::wire::{Frame, status};
use crate::engine::{Inner, lock};
use crate::error::RejectReason;
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use rustix::fd::AsRawFd;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

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
    /// when it succeeded (`ok`) and asked for durability.
    pub(in crate::engine) fn sync_storage(&self, req: u64, ok: bool) -> Result<(), RejectReason> {
        let Some(w) = lock(&self.storage).remove(&req) else {
            return Ok(());
        };
        if !ok || !w.durable {
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
            Err(reason) => {
                let refusal = Frame::ReadData {
                    req,
                    len: 0,
                    status: reason.code(),
                    checked: false,
                };
                c.send(&[refusal.encode()], io_timeout)?;
                return Ok(Err(reason));
            }
        };
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
                && let Err(e) = file.file().read_exact_at(buf, addr + done)
            {
                tracing::warn!(remote = %c.session.remote, handle = device, offset = addr + done, error = %e, "storage read for a peer failed");
                outcome = Err(RejectReason::storage_io(&e));
            }
            if outcome.is_err() {
                buf.fill(0);
            }
            send_bytes(c.sock, buf, c.idle.clock, io_timeout)?;
            done += n;
        }
        drop(guard);
        Ok(outcome)
    }
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
