//! Transfers made by index: descriptor lists prepared once for one side of
//! later transfers ([`PreparedDescList`], NIXL's prepared lists), and
//! requests that select pairs from two of them by index
//! ([`IndexedRequest`], NIXL's `make_prepped_xfer`).
//!
//! Making such a request costs what its indices cost: each list knows,
//! from its preparation, which of its descriptors follow one another in
//! memory (the same region, the same device), so pairs adjacent on both
//! sides merge by comparing indices, and where every descriptor of a list
//! has one length the lengths are checked once. No descriptor is copied
//! and no segment planned on the caller's thread: the link's threads
//! expand a request's pairs into segments as they send them (see
//! `IndexedPairs`).
//!
//! This module is free of I/O; the engine resolves the lists (local
//! regions, the peer's keys) and moves the data.

#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;

use crate::agent::{TransferOp, TransferRequest};
use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryDescs, MemoryType};
use crate::registry::LocalRegion;

/// No descriptor (in [`PreparedDescList`]'s successor tables).
pub(crate) const NONE: u32 = u32::MAX;

/// A descriptor list prepared once for one side of later transfers: this
/// agent's memory (`remote_agent` `None`) or a remote agent's. Made by
/// [`prepare_desc_list`](crate::TransferAgent::prepare_desc_list); shared
/// (an `Arc`) by the requests made from it.
///
/// The agent checks every descriptor when it prepares the list (local ones
/// registered, remote ones exported) and again, once for the whole list,
/// when a deregistration or a new load of the remote agent has happened
/// since.
pub struct PreparedDescList {
    /// The agent that prepared it.
    pub(crate) owner: u64,
    remote_agent: Option<String>,
    descs: MemoryDescs,
    /// The length of every descriptor, when they all have one.
    uniform: Option<u64>,
    /// For each descriptor, the first one with the same address and device
    /// (descriptors compare by these through it); empty when every
    /// descriptor starts somewhere of its own (each is then its own first).
    start: Vec<u32>,
    /// For each descriptor, the first one that starts where it ends (same
    /// device), or [`NONE`].
    succ: Vec<u32>,
    /// The engine's resolution of the list, replaced when it is stale.
    pub(crate) resolved: Mutex<Option<Resolution>>,
}

/// What the engine resolved a [`PreparedDescList`] to, kept with the list
/// and replaced when it is stale.
#[derive(Clone)]
pub(crate) enum Resolution {
    /// This agent's list.
    Local(Arc<LocalSide>),
    /// A remote agent's list.
    Remote(Arc<RemoteSide>),
}

/// A local list's resolution: the regions its descriptors lie in (each
/// transfer made from the list holds them all), found at a registry
/// generation, and its successor table within those regions.
pub(crate) struct LocalSide {
    /// The registry's generation when the regions were found.
    pub(crate) generation: u64,
    /// The regions.
    pub(crate) regions: Vec<Arc<LocalRegion>>,
    /// Which descriptor follows which, within one region.
    pub(crate) succ: Arc<Successors>,
}

/// A remote list's resolution against one load of its agent: each
/// descriptor's access key, and the successor table within the peer's
/// regions.
pub(crate) struct RemoteSide {
    /// The load of the agent it was resolved against (see the engine's
    /// peer entries, each numbered once).
    pub(crate) entry: u64,
    /// Each descriptor's access key.
    pub(crate) keys: Vec<u64>,
    /// Which descriptor follows which, within one exported region.
    pub(crate) succ: Arc<Successors>,
}

impl PreparedDescList {
    /// A list of `descs` (each valid: non-empty, not wrapping) for
    /// `remote_agent`'s side, or this agent's.
    ///
    /// # Errors
    /// [`Error::InvalidDescriptor`] for a descriptor that is empty or wraps;
    /// [`Error::InvalidRequest`] for a list of more than `u32::MAX - 1`
    /// descriptors.
    pub(crate) fn new(
        owner: u64,
        remote_agent: Option<String>,
        descs: MemoryDescs,
    ) -> Result<Self, Error> {
        let n = descs.descs.len();
        if n >= NONE as usize {
            return Err(Error::InvalidRequest(format!(
                "a prepared list holds at most {} descriptors, not {n}",
                NONE - 1
            )));
        }
        for d in &descs.descs {
            d.validate()?;
        }
        let first = descs.descs.first().map(|d| d.len);
        let uniform = first.filter(|&l| descs.descs.iter().all(|d| d.len == l));
        let mut at: FxHashMap<(u64, u32), u32> = FxHashMap::default();
        at.reserve(n);
        let mut start: Vec<u32> = (0..n as u32)
            .map(|i| {
                let d = &descs.descs[i as usize];
                *at.entry((d.addr, d.device_id)).or_insert(i)
            })
            .collect();
        if start.iter().enumerate().all(|(i, &j)| i as u32 == j) {
            start = Vec::new();
        }
        let succ = descs
            .descs
            .iter()
            .map(|d| {
                let end = d.end().expect("validated");
                at.get(&(end, d.device_id)).copied().unwrap_or(NONE)
            })
            .collect();
        Ok(Self {
            owner,
            remote_agent,
            descs,
            uniform,
            start,
            succ,
            resolved: Mutex::new(None),
        })
    }

    /// Its descriptors.
    pub fn descs(&self) -> &MemoryDescs {
        &self.descs
    }

    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.descs.descs.len()
    }

    /// Whether it holds no descriptor.
    pub fn is_empty(&self) -> bool {
        self.descs.descs.is_empty()
    }

    /// The memory type of its descriptors.
    pub fn mem_type(&self) -> MemoryType {
        self.descs.mem_type
    }

    /// The remote agent whose memory it names; `None` for this agent's.
    pub fn remote_agent(&self) -> Option<&str> {
        self.remote_agent.as_deref()
    }

    /// The first descriptor with descriptor `i`'s address and device.
    fn first(&self, i: u32) -> u32 {
        match self.start.get(i as usize) {
            Some(&j) => j,
            None => i,
        }
    }

    fn len_of(&self, i: u32) -> u64 {
        match self.uniform {
            Some(l) => l,
            None => self.descs.descs[i as usize].len,
        }
    }

    /// The successor table (descriptors that follow one another in memory)
    /// kept only where `same_region(i, j)` says descriptors `i` and `j` lie
    /// in one region: a merged piece never spans two.
    pub(crate) fn successors_within(
        &self,
        same_region: impl Fn(usize, usize) -> bool,
    ) -> Successors {
        let table: Vec<u32> = self
            .succ
            .iter()
            .enumerate()
            .map(|(i, &j)| {
                if j != NONE && same_region(i, j as usize) {
                    j
                } else {
                    NONE
                }
            })
            .collect();
        Successors::new(table, self.start.is_empty())
    }

    /// The successor table by address alone.
    pub(crate) fn successors(&self) -> Successors {
        Successors::new(self.succ.clone(), self.start.is_empty())
    }
}

/// A list's successor table: for each descriptor, the first one that
/// starts where it ends (within one region), or [`NONE`].
#[derive(Debug)]
pub(crate) struct Successors {
    table: Vec<u32>,
    /// Each descriptor is followed by the next one in the list, and by no
    /// other (a pool's blocks in order, one region): descriptor `j` then
    /// continues `i` exactly when `j == i + 1`, no lookup needed.
    sequential: bool,
}

impl Successors {
    /// `table`, for a list whose descriptors start at distinct places
    /// (`distinct`) or not.
    fn new(table: Vec<u32>, distinct: bool) -> Self {
        let n = table.len();
        let sequential = distinct
            && table
                .iter()
                .enumerate()
                .all(|(i, &j)| j as usize == i + 1 || (i + 1 == n && j == NONE));
        Self { table, sequential }
    }
}

impl std::fmt::Debug for PreparedDescList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedDescList")
            .field("remote_agent", &self.remote_agent)
            .field("mem_type", &self.descs.mem_type)
            .field("len", &self.len())
            .finish()
    }
}

/// A transfer of pairs selected by index from two prepared lists: pair `k`
/// is `local[local_indices[k]]` with `remote[remote_indices[k]]`, which
/// must have one length. Made ready to post by
/// [`prepare_indexed`](crate::TransferAgent::prepare_indexed).
#[derive(Clone, Debug)]
pub struct IndexedRequest {
    /// Direction.
    pub op: TransferOp,
    /// This agent's side.
    pub local: Arc<PreparedDescList>,
    /// Indices into `local` (shared: copies of the request are cheap).
    pub local_indices: Arc<[u32]>,
    /// The remote agent's side (it names the agent).
    pub remote: Arc<PreparedDescList>,
    /// Indices into `remote`, pairwise with `local_indices`.
    pub remote_indices: Arc<[u32]>,
    /// Delivered to the remote agent after all of the request's data.
    pub sync_message: Option<Vec<u8>>,
    /// Whether pairs adjacent in memory on both sides (and in one region)
    /// move as one piece.
    pub merge: bool,
}

impl IndexedRequest {
    /// Its shape checked: a local and a remote list, as many indices on
    /// each side, each inside its list.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] naming what is wrong.
    pub(crate) fn check_shape(&self) -> Result<&str, Error> {
        if self.local.remote_agent.is_some() {
            return Err(Error::InvalidRequest(
                "the local side of a request must be a list of this agent's memory".into(),
            ));
        }
        let Some(remote) = self.remote.remote_agent.as_deref() else {
            return Err(Error::InvalidRequest(
                "the remote side of a request must be a list prepared for a remote agent".into(),
            ));
        };
        if self.local_indices.len() != self.remote_indices.len() {
            return Err(Error::InvalidRequest(format!(
                "{} local indices but {} remote indices",
                self.local_indices.len(),
                self.remote_indices.len()
            )));
        }
        for (what, idx, list) in [
            ("local", &self.local_indices, &self.local),
            ("remote", &self.remote_indices, &self.remote),
        ] {
            // One pass, no early exit (vectorised); the culprit looked up
            // only when there is one.
            let n = list.len() as u32;
            if idx.iter().fold(false, |bad, &i| bad | (i >= n)) {
                let (k, i) = idx
                    .iter()
                    .enumerate()
                    .find(|&(_, &i)| i >= n)
                    .expect("found above");
                return Err(Error::InvalidRequest(format!(
                    "{what} index {i} (pair {k}) outside the list of {n} descriptors"
                )));
            }
        }
        Ok(remote)
    }

    /// The plain request it stands for: its pairs merged by address alone
    /// (as a request of merged descriptors would be written by hand).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] for a bad shape (sides swapped, index
    /// counts that differ, an index outside its list, a pair whose sides
    /// differ in length).
    pub fn to_request(&self) -> Result<TransferRequest, Error> {
        self.check_shape()?;
        let pairs = IndexedPairs::new(
            self.clone(),
            Arc::new(self.local.successors()),
            Arc::new(self.remote.successors()),
        );
        pairs.check_lengths()?;
        Ok(pairs.to_request())
    }
}

/// Where a stream's share of an indexed request begins: the run (of merged
/// pairs) starting at pair `pair`, less its first `skip` segments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cut {
    pub(crate) pair: usize,
    pub(crate) skip: u64,
}

/// The segments of an indexed request, cut into one share per stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Walk {
    /// Each stream's first segment and number of segments.
    pub(crate) shares: Vec<(Cut, usize)>,
    /// Segments in all.
    pub(crate) segments: usize,
    /// Pieces after merging.
    pub(crate) runs: usize,
    /// Bytes in all.
    pub(crate) bytes: u64,
}

/// Where share `k` of `streams` starts: `k / streams` of `bytes`.
fn share_target(bytes: u64, k: usize, streams: usize) -> u64 {
    (u128::from(bytes) * k as u128 / streams as u128) as u64
}

/// An indexed request with the successor tables its merges follow (those
/// of its lists' resolutions, so that no merged piece spans two regions):
/// what its segments are, found again from the indices wherever needed.
#[derive(Debug)]
pub(crate) struct IndexedPairs {
    pub(crate) req: IndexedRequest,
    lsucc: Arc<Successors>,
    rsucc: Arc<Successors>,
}

impl IndexedPairs {
    /// `req` (its shape already checked) merged along `lsucc` and `rsucc`.
    pub(crate) fn new(req: IndexedRequest, lsucc: Arc<Successors>, rsucc: Arc<Successors>) -> Self {
        Self { req, lsucc, rsucc }
    }

    /// Number of pairs.
    pub(crate) fn pairs(&self) -> usize {
        self.req.local_indices.len()
    }

    /// Whether pair `k` (> 0) continues pair `k - 1`'s piece.
    fn joins(&self, k: usize) -> bool {
        let r = &self.req;
        let (l0, l1) = (r.local_indices[k - 1], r.local_indices[k]);
        let (r0, r1) = (r.remote_indices[k - 1], r.remote_indices[k]);
        if self.lsucc.sequential && self.rsucc.sequential {
            return (l1 == l0 + 1) & (r1 == r0 + 1);
        }
        (r.local.first(l1) == self.lsucc.table[l0 as usize])
            & (r.remote.first(r1) == self.rsucc.table[r0 as usize])
    }

    /// The piece starting at pair `p`: the pair after its last, and its
    /// length.
    pub(crate) fn run_end(&self, p: usize) -> (usize, u64) {
        let mut len = self.req.local.len_of(self.req.local_indices[p]);
        let mut e = p + 1;
        if self.req.merge {
            while e < self.pairs() && self.joins(e) {
                len += self.req.local.len_of(self.req.local_indices[e]);
                e += 1;
            }
        }
        (e, len)
    }

    /// Reads the tables the walk looks pairs up in, in order, when the
    /// request picks from much of them: after a large transfer they are out
    /// of the caches, and random picks would each miss, where one linear
    /// pass streams them in (the hardware prefetcher follows it).
    fn warm(&self) {
        let r = &self.req;
        if !r.merge || self.pairs() < 64 {
            return;
        }
        let sum = |t: &[u32]| t.iter().fold(0u32, |x, &v| x ^ v);
        for (succ, list) in [(&self.lsucc, &r.local), (&self.rsucc, &r.remote)] {
            if !succ.sequential && self.pairs() * 4 >= list.len() {
                std::hint::black_box(sum(&succ.table) ^ sum(&list.start));
            }
        }
    }

    /// Checks that the two sides of each pair have one length; their sum.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] naming the first pair that does not.
    pub(crate) fn check_lengths(&self) -> Result<u64, Error> {
        let (l, r) = (&self.req.local, &self.req.remote);
        let n = self.pairs() as u64;
        let mismatch = |k: usize, a: u64, b: u64| {
            Error::InvalidRequest(format!("pair {k}: local length {a} != remote length {b}"))
        };
        match (l.uniform, r.uniform) {
            (Some(a), Some(b)) if n > 0 && a != b => Err(mismatch(0, a, b)),
            (Some(a), Some(_)) => Ok(a * n),
            _ => {
                let mut total = 0u64;
                for (k, (&i, &j)) in self
                    .req
                    .local_indices
                    .iter()
                    .zip(self.req.remote_indices.iter())
                    .enumerate()
                {
                    let (a, b) = (l.len_of(i), r.len_of(j));
                    if a != b {
                        return Err(mismatch(k, a, b));
                    }
                    total = total.saturating_add(a);
                }
                Ok(total)
            }
        }
    }

    /// Its segments of at most `max` bytes, cut into `streams` shares of
    /// about equal bytes (`bytes`: from [`check_lengths`](Self::check_lengths)).
    pub(crate) fn walk(&self, bytes: u64, max: u64, streams: usize) -> Walk {
        let (max, streams) = (max.max(1), streams.max(1));
        self.warm();
        // The common case in one tight pass: pairs of one length, each a
        // segment, none continuing the one before.
        let one = self.req.local.uniform.filter(|&l| l <= max);
        if let Some(len) = one
            && (!self.req.merge || self.joins_count() == 0)
        {
            let n = self.pairs();
            let mut shares = Vec::with_capacity(streams);
            let mut from = 0;
            for k in 1..=streams {
                // The first pair starting at or past the byte target.
                let to = if k == streams {
                    n
                } else {
                    (share_target(bytes, k, streams).div_ceil(len) as usize).min(n)
                };
                shares.push((
                    Cut {
                        pair: from,
                        skip: 0,
                    },
                    to - from,
                ));
                from = to;
            }
            return Walk {
                shares,
                segments: n,
                runs: n,
                bytes,
            };
        }
        self.walk_pieces(bytes, max, streams)
    }

    /// How many pairs continue the piece of the pair before (one pass, no
    /// branch per pair).
    fn joins_count(&self) -> usize {
        let r = &self.req;
        if self.lsucc.sequential && self.rsucc.sequential {
            // Two lists in memory order: indices one apart on both sides.
            return r
                .local_indices
                .windows(2)
                .zip(r.remote_indices.windows(2))
                .map(|(l, m)| usize::from((l[1] == l[0] + 1) & (m[1] == m[0] + 1)))
                .sum();
        }
        (1..self.pairs()).map(|k| usize::from(self.joins(k))).sum()
    }

    /// [`walk`](Self::walk), piece by piece.
    fn walk_pieces(&self, bytes: u64, max: u64, streams: usize) -> Walk {
        let target = |k: usize| share_target(bytes, k, streams);
        let mut bounds: Vec<(Cut, usize)> = Vec::with_capacity(streams + 1);
        bounds.push((Cut::default(), 0));
        let next = |b: usize| if b < streams { target(b) } else { u64::MAX };
        let mut t = next(bounds.len());
        let (mut p, mut segments, mut runs, mut at) = (0, 0usize, 0usize, 0u64);
        while p < self.pairs() {
            let (end, len) = self.run_end(p);
            runs += 1;
            let n = if len <= max { 1 } else { len.div_ceil(max) };
            // Each boundary still ahead falls on the first segment that
            // starts at or past its byte target (in this piece only if the
            // target lies before the piece's end).
            let mut s = 0;
            while t < at + len && s < n {
                if t <= at + s * max {
                    bounds.push((Cut { pair: p, skip: s }, segments + s as usize));
                    t = next(bounds.len());
                } else {
                    // The first segment starting at or past `t`.
                    s = (t - at).div_ceil(max);
                }
            }
            segments += n as usize;
            at += len;
            p = end;
        }
        while bounds.len() < streams {
            bounds.push((
                Cut {
                    pair: self.pairs(),
                    skip: 0,
                },
                segments,
            ));
        }
        bounds.push((Cut::default(), segments));
        let shares = bounds
            .windows(2)
            .map(|w| (w[0].0, w[1].1 - w[0].1))
            .collect();
        Walk {
            shares,
            segments,
            runs,
            bytes,
        }
    }

    /// Calls `f(pair, offset, len)` for each of `count` segments of at most
    /// `max` bytes from `cut`: the piece starting at pair `pair`, `offset`
    /// bytes in, `len` long.
    pub(crate) fn for_each_segment(
        &self,
        cut: Cut,
        count: usize,
        max: u64,
        mut f: impl FnMut(usize, u64, u64),
    ) {
        let max = max.max(1);
        let (mut p, mut skip, mut left) = (cut.pair, cut.skip, count);
        while left > 0 && p < self.pairs() {
            let (end, len) = self.run_end(p);
            let mut off = skip * max;
            while left > 0 && off < len {
                let n = (len - off).min(max);
                f(p, off, n);
                off += n;
                left -= 1;
            }
            skip = 0;
            p = end;
        }
    }

    /// The request it stands for: its merged pieces.
    pub(crate) fn to_request(&self) -> TransferRequest {
        let (local, remote) = self.materialize();
        TransferRequest {
            op: self.req.op,
            local,
            remote,
            remote_agent: self.req.remote.remote_agent.clone().unwrap_or_default(),
            sync_message: self.req.sync_message.clone(),
            durable: false,
            integrity: false,
        }
    }

    /// The merged pieces as a local and a remote descriptor list.
    pub(crate) fn materialize(&self) -> (MemoryDescs, MemoryDescs) {
        let r = &self.req;
        let (mut l, mut rr) = (Vec::new(), Vec::new());
        let mut p = 0;
        while p < self.pairs() {
            let (end, len) = self.run_end(p);
            let a = r.local.descs.descs[r.local_indices[p] as usize];
            let b = r.remote.descs.descs[r.remote_indices[p] as usize];
            l.push(MemoryDesc::new(a.addr, len, a.device_id));
            rr.push(MemoryDesc::new(b.addr, len, b.device_id));
            p = end;
        }
        (
            MemoryDescs::new(r.local.mem_type(), l),
            MemoryDescs::new(r.remote.mem_type(), rr),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn list(remote: Option<&str>, descs: &[(u64, u64)]) -> Arc<PreparedDescList> {
        let d = descs
            .iter()
            .map(|&(a, l)| MemoryDesc::new(a, l, 0))
            .collect();
        Arc::new(
            PreparedDescList::new(
                1,
                remote.map(str::to_owned),
                MemoryDescs::new(MemoryType::Dram, d),
            )
            .unwrap(),
        )
    }

    fn request(
        l: &[(u64, u64)],
        li: &[u32],
        r: &[(u64, u64)],
        ri: &[u32],
        merge: bool,
    ) -> IndexedRequest {
        IndexedRequest {
            op: TransferOp::Write,
            local: list(None, l),
            local_indices: li.into(),
            remote: list(Some("peer"), r),
            remote_indices: ri.into(),
            sync_message: None,
            merge,
        }
    }

    fn by_address(req: IndexedRequest) -> IndexedPairs {
        let (ls, rs) = (
            Arc::new(req.local.successors()),
            Arc::new(req.remote.successors()),
        );
        IndexedPairs::new(req, ls, rs)
    }

    /// Every segment of every share, in order, as (local, remote, len).
    fn segments(p: &IndexedPairs, w: &Walk, max: u64) -> Vec<(u64, u64, u64)> {
        let mut out = Vec::new();
        for &(cut, count) in &w.shares {
            let before = out.len();
            p.for_each_segment(cut, count, max, |k, off, len| {
                let a = p.req.local.descs.descs[p.req.local_indices[k] as usize];
                let b = p.req.remote.descs.descs[p.req.remote_indices[k] as usize];
                out.push((a.addr + off, b.addr + off, len));
            });
            assert_eq!(out.len() - before, count, "a share yields its count");
        }
        out
    }

    #[test]
    fn adjacent_pairs_merge_and_shares_balance() {
        // Blocks of 4 KiB: pairs (0,5) (1,6) (2,7) adjacent on both sides,
        // then (9,0) alone.
        let blocks: Vec<(u64, u64)> = (0..10).map(|i| (0x10000 + i * 4096, 4096)).collect();
        let req = request(&blocks, &[0, 1, 2, 9], &blocks, &[5, 6, 7, 0], true);
        let p = by_address(req);
        let bytes = p.check_lengths().unwrap();
        assert_eq!(bytes, 4 * 4096);
        let w = p.walk(bytes, 4096, 2);
        assert_eq!((w.runs, w.segments), (2, 4));
        assert_eq!(
            w.shares,
            vec![(Cut { pair: 0, skip: 0 }, 2), (Cut { pair: 0, skip: 2 }, 2)]
        );
        let (l, r) = p.materialize();
        assert_eq!(
            l.descs,
            vec![
                MemoryDesc::new(0x10000, 3 * 4096, 0),
                MemoryDesc::new(0x10000 + 9 * 4096, 4096, 0)
            ]
        );
        assert_eq!(r.descs[0], MemoryDesc::new(0x10000 + 5 * 4096, 3 * 4096, 0));
        // Without merging: four pieces.
        let mut req = p.req.clone();
        req.merge = false;
        let p = by_address(req);
        assert_eq!(p.walk(bytes, 1 << 20, 3).runs, 4);
    }

    #[test]
    fn descriptors_that_share_an_address_merge_alike() {
        // Descriptor 2 repeats descriptor 0; 3 ends where both start.
        let l = [
            (0x1000u64, 0x100u64),
            (0x1100, 0x100),
            (0x1000, 0x100),
            (0xf00, 0x100),
        ];
        let r = [
            (0x9000u64, 0x100u64),
            (0x9100, 0x100),
            (0x9000, 0x100),
            (0x8f00, 0x100),
        ];
        let p = by_address(request(&l, &[3, 2, 1], &r, &[3, 0, 1], true));
        assert_eq!(p.walk(0x300, 1 << 20, 1).runs, 1);
        let (ml, mr) = p.materialize();
        assert_eq!(ml.descs, vec![MemoryDesc::new(0xf00, 0x300, 0)]);
        assert_eq!(mr.descs, vec![MemoryDesc::new(0x8f00, 0x300, 0)]);
    }

    #[test]
    fn a_region_boundary_stops_a_merge() {
        let blocks: Vec<(u64, u64)> = (0..4).map(|i| (0x1000 * (i + 1), 0x1000)).collect();
        let req = request(&blocks, &[0, 1, 2, 3], &blocks, &[0, 1, 2, 3], true);
        // Remote descriptors 0,1 in one region and 2,3 in another.
        let rs = Arc::new(req.remote.successors_within(|i, j| i / 2 == j / 2));
        let ls = Arc::new(req.local.successors());
        let p = IndexedPairs::new(req, ls, rs);
        let (l, _) = p.materialize();
        assert_eq!(l.descs.len(), 2);
    }

    #[test]
    fn bad_shapes_are_refused() {
        let blocks = [(0x1000u64, 0x1000u64), (0x3000, 0x2000)];
        assert!(matches!(
            request(&blocks, &[0, 2], &blocks, &[0, 1], true).check_shape(),
            Err(Error::InvalidRequest(m)) if m.contains("local index 2 (pair 1)")
        ));
        assert!(
            request(&blocks, &[0], &blocks, &[0, 1], true)
                .check_shape()
                .is_err()
        );
        let p = by_address(request(&blocks, &[0, 1], &blocks, &[1, 0], true));
        assert!(matches!(p.check_lengths(), Err(Error::InvalidRequest(m)) if m.contains("pair 0")));
        let mut swapped = request(&blocks, &[0], &blocks, &[0], true);
        std::mem::swap(&mut swapped.local, &mut swapped.remote);
        assert!(swapped.check_shape().is_err());
        let empty = MemoryDescs::new(MemoryType::Dram, vec![MemoryDesc::new(1, 0, 0)]);
        assert!(PreparedDescList::new(1, None, empty).is_err());
    }

    #[test]
    fn one_large_piece_spreads_over_every_stream() {
        let req = request(
            &[(0x1000, 10 << 20)],
            &[0],
            &[(0x1000_0000, 10 << 20)],
            &[0],
            true,
        );
        let p = by_address(req);
        let w = p.walk(10 << 20, 1 << 20, 4);
        let counts: Vec<usize> = w.shares.iter().map(|s| s.1).collect();
        assert_eq!(counts.iter().sum::<usize>(), 10);
        assert!(counts.iter().all(|&c| (2..=3).contains(&c)), "{counts:?}");
        let segs = segments(&p, &w, 1 << 20);
        for (i, s) in segs.iter().enumerate() {
            assert_eq!(
                *s,
                (
                    0x1000 + (i as u64) * (1 << 20),
                    0x1000_0000 + (i as u64) * (1 << 20),
                    1 << 20
                )
            );
        }
    }

    proptest! {
        /// The shares' segments, in order, are the merged pieces split at
        /// `max`, whatever the lists, indices and stream count; the pieces
        /// are those of merging the selected pairs one after another.
        #[test]
        fn shares_cover_the_merged_pieces(
            lens in prop_oneof![
                proptest::collection::vec(1u64..5, 1..24),
                (1u64..5, 1usize..24).prop_map(|(l, n)| vec![l; n]),
            ],
            picks in proptest::collection::vec((0usize..24, 0usize..24), 0..40),
            merge: bool,
            max in 1u64..7,
            streams in 1usize..5,
            reversed: bool,
        ) {
            // Contiguous descriptors of the given lengths on both sides
            // (lengths in units of 0x100), so that runs of indices merge.
            let mut at = 0x1000;
            let descs: Vec<(u64, u64)> = lens.iter().map(|&l| { let d = (at, l * 0x100); at += l * 0x100; d }).collect();
            // In memory order (looked up by index alone) or not.
            let descs: Vec<(u64, u64)> = if reversed { descs.into_iter().rev().collect() } else { descs };
            let n = descs.len();
            let pairs: Vec<(u32, u32)> = picks.iter().map(|&(a, _)| (a % n) as u32).map(|a| (a, a)).collect();
            let li: Vec<u32> = pairs.iter().map(|p| p.0).collect();
            let ri: Vec<u32> = pairs.iter().map(|p| p.1).collect();
            let p = by_address(request(&descs, &li, &descs, &ri, merge));
            let bytes = p.check_lengths().unwrap();
            let w = p.walk(bytes, max * 0x100, streams);
            prop_assert_eq!(w.shares.len(), streams);
            prop_assert_eq!(&w, &p.walk_pieces(bytes, max * 0x100, streams));
            // The reference: merge pair after pair by address, then split.
            let mut pieces: Vec<(u64, u64, u64)> = Vec::new();
            for &(a, b) in &pairs {
                let (la, ll) = descs[a as usize];
                let (ra, _) = descs[b as usize];
                match pieces.last_mut() {
                    Some(last) if merge && last.0 + last.2 == la && last.1 + last.2 == ra => last.2 += ll,
                    _ => pieces.push((la, ra, ll)),
                }
            }
            let mut want = Vec::new();
            for (l, r, len) in &pieces {
                let mut off = 0;
                while off < *len {
                    let s = (len - off).min(max * 0x100);
                    want.push((l + off, r + off, s));
                    off += s;
                }
            }
            prop_assert_eq!(w.runs, pieces.len());
            prop_assert_eq!(w.segments, want.len());
            prop_assert_eq!(segments(&p, &w, max * 0x100), want);
            let (ml, _) = p.materialize();
            prop_assert_eq!(ml.descs.len(), pieces.len());
            prop_assert_eq!(ml.total_len(), bytes);
        }
    }
}
