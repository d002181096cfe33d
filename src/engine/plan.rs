//! Request planning, free of I/O: TCP segments per stream, write-list and
//! delegate tables (parsed with bounds checks, also by the fuzz targets),
//! cross-memory grants and the delegation choice, RDMA work requests.

#![forbid(unsafe_code)]

use crate::agent::{AgentConfig, TransferRequest};
use crate::engine::socket_link::{GrantRange, RdmaLink, Seg};
use crate::engine::submit::Resolved;
use crate::engine::wire::WRITE_LIST_ENTRY;
use crate::engine::{cma_wire, rdma};
use crate::error::Error;
use crate::memory::{MemoryDescs, MemoryType};
use crate::shm::Piece;
use crate::small::Few;

/// Splits `(local, remote)` pairs into segments of at most `max` bytes and
/// spreads them over `streams` streams, balancing bytes.
pub(in crate::engine) fn plan_segments(
    req: &TransferRequest,
    keys: &[u64],
    max: u64,
    streams: usize,
) -> Vec<Vec<Seg>> {
    // Room for an even share of the pieces each (more when pieces split).
    let share = req.local.descs.len() / streams + 1;
    let mut out: Vec<Vec<Seg>> = (0..streams).map(|_| Vec::with_capacity(share)).collect();
    let mut load = vec![0u64; streams];
    for ((l, r), &key) in req.local.descs.iter().zip(&req.remote.descs).zip(keys) {
        let mut off = 0;
        while off < l.len {
            let len = (l.len - off).min(max);
            let k = if streams == 1 {
                0
            } else {
                (0..streams).min_by_key(|&i| load[i]).unwrap_or(0)
            };
            out[k].push(Seg {
                mem_type: req.remote.mem_type,
                device: r.device_id,
                local: l.addr + off,
                local_gpu: (req.local.mem_type == MemoryType::Vram).then_some(l.device_id),
                remote: r.addr + off,
                len,
                key,
            });
            load[k] += len;
            off += len;
        }
    }
    out
}

/// A write list's pieces and the span they cover.
pub(crate) struct WriteListTable {
    /// `(address, length)` of each piece, as the scatter read takes them.
    pub(crate) pieces: Vec<(*mut u8, usize)>,
    /// Start of the span.
    pub(crate) lo: u64,
    /// End of the span.
    pub(crate) hi: u64,
}

/// The pieces of a write list's table, `(address, length)` each, with the
/// span they cover (`lo..hi`): each non-empty and not wrapping, adding up
/// to the `total` the frame announced.
///
/// # Errors
/// What is wrong with the table.
pub(crate) fn write_list_pieces(table: &[u8], total: u64) -> Result<WriteListTable, String> {
    let mut pieces = Vec::with_capacity(table.len() / WRITE_LIST_ENTRY);
    let (mut lo, mut hi, mut sum) = (u64::MAX, 0u64, 0u64);
    for e in table.chunks_exact(WRITE_LIST_ENTRY) {
        let addr = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(e[8..].try_into().expect("8 bytes"));
        let end = addr
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or("bad write list entry")?;
        lo = lo.min(addr);
        hi = hi.max(end);
        sum = sum.checked_add(len).ok_or("write list overflows")?;
        pieces.push((addr as *mut u8, len as usize));
    }
    if pieces.is_empty() {
        return Err("empty write list".into());
    }
    if sum != total {
        return Err(format!(
            "write list announces {total} bytes, its table {sum}"
        ));
    }
    Ok(WriteListTable { pieces, lo, hi })
}

/// The target's side of the connection handshake on `fd` (for the fuzz
/// targets): whether it accepted.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_respond(
    fd: std::os::fd::BorrowedFd<'_>,
    cred: Option<&crate::auth::Credential>,
) -> std::io::Result<bool> {
    use crate::engine::handshake;
    use crate::engine::sock::{FrameReader, ProgressClock};
    use std::os::fd::AsRawFd;
    use std::time::Duration;
    let clock = ProgressClock::new();
    let mut reader = FrameReader::new(fd.as_raw_fd(), &clock);
    reader.set_deadline(Some(std::time::Instant::now() + Duration::from_secs(1)));
    let v = handshake::respond(
        fd,
        &mut reader,
        &|| false,
        cred,
        "target",
        &clock,
        Duration::from_secs(1),
    )?;
    Ok(matches!(v, handshake::Verdict::Accepted(_)))
}

/// The pieces of a `Delegate` table, as (local = the target's address,
/// remote = the initiator's): each non-empty, and inside one of `spans`
/// (the request's admitted grants).
pub(crate) fn delegated_pieces(
    table: &[u8],
    spans: &[(u64, u64)],
) -> Result<Vec<Piece>, &'static str> {
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    table
        .chunks_exact(cma_wire::DELEGATE_ENTRY)
        .map(|e| {
            let (target, initiator, len) = (word(&e[..8]), word(&e[8..16]), word(&e[16..]));
            let inside = len > 0
                && target.checked_add(len).is_some_and(|end| {
                    spans
                        .iter()
                        .any(|&(a, l)| target >= a && end <= a.saturating_add(l))
                });
            if inside {
                Ok(Piece {
                    local: target,
                    remote: initiator,
                    len,
                })
            } else {
                Err("delegated piece outside the request's grants")
            }
        })
        .collect()
}

/// Adjacent runs in a descriptor list (pieces that continue the previous
/// one's range count once).
pub(in crate::engine) fn runs(descs: &[crate::memory::MemoryDesc]) -> usize {
    descs
        .iter()
        .zip(descs.iter().skip(1))
        .filter(|(a, b)| a.addr.checked_add(a.len) != Some(b.addr))
        .count()
        + usize::from(!descs.is_empty())
}

/// Whether a cross-memory request should be copied by the target: its
/// remote pieces are many and much more scattered than its local ones.
pub(in crate::engine) fn should_delegate(req: &TransferRequest) -> bool {
    let n = req.remote.descs.len();
    if n > cma_wire::DELEGATE_MAX as usize {
        return false;
    }
    let remote = runs(&req.remote.descs);
    remote >= 16 && remote >= 2 * runs(&req.local.descs)
}

/// One grant per remote region a request touches, covering the span of its
/// descriptors in that region.
pub(in crate::engine) fn grant_ranges(remote: &MemoryDescs, keys: &[u64]) -> Vec<GrantRange> {
    let mut spans: Vec<GrantRange> = Vec::new();
    for (d, &key) in remote.descs.iter().zip(keys) {
        let end = d.addr + d.len;
        match spans.iter_mut().find(|g| g.key == key) {
            Some(g) => {
                let g_end = (g.addr + g.len).max(end);
                g.addr = g.addr.min(d.addr);
                g.len = g_end - g.addr;
            }
            None => spans.push(GrantRange {
                mem_type: remote.mem_type,
                addr: d.addr,
                len: d.len,
                key,
            }),
        }
    }
    spans
}

/// Whether waiting threads poll the completion queue themselves for `req`:
/// only for small, latency-bound requests — on large ones a spinning
/// waiter takes the CPU from the stack that moves the data (measured on
/// soft-RoCE: dropped ACKs and stalls), and saves nothing.
pub(in crate::engine) fn small(req: &TransferRequest) -> bool {
    req.local.descs.iter().map(|d| d.len).sum::<u64>() <= crate::status::DRIVE_MAX_BYTES
}

/// `req`'s work requests on `link`'s queue pairs, from its resolved local
/// and remote keys (32-bit: the RDMA transport's handles and its keys in
/// descriptors hold nothing wider).
pub(in crate::engine) fn plan_rdma(
    req: &TransferRequest,
    resolved: &Resolved,
    link: &RdmaLink,
    config: &AgentConfig,
) -> Result<Few<rdma::Wr>, Error> {
    let pieces: Few<_> = req
        .local
        .descs
        .iter()
        .zip(&resolved.local_keys)
        .zip(req.remote.descs.iter().zip(&resolved.remote_keys))
        .map(|((l, &lk), (r, rk))| (lk as u32, l.addr, rk.key as u32, r.addr, l.len))
        .collect();
    let conn = link.parts.qps.first().ok_or(Error::Closed)?;
    let mut wrs = rdma::plan_wrs(
        &pieces,
        conn.max_msg.min(config.tcp.segment_size).min(rdma::WR_MAX),
        conn.max_sge,
    );
    if req.local.mem_type == MemoryType::Vram {
        for w in wrs.iter_mut() {
            w.gpu = true;
        }
    }
    Ok(wrs)
}
