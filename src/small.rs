//! Small helpers for the per-request hot path: a list that holds one
//! element without allocating, and a cheap hasher for the tables looked up
//! on every request.
//!
//! Why: a small RDMA request (an 8-byte WRITE) used to cost ~20 heap
//! allocations and a SipHash or two on each side; on the soft-RoCE guest
//! that was a third of a ping-pong round trip (`docs/benchmarks.md`). Most
//! requests touch one region, carry one descriptor and make one work
//! request, so "one, inline" covers them.

use std::hash::{BuildHasherDefault, Hasher};

/// A list of `T` that stores zero or one element inline and spills to a
/// `Vec` from the second on.
#[derive(Clone, Debug, Default)]
pub(crate) enum Few<T> {
    #[default]
    Empty,
    One(T),
    Many(Vec<T>),
}

impl<T> Few<T> {
    pub(crate) fn new() -> Self {
        Few::Empty
    }

    pub(crate) fn push(&mut self, v: T) {
        // The first element is written in place (no round trip of the whole
        // list through `take`): what a request's one region hold costs.
        match self {
            Few::Empty => *self = Few::One(v),
            Few::Many(all) => all.push(v),
            Few::One(_) => {
                if let Few::One(a) = std::mem::take(self) {
                    *self = Few::Many(vec![a, v]);
                }
            }
        }
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Few::Empty => &[],
            Few::One(a) => std::slice::from_ref(a),
            Few::Many(all) => all,
        }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        match self {
            Few::Empty => &mut [],
            Few::One(a) => std::slice::from_mut(a),
            Few::Many(all) => all,
        }
    }

    /// Drops every element (a spilled list keeps its allocation).
    pub(crate) fn clear(&mut self) {
        match self {
            Few::Many(all) => all.clear(),
            _ => *self = Few::Empty,
        }
    }
}

impl<T> std::ops::Deref for Few<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T> std::ops::DerefMut for Few<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl<T: PartialEq> PartialEq for Few<T> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: Eq> Eq for Few<T> {}

impl<T> From<Vec<T>> for Few<T> {
    fn from(mut v: Vec<T>) -> Self {
        match v.len() {
            0 => Few::Empty,
            1 => Few::One(v.pop().expect("one element")),
            _ => Few::Many(v),
        }
    }
}

impl<T> FromIterator<T> for Few<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        let mut it = iter.into_iter();
        let Some(a) = it.next() else {
            return Few::Empty;
        };
        let Some(b) = it.next() else {
            return Few::One(a);
        };
        let mut all = Vec::with_capacity(2 + it.size_hint().0);
        all.push(a);
        all.push(b);
        all.extend(it);
        Few::Many(all)
    }
}

impl<T> IntoIterator for Few<T> {
    type Item = T;
    type IntoIter = FewIter<T>;

    fn into_iter(self) -> FewIter<T> {
        match self {
            Few::Empty => FewIter::One(None),
            Few::One(a) => FewIter::One(Some(a)),
            Few::Many(all) => FewIter::Many(all.into_iter()),
        }
    }
}

impl<'a, T> IntoIterator for &'a Few<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// By-value iterator of a [`Few`].
pub(crate) enum FewIter<T> {
    One(Option<T>),
    Many(std::vec::IntoIter<T>),
}

impl<T> Iterator for FewIter<T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        match self {
            FewIter::One(v) => v.take(),
            FewIter::Many(it) => it.next(),
        }
    }
}

/// FNV-1a over bytes, with a multiplicative finish for integers: for the
/// agent's own tables (request ids it numbered itself, peer names it was
/// given), where SipHash's flooding resistance buys nothing and costs a
/// measurable part of a small request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FastHasher(u64);

impl Default for FastHasher {
    fn default() -> Self {
        FastHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: consecutive ids spread over the whole word (the
        // table uses the top bits too).
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 ^= self.0 >> 29;
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// `HashMap` state for [`FastHasher`].
pub(crate) type FastHash = BuildHasherDefault<FastHasher>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn few_keeps_order_and_spills() {
        let mut f = Few::new();
        assert!(f.is_empty());
        f.push(1);
        assert!(matches!(f, Few::One(1)));
        f.push(2);
        f.push(3);
        assert_eq!(f.as_slice(), &[1, 2, 3]);
        f[1] = 5;
        assert_eq!(f.iter().copied().collect::<Vec<_>>(), vec![1, 5, 3]);
        assert_eq!(f.clone().into_iter().collect::<Vec<_>>(), vec![1, 5, 3]);
        f.clear();
        assert!(f.is_empty());
        f.push(7);
        assert_eq!(f.as_slice(), &[7]);
        assert_eq!(Few::from(vec![4]), [4].into_iter().collect::<Few<_>>());
        assert_eq!(Few::<u8>::from(vec![]), Few::Empty);
    }

    #[test]
    fn fast_hash_maps_behave_as_maps() {
        let mut m: HashMap<u64, u64, FastHash> = HashMap::default();
        for i in 0..10_000u64 {
            m.insert(i, i * 2);
        }
        for i in (0..10_000u64).step_by(2) {
            assert_eq!(m.remove(&i), Some(i * 2));
        }
        assert_eq!(m.len(), 5_000);
        assert_eq!(m.get(&9_999), Some(&19_998));
        let mut s: HashMap<String, u8, FastHash> = HashMap::default();
        s.insert("kvxfer-ping".into(), 1);
        s.insert("kvxfer-pong".into(), 2);
        assert_eq!(s.get("kvxfer-pong"), Some(&2));
        assert_eq!(s.get("kvxfer-pon"), None);
    }
}
