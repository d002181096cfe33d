//! Encrypted connections in user space, for kernels without TLS (and when
//! `KVXFER_KTLS=0` asks for it): the TLS 1.3 records that kernel TLS makes
//! (see [`super::ktls`]) — application data, AES-128-GCM, the record header
//! as associated data, nonces the IV XOR the record's sequence number from
//! 0 — sealed here before `sendmsg` and opened here after `read`, so the
//! wire is the same whichever side does it.
//!
//! A socket's [`Channel`] is found by its descriptor in a table of this
//! process ([`of`]), checked against the socket's cookie (`SO_COOKIE`,
//! unique while the system runs), so a descriptor number reused by another
//! socket after the first closed is never taken for it; the stream code
//! ([`super::sock`]) asks for it on every write and read, and goes straight
//! to the kernel when the table is empty. Writes hold the channel's sending
//! side for the whole call (records of one call stay in order and whole);
//! reads hold its receiving side, which keeps what was read beyond the
//! reader's buffers (a record's rest, opened, and the next records) for the
//! next read.
//!
//! What this costs over the kernel's, beside the cipher itself: small
//! parts (iovecs) are copied into the sending buffer to share records,
//! sealed there; a part of a record or more is sealed straight from the
//! caller's memory into the buffer, in records of its own, the last one
//! short, so that a reader whose memory for it is that large takes its
//! records there and opens them in place (see [`Channel::readv`]); only
//! the short records, and the bytes of reads into smaller memory, are
//! copied out of the reader's buffer.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use aws_lc_rs::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};

use crate::auth::DirectionKey;
use crate::engine::lock;
use crate::engine::sock::{ProgressClock, iov, writev_plain};

/// Most plaintext bytes in a record (TLS 1.3).
const RECORD_MAX: usize = 1 << 14;
/// A record's header: type, legacy version (2), length (u16 BE).
const HEADER: usize = 5;
/// AES-GCM's tag.
const TAG: usize = 16;
/// What a record adds to its plaintext: header, inner type, tag.
const OVERHEAD: usize = HEADER + 1 + TAG;
/// Longest record body taken from a peer: the plaintext, its inner type,
/// the tag and the padding TLS 1.3 allows (RFC 8446 §5.2).
const BODY_MAX: usize = RECORD_MAX + 256;
/// The content type of application data.
const APPLICATION_DATA: u8 = 23;
/// A part (iovec) of this many bytes or more is sealed in records of its
/// own, which a reader can open where they land; smaller parts share
/// records.
const OWN_RECORDS: usize = RECORD_MAX;
/// Sealed bytes sent per `sendmsg` (at least).
const SEND_BATCH: usize = 256 << 10;
/// The sending buffer: a batch and one more record of the longest.
const SEND_ROOM: usize = SEND_BATCH + HEADER + RECORD_MAX + 1 + TAG;
/// The most bytes asked of the socket per `read` into the buffer.
const READ_CHUNK: usize = 256 << 10;
/// Where in the receiving buffer bytes read past the caller's memory go:
/// after room for a record's part moved in front of them.
const SPILL_AT: usize = HEADER + BODY_MAX;

/// One direction's key and sequence.
struct Direction {
    key: LessSafeKey,
    iv: [u8; 12],
    seq: u64,
}

impl Direction {
    fn new(k: &DirectionKey) -> Self {
        let key = UnboundKey::new(&AES_128_GCM, &k.key).expect("a 16-byte AES-128-GCM key");
        Self {
            key: LessSafeKey::new(key),
            iv: k.iv,
            seq: 0,
        }
    }

    /// The next record's nonce: the IV XOR its sequence number (64-bit
    /// big-endian, in the IV's last 8 bytes).
    fn next_nonce(&mut self) -> Nonce {
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq += 1;
        Nonce::assume_unique_for_key(n)
    }
}

struct Sending {
    dir: Direction,
    /// Records sealed, not yet sent (`SEND_ROOM` bytes once first used).
    buf: Vec<u8>,
}

struct Receiving {
    dir: Direction,
    /// Bytes read from the socket: `[start, end)` not yet taken apart into
    /// records.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The opened plaintext of the last record not yet handed out (in
    /// `buf`, before `start`).
    plain: Range<usize>,
}

impl Receiving {
    /// Reads records into `dst` and opens each whole one there, its
    /// plaintext moved down to follow the previous one's; returns the
    /// plaintext bytes now at the start of `dst` (`Ok(Some(0))`: the peer
    /// closed between records). The bytes this channel held (no more than
    /// `dst` has) go first. Each read also asks for the headers and tags
    /// that the records filling the rest of `dst` add, as this module's
    /// writer cuts them, into `buf`: so the record cut short at the end of
    /// `dst` usually arrives whole in the same call, and is held, opened
    /// at the next read, with anything else read past the last whole
    /// record in `dst`. `Ok(None)`: nothing opened yet, all held.
    fn read_in_place(&mut self, fd: RawFd, dst: &mut [u8]) -> io::Result<Option<usize>> {
        let held = self.end - self.start;
        dst[..held].copy_from_slice(&self.buf[self.start..self.end]);
        (self.start, self.end) = (0, 0);
        // `dst[..out]`: plaintext; `dst[pos..raw]`: records read, not
        // opened; `buf[SPILL_AT..][..spilled]`: read past `dst`.
        let (mut out, mut pos, mut raw, mut spilled) = (0, 0, held, 0);
        let result = loop {
            while let Some(body) = record_at(&dst[pos..raw])? {
                out += open_record(&mut self.dir, dst, pos, body, out)?;
                pos += HEADER + body;
            }
            if out > 0 {
                break Ok(Some(out));
            }
            if spilled > 0 {
                break Ok(None);
            }
            if raw == dst.len() {
                // Full of records without plaintext and part of another
                // (`dst` holds the longest record whole, so `pos > 0`).
                dst.copy_within(pos..raw, 0);
                (pos, raw) = (0, raw - pos);
            }
            let room = dst.len() - raw;
            let spill = overhead_of(room).min(READ_CHUNK);
            let iovs = [
                iov(dst[raw..].as_mut_ptr(), room),
                iov(self.buf[SPILL_AT..].as_mut_ptr(), spill),
            ];
            // SAFETY: the iovecs lie in `dst` and in `buf` (`SPILL_AT +
            // READ_CHUNK` is its length), both ours for the call.
            let n = unsafe { libc::readv(fd, iovs.as_ptr(), 2) };
            match n {
                0 if pos == raw => break Ok(Some(0)),
                0 => break Err(eof_inside_record()),
                n if n < 0 => break Err(io::Error::last_os_error()),
                n => {
                    let n = n as usize;
                    raw += n.min(room);
                    spilled = n.saturating_sub(room);
                }
            }
        };
        // What is left in `dst` (part of a record) goes before what
        // spilled past it.
        let rest = raw - pos;
        (self.start, self.end) = (SPILL_AT - rest, SPILL_AT + spilled);
        self.buf[self.start..SPILL_AT].copy_from_slice(&dst[pos..raw]);
        result
    }
}

/// The bytes that headers, inner types and tags add to `len` bytes of a
/// part sealed in records of its own (see [`tail_len`]).
fn overhead_of(len: usize) -> usize {
    let main = len.saturating_sub(tail_len(len));
    OVERHEAD * (main.div_ceil(RECORD_MAX) + 1)
}

/// Opens the record whose header starts at `buf[at]` (its body `body`
/// bytes), writing its plaintext from `buf[to]` (`to <= at + HEADER`);
/// returns the plaintext's length without its inner type and padding.
fn open_record(
    dir: &mut Direction,
    buf: &mut [u8],
    at: usize,
    body: usize,
    to: usize,
) -> io::Result<usize> {
    let mut aad = [0u8; HEADER];
    aad.copy_from_slice(&buf[at..at + HEADER]);
    let end = at + HEADER + body;
    let nonce = dir.next_nonce();
    // Opened where it lies, then moved down to `to` (from cache).
    let Ok(opened) =
        dir.key
            .open_within(nonce, Aad::from(aad), &mut buf[to..end], at + HEADER - to..)
    else {
        // What failed may have been decrypted in part: none of it stays.
        buf[to..end].fill(0);
        return Err(io::Error::from_raw_os_error(libc::EBADMSG));
    };
    // The inner type is the last byte that is not padding.
    let len = opened
        .iter()
        .rposition(|&b| b != 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "a record of padding only"))?;
    if opened[len] != APPLICATION_DATA {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a record that is not application data",
        ));
    }
    Ok(len)
}

fn eof_inside_record() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the peer closed the connection inside a record",
    )
}

/// Writes the header of a record of `plain` plaintext bytes in `out`;
/// returns it (the associated data).
fn header(out: &mut [u8], plain: usize) -> [u8; HEADER] {
    let [hi, lo] = ((plain + 1 + TAG) as u16).to_be_bytes();
    let h = [APPLICATION_DATA, 3, 3, hi, lo];
    out[..HEADER].copy_from_slice(&h);
    h
}

/// Seals `plain` (at most a record's) into a record at the start of `out`
/// without copying it first: header, ciphertext, inner type, tag; returns
/// the record's length.
fn seal_from(dir: &mut Direction, out: &mut [u8], plain: &[u8]) -> io::Result<usize> {
    let n = plain.len();
    let aad = header(out, n);
    let (body, rest) = out[HEADER..].split_at_mut(n);
    let nonce = dir.next_nonce();
    dir.key
        .seal_out_of_place_scatter(
            nonce,
            Aad::from(aad),
            plain,
            body,
            &[APPLICATION_DATA],
            &mut rest[..1 + TAG],
        )
        .map_err(|_| io::Error::other("sealing a record failed"))?;
    Ok(HEADER + n + 1 + TAG)
}

/// Seals the record at the start of `out` whose `plain` plaintext bytes
/// follow its header's room, in place; returns the record's length.
fn seal_here(dir: &mut Direction, out: &mut [u8], plain: usize) -> io::Result<usize> {
    let aad = header(out, plain);
    let (body, rest) = out[HEADER..].split_at_mut(plain);
    let nonce = dir.next_nonce();
    dir.key
        .seal_in_place_scatter(
            nonce,
            Aad::from(aad),
            body,
            &[APPLICATION_DATA],
            &mut rest[..1 + TAG],
        )
        .map_err(|_| io::Error::other("sealing a record failed"))?;
    Ok(HEADER + plain + 1 + TAG)
}

/// The plaintext bytes of the last record of a part of `len` bytes that
/// gets records of its own: more than the headers, inner types and tags
/// of all its records, so that its other records, read into the reader's
/// memory for the part (see [`Channel::readv`]), fit there whole and open
/// in place; only this short one is read and opened apart. At most half
/// a record: a longer part is read in place a socket's worth at a time
/// anyway.
fn tail_len(len: usize) -> usize {
    let overhead = OVERHEAD * (len.div_ceil(RECORD_MAX) + 1);
    (overhead + 64).min(RECORD_MAX / 2).min(len / 2)
}

/// A socket's user-space record layer.
pub(in crate::engine) struct Channel {
    cookie: u64,
    send: Mutex<Sending>,
    recv: Mutex<Receiving>,
}

/// Whether any socket has a channel (else nothing is looked up).
static ANY: AtomicBool = AtomicBool::new(false);

fn table() -> &'static RwLock<HashMap<RawFd, Arc<Channel>>> {
    static TABLE: OnceLock<RwLock<HashMap<RawFd, Arc<Channel>>>> = OnceLock::new();
    TABLE.get_or_init(RwLock::default)
}

/// The cookie the kernel gave socket `fd` (unique while the system runs).
fn cookie(fd: RawFd) -> io::Result<u64> {
    let mut c: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `c` is a live u64 and `len` its size, for the call.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            std::ptr::from_mut(&mut c).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(c)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Gives socket `fd` a channel that seals what it sends with `tx` and opens
/// what it reads with `rx`. Nothing may have been sent or read past the
/// handshake yet.
///
/// # Errors
/// `fd` is not a socket.
pub(in crate::engine) fn install(
    fd: RawFd,
    tx: &DirectionKey,
    rx: &DirectionKey,
) -> io::Result<()> {
    let ch = Channel {
        cookie: cookie(fd)?,
        send: Mutex::new(Sending {
            dir: Direction::new(tx),
            buf: Vec::new(),
        }),
        recv: Mutex::new(Receiving {
            dir: Direction::new(rx),
            buf: Vec::new(),
            start: 0,
            end: 0,
            plain: 0..0,
        }),
    };
    let mut t = table().write().unwrap_or_else(|p| p.into_inner());
    // Channels of sockets closed since go (their descriptors reused by
    // sockets of other cookies, or by none), whenever the table has doubled
    // since they last went: a cookie asked per entry, amortised.
    static PRUNE_AT: AtomicUsize = AtomicUsize::new(64);
    if t.len() >= PRUNE_AT.load(Ordering::Relaxed) {
        t.retain(|&f, c| cookie(f).is_ok_and(|k| k == c.cookie));
        PRUNE_AT.store((2 * t.len()).max(64), Ordering::Relaxed);
    }
    t.insert(fd, Arc::new(ch));
    ANY.store(true, Ordering::Release);
    Ok(())
}

/// Socket `fd`'s channel, when it has one.
pub(in crate::engine) fn of(fd: RawFd) -> Option<Arc<Channel>> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let ch = {
        let t = table().read().unwrap_or_else(|p| p.into_inner());
        Arc::clone(t.get(&fd)?)
    };
    // A descriptor closed and reused is another socket: its entry goes.
    if cookie(fd).is_ok_and(|k| k == ch.cookie) {
        return Some(ch);
    }
    let mut t = table().write().unwrap_or_else(|p| p.into_inner());
    if t.get(&fd).is_some_and(|c| Arc::ptr_eq(c, &ch)) {
        t.remove(&fd);
    }
    None
}

impl Channel {
    /// Sends every byte `iovs` describe, sealed in records, as
    /// [`super::sock::writev_all`] sends them in the clear.
    ///
    /// # Safety
    /// Every iovec must describe memory valid for reads for the whole call.
    pub(in crate::engine) unsafe fn writev_all(
        &self,
        fd: RawFd,
        iovs: &[libc::iovec],
        clock: &ProgressClock,
        io_timeout: std::time::Duration,
    ) -> io::Result<()> {
        let mut s = lock(&self.send);
        let Sending { dir, buf } = &mut *s;
        if buf.is_empty() {
            *buf = vec![0; SEND_ROOM];
        }
        let parts = iovs.iter().filter(|v| v.iov_len > 0).map(|v| {
            // SAFETY: valid for reads for the call (this function's
            // contract).
            unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) }
        });
        // `buf[..len]`: sealed, not sent; a record being filled with small
        // parts starts at `open` (its plaintext from `open + HEADER` to
        // `len`).
        let (mut len, mut open) = (0, None::<usize>);
        let send = |buf: &[u8], len: &mut usize| {
            let mut one = [iov(buf.as_ptr(), *len)];
            // SAFETY: `buf` is this function's, alive for the call.
            unsafe { writev_plain(fd, &mut one, clock, io_timeout)? };
            *len = 0;
            io::Result::Ok(())
        };
        // Seals the record being filled; sends what is sealed once it is a
        // batch.
        let close = |dir: &mut Direction, buf: &mut [u8], len: &mut usize, at: usize| {
            *len = at + seal_here(dir, &mut buf[at..], *len - at - HEADER)?;
            if *len >= SEND_BATCH {
                send(buf, len)?;
            }
            io::Result::Ok(())
        };
        for part in parts {
            if part.len() >= OWN_RECORDS {
                // Records of its own, the last short (see `tail_len`),
                // sealed from where the part lies.
                if let Some(at) = open.take() {
                    close(dir, buf, &mut len, at)?;
                }
                let (main, tail) = part.split_at(part.len() - tail_len(part.len()));
                for chunk in main.chunks(RECORD_MAX).chain([tail]) {
                    len += seal_from(dir, &mut buf[len..], chunk)?;
                    if len >= SEND_BATCH {
                        send(buf, &mut len)?;
                    }
                }
                continue;
            }
            let mut part = part;
            while !part.is_empty() {
                let at = *open.get_or_insert_with(|| {
                    len += HEADER;
                    len - HEADER
                });
                let take = part.len().min(RECORD_MAX - (len - at - HEADER));
                buf[len..len + take].copy_from_slice(&part[..take]);
                len += take;
                part = &part[take..];
                if len - at - HEADER == RECORD_MAX {
                    close(dir, buf, &mut len, at)?;
                    open = None;
                }
            }
        }
        if let Some(at) = open {
            len = at + seal_here(dir, &mut buf[at..], len - at - HEADER)?;
        }
        if len > 0 {
            send(buf, &mut len)?;
        }
        Ok(())
    }

    /// Reads into `iovs` as `readv` does: the plaintext of the records
    /// that arrive, at least one byte; `Ok(0)` when the peer closed
    /// between records; the socket's errors as they are (a receive timeout
    /// as `WouldBlock`); a record that does not open (changed on the way)
    /// is `EBADMSG`, as kernel TLS reports it.
    ///
    /// When the first iovec holds a record of the longest kind, the
    /// records are read into it and opened where they lie, each record's
    /// plaintext then moved down over the headers and tags before it
    /// (within that memory, from cache); its bytes past what is returned are then
    /// unspecified (as in a buffer a `read` fills in part). Otherwise they
    /// are read into the channel's buffer, opened there and copied out.
    ///
    /// # Safety
    /// Every iovec must be valid for writes for the whole call, and no one
    /// else may read or write that memory during the call.
    pub(in crate::engine) unsafe fn readv(
        &self,
        fd: RawFd,
        iovs: &[libc::iovec],
    ) -> io::Result<usize> {
        let mut guard = lock(&self.recv);
        let r = &mut *guard;
        if r.buf.is_empty() {
            r.buf = vec![0; SPILL_AT + READ_CHUNK];
        }
        loop {
            if !r.plain.is_empty() {
                let mut done = 0;
                for v in iovs {
                    let n = v.iov_len.min(r.plain.len());
                    if n == 0 {
                        continue;
                    }
                    // SAFETY: `v` is valid for writes of `iov_len` bytes (this
                    // function's contract), `n` of them; the source is
                    // inside `buf`, which `v` cannot overlap (it is ours).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            r.buf.as_ptr().add(r.plain.start),
                            v.iov_base.cast::<u8>(),
                            n,
                        );
                    }
                    r.plain.start += n;
                    done += n;
                    if r.plain.is_empty() {
                        break;
                    }
                }
                return Ok(done);
            }
            if let Some(v) = iovs.iter().find(|v| v.iov_len > 0)
                && v.iov_len >= HEADER + BODY_MAX
                && r.end - r.start <= v.iov_len
            {
                // SAFETY: valid for writes and ours alone for the call
                // (this function's contract); it cannot overlap `buf`,
                // which is the channel's.
                let dst = unsafe { std::slice::from_raw_parts_mut(v.iov_base.cast(), v.iov_len) };
                match r.read_in_place(fd, dst)? {
                    Some(n) => return Ok(n),
                    None => continue,
                }
            }
            if let Some(body) = record_at(&r.buf[r.start..r.end])? {
                let at = r.start;
                r.start += HEADER + body;
                let len = open_record(&mut r.dir, &mut r.buf, at, body, at + HEADER)?;
                r.plain = at + HEADER..at + HEADER + len;
                continue;
            }
            // More bytes: what is left of a record moves to the front.
            if r.start == r.end {
                (r.start, r.end) = (0, 0);
            } else if r.start > 0 && r.buf.len() - r.end < HEADER + BODY_MAX {
                r.buf.copy_within(r.start..r.end, 0);
                (r.start, r.end) = (0, r.end - r.start);
            }
            // When a later iovec could take records in place, no more than
            // the record begun (or one of the longest): what follows it
            // is read there. Otherwise what the reader asked for.
            let held = r.end - r.start;
            let want = if iovs.iter().any(|v| v.iov_len >= HEADER + BODY_MAX) {
                match r.buf[r.start..r.end].first_chunk::<HEADER>() {
                    Some(h) => HEADER + usize::from(u16::from_be_bytes([h[3], h[4]])) - held,
                    None => HEADER + BODY_MAX - held,
                }
            } else {
                iovs.iter().map(|v| v.iov_len).sum::<usize>()
            };
            let room = (r.buf.len() - r.end).min(READ_CHUNK).min(want.max(1));
            // SAFETY: `room` bytes from `end` lie inside `buf`.
            let n = unsafe { libc::read(fd, r.buf.as_mut_ptr().add(r.end).cast(), room) };
            match n {
                0 if r.start == r.end => return Ok(0),
                0 => return Err(eof_inside_record()),
                n if n < 0 => return Err(io::Error::last_os_error()),
                n => r.end += n as usize,
            }
        }
    }

    /// Whether bytes read from the socket wait here (opened, or of
    /// records not yet opened).
    pub(in crate::engine) fn pending(&self) -> bool {
        let r = lock(&self.recv);
        !r.plain.is_empty() || r.start < r.end
    }
}

/// The length of the body of the record that `b` starts with, when `b`
/// holds all of it; `None` when more bytes are needed.
///
/// # Errors
/// A header that is no TLS 1.3 application record's, or of a length out of
/// bounds.
fn record_at(b: &[u8]) -> io::Result<Option<usize>> {
    let Some(h) = b.first_chunk::<HEADER>() else {
        return Ok(None);
    };
    if h[0] != APPLICATION_DATA || h[1..3] != [3, 3] {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a TLS 1.3 application record",
        ));
    }
    let body = usize::from(u16::from_be_bytes([h[3], h[4]]));
    if !(TAG + 1..=BODY_MAX).contains(&body) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a record of {body} bytes"),
        ));
    }
    Ok((b.len() >= HEADER + body).then_some(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::Duration;

    fn key(b: u8) -> DirectionKey {
        DirectionKey {
            key: [b; 16],
            iv: [b.wrapping_add(1); 12],
        }
    }

    /// A connected pair, each end with a receive timeout (reads then fail
    /// `WouldBlock` when nothing comes).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
        }
        (a, b)
    }

    fn send(fd: RawFd, parts: &[&[u8]]) {
        let iovs: Vec<_> = parts.iter().map(|p| iov(p.as_ptr(), p.len())).collect();
        let ch = of(fd).unwrap();
        // SAFETY: the iovecs point into `parts`, alive for the call.
        unsafe { ch.writev_all(fd, &iovs, &ProgressClock::new(), Duration::from_secs(5)) }.unwrap();
    }

    /// Reads `len` bytes in calls of at most `step` bytes, over two iovecs.
    fn receive(fd: RawFd, len: usize, step: usize) -> io::Result<Vec<u8>> {
        let ch = of(fd).unwrap();
        let mut out = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = step.min(len - got);
            let half = n / 2;
            let iovs = [
                iov(out[got..].as_mut_ptr(), half),
                iov(out[got + half..].as_mut_ptr(), n - half),
            ];
            // SAFETY: both iovecs point into `out`, within its length.
            let r = unsafe { ch.readv(fd, &iovs) }?;
            assert!(r > 0 && r <= n, "{r} of {n}");
            got += r;
        }
        Ok(out)
    }

    #[test]
    fn what_is_sealed_one_side_opens_the_other_in_any_cut() {
        let (a, b) = pair();
        install(a.as_raw_fd(), &key(1), &key(2)).unwrap();
        install(b.as_raw_fd(), &key(2), &key(1)).unwrap();
        let data: Vec<u8> = (0..(1 << 20) + 7).map(|i| (i * 31 % 251) as u8).collect();
        // Across iovecs and record boundaries, empty parts, one byte.
        let cuts: &[&[u8]] = &[
            &data[..1],
            &[],
            &data[1..RECORD_MAX - 1],
            &data[RECORD_MAX - 1..RECORD_MAX + 2],
            &data[RECORD_MAX + 2..],
        ];
        let writer = std::thread::spawn({
            let fd = a.as_raw_fd();
            let cuts: Vec<Vec<u8>> = cuts.iter().map(|c| c.to_vec()).collect();
            move || {
                let parts: Vec<&[u8]> = cuts.iter().map(Vec::as_slice).collect();
                send(fd, &parts);
            }
        });
        let got = receive(b.as_raw_fd(), data.len(), 5000).unwrap();
        writer.join().unwrap();
        assert!(got == data);
        // The other way, and in bigger reads.
        send(b.as_raw_fd(), &[&data[..300_000]]);
        assert!(receive(a.as_raw_fd(), 300_000, 1 << 20).unwrap() == data[..300_000]);
        // Nothing more: the read times out as the socket's would.
        let e = receive(a.as_raw_fd(), 1, 1).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
        assert!(!of(a.as_raw_fd()).unwrap().pending());
    }

    /// Reads `len` bytes into scattered buffers of `piece` bytes each
    /// (every other one of twice as many, so none follows another in
    /// memory), `piece` bytes asked per call as a frame reader asks.
    fn receive_scattered(fd: RawFd, len: usize, piece: usize) -> io::Result<Vec<u8>> {
        let ch = of(fd).unwrap();
        let mut mem = vec![0u8; 2 * len.div_ceil(piece) * piece];
        let mut got = 0;
        while got < len {
            let (i, at) = (got / piece, got % piece);
            let n = (piece - at).min(len - got);
            let start = 2 * i * piece + at;
            let iovs = [iov(mem[start..].as_mut_ptr(), n)];
            // SAFETY: the iovec points into `mem`, within its length.
            let r = unsafe { ch.readv(fd, &iovs) }?;
            assert!(r > 0 && r <= n, "{r} of {n}");
            got += r;
        }
        Ok(mem
            .chunks(piece)
            .step_by(2)
            .flatten()
            .take(len)
            .copied()
            .collect())
    }

    /// Records sealed with `k`, one for each `(plaintext, padding)`.
    fn records(k: &DirectionKey, plaintexts: &[(&[u8], usize)]) -> Vec<u8> {
        let mut dir = Direction::new(k);
        let mut buf = Vec::new();
        for (p, padding) in plaintexts {
            let at = buf.len();
            buf.extend_from_slice(&[APPLICATION_DATA, 3, 3, 0, 0]);
            buf.extend_from_slice(p);
            buf.push(APPLICATION_DATA);
            buf.resize(buf.len() + padding, 0);
            let len = (buf.len() - at - HEADER + TAG) as u16;
            buf[at + 3..at + HEADER].copy_from_slice(&len.to_be_bytes());
            let aad: [u8; HEADER] = buf[at..at + HEADER].try_into().unwrap();
            let nonce = dir.next_nonce();
            let tag = dir
                .key
                .seal_in_place_separate_tag(nonce, Aad::from(aad), &mut buf[at + HEADER..])
                .unwrap();
            buf.extend_from_slice(tag.as_ref());
        }
        buf
    }

    #[test]
    fn a_large_part_has_records_of_its_own_read_where_they_land() {
        let (a, mut b) = pair();
        install(a.as_raw_fd(), &key(1), &key(2)).unwrap();
        let part: Vec<u8> = (0..65536).map(|i| (i * 7 % 253) as u8).collect();
        // On the wire: the small part's record, then the large part's:
        // full ones and a short last one, none shared with the small parts
        // around it.
        send(a.as_raw_fd(), &[&[1u8; 40], &part, &[2u8; 40]]);
        let tail = tail_len(part.len());
        let sizes = [
            40,
            RECORD_MAX,
            RECORD_MAX,
            RECORD_MAX,
            RECORD_MAX - tail,
            tail,
            40,
        ];
        let mut wire = vec![0u8; sizes.iter().map(|n| HEADER + n + 1 + TAG).sum()];
        std::io::Read::read_exact(&mut b, &mut wire).unwrap();
        let mut at = 0;
        for n in sizes {
            let body = record_at(&wire[at..]).unwrap().unwrap();
            assert_eq!(body, n + 1 + TAG);
            at += HEADER + body;
        }
        assert_eq!(
            overhead_of(part.len()),
            (sizes.len() - 2) * (HEADER + 1 + TAG)
        );

        // Read into memory of the part's size: every record but the last
        // opens in place, in one call, whose reads took the last one too.
        let (c, d) = pair();
        install(c.as_raw_fd(), &key(3), &key(4)).unwrap();
        install(d.as_raw_fd(), &key(4), &key(3)).unwrap();
        send(c.as_raw_fd(), &[&part, &[9u8; 100]]);
        let ch = of(d.as_raw_fd()).unwrap();
        let mut mem = vec![0u8; part.len()];
        let iovs = [iov(mem.as_mut_ptr(), mem.len())];
        // SAFETY: the iovec is `mem`.
        let n = unsafe { ch.readv(d.as_raw_fd(), &iovs) }.unwrap();
        assert_eq!(n, part.len() - tail);
        assert!(mem[..n] == part[..n]);
        {
            let r = lock(&ch.recv);
            assert_eq!(
                record_at(&r.buf[r.start..r.end]).unwrap(),
                Some(tail + 1 + TAG),
                "the last record held whole"
            );
        }
        let rest = receive(d.as_raw_fd(), tail + 100, 1 << 20).unwrap();
        assert!(rest[..tail] == part[n..]);
        assert_eq!(rest[tail..], [9u8; 100]);
    }

    #[test]
    fn any_cut_of_records_opens_in_place_in_scattered_memory() {
        let (a, b) = pair();
        install(a.as_raw_fd(), &key(5), &key(6)).unwrap();
        install(b.as_raw_fd(), &key(6), &key(5)).unwrap();
        let data: Vec<u8> = (0..(3 << 20) + 11).map(|i| (i * 13 % 241) as u8).collect();
        for piece in [RECORD_MAX + 300, 65536, 100_000, 1 << 20] {
            // Parts of this module's writer, large and small.
            let writer = std::thread::spawn({
                let fd = a.as_raw_fd();
                let data = data.clone();
                move || {
                    let parts: Vec<&[u8]> = data.chunks(piece / 3 + 1).collect();
                    send(fd, &parts);
                }
            });
            let got = receive_scattered(b.as_raw_fd(), data.len(), piece).unwrap();
            writer.join().unwrap();
            assert!(got == data, "pieces of {piece}");
        }
        // Records cut as another writer cuts them (kernel TLS: full ones
        // across parts), records without plaintext, padding: all the same.
        let (mut c, d) = pair();
        install(d.as_raw_fd(), &key(7), &key(8)).unwrap();
        let r = RECORD_MAX;
        let wire = records(
            &key(8),
            &[
                (&data[..r], 0),
                (&[], 0),
                (&[], 200),
                (&data[r..r + 1000], 255),
                (&data[r + 1000..2 * r + 1000], 0),
                (&data[2 * r + 1000..3 * r], 0),
            ],
        );
        let writer = std::thread::spawn(move || std::io::Write::write_all(&mut c, &wire));
        let got = receive_scattered(d.as_raw_fd(), 3 * RECORD_MAX, 40_000).unwrap();
        writer.join().unwrap().unwrap();
        assert!(got == data[..3 * RECORD_MAX]);
    }

    #[test]
    fn a_changed_byte_in_a_record_opened_in_place_fails_the_read() {
        let (a, mut b) = pair();
        install(a.as_raw_fd(), &key(1), &key(2)).unwrap();
        send(a.as_raw_fd(), &[&[7u8; 65536]]);
        let mut wire = vec![0u8; 65536 + overhead_of(65536)];
        std::io::Read::read_exact(&mut b, &mut wire).unwrap();
        for at in [
            3,
            HEADER + 1,
            2 * HEADER + RECORD_MAX + 1 + TAG + 5,
            wire.len() - 1,
        ] {
            let (mut c, d) = pair();
            install(d.as_raw_fd(), &key(9), &key(1)).unwrap();
            let mut bad = wire.clone();
            bad[at] ^= 0x01;
            std::io::Write::write_all(&mut c, &bad).unwrap();
            let e = receive_scattered(d.as_raw_fd(), 65536, 65536).unwrap_err();
            assert!(
                e.raw_os_error() == Some(libc::EBADMSG) || e.kind() == io::ErrorKind::InvalidData,
                "byte {at}: {e}"
            );
        }
    }

    #[test]
    fn a_changed_byte_or_another_key_fails_the_read() {
        // The records on the wire, read raw from the far end.
        let (a, mut b) = pair();
        install(a.as_raw_fd(), &key(3), &key(4)).unwrap();
        send(a.as_raw_fd(), &[&[7u8; 100]]);
        let mut wire = vec![0u8; HEADER + 100 + 1 + TAG];
        std::io::Read::read_exact(&mut b, &mut wire).unwrap();
        assert_eq!(wire[..HEADER], [23, 3, 3, 0, 117]);
        assert!(
            !wire.windows(16).any(|w| w == [7u8; 16]),
            "sent in the clear"
        );
        // Replayed to a reader with the right key, each byte changed once.
        for at in [0, 4, HEADER, HEADER + 50, wire.len() - 1] {
            let (mut c, d) = pair();
            install(d.as_raw_fd(), &key(9), &key(3)).unwrap();
            let mut bad = wire.clone();
            bad[at] ^= 0x10;
            std::io::Write::write_all(&mut c, &bad).unwrap();
            let e = receive(d.as_raw_fd(), 100, 100).unwrap_err();
            assert!(
                e.raw_os_error() == Some(libc::EBADMSG)
                    || e.kind() == io::ErrorKind::InvalidData
                    || e.kind() == io::ErrorKind::WouldBlock,
                "byte {at}: {e}"
            );
        }
        // Unchanged, it opens; under another key it does not.
        let (mut c, d) = pair();
        install(d.as_raw_fd(), &key(9), &key(3)).unwrap();
        std::io::Write::write_all(&mut c, &wire).unwrap();
        assert_eq!(receive(d.as_raw_fd(), 100, 100).unwrap(), [7u8; 100]);
        let (mut c, d) = pair();
        install(d.as_raw_fd(), &key(9), &key(5)).unwrap();
        std::io::Write::write_all(&mut c, &wire).unwrap();
        let e = receive(d.as_raw_fd(), 100, 100).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADMSG), "{e}");
    }

    #[test]
    fn a_reused_descriptor_is_another_socket() {
        let (a, _b) = pair();
        let fd = a.as_raw_fd();
        install(fd, &key(1), &key(2)).unwrap();
        assert!(of(fd).is_some());
        drop(a);
        // The next socket most likely takes the same number; either way it
        // has no channel, and the stale entry goes.
        let (c, _d) = pair();
        assert!(of(c.as_raw_fd()).is_none());
        let t = table().read().unwrap();
        assert!(
            t.get(&c.as_raw_fd())
                .is_none_or(|ch| ch.cookie == cookie(c.as_raw_fd()).unwrap())
        );
    }

    #[test]
    fn record_headers_are_checked() {
        assert_eq!(record_at(&[23, 3]).unwrap(), None);
        assert_eq!(record_at(&[23, 3, 3, 0, 17]).unwrap(), None);
        assert_eq!(record_at(&[23, 3, 3, 0, 17, 0, 0]).unwrap(), None);
        let whole = [&[23u8, 3, 3, 0, 17][..], &[0; 17]].concat();
        assert_eq!(record_at(&whole).unwrap(), Some(17));
        for bad in [
            [22, 3, 3, 0, 17],
            [23, 3, 1, 0, 17],
            [23, 3, 3, 0, 16],
            [23, 3, 3, 0x41, 0x01],
        ] {
            assert!(record_at(&bad).is_err(), "{bad:?}");
        }
    }
}
