//! How a request on a libfabric link becomes operations: each pair of
//! descriptors cut into pieces (on a link of several lanes, a large
//! descriptor into one piece per lane) and each piece given to the lane
//! with the fewest bytes in flight and planned (`plan`), keeping off lanes
//! out of service after a failure (`in_service`; `link::failover` takes
//! them out).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::link::{FabricLink, Lane};
use super::region::Seal;
use crate::engine::lock;
use crate::engine::transport::RemoteKey;
use crate::error::Error;
use crate::memory::MemoryDesc;
use crate::small::Few;

/// One operation: the lane it takes, where it reads or writes here, and
/// there.
pub(super) struct Op {
    pub(super) lane: usize,
    pub(super) local: u64,
    pub(super) desc: u64,
    pub(super) remote: u64,
    pub(super) key: u64,
    pub(super) len: u64,
    /// What moving it to another lane of a link of several takes; `None`
    /// when it stays on its lane (one lane, or the link's probe).
    pub(super) alt: Option<Alt>,
    /// Lanes (by bit) it failed on so far.
    pub(super) failed_on: u32,
}

/// The descriptors and keys of an operation's regions on every rail.
#[derive(Clone)]
pub(super) struct Alt {
    /// The local region's descriptor on each of this agent's rails (`None`:
    /// one rail, `Op::desc` on every lane).
    pub(super) descs: Option<Arc<[u64]>>,
    /// The remote region's key on each of the peer's rails (`None`: one
    /// rail, `Op::key` on every lane).
    pub(super) keys: Option<Arc<[u64]>>,
}

impl Op {
    /// The operation on lane `lane` of `lanes`: its local descriptor and
    /// remote key those of the lane's rails.
    pub(super) fn onto(&mut self, lanes: &[Lane], lane: usize) {
        self.lane = lane;
        if let Some(alt) = &self.alt {
            let on = &lanes[lane];
            if let Some(d) = &alt.descs {
                self.desc = d[on.shared.rail];
            }
            if let Some(k) = &alt.keys {
                self.key = k[on.remote];
            }
        }
    }
}

/// How many of a link's `lanes` lanes take this agent's rail `rail` of
/// `rails` (lane `i` takes rail `i mod rails`).
pub(super) fn lanes_on_rail(rail: usize, rails: usize, lanes: usize) -> usize {
    (rail..lanes).step_by(rails.max(1)).count()
}

/// Smallest piece a descriptor is cut into to spread it over several
/// lanes (a smaller one goes whole, on one lane).
const STRIPE_MIN: u64 = 256 << 10;

/// The operations of a request on `link`: each pair of local and remote
/// descriptors (`local_keys`, `remote_keys`: their keys, as the engine
/// resolved them from the peer's descriptor, sealed, and opened here with
/// the link's seal of the peer) cut into pieces of at most the largest operation and,
/// on a link of several lanes, into one piece per lane (of at least
/// [`STRIPE_MIN`]); each piece given to the lane with the fewest bytes in
/// flight and planned, so that a slower rail takes less.
///
/// # Errors
/// A remote region whose key does not have one key per rail of the peer,
/// or a local one no longer registered.
pub(super) fn plan(
    link: &FabricLink,
    local: &[MemoryDesc],
    local_keys: &[u64],
    remote: &[MemoryDesc],
    remote_keys: &[RemoteKey],
) -> Result<Vec<Op>, Error> {
    let parts = &link.parts;
    let lanes = &parts.lanes;
    let n = lanes.len() as u64;
    // Bytes on each lane: in flight, then planned here; a lane out of
    // service never the lightest (unless all are).
    let down = in_service(link);
    let mut load: Few<u64> = lanes
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if down & (1 << i) != 0 {
                u64::MAX
            } else {
                l.credits.bytes_in_flight()
            }
        })
        .collect();
    // Where the search starts (moved on per request: equal lanes take
    // turns); one lane needs none.
    let mut start = if lanes.len() > 1 {
        parts.turn.fetch_add(1, Ordering::Relaxed)
    } else {
        0
    };
    // The local descriptors of the last region of several rails.
    let mut last: Option<(u64, Arc<[u64]>)> = None;
    // The last remote region's keys, opened: by its access key.
    let mut opened: Option<(u64, Opened)> = None;
    let mut ops = Vec::new();
    for ((l, &lk), (r, rk)) in local
        .iter()
        .zip(local_keys)
        .zip(remote.iter().zip(remote_keys))
    {
        let rails = match &rk.keys {
            Some(keys) => keys.len(),
            None => 1,
        };
        let peer_rails = parts.remote_rails;
        if rails != peer_rails {
            return Err(Error::ProtocolViolation {
                remote: link.remote.clone(),
                detail: format!(
                    "a region exported with {rails} libfabric keys by an agent of {peer_rails} rails"
                ),
            });
        }
        let descs = if parts.local_rails > 1 {
            match &last {
                Some((id, d)) if *id == lk => Some(Arc::clone(d)),
                _ => {
                    let d = parts
                        .descs
                        .get(lk)
                        .ok_or_else(|| Error::BackendUnavailable {
                            backend: "fabric",
                            reason: "a local region is no longer registered with the agent's rails"
                                .into(),
                        })?;
                    last = Some((lk, Arc::clone(&d)));
                    Some(d)
                }
            }
        } else {
            None
        };
        let keys = match &opened {
            Some((access, k)) if *access == rk.access => k.clone(),
            _ => {
                let k = open(&parts.seal, rk);
                opened = Some((rk.access, k.clone()));
                k
            }
        };
        let remote = if parts.virt { r.addr } else { r.addr - rk.base };
        let piece = piece_len(l.len, n, parts.max_msg);
        let alt = (lanes.len() > 1).then(|| Alt {
            descs: descs.clone(),
            keys: keys.all.clone(),
        });
        let mut off = 0;
        while off < l.len {
            let len = (l.len - off).min(piece);
            let lane = lightest(&load, start);
            start = lane + 1;
            load[lane] = load[lane].saturating_add(len);
            let mut op = Op {
                lane,
                local: l.addr + off,
                desc: lk,
                remote: remote + off,
                key: keys.first,
                len,
                alt: alt.clone(),
                failed_on: 0,
            };
            op.onto(lanes, lane);
            ops.push(op);
            off += len;
        }
    }
    Ok(ops)
}

/// A remote region's keys opened: its first rail's, and every rail's
/// (several only).
#[derive(Clone)]
struct Opened {
    first: u64,
    all: Option<Arc<[u64]>>,
}

/// `rk`'s keys (as the peer's descriptor publishes them) opened with the
/// peer's `seal`.
fn open(seal: &Seal, rk: &RemoteKey) -> Opened {
    let all: Option<Arc<[u64]>> = rk.keys.as_ref().map(|keys| {
        keys.iter()
            .enumerate()
            .map(|(rail, &k)| seal.open(k, rk.access, rail))
            .collect()
    });
    Opened {
        first: all
            .as_ref()
            .and_then(|a| a.first().copied())
            .unwrap_or_else(|| seal.open(rk.key, rk.access, 0)),
        all,
    }
}

/// The length of the pieces a descriptor of `len` bytes is cut into on a
/// link of `lanes` lanes whose largest operation is `max_msg`: one piece
/// per lane, of at least [`STRIPE_MIN`], when there are several lanes and
/// it is larger than that; never over `max_msg`.
fn piece_len(len: u64, lanes: u64, max_msg: u64) -> u64 {
    if lanes > 1 && len > STRIPE_MIN {
        len.div_ceil(lanes).max(STRIPE_MIN).min(max_msg)
    } else {
        max_msg
    }
}

/// The lane with the fewest bytes of `load` (the first such from `start`
/// on, round the lanes).
fn lightest(load: &[u64], start: usize) -> usize {
    (0..load.len())
        .map(|k| (start + k) % load.len())
        .min_by_key(|&i| load[i])
        .unwrap_or(0)
}

/// The lanes of `link` out of service (by bit); puts them back when they
/// have rested the link's `lane_rest` (from the last one's failure): then
/// every lane is tried again, and one still failing costs its operations
/// a second post once more.
pub(super) fn in_service(link: &FabricLink) -> u32 {
    let parts = &link.parts;
    if parts.down.load(Ordering::Acquire) == 0 {
        return 0;
    }
    // Under the lock that `failover` takes them out under.
    let since = lock(&parts.down_since);
    if since.elapsed() < parts.lane_rest {
        return parts.down.load(Ordering::Acquire);
    }
    let down = parts.down.swap(0, Ordering::AcqRel);
    drop(since);
    if down != 0 {
        tracing::info!(remote = %link.remote, lanes = format_args!("{down:#b}"), "libfabric lanes back in service");
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_descriptor_is_cut_one_piece_per_lane() {
        const MIB: u64 = 1 << 20;
        // One lane: pieces of the largest operation.
        assert_eq!(piece_len(64 * MIB, 1, 4 * MIB), 4 * MIB);
        // Several: one piece per lane, at most the largest operation.
        assert_eq!(piece_len(2 * MIB, 2, 4 * MIB), MIB);
        assert_eq!(piece_len(3 * MIB + 1, 3, 4 * MIB), MIB + 1);
        assert_eq!(piece_len(64 * MIB, 4, 4 * MIB), 4 * MIB);
        // Small ones go whole; pieces are at least STRIPE_MIN.
        assert_eq!(piece_len(STRIPE_MIN, 4, 4 * MIB), 4 * MIB);
        assert_eq!(piece_len(STRIPE_MIN + 4, 4, 4 * MIB), STRIPE_MIN);
    }

    #[test]
    fn lanes_are_counted_by_rail() {
        // As many rails as lanes: one each.
        assert_eq!(lanes_on_rail(1, 2, 2), 1);
        // One rail to a peer of three: all three lanes on it.
        assert_eq!(lanes_on_rail(0, 1, 3), 3);
        // Two rails to a peer of three: lanes 0 and 2 on rail 0.
        assert_eq!(lanes_on_rail(0, 2, 3), 2);
        assert_eq!(lanes_on_rail(1, 2, 3), 1);
    }

    #[test]
    fn pieces_go_to_the_lane_with_the_fewest_bytes() {
        assert_eq!(lightest(&[5, 3, 9], 0), 1);
        // Ties: the first from `start` on, round the lanes.
        assert_eq!(lightest(&[4, 4, 4], 0), 0);
        assert_eq!(lightest(&[4, 4, 4], 2), 2);
        assert_eq!(lightest(&[4, 7, 4], 1), 2);
        // A lane slow to give its bytes back takes fewer pieces: planning
        // 12 equal pieces over lanes loaded 0, 0 and 8 (in pieces).
        let mut load = [0u64, 0, 8];
        let mut start = 0;
        let mut taken = [0; 3];
        for _ in 0..12 {
            let l = lightest(&load, start);
            start = l + 1;
            load[l] += 1;
            taken[l] += 1;
        }
        assert_eq!(taken, [6, 6, 0]);
        assert_eq!(lightest(&[1], 5), 0);
    }
}
