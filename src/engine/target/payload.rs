//! The TCP path at the target: WRITE payloads landed straight into the
//! registered region (`readv`), READs answered from it (`writev`), write
//! lists scattered into their pieces — each admitted against the registry
//! first, a refused payload skipped exactly.

use crate::engine::Inner;
use crate::engine::plan::{WriteListTable, write_list_pieces};
use crate::engine::sock::{ProgressClock, iov, writev_all};
use crate::engine::target::{Conn, GpuLandings, Session, segment, violation};
use crate::engine::wire::{self, Frame, HEADER_LEN, TRAILER_LEN, WRITE_LIST_ENTRY, status};
use crate::error::RejectReason;
use crate::memory::MemoryType;
use rustix::fd::AsRawFd;
use std::io;
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Most `ReadReq`s for GPU memory answered through one staging pipeline.
const GPU_READ_RUN: usize = 1024;

impl Inner {
    /// Lands a `Write` frame's payload at `addr` in host memory, or skips
    /// it when the range is refused (the refusal is the segment's outcome).
    pub(in crate::engine) fn land_write(
        &self,
        c: &mut Conn<'_, '_, '_>,
        mem_type: MemoryType,
        addr: u64,
        len: u64,
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        self.land(c, mem_type, (addr, addr + len), key, len, |c| {
            // SAFETY: `[addr, addr + len)` was admitted: it lies inside a
            // region registered with this agent, whose registrant promised
            // it stays valid for writes while registered, and the
            // admission's guard holds it registered during this read.
            unsafe { c.reader.read_into(addr as *mut u8, len as usize, c.idle) }.map(Ok)
        })
    }

    /// Lands a checked `Write` (its header's seal checked by the caller) in
    /// host memory, then checks the CRC32C that follows the payload over
    /// the bytes as they lie in the region (still in cache): a mismatch is
    /// the segment's outcome ([`RejectReason::Integrity`]).
    pub(in crate::engine) fn land_write_checked(
        &self,
        c: &mut Conn<'_, '_, '_>,
        addr: u64,
        len: u64,
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        let span = (addr, addr + len);
        self.land(
            c,
            MemoryType::Dram,
            span,
            key,
            len + TRAILER_LEN as u64,
            |c| {
                // SAFETY: as in `land_write`; the trailer follows.
                let got = unsafe { c.reader.read_checked(addr as *mut u8, len as usize, c.idle) }?;
                let sent = read_trailer(c)?;
                Ok(self.check(&c.session.remote, sent, got, span))
            },
        )
    }

    /// The outcome of checked bytes `[lo, hi)` here, from `remote`, whose
    /// sender's CRC32C is `sent` and whose own is `got`; a mismatch is
    /// logged and counted (every path that checks at the target).
    pub(in crate::engine) fn check(
        &self,
        remote: &str,
        sent: u32,
        got: u32,
        (lo, hi): (u64, u64),
    ) -> Result<(), RejectReason> {
        if sent == got {
            return Ok(());
        }
        self.metrics
            .integrity_failures
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            remote,
            lo,
            hi,
            sent,
            got,
            "checked bytes did not match their CRC32C: the request fails"
        );
        Err(RejectReason::Integrity)
    }

    /// Reads a payload of `total` bytes with `read` once the registry has
    /// admitted the span `[lo, hi)` it lands in (held meanwhile); skips the
    /// bytes when the span is refused (the refusal is the outcome).
    fn land(
        &self,
        c: &mut Conn<'_, '_, '_>,
        mem_type: MemoryType,
        (lo, hi): (u64, u64),
        key: u64,
        total: u64,
        read: impl FnOnce(&mut Conn<'_, '_, '_>) -> io::Result<Result<(), RejectReason>>,
    ) -> io::Result<Result<(), RejectReason>> {
        match self.registry.admit_remote(mem_type, lo, hi - lo, key) {
            Ok(guard) => {
                let outcome = read(c)?;
                drop(guard);
                Ok(outcome)
            }
            Err(reason) => {
                tracing::debug!(remote = %c.session.remote, lo, hi, %reason, "refused write payload");
                c.reader.discard(total, c.idle)?;
                Ok(Err(reason))
            }
        }
    }

    /// Lands a `Write` payload in GPU memory through the connection thread's
    /// staging ring, or skips it when the range is refused. The copies to
    /// the device are left running: the segment's outcome is told when
    /// `landings` hands it back (the next segments are read meanwhile);
    /// a refusal, or a driver failure while receiving it (`GpuCopy`, the
    /// rest of its bytes drained, what was copied before stays), is the
    /// outcome returned at once.
    pub(in crate::engine) fn land_gpu(
        &self,
        c: &mut Conn<'_, '_, '_>,
        landings: &mut GpuLandings,
        (req, addr, len, key): (u64, u64, u64, u64),
    ) -> io::Result<Option<Result<(), RejectReason>>> {
        let guard = match self.registry.admit_memory(MemoryType::Vram, addr, len, key) {
            Ok(g) => g,
            Err(reason) => {
                tracing::debug!(remote = %c.session.remote, addr, len, %reason, "refused GPU write payload");
                c.reader.discard(len, c.idle)?;
                return Ok(Some(Err(reason)));
            }
        };
        let device = guard.region().desc.device_id;
        let mut got = 0u64;
        let mut read = |buf: &mut [u8]| {
            let last = got + buf.len() as u64 == len;
            // SAFETY: `buf` is a live mutable slice.
            unsafe {
                c.reader
                    .read_part(buf.as_mut_ptr(), buf.len(), last, c.idle)
            }?;
            got += buf.len() as u64;
            Ok(())
        };
        // SAFETY: `[addr, addr + len)` was admitted: inside a VRAM region
        // registered here (checked to be device memory on `device`) and held
        // by `guard`, which `landings` keeps until the copies are over.
        let r = unsafe {
            landings.land(
                device,
                self.config.gpu.shape(),
                addr,
                len,
                &mut read,
                (req, guard),
            )
        };
        match r {
            Ok(()) => Ok(None),
            Err((crate::gpu::StageError::Io(e), _)) => Err(e),
            Err((crate::gpu::StageError::Gpu(e), _)) => {
                tracing::warn!(remote = %c.session.remote, addr, len, error = %e, "copy to GPU memory failed");
                c.reader.discard(len - got, c.idle)?;
                Ok(Some(Err(RejectReason::GpuCopy)))
            }
        }
    }

    /// Records the outcome of each GPU segment whose copies have landed,
    /// finishing the requests they complete, until all have or the next
    /// frame begins to arrive.
    pub(in crate::engine) fn settle_gpu(
        &self,
        c: &mut Conn<'_, '_, '_>,
        landings: &mut GpuLandings,
    ) -> io::Result<()> {
        let (sock, session, clock) = (c.sock, c.session, c.idle.clock);
        c.reader
            .settle(landings, c.idle, |e| e, |(req, guard), r| {
                drop(guard);
                let result = r.map_err(|e| {
                    tracing::warn!(remote = %session.remote, req, error = %e, "copy to GPU memory failed");
                    RejectReason::GpuCopy
                });
                self.told(sock, session, clock, req, result)
            })
    }

    /// Answers a `ReadReq` for GPU memory together with the `ReadReq`s for
    /// memory of the same GPU that have already arrived behind it (up to
    /// [`GPU_READ_RUN`]), through one pipeline of the connection thread's
    /// staging ring: the device→host copies run ahead across them (the
    /// next segment's while one is sent), and each answer goes out in turn,
    /// its header with its first chunk. A refused request, or any other
    /// frame, ends the run: it is put back and handled in turn. A driver
    /// failure after a header cannot be told in band: the connection ends.
    pub(in crate::engine) fn send_reads_gpu(
        &self,
        c: &mut Conn<'_, '_, '_>,
        (req, addr, len, key): (u64, u64, u64, u64),
    ) -> io::Result<()> {
        let admit = |addr, len, key| self.registry.admit_memory(MemoryType::Vram, addr, len, key);
        let guard = match admit(addr, len, key) {
            Ok(g) => g,
            Err(reason) => {
                let refused = self.refuse_read(c, req, reason)?;
                return self.told(c.sock, c.session, c.idle.clock, req, refused);
            }
        };
        let device = guard.region().desc.device_id;
        // Admission refuses empty ranges: every piece of the run has bytes.
        let mut run = vec![(req, addr, len, guard)];
        while run.len() < GPU_READ_RUN && c.reader.frame_waiting(Duration::ZERO) {
            let Some(raw) = c.reader.next_header(c.idle)? else {
                break;
            };
            let next = match Frame::decode(&raw) {
                Ok(Frame::ReadReq {
                    req,
                    mem_type: MemoryType::Vram,
                    addr,
                    len,
                    key,
                    ..
                }) => admit(addr, len, key)
                    .ok()
                    .filter(|g| g.region().desc.device_id == device)
                    .map(|g| (req, addr, len, g)),
                _ => None,
            };
            match next {
                Some(r) => run.push(r),
                None => {
                    c.reader.put_back(raw);
                    break;
                }
            }
        }
        let (fd, clock, timeout) = (c.sock.as_raw_fd(), c.idle.clock, self.config.io_timeout);
        let pieces: Vec<(u64, u64)> = run.iter().map(|r| (r.1, r.2)).collect();
        let mut current = usize::MAX;
        // An answer's header goes with its first chunk.
        let mut write = |k: usize, bytes: &[u8]| {
            let chunk = iov(bytes.as_ptr(), bytes.len());
            if std::mem::replace(&mut current, k) == k {
                // SAFETY: the chunk is a staging buffer borrowed for the call.
                return unsafe { writev_all(fd, &mut [chunk], clock, timeout) };
            }
            let hdr = Frame::ReadData {
                req: run[k].0,
                len: run[k].2,
                status: status::OK,
                checked: false,
            }
            .encode();
            // SAFETY: the header is a live local, the chunk a staging buffer
            // borrowed for the call.
            unsafe {
                writev_all(
                    fd,
                    &mut [iov(hdr.as_ptr(), HEADER_LEN), chunk],
                    clock,
                    timeout,
                )
            }
        };
        // SAFETY: every range was admitted (device memory on `device`,
        // registered here, not empty) and is held by its guard in `run`
        // until the call has returned.
        let staged = unsafe {
            crate::gpu::send_staged_pieces(
                device,
                self.config.gpu.shape(),
                &pieces,
                &|| false,
                &mut write,
            )
        };
        match staged {
            Ok(_) => {}
            Err(crate::gpu::StageError::Io(e)) => return Err(e),
            Err(crate::gpu::StageError::Gpu(e)) => {
                return Err(io::Error::other(format!(
                    "copy from GPU memory for a READ failed: {e}"
                )));
            }
        }
        for (req, _, _, guard) in run {
            drop(guard);
            self.told(c.sock, c.session, c.idle.clock, req, Ok(()))?;
        }
        Ok(())
    }

    /// Records the outcome of one segment of `req`, finishing the request
    /// when it was the last.
    fn told(
        &self,
        sock: &TcpStream,
        session: &Session,
        clock: &ProgressClock,
        req: u64,
        result: Result<(), RejectReason>,
    ) -> io::Result<()> {
        match segment(self, session, req, 1, result)? {
            Some(f) => self.finish(sock, session, f, clock),
            None => Ok(()),
        }
    }

    /// Answers a `ReadReq` with the range's bytes, or with the refusal.
    /// `checked`: the read's place among its request's checked reads on
    /// this stream, which seals the answer, and the bytes' CRC32C follows
    /// them.
    pub(in crate::engine) fn send_read(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        mem_type: MemoryType,
        (addr, len): (u64, u64),
        key: u64,
        seq: Option<u32>,
    ) -> io::Result<Result<(), RejectReason>> {
        let checked = seq.is_some();
        match self.registry.admit_remote(mem_type, addr, len, key) {
            Ok(guard) => {
                let mut hdr = Frame::ReadData {
                    req,
                    len,
                    status: status::OK,
                    checked,
                }
                .encode();
                if let Some(seq) = seq {
                    wire::seal_read_data(&mut hdr, seq);
                }
                let crc = if checked {
                    // SAFETY: the range lies inside a region registered
                    // here and held by `guard`.
                    let src =
                        unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
                    crate::integrity::crc32c(src).to_le_bytes()
                } else {
                    [0; TRAILER_LEN]
                };
                let mut iovs = [
                    iov(hdr.as_ptr(), HEADER_LEN),
                    iov(addr as *const u8, len as usize),
                    iov(crc.as_ptr(), if checked { TRAILER_LEN } else { 0 }),
                ];
                // SAFETY: the payload range lies inside a region registered
                // here and held by `guard`; the header is a live local.
                unsafe {
                    writev_all(
                        c.sock.as_raw_fd(),
                        &mut iovs,
                        c.idle.clock,
                        self.config.io_timeout,
                    )?
                };
                drop(guard);
                Ok(Ok(()))
            }
            Err(reason) => self.refuse_read(c, req, reason),
        }
    }

    /// Answers a `ReadReq` with a refusal (no payload).
    fn refuse_read(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        reason: RejectReason,
    ) -> io::Result<Result<(), RejectReason>> {
        let refusal = Frame::ReadData {
            req,
            len: 0,
            status: reason.code(),
            checked: false,
        };
        c.send(&[refusal.encode()], self.config.io_timeout)?;
        Ok(Err(reason))
    }

    /// Lands a `WriteList`: its table, then its pieces' payloads back to
    /// back, admitted as one span (a key names one region, so the span
    /// inside it puts every piece inside it). `checked`: the header's seal
    /// (`raw`, the `seq`-th checked frame of its request on this stream)
    /// covers the table, checked before a byte lands, and the pieces'
    /// CRC32C follows them.
    pub(in crate::engine) fn land_write_list(
        &self,
        c: &mut Conn<'_, '_, '_>,
        raw: &[u8; HEADER_LEN],
        mem_type: MemoryType,
        (count, total): (u32, u64),
        key: u64,
        checked: Option<u32>,
    ) -> io::Result<Result<(), RejectReason>> {
        let table = c
            .reader
            .read_vec_mid_frame(count as usize * WRITE_LIST_ENTRY, c.idle)?;
        if checked.is_some_and(|seq| !wire::sealed_seq(raw, &table, seq)) {
            return Err(violation(
                "a checked write list does not match its seal (damaged, repeated or out of order)",
            ));
        }
        let checked = checked.is_some();
        let WriteListTable { pieces, lo, hi } =
            write_list_pieces(&table, total).map_err(violation)?;
        let skip = total + if checked { TRAILER_LEN as u64 } else { 0 };
        // One admission for the span: a key names one region, so the span
        // inside it puts every piece inside it.
        self.land(c, mem_type, (lo, hi), key, skip, |c| {
            let idle = &mut *c.idle;
            // SAFETY: every piece lies inside the admitted span of a
            // registered region, writable while registered; the admission's
            // guard holds the registration during this read.
            let mut read = |r: &mut crate::engine::sock::FrameReader<'_>| unsafe {
                r.read_into_many(&pieces, idle)
            };
            if checked {
                // Its trailer follows the pieces: no read-ahead.
                c.reader.mid_frame(read)?;
            } else {
                read(c.reader)?;
            }
            if !checked {
                return Ok(Ok(()));
            }
            // Summed before the trailer is read: the sender may send it
            // only once its own sum is done.
            let mut crc = crate::integrity::Crc32c::new();
            for &(p, n) in &pieces {
                // SAFETY: as above; each piece was just written.
                crc.update(unsafe { std::slice::from_raw_parts(p.cast_const(), n) });
            }
            let sent = read_trailer(c)?;
            Ok(self.check(&c.session.remote, sent, crc.finish(), (lo, hi)))
        })
    }
}

/// Reads the CRC32C trailer of a checked frame.
fn read_trailer(c: &mut Conn<'_, '_, '_>) -> io::Result<u32> {
    let mut t = [0u8; TRAILER_LEN];
    // SAFETY: `t` is a live local of exactly that length.
    unsafe { c.reader.read_into(t.as_mut_ptr(), TRAILER_LEN, c.idle) }?;
    Ok(u32::from_le_bytes(t))
}
