//! The TCP path at the target: WRITE payloads landed straight into the
//! registered region (`readv`), READs answered from it (`writev`), write
//! lists scattered into their pieces — each admitted against the registry
//! first, a refused payload skipped exactly.

use super::*;

impl Inner {
    /// Lands a `Write` frame's payload at `addr`, or skips it when the
    /// range is refused (the refusal is the segment's outcome).
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
            unsafe { c.reader.read_into(addr as *mut u8, len as usize, c.idle) }
        })
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
        read: impl FnOnce(&mut Conn<'_, '_, '_>) -> io::Result<()>,
    ) -> io::Result<Result<(), RejectReason>> {
        match self.registry.admit_remote(mem_type, lo, hi - lo, key) {
            Ok(guard) => {
                read(c)?;
                drop(guard);
                Ok(Ok(()))
            }
            Err(reason) => {
                tracing::debug!(remote = %c.session.remote, lo, hi, %reason, "refused write payload");
                c.reader.discard(total, c.idle)?;
                Ok(Err(reason))
            }
        }
    }

    /// Answers a `ReadReq` with the range's bytes, or with the refusal.
    pub(in crate::engine) fn send_read(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        mem_type: MemoryType,
        addr: u64,
        len: u64,
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        match self.registry.admit_remote(mem_type, addr, len, key) {
            Ok(guard) => {
                let hdr = Frame::ReadData {
                    req,
                    len,
                    status: status::OK,
                }
                .encode();
                let mut iovs = [
                    iov(hdr.as_ptr(), HEADER_LEN),
                    iov(addr as *const u8, len as usize),
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
            Err(reason) => {
                let refusal = Frame::ReadData {
                    req,
                    len: 0,
                    status: reason.code(),
                };
                c.send(&[refusal.encode()], self.config.io_timeout)?;
                Ok(Err(reason))
            }
        }
    }

    /// Lands a `WriteList`: its table, then its pieces' payloads back to
    /// back, admitted as one span (a key names one region, so the span
    /// inside it puts every piece inside it).
    pub(in crate::engine) fn land_write_list(
        &self,
        c: &mut Conn<'_, '_, '_>,
        mem_type: MemoryType,
        count: u32,
        total: u64,
        key: u64,
    ) -> io::Result<Result<(), RejectReason>> {
        let table = c
            .reader
            .read_vec_mid_frame(count as usize * WRITE_LIST_ENTRY, c.idle)?;
        let WriteListTable { pieces, lo, hi } =
            write_list_pieces(&table, total).map_err(violation)?;
        // One admission for the span: a key names one region, so the span
        // inside it puts every piece inside it.
        self.land(c, mem_type, (lo, hi), key, total, |c| {
            // SAFETY: every piece lies inside the admitted span of a
            // registered region, writable while registered; the admission's
            // guard holds the registration during this read.
            unsafe { c.reader.read_into_many(&pieces, c.idle) }
        })
    }
}
