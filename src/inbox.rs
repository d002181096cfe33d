//! The sync-message inbox: messages received from peers, grouped by
//! sender, held within a byte budget until the application takes them.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::agent::{SyncBatch, SyncMessages, TimedSyncMessages};
use crate::error::RejectReason;

/// Received sync messages, grouped by sender, held until taken within a
/// byte budget (so a peer that sends and a caller that does not take cannot
/// exhaust memory).
#[derive(Debug)]
pub(crate) struct Inbox {
    mailbox: Mutex<Mailbox>,
    cv: Condvar,
    /// Most bytes of messages queued or announced, in all.
    max_total: u64,
    /// Most bytes of messages queued or announced from one sender.
    max_per_peer: u64,
}

impl Default for Inbox {
    fn default() -> Self {
        Self::new(u64::MAX, u64::MAX)
    }
}

/// Room in the inbox for one announced sync message, taken before its body
/// is read; given back on drop unless the message is delivered.
pub(crate) struct Reservation {
    inbox: Arc<Inbox>,
    from: String,
    len: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.len > 0 {
            let mut m = self.inbox.lock();
            Mailbox::release(&mut m, &self.from, self.len);
        }
    }
}

impl Mailbox {
    fn release(&mut self, from: &str, len: u64) {
        self.total = self.total.saturating_sub(len);
        if let Some(b) = self.per_peer.get_mut(from) {
            *b = b.saturating_sub(len);
            if *b == 0 {
                self.per_peer.remove(from);
            }
        }
    }

    /// Takes every queued message, giving back their bytes, and the
    /// departures recorded with them.
    fn take(&mut self) -> SyncBatch {
        let messages = std::mem::take(&mut self.messages);
        for (from, list) in &messages {
            let n = list.iter().map(|(m, _)| m.len() as u64).sum();
            self.release(from, n);
        }
        SyncBatch {
            messages,
            departed: std::mem::take(&mut self.departed),
        }
    }
}

/// Most departures an inbox records between two takes (one per peer
/// name): past it, a departure is not recorded (a KV-cache reassembler
/// then drops that peer's partial message at its expiry instead).
const DEPARTED_MAX: usize = 1024;

/// The inbox's state: the messages, and how many times waiters were woken
/// without one (see [`Inbox::wake`]).
#[derive(Debug, Default)]
struct Mailbox {
    /// Messages by sender, each with when it was delivered.
    messages: TimedSyncMessages,
    wakes: u64,
    /// A wake no wait has answered yet (the next wait returns at once).
    woken: bool,
    /// Peers whose last connection into the agent ended since the last
    /// take, each with how many of its queued messages came before that
    /// (see [`SyncBatch::departed`]).
    departed: HashMap<String, usize>,
    /// Bytes of messages queued or reserved, in all.
    total: u64,
    /// The same per sending agent.
    per_peer: HashMap<String, u64>,
}

impl Inbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Mailbox> {
        self.mailbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An inbox that holds at most `max_total` bytes of messages, and at
    /// most `max_per_peer` from one sender, until they are taken.
    pub(crate) fn new(max_total: u64, max_per_peer: u64) -> Self {
        Self {
            mailbox: Mutex::new(Mailbox::default()),
            cv: Condvar::new(),
            max_total,
            max_per_peer,
        }
    }

    /// Room for a message of `len` bytes from `from`, or why not
    /// ([`RejectReason::InboxFull`]): counted from now until it is taken.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        from: &str,
        len: u64,
    ) -> Result<Reservation, RejectReason> {
        let mut m = self.lock();
        let peer = m.per_peer.get(from).copied().unwrap_or(0);
        if m.total.saturating_add(len) > self.max_total
            || peer.saturating_add(len) > self.max_per_peer
        {
            return Err(RejectReason::InboxFull);
        }
        m.total += len;
        match m.per_peer.get_mut(from) {
            Some(b) => *b += len,
            None => {
                m.per_peer.insert(from.to_owned(), len);
            }
        }
        Ok(Reservation {
            inbox: Arc::clone(self),
            from: from.to_owned(),
            len,
        })
    }

    /// Queues `msg` in the room `room` reserved for it (its exact length):
    /// the room now counts the queued message until it is taken.
    pub(crate) fn deliver(&self, mut room: Reservation, msg: Vec<u8>) {
        debug_assert_eq!(
            msg.len() as u64,
            room.len,
            "room reserved for another length"
        );
        let mut m = self.lock();
        room.len = 0;
        m.messages
            .entry(std::mem::take(&mut room.from))
            .or_default()
            .push((msg, Instant::now()));
        self.cv.notify_all();
    }

    pub(crate) fn take(&self) -> SyncMessages {
        untimed(self.lock().take().messages)
    }

    /// Records that `from`'s last connection into the agent ended: the
    /// next batch taken says so, after the messages of it queued now (see
    /// [`SyncBatch::departed`]); a waiter returns with it.
    pub(crate) fn depart(&self, from: &str) {
        let mut m = self.lock();
        let queued = m.messages.get(from).map_or(0, Vec::len);
        if m.departed.len() >= DEPARTED_MAX && !m.departed.contains_key(from) {
            tracing::debug!(remote = from, "departures not taken: not recorded");
            return;
        }
        m.departed.insert(from.to_owned(), queued);
        self.cv.notify_all();
    }

    /// Makes every thread now in [`wait`](Self::wait) return at once, with
    /// whatever has arrived (possibly nothing); with none waiting, the next
    /// wait returns at once (a wake is never lost between a waiter's look
    /// at its own state and its wait).
    pub(crate) fn wake(&self) {
        let mut m = self.lock();
        m.wakes = m.wakes.wrapping_add(1);
        m.woken = true;
        self.cv.notify_all();
    }

    pub(crate) fn wait(&self, timeout: Duration) -> SyncMessages {
        untimed(self.wait_batch(timeout).messages)
    }

    /// As [`wait`](Self::wait), with each message's delivery time.
    pub(crate) fn wait_timed(&self, timeout: Duration) -> TimedSyncMessages {
        self.wait_batch(timeout).messages
    }

    /// As [`wait_timed`](Self::wait_timed), with the departures recorded
    /// meanwhile (a departure also ends the wait).
    pub(crate) fn wait_batch(&self, timeout: Duration) -> SyncBatch {
        // `None`: no deadline (a timeout past what `Instant` can hold).
        let deadline = Instant::now().checked_add(timeout);
        let mut m = self.lock();
        let wakes = m.wakes;
        while m.messages.is_empty() && m.departed.is_empty() && m.wakes == wakes && !m.woken {
            let left = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                break;
            }
            m = self
                .cv
                .wait_timeout(m, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        m.woken = false;
        m.take()
    }
}

fn untimed(msgs: TimedSyncMessages) -> SyncMessages {
    msgs.into_iter()
        .map(|(from, list)| (from, list.into_iter().map(|(m, _)| m).collect()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbox_wait_returns_on_message_or_wake() {
        let inbox = std::sync::Arc::new(Inbox::default());
        // A message: delivered to the waiter, grouped by sender (a wait
        // without a deadline, too).
        let i = std::sync::Arc::clone(&inbox);
        let t = std::thread::spawn(move || i.wait(Duration::MAX));
        inbox.deliver(inbox.reserve("a", 1).unwrap(), vec![1]);
        let got = t.join().unwrap();
        assert_eq!(got.get("a"), Some(&vec![vec![1u8]]));
        // A wake without a message: the waiter returns (empty) long before
        // its timeout; the test would hang for ten minutes otherwise.
        let i = std::sync::Arc::clone(&inbox);
        let t = std::thread::spawn(move || i.wait(Duration::from_secs(600)));
        while !t.is_finished() {
            inbox.wake();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(t.join().unwrap().is_empty());
        // Wakes the loop sent after the waiter returned are answered by one
        // wait.
        let _ = inbox.wait(Duration::ZERO);
        // A wake before a wait is kept for it (an event loop that looked at
        // its work just before the wake misses nothing): the next wait
        // returns at once ...
        inbox.wake();
        let t0 = Instant::now();
        assert!(inbox.wait(Duration::from_secs(600)).is_empty());
        assert!(t0.elapsed() < Duration::from_secs(60));
        // ... and only that one: the wait after it waits its (short)
        // timeout.
        let t0 = Instant::now();
        assert!(inbox.wait(Duration::from_millis(50)).is_empty());
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }

    /// A departure ends a wait and comes with the batch, placed after the
    /// messages of that peer queued before it; a later one of the same
    /// peer in the batch moves the place; a plain take drops it.
    #[test]
    fn departures_are_placed_among_the_peers_messages() {
        let inbox = Arc::new(Inbox::default());
        let i = Arc::clone(&inbox);
        let t = std::thread::spawn(move || i.wait_batch(Duration::from_secs(600)));
        inbox.depart("a");
        let b = t.join().unwrap();
        assert!(b.messages.is_empty());
        assert_eq!(b.departed.get("a"), Some(&0));
        for m in [1u8, 2] {
            inbox.deliver(inbox.reserve("a", 1).unwrap(), vec![m]);
        }
        inbox.depart("a");
        inbox.depart("b");
        inbox.deliver(inbox.reserve("a", 1).unwrap(), vec![3]);
        let b = inbox.wait_batch(Duration::ZERO);
        assert_eq!(b.messages["a"].len(), 3);
        assert_eq!(b.departed.get("a"), Some(&2));
        assert_eq!(b.departed.get("b"), Some(&0));
        inbox.deliver(inbox.reserve("a", 1).unwrap(), vec![4]);
        inbox.depart("a");
        inbox.deliver(inbox.reserve("a", 1).unwrap(), vec![5]);
        inbox.depart("a");
        let b = inbox.wait_batch(Duration::ZERO);
        assert_eq!(b.departed.get("a"), Some(&2));
        inbox.depart("a");
        assert!(inbox.take().is_empty());
        assert!(inbox.wait_batch(Duration::ZERO).departed.is_empty());
        // Bounded: a departure past the cap is not recorded.
        for n in 0..DEPARTED_MAX + 5 {
            inbox.depart(&format!("p{n}"));
        }
        assert_eq!(
            inbox.wait_batch(Duration::ZERO).departed.len(),
            DEPARTED_MAX
        );
    }

    #[test]
    fn inbox_bytes_are_bounded_per_sender_and_in_all() {
        let inbox = Arc::new(Inbox::new(100, 60));
        let a1 = inbox.reserve("a", 40).unwrap();
        // Over a's share, though the inbox has room.
        assert_eq!(inbox.reserve("a", 21).err(), Some(RejectReason::InboxFull));
        let b1 = inbox.reserve("b", 60).unwrap();
        // Over the total, though c has sent nothing.
        assert_eq!(inbox.reserve("c", 1).err(), Some(RejectReason::InboxFull));
        // A reservation dropped unused gives its room back.
        drop(b1);
        let c1 = inbox.reserve("c", 50).unwrap();
        // Delivered messages count until taken.
        inbox.deliver(a1, vec![0; 40]);
        inbox.deliver(c1, vec![0; 50]);
        assert_eq!(inbox.reserve("b", 11).err(), Some(RejectReason::InboxFull));
        let got = inbox.take();
        assert_eq!(got["a"].len() + got["c"].len(), 2);
        let _ = inbox.reserve("a", 60).unwrap();
        assert_eq!(inbox.lock().per_peer.get("c"), None);
    }
}
