//! The RDMA send window: a lock-free ring of the sizes of the posted work
//! requests, checked by a `loom` model (`RUSTFLAGS="--cfg loom" cargo test
//! -p kvxfer-sync`).

#![forbid(unsafe_code)]

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

/// Under `loom`, a sequentially consistent fence; elsewhere nothing. The
/// window relies on its `SeqCst` accesses being in one total order with
/// the send queue's `waiting` count (a submitter counts its work, then
/// tries; the drainer releases, then looks at the count). loom models a
/// `SeqCst` access as acquire/release only (a documented limitation) and
/// would report a lost wake-up the hardware cannot produce; the fence gives
/// the model the order the accesses have.
#[inline(always)]
fn model_seq_cst() {
    #[cfg(loom)]
    loom::sync::atomic::fence(Ordering::SeqCst);
}

/// The send window without a lock: the sizes of the posted work requests
/// in a ring indexed by posting order (at most its `slots`), and their sum.
/// Slots are taken (and unwound) by one thread at a time — the holder of
/// the send queue's lock — and released in order by the one thread
/// draining the completion queue; `taken` and `released` count them.
/// A try and a release are sequentially consistent (with the send queue's
/// `waiting` count), so a release never misses work that a try refused.
pub struct Window {
    lens: Box<[AtomicU64]>,
    taken: AtomicU64,
    released: AtomicU64,
    bytes: AtomicU64,
}

impl Window {
    /// A window of `slots` work requests (at least one).
    pub fn new(slots: u32) -> Self {
        assert!(slots > 0, "a send window needs a slot");
        Self {
            lens: (0..slots).map(|_| AtomicU64::new(0)).collect(),
            taken: AtomicU64::new(0),
            released: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    fn slot(&self, n: u64) -> &AtomicU64 {
        &self.lens[(n % self.lens.len() as u64) as usize]
    }

    /// Takes a slot for a work request of `len` bytes if the ring has one
    /// and the bytes in flight stay within `max_bytes` (a lone request may
    /// always go).
    pub fn try_take(&self, len: u64, max_bytes: u64) -> bool {
        model_seq_cst();
        let taken = self.taken.load(Ordering::Relaxed);
        let released = self.released.load(Ordering::SeqCst);
        let in_flight = taken - released;
        if in_flight >= self.lens.len() as u64
            || (in_flight > 0 && self.bytes.load(Ordering::SeqCst) + len > max_bytes)
        {
            return false;
        }
        self.slot(taken).store(len, Ordering::Relaxed);
        self.bytes.fetch_add(len, Ordering::AcqRel);
        // Publishes the slot's length to the releasing thread.
        self.taken.store(taken + 1, Ordering::Release);
        true
    }

    /// Gives back the oldest taken slot (its work request completed).
    pub fn release(&self) {
        let released = self.released.load(Ordering::Relaxed);
        if released == self.taken.load(Ordering::Acquire) {
            return;
        }
        let len = self.slot(released).load(Ordering::Relaxed);
        self.bytes.fetch_sub(len, Ordering::SeqCst);
        self.released.store(released + 1, Ordering::SeqCst);
        model_seq_cst();
    }

    /// Gives back the slot just taken (its work request was not posted).
    pub fn unwind(&self) {
        let taken = self.taken.load(Ordering::Relaxed);
        if taken == self.released.load(Ordering::Acquire) {
            return;
        }
        let len = self.slot(taken - 1).load(Ordering::Relaxed);
        self.bytes.fetch_sub(len, Ordering::AcqRel);
        self.taken.store(taken - 1, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const SLOTS: u32 = 256;

    #[test]
    fn bytes_and_slots_bound_what_is_in_flight() {
        let w = Window::new(SLOTS);
        // A lone request may exceed the byte bound.
        assert!(w.try_take(10, 4));
        assert!(!w.try_take(1, 4));
        w.release();
        assert!(w.try_take(3, 4));
        assert!(w.try_take(1, 4));
        assert!(!w.try_take(1, 4));
        w.unwind();
        assert!(w.try_take(1, 4));
        w.release();
        w.release();
        // Releasing with nothing taken changes nothing.
        w.release();
        for _ in 0..SLOTS {
            assert!(w.try_take(0, 4));
        }
        assert!(!w.try_take(0, 4), "the ring is full");
    }
}

/// The taking thread (the send queue's lock holder: takes, posts or
/// unwinds) against the thread draining completions (releases what was
/// posted, in order), in every interleaving loom explores: the bytes in
/// flight never exceed the bound, never underflow, and end at zero.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicUsize;

    /// The RDMA transport's window (what the models ran with in the library).
    const SLOTS: u32 = 256;

    #[test]
    fn take_unwind_and_release_keep_the_window_whole() {
        loom::model(|| {
            let w = Arc::new(Window::new(SLOTS));
            let posted = Arc::new(AtomicUsize::new(0));
            let (w2, p2) = (Arc::clone(&w), Arc::clone(&posted));
            let drainer = loom::thread::spawn(move || {
                // Completions come only for posted work, in posting order.
                let mut released = 0;
                while released < 2 {
                    if p2.load(Ordering::Acquire) > released {
                        w2.release();
                        released += 1;
                    } else {
                        loom::thread::yield_now();
                    }
                }
            });
            let max = 8;
            let mut posts = 0;
            // Three tries: one is unwound (its post "failed"); a try the
            // window refuses is retried once a completion freed room.
            for (len, post) in [(6, true), (4, false), (4, true)] {
                while !w.try_take(len, max) {
                    loom::thread::yield_now();
                }
                assert!(w.bytes.load(Ordering::SeqCst) <= max.max(len));
                if post {
                    posts += 1;
                    posted.store(posts, Ordering::Release);
                } else {
                    w.unwind();
                }
            }
            drainer.join().unwrap();
            assert_eq!(w.bytes.load(Ordering::SeqCst), 0);
            assert_eq!(
                w.taken.load(Ordering::SeqCst),
                w.released.load(Ordering::SeqCst)
            );
        });
    }

    /// The lost wake-up the send path must not have: a submitter queues
    /// work and finds the window full, while the draining thread frees it
    /// and looks whether work waits. Either the submitter's try sees the
    /// room, or the drainer sees the work counted (`waiting`): the work is
    /// posted in every interleaving.
    #[test]
    fn queued_work_is_never_left_behind_a_freed_window() {
        fn pump(w: &Window, queued: &mut usize, waiting: &AtomicUsize) {
            while *queued > 0 && w.try_take(8, 8) {
                *queued -= 1;
                waiting.fetch_sub(1, Ordering::SeqCst);
            }
        }
        loom::model(|| {
            let w = Arc::new(Window::new(SLOTS));
            // One request in flight fills the window.
            assert!(w.try_take(8, 8));
            let waiting = Arc::new(AtomicUsize::new(0));
            let queue = Arc::new(loom::sync::Mutex::new(0usize));
            let submitter = {
                let (w, waiting, queue) =
                    (Arc::clone(&w), Arc::clone(&waiting), Arc::clone(&queue));
                loom::thread::spawn(move || {
                    let mut q = queue.lock().unwrap();
                    waiting.fetch_add(1, Ordering::SeqCst);
                    *q += 1;
                    pump(&w, &mut q, &waiting);
                })
            };
            // The in-flight request completes.
            w.release();
            if waiting.load(Ordering::SeqCst) > 0 {
                pump(&w, &mut queue.lock().unwrap(), &waiting);
            }
            submitter.join().unwrap();
            assert_eq!(*queue.lock().unwrap(), 0, "work left queued");
        });
    }
}
