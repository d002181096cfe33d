//! RDMA data path of the socket agent: one reliable-connected queue pair per
//! link, set up over the link's first TCP stream (an `Attach` naming
//! `rdma`, see `engine::attach`);
//! data moved by one-sided WRITE and READ straight between registered
//! regions; a request's sync message sent as a SEND on the same queue pair
//! after its data, so RC ordering delivers it only after every byte landed.

mod accept;
mod fast;
mod link;
mod progress;
mod recv;
mod schedule;
pub(in crate::engine) mod transport;

use kvxfer_sync::{Lane, Window};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Error;
use crate::small::Few;
use crate::verbs::{CqPoller, Device, RcQueuePair, Sge, VerbsError};

/// Size of one message buffer (a receive buffer on the target).
pub(crate) const SYNC_MAX: usize = 4096;
/// Largest sync message on the RDMA path: a buffer less the request id that
/// precedes the message in the SEND.
pub(crate) const SYNC_MSG_MAX: usize = SYNC_MAX - 8;

/// Splits a received SEND into (request id, message).
pub(crate) fn split_sync(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let (id, msg) = bytes.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*id), msg))
}
/// Message buffers per connection, each side.
pub(crate) const RING: usize = 64;
/// Largest work request: large transfers become several requests, so
/// several READs are outstanding at once (up to the queue pair's
/// read/atomic depth) and completions arrive regularly.
pub(crate) const WR_MAX: u64 = 1 << 20;
/// Outstanding work requests per queue pair.
pub(crate) const WINDOW: u32 = 256;
/// Most work requests posted with one doorbell (one `ibv_post_send`).
pub(crate) const DOORBELL_BATCH: usize = 32;
/// `wr_id` bit marking a SEND (whose bits 40..56 name its buffer slot).
pub(crate) const SEND_FLAG: u64 = 1 << 63;
/// `wr_id` bit marking the data work request of a link's express request
/// (see `Express` in the agent).
pub(crate) const EXPRESS_FLAG: u64 = 1 << 62;
const REQ_MASK: u64 = (1 << 40) - 1;

/// Splits a `wr_id` into (request id, send buffer slot).
pub(crate) fn decode_wr_id(wr_id: u64) -> (u64, Option<usize>) {
    let req = wr_id & REQ_MASK;
    if wr_id & SEND_FLAG != 0 {
        (req, Some(((wr_id >> 40) & 0xffff) as usize))
    } else {
        (req, None)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn rdma_err(remote: &str, e: VerbsError) -> Error {
    Error::Rdma {
        remote: remote.to_owned(),
        source: Arc::new(e),
    }
}

/// A registered ring of fixed-size message buffers. The registration is
/// declared first so it is dropped before the memory it covers.
pub(crate) struct MsgRing {
    mr: crate::verbs::Registered,
    buf: Box<[u8]>,
    free: Mutex<Vec<usize>>,
}

impl MsgRing {
    pub(crate) fn new(dev: &Device, slots: usize) -> Result<Self, VerbsError> {
        let buf = vec![0u8; slots * SYNC_MAX].into_boxed_slice();
        // SAFETY: `buf` lives in the same struct and is dropped after `mr`.
        let mr = unsafe { dev.register(buf.as_ptr() as u64, buf.len() as u64)? };
        Ok(Self {
            mr,
            buf,
            free: Mutex::new((0..slots).collect()),
        })
    }

    pub(crate) fn sge(&self, slot: usize, len: usize) -> Sge {
        Sge {
            lkey: self.mr.lkey(),
            addr: self.buf.as_ptr() as u64 + (slot * SYNC_MAX) as u64,
            len: len as u32,
        }
    }

    /// Copies the first `len` bytes of `slot` out (after a receive landed).
    pub(crate) fn read(&self, slot: usize, len: usize) -> Vec<u8> {
        let start = self.buf.as_ptr() as usize + slot * SYNC_MAX;
        (0..len.min(SYNC_MAX))
            // SAFETY: inside the ring; the device wrote this slot before the
            // receive completion that reported it, and does not touch it again
            // until it is reposted.
            .map(|i| unsafe { std::ptr::read_volatile((start + i) as *const u8) })
            .collect()
    }

    /// Copies `msg` into `slot` (before a SEND from it).
    pub(crate) fn write(&self, slot: usize, msg: &[u8]) {
        let start = self.buf.as_ptr() as usize + slot * SYNC_MAX;
        for (i, b) in msg.iter().take(SYNC_MAX).enumerate() {
            // SAFETY: inside the ring; the slot is owned by the caller (taken
            // from the free list) and no work request uses it.
            unsafe { std::ptr::write_volatile((start + i) as *mut u8, *b) };
        }
    }

    /// Writes a SEND payload (request id, then the message) into `slot`;
    /// returns its length.
    pub(crate) fn write_sync(&self, slot: usize, req: u64, msg: &[u8]) -> usize {
        let mut payload = Vec::with_capacity(8 + msg.len());
        payload.extend_from_slice(&req.to_le_bytes());
        payload.extend_from_slice(msg);
        self.write(slot, &payload);
        payload.len().min(SYNC_MAX)
    }

    /// Takes a free buffer, if any.
    pub(crate) fn try_acquire(&self) -> Option<usize> {
        lock(&self.free).pop()
    }

    pub(crate) fn release(&self, slot: usize) {
        lock(&self.free).push(slot);
    }
}

/// Work waiting to be posted on a queue pair.
pub(crate) enum Queued {
    /// One WRITE or READ of a request.
    Data {
        /// Request id.
        id: u64,
        /// Direction.
        op: crate::agent::TransferOp,
        /// The work request.
        wr: Wr,
    },
    /// A request's sync message, to send after its data.
    Sync {
        /// Request id.
        id: u64,
        /// The message.
        msg: Vec<u8>,
        /// With several queue pairs: waits until every work request
        /// queued before it on the others has completed, so every earlier
        /// byte has landed ([`schedule::Gate`]).
        gate: schedule::Gate,
    },
}

impl Queued {
    /// The request it belongs to.
    pub(crate) fn id(&self) -> u64 {
        match self {
            Queued::Data { id, .. } | Queued::Sync { id, .. } => *id,
        }
    }

    /// Events it stands for in the request: a data work request's
    /// completion; a SEND's completion and the target's acknowledgement.
    pub(crate) fn events(&self) -> usize {
        match self {
            Queued::Data { .. } => 1,
            Queued::Sync { .. } => 2,
        }
    }
}

/// Queued work and the request it belongs to.
pub(crate) type QueuedFor = (Queued, Arc<crate::engine::socket_link::Pending>);

/// A queue pair's work waiting for room in the send window, in posting
/// order, with the pump's scratch space (kept, so that posting allocates
/// nothing).
#[derive(Default)]
pub(crate) struct SendQueue {
    pub(crate) items: VecDeque<QueuedFor>,
    /// Items being posted, each with its message buffer (sync messages).
    pub(crate) batch: Vec<(QueuedFor, Option<usize>)>,
    /// The batch's gather lists back to back, and where each one's is.
    pub(crate) sges: Vec<Sge>,
    pub(crate) spans: Vec<std::ops::Range<usize>>,
}

/// One work request to post: a gather/scatter list against one contiguous
/// remote range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Wr {
    /// The local pieces, in the form the post takes.
    pub(crate) sges: Few<Sge>,
    pub(crate) rkey: u32,
    pub(crate) remote: u64,
    pub(crate) len: u64,
    /// The local pieces are GPU memory: never carried inline (the CPU must
    /// not read them).
    pub(crate) gpu: bool,
}

/// Plans work requests for `(lkey, local, rkey, remote, len)` pieces:
/// splits at `max_msg`, coalesces pieces whose remote ranges are adjacent
/// into one request (merging adjacent local pieces into one entry), with at
/// most `max_sge` entries per request.
pub(crate) fn plan_wrs(
    pieces: &[(u32, u64, u32, u64, u64)],
    max_msg: u64,
    max_sge: usize,
) -> Few<Wr> {
    let max_msg = max_msg.clamp(1, u64::from(u32::MAX));
    let max_sge = max_sge.max(1);
    let mut out: Few<Wr> = Few::new();
    for &(lkey, local, rkey, remote, len) in pieces {
        let mut off = 0;
        while off < len {
            let (l, r) = (local + off, remote + off);
            let room = match out.last() {
                Some(w) if w.rkey == rkey && w.remote + w.len == r => max_msg - w.len,
                _ => 0,
            };
            let n = if room > 0 {
                (len - off).min(room)
            } else {
                (len - off).min(max_msg)
            };
            let merged = room > 0 && {
                let w = out.last_mut().expect("room > 0 implies a last request");
                let extends = w
                    .sges
                    .last()
                    .is_some_and(|s| s.lkey == lkey && s.addr + u64::from(s.len) == l);
                if extends {
                    if let Some(s) = w.sges.last_mut() {
                        s.len += n as u32;
                    }
                    w.len += n;
                    true
                } else if w.sges.len() < max_sge {
                    w.sges.push(Sge::from((lkey, l, n as u32)));
                    w.len += n;
                    true
                } else {
                    false
                }
            };
            let n = if merged {
                n
            } else {
                let n = (len - off).min(max_msg);
                out.push(Wr {
                    sges: smallvec::smallvec![Sge::from((lkey, l, n as u32))],
                    rkey,
                    remote: r,
                    len: n,
                    gpu: false,
                });
                n
            };
            off += n;
        }
    }
    out
}

/// The work request that moves one planned piece of request `id`.
pub(crate) fn data_post<'a>(
    id: u64,
    op: crate::agent::TransferOp,
    wr: &Wr,
    sges: &'a [Sge],
) -> crate::verbs::Post<'a> {
    use crate::verbs::PostOp;
    crate::verbs::Post {
        wr_id: id,
        op: match op {
            crate::agent::TransferOp::Write => PostOp::Write {
                rkey: wr.rkey,
                remote_addr: wr.remote,
                imm: None,
            },
            crate::agent::TransferOp::Read => PostOp::Read {
                rkey: wr.rkey,
                remote_addr: wr.remote,
            },
        },
        sges,
        host_source: !wr.gpu,
    }
}

/// Misses in a row after which express posts stop looking for their own
/// completion at once ([`ReapHint`]).
const REAP_MISSES: u32 = 8;
/// One express post in this many looks again after the misses.
const REAP_RETRY: u64 = 256;

/// The initiator's side of one RDMA connection.
pub(crate) struct RdmaConn {
    /// Position among the link's queue pairs (sync messages go on 0).
    pub(crate) index: usize,
    /// Work requests ever queued here, and ever completed (in order: one
    /// send queue completes in posting order). Counted on the queue pairs
    /// after the first only: a sync message (always on the first) waits
    /// for the others' (see [`count_queued`](Self::count_queued)).
    pub(crate) queued: AtomicU64,
    pub(crate) completed: AtomicU64,
    /// This queue pair's share of the link's bytes in flight
    /// ([`RdmaConfig::max_inflight`](crate::RdmaConfig::max_inflight)).
    max_inflight: u64,
    /// Posting needs exclusive access; polling goes through `cq`.
    pub(crate) qp: Mutex<RcQueuePair>,
    /// Posts the express lane's lone work requests without `qp`'s lock
    /// (`ibv_post_send` is thread-safe). Made from `qp`, which lives as
    /// long as this connection.
    pub(crate) poster: crate::verbs::SharedPoster,
    pub(crate) cq: CqPoller,
    /// The completion channel, in the [`RdmaProgress`](crate::RdmaProgress)
    /// modes that sleep on one (all but `Poll`).
    pub(crate) events: Option<crate::verbs::CqEvents>,
    /// Held while draining `cq` (by the progress thread or a waiter).
    pub(crate) polled: Mutex<()>,
    /// Drains that found completions, counted by the drainer (under
    /// `polled`'s lock): the progress thread, parked while waiters poll,
    /// looks at it to see whether they still do.
    pub(crate) drains: AtomicU64,
    pub(crate) sends: MsgRing,
    window: Window,
    /// Work waiting for room in the send queue, in posting order.
    pub(crate) queue: Mutex<SendQueue>,
    /// Work requests posted and not yet completed.
    pub(crate) posted: AtomicUsize,
    /// Items in `queue` (changed under its lock, read without it).
    pub(crate) waiting: AtomicUsize,
    pub(crate) max_sge: usize,
    pub(crate) max_msg: u64,
    /// Whether a failed batch post posted nothing (see
    /// [`RcQueuePair::batch_is_atomic`]).
    pub(crate) batch_is_atomic: bool,
    /// Whether express posts look for their own completion at once.
    pub(crate) reap: ReapHint,
}

/// Whether to look at the completion queue right after an express post.
/// Software providers (soft-RoCE, siw) run the transport inside the post's
/// system call, so the completion is usually there when it returns:
/// reaping it then, in the submitting call, saves the waiter its own pass
/// through the completion machinery. Where completions come later (a
/// hardware NIC) the looks miss: after [`REAP_MISSES`] misses in a row
/// only one express post in [`REAP_RETRY`] looks (so a change is noticed),
/// a poll of an empty queue (a few loads) per 256 requests. Kept as the
/// misses in a row: a hint, read and written without a read-modify-write
/// (a lost update costs one look).
#[derive(Default)]
pub(crate) struct ReapHint {
    misses: AtomicU32,
}

impl ReapHint {
    /// Look after the post of request `id`?
    pub(crate) fn look(&self, id: u64) -> bool {
        self.misses.load(Ordering::Relaxed) < REAP_MISSES || id.is_multiple_of(REAP_RETRY)
    }

    /// Records what a look found.
    pub(crate) fn record(&self, found: bool) {
        let m = self.misses.load(Ordering::Relaxed);
        let next = if found { 0 } else { m.saturating_add(1) };
        if next != m {
            self.misses.store(next, Ordering::Relaxed);
        }
    }
}

impl RdmaConn {
    /// The `index`-th of a link's `of` queue pairs.
    pub(crate) fn new(
        qp: RcQueuePair,
        dev: &Device,
        max_msg: u64,
        (index, of): (usize, usize),
        link_inflight: u64,
    ) -> Result<Self, VerbsError> {
        Ok(Self {
            index,
            max_inflight: link_inflight / of.max(1) as u64,
            queued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            cq: qp.send_poller(),
            events: qp.send_events(),
            polled: Mutex::new(()),
            drains: AtomicU64::new(0),
            max_sge: qp.max_sge() as usize,
            batch_is_atomic: qp.batch_is_atomic(),
            // SAFETY: the poster is kept beside the queue pair, in this
            // connection, and dropped with it.
            poster: unsafe { qp.shared_poster() },
            qp: Mutex::new(qp),
            sends: MsgRing::new(dev, RING)?,
            window: Window::new(WINDOW),
            queue: Mutex::new(SendQueue::default()),
            waiting: AtomicUsize::new(0),
            posted: AtomicUsize::new(0),
            max_msg: max_msg.min(dev.max_msg_size()),
            reap: ReapHint::default(),
        })
    }

    /// Counts `n` work requests queued. Only the queue pairs after the
    /// first are counted: the counts are read for a sync message's gate,
    /// which covers the other queue pairs (RC orders the first's own work
    /// before it), so the first's — every request's, on a one-queue-pair
    /// link — would be two atomic updates a request for nothing.
    pub(crate) fn count_queued(&self, n: u64) {
        if self.index != 0 {
            self.queued.fetch_add(n, Ordering::AcqRel);
        }
    }

    /// Counts one work request completed (see [`count_queued`](Self::count_queued)).
    pub(crate) fn count_completed(&self) {
        if self.index != 0 {
            self.completed.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Takes one send-queue slot for a work request of `len` bytes if one
    /// is free and the bytes in flight allow it. Called with the send
    /// queue's lock held (takers are serialized, in posting order).
    pub(crate) fn try_take_slot(&self, len: u64) -> bool {
        self.window.try_take(len, self.max_inflight)
    }

    /// Gives back the slot of the oldest posted work request (completions
    /// of one send queue arrive in posting order). Called by the one
    /// thread draining the completion queue.
    pub(crate) fn release_slot(&self) {
        self.window.release();
    }

    /// Gives back the slot just taken, for a work request not posted.
    /// Called with the send queue's lock held.
    pub(crate) fn unwind_slot(&self) {
        self.window.unwind();
    }
}

/// An RDMA link: queue pairs, control on one stream.
pub(in crate::engine) type RdmaLink = crate::engine::socket_link::SocketLink<RdmaParts>;

/// The RDMA part of a socket link.
pub(crate) struct RdmaParts {
    /// The link's queue pairs (none on the other paths); sync messages go
    /// on the first.
    pub(crate) qps: Vec<RdmaConn>,
    /// Rotates the queue pair a request's first work request goes to.
    pub(crate) next_stripe: AtomicUsize,
    /// RDMA requests in flight whose waiters do not poll the completion
    /// queue themselves (large ones). While there are none, the progress
    /// threads stay off the completion queue (no completion events, no
    /// wake-ups competing with the waiting thread) and only look in now and
    /// then; submitting one wakes them.
    pub(crate) undriven: Arc<AtomicUsize>,
    /// The progress threads, to wake them.
    pub(crate) progress_threads: std::sync::OnceLock<Vec<std::thread::Thread>>,
    /// One queue pair: the express lane of small requests.
    pub(crate) express: ExpressLane,
    /// The last small request the link took, to post again unresolved.
    pub(crate) remembered: Mutex<Option<Box<fast::Remembered>>>,
}

impl RdmaParts {
    pub(crate) fn new(qps: Vec<RdmaConn>) -> Self {
        RdmaParts {
            qps,
            next_stripe: AtomicUsize::new(0),
            undriven: Arc::new(AtomicUsize::new(0)),
            progress_threads: std::sync::OnceLock::new(),
            express: ExpressLane::default(),
            remembered: Mutex::new(None),
        }
    }
}

/// A link's express lane: one small request at a time — a single data work
/// request of at most four pieces, no sync message, its waiter polling the
/// completion queue — travels without a `Pending` record and a table
/// entry, and reuses the previous express request's status when its caller
/// has dropped it. What a latency-bound caller (one request, wait, the next)
/// submits; the record, the table and the status cost more than the post
/// itself (callgrind, soft-RoCE ping-pong: about 550 of 2,040 instructions a
/// request).
///
/// The lane takes no lock ([`Lane`], model-checked with loom):
/// a submitter claims a free lane (one compare-and-swap), fills the slot,
/// marks it posted and posts its work request through the queue pair's
/// [`SharedPoster`](crate::verbs::SharedPoster) — outside the send queue's
/// lock and the window: the queue pair has one send-queue entry beyond the
/// window for it. From then on the slot belongs to whoever finishes the
/// request: the thread draining its completion, the submitter when the
/// post fails, or the link's last thread on exit, which also closes the
/// lane. A request finds the lane taken, or work counted in the send
/// queue's `waiting` (queued, or popped and not yet posted), or the link
/// broken: it takes the ordinary path, so it never overtakes earlier work
/// of its caller.
pub(crate) type ExpressLane = Lane<Express>;

/// What the express lane's slot holds.
#[derive(Default)]
pub(crate) struct Express {
    /// The holds on the regions of the request in flight.
    pub(crate) guards: Few<crate::registry::RegionGuard>,
    /// The status of the request in flight, or of the last one: reused
    /// when nothing else refers to it any more.
    pub(crate) status: Option<Arc<crate::agent::Completion>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaping_after_post_backs_off_when_it_misses() {
        let h = ReapHint::default();
        // Looks while it finds completions (a software provider).
        for id in 1..100 {
            assert!(h.look(id));
            h.record(true);
        }
        // A provider completing later: after REAP_MISSES misses, only one
        // request in REAP_RETRY looks.
        for id in 1..=u64::from(REAP_MISSES) {
            assert!(h.look(id));
            h.record(false);
        }
        let looks = (1..=10 * REAP_RETRY).filter(|&id| h.look(id)).count();
        assert_eq!(looks, 10);
        // One hit and it looks every time again.
        h.record(true);
        assert!((1..REAP_RETRY).all(|id| h.look(id)));
    }

    #[test]
    fn coalesces_adjacent_and_gathers_scattered() {
        // Remote-adjacent pieces from scattered local memory: one request,
        // three entries; the third local piece extends the second.
        let p = [
            (1, 1000, 9, 50_000, 100),
            (1, 5000, 9, 50_100, 100),
            (1, 5100, 9, 50_200, 50),
        ];
        let w = plan_wrs(&p, 1 << 20, 30);
        assert_eq!(
            w.as_slice(),
            &[Wr {
                sges: vec![(1, 1000, 100).into(), (1, 5000, 150).into()].into(),
                rkey: 9,
                remote: 50_000,
                len: 250,
                gpu: false,
            }]
        );
    }

    #[test]
    fn splits_at_max_message_and_max_sge() {
        let w = plan_wrs(&[(1, 0, 2, 0, 10)], 4, 30);
        assert_eq!(w.iter().map(|w| w.len).collect::<Vec<_>>(), vec![4, 4, 2]);
        assert_eq!(w[1].sges.as_slice(), &[(1, 4, 4).into()]);
        assert_eq!(w[1].remote, 4);
        // Four scattered local pieces to one remote range, two entries max.
        let p: Vec<_> = (0..4).map(|i| (1, i * 100, 2, 1000 + i * 10, 10)).collect();
        let w = plan_wrs(&p, 1 << 20, 2);
        assert_eq!(w.len(), 2);
        assert!(w.iter().all(|w| w.sges.len() == 2 && w.len == 20));
        // Different remote keys never merge.
        let w = plan_wrs(&[(1, 0, 2, 0, 10), (1, 10, 3, 10, 10)], 1 << 20, 30);
        assert_eq!(w.len(), 2);
    }

    #[test]
    fn every_byte_once_in_order() {
        let p: Vec<_> = (0..50u64)
            .map(|i| (1, i * 37 % 1000 * 64, 5, i * 40, 40))
            .collect();
        let w = plan_wrs(&p, 96, 3);
        let total: u64 = w.iter().map(|w| w.len).sum();
        assert_eq!(total, 2000);
        let mut at = 0;
        for wr in w.iter() {
            assert_eq!(wr.remote, at);
            assert_eq!(
                wr.sges.iter().map(|s| u64::from(s.len)).sum::<u64>(),
                wr.len
            );
            assert!(wr.len <= 96 && wr.sges.len() <= 3);
            at += wr.len;
        }
    }

    #[test]
    fn sync_payload_round_trip() {
        let mut p = 42u64.to_le_bytes().to_vec();
        p.extend_from_slice(b"hello");
        assert_eq!(split_sync(&p), Some((42, &b"hello"[..])));
        assert_eq!(split_sync(&p[..7]), None);
    }

    #[test]
    fn wr_ids_round_trip() {
        assert_eq!(decode_wr_id(77), (77, None));
        assert_eq!(decode_wr_id(SEND_FLAG | (5 << 40) | 77), (77, Some(5)));
    }
}
