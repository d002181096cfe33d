//! Which ranks of the other executor a rank exchanges KV cache with: pure
//! functions of the two [`CacheState`]s, run by both sides from their own
//! point of view ("self" and "peer"), as the reference transceiver does.
//!
//! Global rank numbering: `rank = pp_rank × TP + tp_rank`. Context
//! parallelism is not supported (CP = 1 on both sides).

#![forbid(unsafe_code)]

use crate::cache::error::CacheError;
use crate::cache::state::CacheState;

/// The peer ranks one rank talks to, and the shape of that domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetRanks {
    /// Peer global ranks, TP index outer, PP index inner.
    pub ranks: Vec<u32>,
    /// Peer TP ranks in the domain.
    pub domain_tp: u32,
    /// Peer PP ranks in the domain.
    pub domain_pp: u32,
    /// First peer PP rank of the domain.
    pub first_peer_pp: u32,
    /// For each peer PP rank of the domain, how many of self's layers it
    /// holds (they sum to self's layer count).
    pub peer_layers_in_domain: Vec<u32>,
    /// Heads are duplicated this many times more on self's side than on the
    /// peer's (1: not more).
    pub dup_head_factor: u32,
    /// Heads are duplicated this many times more on the peer's side.
    pub peer_dup_head_factor: u32,
}

/// The peer ranks `self_rank` (of `me`) exchanges cache with, for a request
/// owned by the peer's attention-DP group `peer_dp_rank` (0 without DP).
///
/// # Errors
/// [`CacheError::InvalidState`] for a rank outside `me`, a DP rank outside
/// the peer, or layer ranges that do not cover each other.
pub fn target_ranks(
    me: &CacheState,
    self_rank: u32,
    peer: &CacheState,
    peer_dp_rank: u32,
) -> Result<TargetRanks, CacheError> {
    if self_rank >= me.world_size() {
        return Err(CacheError::InvalidState(format!(
            "rank {self_rank} outside TP {} × PP {}",
            me.tp, me.pp
        )));
    }
    let (self_tp, self_pp) = me.coords(self_rank);
    // PP domain: peer stages whose layers overlap ours.
    let mine = me.layer_range(self_pp);
    let mut first_peer_pp = None;
    let mut overlaps = Vec::new();
    for p in 0..peer.pp {
        let theirs = peer.layer_range(p);
        let lo = mine.start.max(theirs.start);
        let hi = mine.end.min(theirs.end);
        if lo < hi {
            first_peer_pp.get_or_insert(p);
            overlaps.push(hi - lo);
        }
    }
    if overlaps.iter().sum::<u32>() != mine.len() as u32 {
        return Err(CacheError::InvalidState(format!(
            "the peer's layers do not cover layers {mine:?}"
        )));
    }
    let first_peer_pp = first_peer_pp.unwrap_or(0);
    let domain_pp = overlaps.len() as u32;
    // TP domain, within the peer's DP group.
    let (self_tpd, peer_tpd) = (me.tp_per_dp(), peer.tp_per_dp());
    let peer_dp_groups = peer.tp / peer_tpd;
    if peer_dp_rank >= peer_dp_groups {
        return Err(CacheError::InvalidState(format!(
            "peer DP rank {peer_dp_rank} outside its {peer_dp_groups} groups"
        )));
    }
    let self_tp_in_dp = self_tp % self_tpd;
    let (domain_tp, start) = if self_tpd <= peer_tpd {
        let d = peer_tpd / self_tpd;
        (d, self_tp_in_dp * d + peer_dp_rank * peer_tpd)
    } else {
        (
            1,
            self_tp_in_dp / (self_tpd / peer_tpd) + peer_dp_rank * peer_tpd,
        )
    };
    let mut ranks = Vec::with_capacity((domain_tp * domain_pp) as usize);
    for tp in start..start + domain_tp {
        for pp in first_peer_pp..first_peer_pp + domain_pp {
            ranks.push(pp * peer.tp + tp);
        }
    }
    let (self_h, peer_h) = (
        me.heads_per_rank() * self_tpd,
        peer.heads_per_rank() * peer_tpd,
    );
    let (dup, peer_dup) = if me.attention.is_mla() {
        (1, 1)
    } else {
        (
            (self_h / peer_h.max(1)).max(1),
            (peer_h / self_h.max(1)).max(1),
        )
    };
    Ok(TargetRanks {
        ranks,
        domain_tp,
        domain_pp,
        first_peer_pp,
        peer_layers_in_domain: overlaps,
        dup_head_factor: dup,
        peer_dup_head_factor: peer_dup,
    })
}

/// Whether context rank `self_rank` sends its cache for a request of the
/// generation DP group `dest_dp_rank`: of replicas holding the same heads
/// (duplicated heads, or MLA's replicated latent) exactly one sends.
///
/// # Errors
/// As [`target_ranks`].
pub fn needs_send(
    ctx: &CacheState,
    self_rank: u32,
    gen_state: &CacheState,
    dest_dp_rank: u32,
) -> Result<bool, CacheError> {
    let t = target_ranks(ctx, self_rank, gen_state, dest_dp_rank)?;
    let (self_tp, _) = ctx.coords(self_rank);
    let self_tp_in_dp = self_tp % ctx.tp_per_dp();
    if ctx.attention.is_mla() {
        let (s, d) = (ctx.tp_per_dp(), gen_state.tp_per_dp());
        return Ok(s <= d || self_tp_in_dp.is_multiple_of(s / d));
    }
    let dup = t.dup_head_factor;
    Ok(dup <= 1 || dest_dp_rank % dup == self_tp_in_dp % dup)
}

/// The context ranks generation rank `self_rank` receives from, for a
/// request whose context DP group is `ctx_dp_rank`: the target ranks minus
/// the duplicate replicas that do not send (they hold the same heads), or
/// for MLA one TP rank per PP stage. Ordered TP outer, PP inner.
///
/// # Errors
/// As [`target_ranks`].
pub fn recv_ranks(
    gen_state: &CacheState,
    self_rank: u32,
    ctx: &CacheState,
    ctx_dp_rank: u32,
) -> Result<Vec<u32>, CacheError> {
    let t = target_ranks(gen_state, self_rank, ctx, ctx_dp_rank)?;
    if gen_state.attention.is_mla() {
        return Ok(t.ranks[..t.domain_pp as usize].to_vec());
    }
    let peer_dup = t.peer_dup_head_factor;
    if peer_dup <= 1 {
        return Ok(t.ranks);
    }
    let self_dp = gen_state.attention_dp.map_or(0, |d| d.rank);
    Ok(t.ranks
        .chunks(t.domain_pp as usize)
        .enumerate()
        .filter(|(i, _)| *i as u32 % peer_dup == self_dp % peer_dup)
        .flat_map(|(_, c)| c.iter().copied())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{Attention, DataType};

    fn mla(tp: u32, pp: u32, layers: u32) -> CacheState {
        CacheState::new(
            layers,
            1,
            576,
            16,
            DataType::Bf16,
            Attention::Mla { kv_factor: 1 },
            tp,
            pp,
        )
    }

    fn gqa(tp: u32, pp: u32, layers: u32, heads_per_rank: u32) -> CacheState {
        CacheState::new(
            layers,
            heads_per_rank,
            128,
            16,
            DataType::Bf16,
            Attention::Default,
            tp,
            pp,
        )
    }

    /// The reference's `targetTest.CacheStateNODP`, ctx TP4 PP2 → gen TP2
    /// PP2 (MLA, 16 layers): ranks 0 and 1 both target gen rank 0; only
    /// rank 0 sends.
    #[test]
    fn reference_target_test_mla_tp4pp2_to_tp2pp2() {
        let (ctx, gen_s) = (mla(4, 2, 16), mla(2, 2, 16));
        ctx.check_compatible(&gen_s).unwrap();
        let r0 = target_ranks(&ctx, 0, &gen_s, 0).unwrap();
        assert_eq!(r0.ranks, vec![0]);
        assert_eq!((r0.domain_tp, r0.domain_pp), (1, 1));
        assert!(needs_send(&ctx, 0, &gen_s, 0).unwrap());
        let r1 = target_ranks(&ctx, 1, &gen_s, 0).unwrap();
        assert_eq!(r1.ranks, vec![0]);
        assert!(!needs_send(&ctx, 1, &gen_s, 0).unwrap());
        // Second stage: ctx rank 4 (tp 0, pp 1) → gen rank 2 (tp 0, pp 1).
        assert_eq!(target_ranks(&ctx, 4, &gen_s, 0).unwrap().ranks, vec![2]);
        // The generation side takes one TP rank per PP stage.
        assert_eq!(recv_ranks(&gen_s, 0, &ctx, 0).unwrap(), vec![0]);
    }

    /// `targetTest.CacheStateContextDP`: ctx TP4 with attention DP → gen
    /// TP2 with attention DP: every context rank targets the request's
    /// generation DP rank and sends.
    #[test]
    fn reference_target_test_context_dp() {
        for ctx_rank in 0..4 {
            let ctx = mla(4, 1, 16).with_attention_dp(ctx_rank, 4);
            for gen_dp in 0..2 {
                let gen_s = mla(2, 1, 16).with_attention_dp(gen_dp, 2);
                let t = target_ranks(&ctx, ctx_rank, &gen_s, gen_dp).unwrap();
                assert_eq!(t.ranks, vec![gen_dp], "ctx rank {ctx_rank}");
                assert!(needs_send(&ctx, ctx_rank, &gen_s, gen_dp).unwrap());
            }
        }
    }

    #[test]
    fn identity_layout_is_one_to_one() {
        let s = gqa(2, 2, 8, 4);
        for r in 0..4 {
            let t = target_ranks(&s, r, &s, 0).unwrap();
            assert_eq!(t.ranks, vec![r]);
            assert_eq!(t.peer_layers_in_domain, vec![4]);
            assert!(needs_send(&s, r, &s, 0).unwrap());
            assert_eq!(recv_ranks(&s, r, &s, 0).unwrap(), vec![r]);
        }
    }

    #[test]
    fn tp_mismatch_splits_heads_both_ways() {
        // 8 KV heads: ctx TP2 (4 per rank) → gen TP4 (2 per rank).
        let (ctx, gen_s) = (gqa(2, 1, 4, 4), gqa(4, 1, 4, 2));
        ctx.check_compatible(&gen_s).unwrap();
        assert_eq!(target_ranks(&ctx, 1, &gen_s, 0).unwrap().ranks, vec![2, 3]);
        assert_eq!(recv_ranks(&gen_s, 3, &ctx, 0).unwrap(), vec![1]);
        // And back: gen TP1 receives from both context ranks.
        let g1 = gqa(1, 1, 4, 8);
        assert_eq!(recv_ranks(&g1, 0, &ctx, 0).unwrap(), vec![0, 1]);
    }

    #[test]
    fn uneven_pp_overlaps_sum_to_own_layers() {
        // 10 layers over ctx PP4 (3/3/2/2) → gen PP2 (5/5).
        let ctx = gqa(1, 4, 10, 4);
        let gen_s = gqa(1, 2, 10, 4);
        assert_eq!(ctx.layers_per_pp, vec![3, 3, 2, 2]);
        let g0 = target_ranks(&gen_s, 0, &ctx, 0).unwrap();
        assert_eq!(g0.ranks, vec![0, 1]);
        assert_eq!(g0.peer_layers_in_domain, vec![3, 2]);
        let g1 = target_ranks(&gen_s, 1, &ctx, 0).unwrap();
        assert_eq!(g1.ranks, vec![1, 2, 3]);
        assert_eq!(g1.peer_layers_in_domain, vec![1, 2, 2]);
        let c1 = target_ranks(&ctx, 1, &gen_s, 0).unwrap();
        assert_eq!(c1.ranks, vec![0, 1]);
        assert_eq!(c1.peer_layers_in_domain, vec![2, 1]);
    }

    #[test]
    fn duplicate_heads_send_once_and_receive_once() {
        // 2 KV heads: ctx TP4 (each head on two ranks) → gen TP2.
        let (ctx, gen_s) = (gqa(4, 1, 4, 1), gqa(2, 1, 4, 1));
        ctx.check_compatible(&gen_s).unwrap();
        // Context ranks 0 and 1 hold head 0, 2 and 3 head 1.
        for r in 0..4 {
            let t = target_ranks(&ctx, r, &gen_s, 0).unwrap();
            assert_eq!(t.ranks, vec![r / 2]);
            assert_eq!(t.dup_head_factor, 2);
        }
        let senders: Vec<u32> = (0..4)
            .filter(|&r| needs_send(&ctx, r, &gen_s, 0).unwrap())
            .collect();
        assert_eq!(senders, vec![0, 2]);
        // The other way: gen TP4 duplicates; each gen rank receives from
        // the one context rank with its head.
        let (ctx2, gen2) = (gqa(2, 1, 4, 1), gqa(4, 1, 4, 1));
        for r in 0..4 {
            assert_eq!(recv_ranks(&gen2, r, &ctx2, 0).unwrap(), vec![r / 2]);
        }
        // Receiving from the duplicating side: each generation rank keeps
        // exactly the context rank that sends its heads.
        assert_eq!(recv_ranks(&gen_s, 0, &ctx, 0).unwrap(), vec![0]);
        assert_eq!(recv_ranks(&gen_s, 1, &ctx, 0).unwrap(), vec![2]);
    }

    #[test]
    fn mismatches_are_typed_errors() {
        let base = gqa(2, 1, 4, 4);
        let mut other = base.clone();
        other.dtype = DataType::F16;
        assert!(matches!(
            base.check_compatible(&other),
            Err(CacheError::Incompatible { field: "dtype", .. })
        ));
        let other = gqa(2, 1, 5, 4);
        assert!(matches!(
            base.check_compatible(&other),
            Err(CacheError::Incompatible {
                field: "layers",
                ..
            })
        ));
        let other = gqa(2, 1, 4, 3);
        assert!(matches!(
            base.check_compatible(&other),
            Err(CacheError::Incompatible {
                field: "kv_heads",
                ..
            })
        ));
        let mut bad = base.clone();
        bad.tp = 3;
        assert!(matches!(bad.validate(), Err(CacheError::InvalidState(_))));
        assert!(target_ranks(&base, 2, &base, 0).is_err());
        assert!(target_ranks(&base, 0, &base, 1).is_err());
    }
}
