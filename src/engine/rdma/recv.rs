//! RDMA at the target and link set-up: the receive side of sync messages
//! (a thread per connection, or one shared receive queue per device),
//! and connecting a link's queue pairs over its first TCP stream.

use crate::agent::TransportKind;
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::peer::ack_timeout;
use crate::engine::sock::ProgressClock;
use crate::engine::target::attach;
use crate::engine::target::send_frames;
use crate::engine::wire::{Frame, status};
use crate::engine::{lock, rdma};
use crate::error::Error;
use crate::inbox::Inbox;
use crate::small::FastHash;
use crate::verbs::Device;
use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Polls a completion queue with a short spin, then sleeps: a busy-poll
/// phase for latency, bounded CPU when idle.
pub(in crate::engine) struct Backoff {
    pub(in crate::engine) idle_polls: u32,
}

impl Backoff {
    pub(in crate::engine) fn new() -> Self {
        Self { idle_polls: 0 }
    }

    pub(in crate::engine) fn reset(&mut self) {
        self.idle_polls = 0;
    }

    /// Waits before the next poll. `busy`: work is outstanding, so the
    /// completion is due soon — keep polling (yielding the CPU) instead of
    /// sleeping, which costs a timer tick of latency.
    pub(in crate::engine) fn wait(&mut self, busy: bool) {
        self.idle_polls = self.idle_polls.saturating_add(1);
        // While work is outstanding, sleep less: 20 µs instead of 100.
        // Pure spinning was measured worse on soft-RoCE, where the polling
        // thread takes the CPU from the kernel threads that move the data.
        if busy && self.idle_polls >= 2000 {
            std::thread::sleep(Duration::from_micros(20));
        } else if self.idle_polls < 200 {
            std::hint::spin_loop();
        } else if self.idle_polls < 2000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Where one connection's sync messages go: the inbox, and the
/// connection's socket, on which each delivery is acknowledged (the serve
/// thread no longer writes on an RDMA connection).
pub(in crate::engine) struct SyncSink {
    pub(in crate::engine) inbox: Arc<Inbox>,
    pub(in crate::engine) remote: String,
    pub(in crate::engine) sock: TcpStream,
    pub(in crate::engine) io_timeout: Duration,
}

impl SyncSink {
    /// Delivers one received SEND (a sync message, after its request's data
    /// by RC ordering) and acknowledges it. `false`: the connection must
    /// receive no more (a malformed message, or the socket failed).
    pub(in crate::engine) fn deliver(&self, bytes: &[u8], clock: &ProgressClock) -> bool {
        let Some((req, msg)) = rdma::split_sync(bytes) else {
            tracing::warn!(remote = %self.remote, "malformed RDMA sync message");
            return false;
        };
        let st = match self.inbox.reserve(&self.remote, msg.len() as u64) {
            Ok(room) => {
                self.inbox.deliver(room, msg.to_vec());
                status::OK
            }
            Err(reason) => {
                tracing::debug!(remote = %self.remote, len = msg.len(), %reason, "refused an RDMA sync message");
                reason.code()
            }
        };
        // The message follows its data, which landed by then.
        let ack = [Frame::Ack {
            req,
            status: st,
            landed: crate::error::Landed::All.code(),
        }
        .encode()];
        send_frames(&self.sock, &ack, clock, self.io_timeout).is_ok()
    }
}

/// Sleeps on a completion channel between polls: arm, poll once more (a
/// completion that came before arming raises no event), then wait at most
/// 50 ms (so a stop request is noticed). Returns `false` when the channel
/// failed.
pub(in crate::engine) fn idle_wait(events: &crate::verbs::CqEvents, armed: &mut bool) -> bool {
    if *armed {
        *armed = false;
        events.wait(Duration::from_millis(50)).is_ok()
    } else {
        *armed = true;
        events.arm().is_ok()
    }
}

/// What a connection's own receive thread needs (when receives are not
/// shared).
pub(in crate::engine) struct ReceiverCtx {
    pub(in crate::engine) sink: SyncSink,
    pub(in crate::engine) stop: Arc<AtomicBool>,
}

impl ReceiverCtx {
    /// Delivers each SEND and reposts its buffer, until stopped or the
    /// queue pair fails. Owns the queue pair and the ring; the queue pair
    /// is declared first in the tuple so it is destroyed before the ring's
    /// registration.
    pub(in crate::engine) fn run(self, mut qp: crate::verbs::RcQueuePair, ring: rdma::MsgRing) {
        let poller = qp.recv_poller();
        let events = qp.recv_events();
        let clock = ProgressClock::new();
        let mut done = Vec::new();
        let mut backoff = Backoff::new();
        let mut armed = false;
        while !self.stop.load(Ordering::Relaxed) {
            done.clear();
            if poller.poll(&mut done).is_err() {
                break;
            }
            if done.is_empty() {
                match &events {
                    Some(ev) => {
                        if !idle_wait(ev, &mut armed) {
                            break;
                        }
                    }
                    None => backoff.wait(false),
                }
                continue;
            }
            backoff.reset();
            for c in &done {
                let slot = c.wr_id as usize;
                if c.status != 0 || slot >= rdma::RING {
                    tracing::debug!(remote = %self.sink.remote, status = crate::verbs::wc_status_name(c.status), "RDMA receive ended");
                    return;
                }
                if !self
                    .sink
                    .deliver(&ring.read(slot, c.byte_len as usize), &clock)
                {
                    return;
                }
                // SAFETY: the slot belongs to `ring`, which outlives `qp`.
                if unsafe { qp.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX)) }.is_err() {
                    return;
                }
            }
        }
        drop(qp);
        drop(ring);
    }
}

/// Receive buffers in the agent's shared receive queue.
pub(in crate::engine) const SRQ_RING: usize = 256;

/// What the shared receive thread and the connections using it share.
///
/// Drop order: `srq` (whose queue pairs, holding `Arc`s to it, are gone
/// by then) is released before `ring`'s registration.
pub(in crate::engine) struct SrqShared {
    pub(in crate::engine) srq: Arc<crate::verbs::SharedReceiveQueue>,
    pub(in crate::engine) ring: rdma::MsgRing,
    /// Queue pair number → the connection its messages belong to.
    pub(in crate::engine) conns: Mutex<HashMap<u32, Arc<SyncSink>, FastHash>>,
}

/// The agent's one thread receiving the sync messages of every incoming
/// RDMA connection, from one shared receive queue. Dropped (stopped and
/// joined) with the last connection and the agent.
pub(in crate::engine) struct SrqReceiver {
    pub(in crate::engine) shared: Arc<SrqShared>,
    pub(in crate::engine) stop: Arc<AtomicBool>,
    pub(in crate::engine) thread: Option<JoinHandle<()>>,
}

impl SrqReceiver {
    pub(in crate::engine) fn start(
        dev: &Arc<Device>,
        agent: &str,
    ) -> Result<Arc<Self>, crate::verbs::VerbsError> {
        let srq = dev.create_srq(SRQ_RING as u32)?;
        let slots = (srq.depth() as usize).min(SRQ_RING);
        let ring = rdma::MsgRing::new(dev, slots)?;
        for slot in 0..slots {
            // SAFETY: the ring lives in `SrqShared` beside the queue and is
            // released after it.
            unsafe { srq.post_recv(slot as u64, ring.sge(slot, rdma::SYNC_MAX))? };
        }
        let shared = Arc::new(SrqShared {
            srq,
            ring,
            conns: Mutex::new(HashMap::default()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (sh, st) = (Arc::clone(&shared), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-rdma-srq-{agent}"))
            .spawn(move || srq_receive(&sh, &st, slots))
            .map_err(|e| crate::verbs::VerbsError::Verb {
                verb: "spawning the receive thread",
                source: e,
            })?;
        Ok(Arc::new(Self {
            shared,
            stop,
            thread: Some(thread),
        }))
    }
}

impl Drop for SrqReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The shared receive thread: delivers each SEND to the connection whose
/// queue pair it came through and reposts the buffer. A connection whose
/// message fails (malformed, socket gone) or whose queue pair reports an
/// error receives no more; the others are unaffected.
pub(in crate::engine) fn srq_receive(sh: &SrqShared, stop: &AtomicBool, slots: usize) {
    let events = sh.srq.events();
    let clock = ProgressClock::new();
    let mut done = Vec::new();
    let mut armed = false;
    while !stop.load(Ordering::Relaxed) {
        done.clear();
        if let Err(e) = sh.srq.poll(&mut done) {
            tracing::error!(error = %e, "polling the shared receive queue failed; RDMA sync messages stop");
            return;
        }
        if done.is_empty() {
            if !idle_wait(&events, &mut armed) {
                tracing::error!(
                    "the shared receive queue's channel failed; RDMA sync messages stop"
                );
                return;
            }
            continue;
        }
        for &(qpn, c) in &done {
            let slot = c.wr_id as usize;
            if slot >= slots {
                continue;
            }
            let sink = lock(&sh.conns).get(&qpn).cloned();
            match sink {
                Some(sink) if c.status == 0 => {
                    let ok = sink.deliver(&sh.ring.read(slot, c.byte_len as usize), &clock);
                    if !ok {
                        lock(&sh.conns).remove(&qpn);
                    }
                }
                Some(sink) => {
                    tracing::debug!(remote = %sink.remote, status = crate::verbs::wc_status_name(c.status), "RDMA receive ended");
                    lock(&sh.conns).remove(&qpn);
                }
                // A connection already closed.
                None => {}
            }
            // SAFETY: the slot belongs to `sh.ring`, which outlives the
            // queue (declared after it in `SrqShared`).
            if let Err(e) = unsafe {
                sh.srq
                    .post_recv(slot as u64, sh.ring.sge(slot, rdma::SYNC_MAX))
            } {
                tracing::error!(error = %e, "reposting to the shared receive queue failed");
            }
        }
    }
}

/// A connection's receiving end: its own thread, or its place in the
/// shared receive queue. Dropped when the connection ends.
pub(in crate::engine) enum RdmaReceiver {
    /// Stops and joins the connection's thread (which owns its queue pair).
    Own {
        stop: Arc<AtomicBool>,
        thread: Option<JoinHandle<()>>,
    },
    /// Leaves the shared receive thread's table (in `drop`), then destroys
    /// the queue pair, then releases the receiver (fields drop in order).
    Shared {
        qpn: u32,
        /// Held only to be destroyed after leaving the table.
        _qp: crate::verbs::SrqQueuePair,
        rx: Arc<SrqReceiver>,
    },
}

impl Drop for RdmaReceiver {
    fn drop(&mut self) {
        match self {
            RdmaReceiver::Own { stop, thread } => {
                stop.store(true, Ordering::Relaxed);
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
            RdmaReceiver::Shared { qpn, rx, .. } => {
                lock(&rx.shared.conns).remove(qpn);
            }
        }
    }
}

/// Initiator side of the queue-pair exchange on a fresh stream.
pub(in crate::engine) fn rdma_connect(
    cx: Ctx<'_>,
    dev: &Arc<Device>,
    peer: &AgentDesc,
    sock: &TcpStream,
    clock: &ProgressClock,
    index: usize,
) -> Result<rdma::RdmaConn, Error> {
    let rerr = |e: crate::verbs::VerbsError| rdma::rdma_err(&peer.name, e);
    let events = cx.config().rdma.progress != crate::agent::RdmaProgress::Poll;
    // One send-queue entry beyond the window: the express lane's, whose
    // lone work request bypasses the window (see `RdmaLink::post_express`).
    let mut qp = dev.create_rc_with(rdma::WINDOW + 1, events).map_err(rerr)?;
    let mine = qp.info();
    let t = cx.config().connect_timeout;
    let msg = rdma::accept::qp_msg(&mine);
    let answer = attach::attach(&peer.name, sock, clock, t, TransportKind::Rdma, &msg)?;
    let theirs = match answer {
        Ok(m) => rdma::accept::qp_from_msg(&m).ok_or_else(|| Error::ProtocolViolation {
            remote: peer.name.clone(),
            detail: format!("bad queue pair answer ({} bytes)", m.len()),
        })?,
        Err(st) => {
            return Err(Error::BackendUnavailable {
                backend: "rdma",
                reason: format!(
                    "remote agent {:?} refused the queue pair ({})",
                    peer.name,
                    if st == status::NO_TRANSPORT {
                        "it has no RDMA device"
                    } else {
                        "it could not create or connect one"
                    }
                ),
            });
        }
    };
    qp.set_ack_timeout(ack_timeout(cx.config()));
    qp.connect(&theirs).map_err(rerr)?;
    rdma::RdmaConn::new(
        qp,
        dev,
        u64::MAX,
        (index, cx.config().rdma.qps_per_peer),
        cx.config().rdma.max_inflight,
    )
    .map_err(rerr)
}
