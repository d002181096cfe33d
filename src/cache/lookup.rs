//! Partial reuse: the context side finds a request's blocks from the key of
//! its last block, walking back, through a lookup the serving engine
//! provides (its reuse radix tree).

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::RwLock;

/// The serving engine's block index, as the context side sees it.
pub trait BlockLookup: Send + Sync {
    /// The block whose key is `key`: its start address in the pool and the
    /// key of the block before it in its sequence (`None` for the first).
    fn block(&self, key: u64) -> Option<(u64, Option<u64>)>;
}

/// A reference [`BlockLookup`] in memory, for tests and simple engines.
#[derive(Default, Debug)]
pub struct MemBlockLookup {
    blocks: RwLock<HashMap<u64, (u64, Option<u64>)>>,
}

impl MemBlockLookup {
    /// An empty lookup.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a sequence: `keys[i]` names the block at `addrs[i]`, each
    /// following the one before.
    pub fn insert_sequence(&self, keys: &[u64], addrs: &[u64]) {
        let mut m = self.blocks.write().unwrap_or_else(|p| p.into_inner());
        for (i, (&k, &a)) in keys.iter().zip(addrs).enumerate() {
            let prev = i.checked_sub(1).map(|j| keys[j]);
            m.insert(k, (a, prev));
        }
    }
}

impl BlockLookup for MemBlockLookup {
    fn block(&self, key: u64) -> Option<(u64, Option<u64>)> {
        self.blocks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .copied()
    }
}

/// The last `count` blocks of the sequence ending with `last_key`, oldest
/// first; `None` when the lookup misses or the sequence is shorter.
pub(crate) fn walk_back(lookup: &dyn BlockLookup, last_key: u64, count: usize) -> Option<Vec<u64>> {
    let mut out = Vec::with_capacity(count);
    let mut key = Some(last_key);
    while out.len() < count {
        let (addr, prev) = lookup.block(key?)?;
        out.push(addr);
        key = prev;
    }
    out.reverse();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_back_from_the_last_key() {
        let l = MemBlockLookup::new();
        l.insert_sequence(&[11, 12, 13, 14], &[100, 200, 300, 400]);
        assert_eq!(walk_back(&l, 14, 2), Some(vec![300, 400]));
        assert_eq!(walk_back(&l, 13, 3), Some(vec![100, 200, 300]));
        assert_eq!(walk_back(&l, 14, 5), None);
        assert_eq!(walk_back(&l, 99, 1), None);
    }
}
