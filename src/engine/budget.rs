//! The agent-wide budget of requests open at the target (begun by a peer,
//! not finished), free of I/O: which connection gives way when it is
//! spent.
//!
//! Every session may hold its fair share of the budget (the budget over
//! the sessions alive). While the budget lasts, anyone opens requests.
//! Once it is spent, a session at or past its share is refused (the agent
//! closes it, telling it `Overloaded`); one below its share is admitted,
//! and the session holding the most gives way instead (some session must
//! hold more than its share then). A peer that never finishes its requests
//! thus loses its own connection, never another's.

#![forbid(unsafe_code)]

/// What happens to a request that would open one more entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Admitted: the budget is not spent.
    Admit,
    /// Refused: the budget is spent and the asking session holds its share.
    RefuseSelf,
    /// Admitted, and the session holding the most is closed: the budget is
    /// spent and the asking session is below its share.
    EvictLargest,
}

/// The verdict on one more open request, when `open` are open in all,
/// `own` of them by the asking session, among `sessions` sessions alive,
/// under a budget of `limit`.
pub(crate) fn verdict(limit: usize, open: usize, own: usize, sessions: usize) -> Verdict {
    if open < limit {
        return Verdict::Admit;
    }
    let share = (limit / sessions.max(1)).max(1);
    if own >= share {
        Verdict::RefuseSelf
    } else {
        Verdict::EvictLargest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admitted_while_the_budget_lasts() {
        assert_eq!(verdict(100, 0, 0, 1), Verdict::Admit);
        assert_eq!(verdict(100, 99, 99, 1), Verdict::Admit);
    }

    #[test]
    fn a_hog_is_refused_and_a_modest_peer_makes_it_give_way() {
        // Two sessions, budget 100 spent: 95 by the hog, 5 by the other.
        assert_eq!(verdict(100, 100, 95, 2), Verdict::RefuseSelf);
        assert_eq!(verdict(100, 100, 5, 2), Verdict::EvictLargest);
        // Exactly at the share is refused too.
        assert_eq!(verdict(100, 100, 50, 2), Verdict::RefuseSelf);
        // Many sessions: the share never drops to nothing.
        assert_eq!(verdict(10, 10, 0, 1000), Verdict::EvictLargest);
        assert_eq!(verdict(10, 10, 1, 1000), Verdict::RefuseSelf);
    }

    /// Whatever the split, when the budget is spent and the asker is below
    /// its share, another session holds more than its share (so evicting
    /// the largest frees more than a share), or a whole share when the
    /// budget is smaller than the number of sessions.
    #[test]
    fn someone_else_holds_more_than_a_share_when_the_asker_holds_less() {
        for limit in 1..64usize {
            for sessions in 2..9usize {
                let share = (limit / sessions).max(1);
                for own in 0..limit.min(share) {
                    assert_eq!(verdict(limit, limit, own, sessions), Verdict::EvictLargest);
                    // The largest of the others holds at least their mean.
                    let largest = (limit - own).div_ceil(sessions - 1);
                    assert!(
                        largest > share || limit < sessions && largest == share,
                        "limit {limit} sessions {sessions} own {own}"
                    );
                }
            }
        }
    }
}
