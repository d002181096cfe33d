//! Shared receive queues and the queue pairs that take their receives
//! from one.

use super::*;

/// A shared receive queue: receive buffers posted once for every queue pair
/// attached to it, so a receiving agent keeps one pool (and one thread)
/// however many peers send to it. Receives complete on its completion
/// queue; each completion names the queue pair it came through.
///
/// Drop order: the queue pairs attached hold an `Arc` to it, so it is
/// destroyed after them; then its completion queue, then the channel
/// (fields in declaration order), then the protection domain.
pub struct SharedReceiveQueue {
    pub(super) srq: std::ptr::NonNull<rdma_mummy_sys::ibv_srq>,
    pub(super) cq: GenericCompletionQueue,
    pub(super) channel: Arc<CompletionChannel>,
    /// Held so that the protection domain outlives the queue.
    pub(super) _pd: Arc<ProtectionDomain>,
    pub(super) depth: u32,
}

// SAFETY: verbs objects may be used from any thread; posting to a shared
// receive queue and polling a completion queue are thread-safe in
// libibverbs.
unsafe impl Send for SharedReceiveQueue {}
// SAFETY: as above; `&self` methods are the thread-safe verbs.
unsafe impl Sync for SharedReceiveQueue {}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: no queue pair uses it any more (they hold `Arc`s to us).
        let rc = unsafe { rdma_mummy_sys::ibv_destroy_srq(self.srq.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_destroy_srq failed");
        }
    }
}

impl std::fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("depth", &self.depth)
            .finish()
    }
}

impl SharedReceiveQueue {
    /// How many receives it holds.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Posts a receive buffer, for whichever attached queue pair gets the
    /// next message.
    ///
    /// # Safety
    /// The buffer must stay registered and valid until the receive
    /// completes or the queue is destroyed.
    ///
    /// # Errors
    /// `ibv_post_srq_recv`'s error.
    pub unsafe fn post_recv(&self, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        let mut list = rdma_mummy_sys::ibv_sge::from(sge);
        let mut wr = rdma_mummy_sys::ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut list,
            num_sge: 1,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the queue is alive; `wr` and its list are valid for the
        // call (the device copies them); the buffer's validity is the
        // caller's promise.
        let rc = unsafe { rdma_mummy_sys::ibv_post_srq_recv(self.srq.as_ptr(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(verb("ibv_post_srq_recv")(io::Error::from_raw_os_error(rc)))
        }
    }

    /// Appends up to 32 completions to `out`, each with the number of the
    /// queue pair it arrived on; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll(&self, out: &mut Vec<(u32, WorkCompletion)>) -> Result<usize, VerbsError> {
        // SAFETY: the completion queue is alive (we hold it).
        let cq = unsafe { self.cq.cq() };
        poll_raw(cq, |w| {
            out.push((w.qp_num, WorkCompletion::from_wc(w, false)));
        })
    }

    /// Sleeping until a receive completes ([`CqEvents`]).
    pub fn events(&self) -> CqEvents {
        CqEvents {
            channel: Arc::clone(&self.channel),
            cq: self.cq.clone(),
        }
    }
}

/// A reliable-connected queue pair whose receives come from a
/// [`SharedReceiveQueue`]: the receiving end of a connection.
///
/// Drop order: the queue pair is destroyed first (its `Drop`), then its
/// `Arc` on the shared receive queue is released.
pub struct SrqQueuePair {
    pub(super) qp: std::ptr::NonNull<rdma_mummy_sys::ibv_qp>,
    pub(super) path: QpPath,
    /// Held so that the shared receive queue outlives the queue pair.
    pub(super) _srq: Arc<SharedReceiveQueue>,
}

// SAFETY: verbs objects may be used from any thread; the methods that
// change the queue pair take `&mut self`.
unsafe impl Send for SrqQueuePair {}
// SAFETY: `&self` methods only read (`ibv_query_qp`) or return copies.
unsafe impl Sync for SrqQueuePair {}

impl Drop for SrqQueuePair {
    fn drop(&mut self) {
        // SAFETY: we own the queue pair; nothing uses it after this.
        let rc = unsafe { rdma_mummy_sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = rc, "ibv_destroy_qp failed");
        }
    }
}

impl std::fmt::Debug for SrqQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SrqQueuePair")
            .field("qpn", &self.qp_num())
            .finish()
    }
}

impl SrqQueuePair {
    /// The queue pair number (what [`SharedReceiveQueue::poll`] reports).
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the queue pair is alive; `qp_num` is set at creation.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    /// Sets the local ACK timeout (as [`RcQueuePair::set_ack_timeout`]).
    pub fn set_ack_timeout(&mut self, exp: u8) {
        self.path.ack_timeout = exp.clamp(1, 31);
    }

    /// This queue pair's address, for the peer.
    pub fn info(&self) -> QpInfo {
        self.path.info(self.qp_num())
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error for the failing transition.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is alive and in INIT (created so).
        unsafe { self.path.connect(self.qp.as_ptr(), remote) }
    }

    /// Whether the queue pair is in the error state, as the device
    /// reports it now.
    pub fn is_error(&self) -> bool {
        // SAFETY: the queue pair is alive.
        unsafe { qp_in_error(self.qp.as_ptr()) }
    }
}
