//! Raw vectored socket I/O straight between the kernel and registered
//! memory: `writev` from source regions, `readv` into destination regions.
//!
//! The kernel does every copy, so no Rust reference to registered memory is
//! ever formed (such memory may be written concurrently by peers).
//! Receiving reads the payload of frame *n* and the header of frame *n + 1*
//! in one `readv`, so headers cost no extra system call when frames arrive
//! back to back.
//!
//! Files: this one (plain sockets: vectored I/O, the frame reader, idle
//! policies and progress clocks), `records` (TLS records in user space)
//! and `ktls` (kernel TLS; falls back to `records`).

pub(in crate::engine) mod ktls;
mod records;

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::wire::HEADER_LEN;
use crate::error::Error;
use std::time::Duration;

/// Most iovecs passed to one `writev`/`readv` (Linux's `IOV_MAX`).
pub(crate) const IOV_MAX: usize = 1024;
/// Most bytes handed to one `sendmsg`.
const MAX_CALL_BYTES: usize = 4 << 20;

/// A monotonic clock in nanoseconds, shared by the threads of one
/// connection to record the time of the last progress. It reads the coarse
/// monotonic clock (`CLOCK_MONOTONIC_COARSE`, a few milliseconds' resolution,
/// always answered without entering the kernel): it times no-progress
/// timeouts of seconds, and is touched on every request and completion,
/// where a precise clock read can be a system call (a guest on an emulated
/// HPET: about ten per ping-pong round trip before).
#[derive(Debug)]
pub(crate) struct ProgressClock {
    last: AtomicU64,
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds.
fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter; the clock id is a constant the
    // kernel has supported since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

impl Default for ProgressClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressClock {
    pub(crate) fn new() -> Self {
        Self {
            last: AtomicU64::new(coarse_now_ns()),
        }
    }

    /// Records progress now.
    pub(crate) fn touch(&self) {
        self.last.store(coarse_now_ns(), Ordering::Relaxed);
    }

    /// Time since the last recorded progress.
    pub(crate) fn idle(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(
            coarse_now_ns().saturating_sub(self.last.load(Ordering::Relaxed)),
        )
    }
}

/// An iovec over bytes the caller keeps alive and unmoved until the write
/// returns.
pub(crate) fn iov(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: len,
    }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Writes every byte described by `iovs`, in order, handling partial writes.
/// The socket's send timeout (`SO_SNDTIMEO`) should be a short tick; when
/// no byte has moved on `clock` for `io_timeout`, the write fails with
/// `TimedOut`.
///
/// # Safety
/// Every iovec must describe memory valid for reads for the whole call
/// (kernel copies from it; a bad pointer yields `EFAULT`, not undefined
/// behaviour in this process, but callers must still uphold it).
///
/// On a socket encrypted in user space (see [`records`]) the bytes
/// go sealed in records.
pub(crate) unsafe fn writev_all(
    fd: RawFd,
    iovs: &mut [libc::iovec],
    clock: &ProgressClock,
    io_timeout: std::time::Duration,
) -> io::Result<()> {
    if let Some(ch) = records::of(fd) {
        // SAFETY: forwarded contract.
        return unsafe { ch.writev_all(fd, iovs, clock, io_timeout) };
    }
    // SAFETY: forwarded contract.
    unsafe { writev_plain(fd, iovs, clock, io_timeout) }
}

/// [`writev_all`] straight to the socket.
///
/// # Safety
/// As [`writev_all`].
pub(crate) unsafe fn writev_plain(
    fd: RawFd,
    iovs: &mut [libc::iovec],
    clock: &ProgressClock,
    io_timeout: std::time::Duration,
) -> io::Result<()> {
    let mut i = 0;
    while i < iovs.len() {
        if iovs[i].iov_len == 0 {
            i += 1;
            continue;
        }
        // Batch up to IOV_MAX iovecs and MAX_CALL_BYTES bytes, trimming the
        // last iovec temporarily: each call then returns (and records
        // progress) often enough for the no-progress timeout to be precise.
        let mut end = i;
        let mut bytes = 0usize;
        while end < iovs.len() && end - i < IOV_MAX && bytes < MAX_CALL_BYTES {
            bytes += iovs[end].iov_len;
            end += 1;
        }
        let n = end - i;
        let last = end - 1;
        let saved = iovs[last].iov_len;
        iovs[last].iov_len -= bytes.saturating_sub(MAX_CALL_BYTES);
        // SAFETY: an all-zero msghdr is a valid "no address, no control"
        // header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iovs[i..].as_mut_ptr();
        msg.msg_iovlen = n as _;
        // SAFETY: `msg` points at `n` live, initialised iovecs whose memory is
        // valid for reads per this function's contract. `sendmsg` with
        // MSG_NOSIGNAL is `writev` that reports a dead peer as EPIPE instead
        // of raising SIGPIPE, which would kill a host process that does not
        // ignore it.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        iovs[last].iov_len = saved;
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if would_block(&e) {
                // The socket's send timeout is a short tick; the connection
                // is dead only when nothing moved for the whole I/O timeout.
                if clock.idle() > io_timeout {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "send made no progress within the I/O timeout",
                    ));
                }
                continue;
            }
            return Err(e);
        }
        clock.touch();
        let mut written = r as usize;
        while written > 0 {
            let cur = &mut iovs[i];
            if written >= cur.iov_len {
                written -= cur.iov_len;
                cur.iov_len = 0;
                i += 1;
            } else {
                // SAFETY: `written < iov_len`, so the advanced pointer stays
                // inside the same buffer.
                cur.iov_base =
                    unsafe { (cur.iov_base as *mut u8).add(written) } as *mut libc::c_void;
                cur.iov_len -= written;
                written = 0;
            }
        }
    }
    Ok(())
}

/// What a reader does when a receive timeout (`SO_RCVTIMEO`) expires.
/// Idle policy of an exchange that the reader's deadline bounds
/// ([`FrameReader::set_deadline`]): a tick without data just waits on.
pub(crate) struct UntilDeadline;

impl IdlePolicy for UntilDeadline {
    fn on_idle(&mut self, _mid_frame: bool) -> io::Result<()> {
        Ok(())
    }
}

pub(crate) trait IdlePolicy {
    /// Called on each timeout tick; `mid_frame` tells whether a frame's
    /// body is partly read (a header partly read is not). Return an error to abandon the connection.
    fn on_idle(&mut self, mid_frame: bool) -> io::Result<()>;
}

/// Reads frames from a socket, landing payloads directly in memory.
pub(crate) struct FrameReader<'c> {
    fd: RawFd,
    hdr: [u8; HEADER_LEN],
    filled: usize,
    clock: &'c ProgressClock,
    /// Set while reading a part of a frame that more payload follows (a
    /// write list's table): no header read-ahead then.
    no_read_ahead: bool,
    /// Control exchanges (handshakes, descriptor fetches) end by this time
    /// however the peer trickles its bytes; `None` on the data path.
    deadline: Option<std::time::Instant>,
    /// A header read and put back ([`put_back`](Self::put_back)): the next
    /// one [`next_header`](Self::next_header) returns.
    put_back: Option<[u8; HEADER_LEN]>,
    /// The socket's user-space record layer, once found (a socket keeps
    /// it while the reader reads it; looked for again until then, as it
    /// comes after the handshake).
    channel: Option<std::sync::Arc<records::Channel>>,
}

impl<'c> FrameReader<'c> {
    pub(crate) fn new(fd: RawFd, clock: &'c ProgressClock) -> Self {
        Self {
            fd,
            hdr: [0; HEADER_LEN],
            filled: 0,
            clock,
            no_read_ahead: false,
            deadline: None,
            put_back: None,
            channel: None,
        }
    }

    /// The socket's record layer, when it has one.
    fn channel(&mut self) -> Option<std::sync::Arc<records::Channel>> {
        if self.channel.is_none() {
            self.channel = records::of(self.fd);
        }
        self.channel.clone()
    }

    /// Makes every read fail with `TimedOut` from `deadline` on (`None`:
    /// no overall deadline).
    pub(crate) fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.deadline = deadline;
    }

    /// One `readv` into `payload` then the next header's free space.
    ///
    /// # Safety
    /// `payload` must be valid for writes of `payload_len` bytes.
    unsafe fn readv_once(
        &mut self,
        payload: *mut u8,
        payload_len: usize,
        idle: &mut dyn IdlePolicy,
        mid_frame: bool,
    ) -> io::Result<usize> {
        let mut iovs = [iov(payload, payload_len), iov(std::ptr::null(), 0)];
        let mut n = 0;
        if payload_len > 0 {
            n += 1;
        }
        let free = HEADER_LEN - self.filled;
        if free > 0 && !self.no_read_ahead {
            // SAFETY: `filled <= HEADER_LEN`, so the pointer is inside or one
            // past `hdr`, and `free` bytes from it are inside `hdr`.
            iovs[n] = iov(unsafe { self.hdr.as_ptr().add(self.filled) }, free);
            n += 1;
        }
        // SAFETY: the iovecs point into `payload` (valid for writes per the
        // contract) and into `self.hdr`, which we borrow mutably.
        let r = unsafe { self.readv_retry(&iovs[..n], idle, mid_frame)? };
        if r > payload_len {
            self.filled += r - payload_len;
        }
        Ok(r)
    }

    /// One successful `readv` into `iovs`, retried on interruption and,
    /// after asking `idle`, on a timeout. Returns the bytes read (> 0).
    ///
    /// # Safety
    /// Every iovec must be valid for writes for the whole call, and no one
    /// else may access that memory during it (an encrypted socket's
    /// records may be opened in place there).
    unsafe fn readv_retry(
        &mut self,
        iovs: &[libc::iovec],
        idle: &mut dyn IdlePolicy,
        mid_frame: bool,
    ) -> io::Result<usize> {
        // A header put back comes first: no byte after it may be read.
        debug_assert!(self.put_back.is_none());
        let channel = self.channel();
        loop {
            if let Some(d) = self.deadline
                && std::time::Instant::now() >= d
            {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the exchange's deadline passed",
                ));
            }
            let read = match &channel {
                // SAFETY: forwarded contract.
                Some(ch) => unsafe { ch.readv(self.fd, iovs) },
                None => {
                    // SAFETY: forwarded contract.
                    let r =
                        unsafe { libc::readv(self.fd, iovs.as_ptr(), iovs.len() as libc::c_int) };
                    if r < 0 {
                        Err(io::Error::last_os_error())
                    } else {
                        Ok(r as usize)
                    }
                }
            };
            match read {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed the connection",
                    ));
                }
                Ok(n) => {
                    self.clock.touch();
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if would_block(&e) => idle.on_idle(mid_frame)?,
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the next frame has begun to arrive: bytes of its header read
    /// ahead, or the socket readable (or closed, or failed: the read that
    /// follows tells) within `timeout`.
    pub(crate) fn frame_waiting(&self, timeout: std::time::Duration) -> bool {
        if self.filled > 0 || self.put_back.is_some() {
            return true;
        }
        let channel = self.channel.clone().or_else(|| records::of(self.fd));
        if channel.is_some_and(|ch| ch.pending()) {
            return true;
        }
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: one live pollfd and a live timespec; no signal mask.
        unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) > 0 }
    }

    /// Hands each segment of `landings` whose copies into GPU memory have
    /// completed to `report`, in order, until all have or the next frame
    /// begins to arrive (then its segments are read while the copies run).
    /// Copies still gathered are issued once no frame arrives within the
    /// first pause.
    /// Looks at the copies again after pauses growing to 50 µs (a landed
    /// segment is told at most that late), asking `idle` every millisecond
    /// or so (an agent closing ends the wait).
    pub(crate) fn settle<T, E>(
        &self,
        landings: &mut crate::gpu::Landings<T>,
        idle: &mut dyn IdlePolicy,
        on_idle: impl Fn(io::Error) -> E,
        mut report: impl FnMut(T, Result<(), crate::gpu::GpuError>) -> Result<(), E>,
    ) -> Result<(), E> {
        use std::time::Duration;
        const MOST: Duration = Duration::from_micros(50);
        const ASK_IDLE: Duration = Duration::from_millis(1);
        let (mut pause, mut waited) = (Duration::from_micros(5), Duration::ZERO);
        loop {
            while let Some((tag, r)) = landings.next(false) {
                report(tag, r)?;
            }
            if landings.is_empty() || self.frame_waiting(pause) {
                return Ok(());
            }
            // Nothing arriving: the copies still gathered go now (while
            // frames arrive they go a staging buffer at a time).
            landings.flush();
            waited += pause;
            if waited >= ASK_IDLE {
                idle.on_idle(false).map_err(&on_idle)?;
                waited = Duration::ZERO;
            }
            pause = (pause * 2).min(MOST);
        }
    }

    /// Puts `header`, just read by [`next_header`](Self::next_header) and
    /// none of its frame's body yet, back: the next `next_header` returns
    /// it again.
    pub(crate) fn put_back(&mut self, header: [u8; HEADER_LEN]) {
        debug_assert!(self.put_back.is_none());
        self.put_back = Some(header);
    }

    /// Reads the next frame header; `Ok(None)` on a clean close between
    /// frames.
    pub(crate) fn next_header(
        &mut self,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<Option<[u8; HEADER_LEN]>> {
        if let Some(h) = self.put_back.take() {
            return Ok(Some(h));
        }
        while self.filled < HEADER_LEN {
            let mid = self.filled > 0;
            // A header partly in is still "between frames" for `idle`: the
            // whole header must come as if none of it had.
            // SAFETY: a zero-length payload is never written to.
            match unsafe { self.readv_once(std::ptr::null_mut(), 0, idle, false) } {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && !mid => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        self.filled = 0;
        Ok(Some(self.hdr))
    }

    /// Reads exactly `len` payload bytes into `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes for the whole call.
    pub(crate) unsafe fn read_into(
        &mut self,
        dst: *mut u8,
        len: usize,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            // SAFETY: `done < len`, so `dst + done` and the `len - done` bytes
            // after it lie inside the caller's buffer.
            let r = unsafe { self.readv_once(dst.add(done), len - done, idle, true)? };
            done += r.min(len - done);
        }
        Ok(())
    }

    /// Reads exactly `len` bytes of a payload that goes on after them (read
    /// in parts): nothing is read ahead, since the bytes after them are
    /// still payload, not the next header. `last` says the part ends the
    /// payload (then the next header may be read ahead, as by
    /// [`read_into`](Self::read_into)).
    ///
    /// # Safety
    /// As [`read_into`](Self::read_into).
    pub(crate) unsafe fn read_part(
        &mut self,
        dst: *mut u8,
        len: usize,
        last: bool,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<()> {
        let saved = self.no_read_ahead;
        self.no_read_ahead |= !last;
        // SAFETY: forwarded contract.
        let r = unsafe { self.read_into(dst, len, idle) };
        self.no_read_ahead = saved;
        r
    }

    /// Reads `pieces` (pointer, length) back to back from the stream, with
    /// as few `readv` calls as the socket allows (up to 1023 pieces, plus
    /// the next header's free space, per call).
    ///
    /// # Safety
    /// Every piece must be valid for writes of its length for the whole
    /// call.
    pub(crate) unsafe fn read_into_many(
        &mut self,
        pieces: &[(*mut u8, usize)],
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<()> {
        let mut i = 0;
        let mut off = 0;
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(pieces.len().min(1023) + 1);
        while i < pieces.len() {
            iovs.clear();
            let mut want = 0;
            for (k, &(p, len)) in pieces[i..].iter().take(1023).enumerate() {
                let skip = if k == 0 { off } else { 0 };
                // SAFETY: `skip < len` for the first piece (a finished
                // piece is stepped over below), so the pointer stays inside
                // the caller's piece.
                iovs.push(iov(unsafe { p.add(skip) }, len - skip));
                want += len - skip;
            }
            // The next header's free space, only behind the last piece:
            // bytes past a capped list belong to the pieces after it.
            let free = HEADER_LEN - self.filled;
            if free > 0 && !self.no_read_ahead && pieces.len() - i <= 1023 {
                // SAFETY: as in `readv_once`: inside `hdr`.
                iovs.push(iov(unsafe { self.hdr.as_ptr().add(self.filled) }, free));
            }
            // SAFETY: the iovecs point into the caller's pieces (valid for
            // writes per the contract) and into `self.hdr`.
            let r = unsafe { self.readv_retry(&iovs, idle, true)? };
            if r > want {
                self.filled += r - want;
            }
            // Advance over what landed.
            let mut left = r.min(want);
            while left > 0 {
                let rest = pieces[i].1 - off;
                if left >= rest {
                    left -= rest;
                    i += 1;
                    off = 0;
                } else {
                    off += left;
                    left = 0;
                }
            }
        }
        Ok(())
    }

    /// Reads exactly `len` bytes of a checked payload into `dst`, its
    /// trailer after it (no read-ahead), a chunk at a time; returns the
    /// CRC32C of what landed, each chunk summed right after it landed
    /// (still in the core's cache).
    ///
    /// # Safety
    /// As [`read_into`](Self::read_into).
    pub(crate) unsafe fn read_checked(
        &mut self,
        dst: *mut u8,
        len: usize,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<u32> {
        let mut crc = crate::integrity::Crc32c::new();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(crate::integrity::CHECK_CHUNK);
            // SAFETY: `done + n <= len`: inside the caller's buffer.
            let at = unsafe { dst.add(done) };
            // SAFETY: forwarded contract.
            unsafe { self.read_part(at, n, false, idle)? };
            // SAFETY: the chunk was just written, inside the caller's buffer.
            crc.update(unsafe { std::slice::from_raw_parts(at.cast_const(), n) });
            done += n;
        }
        Ok(crc.finish())
    }

    /// Runs `read` with no read-ahead into the next header: more of the
    /// same frame follows what it reads (a checked frame's trailer).
    pub(crate) fn mid_frame<R>(&mut self, read: impl FnOnce(&mut Self) -> R) -> R {
        let saved = std::mem::replace(&mut self.no_read_ahead, true);
        let r = read(self);
        self.no_read_ahead = saved;
        r
    }

    /// Reads `len` bytes that more of the same frame follows (no header
    /// read-ahead) into a new vector.
    pub(crate) fn read_vec_mid_frame(
        &mut self,
        len: usize,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<Vec<u8>> {
        self.no_read_ahead = true;
        let r = self.read_vec(len, idle);
        self.no_read_ahead = false;
        r
    }

    /// Reads a control body of `len` bytes into a new vector.
    pub(crate) fn read_vec(
        &mut self,
        len: usize,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        // SAFETY: `v` owns `len` initialised bytes, valid for writes.
        unsafe { self.read_into(v.as_mut_ptr(), len, idle)? };
        Ok(v)
    }

    /// Reads exactly `buf.len()` payload bytes into `buf`; `more`: the
    /// frame's payload goes on after them (no read-ahead into the next
    /// header).
    pub(crate) fn read_chunk(
        &mut self,
        buf: &mut [u8],
        more: bool,
        idle: &mut dyn IdlePolicy,
    ) -> io::Result<()> {
        self.no_read_ahead = more;
        // SAFETY: `buf` is a live exclusive slice of `buf.len()` bytes.
        let r = unsafe { self.read_into(buf.as_mut_ptr(), buf.len(), idle) };
        self.no_read_ahead = false;
        r
    }

    /// Reads and drops `len` bytes (the payload of a refused segment).
    /// Only the last piece may read ahead into the next header: bytes past
    /// an earlier piece are still this payload's.
    pub(crate) fn discard(&mut self, mut len: u64, idle: &mut dyn IdlePolicy) -> io::Result<()> {
        let mut scratch = vec![0u8; (64 << 10).min(len) as usize];
        while len > 0 {
            let n = len.min(scratch.len() as u64) as usize;
            self.no_read_ahead = (n as u64) < len;
            // SAFETY: `scratch` owns at least `n` bytes, valid for writes.
            let r = unsafe { self.read_into(scratch.as_mut_ptr(), n, idle) };
            self.no_read_ahead = false;
            r?;
            len -= n as u64;
        }
        Ok(())
    }
}

/// `e` as the agent's error: [`Error::Timeout`] for `what` after `after`
/// when it timed out, else `other(e)`.
pub(in crate::engine) fn timeout_or(
    e: io::Error,
    what: &'static str,
    after: Duration,
    other: impl FnOnce(io::Error) -> Error,
) -> Error {
    if e.kind() == io::ErrorKind::TimedOut {
        Error::Timeout { what, after }
    } else {
        other(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    struct Never;
    impl IdlePolicy for Never {
        fn on_idle(&mut self, _mid_frame: bool) -> io::Result<()> {
            Err(io::Error::new(io::ErrorKind::TimedOut, "test stalled"))
        }
    }

    /// A refused payload of any length is skipped exactly: the header
    /// after it is read whole, however the pieces of the skip fall.
    #[test]
    fn discard_stops_at_the_next_header() {
        for len in [1usize, 4095, 64 << 10, (64 << 10) + 1, 200_000, 1 << 20] {
            let (mut w, r) = UnixStream::pair().unwrap();
            r.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            let writer = std::thread::spawn(move || {
                w.write_all(&vec![0xEE; len]).unwrap();
                w.write_all(&[0x42; HEADER_LEN]).unwrap();
            });
            let clock = ProgressClock::new();
            let mut reader = FrameReader::new(r.as_raw_fd(), &clock);
            reader.discard(len as u64, &mut Never).unwrap();
            let h = reader.next_header(&mut Never).unwrap().unwrap();
            assert_eq!(h, [0x42; HEADER_LEN], "after {len} bytes");
            writer.join().unwrap();
        }
    }
}
