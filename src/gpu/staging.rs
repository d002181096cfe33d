//! The staging rings: pinned host buffers through which GPU memory goes
//! where a path cannot reach it (TCP, storage). One ring per thread and
//! device, made on first use: a non-blocking stream, `slots` page-aligned
//! pinned buffers of `chunk` bytes, and an event per buffer; the copy of
//! the next chunk runs while the current one is written or read. Small
//! pieces are packed: a buffer takes as many as fit, each into its own
//! page-aligned part of it. The copies of a buffer's parts are gathered in
//! a table and issued together, as one launch of the piece-copy kernel
//! (which reads and writes pinned host memory directly), where the driver
//! would charge microseconds per `cuMemcpyAsync`; without the kernel, one
//! `cuMemcpyAsync` each.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys as cu;

use super::GpuError;
use super::cuda::{
    Cuda, KERNEL_ENTRY_MAX, check, driver, for_each_entry, launch_pieces, new_stream,
};

/// One pinned host buffer of a [`Staging`] ring, its table of copies, and
/// the event that marks them.
struct Slot {
    host: *mut u8,
    /// The copies into or from the buffer since it was last reused:
    /// `(dst, src, len)`, three u64 each, in pinned host memory (the
    /// kernel reads it there); room for one per page of the buffer.
    table: *mut u64,
    /// Entries of `table` written, and of those the ones issued.
    entries: usize,
    launched: usize,
    event: cu::CUevent,
    /// Whether copies using it were issued (or are gathered) and not yet
    /// waited for.
    busy: bool,
    /// The ring's number of the last copy into or from it (see
    /// [`Staging::issued`]).
    seq: u64,
    /// The event was last recorded when the copies numbered below this
    /// had been issued (it marks them all); `None`: not since the buffer's
    /// last reuse.
    mark: Option<u64>,
    /// Bytes of the buffer taken since it was last waited for and reused.
    fill: usize,
}

/// A pipelined staging ring of one thread for one device: pinned host
/// buffers (`cuMemHostAlloc`), a non-blocking stream and one event per
/// buffer. Moving device memory through a socket, the copies of the next
/// buffer run while the current one is on the wire.
///
/// Copies are numbered in the order they are gathered. Pieces take the
/// buffers in turn, each buffer filled from its start (a piece longer than
/// what is left is cut there), then the next; a buffer is waited for (all
/// its copies) before it is filled again. Only the buffer being filled has
/// copies gathered and not yet issued: they are issued when it is left for
/// the next, when one of its copies is waited for, and on
/// [`flush`](Self::flush). The copies run in order on the one stream, so a
/// copy known done means every earlier one is. A received segment's copies
/// may be left gathered or in flight ([`recv_deferred`](Self::recv_deferred))
/// and asked after later ([`landed`](Self::landed)).
pub(crate) struct Staging {
    /// Tells this ring from one made after it (a [`Ticket`] names both).
    id: u64,
    device: u32,
    shape: super::StagingShape,
    stream: cu::CUstream,
    /// The piece-copy kernel, or `None`: one `cuMemcpyAsync` per copy.
    kernel: Option<cu::CUfunction>,
    slots: Vec<Slot>,
    /// The buffer being filled.
    cur: usize,
    /// Copies gathered so far.
    issued: u64,
    /// Copies numbered below this one have been issued to the driver.
    launched: u64,
    /// Every copy numbered below this one has completed.
    done: u64,
    /// The first failure seen issuing or waiting for a copy. The stream's
    /// later copies cannot be trusted after it (the driver's asynchronous
    /// errors are sticky): the ring answers every later wait with it.
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
            kernel: cuda.kernel_for(device),
            slots: Vec::with_capacity(shape.slots),
            cur: 0,
            issued: 0,
            launched: 0,
            done: 0,
            fault: None,
        };
        let rows = shape.chunk.div_ceil(PAGE);
        for _ in 0..shape.slots {
            let mut host: *mut c_void = std::ptr::null_mut();
            // SAFETY: writes one pointer to `chunk` bytes of pinned memory.
            check("cuMemHostAlloc", unsafe {
                cu::cuMemHostAlloc(&mut host, shape.chunk, cu::CU_MEMHOSTALLOC_PORTABLE)
            })?;
            let mut table: *mut c_void = std::ptr::null_mut();
            // SAFETY: writes one pointer to `rows * 24` bytes of pinned
            // memory.
            let r = check("cuMemHostAlloc", unsafe {
                cu::cuMemHostAlloc(&mut table, rows * 24, cu::CU_MEMHOSTALLOC_PORTABLE)
            });
            let mut event: cu::CUevent = std::ptr::null_mut();
            let r = r.and_then(|()| {
                // SAFETY: writes one event handle.
                check("cuEventCreate", unsafe {
                    cu::cuEventCreate(
                        &mut event,
                        cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                    )
                })
            });
            if let Err(e) = r {
                // SAFETY: allocated just above (or null), not yet in a slot.
                unsafe {
                    cu::cuMemFreeHost(host);
                    if !table.is_null() {
                        cu::cuMemFreeHost(table);
                    }
                }
                return Err(e);
            }
            s.slots.push(Slot {
                host: host.cast(),
                table: table.cast(),
                entries: 0,
                launched: 0,
                event,
                busy: false,
                seq: 0,
                mark: None,
                fill: 0,
            });
        }
        Ok(s)
    }

    /// Room for up to `len` bytes (at most a buffer's, not 0): the rest of
    /// the buffer being filled (perhaps less than `len`: the caller cuts
    /// its chunk there), or, once that is full, the start of the next
    /// buffer, waited for first (all its copies done); the copies gathered
    /// for the one left are issued. `reusable` says whether a buffer may be
    /// taken again (the sender's buffers are not while a chunk in them is
    /// unsent); `None` when the next one may not.
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
        // The buffer left: its copies issued, and its event recorded right
        // after them (a wait for it then waits for them alone).
        let left = self.cur;
        self.flush()?;
        if self.slots[left].busy {
            let need = self.slots[left].seq + 1;
            self.mark(left, need)?;
        }
        self.wait(next)?;
        self.cur = next;
        let s = &mut self.slots[next];
        s.fill = 0;
        s.entries = 0;
        s.launched = 0;
        s.mark = None;
        Ok(Some((next, 0)))
    }

    /// Gathers the copy of `len` bytes `src → dst` into or from `slot`'s
    /// buffer at `off` (an answer of [`take`]), and takes those bytes of
    /// it. Issued later (see [`Staging`]).
    ///
    /// [`take`]: Self::take
    fn gather(&mut self, slot: usize, off: usize, dst: u64, src: u64, len: usize) {
        debug_assert_eq!(slot, self.cur);
        debug_assert_eq!(off, self.slots[slot].fill);
        let s = &mut self.slots[slot];
        // Entries of at most KERNEL_ENTRY_MAX bytes for the kernel (each a
        // thread block's), the whole copy otherwise.
        let most = if self.kernel.is_some() {
            KERNEL_ENTRY_MAX
        } else {
            u64::MAX
        };
        for_each_entry(dst, src, len as u64, most, |e| {
            // SAFETY: the table has a row per page of the buffer, and each
            // entry covers at least a page's worth of the buffer's parts
            // (every part starts page-aligned; an entry is a whole part or
            // KERNEL_ENTRY_MAX bytes of one); no launch reads rows at or
            // past `entries`.
            let row = unsafe { std::slice::from_raw_parts_mut(s.table.add(s.entries * 3), 3) };
            row.copy_from_slice(&e);
            s.entries += 1;
        });
        s.busy = true;
        s.seq = self.issued;
        // The next part starts page-aligned, as each buffer does: direct
        // I/O (storage) reads and writes whole pages at aligned addresses.
        s.fill = (off + len).next_multiple_of(PAGE).min(self.shape.chunk);
        self.issued += 1;
    }

    /// Issues the copies gathered for the buffer being filled: one kernel
    /// launch, or one `cuMemcpyAsync` each. A failure fails the ring (every
    /// copy issued waited for first).
    pub(crate) fn flush(&mut self) -> Result<(), GpuError> {
        let s = &mut self.slots[self.cur];
        if s.launched == s.entries {
            return Ok(());
        }
        let (from, n) = (s.launched, s.entries - s.launched);
        s.launched = s.entries;
        if let Some(e) = &self.fault {
            return Err(e.clone());
        }
        // SAFETY: rows `from..from + n` of the table were written by
        // `gather`, and are not rewritten before the buffer is waited for.
        let rows = unsafe { std::slice::from_raw_parts(s.table.add(from * 3), n * 3) };
        let r = match self.kernel {
            // SAFETY: each row names a part of this slot's pinned buffer
            // and device memory the caller holds until the copies are
            // waited for (send/recv contracts); the table lives as long.
            Some(f) => unsafe { launch_pieces(f, rows.as_ptr() as u64, n as u32, self.stream) },
            None => rows.chunks_exact(3).try_for_each(|r| {
                // SAFETY: as for the kernel.
                check("cuMemcpyAsync", unsafe {
                    cu::cuMemcpyAsync(r[0], r[1], r[2] as usize, self.stream)
                })
            }),
        };
        match r {
            Ok(()) => {
                self.launched = self.issued;
                Ok(())
            }
            Err(e) => {
                // SAFETY: this ring's stream.
                unsafe { cu::cuStreamSynchronize(self.stream) };
                Err(self.fault.get_or_insert(e).clone())
            }
        }
    }

    /// Records `slot`'s event after every copy issued so far, unless it
    /// already marks the copies numbered below `need`.
    fn mark(&mut self, slot: usize, need: u64) -> Result<(), GpuError> {
        if self.slots[slot].mark.is_some_and(|m| m >= need) {
            return Ok(());
        }
        // SAFETY: an event and stream of this ring.
        let r = check("cuEventRecord", unsafe {
            cu::cuEventRecord(self.slots[slot].event, self.stream)
        });
        match r {
            Ok(()) => {
                self.slots[slot].mark = Some(self.launched);
                Ok(())
            }
            Err(e) => {
                // No event marks the copies: wait for them here, since the
                // caller lets the buffer and the ranges go on failure.
                // SAFETY: this ring's stream.
                unsafe { cu::cuStreamSynchronize(self.stream) };
                Err(self.fault.get_or_insert(e).clone())
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

    /// Waits for the copies that used `slot`, if any is outstanding (those
    /// still gathered are issued first).
    fn sync(&mut self, slot: usize) -> Result<(), GpuError> {
        if !self.slots[slot].busy {
            return Ok(());
        }
        let issued = if slot == self.cur {
            self.flush()
        } else {
            Ok(())
        };
        let need = self.slots[slot].seq + 1;
        let r = issued.and_then(|()| self.mark(slot, need)).and_then(|()| {
            // SAFETY: an event of this ring, recorded after the slot's
            // copies.
            check("cuEventSynchronize", unsafe {
                cu::cuEventSynchronize(self.slots[slot].event)
            })
        });
        if r.is_err() {
            // Nothing of the ring's may still run when its buffers are let
            // go.
            // SAFETY: this ring's stream.
            unsafe { cu::cuStreamSynchronize(self.stream) };
        }
        self.waited(slot, r)
    }

    /// Waits for every copy gathered. The buffers are free afterwards even
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
    /// driver without blocking (copies still gathered are not done: see
    /// [`flush`](Self::flush)), or waited for when `block`.
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
        if ticket.end > self.launched {
            return Ok(false);
        }
        self.mark(slot, ticket.end)?;
        let mark = self.slots[slot].mark.expect("marked above");
        // SAFETY: an event of this ring, recorded after the ticket's
        // copies.
        let r = unsafe { cu::cuEventQuery(self.slots[slot].event) };
        if r == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        if let Err(e) = check("cuEventQuery", r) {
            // SAFETY: this ring's stream.
            unsafe { cu::cuStreamSynchronize(self.stream) };
            return Err(self.fault.get_or_insert(e).clone());
        }
        self.done = self.done.max(mark);
        if mark > self.slots[slot].seq {
            self.slots[slot].busy = false;
        }
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
                    self.gather(slot, off, host, addr + issue.1, n);
                    queue.push_back((slot, off, issue.0, issue.1, n));
                    issue.1 += n as u64;
                    if issue.1 >= len {
                        issue = (issue.0 + 1, 0);
                    }
                }
                // Gathering stops with the current buffer full (or the
                // pieces all in): its copies run while earlier buffers are
                // sent.
                self.flush()?;
                if self.slots[self.cur].busy {
                    let need = self.slots[self.cur].seq + 1;
                    self.mark(self.cur, need)?;
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
            self.gather(slot, off, dst + at, host, n);
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
                cu::cuMemFreeHost(s.table.cast());
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

/// Issues the copies gathered in the calling thread's rings
/// ([`Staging::flush`]); a failure fails its ring, and the tickets of its
/// copies are told so.
pub(crate) fn flush_all() {
    let _ = STAGING.try_with(|s| {
        for r in s.borrow_mut().live.iter_mut() {
            let _ = r.flush();
        }
    });
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
