//! Memory model: what a descriptor names, and the registration table that
//! validates descriptors against registered regions.
//!
//! A [`MemoryDesc`] is a byte range `[addr, addr + len)` on a device. Ranges
//! live in *address spaces*: host (DRAM) and GPU (VRAM) memory share the
//! process's unified virtual address space, so `device_id` does not separate
//! them; for block, object and file memory `device_id` names the volume,
//! object or file descriptor, and `addr` is an offset inside it.
//!
//! [`RegionMap`] keeps non-overlapping regions per address space in a
//! `BTreeMap`, so "which registered region contains this range" costs
//! O(log n).
//!
//! Pure: its own error ([`MemoryError`]), no I/O, nothing else of the
//! crate imported.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a descriptor or a registration is refused: the memory model's own
/// error, free of the agent layer (whose [`Error`](crate::Error) carries
/// it as `Error::InvalidDescriptor` and `Error::Overlap`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A descriptor is malformed (zero length, address range overflow).
    #[error("invalid descriptor {desc:?}: {reason}")]
    InvalidDescriptor {
        /// The offending descriptor.
        desc: MemoryDesc,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A registration overlaps one that already exists.
    #[error("descriptor {desc:?} overlaps registered region {existing:?}")]
    Overlap {
        /// The descriptor being registered.
        desc: MemoryDesc,
        /// The existing registration it overlaps.
        existing: MemoryDesc,
    },
}

/// The kind of memory a descriptor refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum MemoryType {
    /// Host memory.
    Dram,
    /// GPU memory.
    Vram,
    /// A block device; `device_id` names it, `addr` is a byte offset.
    Blk,
    /// An object store object; `device_id` is the object key.
    Obj,
    /// A file; `device_id` is the file descriptor, `addr` a byte offset.
    File,
}

impl MemoryType {
    /// Lower-case name, as used in logs and the C ABI (`"dram"`, `"vram"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryType::Dram => "dram",
            MemoryType::Vram => "vram",
            MemoryType::Blk => "blk",
            MemoryType::Obj => "obj",
            MemoryType::File => "file",
        }
    }

    /// Whether ranges of this type live in the process's virtual address
    /// space (so `device_id` does not separate address spaces).
    pub fn is_virtual_address(self) -> bool {
        matches!(self, MemoryType::Dram | MemoryType::Vram)
    }
}

impl fmt::Display for MemoryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One byte range: `[addr, addr + len)` on device `device_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryDesc {
    /// Start address (or offset, for block/object/file memory).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device index (GPU ordinal, NUMA node, file descriptor, ...).
    pub device_id: u32,
}

impl MemoryDesc {
    /// A descriptor for `len` bytes at `addr` on device `device_id`.
    pub const fn new(addr: u64, len: u64, device_id: u32) -> Self {
        Self {
            addr,
            len,
            device_id,
        }
    }

    /// A host-memory descriptor covering `buf`.
    pub fn from_slice(buf: &[u8]) -> Self {
        Self::new(buf.as_ptr() as u64, buf.len() as u64, 0)
    }

    /// One past the last byte, or `None` when `addr + len` overflows.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// Checks that the range is non-empty and does not wrap around.
    ///
    /// # Errors
    /// [`MemoryError::InvalidDescriptor`] naming the problem.
    pub fn validate(&self) -> Result<(), MemoryError> {
        if self.len == 0 {
            return Err(MemoryError::InvalidDescriptor {
                desc: *self,
                reason: "zero length",
            });
        }
        if self.end().is_none() {
            return Err(MemoryError::InvalidDescriptor {
                desc: *self,
                reason: "addr + len overflows",
            });
        }
        Ok(())
    }
}

/// A list of descriptors that share one memory type.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDescs {
    /// The memory type of every descriptor in `descs`.
    pub mem_type: MemoryType,
    /// The descriptors.
    pub descs: Vec<MemoryDesc>,
}

impl MemoryDescs {
    /// A descriptor list of type `mem_type`.
    pub fn new(mem_type: MemoryType, descs: Vec<MemoryDesc>) -> Self {
        Self { mem_type, descs }
    }

    /// A single host-memory descriptor covering `buf`.
    pub fn dram(buf: &[u8]) -> Self {
        Self::new(MemoryType::Dram, vec![MemoryDesc::from_slice(buf)])
    }

    /// Sum of the descriptors' lengths (saturating).
    pub fn total_len(&self) -> u64 {
        self.descs
            .iter()
            .fold(0u64, |acc, d| acc.saturating_add(d.len))
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether the list holds no descriptor.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }
}

/// The address space a descriptor of a given type belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AddressSpace {
    mem_type: MemoryType,
    device: u32,
}

impl AddressSpace {
    /// The address space of `desc` when it has type `mem_type`.
    pub fn of(mem_type: MemoryType, desc: &MemoryDesc) -> Self {
        let device = if mem_type.is_virtual_address() {
            0
        } else {
            desc.device_id
        };
        Self { mem_type, device }
    }
}

/// A registered region and the value attached to it.
#[derive(Clone, Debug)]
pub struct Region<V> {
    /// The registered range, as registered.
    pub desc: MemoryDesc,
    /// The memory type it was registered with.
    pub mem_type: MemoryType,
    /// Backend data attached to the region (access key, MR, ...).
    pub value: V,
}

impl<V> Region<V> {
    /// Whether `[addr, addr + len)` lies entirely inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let (Some(end), Some(rend)) = (addr.checked_add(len), self.desc.end()) else {
            return false;
        };
        addr >= self.desc.addr && end <= rend
    }
}

/// Non-overlapping regions per address space, with O(log n) lookup of the
/// region containing a range.
#[derive(Clone, Debug)]
pub struct RegionMap<V> {
    spaces: BTreeMap<AddressSpace, BTreeMap<u64, Region<V>>>,
    count: usize,
}

impl<V> Default for RegionMap<V> {
    fn default() -> Self {
        Self {
            spaces: BTreeMap::new(),
            count: 0,
        }
    }
}

impl<V> RegionMap<V> {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether the map holds no region.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Checks that `desc` could be inserted: valid, and overlapping nothing.
    ///
    /// # Errors
    /// [`MemoryError::InvalidDescriptor`] or [`MemoryError::Overlap`].
    pub fn check_insert(&self, mem_type: MemoryType, desc: &MemoryDesc) -> Result<(), MemoryError> {
        desc.validate()?;
        let Some(space) = self.spaces.get(&AddressSpace::of(mem_type, desc)) else {
            return Ok(());
        };
        let end = desc.addr + desc.len; // validated above: no overflow
        // The nearest region starting before `end` is the only candidate:
        // regions are disjoint, so any overlapping one starts before `end`
        // and the last such one ends last.
        if let Some((_, r)) = space.range(..end).next_back() {
            let rend = r.desc.addr + r.desc.len;
            if rend > desc.addr {
                return Err(MemoryError::Overlap {
                    desc: *desc,
                    existing: r.desc,
                });
            }
        }
        Ok(())
    }

    /// Inserts a region.
    ///
    /// # Errors
    /// As [`RegionMap::check_insert`]; nothing changes on error.
    pub fn insert(
        &mut self,
        mem_type: MemoryType,
        desc: MemoryDesc,
        value: V,
    ) -> Result<(), MemoryError> {
        self.check_insert(mem_type, &desc)?;
        self.spaces
            .entry(AddressSpace::of(mem_type, &desc))
            .or_default()
            .insert(
                desc.addr,
                Region {
                    desc,
                    mem_type,
                    value,
                },
            );
        self.count += 1;
        Ok(())
    }

    /// The region registered exactly as `desc` (same start and length).
    pub fn get_exact(&self, mem_type: MemoryType, desc: &MemoryDesc) -> Option<&Region<V>> {
        self.spaces
            .get(&AddressSpace::of(mem_type, desc))?
            .get(&desc.addr)
            .filter(|r| r.desc.len == desc.len)
    }

    /// Removes the region registered exactly as `desc`.
    pub fn remove_exact(&mut self, mem_type: MemoryType, desc: &MemoryDesc) -> Option<Region<V>> {
        let space_key = AddressSpace::of(mem_type, desc);
        let space = self.spaces.get_mut(&space_key)?;
        if space.get(&desc.addr)?.desc.len != desc.len {
            return None;
        }
        let r = space.remove(&desc.addr);
        if space.is_empty() {
            self.spaces.remove(&space_key);
        }
        self.count -= 1;
        r
    }

    /// The region that contains `[desc.addr, desc.addr + desc.len)`, if any.
    pub fn find(&self, mem_type: MemoryType, desc: &MemoryDesc) -> Option<&Region<V>> {
        if desc.len == 0 {
            return None;
        }
        let space = self.spaces.get(&AddressSpace::of(mem_type, desc))?;
        let (_, r) = space.range(..=desc.addr).next_back()?;
        r.contains(desc.addr, desc.len).then_some(r)
    }

    /// As [`find`](Self::find), trying `hint` (the region the previous
    /// descriptor was found in) first: descriptors of one request usually
    /// fall in one region, and this skips the tree walk for them.
    pub fn find_hinted<'a>(
        &'a self,
        mem_type: MemoryType,
        desc: &MemoryDesc,
        hint: Option<&'a Region<V>>,
    ) -> Option<&'a Region<V>> {
        match hint {
            Some(r)
                if r.mem_type == mem_type
                    && r.desc.device_id == desc.device_id
                    && desc.len > 0
                    && r.contains(desc.addr, desc.len) =>
            {
                Some(r)
            }
            _ => self.find(mem_type, desc),
        }
    }

    /// Every region, ordered by address space then address.
    pub fn iter(&self) -> impl Iterator<Item = &Region<V>> {
        self.spaces.values().flat_map(|s| s.values())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(addr: u64, len: u64) -> MemoryDesc {
        MemoryDesc::new(addr, len, 0)
    }

    #[test]
    fn rejects_zero_length_and_overflow() {
        let mut m = RegionMap::new();
        assert!(matches!(
            m.insert(MemoryType::Dram, d(10, 0), ()),
            Err(MemoryError::InvalidDescriptor { .. })
        ));
        assert!(matches!(
            m.insert(MemoryType::Dram, d(u64::MAX - 1, 4), ()),
            Err(MemoryError::InvalidDescriptor { .. })
        ));
        assert!(m.is_empty());
    }

    #[test]
    fn rejects_overlap_on_both_sides() {
        let mut m = RegionMap::new();
        m.insert(MemoryType::Dram, d(100, 100), 1).unwrap();
        for (a, l) in [(50, 51), (199, 10), (120, 10), (0, 1000), (100, 100)] {
            assert!(
                matches!(
                    m.insert(MemoryType::Dram, d(a, l), 2),
                    Err(MemoryError::Overlap { .. })
                ),
                "{a}+{l} must overlap"
            );
        }
        // Touching ranges do not overlap.
        m.insert(MemoryType::Dram, d(50, 50), 3).unwrap();
        m.insert(MemoryType::Dram, d(200, 8), 4).unwrap();
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn address_spaces_are_separate_for_files_not_for_vram() {
        let mut m = RegionMap::new();
        m.insert(MemoryType::File, MemoryDesc::new(0, 10, 3), ())
            .unwrap();
        m.insert(MemoryType::File, MemoryDesc::new(0, 10, 4), ())
            .unwrap();
        m.insert(MemoryType::Vram, MemoryDesc::new(0x1000, 10, 0), ())
            .unwrap();
        assert!(
            m.insert(MemoryType::Vram, MemoryDesc::new(0x1004, 10, 1), ())
                .is_err()
        );
    }

    #[test]
    fn find_and_remove_exact() {
        let mut m = RegionMap::new();
        m.insert(MemoryType::Dram, d(100, 100), 'a').unwrap();
        m.insert(MemoryType::Dram, d(300, 100), 'b').unwrap();
        assert_eq!(m.find(MemoryType::Dram, &d(150, 50)).unwrap().value, 'a');
        assert!(m.find(MemoryType::Dram, &d(150, 51)).is_none());
        assert!(m.find(MemoryType::Dram, &d(250, 10)).is_none());
        assert!(m.find(MemoryType::Vram, &d(150, 10)).is_none());
        assert!(m.remove_exact(MemoryType::Dram, &d(100, 99)).is_none());
        assert_eq!(
            m.remove_exact(MemoryType::Dram, &d(100, 100))
                .unwrap()
                .value,
            'a'
        );
        assert!(m.find(MemoryType::Dram, &d(150, 1)).is_none());
        assert_eq!(m.len(), 1);
    }

    proptest! {
        /// Against a brute-force model: inserts succeed exactly when no
        /// overlap exists, and `find` agrees with a linear scan.
        #[test]
        fn matches_linear_model(ops in prop::collection::vec((0u64..2000, 1u64..200), 1..60),
                                probes in prop::collection::vec((0u64..2200, 1u64..100), 1..60)) {
            let mut m = RegionMap::new();
            let mut model: Vec<(u64, u64)> = Vec::new();
            for (a, l) in ops {
                let overlaps = model.iter().any(|&(ma, ml)| a < ma + ml && ma < a + l);
                let r = m.insert(MemoryType::Dram, d(a, l), ());
                prop_assert_eq!(r.is_ok(), !overlaps);
                if !overlaps { model.push((a, l)); }
            }
            for (a, l) in probes {
                let want = model.iter().find(|&&(ma, ml)| a >= ma && a + l <= ma + ml);
                let got = m.find(MemoryType::Dram, &d(a, l)).map(|r| (r.desc.addr, r.desc.len));
                prop_assert_eq!(got, want.copied());
            }
        }
    }
}

/// One piece of a copy: `len` bytes at `local` here and `remote` there.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
}
