//! The KV-cache protocol without I/O: [`SenderMachine`] (context side) and
//! [`ReceiverMachine`] (generation side) are fed events — a message from a
//! peer, a transfer's completion, the passing of time — and polled for
//! what to do: messages to send ([`Transmit`]), writes to post or abort
//! ([`TransferAction`]), outcomes to report, and the next instant at which
//! they want to be woken.
//!
//! Neither reads a clock, sleeps, spawns, locks or touches an agent: every
//! method takes the current [`Instant`] from its caller. So the whole
//! protocol — peers that never answer, cancels at any step, deadlines —
//! runs deterministically in tests, with two machines wired in memory and
//! simulated time. [`CacheSender`](super::CacheSender) and
//! [`CacheReceiver`](super::CacheReceiver) are the thin drivers that wire
//! them to a [`TransferAgent`](crate::TransferAgent) and a thread.
//!
//! # Driving a machine
//! After every `handle_*` call (and every API call such as `send`), the
//! driver drains, in this order, `poll_transmit` (sync messages, sent in
//! the order given), `poll_transfer` (posts and aborts, in the order given)
//! and `poll_event`, then sleeps until a message arrives, a posted transfer
//! completes, or `poll_timeout` passes (then `handle_timeout`).
//!
//! Durations *inside* one step (the time spent mapping fragments) are
//! measured only when the driver hands in a [`Stopwatch`]; without one they
//! read zero. No decision ever depends on it.

#![forbid(unsafe_code)]

mod receiver;
mod sender;
#[cfg(test)]
mod tests;

use std::time::Instant;

use crate::cache::wire::Msg;
use crate::proto::TransferRequest;

pub use receiver::{ReceiverEvent, ReceiverMachine};
#[cfg(any(test, feature = "fuzzing"))]
pub use sender::context_plan;
pub use sender::{SenderEvent, SenderMachine};

/// A clock read for the statistics of one step (see the
/// [module docs](self)); `std::time::Instant::now` in a real driver.
pub type Stopwatch = fn() -> Instant;

/// The stopwatch's reading, or `now` without one.
fn lap(stopwatch: Option<Stopwatch>, now: Instant) -> Instant {
    stopwatch.map_or(now, |f| f())
}

/// A protocol message for the driver to send as sync messages
/// ([`Msg::encode`] chunks, in order) to agent `to`.
#[derive(Clone, Debug, PartialEq)]
pub struct Transmit {
    /// The peer agent's name.
    pub to: String,
    /// The message.
    pub msg: Msg,
}

/// Names one transfer a [`SenderMachine`] asked to post.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

/// What a [`SenderMachine`] asks of the transport.
#[derive(Clone, Debug)]
pub enum TransferAction {
    /// Submit `request`; report its end with
    /// [`SenderMachine::handle_transfer_done`] (a refused submission too).
    Post {
        /// Names the transfer in the completion.
        id: TransferId,
        /// The write, with its sync message when it closes a share.
        request: TransferRequest,
    },
    /// Stop a posted transfer (see [`TransferStatus::abort`]); its
    /// completion is still reported, once nothing of it moves.
    ///
    /// [`TransferStatus::abort`]: crate::TransferStatus::abort
    Abort {
        /// The transfer.
        id: TransferId,
    },
}
