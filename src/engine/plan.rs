//! Request planning, free of I/O: TCP segments per stream, write-list and
//! delegate tables (parsed with bounds checks, also by the fuzz targets),
//! cross-memory grants and the delegation choice. It imports only the
//! pure parts of the crate (the memory model, the protocol's vocabulary,
//! the frame codecs); the RDMA link plans its work requests itself.

#![forbid(unsafe_code)]

use crate::engine::cma_wire;
use crate::engine::wire::{Frame, HEADER_LEN, WRITE_LIST_ENTRY};
use crate::memory::{MemoryDescs, MemoryType, Piece};
use crate::proto::TransferRequest;

/// A piece of a TCP request on one stream: where it comes from here and
/// goes to there.
#[derive(Clone, Copy)]
pub(in crate::engine) struct Seg {
    pub(in crate::engine) mem_type: MemoryType,
    /// The storage handle of a FILE or BLK destination (else unused).
    pub(in crate::engine) device: u32,
    pub(in crate::engine) local: u64,
    /// The device of local GPU memory (moved through staging buffers).
    pub(in crate::engine) local_gpu: Option<u32>,
    pub(in crate::engine) remote: u64,
    pub(in crate::engine) len: u64,
    pub(in crate::engine) key: u64,
}

impl Seg {
    /// Its `Write` frame header (the payload follows it); `checked`:
    /// sealed, and a CRC32C trailer follows the payload.
    pub(in crate::engine) fn write_header(&self, req: u64, checked: bool) -> [u8; HEADER_LEN] {
        Frame::Write {
            req,
            mem_type: self.mem_type,
            device: self.device,
            addr: self.remote,
            len: self.len,
            key: self.key,
            checked,
        }
        .encode()
    }
}

/// A range the target must grant for a cross-memory request.
pub(in crate::engine) struct GrantRange {
    pub(in crate::engine) mem_type: MemoryType,
    pub(in crate::engine) addr: u64,
    pub(in crate::engine) len: u64,
    pub(in crate::engine) key: u64,
}

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
