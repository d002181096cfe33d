//! The libfabric link's bookkeeping that needs no libfabric: a request's
//! operations held by the provider, by lane ([`Posted`]); how a request
//! ends once its last operation is back ([`ending`]); where an operation
//! that failed on one lane goes next ([`failover`]); and a rail's backlog,
//! whose lanes take turns posting ([`Backlog`], [`drain`]). The link
//! (`link.rs`) applies the decisions to its lanes, credits and endpoint.

#![forbid(unsafe_code)]

use crate::small::Few;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// A request's operations handed to the provider and not back, by lane:
/// their count and bytes (the credits they hold).
#[derive(Debug)]
pub(super) struct Posted {
    /// Operations and their bytes, by lane.
    lanes: Few<(usize, u64)>,
    /// The request was abandoned: its credits were given back then.
    abandoned: bool,
}

impl Posted {
    /// Nothing posted yet, on a link of `lanes` lanes.
    pub(super) fn new(lanes: usize) -> Self {
        Self {
            lanes: std::iter::repeat_n((0, 0), lanes).collect(),
            abandoned: false,
        }
    }

    /// Counts an operation of `len` bytes on `lane` about to be handed to
    /// the provider; false when the request was abandoned (nothing more of
    /// it is posted).
    pub(super) fn hold(&mut self, lane: usize, len: u64) -> bool {
        if self.abandoned {
            return false;
        }
        let (ops, bytes) = &mut self.lanes[lane];
        *ops += 1;
        *bytes += len;
        true
    }

    /// An operation of `len` bytes on `lane` is back from the provider
    /// (completed, or not taken): whether its credits are to be given back
    /// (not when the request was abandoned, which gave them back).
    pub(super) fn release(&mut self, lane: usize, len: u64) -> bool {
        if self.abandoned {
            return false;
        }
        let (ops, bytes) = &mut self.lanes[lane];
        *ops -= 1;
        *bytes -= len;
        true
    }

    /// Abandons the request: what it holds, by lane (operations, bytes),
    /// to give back now; from then on nothing is held or given back.
    pub(super) fn abandon(&mut self) -> Few<(usize, u64)> {
        self.abandoned = true;
        std::mem::take(&mut self.lanes)
    }
}

/// How a request ends once its last operation is back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// The status reports now: the request failed (or was aborted while
    /// its operations ran), or it has nothing for the target (no sync
    /// message, no fence, nothing to check).
    Report,
    /// Its commit goes to the target, whose answer reports it.
    Commit,
}

/// How a request ends: `failed` (one of its operations did, or it was
/// aborted), and whether it carries a sync message, a fence or checks.
pub(super) fn ending(failed: bool, sync: bool, fence: bool, checks: bool) -> Ending {
    if failed || !(sync || fence || checks) {
        Ending::Report
    } else {
        Ending::Commit
    }
}

/// Where an operation that failed on a lane goes, on a link of several.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Failover {
    /// It has failed on every lane (`failed_on`, now every bit): the fault
    /// is its request's, not the lanes'; those lanes go back in service.
    Refused { failed_on: u32 },
    /// Posted again on lane `to`; `failed_on` is where it has failed.
    Move { to: usize, failed_on: u32 },
}

/// Where an operation goes that failed on lane `from` of a link of `n`
/// lanes (`n` ≥ 2, at most 32), having failed before on the lanes of
/// `failed_on`, with the lanes of `down` out of service (lane `from`
/// among them once it is taken out): the next lane in service it has not
/// failed on, else the next it has not failed on.
pub(super) fn failover(n: usize, from: usize, failed_on: u32, down: u32) -> Failover {
    let failed_on = failed_on | 1 << from;
    let every = u32::MAX >> (32 - n);
    if failed_on == every {
        return Failover::Refused { failed_on };
    }
    let untried = (1..n)
        .map(|k| (from + k) % n)
        .filter(|&l| failed_on & (1 << l) == 0);
    match untried
        .clone()
        .find(|&l| down & (1 << l) == 0)
        .or_else(|| untried.clone().next())
    {
        Some(to) => Failover::Move { to, failed_on },
        // No lane it has not failed on (not reached: `failed_on` is not
        // every lane).
        None => Failover::Refused { failed_on },
    }
}

/// A rail's operations (`Q`) waiting to be posted, by lane (a link `L`'s
/// lane on the rail), in the order the lanes take their turns: a lane
/// whose peer stops taking data fills its share of the credits and waits,
/// while the others' operations are posted.
pub(super) struct Backlog<L, Q> {
    /// Each lane with operations waiting (once: its link and its place
    /// there), and those operations in order.
    turns: VecDeque<(Arc<L>, usize, VecDeque<Q>)>,
}

impl<L, Q> Default for Backlog<L, Q> {
    fn default() -> Self {
        Self {
            turns: VecDeque::new(),
        }
    }
}

impl<L, Q> Backlog<L, Q> {
    /// Whether nothing waits.
    pub(super) fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    /// Whether operations of `lane` of `link` wait.
    pub(super) fn holds(&self, link: &Arc<L>, lane: usize) -> bool {
        self.turns
            .iter()
            .any(|(l, i, _)| *i == lane && Arc::ptr_eq(l, link))
    }

    /// Queues `q` on `lane` of `link`, behind the others of that lane.
    pub(super) fn push(&mut self, link: &Arc<L>, lane: usize, q: Q) {
        match self
            .turns
            .iter_mut()
            .find(|(l, i, _)| *i == lane && Arc::ptr_eq(l, link))
        {
            Some((_, _, ops)) => ops.push_back(q),
            None => self
                .turns
                .push_back((Arc::clone(link), lane, VecDeque::from([q]))),
        }
    }
}

/// What became of a lane's turn in [`drain`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// An operation was posted, or dropped (its request over).
    Moved,
    /// The lane's share is full: its operations wait for its completions.
    Full,
    /// The endpoint has no room: nothing more is posted now.
    Stop,
}

/// Takes turns on what waits in `backlog` while there is room: one
/// operation per lane in turn, handed to `step`, which says what became of
/// it and gives it back when it is still to be posted. A `Stop` ends the
/// drain with that lane first in line; a whole round of `Full` lanes ends
/// it too. The backlog is not locked while `step` runs.
pub(super) fn drain<L, Q>(
    backlog: &Mutex<Backlog<L, Q>>,
    mut step: impl FnMut(Q) -> (Turn, Option<Q>),
) {
    let lock = || backlog.lock().unwrap_or_else(|p| p.into_inner());
    // Turns since one moved something: a whole round of full lanes ends.
    let mut idle = 0;
    loop {
        let Some((link, lane, mut ops)) = lock().turns.pop_front() else {
            return;
        };
        let turn = match ops.pop_front() {
            None => Turn::Moved,
            Some(q) => {
                let (turn, back) = step(q);
                if let Some(q) = back {
                    ops.push_front(q);
                }
                turn
            }
        };
        let mut b = lock();
        let lanes = b.turns.len() + 1;
        if !ops.is_empty() {
            match turn {
                // Its turn again first: the endpoint's room came back.
                Turn::Stop => b.turns.push_front((link, lane, ops)),
                Turn::Moved | Turn::Full => b.turns.push_back((link, lane, ops)),
            }
        }
        drop(b);
        match turn {
            Turn::Stop => return,
            Turn::Moved => idle = 0,
            Turn::Full => {
                idle += 1;
                if idle >= lanes {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posted_operations_are_counted_by_lane_until_abandoned() {
        let mut p = Posted::new(3);
        assert!(p.hold(0, 100) && p.hold(2, 50) && p.hold(2, 25));
        assert!(p.release(2, 50));
        let held = p.abandon();
        assert_eq!(held.as_slice(), [(1, 100), (0, 0), (1, 25)]);
        // Abandoned: nothing more is held, nothing given back twice.
        assert!(!p.hold(1, 10));
        assert!(!p.release(0, 100));
        assert!(p.abandon().is_empty());
    }

    #[test]
    fn a_request_reports_or_commits() {
        assert_eq!(ending(true, true, true, true), Ending::Report);
        assert_eq!(ending(false, false, false, false), Ending::Report);
        for (s, f, c) in [
            (true, false, false),
            (false, true, false),
            (false, false, true),
        ] {
            assert_eq!(ending(false, s, f, c), Ending::Commit);
        }
    }

    #[test]
    fn a_failed_operation_moves_to_the_next_lane_in_service() {
        // Four lanes; failed on 1, lane 1 now down: lane 2.
        assert_eq!(
            failover(4, 1, 0, 0b0010),
            Failover::Move {
                to: 2,
                failed_on: 0b0010
            }
        );
        // Lane 2 down too: lane 3.
        assert_eq!(
            failover(4, 1, 0, 0b0110),
            Failover::Move {
                to: 3,
                failed_on: 0b0010
            }
        );
        // Every other lane down: the next untried one anyway.
        assert_eq!(
            failover(4, 1, 0, 0b1111),
            Failover::Move {
                to: 2,
                failed_on: 0b0010
            }
        );
        // Failed before on 2 and 3: lane 0, wrapping round.
        assert_eq!(
            failover(4, 1, 0b1100, 0b1110),
            Failover::Move {
                to: 0,
                failed_on: 0b1110
            }
        );
        // Failed on every lane: the request's fault.
        assert_eq!(
            failover(2, 0, 0b10, 0b01),
            Failover::Refused { failed_on: 0b11 }
        );
        assert_eq!(
            failover(32, 5, !(1 << 5), 0),
            Failover::Refused {
                failed_on: u32::MAX
            }
        );
    }

    /// Lanes take turns; a full lane waits while the others post; a whole
    /// round of full lanes ends the drain; a `Stop` ends it with that lane
    /// first in line again.
    #[test]
    fn lanes_take_turns_and_a_full_one_holds_up_no_other() {
        let (a, b) = (Arc::new("a"), Arc::new("b"));
        let backlog: Mutex<Backlog<&str, (char, u32)>> = Mutex::default();
        {
            let mut q = backlog.lock().unwrap();
            for i in 0..3 {
                q.push(&a, 0, ('a', i));
                q.push(&b, 1, ('b', i));
            }
            assert!(q.holds(&a, 0) && q.holds(&b, 1) && !q.holds(&a, 1));
        }
        // Lane `a` is full from the start: `b` posts all of its own, then
        // a round of `a` alone being full ends the drain.
        let mut seen = Vec::new();
        drain(&backlog, |op| {
            seen.push(op);
            if op.0 == 'a' {
                (Turn::Full, Some(op))
            } else {
                (Turn::Moved, None)
            }
        });
        assert_eq!(
            seen,
            [
                ('a', 0),
                ('b', 0),
                ('a', 0),
                ('b', 1),
                ('a', 0),
                ('b', 2),
                ('a', 0)
            ]
        );
        assert!(backlog.lock().unwrap().holds(&a, 0));
        assert!(!backlog.lock().unwrap().holds(&b, 1));
        // The endpoint has no room: the drain stops at once, the lane
        // first in line with its operation kept.
        let mut stops = 0;
        drain(&backlog, |op| {
            stops += 1;
            (Turn::Stop, Some(op))
        });
        assert_eq!(stops, 1);
        // Room again: every operation goes, in order.
        let mut order = Vec::new();
        drain(&backlog, |op| {
            order.push(op.1);
            (Turn::Moved, None)
        });
        assert_eq!(order, [0, 1, 2]);
        assert!(backlog.lock().unwrap().is_empty());
    }
}
