//! What each side of a KV-cache transfer knows about its own cache: model
//! shape, parallel layout, element type, attention kind. Both sides
//! exchange it; [`CacheState::check_compatible`] says what differs when the
//! two cannot be mapped onto each other.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::cache::error::CacheError;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DataType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (E4M3 or E5M2: the bytes move unchanged).
    Fp8,
    /// 8-bit integer.
    I8,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> u32 {
        match self {
            DataType::F32 => 4,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::Fp8 | DataType::I8 => 1,
        }
    }
}

/// Attention kind: how many tensors (K and V, or one latent) a layer keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Attention {
    /// Multi-head / grouped-query attention: K and V per layer (factor 2).
    Default,
    /// Multi-head latent attention: one latent per layer, replicated on
    /// every TP rank; `kv_factor` is 1 (latent only) or 2.
    Mla {
        /// Tensors per layer.
        kv_factor: u32,
    },
}

impl Attention {
    /// Tensors per layer (2: K and V).
    pub fn kv_factor(self) -> u32 {
        match self {
            Attention::Default => 2,
            Attention::Mla { kv_factor } => kv_factor,
        }
    }

    /// Whether this is MLA.
    pub fn is_mla(self) -> bool {
        matches!(self, Attention::Mla { .. })
    }
}

/// Attention data parallelism: each DP group serves its own requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttentionDp {
    /// This rank's DP group.
    pub rank: u32,
    /// Number of DP groups (divides TP).
    pub size: u32,
}

/// One side's KV-cache layout.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CacheState {
    /// KV heads held by one rank, per model layer (all layers of the model).
    pub kv_heads_per_layer: Vec<u32>,
    /// Elements per head (for MLA: the latent width).
    pub head_size: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Element type.
    pub dtype: DataType,
    /// Attention kind.
    pub attention: Attention,
    /// Tensor parallelism (power of two).
    pub tp: u32,
    /// Pipeline parallelism.
    pub pp: u32,
    /// Attention data parallelism, if enabled.
    pub attention_dp: Option<AttentionDp>,
    /// Layers on each PP rank, in order (uneven splits allowed); sums to
    /// the model's layer count.
    pub layers_per_pp: Vec<u32>,
}

/// Most TP (and PP) ranks a cache state may name.
pub const MAX_PARALLEL: u32 = 1 << 12;
/// Most layers a cache state may name.
pub const MAX_LAYERS: u32 = 1 << 14;
/// Most KV heads per rank per layer.
pub const MAX_HEADS: u32 = 1 << 12;
/// Largest head size, in elements.
pub const MAX_HEAD_SIZE: u32 = 1 << 14;
/// Most tokens per block. With the other bounds a block of one rank stays
/// under 2^59 bytes, so block arithmetic cannot overflow.
pub const MAX_TOKENS_PER_BLOCK: u32 = 1 << 16;

impl CacheState {
    /// A state with `layers` split as evenly as possible over `pp` ranks
    /// (earlier ranks take the remainder), the same `kv_heads_per_rank` on
    /// every layer, no attention DP.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        layers: u32,
        kv_heads_per_rank: u32,
        head_size: u32,
        tokens_per_block: u32,
        dtype: DataType,
        attention: Attention,
        tp: u32,
        pp: u32,
    ) -> Self {
        let pp_n = pp.max(1);
        let layers_per_pp = (0..pp_n)
            .map(|i| layers / pp_n + u32::from(i < layers % pp_n))
            .collect();
        Self {
            kv_heads_per_layer: vec![kv_heads_per_rank; layers as usize],
            head_size,
            tokens_per_block,
            dtype,
            attention,
            tp,
            pp,
            attention_dp: None,
            layers_per_pp,
        }
    }

    /// With attention DP of `size` groups; this rank in group `rank`.
    pub fn with_attention_dp(mut self, rank: u32, size: u32) -> Self {
        self.attention_dp = Some(AttentionDp { rank, size });
        self
    }

    /// With an explicit split of layers over PP ranks.
    pub fn with_layers_per_pp(mut self, layers: Vec<u32>) -> Self {
        self.layers_per_pp = layers;
        self
    }

    /// Ranks in this executor (TP × PP).
    pub fn world_size(&self) -> u32 {
        self.tp.saturating_mul(self.pp)
    }

    /// Layers in the model.
    pub fn num_layers(&self) -> u32 {
        // Saturating: a peer's state is summed before it is validated, and
        // `validate` refuses anything past `MAX_LAYERS`.
        self.layers_per_pp
            .iter()
            .fold(0u32, |a, &b| a.saturating_add(b))
    }

    /// TP ranks per attention-DP group (TP without attention DP).
    pub fn tp_per_dp(&self) -> u32 {
        match self.attention_dp {
            Some(dp) => self.tp / dp.size.max(1),
            None => self.tp,
        }
    }

    /// `(tp_rank, pp_rank)` of global `rank` (`rank = pp_rank × TP + tp_rank`).
    pub fn coords(&self, rank: u32) -> (u32, u32) {
        (rank % self.tp, rank / self.tp)
    }

    /// The half-open range of model layers on PP rank `pp_rank`.
    pub fn layer_range(&self, pp_rank: u32) -> std::ops::Range<u32> {
        let start: u32 = self.layers_per_pp[..pp_rank as usize].iter().sum();
        start..start + self.layers_per_pp[pp_rank as usize]
    }

    /// KV heads on one rank (of the first layer; uniform per layer is
    /// checked by [`validate`](Self::validate)).
    pub fn heads_per_rank(&self) -> u32 {
        self.kv_heads_per_layer.first().copied().unwrap_or(0)
    }

    /// Bytes of one block of one layer on one rank: `kv_factor × heads ×
    /// tokens_per_block × head_size × element size`.
    pub fn layer_block_bytes(&self) -> u64 {
        u64::from(self.attention.kv_factor())
            * u64::from(self.heads_per_rank())
            * u64::from(self.tokens_per_block)
            * u64::from(self.head_size)
            * u64::from(self.dtype.size())
    }

    /// Checks the state on its own: positive sizes, TP a power of two, the
    /// layer split matching PP and the layer count, attention DP dividing
    /// TP, a uniform head count per layer.
    ///
    /// # Errors
    /// [`CacheError::InvalidState`] saying what is wrong.
    pub fn validate(&self) -> Result<(), CacheError> {
        let bad = |what: String| Err(CacheError::InvalidState(what));
        // Bounds first: a peer's state sizes allocations and products of
        // its fields (a block's bytes stay far below 2^64 within them).
        for (what, v, max) in [
            ("TP", self.tp, MAX_PARALLEL),
            ("PP", self.pp, MAX_PARALLEL),
            ("layers", self.num_layers(), MAX_LAYERS),
            ("heads per rank", self.heads_per_rank(), MAX_HEADS),
            ("head size", self.head_size, MAX_HEAD_SIZE),
            (
                "tokens per block",
                self.tokens_per_block,
                MAX_TOKENS_PER_BLOCK,
            ),
        ] {
            if v > max {
                return bad(format!("{what} is {v}, more than {max}"));
            }
        }
        if self.tp == 0 || !self.tp.is_power_of_two() {
            return bad(format!("TP must be a power of two, is {}", self.tp));
        }
        if self.pp == 0 || self.layers_per_pp.len() != self.pp as usize {
            return bad(format!(
                "PP is {} but {} layer counts are given",
                self.pp,
                self.layers_per_pp.len()
            ));
        }
        if self.num_layers() as usize != self.kv_heads_per_layer.len() {
            return bad(format!(
                "{} layers over the PP ranks but {} head counts",
                self.num_layers(),
                self.kv_heads_per_layer.len()
            ));
        }
        if self.num_layers() == 0 {
            return bad("no layers".into());
        }
        let h = self.heads_per_rank();
        if h == 0 || self.kv_heads_per_layer.iter().any(|&x| x != h) {
            return bad("every layer must hold the same, non-zero number of heads per rank".into());
        }
        if self.head_size == 0 || self.tokens_per_block == 0 {
            return bad("head size and tokens per block must be positive".into());
        }
        if !matches!(self.attention.kv_factor(), 1 | 2) {
            return bad(format!(
                "K/V factor must be 1 or 2, is {}",
                self.attention.kv_factor()
            ));
        }
        if self.attention.is_mla() && h != 1 {
            return bad(format!("MLA keeps one latent head per rank, not {h}"));
        }
        if let Some(dp) = self.attention_dp
            && (dp.size == 0 || !self.tp.is_multiple_of(dp.size) || dp.rank >= dp.size)
        {
            return bad(format!(
                "attention DP rank {} of {} does not fit TP {}",
                dp.rank, dp.size, self.tp
            ));
        }
        Ok(())
    }

    /// Checks that a context state (`self`) and a generation state can be
    /// mapped onto each other: same element type, attention kind and K/V
    /// factor, head size, tokens per block and layer count, and the same
    /// model head count (heads per rank × TP per DP group, up to head
    /// duplication). TP, PP, attention DP and the layer split may differ.
    ///
    /// # Errors
    /// [`CacheError::InvalidState`] for either side on its own, or
    /// [`CacheError::Incompatible`] naming the first field that differs.
    pub fn check_compatible(&self, gen_side: &CacheState) -> Result<(), CacheError> {
        self.validate()?;
        gen_side.validate()?;
        let differ = |field: &'static str, ctx: String, gen_v: String| {
            Err(CacheError::Incompatible {
                field,
                context: ctx,
                generation: gen_v,
            })
        };
        if self.dtype != gen_side.dtype {
            return differ(
                "dtype",
                format!("{:?}", self.dtype),
                format!("{:?}", gen_side.dtype),
            );
        }
        if self.attention != gen_side.attention {
            return differ(
                "attention",
                format!("{:?}", self.attention),
                format!("{:?}", gen_side.attention),
            );
        }
        if self.head_size != gen_side.head_size {
            return differ(
                "head_size",
                self.head_size.to_string(),
                gen_side.head_size.to_string(),
            );
        }
        if self.tokens_per_block != gen_side.tokens_per_block {
            return differ(
                "tokens_per_block",
                self.tokens_per_block.to_string(),
                gen_side.tokens_per_block.to_string(),
            );
        }
        if self.num_layers() != gen_side.num_layers() {
            return differ(
                "layers",
                self.num_layers().to_string(),
                gen_side.num_layers().to_string(),
            );
        }
        if !self.attention.is_mla() {
            // Total heads per DP group; the side with more is duplicating
            // heads (TP above the head count), which needs one head per rank.
            let (a, b) = (
                self.heads_per_rank() * self.tp_per_dp(),
                gen_side.heads_per_rank() * gen_side.tp_per_dp(),
            );
            let (big, small, big_state) = if a >= b {
                (a, b, self)
            } else {
                (b, a, gen_side)
            };
            if !big.is_multiple_of(small) || (big != small && big_state.heads_per_rank() != 1) {
                return differ(
                    "kv_heads",
                    format!(
                        "{} per rank × TP {}",
                        self.heads_per_rank(),
                        self.tp_per_dp()
                    ),
                    format!(
                        "{} per rank × TP {}",
                        gen_side.heads_per_rank(),
                        gen_side.tp_per_dp()
                    ),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_state() -> impl Strategy<Value = CacheState> {
        (
            prop::collection::vec(any::<u32>(), 0..4),
            prop::collection::vec(prop_oneof![Just(8u32), any::<u32>()], 0..6),
            any::<u32>(),
            any::<u32>(),
            prop_oneof![
                Just(Attention::Default),
                any::<u32>().prop_map(|k| Attention::Mla { kv_factor: k })
            ],
            prop_oneof![Just(1u32), Just(2), Just(1 << 31), any::<u32>()],
            prop_oneof![Just(1u32), any::<u32>()],
            prop::option::of((any::<u32>(), any::<u32>())),
        )
            .prop_map(
                |(layers, heads, head_size, tokens, attention, tp, pp, dp)| CacheState {
                    kv_heads_per_layer: heads,
                    head_size,
                    tokens_per_block: tokens,
                    dtype: DataType::F32,
                    attention,
                    tp,
                    pp,
                    attention_dp: dp.map(|(rank, size)| AttentionDp { rank, size }),
                    layers_per_pp: layers,
                },
            )
    }

    proptest! {
        /// A peer's state, however hostile, gets an answer and never a
        /// panic; a state that validates has sizes that fit their types.
        #[test]
        fn hostile_states_are_refused_not_panicked_on(a in any_state(), b in any_state()) {
            let _ = a.check_compatible(&b);
            let _ = a.num_layers();
            let _ = a.world_size();
            if a.validate().is_ok() {
                prop_assert!(a.tp <= MAX_PARALLEL && a.num_layers() <= MAX_LAYERS);
                let bytes = u64::from(a.attention.kv_factor())
                    .checked_mul(u64::from(a.heads_per_rank()))
                    .and_then(|x| x.checked_mul(u64::from(a.tokens_per_block)))
                    .and_then(|x| x.checked_mul(u64::from(a.head_size)))
                    .and_then(|x| x.checked_mul(u64::from(a.dtype.size())));
                prop_assert_eq!(bytes, Some(a.layer_block_bytes()));
            }
        }
    }

    #[test]
    fn huge_tp_and_layer_sums_are_refused() {
        let s = CacheState::new(32, 8, 128, 16, DataType::Bf16, Attention::Default, 1, 1);
        let mut t = s.clone();
        t.tp = 1 << 31;
        assert!(matches!(t.validate(), Err(CacheError::InvalidState(_))));
        let mut t = s.clone();
        t.pp = 2;
        t.layers_per_pp = vec![u32::MAX, 2];
        assert!(matches!(t.validate(), Err(CacheError::InvalidState(_))));
        assert!(s.validate().is_ok());
    }
}
