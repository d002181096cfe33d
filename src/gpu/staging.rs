//! The staging rings: pinned host buffers through which GPU memory goes
//! where a path cannot reach it (TCP, storage). One ring per thread and
//! device, made on first use: a non-blocking stream, `slots` page-aligned
//! pinned buffers of `chunk` bytes, and an event per buffer; the copy of
//! the next chunk runs while the current one is written or read.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// The ring's number of that copy (see [`Staging::issued`]).
    seq: u64,
}

/// A pipelined staging ring of one thread for one device: pinned host
/// buffers (`cuMemHostAlloc`), a non-blocking stream and one event per
/// buffer. Moving device memory through a socket, the copy of chunk
/// `k + 1` runs while chunk `k` is on the wire.
///
/// Copies are numbered in issue order and take the buffers round-robin
/// (copy `q` uses slot `q % slots`), each buffer waited for before it is
/// used again; they run in order on the one stream, so a copy known done
/// means every earlier one is. A received segment's copies may be left in
/// flight ([`recv_deferred`](Self::recv_deferred)) and asked after later
/// ([`landed`](Self::landed)).
pub(crate) struct Staging {
    /// Tells this ring from one made after it (a [`Ticket`] names both).
    id: u64,
    device: u32,
    shape: super::StagingShape,
    stream: cu::CUstream,
    slots: Vec<Slot>,
    /// Copies issued so far.
    issued: u64,
    /// Every copy numbered below this one has completed.
    done: u64,
    /// The first failure seen waiting for a copy. The stream's later
    /// copies cannot be trusted after it (the driver's asynchronous errors
    /// are sticky): the ring answers every later wait with it.
    fault: Option<GpuError>,
}

/// Where a deferred receive's last copy stands in its ring: the ring (by
/// device and id) and the copy's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    device: u32,
    ring: u64,
    /// Copies numbered below it are the segment's and those before.
    end: u64,
}

static RING_IDS: AtomicU64 = AtomicU64::new(0);

impl Staging {
    fn new(cuda: &Cuda, device: u32, shape: super::StagingShape) -> Result<Self, GpuError> {
        cuda.bind(device)?;
        let stream = new_stream()?;
        // From here on `Drop` frees what was made.
        let mut s = Staging {
            id: RING_IDS.fetch_add(1, Ordering::Relaxed),
            device,
            shape,
            stream,
            slots: Vec::with_capacity(shape.slots),
            issued: 0,
            done: 0,
            fault: None,
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
                seq: 0,
            });
        }
        Ok(s)
    }

    /// The slot the next copy takes, waited for (its last copy done).
    fn next_slot(&mut self) -> Result<usize, GpuError> {
        let slot = (self.issued % self.slots.len() as u64) as usize;
        self.wait(slot)?;
        Ok(slot)
    }

    /// Issues the copy of `len` bytes `src → dst` on the ring's stream and
    /// records `slot`'s event after it; `slot` is [`next_slot`]'s answer.
    ///
    /// [`next_slot`]: Self::next_slot
    fn issue(&mut self, slot: usize, dst: u64, src: u64, len: usize) -> Result<(), GpuError> {
        debug_assert!(!self.slots[slot].busy);
        debug_assert_eq!(slot as u64, self.issued % self.slots.len() as u64);
        // SAFETY: the caller (send/recv) passes a slot's pinned buffer and a
        // device range it holds; the copy is waited for (`wait`) before the
        // buffer is reused, and before the range is let go.
        check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, len, self.stream)
        })?;
        // SAFETY: an event and stream of this ring.
        let recorded = check("cuEventRecord", unsafe {
            cu::cuEventRecord(self.slots[slot].event, self.stream)
        });
        if let Err(e) = recorded {
            // No event marks the copy: wait for it here, since the caller
            // lets the buffer and the range go on failure.
            // SAFETY: this ring's stream.
            unsafe { cu::cuStreamSynchronize(self.stream) };
            return Err(e);
        }
        let s = &mut self.slots[slot];
        s.busy = true;
        s.seq = self.issued;
        self.issued += 1;
        Ok(())
    }

    /// Records the outcome of a wait for `slot`'s copy.
    fn waited(&mut self, slot: usize, r: Result<(), GpuError>) -> Result<(), GpuError> {
        let s = &mut self.slots[slot];
        s.busy = false;
        match r {
            Ok(()) => {
                self.done = self.done.max(s.seq + 1);
                Ok(())
            }
            Err(e) => Err(self.fault.get_or_insert(e).clone()),
        }
    }

    /// Waits for the last copy that used `slot`; a ring that saw a copy
    /// fail answers with that failure.
    fn wait(&mut self, slot: usize) -> Result<(), GpuError> {
        if let Some(e) = &self.fault {
            return Err(e.clone());
        }
        self.sync(slot)
    }

    /// Waits for the last copy that used `slot`, if any is outstanding.
    fn sync(&mut self, slot: usize) -> Result<(), GpuError> {
        if !self.slots[slot].busy {
            return Ok(());
        }
        // SAFETY: an event of this ring, recorded.
        let r = check("cuEventSynchronize", unsafe {
            cu::cuEventSynchronize(self.slots[slot].event)
        });
        self.waited(slot, r)
    }

    /// Waits for every copy issued. The buffers are free afterwards even
    /// when a copy failed (the first failure is returned).
    fn drain(&mut self) -> Result<(), GpuError> {
        let mut first = Ok(());
        for k in 0..self.slots.len() {
            let r = self.sync(k);
            if first.is_ok() {
                first = r;
            }
        }
        first?;
        match &self.fault {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Whether the copies up to `ticket`'s have completed: asked of the
    /// driver without blocking, or waited for when `block`.
    fn landed(&mut self, ticket: Ticket, block: bool) -> Result<bool, GpuError> {
        debug_assert_eq!((ticket.device, ticket.ring), (self.device, self.id));
        if ticket.end <= self.done {
            return Ok(true);
        }
        if let Some(e) = &self.fault {
            return Err(e.clone());
        }
        // Its last copy is not done, so that copy's slot has not been
        // taken again (a slot is waited for first): it still holds it.
        let last = ticket.end - 1;
        let slot = (last % self.slots.len() as u64) as usize;
        debug_assert!(self.slots[slot].busy && self.slots[slot].seq == last);
        if block {
            self.wait(slot)?;
            return Ok(true);
        }
        // SAFETY: an event of this ring, recorded.
        let r = unsafe { cu::cuEventQuery(self.slots[slot].event) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.waited(slot, check("cuEventQuery", r))?;
        Ok(true)
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
        let base = self.issued;
        let (mut issued, mut sent, mut bytes) = (0u64, 0u64, 0u64);
        let r = (|| -> Result<usize, super::StageError> {
            while send.0 < pieces.len() {
                if send.1 == 0 && stop() {
                    return Ok(send.0);
                }
                while issue.0 < pieces.len() && issued - sent < n {
                    let slot = self.next_slot()?;
                    let host = self.slots[slot].host as u64;
                    let len = piece(issue) as usize;
                    self.issue(slot, host, pieces[issue.0].0 + issue.1, len)?;
                    issue = next(issue);
                    issued += 1;
                }
                let slot = ((base + sent) % n) as usize;
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
    /// chunk by chunk through the pinned buffers (the copy of chunk `k`
    /// runs while chunk `k + 1` is read), and returns once the last chunk's
    /// copy is issued: the ticket tells when they have all landed
    /// ([`landed`](Self::landed)). Chunks of later receives are read while
    /// these copies run.
    ///
    /// # Safety
    /// `[dst, dst + len)` is device memory of this ring's device, allocated
    /// and writable until the ticket is known landed (or the ring drained).
    pub(crate) unsafe fn recv_deferred(
        &mut self,
        dst: u64,
        len: u64,
        read: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>,
    ) -> Result<Ticket, super::StageError> {
        driver()?.bind(self.device)?;
        let chunk = self.shape.chunk as u64;
        let chunks = len.div_ceil(chunk);
        for k in 0..chunks {
            let piece = (chunk.min(len - k * chunk)) as usize;
            let slot = self.next_slot()?;
            // SAFETY: no copy reads the slot's buffer any more (waited for
            // by `next_slot`); it has `chunk >= piece` bytes.
            let buf = unsafe { std::slice::from_raw_parts_mut(self.slots[slot].host, piece) };
            read(buf).map_err(super::StageError::Io)?;
            let host = self.slots[slot].host as u64;
            self.issue(slot, dst + k * chunk, host, piece)?;
        }
        super::count_staged(chunks, len);
        Ok(Ticket {
            device: self.device,
            ring: self.id,
            end: self.issued,
        })
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

/// A ring retired after a copy through it failed: what its copies' tickets
/// are told afterwards.
struct Retired {
    device: u32,
    id: u64,
    /// Every copy numbered below this one completed.
    done: u64,
    fault: GpuError,
}

/// A thread's staging rings.
struct Rings {
    /// One per device and shape used.
    live: Vec<Staging>,
    /// Every ring retired (a few words each; a copy fails rarely, and
    /// usually ends the context with it).
    retired: Vec<Retired>,
}

thread_local! {
    /// The calling thread's staging rings.
    static STAGING: RefCell<Rings> = const {
        RefCell::new(Rings {
            live: Vec::new(),
            retired: Vec::new(),
        })
    };
}

/// Runs `f` with the calling thread's staging ring for `device` in `shape`
/// (made on first use). A ring lives as long as its thread unless a copy
/// through it fails: it is then retired (drained and freed) when next
/// asked for, and a new one made; the tickets of its copies are answered
/// from what it knew.
pub(crate) fn with_staging<R>(
    device: u32,
    shape: super::StagingShape,
    f: impl FnOnce(&mut Staging) -> R,
) -> Result<R, GpuError> {
    let cuda = driver()?;
    STAGING.with(|s| {
        let rings = &mut *s.borrow_mut();
        let mut found = rings
            .live
            .iter()
            .position(|r| r.device == device && r.shape == shape);
        if let Some(i) = found
            && rings.live[i].fault.is_some()
        {
            let mut old = rings.live.swap_remove(i);
            let _ = old.drain();
            rings.retired.push(Retired {
                device,
                id: old.id,
                done: old.done,
                fault: old.fault.take().expect("looked at above"),
            });
            found = None;
        }
        let i = match found {
            Some(i) => i,
            None => {
                rings.live.push(Staging::new(cuda, device, shape)?);
                rings.live.len() - 1
            }
        };
        Ok(f(&mut rings.live[i]))
    })
}

/// Receives `len` bytes through `read` into device memory at `dst` on
/// `device` through the calling thread's ring ([`Staging::recv_deferred`]):
/// returns once the copies are issued. On failure every copy of the ring
/// has completed when it returns.
///
/// # Safety
/// As [`Staging::recv_deferred`].
pub(crate) unsafe fn recv_deferred(
    device: u32,
    shape: super::StagingShape,
    dst: u64,
    len: u64,
    read: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>,
) -> Result<Ticket, super::StageError> {
    with_staging(device, shape, |s| {
        // SAFETY: forwarded contract.
        let r = unsafe { s.recv_deferred(dst, len, read) };
        if r.is_err() {
            // The copies issued read buffers and write memory that the
            // caller lets go on failure.
            let _ = s.drain();
        }
        r
    })?
}

/// Whether the copies up to `ticket`'s have completed ([`Staging::landed`]),
/// in the calling thread's ring that issued them, or as that ring knew
/// when it was retired. When the thread's rings are gone (its exit), they
/// were dropped, which waits for every copy.
pub(crate) fn landed(ticket: Ticket, block: bool) -> Result<bool, GpuError> {
    STAGING
        .try_with(|s| {
            let rings = &mut *s.borrow_mut();
            let is = |device, id| device == ticket.device && id == ticket.ring;
            if let Some(r) = rings.live.iter_mut().find(|r| is(r.device, r.id)) {
                return r.landed(ticket, block);
            }
            let r = rings.retired.iter().find(|r| is(r.device, r.id));
            let r = r.expect("a ticket's ring is live or retired");
            if ticket.end > r.done {
                Err(r.fault.clone())
            } else {
                Ok(true)
            }
        })
        .unwrap_or(Ok(true))
}
