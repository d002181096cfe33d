//! Posting one work request with `ibv_post_send` from a work request built
//! on the stack, and the poster that does it through a shared reference.

use super::*;

pub(super) fn send_flags(signaled: bool) -> WorkRequestFlags {
    if signaled {
        WorkRequestFlags::Signaled
    } else {
        WorkRequestFlags::none()
    }
}

/// Longest gather list a lone work request is posted with directly
/// (`ibv_post_send`, list on the stack); longer ones take the batch path.
pub(super) const DIRECT_SGES: usize = 4;

/// Posts one signaled-or-not work request with `ibv_post_send`, its work
/// request and gather list built on the stack. (The extended API's start,
/// set-up and complete calls, through sideway's guards, cost about twice the
/// instructions for one work request: callgrind in the soft-RoCE guest,
/// the git history of `docs/benchmarks.md`.) One work request is posted whole or not at all,
/// as with the extended API.
///
/// # Safety
/// `qp` is a live queue pair; the pieces of `w` (at most [`DIRECT_SGES`])
/// stay registered and valid until the work request completes.
pub(super) unsafe fn post_direct_raw(
    qp: std::ptr::NonNull<rdma_mummy_sys::ibv_qp>,
    w: &Post<'_>,
    signaled: bool,
) -> Result<(), VerbsError> {
    use rdma_mummy_sys as sys;
    let blank = sys::ibv_sge {
        addr: 0,
        length: 0,
        lkey: 0,
    };
    let mut list = [blank; DIRECT_SGES];
    for (r, &s) in list.iter_mut().zip(w.sges) {
        *r = s.into();
    }
    let mut flags = if signaled {
        sys::ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
    if w.inline_piece().is_some() {
        flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
    }
    let (opcode, imm, remote_addr, rkey) = match w.op {
        PostOp::Write {
            rkey,
            remote_addr,
            imm: None,
        } => (sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0, remote_addr, rkey),
        PostOp::Write {
            rkey,
            remote_addr,
            imm: Some(i),
        } => (
            sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            i,
            remote_addr,
            rkey,
        ),
        PostOp::Read { rkey, remote_addr } => {
            (sys::ibv_wr_opcode::IBV_WR_RDMA_READ, 0, remote_addr, rkey)
        }
        PostOp::Send { imm } => (sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, imm, 0, 0),
    };
    // SAFETY: an all-zero `ibv_send_wr` is valid (null pointers, zero
    // counts); the fields this post uses are set below.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = w.wr_id;
    wr.sg_list = list.as_mut_ptr();
    wr.num_sge = w.sges.len().min(DIRECT_SGES) as i32;
    wr.opcode = opcode;
    wr.send_flags = flags;
    // Passed as given, as the extended API's set-up calls do.
    wr.imm_data_invalidated_rkey_union.imm_data = imm;
    wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
    let mut bad = std::ptr::null_mut();
    // SAFETY: the queue pair is alive (the caller's promise); `wr` and
    // `list` outlive the call, which copies them (and the inline bytes);
    // the pieces stay valid until the completion (forwarded contract).
    // `ibv_post_send` is thread-safe: the provider serializes the posts to
    // one send queue, and against the extended API's start…complete
    // sections on it.
    let rc = unsafe { sys::ibv_post_send(qp.as_ptr(), &mut wr, &mut bad) };
    if rc == 0 {
        Ok(())
    } else {
        Err(verb("ibv_post_send")(io::Error::from_raw_os_error(rc)))
    }
}

/// Posts lone work requests to one queue pair through a shared reference,
/// from any thread ([`RcQueuePair::shared_poster`]): `ibv_post_send` is
/// thread-safe in libibverbs (the provider locks the send queue for each
/// post, and around the extended API's start…complete sections), so a
/// caller that posts one work request needs no lock of its own on the
/// queue pair. Valid while the queue pair lives (the creator's promise).
#[derive(Clone, Copy, Debug)]
pub struct SharedPoster(pub(super) std::ptr::NonNull<rdma_mummy_sys::ibv_qp>);

// SAFETY: the pointer is only handed to `ibv_post_send`, which is
// thread-safe; the queue pair's lifetime is the creator's promise.
unsafe impl Send for SharedPoster {}
// SAFETY: as above: every use is a thread-safe verb.
unsafe impl Sync for SharedPoster {}

impl SharedPoster {
    /// Whether [`post`](Self::post) takes `w` (at most four pieces; longer
    /// lists go through [`RcQueuePair::post_batch`]).
    pub fn fits(w: &Post<'_>) -> bool {
        w.sges.len() <= DIRECT_SGES
    }

    /// Posts `w`, signaled.
    ///
    /// # Safety
    /// The queue pair is alive; `w` [`fits`](Self::fits); its pieces stay
    /// registered and valid until the work request completes.
    ///
    /// # Errors
    /// `ibv_post_send`'s error (nothing was posted).
    pub unsafe fn post(&self, w: &Post<'_>) -> Result<(), VerbsError> {
        // SAFETY: forwarded contract.
        unsafe { post_direct_raw(self.0, w, true) }
    }
}
