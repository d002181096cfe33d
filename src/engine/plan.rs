//! Request planning, free of I/O: TCP segments per stream and write-list
//! tables (parsed with bounds checks, also by the fuzz targets). It
//! imports only the pure parts of the crate (the memory model, the
//! protocol's vocabulary, the frame codecs); the shm transport plans its
//! grants and delegated copies in `shm::plan`, the RDMA link its work
//! requests itself.

#![forbid(unsafe_code)]

use crate::engine::wire::{Frame, HEADER_LEN, WRITE_LIST_ENTRY};
use crate::memory::MemoryType;
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
