//! The express lane's ownership protocol, apart from what it carries: one
//! slot, and an atomic state that says which thread may touch it. Checked
//! by a `loom` model (`RUSTFLAGS="--cfg loom" cargo test -p kvxfer-sync`).
//!
//! ```text
//!   FREE ──claim──► CLAIMED ──post──► POSTED ──finish──► FINISHING ──► FREE
//!    ▲                 │                                      │
//!    └────release──────┘                         (close) ─────┴──────► CLOSED
//!   FREE ──close──► CLOSED
//! ```
//!
//! The thread whose compare-and-swap moved the state to CLAIMED (a
//! submitter) or FINISHING (a finisher) owns the slot until its release
//! store hands it on; the next owner's acquiring compare-and-swap reads
//! that store, so each owner sees everything the previous one wrote.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU8, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU8, Ordering};

/// The lane is free: a submitter may claim it.
const FREE: u8 = 0;
/// A submitter is filling the slot (a few instructions, no system call).
const CLAIMED: u8 = 1;
/// A request is in flight (or being posted); its finisher takes the slot.
const POSTED: u8 = 2;
/// A finisher is releasing the request's holds and recording its outcome.
const FINISHING: u8 = 3;
/// Closed: no request may take the lane any more.
const CLOSED: u8 = 4;

/// `UnsafeCell` with loom's closure interface (loom's own under `loom`,
/// so the model sees every access to the slot).
#[cfg(not(loom))]
struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    fn new(v: T) -> Self {
        Self(std::cell::UnsafeCell::new(v))
    }

    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(loom)]
use loom::cell::UnsafeCell;

/// One slot of `T` and the state that says who owns it.
pub struct Lane<T> {
    state: AtomicU8,
    slot: UnsafeCell<T>,
}

// SAFETY: the slot is touched only through a `Claim` (whose creation moved
// the state to CLAIMED) or inside `finish` (after moving it to FINISHING):
// one thread at a time, handed on by release stores that the next owner's
// acquiring compare-and-swap reads. `T: Send` lets it change threads.
unsafe impl<T: Send> Sync for Lane<T> {}

impl<T: Default> Default for Lane<T> {
    fn default() -> Self {
        Self {
            state: AtomicU8::new(FREE),
            slot: UnsafeCell::new(T::default()),
        }
    }
}

/// A submitter's exclusive hold on the slot: [`post`](Self::post) hands it
/// to the finisher, dropping it frees the lane again.
pub struct Claim<'a, T> {
    lane: &'a Lane<T>,
}

impl<T> Claim<'_, T> {
    /// Runs `f` on the slot.
    pub fn with_slot<R>(&mut self, f: impl FnOnce(&mut T) -> R) -> R {
        // SAFETY: this claim moved the state to CLAIMED and has not handed
        // it on: no other thread touches the slot.
        self.lane.slot.with_mut(|p| f(unsafe { &mut *p }))
    }

    /// The request is about to be posted: from now on the slot belongs to
    /// whoever finishes it.
    pub fn post(self) {
        self.lane.state.store(POSTED, Ordering::Release);
        std::mem::forget(self);
    }
}

impl<T> Drop for Claim<'_, T> {
    /// Not posted: the lane is free again.
    fn drop(&mut self) {
        self.lane.state.store(FREE, Ordering::Release);
    }
}

impl<T> Lane<T> {
    /// Claims the lane if it is free.
    pub fn claim(&self) -> Option<Claim<'_, T>> {
        self.state
            .compare_exchange(FREE, CLAIMED, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Claim { lane: self })
    }

    /// Finishes the request in flight, if any: runs `f` on the slot, then
    /// frees the lane — or closes it when `close` (no request may take it
    /// afterwards; a lane that is free is closed too, and a submitter or
    /// finisher holding the slot is waited for, a few instructions). Returns
    /// whether `f` ran.
    pub fn finish(&self, close: bool, f: impl FnOnce(&mut T)) -> bool {
        loop {
            match self.state.load(Ordering::Acquire) {
                POSTED => {
                    if self
                        .state
                        .compare_exchange(POSTED, FINISHING, Ordering::Acquire, Ordering::Relaxed)
                        .is_err()
                    {
                        continue;
                    }
                    // SAFETY: our compare-and-swap moved the state to
                    // FINISHING: the slot is ours until the store below.
                    self.slot.with_mut(|p| f(unsafe { &mut *p }));
                    let next = if close { CLOSED } else { FREE };
                    self.state.store(next, Ordering::Release);
                    return true;
                }
                FREE if close => {
                    if self
                        .state
                        .compare_exchange(FREE, CLOSED, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                    {
                        return false;
                    }
                }
                CLAIMED | FINISHING if close => yield_now(),
                // Nothing in flight, someone else finishing it, or closed.
                _ => return false,
            }
        }
    }

    /// Whether the lane is closed.
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) == CLOSED
    }
}

fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_exclusive_and_hands_the_slot_on() {
        let lane: Lane<Vec<u32>> = Lane::default();
        let mut c = lane.claim().expect("free");
        assert!(lane.claim().is_none());
        c.with_slot(|v| v.push(7));
        c.post();
        assert!(lane.claim().is_none(), "posted: the finisher's");
        let mut seen = Vec::new();
        assert!(lane.finish(false, |v| seen = std::mem::take(v)));
        assert_eq!(seen, [7]);
        assert!(!lane.finish(false, |_| unreachable!()), "nothing in flight");
        // A dropped claim frees the lane.
        drop(lane.claim().expect("free again"));
        let c = lane.claim().expect("free after a drop");
        c.post();
        assert!(lane.finish(true, |_| {}));
        assert!(lane.is_closed());
        assert!(lane.claim().is_none());
    }
}

/// The lane's protocol in every interleaving loom explores: a submitter
/// that claims, fills and posts, a finisher that drains what is posted, and
/// the link's last thread closing the lane; loom's cell checks that no two
/// threads touch the slot at once.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::Arc;

    #[test]
    fn loom_express_lane_hands_the_slot_on_and_closes() {
        loom::model(|| {
            let lane: Arc<Lane<u32>> = Arc::new(Lane::default());
            // The submitter: two requests, each claimed, filled, posted
            // (or given up when the lane is busy or closed).
            let s = Arc::clone(&lane);
            let submitter = loom::thread::spawn(move || {
                let mut posted = 0;
                for v in 1..=2u32 {
                    if let Some(mut c) = s.claim() {
                        c.with_slot(|x| {
                            assert_eq!(*x, 0, "a finished slot is cleared");
                            *x = v;
                        });
                        c.post();
                        posted += 1;
                    }
                }
                posted
            });
            // The completion drainer: finishes what is posted.
            let f = Arc::clone(&lane);
            let finisher = loom::thread::spawn(move || {
                let mut got = 0;
                for _ in 0..2 {
                    if f.finish(false, |x| {
                        assert_ne!(*x, 0, "finished a request never filled");
                        *x = 0;
                    }) {
                        got += 1;
                    }
                }
                got
            });
            let posted = submitter.join().unwrap();
            let finished = finisher.join().unwrap();
            // The link's last thread: finishes what is left, closes.
            let mut closed_one = 0;
            if lane.finish(true, |x| {
                assert_ne!(*x, 0);
                *x = 0;
            }) {
                closed_one = 1;
            }
            assert!(lane.is_closed());
            assert!(lane.claim().is_none());
            // Every posted request finished exactly once.
            assert_eq!(posted, finished + closed_one);
        });
    }

    #[test]
    fn loom_express_lane_close_races_a_submitter() {
        loom::model(|| {
            let lane: Arc<Lane<u32>> = Arc::new(Lane::default());
            let s = Arc::clone(&lane);
            let submitter = loom::thread::spawn(move || match s.claim() {
                Some(mut c) => {
                    c.with_slot(|x| *x = 5);
                    c.post();
                    true
                }
                None => false,
            });
            // Closing while the submitter may hold the slot: waits for it,
            // then finishes its request if it posted one.
            let finished = lane.finish(true, |x| {
                assert_eq!(*x, 5);
                *x = 0;
            });
            let posted = submitter.join().unwrap();
            // Either the close came first (no claim after it) or it waited
            // for the request and finished it.
            assert_eq!(posted, finished);
            assert!(lane.is_closed());
        });
    }
}
