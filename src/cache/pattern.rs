//! The deterministic KV pattern tests and benchmarks use: every element is
//! a hash of its model coordinates (layer, K/V, head, token, dimension),
//! truncated to the element size, so a receiver can check every byte from
//! its own layout alone, whatever the sender's.

#![forbid(unsafe_code)]

use crate::cache::fragments::RankSlice;
use crate::cache::state::CacheState;

/// The value of one element (its low `dtype.size()` bytes are stored).
pub fn element_value(layer: u32, kv: u32, head: u32, token: u32, dim: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for x in [layer, kv, head, token, dim] {
        for b in x.to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    }
    h
}

/// Calls `f(byte offset in the block, token, value)` for every element of
/// one block of `slice`, which holds the request's block number
/// `logical_block` (tokens `logical_block × tokens_per_block ..`).
pub fn for_each_element(
    state: &CacheState,
    slice: &RankSlice,
    logical_block: u32,
    mut f: impl FnMut(usize, u32, u32),
) {
    let e = u64::from(state.dtype.size());
    let t = state.tokens_per_block;
    for layer in slice.first_layer..slice.first_layer + slice.layers {
        for kv in 0..slice.kv_factor {
            for h in 0..slice.heads_in_block {
                let head = slice.first_head + h;
                let base = slice.offset(layer, kv, head);
                for tok in 0..t {
                    for d in 0..state.head_size {
                        let off = base + u64::from(tok * state.head_size + d) * e;
                        let token = logical_block * t + tok;
                        f(
                            off as usize,
                            token,
                            element_value(layer, kv, head, token, d),
                        );
                    }
                }
            }
        }
    }
}

/// Writes the pattern into `block` (one block of `slice`).
pub fn fill_block(state: &CacheState, slice: &RankSlice, block: &mut [u8], logical_block: u32) {
    let e = state.dtype.size() as usize;
    for_each_element(state, slice, logical_block, |off, _, v| {
        block[off..off + e].copy_from_slice(&v.to_le_bytes()[..e]);
    });
}

/// Checks the pattern in `block` for tokens below `tokens`; returns the
/// first mismatch, described.
pub fn check_block(
    state: &CacheState,
    slice: &RankSlice,
    block: &[u8],
    logical_block: u32,
    tokens: u32,
) -> Option<String> {
    let e = state.dtype.size() as usize;
    let mut bad = None;
    for_each_element(state, slice, logical_block, |off, token, v| {
        if bad.is_none() && token < tokens && block[off..off + e] != v.to_le_bytes()[..e] {
            bad = Some(format!(
                "block {logical_block}, byte {off} (token {token}): {:?} instead of {:?}",
                &block[off..off + e],
                &v.to_le_bytes()[..e]
            ));
        }
    });
    bad
}
