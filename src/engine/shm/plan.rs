//! The shm transport's planning, free of I/O: the grants a cross-memory
//! request needs, whether the target should copy it (delegation), and the
//! pieces of a `Delegate` table (parsed with bounds checks, also by the
//! fuzz targets). It imports only the pure parts of the crate.

#![forbid(unsafe_code)]

use crate::engine::shm::frames;
use crate::memory::{MemoryDescs, MemoryType, Piece};
use crate::proto::TransferRequest;

/// A range the target must grant for a cross-memory request.
pub(in crate::engine) struct GrantRange {
    pub(in crate::engine) mem_type: MemoryType,
    pub(in crate::engine) addr: u64,
    pub(in crate::engine) len: u64,
    pub(in crate::engine) key: u64,
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
        .chunks_exact(frames::DELEGATE_ENTRY)
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
    if n > frames::DELEGATE_MAX as usize {
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
