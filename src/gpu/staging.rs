//! The staging rings: pinned host buffers through which GPU memory goes
//! where a path cannot reach it (TCP, storage). One ring per thread and
//! device, made on first use: a non-blocking stream, `slots` page-aligned
//! pinned buffers of `chunk` bytes, and an event per buffer; the copy of
//! the next chunk runs while the current one is written or read.

use std::cell::RefCell;
use std::ffi::c_void;

use cudarc::driver::sys as cu;

use super::GpuError;
use super::cuda::{Cuda, check, driver, new_stream};

/// One pinned host buffer of a [`Staging`] ring and the event recorded
/// after the last copy that used it.
struct Slot {
    host: *mut u8,
    event: cu::CUevent,
    /// Whether a copy using it was issued and not yet waited for.
    busy: bool,
}

/// A pipelined staging ring of one thread for one device: pinned host
/// buffers (`cuMemHostAlloc`), a non-blocking stream and one event per
/// buffer. Moving device memory through a socket, the copy of chunk
/// `k + 1` runs while chunk `k` is on the wire.
pub(crate) struct Staging {
    device: u32,
    shape: super::StagingShape,
    stream: cu::CUstream,
    slots: Vec<Slot>,
}

impl Staging {
    fn new(cuda: &Cuda, device: u32, shape: super::StagingShape) -> Result<Self, GpuError> {
        cuda.bind(device)?;
        let stream = new_stream()?;
        // From here on `Drop` frees what was made.
        let mut s = Staging {
            device,
            shape,
            stream,
            slots: Vec::with_capacity(shape.slots),
        };
        for _ in 0..shape.slots {
            let mut host: *mut c_void = std::ptr::null_mut();
            // SAFETY: writes one pointer to `chunk` bytes of pinned memory.
            check("cuMemHostAlloc", unsafe {
                cu::cuMemHostAlloc(&mut host, shape.chunk, cu::CU_MEMHOSTALLOC_PORTABLE)
            })?;
            let mut event: cu::CUevent = std::ptr::null_mut();
            // SAFETY: writes one event handle.
            let r = check("cuEventCreate", unsafe {
                cu::cuEventCreate(
                    &mut event,
                    cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            });
            if let Err(e) = r {
                // SAFETY: allocated just above, not yet in a slot.
                unsafe { cu::cuMemFreeHost(host) };
                return Err(e);
            }
            s.slots.push(Slot {
                host: host.cast(),
                event,
                busy: false,
            });
        }
        Ok(s)
    }

    /// Issues the copy of `len` bytes `src → dst` on the ring's stream and
    /// records `slot`'s event after it.
    fn issue(&mut self, slot: usize, dst: u64, src: u64, len: usize) -> Result<(), GpuError> {
        // SAFETY: the caller (send/recv) passes a slot's pinned buffer and a
        // device range it holds; the copy is waited for (`wait`) before the
        // buffer is reused or the call returns.
        check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, len, self.stream)
        })?;
        // SAFETY: an event and stream of this ring.
        check("cuEventRecord", unsafe {
            cu::cuEventRecord(self.slots[slot].event, self.stream)
        })?;
        self.slots[slot].busy = true;
        Ok(())
    }

    /// Waits for the last copy that used `slot`.
    fn wait(&mut self, slot: usize) -> Result<(), GpuError> {
        if !self.slots[slot].busy {
            return Ok(());
        }
        self.slots[slot].busy = false;
        // SAFETY: an event of this ring, recorded.
        check("cuEventSynchronize", unsafe {
            cu::cuEventSynchronize(self.slots[slot].event)
        })
    }

    /// Waits for every copy issued.
    fn drain(&mut self) -> Result<(), GpuError> {
        let mut first = Ok(());
        for k in 0..self.slots.len() {
            let r = self.wait(k);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Sends `len` bytes of device memory at `src` through `write`, chunk by
    /// chunk, each copied to a pinned buffer first (the next copies issued
    /// before a chunk is written).
    ///
    /// # Safety
    /// `[src, src + len)` is device memory of this ring's device, allocated
    /// for the whole call.
    pub(crate) unsafe fn send(
        &mut self,
        src: u64,
        len: u64,
        write: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<(), super::StageError> {
        if len == 0 {
            return write(&[]).map_err(super::StageError::Io);
        }
        // SAFETY: forwarded contract.
        unsafe { self.send_pieces(&[(src, len)], &|| false, &mut |_, b| write(b)) }?;
        Ok(())
    }

    /// Sends device memory pieces `(address, length)` through `write`, in
    /// order, chunk by chunk through the pinned buffers: the copies run
    /// ahead across pieces (chunk `k + slots - 1` may belong to a later
    /// piece), so many small pieces overlap their copies with the sends as
    /// one large one does. `write(i, bytes)` gets each chunk of piece `i`.
    /// `stop` is asked before each piece's first chunk: once it says so, no
    /// more pieces are sent. Returns the pieces sent (all of them unless
    /// stopped); every copy issued has completed by then.
    ///
    /// # Safety
    /// Each piece is device memory of this ring's device, not empty,
    /// allocated for the whole call.
    pub(crate) unsafe fn send_pieces(
        &mut self,
        pieces: &[(u64, u64)],
        stop: &dyn Fn() -> bool,
        write: &mut dyn FnMut(usize, &[u8]) -> std::io::Result<()>,
    ) -> Result<usize, super::StageError> {
        driver()?.bind(self.device)?;
        let chunk = self.shape.chunk as u64;
        let n = self.slots.len() as u64;
        // A position: (piece, offset in it); the chunk there, and the next.
        let piece = |(i, off): (usize, u64)| (pieces[i].1 - off).min(chunk);
        let next = |(i, off): (usize, u64)| {
            let end = off + piece((i, off));
            if end >= pieces[i].1 {
                (i + 1, 0)
            } else {
                (i, end)
            }
        };
        let (mut issue, mut send) = ((0usize, 0u64), (0usize, 0u64));
        let (mut issued, mut sent, mut bytes) = (0u64, 0u64, 0u64);
        let r = (|| -> Result<usize, super::StageError> {
            while send.0 < pieces.len() {
                if send.1 == 0 && stop() {
                    return Ok(send.0);
                }
                while issue.0 < pieces.len() && issued - sent < n {
                    let slot = (issued % n) as usize;
                    let host = self.slots[slot].host as u64;
                    let len = piece(issue) as usize;
                    self.issue(slot, host, pieces[issue.0].0 + issue.1, len)?;
                    issue = next(issue);
                    issued += 1;
                }
                let slot = (sent % n) as usize;
                self.wait(slot)?;
                let len = piece(send) as usize;
                // SAFETY: the slot's copy has completed (waited above); its
                // buffer holds `len` initialised bytes.
                let b = unsafe { std::slice::from_raw_parts(self.slots[slot].host, len) };
                write(send.0, b).map_err(super::StageError::Io)?;
                send = next(send);
                sent += 1;
                bytes += len as u64;
            }
            Ok(pieces.len())
        })();
        let drained = self.drain();
        let done = r?;
        drained?;
        super::count_staged(sent, bytes);
        Ok(done)
    }

    /// Receives `len` bytes through `read` into device memory at `dst`,
    /// chunk by chunk through the pinned buffers (the copy of chunk `k` up
    /// runs while chunk `k + 1` is read); returns once all have landed.
    ///
    /// # Safety
    /// `[dst, dst + len)` is device memory of this ring's device, allocated
    /// and writable for the whole call.
    pub(crate) unsafe fn recv(
        &mut self,
        dst: u64,
        len: u64,
        read: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>,
    ) -> Result<(), super::StageError> {
        driver()?.bind(self.device)?;
        let chunk = self.shape.chunk as u64;
        let n = self.slots.len() as u64;
        let chunks = len.div_ceil(chunk);
        let r = (|| -> Result<(), super::StageError> {
            for k in 0..chunks {
                let slot = (k % n) as usize;
                let piece = (chunk.min(len - k * chunk)) as usize;
                self.wait(slot)?;
                // SAFETY: no copy reads the slot's buffer any more (waited
                // above); it has `chunk >= piece` bytes.
                let buf = unsafe { std::slice::from_raw_parts_mut(self.slots[slot].host, piece) };
                read(buf).map_err(super::StageError::Io)?;
                let host = self.slots[slot].host as u64;
                self.issue(slot, dst + k * chunk, host, piece)?;
            }
            Ok(())
        })();
        let drained = self.drain();
        r?;
        drained?;
        super::count_staged(chunks, len);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.drain();
        for s in &self.slots {
            // SAFETY: made in `new`, no copy in flight (drained), freed once.
            unsafe {
                cu::cuEventDestroy_v2(s.event);
                cu::cuMemFreeHost(s.host.cast());
            }
        }
        // SAFETY: made in `new`, idle, destroyed once.
        unsafe { cu::cuStreamDestroy_v2(self.stream) };
    }
}

thread_local! {
    /// The calling thread's staging rings, one per device used.
    static STAGING: RefCell<Vec<Staging>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with the calling thread's staging ring for `device` (made, or
/// made again in another shape, on first use).
pub(crate) fn with_staging<R>(
    device: u32,
    shape: super::StagingShape,
    f: impl FnOnce(&mut Staging) -> R,
) -> Result<R, GpuError> {
    let cuda = driver()?;
    STAGING.with(|s| {
        let mut rings = s.borrow_mut();
        let i = match rings.iter().position(|r| r.device == device) {
            Some(i) if rings[i].shape == shape => i,
            found => {
                if let Some(i) = found {
                    rings.swap_remove(i);
                }
                rings.push(Staging::new(cuda, device, shape)?);
                rings.len() - 1
            }
        };
        Ok(f(&mut rings[i]))
    })
}
