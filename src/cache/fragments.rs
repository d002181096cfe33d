//! Fragment mapping: which bytes of a context rank's KV blocks go where in
//! a generation rank's KV blocks, written straight from pool to pool.
//!
//! Both sides keep paged blocks laid out `[layer][k|v][head][token][dim]`
//! over the layers of their PP stage and the heads of their TP rank. For a
//! (context rank, generation rank) pair the shared part of each block is,
//! per shared layer and per K/V, one run of whole heads — contiguous on
//! both sides, because a head's `[token][dim]` is contiguous and the
//! shared heads are consecutive on both. Runs that are adjacent on both
//! sides (identical layouts, consecutive blocks) are coalesced.
//!
//! No byte is copied here: the result is a list of (source address,
//! destination address, length) for one-sided WRITEs.

#![forbid(unsafe_code)]

use crate::cache::error::CacheError;
use crate::cache::state::CacheState;

/// One contiguous piece to move: `len` bytes from `src` (context pool) to
/// `dst` (generation pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment {
    /// Address in the context rank's pool.
    pub src: u64,
    /// Address in the generation rank's pool.
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Counts of one mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragmentStats {
    /// Runs before coalescing (one per block × shared layer × K/V).
    pub fragments: u64,
    /// Fragments after coalescing (what is posted).
    pub coalesced: u64,
    /// Bytes covered.
    pub bytes: u64,
}

/// The part of one rank's cache a block holds: its layers, its heads (in
/// the model's distinct-head numbering), and the block's byte size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankSlice {
    /// First model layer in the block.
    pub first_layer: u32,
    /// Layers in the block.
    pub layers: u32,
    /// First distinct head the rank holds.
    pub first_head: u32,
    /// Heads the rank holds (all copies of one head count once).
    pub heads: u32,
    /// Heads laid out in the block (`kv_heads_per_layer` of the state).
    pub heads_in_block: u32,
    /// Bytes of one `[token][dim]` head slice.
    pub head_bytes: u64,
    /// K/V factor.
    pub kv_factor: u32,
}

impl RankSlice {
    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.layers)
            * u64::from(self.kv_factor)
            * u64::from(self.heads_in_block)
            * self.head_bytes
    }

    /// Offset in a block of `(layer, kv, head)` given in model numbering.
    pub(crate) fn offset(&self, layer: u32, kv: u32, head: u32) -> u64 {
        let l = u64::from(layer - self.first_layer);
        let h = u64::from(head - self.first_head);
        ((l * u64::from(self.kv_factor) + u64::from(kv)) * u64::from(self.heads_in_block) + h)
            * self.head_bytes
    }
}

/// What `rank` of `state` holds, with `distinct_heads` the model's distinct
/// KV heads per attention-DP group (the smaller of the two sides' totals).
pub fn rank_slice(state: &CacheState, rank: u32, distinct_heads: u32) -> RankSlice {
    let (tp, pp) = state.coords(rank);
    let layers = state.layer_range(pp);
    let tp_in_dp = tp % state.tp_per_dp();
    let hpr = state.heads_per_rank();
    let (first_head, heads) = if state.attention.is_mla() {
        (0, 1)
    } else {
        let total = hpr * state.tp_per_dp();
        let dup = (total / distinct_heads.max(1)).max(1);
        ((tp_in_dp * hpr) / dup, hpr)
    };
    RankSlice {
        first_layer: layers.start,
        layers: layers.end - layers.start,
        first_head,
        heads,
        heads_in_block: hpr,
        head_bytes: u64::from(state.tokens_per_block)
            * u64::from(state.head_size)
            * u64::from(state.dtype.size()),
        kv_factor: state.attention.kv_factor(),
    }
}

/// The model's distinct KV heads per DP group, as both sides see it.
pub fn distinct_heads(ctx: &CacheState, gen_state: &CacheState) -> u32 {
    if ctx.attention.is_mla() {
        return 1;
    }
    (ctx.heads_per_rank() * ctx.tp_per_dp()).min(gen_state.heads_per_rank() * gen_state.tp_per_dp())
}

/// Appends to `out` the fragments that move what context slice `src`
/// shares with generation slice `dst`, for blocks at `src_blocks[i]` →
/// `dst_blocks[i]` (block start addresses; the lists have equal length),
/// coalescing as it goes.
///
/// # Errors
/// [`CacheError::InvalidState`] when the block lists differ in length.
pub fn map_blocks(
    src: &RankSlice,
    dst: &RankSlice,
    src_blocks: &[u64],
    dst_blocks: &[u64],
    out: &mut Vec<Fragment>,
) -> Result<FragmentStats, CacheError> {
    map_layers(src, dst, src_blocks, dst_blocks, 0..u32::MAX, out)
}

/// As [`map_blocks`], for the model layers in `layers` only (one layer
/// group of a layer-wise transfer): the fragments of the layers outside it
/// are left out, and no fragment spans a layer outside it.
///
/// # Errors
/// As [`map_blocks`].
pub fn map_layers(
    src: &RankSlice,
    dst: &RankSlice,
    src_blocks: &[u64],
    dst_blocks: &[u64],
    layers: std::ops::Range<u32>,
    out: &mut Vec<Fragment>,
) -> Result<FragmentStats, CacheError> {
    if src_blocks.len() != dst_blocks.len() {
        return Err(CacheError::InvalidState(format!(
            "{} context blocks for {} generation blocks",
            src_blocks.len(),
            dst_blocks.len()
        )));
    }
    let mut stats = FragmentStats::default();
    let l0 = src.first_layer.max(dst.first_layer).max(layers.start);
    let l1 = (src.first_layer + src.layers)
        .min(dst.first_layer + dst.layers)
        .min(layers.end);
    let h0 = src.first_head.max(dst.first_head);
    let h1 = (src.first_head + src.heads).min(dst.first_head + dst.heads);
    if l0 >= l1 || h0 >= h1 || src.head_bytes != dst.head_bytes {
        return Ok(stats);
    }
    let run = u64::from(h1 - h0) * src.head_bytes;
    let before = out.len();
    for (&sb, &db) in src_blocks.iter().zip(dst_blocks) {
        for layer in l0..l1 {
            for kv in 0..src.kv_factor.min(dst.kv_factor) {
                let f = Fragment {
                    src: sb + src.offset(layer, kv, h0),
                    dst: db + dst.offset(layer, kv, h0),
                    len: run,
                };
                stats.fragments += 1;
                stats.bytes += run;
                let mine = out.len() > before;
                match out.last_mut() {
                    Some(last)
                        if mine && last.src + last.len == f.src && last.dst + last.len == f.dst =>
                    {
                        last.len += f.len;
                    }
                    _ => out.push(f),
                }
            }
        }
    }
    stats.coalesced = (out.len() - before) as u64;
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::pattern::{check_block, fill_block};
    use crate::cache::{Attention, DataType, needs_send, recv_ranks, target_ranks};

    struct Pools {
        slices: Vec<RankSlice>,
        mem: Vec<Vec<u8>>,
    }

    fn pools(state: &CacheState, distinct: u32, blocks: u32) -> Pools {
        let slices: Vec<_> = (0..state.world_size())
            .map(|r| rank_slice(state, r, distinct))
            .collect();
        let mem = slices
            .iter()
            .map(|s| vec![0u8; (s.block_bytes() * u64::from(blocks)) as usize])
            .collect();
        Pools { slices, mem }
    }

    /// Runs the whole mapping for one request of `tokens` tokens from every
    /// context rank to every generation rank (applying fragments with a
    /// memory copy in place of the transport) and checks every element of
    /// every generation block. Returns the summed stats.
    fn run_case(ctx: &CacheState, gen_s: &CacheState, tokens: u32) -> FragmentStats {
        ctx.check_compatible(gen_s).unwrap();
        let distinct = distinct_heads(ctx, gen_s);
        let nblocks = tokens.div_ceil(ctx.tokens_per_block);
        let pool_blocks = nblocks + 3;
        let mut cp = pools(ctx, distinct, pool_blocks);
        let mut gp = pools(gen_s, distinct, pool_blocks);
        // Blocks in scattered, different orders on the two sides.
        let ctx_ids: Vec<u32> = (0..nblocks).map(|i| (i * 3 + 1) % pool_blocks).collect();
        let gen_ids: Vec<u32> = (0..nblocks).map(|i| pool_blocks - 1 - i).collect();
        for r in 0..ctx.world_size() as usize {
            let s = cp.slices[r];
            let bb = s.block_bytes() as usize;
            for (lb, &b) in ctx_ids.iter().enumerate() {
                let b = b as usize;
                fill_block(ctx, &s, &mut cp.mem[r][b * bb..(b + 1) * bb], lb as u32);
            }
        }
        let mut total = FragmentStats::default();
        for g in 0..gen_s.world_size() {
            let from = recv_ranks(gen_s, g, ctx, 0).unwrap();
            assert!(!from.is_empty(), "generation rank {g} receives nothing");
            for &c in &from {
                // The context side agrees: c sends, and targets g.
                assert!(needs_send(ctx, c, gen_s, 0).unwrap(), "ctx {c} → gen {g}");
                assert!(target_ranks(ctx, c, gen_s, 0).unwrap().ranks.contains(&g));
                let (src, dst) = (cp.slices[c as usize], gp.slices[g as usize]);
                let sbase = cp.mem[c as usize].as_ptr() as u64;
                let dbase = gp.mem[g as usize].as_ptr() as u64;
                let sb: Vec<u64> = ctx_ids
                    .iter()
                    .map(|&b| sbase + u64::from(b) * src.block_bytes())
                    .collect();
                let db: Vec<u64> = gen_ids
                    .iter()
                    .map(|&b| dbase + u64::from(b) * dst.block_bytes())
                    .collect();
                let mut frags = Vec::new();
                let st = map_blocks(&src, &dst, &sb, &db, &mut frags).unwrap();
                total.fragments += st.fragments;
                total.coalesced += st.coalesced;
                total.bytes += st.bytes;
                for f in frags {
                    let s0 = (f.src - sbase) as usize;
                    let d0 = (f.dst - dbase) as usize;
                    let n = f.len as usize;
                    let bytes = cp.mem[c as usize][s0..s0 + n].to_vec();
                    gp.mem[g as usize][d0..d0 + n].copy_from_slice(&bytes);
                }
            }
        }
        for g in 0..gen_s.world_size() as usize {
            let s = gp.slices[g];
            let bb = s.block_bytes() as usize;
            for (lb, &b) in gen_ids.iter().enumerate() {
                let b = b as usize;
                let blk = &gp.mem[g][b * bb..(b + 1) * bb];
                if let Some(m) = check_block(gen_s, &s, blk, lb as u32, tokens) {
                    panic!("generation rank {g}: {m}");
                }
            }
        }
        total
    }

    fn state(layers: u32, heads_total: u32, tp: u32, pp: u32, dtype: DataType) -> CacheState {
        CacheState::new(
            layers,
            (heads_total / tp).max(1),
            4,
            8,
            dtype,
            Attention::Default,
            tp,
            pp,
        )
    }

    #[test]
    fn tp_pp_matrix_all_element_sizes() {
        for dtype in [DataType::F32, DataType::Bf16, DataType::I8] {
            for (ct, cpp, gt, gpp) in [
                (1, 1, 1, 1),
                (2, 1, 1, 1),
                (1, 1, 2, 1),
                (2, 2, 1, 2),
                (1, 2, 2, 1),
                (4, 1, 1, 4),
                (1, 4, 4, 1),
                (2, 2, 4, 1),
                (4, 2, 2, 1),
            ] {
                for tokens in [10, 30] {
                    let ctx = state(8, 4, ct, cpp, dtype);
                    let gen_s = state(8, 4, gt, gpp, dtype);
                    run_case(&ctx, &gen_s, tokens);
                }
            }
        }
    }

    #[test]
    fn uneven_pp_ten_layers_over_four_stages() {
        let ctx = state(10, 4, 1, 4, DataType::F32);
        let gen_s = state(10, 4, 4, 1, DataType::F32);
        run_case(&ctx, &gen_s, 60);
        run_case(&gen_s.clone(), &state(10, 4, 2, 2, DataType::F32), 80);
    }

    #[test]
    fn duplicate_heads_both_directions() {
        // 2 distinct heads; TP4 holds each head twice.
        let dup4 = CacheState::new(4, 1, 4, 8, DataType::Bf16, Attention::Default, 4, 1);
        for other in [
            state(4, 2, 1, 1, DataType::Bf16),
            state(4, 2, 2, 1, DataType::Bf16),
            state(4, 2, 1, 2, DataType::Bf16),
        ] {
            run_case(&dup4, &other, 30);
            run_case(&other, &dup4, 30);
        }
    }

    #[test]
    fn mla_latent_replicated() {
        let mla = |tp, pp| {
            CacheState::new(
                6,
                1,
                16,
                8,
                DataType::Bf16,
                Attention::Mla { kv_factor: 1 },
                tp,
                pp,
            )
        };
        for (a, b) in [((1, 1), (1, 1)), ((4, 1), (1, 2)), ((2, 2), (4, 1))] {
            run_case(&mla(a.0, a.1), &mla(b.0, b.1), 30);
        }
    }

    #[test]
    fn identical_layouts_coalesce_to_one_fragment_per_run_of_blocks() {
        let s = state(4, 4, 1, 1, DataType::F32);
        let slice = rank_slice(&s, 0, 4);
        let bb = slice.block_bytes();
        let (sb, db): (Vec<u64>, Vec<u64>) = (0..8u64)
            .map(|i| (0x10_0000 + i * bb, 0x90_0000 + i * bb))
            .unzip();
        let mut out = Vec::new();
        let st = map_blocks(&slice, &slice, &sb, &db, &mut out).unwrap();
        assert_eq!(st.fragments, 8 * 4 * 2);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].len, 8 * bb);
        // Scattered destination blocks: one fragment per block.
        let db2: Vec<u64> = (0..8u64).map(|i| 0x90_0000 + (7 - i) * bb).collect();
        out.clear();
        let st = map_blocks(&slice, &slice, &sb, &db2, &mut out).unwrap();
        assert_eq!((st.coalesced, out.len()), (8, 8));
        assert!(out.iter().all(|f| f.len == bb));
    }

    #[test]
    fn tp2_to_tp1_fragments_are_head_runs() {
        let ctx = state(2, 4, 2, 1, DataType::F32);
        let gen_s = state(2, 4, 1, 1, DataType::F32);
        let st = run_case(&ctx, &gen_s, 8);
        // One block, 2 layers × K/V per context rank, two context ranks:
        // nothing adjacent on both sides.
        assert_eq!((st.fragments, st.coalesced), (8, 8));
    }

    #[test]
    fn mismatched_block_lists_are_refused() {
        let s = rank_slice(&state(2, 2, 1, 1, DataType::F32), 0, 2);
        let mut out = Vec::new();
        assert!(map_blocks(&s, &s, &[0, 1], &[0], &mut out).is_err());
        assert!(out.is_empty());
    }
}
