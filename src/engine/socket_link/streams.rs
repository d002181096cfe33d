//! Every socket link's stream threads (the TCP, shm and RDMA links
//! alike; `SocketLink<P>`): the sender writes each job's frames and
//! payloads straight from registered memory (in batches, looking for an
//! abort between them) and runs its transport's own jobs; the reader lands
//! READ data straight in registered memory (or drains it, for an aborted
//! request) and routes acknowledgements and its transport's frames.

use crate::agent::TransferOp;
use crate::engine::plan::Seg;
use crate::engine::sock::{FrameReader, IdlePolicy, ProgressClock, iov, writev_all};
use crate::engine::socket_link::{Frames, Job, Pending, ReadSlot, SocketLink, SocketPath, Tail};
use crate::engine::wire::{
    self, CHECK_ENTRY, CommitOp, Frame, HEADER_LEN, TRAILER_LEN, WRITE_LIST_ENTRY, WRITE_LIST_MAX,
    status,
};
use crate::engine::{ABORT_CHECK_BYTES, WRITE_LIST_PIECE_MAX, lock};
use crate::error::{Error, RejectReason};
use crate::integrity::CHECK_CHUNK;
use crate::memory::MemoryType;
use crossbeam_channel::Receiver;
use rustix::fd::AsRawFd;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// READ data received into GPU memory whose copies may still be running,
/// each with its slot (the request, holding its memory registered).
type ReadLandings = crate::gpu::Landings<ReadSlot>;

/// Segments a sender keeps room for between jobs (about 3 MiB).
const SCRATCH_KEPT: usize = 1 << 16;

impl<P: SocketPath> SocketLink<P> {
    /// Stream `idx`'s sender thread: writes each job's frames (doing the
    /// transport's own jobs first) until the link stops.
    pub(in crate::engine) fn run_sender(self: Arc<Self>, idx: usize, rx: Receiver<Job<P::Job>>) {
        let fd = self.streams[idx].sock.as_raw_fd();
        let mut f = Framed::default();
        // The segments of indexed shares, found here (kept between jobs).
        let mut scratch = Vec::new();
        // An idle stream tells the target it lives, well within the
        // target's I/O timeout (after which it closes a silent stream).
        let keepalive = self
            .target_timeout
            .map(|t| (t / 4).max(Duration::from_millis(50)));
        let keepalive_frame = Frame::Keepalive.encode();
        // Keepalives are not the requests' progress: they move no clock the
        // link's I/O timeout reads.
        let keepalive_clock = ProgressClock::new();
        loop {
            let next = match keepalive {
                None => rx
                    .recv()
                    .map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
                Some(every) => rx.recv_timeout(every),
            };
            let job = match next {
                Ok(job) => job,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    let mut iovs = [iov(keepalive_frame.as_ptr(), HEADER_LEN)];
                    // SAFETY: the iovec points into `keepalive_frame`, alive
                    // for the call.
                    let sent =
                        unsafe { writev_all(fd, &mut iovs, &keepalive_clock, self.io_timeout) };
                    if let Err(e) = sent {
                        self.fail(self.io_error(e));
                        break;
                    }
                    continue;
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            };
            let frames = match job {
                Job::Stop => break,
                Job::Frames(frames) => frames,
                Job::Path(job) => match P::run_job(&self, fd, job) {
                    Ok(Some(frames)) => frames,
                    Ok(None) => continue,
                    Err(e) => {
                        self.fail(e);
                        break;
                    }
                },
            };
            let Frames {
                req,
                op,
                segs: planned,
                tail,
                pending,
                mut aborted,
                checked,
            } = frames;
            // Aborted before any of it went out: its segments are skipped
            // (a READ's events for them are counted here, as no data will
            // come for them).
            let mut skipped = 0;
            let mut segs: &[Seg] = &[];
            if !planned.is_empty() && pending.completion.abort_requested() {
                skipped = planned.len();
                if op == TransferOp::Read {
                    for _ in 0..skipped {
                        self.complete_event(req, &pending, Err(Error::Aborted));
                    }
                }
                aborted = true;
            } else {
                segs = planned.get(&mut scratch);
            }
            f.clear();
            if op == TransferOp::Write && segs.iter().any(|s| s.local_gpu.is_some()) {
                if let Err(e) = self.write_gpu(fd, &mut f, req, segs, &tail, &pending) {
                    self.fail(e);
                    break;
                }
                continue;
            }
            if op == TransferOp::Write {
                f.writes(req, segs, checked);
            }
            let data_end = f.tail(req, op, segs, aborted.then_some(skipped), &tail, checked);
            if op == TransferOp::Read {
                let mut reads = lock(&self.streams[idx].reads);
                for (k, s) in segs.iter().enumerate() {
                    reads.push_back(ReadSlot {
                        req,
                        dst: s.local,
                        len: s.len,
                        gpu: s.local_gpu,
                        pending: Arc::clone(&pending),
                        checked: checked.then_some(k as u32),
                    });
                }
            }
            let abortable = f.marks.last().is_some_and(|m| m.2 > ABORT_CHECK_BYTES);
            let checked = checked && !f.sums.is_empty();
            // SAFETY: header iovecs point into `f.headers`, trailer iovecs
            // into `f.trailers`, the sync iovec into the job (all alive until
            // the call returns); payload iovecs (and `f.pieces`) point into
            // local regions validated at submit time and held by the
            // request's guards, which live until the request completes,
            // which cannot happen before this write returns (its
            // acknowledgement follows these bytes).
            let written = unsafe {
                if checked {
                    self.write_checked(fd, &mut f, data_end, (req, &pending))
                } else if abortable {
                    let Framed { iovs, marks, .. } = &mut f;
                    self.write_abortable(fd, iovs, marks, data_end, (req, &pending))
                } else {
                    writev_all(fd, &mut f.iovs, &self.clock, self.io_timeout)
                }
            };
            if let Err(e) = written {
                self.fail(self.io_error(e));
                break;
            }
            // A very large share's segments are not kept for ever.
            if scratch.capacity() > SCRATCH_KEPT {
                scratch = Vec::new();
            }
        }
        self.thread_exit();
    }

    /// Writes a WRITE job whose local memory is on the GPU: each segment's
    /// `Write` frame with its payload staged through the thread's pinned
    /// ring, the copies running ahead across the segments of a device (the
    /// copy of the next chunk, of this segment or a later one, runs while
    /// one is sent), then the tail. An abort is looked for before each
    /// segment: the rest are replaced by an `Abort` frame counting them. A
    /// driver failure mid-frame cannot be told to the target: the link
    /// fails with it.
    fn write_gpu(
        &self,
        fd: std::os::fd::RawFd,
        f: &mut Framed,
        req: u64,
        segs: &[Seg],
        tail: &Tail,
        pending: &Pending,
    ) -> Result<(), Error> {
        let send = |iovs: &mut [libc::iovec]| {
            // SAFETY: every iovec points into a live local (a header, a
            // staging buffer, the job's tail) or, for host memory, into a
            // local region held by the request's guards.
            unsafe { writev_all(fd, iovs, &self.clock, self.io_timeout) }
        };
        let abort = |f: &mut Framed, left: usize| {
            f.clear();
            f.tail(req, TransferOp::Write, &[], Some(left), tail, false);
            send(&mut f.iovs).map_err(|e| self.io_error(e))
        };
        let mut i = 0;
        while i < segs.len() {
            if pending.completion.abort_requested() {
                return abort(f, segs.len() - i);
            }
            let Some(device) = segs[i].local_gpu else {
                let s = &segs[i];
                let hdr = s.write_header(req, false);
                let mut iovs = [
                    iov(hdr.as_ptr(), HEADER_LEN),
                    iov(s.local as *const u8, s.len as usize),
                ];
                send(&mut iovs).map_err(|e| self.io_error(e))?;
                i += 1;
                continue;
            };
            // The run of segments from this device's memory: one pipeline.
            let run = &segs[i..];
            let run = &run[..run
                .iter()
                .take_while(|s| s.local_gpu == Some(device))
                .count()];
            let pieces: Vec<(u64, u64)> = run.iter().map(|s| (s.local, s.len)).collect();
            // A segment's header goes with its first chunk.
            let mut current = usize::MAX;
            let mut write = |k: usize, bytes: &[u8]| {
                let chunk = iov(bytes.as_ptr(), bytes.len());
                if k != current {
                    current = k;
                    let hdr = run[k].write_header(req, false);
                    send(&mut [iov(hdr.as_ptr(), HEADER_LEN), chunk])
                } else {
                    send(&mut [chunk])
                }
            };
            let stop = || pending.completion.abort_requested();
            // SAFETY: each piece lies inside a local VRAM region (device
            // memory on `device`) validated at submit time and held by the
            // request's guards, which live until its acknowledgement, which
            // follows these bytes; segments are never empty.
            let staged = unsafe {
                crate::gpu::send_staged_pieces(device, self.gpu_staging, &pieces, &stop, &mut write)
            };
            match staged {
                Ok(sent) if sent < run.len() => return abort(f, segs.len() - i - sent),
                Ok(_) => {}
                Err(crate::gpu::StageError::Io(e)) => return Err(self.io_error(e)),
                Err(crate::gpu::StageError::Gpu(e)) => return Err(Error::Gpu(e)),
            }
            i += run.len();
        }
        f.clear();
        f.tail(req, TransferOp::Write, &[], None, tail, false);
        send(&mut f.iovs).map_err(|e| self.io_error(e))
    }

    /// Writes a job's frames as [`writev_all`] does, about
    /// `ABORT_CHECK_BYTES` of payload at a time, looking before each batch
    /// whether the request was aborted: if so, the rest of its data frames
    /// is replaced by an `Abort` frame counting their segments, and its tail
    /// (`iovs[data_end..]`) follows.
    ///
    /// # Safety
    /// As [`writev_all`].
    unsafe fn write_abortable(
        &self,
        fd: std::os::fd::RawFd,
        iovs: &mut [libc::iovec],
        marks: &[(usize, usize, u64)],
        data_end: usize,
        (req, pending): (u64, &Pending),
    ) -> io::Result<()> {
        let segments = marks.last().map_or(0, |m| m.1);
        let (mut at, mut done) = (0, (0usize, 0usize, 0u64));
        let mut m = 0;
        while m < marks.len() {
            if pending.completion.abort_requested() {
                let abort = abort_frame(req, segments - done.1);
                let mut rest = Vec::with_capacity(1 + iovs.len() - data_end);
                rest.push(iov(abort.as_ptr(), HEADER_LEN));
                rest.extend_from_slice(&iovs[data_end..]);
                // SAFETY: `abort` lives for the call; the rest as the caller
                // promised.
                return unsafe { writev_all(fd, &mut rest, &self.clock, self.io_timeout) };
            }
            while m + 1 < marks.len() && marks[m].2 - done.2 < ABORT_CHECK_BYTES {
                m += 1;
            }
            let end = if m + 1 == marks.len() {
                iovs.len()
            } else {
                marks[m].0
            };
            // SAFETY: forwarded contract.
            unsafe { writev_all(fd, &mut iovs[at..end], &self.clock, self.io_timeout)? };
            at = end;
            done = marks[m];
            m += 1;
        }
        Ok(())
    }

    /// Writes a checked WRITE job's frames, looking before each frame
    /// whether the request was aborted (as [`Self::write_abortable`]).
    ///
    /// A frame of `SUM_BEFORE_MAX` payload bytes or more goes
    /// `CHECK_CHUNK` bytes a call, each chunk added to the frame's CRC32C
    /// right after the kernel copied it (read again from cache, not from
    /// memory); its trailer, filled then, leads the next call. Smaller
    /// frames are summed before they are written and gathered into calls
    /// of about `CHECK_CHUNK` bytes.
    ///
    /// # Safety
    /// As [`writev_all`]; `f` as [`Framed::writes`] and [`Framed::tail`]
    /// left it.
    unsafe fn write_checked(
        &self,
        fd: std::os::fd::RawFd,
        f: &mut Framed,
        data_end: usize,
        (req, pending): (u64, &Pending),
    ) -> io::Result<()> {
        let Framed {
            trailers,
            sums,
            pieces,
            iovs,
            marks,
            ..
        } = f;
        let segments = marks.last().map_or(0, |m| m.1);
        // The next iovec not yet written nor gathered into `out`.
        let mut at = 0;
        let mut out: Vec<libc::iovec> = Vec::new();
        let mut out_bytes = 0u64;
        // The payload parts of the call being made: summed once written.
        let mut parts: Vec<(u64, u64)> = Vec::new();
        let send = |out: &mut Vec<libc::iovec>| {
            // SAFETY: as the caller promised for `iovs` (which `out` copies
            // from) and `pieces`.
            let r = unsafe { writev_all(fd, out, &self.clock, self.io_timeout) };
            out.clear();
            r
        };
        for k in 0..marks.len() {
            let start = if k == 0 { 0 } else { marks[k - 1].0 };
            if pending.completion.abort_requested() {
                let done = if k == 0 { 0 } else { marks[k - 1].1 };
                let abort = abort_frame(req, segments - done);
                out.extend_from_slice(&iovs[at..start]);
                out.push(iov(abort.as_ptr(), HEADER_LEN));
                out.extend_from_slice(&iovs[data_end..]);
                return send(&mut out);
            }
            let end = marks[k].0;
            let (lo, hi) = sums[k];
            let payload: u64 = pieces[lo..hi].iter().map(|p| p.1).sum();
            if payload < SUM_BEFORE_MAX {
                // SAFETY: forwarded contract.
                unsafe { sum_frames(trailers, sums, pieces, k..k + 1) };
                out.extend_from_slice(&iovs[at..end]);
                at = end;
                out_bytes += payload;
                if out_bytes >= CHECK_CHUNK as u64 {
                    send(&mut out)?;
                    out_bytes = 0;
                }
                continue;
            }
            // Its trailer is the last iovec, its payload pieces the ones
            // before it; the header (and table) before those.
            let trailer = end - 1;
            out.extend_from_slice(&iovs[at..trailer - (hi - lo)]);
            let mut crc = crate::integrity::Crc32c::new();
            let (mut p, mut off) = (lo, 0u64);
            while p < hi {
                let mut room = CHECK_CHUNK as u64;
                while p < hi && room > 0 {
                    let (addr, len) = pieces[p];
                    let take = (len - off).min(room);
                    out.push(iov((addr + off) as *const u8, take as usize));
                    parts.push((addr + off, take));
                    (off, room) = (off + take, room - take);
                    if off == len {
                        (p, off) = (p + 1, 0);
                    }
                }
                send(&mut out)?;
                for (addr, len) in parts.drain(..) {
                    // SAFETY: a part of a piece, readable as the caller
                    // promised.
                    crc.update(unsafe {
                        std::slice::from_raw_parts(addr as *const u8, len as usize)
                    });
                }
            }
            out_bytes = 0;
            trailers[k] = crc.finish().to_le_bytes();
            at = trailer;
        }
        out.extend_from_slice(&iovs[at..]);
        send(&mut out)
    }
}

/// Payload bytes below which a checked frame is summed before it is
/// written (gathered with others into one call) rather than after.
const SUM_BEFORE_MAX: u64 = 64 << 10;

/// An `Abort` frame's header: `segments` data segments will not come.
fn abort_frame(req: u64, segments: usize) -> [u8; HEADER_LEN] {
    Frame::Abort {
        req,
        segments: segments as u64,
    }
    .encode()
}

impl<P: SocketPath> SocketLink<P> {
    pub(in crate::engine) fn run_reader(self: Arc<Self>, idx: usize) {
        let sock = &self.streams[idx].sock;
        let clock = ProgressClock::new();
        let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
        let mut idle = LinkIdle { link: &self };
        let r = self.read_loop(idx, &mut reader, &mut idle);
        if let Err(e) = r {
            self.fail(e);
        } else {
            self.fail(Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "remote agent closed the connection",
                )),
            });
        }
        self.thread_exit();
    }

    fn read_loop(
        &self,
        idx: usize,
        reader: &mut FrameReader<'_>,
        idle: &mut LinkIdle<'_, P>,
    ) -> Result<(), Error> {
        // READ data still being copied into GPU memory; dropped (the copies
        // waited for) before the requests they belong to are let go.
        let mut landings = ReadLandings::new();
        loop {
            if !landings.is_empty() {
                reader.settle(
                    &mut landings,
                    idle,
                    |e| self.link_error(e),
                    |slot, r| {
                        self.complete_event(slot.req, &slot.pending, r.map_err(Error::Gpu));
                        Ok(())
                    },
                )?;
            }
            let raw = match reader.next_header(idle) {
                Ok(Some(raw)) => raw,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.link_error(e)),
            };
            self.clock.touch();
            let frame = Frame::decode(&raw).map_err(|e| Error::ProtocolViolation {
                remote: self.remote.clone(),
                detail: e.to_string(),
            })?;
            match frame {
                Frame::ReadData {
                    req,
                    len,
                    status: st,
                    checked,
                } => {
                    let slot = lock(&self.streams[idx].reads).pop_front();
                    let Some(slot) = slot else {
                        return Err(self.violation("READ data with no READ outstanding"));
                    };
                    if slot.req != req {
                        return Err(self.violation("READ data out of order"));
                    }
                    let result = if st == status::OK {
                        if len != slot.len {
                            return Err(self.violation("READ data length differs from the request"));
                        }
                        if checked != slot.checked.is_some()
                            || slot
                                .checked
                                .is_some_and(|seq| !wire::read_data_sealed(&raw, seq))
                        {
                            return Err(self.violation(
                                "READ data checked differently from the request, or not in its order",
                            ));
                        }
                        if slot.pending.completion.abort_requested() {
                            // Aborted: the bytes are drained, the
                            // destination left as it is.
                            let trailer = if checked { TRAILER_LEN as u64 } else { 0 };
                            reader
                                .discard(len + trailer, idle)
                                .map_err(|e| self.link_error(e))?;
                            self.complete_event(req, &slot.pending, Err(Error::Aborted));
                            continue;
                        }
                        if let Some(device) = slot.gpu {
                            self.read_into_gpu(reader, idle, &mut landings, slot, device)?;
                            continue;
                        }
                        // `slot.dst` lies inside a local region that was
                        // registered and validated at submit time, and the
                        // request's guards (in `slot.pending`) keep it
                        // registered until every event, this one included,
                        // has been processed.
                        if checked {
                            // SAFETY: as said above.
                            let got = unsafe {
                                reader.read_checked(slot.dst as *mut u8, len as usize, idle)
                            }
                            .map_err(|e| self.link_error(e))?;
                            self.check_read(reader, idle, &slot, got)?
                        } else {
                            // SAFETY: as said above.
                            unsafe { reader.read_into(slot.dst as *mut u8, len as usize, idle) }
                                .map_err(|e| self.link_error(e))?;
                            Ok(())
                        }
                    } else {
                        Err(Error::RemoteRejected {
                            remote: self.remote.clone(),
                            reason: RejectReason::from_code(st),
                            landed: crate::error::Landed::Unknown,
                        })
                    };
                    self.complete_event(req, &slot.pending, result);
                }
                // The link's transport's own frame (shm's answers).
                Frame::Transport { transport, head } if transport == self.path.transport => {
                    P::on_frame(self, &head)?;
                }
                Frame::Ack {
                    req,
                    status: st,
                    landed,
                } => {
                    let p = lock(&self.pending).map.get(&req).cloned();
                    let Some(p) = p else {
                        return Err(self.violation("acknowledgement for an unknown request"));
                    };
                    let result = match st {
                        status::OK => Ok(()),
                        st => match RejectReason::from_code(st) {
                            RejectReason::Aborted => Err(Error::Aborted),
                            RejectReason::Integrity => Err(Error::Integrity {
                                remote: self.remote.clone(),
                                what: "a piece did not match its CRC32C at the target \
                                       (which logs its range)"
                                    .into(),
                            }),
                            reason => Err(Error::RemoteRejected {
                                remote: self.remote.clone(),
                                reason,
                                landed: crate::error::Landed::from_code(landed),
                            }),
                        },
                    };
                    self.complete_event(req, &p, result);
                }
                // The target closes the link on its own accord: every
                // request on it fails with its reason.
                Frame::Closing { status: st } => {
                    return Err(Error::RemoteRejected {
                        remote: self.remote.clone(),
                        reason: RejectReason::from_code(st),
                        landed: crate::error::Landed::Unknown,
                    });
                }
                other => return Err(self.violation(&format!("unexpected frame {other:?}"))),
            }
        }
    }

    /// Checks a checked READ's data, landed at `slot.dst` with the CRC32C
    /// `got`, against the trailer that follows it; a mismatch is the
    /// segment's outcome.
    fn check_read(
        &self,
        reader: &mut FrameReader<'_>,
        idle: &mut LinkIdle<'_, P>,
        slot: &ReadSlot,
        got: u32,
    ) -> Result<Result<(), Error>, Error> {
        let mut t = [0u8; TRAILER_LEN];
        // SAFETY: `t` is a live local of exactly that length.
        unsafe { reader.read_into(t.as_mut_ptr(), TRAILER_LEN, idle) }
            .map_err(|e| self.link_error(e))?;
        let sent = u32::from_le_bytes(t);
        if sent == got {
            return Ok(Ok(()));
        }
        tracing::warn!(
            remote = %self.remote, dst = slot.dst, len = slot.len, sent, got,
            "checked READ data did not match its CRC32C: the request fails"
        );
        Ok(Err(Error::Integrity {
            remote: self.remote.clone(),
            what: format!(
                "READ data landed at {:#x}..{:#x} did not match the CRC32C of its source",
                slot.dst,
                slot.dst + slot.len
            ),
        }))
    }

    /// Lands READ data in local GPU memory through the thread's staging
    /// ring, the copies left running: the segment's event is told when
    /// `landings` hands it back. A driver failure while receiving fails the
    /// segment at once (the rest of its bytes are drained); a socket
    /// failure, the link.
    fn read_into_gpu(
        &self,
        reader: &mut FrameReader<'_>,
        idle: &mut LinkIdle<'_, P>,
        landings: &mut ReadLandings,
        slot: ReadSlot,
        device: u32,
    ) -> Result<(), Error> {
        let (dst, len) = (slot.dst, slot.len);
        let mut got = 0u64;
        let mut read = |buf: &mut [u8]| {
            let last = got + buf.len() as u64 == len;
            // SAFETY: `buf` is a live mutable slice.
            unsafe { reader.read_part(buf.as_mut_ptr(), buf.len(), last, idle) }?;
            got += buf.len() as u64;
            Ok(())
        };
        // SAFETY: `slot.dst` lies inside a local VRAM region registered and
        // validated at submit time (device memory on `device`), held by the
        // request's guards (in `slot.pending`), which `landings` keeps until
        // the copies are over.
        let r = unsafe { landings.land(device, self.gpu_staging, dst, len, &mut read, slot) };
        match r {
            Ok(()) => Ok(()),
            Err((crate::gpu::StageError::Io(e), _)) => Err(self.link_error(e)),
            Err((crate::gpu::StageError::Gpu(e), slot)) => {
                reader
                    .discard(len - got, idle)
                    .map_err(|e| self.link_error(e))?;
                self.complete_event(slot.req, &slot.pending, Err(Error::Gpu(e)));
                Ok(())
            }
        }
    }

    pub(in crate::engine) fn violation(&self, detail: &str) -> Error {
        Error::ProtocolViolation {
            remote: self.remote.clone(),
            detail: detail.to_owned(),
        }
    }

    /// Maps a reader error, preferring the cause already recorded (the
    /// reader's error is often the echo of a shutdown by another thread).
    fn link_error(&self, e: io::Error) -> Error {
        if let Some(c) = &lock(&self.pending).broken {
            return c.clone();
        }
        self.io_error(e)
    }
}

/// A link reader's idle check: the link broken, or requests outstanding
/// and no progress within the I/O timeout, ends the wait.
struct LinkIdle<'a, P: SocketPath> {
    link: &'a SocketLink<P>,
}

impl<P: SocketPath> IdlePolicy for LinkIdle<'_, P> {
    fn on_idle(&mut self, _mid_frame: bool) -> io::Result<()> {
        let t = lock(&self.link.pending);
        if t.broken.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "link closed",
            ));
        }
        if !t.map.is_empty() && self.link.clock.idle() > self.link.io_timeout {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no progress within the I/O timeout",
            ));
        }
        Ok(())
    }
}

/// A stream sender's scratch: one job's frames as the iovecs of one
/// `writev` — headers, write-list tables, payloads straight from the local
/// regions, and the sync message.
#[derive(Default)]
struct Framed {
    headers: Vec<[u8; HEADER_LEN]>,
    /// CRC32C trailers of checked frames, one per data frame, filled in
    /// as [`SocketLink::write_checked`] writes them.
    trailers: Vec<[u8; TRAILER_LEN]>,
    /// Per checked data frame: the range of `pieces` its trailer covers.
    sums: Vec<(usize, usize)>,
    /// The payload pieces (address, length) of checked frames.
    pieces: Vec<(u64, u64)>,
    iovs: Vec<libc::iovec>,
    tables: Vec<Vec<u8>>,
    /// After each data frame: (iovecs so far, segments so far, bytes so
    /// far), where an aborted request may stop.
    marks: Vec<(usize, usize, u64)>,
}

impl Framed {
    fn clear(&mut self) {
        self.headers.clear();
        self.trailers.clear();
        self.sums.clear();
        self.pieces.clear();
        self.iovs.clear();
        self.tables.clear();
        self.marks.clear();
    }

    /// A WRITE's data frames: runs of small segments to one region go as
    /// write lists (one frame and one scatter read at the target for up to
    /// `WRITE_LIST_MAX` of them); the rest as single segments.
    /// `checked`: each frame sealed, its payload's CRC32C after it.
    fn writes(&mut self, req: u64, segs: &[Seg], checked: bool) {
        let Framed {
            headers,
            trailers,
            sums,
            pieces,
            iovs,
            tables,
            marks,
        } = self;
        // Room for every header of the job (its data frames, an abort and
        // the tail) and every trailer up front: the iovecs point into these
        // vectors.
        headers.reserve(segs.len() + 3);
        if checked {
            trailers.reserve(segs.len());
        }
        // A checked list is summed where it lands once whole: small enough
        // to be still in cache there.
        let run_max = if checked {
            crate::integrity::CHECK_CHUNK as u64
        } else {
            ABORT_CHECK_BYTES
        };
        let mut bytes = 0;
        // Checked frames: their place among the request's on this stream.
        let mut seq = 0u32;
        let mut i = 0;
        while i < segs.len() {
            let s0 = &segs[i];
            let mut j = i + 1;
            // Host memory only: a storage target writes each piece itself.
            // At most ABORT_CHECK_BYTES a frame: an abort stops a stream
            // between frames, so within that much.
            if s0.len <= WRITE_LIST_PIECE_MAX && s0.mem_type == MemoryType::Dram {
                let mut run_bytes = s0.len;
                while j < segs.len()
                    && j - i < WRITE_LIST_MAX as usize
                    && segs[j].len <= WRITE_LIST_PIECE_MAX
                    && segs[j].key == s0.key
                    && segs[j].mem_type == s0.mem_type
                    && run_bytes + segs[j].len <= run_max
                {
                    run_bytes += segs[j].len;
                    j += 1;
                }
            }
            if j - i >= 2 {
                let run = &segs[i..j];
                let mut table = Vec::with_capacity(run.len() * WRITE_LIST_ENTRY);
                for s in run {
                    table.extend_from_slice(&s.remote.to_le_bytes());
                    table.extend_from_slice(&s.len.to_le_bytes());
                }
                let total = run.iter().map(|s| s.len).sum();
                let mut h = Frame::WriteList {
                    req,
                    mem_type: s0.mem_type,
                    count: run.len() as u32,
                    total,
                    key: s0.key,
                    checked,
                }
                .encode();
                if checked {
                    wire::seal_seq(&mut h, &table, seq);
                    seq += 1;
                }
                headers.push(h);
                iovs.push(iov(
                    headers.last().expect("just pushed").as_ptr(),
                    HEADER_LEN,
                ));
                iovs.push(iov(table.as_ptr(), table.len()));
                tables.push(table);
                let lo = pieces.len();
                for s in run {
                    iovs.push(iov(s.local as *const u8, s.len as usize));
                    if checked {
                        pieces.push((s.local, s.len));
                    }
                }
                if checked {
                    trailer(trailers, iovs, sums, (lo, pieces.len()));
                }
                bytes += total;
            } else {
                let mut h = s0.write_header(req, checked);
                if checked {
                    wire::seal_seq(&mut h, &[], seq);
                    seq += 1;
                }
                headers.push(h);
                iovs.push(iov(
                    headers.last().expect("just pushed").as_ptr(),
                    HEADER_LEN,
                ));
                iovs.push(iov(s0.local as *const u8, s0.len as usize));
                if checked {
                    pieces.push((s0.local, s0.len));
                    trailer(trailers, iovs, sums, (pieces.len() - 1, pieces.len()));
                }
                bytes += s0.len;
            }
            i = j;
            marks.push((iovs.len(), i, bytes));
        }
    }

    /// After the data frames: a READ's requests, an `Abort` (counting
    /// `aborted` skipped segments), the fence or commit and the sync
    /// message. Returns where the data frames' iovecs end.
    fn tail<'a>(
        &mut self,
        req: u64,
        op: TransferOp,
        segs: &[Seg],
        aborted: Option<usize>,
        tail: &'a Tail,
        checked: bool,
    ) -> usize {
        let headers = &mut self.headers;
        let data_frames = headers.len();
        for (k, s) in segs.iter().filter(|_| op == TransferOp::Read).enumerate() {
            let mut h = Frame::ReadReq {
                req,
                mem_type: s.mem_type,
                device: s.device,
                addr: s.remote,
                len: s.len,
                key: s.key,
                checked,
            }
            .encode();
            if checked {
                wire::seal_seq(&mut h, &[], k as u32);
            }
            headers.push(h);
        }
        if let Some(skipped) = aborted {
            headers.push(
                Frame::Abort {
                    req,
                    segments: skipped as u64,
                }
                .encode(),
            );
        }
        let mut table: &'a [u8] = &[];
        let sync: Option<&'a [u8]> = match tail {
            Tail::None => None,
            Tail::Fence => {
                headers.push(Frame::Fence { req }.encode());
                None
            }
            Tail::Commit {
                segments,
                sync,
                durable,
                checks,
            } => {
                table = checks;
                headers.push(
                    Frame::Commit {
                        req,
                        op: match op {
                            TransferOp::Write => CommitOp::Write,
                            TransferOp::Read => CommitOp::Read,
                        },
                        segments: *segments,
                        sync_len: sync.as_ref().map_or(0, |m| m.len() as u32),
                        has_sync: sync.is_some(),
                        durable: *durable,
                        checks: (checks.len() / CHECK_ENTRY) as u32,
                        sync_crc: sync.as_deref().map(crate::integrity::crc32c),
                    }
                    .encode(),
                );
                sync.as_deref()
            }
        };
        // Write frames are in `iovs` already; then the read requests, an
        // abort and the tail.
        let data_end = self.iovs.len();
        for h in &self.headers[data_frames..] {
            self.iovs.push(iov(h.as_ptr(), HEADER_LEN));
        }
        if let Some(m) = sync {
            self.iovs.push(iov(m.as_ptr(), m.len()));
        }
        if !table.is_empty() {
            self.iovs.push(iov(table.as_ptr(), table.len()));
        }
        data_end
    }
}

/// Adds a checked frame's trailer (filled in later, by [`SocketLink::write_checked`])
/// after its payload, covering `pieces[lo..hi]`.
fn trailer(
    trailers: &mut Vec<[u8; TRAILER_LEN]>,
    iovs: &mut Vec<libc::iovec>,
    sums: &mut Vec<(usize, usize)>,
    (lo, hi): (usize, usize),
) {
    // `trailers` has room for every frame of the job (reserved up front):
    // the iovec's pointer stays valid.
    debug_assert!(trailers.len() < trailers.capacity());
    trailers.push([0; TRAILER_LEN]);
    iovs.push(iov(
        trailers.last().expect("just pushed").as_ptr(),
        TRAILER_LEN,
    ));
    sums.push((lo, hi));
}

/// Fills the trailers of the checked data frames `frames`: the CRC32C of
/// each one's payload pieces.
///
/// # Safety
/// Every piece must be readable (local regions validated at submit time,
/// held registered by the request).
unsafe fn sum_frames(
    trailers: &mut [[u8; TRAILER_LEN]],
    sums: &[(usize, usize)],
    pieces: &[(u64, u64)],
    frames: std::ops::Range<usize>,
) {
    for k in frames {
        let (lo, hi) = sums[k];
        let mut c = crate::integrity::Crc32c::new();
        for &(p, n) in &pieces[lo..hi] {
            // SAFETY: forwarded to the caller.
            c.update(unsafe { std::slice::from_raw_parts(p as *const u8, n as usize) });
        }
        trailers[k] = c.finish().to_le_bytes();
    }
}
