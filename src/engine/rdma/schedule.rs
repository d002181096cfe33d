//! The pure parts of the RDMA send schedule: which queue pair each work
//! request of a request goes to; when a request's sync message may follow
//! its data when that data is spread over several queue pairs; which of a
//! send queue's work goes in the next batch. No I/O, no atomics: the link
//! reads its counters and passes them in ([`Room`]).
//!
//! Reliable-connected queue pairs order work only within themselves: a
//! SEND on the first queue pair may overtake WRITEs still in flight on
//! the others. So a sync message waits at its gate — for each other queue
//! pair, the number of its work requests queued before the message — until
//! each of those queue pairs has completed at least that many.

#![forbid(unsafe_code)]

use std::collections::VecDeque;

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

/// What a queued item needs before it is posted.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Needs {
    /// A data work request of this many bytes: a window slot.
    Data(u64),
    /// A sync message of this many bytes: its gate open (`open`, as the
    /// link read it), a window slot and a message buffer.
    Sync { len: u64, open: bool },
}

/// The queue pair's resources a batch takes, asked in posting order. The
/// link's implementation takes its atomics (the send window, the message
/// ring).
pub(crate) trait Room {
    /// Takes a window slot for `len` bytes, if there is one.
    fn take_slot(&mut self, len: u64) -> bool;
    /// Gives back the slot just taken.
    fn unwind_slot(&mut self);
    /// Takes a message buffer, if one is free.
    fn take_buffer(&mut self) -> Option<usize>;
}

/// Moves the next batch from the head of `items` into `batch` (each with
/// its message buffer), at most `max`: in order, while `room` has what
/// each item needs. An aborted item (`aborted`) met at the head goes to
/// `skipped` instead (nothing taken for it); the first item that cannot go
/// stops the batch, so nothing overtakes it.
pub(crate) fn take_batch<T>(
    items: &mut VecDeque<T>,
    batch: &mut Vec<(T, Option<usize>)>,
    max: usize,
    needs: impl Fn(&T) -> Needs,
    aborted: impl Fn(&T) -> bool,
    room: &mut impl Room,
    skipped: &mut Vec<T>,
) {
    while batch.len() < max {
        let Some(front) = items.front() else {
            break;
        };
        if aborted(front) {
            skipped.extend(items.pop_front());
            continue;
        }
        let buffer = match needs(front) {
            Needs::Sync { open: false, .. } => break,
            Needs::Data(len) => {
                if !room.take_slot(len) {
                    break;
                }
                None
            }
            Needs::Sync { len, .. } => {
                if !room.take_slot(len) {
                    break;
                }
                match room.take_buffer() {
                    Some(b) => Some(b),
                    None => {
                        room.unwind_slot();
                        break;
                    }
                }
            }
        };
        let item = items.pop_front().expect("front exists");
        batch.push((item, buffer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A queued item of the model: data or a sync message, its length,
    /// whether its gate is open, whether its request was aborted.
    #[derive(Clone, Debug)]
    struct Item {
        id: usize,
        sync: bool,
        len: u64,
        gate_open: bool,
        aborted: bool,
    }

    /// Counted resources: window slots (and bytes, as the window counts
    /// only slots here) and message buffers.
    struct Counted {
        slots: usize,
        buffers: Vec<usize>,
        taken_slots: usize,
        unwound: usize,
    }

    impl Room for Counted {
        fn take_slot(&mut self, _len: u64) -> bool {
            if self.slots == 0 {
                return false;
            }
            self.slots -= 1;
            self.taken_slots += 1;
            true
        }
        fn unwind_slot(&mut self) {
            self.slots += 1;
            self.taken_slots -= 1;
            self.unwound += 1;
        }
        fn take_buffer(&mut self) -> Option<usize> {
            self.buffers.pop()
        }
    }

    fn items() -> impl Strategy<Value = Vec<Item>> {
        proptest::collection::vec((any::<bool>(), 1..1000u64, any::<bool>(), 0..5u8), 0..40)
            .prop_map(|v| {
                v.into_iter()
                    .enumerate()
                    .map(|(id, (sync, len, gate_open, a))| Item {
                        id,
                        sync,
                        len,
                        gate_open,
                        aborted: a == 0,
                    })
                    .collect()
            })
    }

    proptest! {
        /// The batch is the longest run from the head that fits, in order;
        /// aborted items before the stop are skipped, nothing after it
        /// moves; every batched item holds one slot, every batched sync
        /// message one buffer, and a slot taken for a message without a
        /// buffer is given back.
        #[test]
        fn a_batch_is_the_head_that_fits_in_order(
            items in items(),
            slots in 0..20usize,
            buffers in 0..4usize,
            max in 1..40usize,
        ) {
            let mut queue: VecDeque<Item> = items.iter().cloned().collect();
            let mut room = Counted {
                slots,
                buffers: (0..buffers).collect(),
                taken_slots: 0,
                unwound: 0,
            };
            let (mut batch, mut skipped) = (Vec::new(), Vec::new());
            take_batch(
                &mut queue,
                &mut batch,
                max,
                |i| if i.sync {
                    Needs::Sync { len: i.len, open: i.gate_open }
                } else {
                    Needs::Data(i.len)
                },
                |i| i.aborted,
                &mut room,
                &mut skipped,
            );
            // The model: walk the items with the same rules.
            let (mut s, mut b, mut want_batch, mut want_skip) = (slots, buffers, vec![], vec![]);
            let mut stop = items.len();
            let mut unwound = 0;
            for (k, i) in items.iter().enumerate() {
                if want_batch.len() == max {
                    stop = k;
                    break;
                }
                if i.aborted {
                    want_skip.push(i.id);
                    continue;
                }
                let fits = if i.sync {
                    if !i.gate_open || s == 0 {
                        false
                    } else if b == 0 {
                        unwound += 1;
                        false
                    } else {
                        b -= 1;
                        true
                    }
                } else {
                    s > 0
                };
                if !fits {
                    stop = k;
                    break;
                }
                s -= 1;
                want_batch.push(i.id);
            }
            let got: Vec<usize> = batch.iter().map(|(i, _)| i.id).collect();
            prop_assert_eq!(&got, &want_batch);
            prop_assert_eq!(skipped.iter().map(|i| i.id).collect::<Vec<_>>(), want_skip);
            let rest: Vec<usize> = queue.iter().map(|i| i.id).collect();
            prop_assert_eq!(rest, items[stop..].iter().map(|i| i.id).collect::<Vec<_>>());
            prop_assert_eq!(room.taken_slots, batch.len());
            prop_assert_eq!(room.unwound, unwound);
            for (i, buf) in &batch {
                prop_assert_eq!(buf.is_some(), i.sync);
            }
        }
    }

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
