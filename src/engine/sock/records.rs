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
//! What this costs over the kernel's: a copy each way (into the sealing
//! buffer, out of the opened record), beside the cipher itself.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use ring::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};

use crate::auth::DirectionKey;
use crate::engine::lock;
use crate::engine::sock::{ProgressClock, iov, writev_plain};

/// Most plaintext bytes in a record (TLS 1.3).
const RECORD_MAX: usize = 1 << 14;
/// A record's header: type, legacy version (2), length (u16 BE).
const HEADER: usize = 5;
/// AES-GCM's tag.
const TAG: usize = 16;
/// Longest record body taken from a peer: the plaintext, its inner type,
/// the tag and the padding TLS 1.3 allows (RFC 8446 §5.2).
const BODY_MAX: usize = RECORD_MAX + 256;
/// The content type of application data.
const APPLICATION_DATA: u8 = 23;
/// Plaintext sealed per `sendmsg`.
const SEND_BATCH: usize = 256 << 10;
/// Bytes asked of the socket per `read`.
const READ_CHUNK: usize = 256 << 10;

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
        let mut parts = iovs.iter().filter(|v| v.iov_len > 0).map(|v| {
            // SAFETY: valid for reads for the call (this function's
            // contract).
            unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) }
        });
        let mut part: &[u8] = parts.next().unwrap_or_default();
        while !part.is_empty() {
            buf.clear();
            while buf.len() < SEND_BATCH && !part.is_empty() {
                // One record of up to RECORD_MAX bytes of the iovecs.
                let at = buf.len();
                buf.extend_from_slice(&[APPLICATION_DATA, 3, 3, 0, 0]);
                let mut n = 0;
                while n < RECORD_MAX && !part.is_empty() {
                    let take = part.len().min(RECORD_MAX - n);
                    buf.extend_from_slice(&part[..take]);
                    part = &part[take..];
                    n += take;
                    if part.is_empty() {
                        part = parts.next().unwrap_or_default();
                    }
                }
                buf.push(APPLICATION_DATA);
                let len = (n + 1 + TAG) as u16;
                buf[at + 3..at + HEADER].copy_from_slice(&len.to_be_bytes());
                let mut aad = [0u8; HEADER];
                aad.copy_from_slice(&buf[at..at + HEADER]);
                let nonce = dir.next_nonce();
                let tag = dir
                    .key
                    .seal_in_place_separate_tag(nonce, Aad::from(aad), &mut buf[at + HEADER..])
                    .map_err(|_| io::Error::other("sealing a record failed"))?;
                buf.extend_from_slice(tag.as_ref());
            }
            let mut one = [iov(buf.as_ptr(), buf.len())];
            // SAFETY: `buf` is this function's, alive for the call.
            unsafe { writev_plain(fd, &mut one, clock, io_timeout)? };
        }
        Ok(())
    }

    /// Reads into `iovs` as `readv` does: the plaintext of the records
    /// that arrive, at least one byte; `Ok(0)` when the peer closed
    /// between records; the socket's errors as they are (a receive timeout
    /// as `WouldBlock`); a record that does not open (changed on the way)
    /// is `EBADMSG`, as kernel TLS reports it.
    ///
    /// # Safety
    /// Every iovec must be valid for writes for the whole call.
    pub(in crate::engine) unsafe fn readv(
        &self,
        fd: RawFd,
        iovs: &[libc::iovec],
    ) -> io::Result<usize> {
        let mut guard = lock(&self.recv);
        let r = &mut *guard;
        if r.buf.is_empty() {
            r.buf = vec![0; READ_CHUNK + HEADER + BODY_MAX];
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
            if let Some(body) = record_at(&r.buf[r.start..r.end])? {
                let at = r.start;
                r.start += HEADER + body;
                let mut aad = [0u8; HEADER];
                aad.copy_from_slice(&r.buf[at..at + HEADER]);
                let nonce = r.dir.next_nonce();
                let opened = r
                    .dir
                    .key
                    .open_in_place(
                        nonce,
                        Aad::from(aad),
                        &mut r.buf[at + HEADER..at + HEADER + body],
                    )
                    .map_err(|_| io::Error::from_raw_os_error(libc::EBADMSG))?;
                // The inner type is the last byte that is not padding.
                let len = opened.iter().rposition(|&b| b != 0).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidData, "a record of padding only")
                })?;
                if opened[len] != APPLICATION_DATA {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a record that is not application data",
                    ));
                }
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
            let room = (r.buf.len() - r.end).min(READ_CHUNK);
            // SAFETY: `room` bytes from `end` lie inside `buf`.
            let n = unsafe { libc::read(fd, r.buf.as_mut_ptr().add(r.end).cast(), room) };
            match n {
                0 if r.start == r.end => return Ok(0),
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection inside a record",
                    ));
                }
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
