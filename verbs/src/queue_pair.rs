//! Reliable-connected queue pairs: work requests and their gather lists,
//! connecting, posting (batched, inline), receives.

use super::*;

/// One local piece of a work request: `len` bytes at `addr` in the region
/// with `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Local key of the memory region.
    pub lkey: u32,
    /// Address.
    pub addr: u64,
    /// Length.
    pub len: u32,
}

impl From<Sge> for rdma_mummy_sys::ibv_sge {
    fn from(s: Sge) -> Self {
        Self {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey,
        }
    }
}

impl From<(u32, u64, u32)> for Sge {
    /// From `(lkey, addr, len)`.
    fn from((lkey, addr, len): (u32, u64, u32)) -> Self {
        Self { lkey, addr, len }
    }
}

/// What one work request of a [`RcQueuePair::post_batch`] does.
#[derive(Clone, Copy, Debug)]
pub enum PostOp {
    /// RDMA WRITE of the gathered pieces to `remote_addr`, with immediate
    /// data when `imm` is given.
    Write {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA READ from `remote_addr`, scattered into the pieces.
    Read {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        remote_addr: u64,
    },
    /// SEND of the gathered pieces with immediate data.
    Send {
        /// Immediate data.
        imm: u32,
    },
}

/// One work request of a batch.
#[derive(Clone, Copy, Debug)]
pub struct Post<'a> {
    /// Returned in its completion.
    pub wr_id: u64,
    /// The operation.
    pub op: PostOp,
    /// Local pieces, in order.
    pub sges: &'a [Sge],
    /// Whether the local pieces are host memory, which the CPU may read: a
    /// small WRITE or SEND is then carried inline. `false` for GPU memory
    /// (the device reads it, never the CPU).
    pub host_source: bool,
}

impl<'a> Post<'a> {
    /// The piece this work request carries inline, if it does: a WRITE or
    /// SEND of one piece of at most [`MAX_INLINE`] bytes (copied into the
    /// work request when posted, so the device reads no memory region).
    pub(super) fn inline_piece(&self) -> Option<&'a Sge> {
        match (self.op, self.sges) {
            _ if !self.host_source => None,
            (PostOp::Read { .. }, _) => None,
            (_, [one]) if one.len <= MAX_INLINE => Some(one),
            _ => None,
        }
    }
}

/// A reliable-connected queue pair and its completion queues.
pub struct RcQueuePair {
    // Declared first: destroyed before the completion queues it uses.
    pub(super) qp: GenericQueuePair,
    pub(super) send_cq: GenericCompletionQueue,
    pub(super) recv_cq: GenericCompletionQueue,
    /// The send completion queue's channel, when created with events. The
    /// completion queue holds a reference too, so the channel is destroyed
    /// after it.
    pub(super) channel: Option<Arc<CompletionChannel>>,
    /// The receive completion queue's channel, likewise.
    pub(super) recv_channel: Option<Arc<CompletionChannel>>,
    pub(super) path: QpPath,
    pub(super) max_sge: u32,
}

/// Bytes a WRITE or SEND carries inside its work request instead of
/// through a gather list (asked of every queue pair at creation; perftest
/// inlines up to 220 in its latency tests): the device reads no memory
/// region for them, and the source is free again once posted.
pub const MAX_INLINE: u32 = 64;

/// The local ACK timeout exponent a queue pair gets unless
/// [`RcQueuePair::set_ack_timeout`] says otherwise: 4.096 µs × 2^14 ≈ 67 ms,
/// perftest's default and a common choice on RoCE fabrics.
pub const DEFAULT_ACK_TIMEOUT: u8 = 14;

/// Connection parameters, chosen for RoCE and documented in
/// `docs/architecture.md`: local ACK timeout [`DEFAULT_ACK_TIMEOUT`], 7
/// transport retries, 7 RNR retries (infinite), minimum RNR timer 12
/// (0.64 ms), 16 outstanding RDMA READs each way.
pub(super) const QP_RETRY_CNT: u8 = 7;
pub(super) const QP_RNR_RETRY: u8 = 7;
pub(super) const QP_MIN_RNR_TIMER: u8 = 12;
pub(super) const QP_RD_ATOMIC: u8 = 16;

impl RcQueuePair {
    /// Sets the local ACK timeout that [`connect`](Self::connect) gives the
    /// queue pair: the requester retransmits after 4.096 µs × 2^`exp`
    /// without an acknowledgement (7 times, then the queue pair fails).
    /// `exp` is clamped to 1..=31 (0 would mean never, and a lost packet
    /// would then stall the queue pair for good).
    pub fn set_ack_timeout(&mut self, exp: u8) {
        self.path.ack_timeout = exp.clamp(1, 31);
    }

    /// This queue pair's address, for the peer.
    pub fn info(&self) -> QpInfo {
        self.path.info(self.qp.qp_number())
    }

    /// Connects to `remote`: INIT → RTR → RTS.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error for the failing transition.
    pub fn connect(&mut self, remote: &QpInfo) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is alive (we own it) and in INIT.
        unsafe { self.path.connect(self.qp.qp().as_ptr(), remote) }
    }

    /// Whether the queue pair is in the error state, as the device reports
    /// it now (`ibv_query_qp`; the cached state does not see transitions the
    /// hardware makes on a failed completion).
    pub fn is_error(&self) -> bool {
        // SAFETY: the queue pair is alive (we own it).
        unsafe { qp_in_error(self.qp.qp().as_ptr()) }
    }

    /// Most scatter-gather entries per work request on this queue pair.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// Posts an RDMA WRITE of `sges` (gathered in order) to `remote_addr`
    /// with `rkey`, with immediate data when `imm` is given.
    ///
    /// # Safety
    /// The local pieces must stay registered and valid until the request
    /// completes.
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub unsafe fn post_write(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        rkey: u32,
        remote_addr: u64,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let op = PostOp::Write {
            rkey,
            remote_addr,
            imm,
        };
        // SAFETY: forwarded contract.
        unsafe { self.post_one(wr_id, op, sges, signaled) }
    }

    /// Posts an RDMA READ from `remote_addr` (with `rkey`) scattered into
    /// `sges` in order.
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write).
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub unsafe fn post_read(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        rkey: u32,
        remote_addr: u64,
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let op = PostOp::Read { rkey, remote_addr };
        // SAFETY: forwarded contract.
        unsafe { self.post_one(wr_id, op, sges, signaled) }
    }

    /// Posts a SEND of a small inline message with immediate data.
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub fn post_send_inline(&mut self, wr_id: u64, msg: &[u8], imm: u32) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_send();
        guard
            .construct_wr(wr_id, WorkRequestFlags::Signaled | WorkRequestFlags::Inline)
            .setup_send_imm(imm)
            .setup_inline_data(msg);
        guard
            .post()
            .map_err(|e| verb("ibv_post_send(SEND)")(other(e)))
    }

    /// Posts a SEND of `sges` with immediate data (signaled).
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write).
    ///
    /// # Errors
    /// `ibv_post_send`'s error.
    pub unsafe fn post_send(
        &mut self,
        wr_id: u64,
        sges: &[Sge],
        imm: u32,
    ) -> Result<(), VerbsError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_one(wr_id, PostOp::Send { imm }, sges, true) }
    }

    /// Whether a failed [`post_batch`](Self::post_batch) posted none of
    /// its work requests: true on queue pairs built with the extended verbs
    /// (`ibv_wr_start` … `ibv_wr_complete`, which discards the whole batch
    /// on error); false on basic ones, where `ibv_post_send` may have posted
    /// a prefix — post one work request per batch there.
    pub fn batch_is_atomic(&self) -> bool {
        matches!(self.qp, GenericQueuePair::Extended(_))
    }

    /// Posts `wrs` in order with one doorbell, each signaled: one system
    /// call (soft-RoCE) or one MMIO write (hardware) for the whole batch.
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write), for every work request.
    ///
    /// # Errors
    /// The post's error; see [`batch_is_atomic`](Self::batch_is_atomic)
    /// for what was posted then.
    pub unsafe fn post_batch(&mut self, wrs: &[Post<'_>]) -> Result<(), VerbsError> {
        // SAFETY: forwarded contract.
        unsafe { self.post_wrs(wrs, true) }
    }

    /// One work request, signaled or not.
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write).
    unsafe fn post_one(
        &mut self,
        wr_id: u64,
        op: PostOp,
        sges: &[Sge],
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let w = [Post {
            wr_id,
            op,
            sges,
            host_source: true,
        }];
        // SAFETY: forwarded contract.
        unsafe { self.post_wrs(&w, signaled) }
    }

    /// # Safety
    /// As [`post_write`](Self::post_write).
    unsafe fn post_wrs(&mut self, wrs: &[Post<'_>], signaled: bool) -> Result<(), VerbsError> {
        match wrs {
            [] => return Ok(()),
            // SAFETY: forwarded contract.
            [w] if SharedPoster::fits(w) => return unsafe { self.post_direct(w, signaled) },
            _ => {}
        }
        let flags = send_flags(signaled);
        // One scratch list for the whole batch: each work request's list is
        // copied when it is set up. Short lists (the common case) stay on
        // the stack.
        let longest = wrs.iter().map(|w| w.sges.len()).max().unwrap_or(0);
        let blank = rdma_mummy_sys::ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let mut stack = [blank; 4];
        let mut heap = Vec::new();
        let scratch: &mut [rdma_mummy_sys::ibv_sge] = if longest <= stack.len() {
            &mut stack
        } else {
            heap.resize(longest, blank);
            &mut heap
        };
        let mut guard = self.qp.start_post_send();
        for w in wrs {
            let inline = w.inline_piece();
            // The flag too: soft-RoCE reads the inline bytes only with it
            // (without, the work request fails with a local QP error).
            let wr_flags = match inline {
                Some(_) => flags | WorkRequestFlags::Inline,
                None => flags,
            };
            let wr = guard.construct_wr(w.wr_id, wr_flags);
            let h = match w.op {
                PostOp::Write {
                    rkey,
                    remote_addr,
                    imm: Some(i),
                } => wr.setup_write_imm(rkey, remote_addr, i),
                PostOp::Write {
                    rkey,
                    remote_addr,
                    imm: None,
                } => wr.setup_write(rkey, remote_addr),
                PostOp::Read { rkey, remote_addr } => wr.setup_read(rkey, remote_addr),
                PostOp::Send { imm } => wr.setup_send_imm(imm),
            };
            match inline {
                Some(one) => {
                    // SAFETY: forwarded contract: the piece is valid memory
                    // (a registered region the caller holds) for at least
                    // this call; its bytes are copied into the work request
                    // here.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(one.addr as *const u8, one.len as usize)
                    };
                    h.setup_inline_data(bytes);
                }
                None => {
                    for (r, &s) in scratch.iter_mut().zip(w.sges) {
                        *r = s.into();
                    }
                    // SAFETY: forwarded contract: the pieces stay valid until
                    // the work request completes. The list is copied at once.
                    unsafe { h.setup_sge_list(&scratch[..w.sges.len()]) }
                }
            }
        }
        guard.post().map_err(|e| verb("ibv_post_send")(other(e)))
    }

    /// Posts one work request with `ibv_post_send` ([`post_direct_raw`]).
    ///
    /// # Safety
    /// As [`post_write`](Self::post_write); `w.sges` has at most
    /// [`DIRECT_SGES`] entries.
    unsafe fn post_direct(&mut self, w: &Post<'_>, signaled: bool) -> Result<(), VerbsError> {
        // SAFETY: the queue pair is alive (we own it); the rest is the
        // forwarded contract.
        unsafe { post_direct_raw(self.qp.qp(), w, signaled) }
    }

    /// A handle that posts lone work requests to this queue pair from any
    /// thread, without `&mut` access ([`SharedPoster::post`]): what a
    /// latency-bound caller posts while other threads may be posting
    /// batches through [`post_batch`](Self::post_batch).
    ///
    /// # Safety
    /// The handle must not be used after this queue pair is dropped.
    pub unsafe fn shared_poster(&self) -> SharedPoster {
        // SAFETY: the queue pair is alive now; the caller keeps the handle
        // from outliving it.
        SharedPoster(unsafe { self.qp.qp() })
    }

    /// Moves the queue pair to the error state: every outstanding work
    /// request then completes with `IBV_WC_WR_FLUSH_ERR`.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s error.
    pub fn set_error(&mut self) -> Result<(), VerbsError> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp
            .modify(&attr)
            .map_err(|e| verb("ibv_modify_qp(ERR)")(other(e)))
    }

    /// A handle on the send completion queue, usable without the queue pair.
    pub fn send_poller(&self) -> CqPoller {
        CqPoller(self.send_cq.clone())
    }

    /// Completion events of the send queue, when created with them.
    pub fn send_events(&self) -> Option<CqEvents> {
        self.channel.as_ref().map(|ch| CqEvents {
            channel: Arc::clone(ch),
            cq: self.send_cq.clone(),
        })
    }

    /// The receive completion queue's channel, when created with receive
    /// events.
    pub fn recv_events(&self) -> Option<CqEvents> {
        self.recv_channel.as_ref().map(|ch| CqEvents {
            channel: Arc::clone(ch),
            cq: self.recv_cq.clone(),
        })
    }

    /// A handle on the receive completion queue, usable without the queue pair.
    pub fn recv_poller(&self) -> CqPoller {
        CqPoller(self.recv_cq.clone())
    }

    /// Posts a receive buffer.
    ///
    /// # Safety
    /// The buffer must stay registered and valid until the receive completes
    /// or the queue pair is destroyed.
    ///
    /// # Errors
    /// `ibv_post_recv`'s error.
    pub unsafe fn post_recv(&mut self, wr_id: u64, sge: Sge) -> Result<(), VerbsError> {
        let mut guard = self.qp.start_post_recv();
        let h = guard.construct_wr(wr_id);
        // SAFETY: forwarded contract.
        unsafe { h.setup_sge(sge.lkey, sge.addr, sge.len) };
        guard.post().map_err(|e| verb("ibv_post_recv")(other(e)))
    }

    /// Appends the send queue's completions to `out`; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll_send(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        poll(&self.send_cq, out)
    }

    /// Appends the receive queue's completions to `out`; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll_recv(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        poll(&self.recv_cq, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small WRITE or SEND from host memory goes inline; from GPU memory
    /// (which the CPU must not read), a READ, or more than one piece, never.
    #[test]
    fn only_small_host_writes_and_sends_are_inlined() {
        let one = [Sge {
            lkey: 1,
            addr: 0x1000,
            len: 8,
        }];
        let big = [Sge {
            lkey: 1,
            addr: 0x1000,
            len: MAX_INLINE + 1,
        }];
        let write = PostOp::Write {
            rkey: 2,
            remote_addr: 0x2000,
            imm: None,
        };
        let post = |op, sges, host_source| Post {
            wr_id: 0,
            op,
            sges,
            host_source,
        };
        assert!(post(write, &one[..], true).inline_piece().is_some());
        assert!(
            post(PostOp::Send { imm: 0 }, &one[..], true)
                .inline_piece()
                .is_some()
        );
        assert!(post(write, &one[..], false).inline_piece().is_none());
        assert!(post(write, &big[..], true).inline_piece().is_none());
        let read = PostOp::Read {
            rkey: 2,
            remote_addr: 0x2000,
        };
        assert!(post(read, &one[..], true).inline_piece().is_none());
    }
}
