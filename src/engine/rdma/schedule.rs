//! The pure parts of the RDMA send schedule: which queue pair each work
//! request of a request goes to, and when a request's sync message may
//! follow its data when that data is spread over several queue pairs. No
//! I/O, no atomics: the link reads its counters and passes them in.
//!
//! Reliable-connected queue pairs order work only within themselves: a
//! SEND on the first queue pair may overtake WRITEs still in flight on
//! the others. So a sync message waits at its gate — for each other queue
//! pair, the number of its work requests queued before the message — until
//! each of those queue pairs has completed at least that many.

#![forbid(unsafe_code)]

/// The queue pair of each of `n` work requests spread round-robin over
/// `qps` queue pairs from `start` (where the previous request left off,
/// so small requests spread too).
pub(crate) fn stripe(start: usize, n: usize, qps: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |i| (start + i) % qps.max(1))
}

/// A sync message's gate over the link's other queue pairs (the second,
/// third, ...): for each, how many of its work requests must have completed
/// before the message may be posted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Gate(Vec<u64>);

impl Gate {
    /// Behind everything queued so far on each other queue pair (`queued`:
    /// their counts of work requests ever queued, in order).
    pub(crate) fn behind(queued: impl IntoIterator<Item = u64>) -> Self {
        Gate(queued.into_iter().collect())
    }

    /// Whether it is open: each other queue pair has completed (`completed`,
    /// in the same order) at least what the gate waits for.
    pub(crate) fn open(&self, completed: impl IntoIterator<Item = u64>) -> bool {
        self.0
            .iter()
            .zip(completed)
            .all(|(&want, done)| done >= want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stripes_round_robin_from_where_the_last_left_off() {
        assert_eq!(stripe(0, 5, 3).collect::<Vec<_>>(), [0, 1, 2, 0, 1]);
        assert_eq!(stripe(5, 2, 3).collect::<Vec<_>>(), [2, 0]);
        assert_eq!(stripe(7, 3, 1).collect::<Vec<_>>(), [0, 0, 0]);
    }

    #[test]
    fn a_gate_with_no_other_queue_pair_is_open() {
        assert!(Gate::behind([]).open([]));
        assert!(Gate::default().open([5, 6]));
    }

    /// One step of a link with several queue pairs.
    #[derive(Clone, Debug)]
    enum Step {
        /// A request of this many work requests, with a sync message.
        Request(usize),
        /// The oldest outstanding work request of queue pair `qp % qps`
        /// completes.
        Complete(usize),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        proptest::collection::vec(
            prop_oneof![
                (1..6usize).prop_map(Step::Request),
                (0..8usize).prop_map(Step::Complete),
            ],
            1..80,
        )
    }

    proptest! {
        /// A sync message's gate opens exactly when every work request
        /// queued before it on the other queue pairs has completed
        /// (completions come in order per queue pair, as on RC).
        #[test]
        fn a_gate_opens_exactly_when_the_earlier_data_has_landed(
            qps in 2..5usize,
            steps in steps(),
        ) {
            let mut queued = vec![0u64; qps];
            let mut completed = vec![0u64; qps];
            let mut next = 0;
            // Per sync message: its gate, and per other queue pair the
            // ordinal of the last work request queued before it.
            let mut syncs: Vec<(Gate, Vec<u64>)> = Vec::new();
            for s in steps {
                match s {
                    Step::Request(n) => {
                        for qp in stripe(next, n, qps) {
                            queued[qp] += 1;
                        }
                        next += n;
                        let gate = Gate::behind(queued[1..].iter().copied());
                        syncs.push((gate, queued[1..].to_vec()));
                    }
                    Step::Complete(q) => {
                        let qp = q % qps;
                        if completed[qp] < queued[qp] {
                            completed[qp] += 1;
                        }
                    }
                }
                for (gate, before) in &syncs {
                    let landed = before.iter().zip(&completed[1..]).all(|(b, c)| c >= b);
                    prop_assert_eq!(gate.open(completed[1..].iter().copied()), landed);
                }
            }
        }
    }
}
