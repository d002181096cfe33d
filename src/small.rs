//! The small containers of the per-request hot path, from well-kept crates.
//!
//! Most requests touch one region, carry one descriptor and make one work
//! request, so a list that holds one element inline (no allocation) covers
//! them; the agent's own tables (request ids it numbered, peer names, queue
//! pair numbers) need no flooding-resistant hash.

#![forbid(unsafe_code)]

/// A list that stores one element inline and spills to the heap from the
/// second on.
pub(crate) type Few<T> = smallvec::SmallVec<[T; 1]>;

/// `HashMap` state for the agent's own tables: FxHash.
pub(crate) type FastHash = rustc_hash::FxBuildHasher;
