//! The staging rings: pinned host buffers through which GPU memory goes
//! where a path cannot reach it (TCP, storage). One ring per thread and
//! device, made on first use: a non-blocking stream, `slots` page-aligned
//! pinned buffers of `chunk` bytes, and an event per buffer; the copy of
//! the next chunk runs while the current one is written or read. Small
//! pieces are packed: a buffer takes as many as fit, each its own copy
//! into its own part of it, so that a buffer's worth of copies is in flight
//! however small the pieces.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys as cu;

use super::GpuError;
use super::cuda::{Cuda, check, driver, new_stream};

/// One pinned host buffer of a [`Staging`] ring and the event that marks
/// its copies.
struct Slot {
    host: *mut u8,
    event: cu::CUevent,
    /// Whether copies using it were issued and not yet waited for.
    busy: bool,
    /// The ring's number of the last copy issued into or from it (see
    /// [`Staging::issued`]).
    seq: u64,
    /// Whether the event was recorded after that copy (it is recorded
    /// when first waited for or asked after, not after every copy).
    recorded: bool,
    /// Bytes of the buffer taken since it was last waited for and reused.
    fill: usize,
}

/// A pipelined staging ring of one thread for one device: pinned host
/// buffers (`cuMemHostAlloc`), a non-blocking stream and one event per
/// buffer. Moving device memory through a socket, the copies of the next
/// buffer run while the current one is on the wire.
///
/// Copies are numbered in issue order. Pieces take the buffers in turn,
/// each buffer filled from its start until the next piece does not fit
/// (a piece longer than what is left is cut there), then the next; a
/// buffer is waited for (all its copies) before it is filled again. The
/// copies run in order on the one stream, so a copy known done means
/// every earlier one is. A received segment's copies may be left in flight
/// ([`recv_deferred`](Self::recv_deferred)) and asked after later
/// ([`landed`](Self::landed)).
pub(crate) struct Staging {
    /// Tells this ring from one made after it (a [`Ticket`] names both).
    id: u64,
    device: u32,
    shape: super::StagingShape,
    stream: cu::CUstream,
    slots: Vec<Slot>,
    /// The buffer being filled.
    cur: usize,
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
/// device and id), the copy's number and its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    device: u32,
    ring: u64,
    /// Copies numbered below it are the segment's and those before.
    end: u64,
    /// The buffer of the segment's last copy.
    slot: usize,
}

/// The alignment of every part of a buffer that a chunk takes.
const PAGE: usize = 4096;

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
            cur: 0,
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
                recorded: false,
                fill: 0,
            });
        }
        Ok(s)
    }

    /// Room for up to `len` bytes (at most a buffer's, not 0): the rest of
    /// the buffer being filled (perhaps less than `len`: the caller cuts
    /// its chunk there), or, once that is full, the start of the next
    /// buffer, waited for first (all its copies done). `reusable`
    /// says whether a buffer may be taken again (the sender's buffers are
    /// not while a chunk in them is unsent); `None` when the next one may
    /// not.
    fn take(
        &mut self,
        len: usize,
        reusable: &dyn Fn(usize) -> bool,
    ) -> Result<Option<(usize, usize)>, GpuError> {
        debug_assert!(len > 0 && len <= self.shape.chunk);
        let cur = &self.slots[self.cur];
        if cur.fill > 0 && cur.fill < self.shape.chunk {
            return Ok(Some((self.cur, cur.fill)));
        }
        let next = if cur.fill == 0 {
            self.cur
        } else {
            (self.cur + 1) % self.slots.len()
        };
        if !reusable(next) {
            return Ok(None);
        }
        self.wait(next)?;
        self.cur = next;
        self.slots[next].fill = 0;
        Ok(Some((next, 0)))
    }

    /// Issues the copy of `len` bytes `src → dst` on the ring's stream
    /// into or from `slot`'s buffer at `off` (an answer of [`take`]), and
    /// takes those bytes of it.
    ///
    /// [`take`]: Self::take
    fn issue(
        &mut self,
        slot: usize,
        off: usize,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        debug_assert_eq!(slot, self.cur);
        debug_assert_eq!(off, self.slots[slot].fill);
        // SAFETY: the caller (send/recv) passes its part of a slot's pinned
        // buffer and a device range it holds; the copy is waited for
        // (`wait`) before the buffer is reused, and before the range is let
        // go.
        check("cuMemcpyAsync", unsafe {
            cu::cuMemcpyAsync(dst, src, len, self.stream)
        })?;
        let s = &mut self.slots[slot];
        s.busy = true;
        s.recorded = false;
        s.seq = self.issued;
        // The next part starts page-aligned, as each buffer does: direct
        // I/O (storage) reads and writes whole pages at aligned addresses.
        s.fill = (off + len).next_multiple_of(PAGE).min(self.shape.chunk);
        self.issued += 1;
        Ok(())
    }

    /// Records `slot`'s event after its last copy, unless it already is.
    fn record(&mut self, slot: usize) -> Result<(), GpuError> {
        let s = &mut self.slots[slot];
        if !s.busy || s.recorded {
            return Ok(());
        }
        // SAFETY: an event and stream of this ring.
        let r = check("cuEventRecord", unsafe {
            cu::cuEventRecord(s.event, self.stream)
        });
        match r {
            Ok(()) => {
                s.recorded = true;
                Ok(())
            }
            Err(e) => {
                // No event marks the copies: wait for them here, since the
                // caller lets the buffer and the ranges go on failure.
                // SAFETY: this ring's stream.
                let synced = check("cuStreamSynchronize", unsafe {
                    cu::cuStreamSynchronize(self.stream)
                });
                self.waited(slot, synced.and(Err(e)))
            }
        }
    }

    /// Records the outcome of a wait for `slot`'s copies.
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

    /// Waits for the copies that used `slot`; a ring that saw a copy fail
    /// answers with that failure.
    fn wait(&mut self, slot: usize) -> Result<(), GpuError> {
        if let Some(e) = &self.fault {
            return Err(e.clone());
        }
        self.sync(slot)
    }

    /// Waits for the copies that used `slot`, if any is outstanding.
    fn sync(&mut self, slot: usize) -> Result<(), GpuError> {
        if !self.slots[slot].busy {
            return Ok(());
        }
        self.record(slot)?;
        if !self.slots[slot].busy {
            return Ok(());
        }
        // SAFETY: an event of this ring, recorded after the slot's copies.
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
        // Its last copy is not done, so that copy's buffer has not been
        // taken again (a buffer is waited for first): it still holds it,
        // perhaps with later copies (then waited for too).
        let slot = ticket.slot;
        debug_assert!(self.slots[slot].busy && self.slots[slot].seq + 1 >= ticket.end);
        if block {
            self.wait(slot)?;
            return Ok(true);
        }
        self.record(slot)?;
        if !self.slots[slot].busy {
            return Ok(true);
        }
        // SAFETY: an event of this ring, recorded after the slot's copies.
        let r = unsafe { cu::cuEventQuery(self.slots[slot].event) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.waited(slot, check("cuEventQuery", r))?;
        Ok(true)
    }

    /// Sends device memory pieces `(address, length)` through `write`, in
    /// order, through the pinned buffers: the copies run ahead across
    /// pieces, packed into the buffers (a buffer holds many small pieces,
    /// or a part of a large one), so many small pieces overlap their copies
    /// with the sends as one large one does. `write(i, bytes)` gets each
    /// chunk of piece `i`. `stop` is asked before each piece's first chunk:
    /// once it says so, no more pieces are sent. Returns the pieces sent
    /// (all of them unless stopped); every copy issued has completed by
    /// then.
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
        // Chunks issued and not yet sent, oldest first: (buffer, offset in
        // it, piece, offset in the piece, length).
        let mut queue: VecDeque<(usize, usize, usize, u64, usize)> = VecDeque::new();
        let mut issue = (0usize, 0u64);
        let (mut sent, mut bytes) = (0u64, 0u64);
        let r = (|| -> Result<usize, super::StageError> {
            loop {
                while issue.0 < pieces.len() {
                    let (addr, len) = pieces[issue.0];
                    let want = (len - issue.1).min(chunk) as usize;
                    let unsent = |slot: usize| queue.iter().all(|q| q.0 != slot);
                    let Some((slot, off)) = self.take(want, &unsent)? else {
                        break;
                    };
                    let n = want.min(self.shape.chunk - off);
                    let host = self.slots[slot].host as u64 + off as u64;
                    self.issue(slot, off, host, addr + issue.1, n)?;
                    queue.push_back((slot, off, issue.0, issue.1, n));
                    issue.1 += n as u64;
                    if issue.1 >= len {
                        issue = (issue.0 + 1, 0);
                    }
                }
                let Some(&(slot, off, i, at, n)) = queue.front() else {
                    return Ok(pieces.len());
                };
                if at == 0 && stop() {
                    return Ok(i);
                }
                self.wait(slot)?;
                // SAFETY: the slot's copies have completed (waited above);
                // these `n` bytes of its buffer were written by one of them.
                let b = unsafe { std::slice::from_raw_parts(self.slots[slot].host.add(off), n) };
                write(i, b).map_err(super::StageError::Io)?;
                queue.pop_front();
                sent += 1;
                bytes += n as u64;
            }
        })();
        let drained = self.drain();
        let done = r?;
        drained?;
        super::count_staged(sent, bytes);
        Ok(done)
    }

    /// Receives `len` bytes through `read` into device memory at `dst`,
    /// chunk by chunk through the pinned buffers (packed: a small segment
    /// takes the next part of the buffer being filled), each chunk's copy
    /// issued once it is read, and returns once the last chunk's copy is
    /// issued: the ticket tells when they have all landed
    /// ([`landed`](Self::landed)). Chunks of later receives are read while
    /// these copies run.
    ///
    /// # Safety
    /// `[dst, dst + len)` is device memory of this ring's device, allocated
    /// and writable until the ticket is known landed (or the ring drained);
    /// `len > 0`.
    pub(crate) unsafe fn recv_deferred(
        &mut self,
        dst: u64,
        len: u64,
        read: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>,
    ) -> Result<Ticket, super::StageError> {
        driver()?.bind(self.device)?;
        let chunk = self.shape.chunk as u64;
        let (mut at, mut chunks) = (0u64, 0u64);
        while at < len {
            let want = (len - at).min(chunk) as usize;
            let (slot, off) = self
                .take(want, &|_| true)?
                .expect("every buffer may be taken");
            let n = want.min(self.shape.chunk - off);
            // SAFETY: no copy uses these bytes of the buffer any more (the
            // buffer was waited for before it was filled again, and this
            // part was not taken since); it has `off + n <= chunk` bytes.
            let buf = unsafe { std::slice::from_raw_parts_mut(self.slots[slot].host.add(off), n) };
            read(buf).map_err(super::StageError::Io)?;
            let host = self.slots[slot].host as u64 + off as u64;
            self.issue(slot, off, dst + at, host, n)?;
            at += n as u64;
            chunks += 1;
        }
        super::count_staged(chunks, len);
        Ok(Ticket {
            device: self.device,
            ring: self.id,
            end: self.issued,
            slot: self.cur,
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
