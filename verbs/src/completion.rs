//! Completions: work completions, polling a completion queue, and sleeping
//! on its completion channel.

use super::*;

/// A completed work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id given when posting.
    pub wr_id: u64,
    /// `ibv_wc_status` (0 = success).
    pub status: u32,
    /// Vendor error.
    pub vendor_err: u32,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// Immediate data (receives of WRITE_WITH_IMM / SEND_WITH_IMM).
    pub imm: u32,
}

impl WorkCompletion {
    /// From a work completion; `imm`: keep its immediate data (a shared
    /// receive queue's completions carry none the caller reads).
    pub(super) fn from_wc(w: &rdma_mummy_sys::ibv_wc, imm: bool) -> Self {
        // SAFETY: a plain integer in either member of the union.
        let raw = unsafe { w.imm_data_invalidated_rkey_union.imm_data };
        Self {
            wr_id: w.wr_id,
            status: w.status,
            vendor_err: w.vendor_err,
            byte_len: w.byte_len,
            imm: if imm { raw } else { 0 },
        }
    }

    /// The completion as a result.
    ///
    /// # Errors
    /// [`VerbsError::WorkCompletion`] for an error status.
    pub fn ok(&self) -> Result<(), VerbsError> {
        if self.status == 0 {
            Ok(())
        } else {
            Err(VerbsError::WorkCompletion {
                wr_id: self.wr_id,
                status: self.status,
                status_name: wc_status_name(self.status),
                vendor_err: self.vendor_err,
            })
        }
    }
}

/// A completion queue handle that polls without holding the queue pair
/// (the queue pair is usually behind a lock for posting).
#[derive(Clone)]
pub struct CqPoller(pub(super) GenericCompletionQueue);

impl CqPoller {
    /// Appends completions to `out`; returns how many.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>) -> Result<usize, VerbsError> {
        poll(&self.0, out)
    }

    /// Hands each completion to `each` as it is polled (no buffer);
    /// returns how many there were.
    ///
    /// # Errors
    /// `ibv_poll_cq`'s error.
    pub fn poll_each(&self, each: impl FnMut(&WorkCompletion)) -> Result<usize, VerbsError> {
        poll_each(&self.0, each)
    }
}

/// Sleeping until a completion queue has news, instead of polling it:
/// arm, re-poll (a completion may have arrived before arming), then
/// [`wait`](Self::wait).
pub struct CqEvents {
    pub(super) channel: Arc<CompletionChannel>,
    pub(super) cq: GenericCompletionQueue,
}

impl CqEvents {
    /// Requests an event for the next completion (`ibv_req_notify_cq`).
    ///
    /// # Errors
    /// The verb's error.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the completion queue is alive (we hold it).
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(verb("ibv_req_notify_cq")(io::Error::from_raw_os_error(rc)))
        }
    }

    /// Waits up to `timeout` for an event; consumes and acknowledges it.
    /// Returns whether one came.
    ///
    /// # Errors
    /// `poll` or `ibv_get_cq_event`'s error.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<bool, VerbsError> {
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&*self.channel),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(verb("poll(completion channel)")(e));
        }
        if n == 0 {
            return Ok(false);
        }
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the channel is alive and non-blocking; the out pointers
        // point to locals.
        let rc = unsafe {
            rdma_mummy_sys::ibv_get_cq_event(
                self.channel.comp_channel().as_ptr(),
                &mut cq,
                &mut ctx,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(false);
            }
            return Err(verb("ibv_get_cq_event")(e));
        }
        // SAFETY: `cq` is the completion queue the event came from (ours,
        // alive); each event is acknowledged once, so destroying the queue
        // never waits for unacknowledged events.
        unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

/// Work completions one poll takes at most.
pub(super) const POLL_BATCH: usize = 32;

pub(super) fn poll(
    cq: &GenericCompletionQueue,
    out: &mut Vec<WorkCompletion>,
) -> Result<usize, VerbsError> {
    poll_each(cq, |c| out.push(*c))
}

/// Polls `cq` once, handing each completion to `each` as it comes (no
/// buffer); returns how many there were.
pub(super) fn poll_each(
    cq: &GenericCompletionQueue,
    mut each: impl FnMut(&WorkCompletion),
) -> Result<usize, VerbsError> {
    let GenericCompletionQueue::Basic(basic) = cq else {
        let poller = match cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(0),
            Err(e) => return Err(verb("ibv_poll_cq")(other(e))),
        };
        let mut n = 0;
        for wc in poller {
            each(&WorkCompletion {
                wr_id: wc.wr_id(),
                status: wc.status(),
                vendor_err: wc.vendor_err(),
                byte_len: wc.byte_len(),
                imm: wc.imm_data(),
            });
            n += 1;
        }
        return Ok(n);
    };
    // SAFETY: the completion queue is alive (we hold it).
    let cq = unsafe { basic.cq() };
    poll_raw(cq, |w| each(&WorkCompletion::from_wc(w, true)))
}

/// Polls `cq` once with `ibv_poll_cq` into a batch on the stack, handing
/// each work completion to `each`; returns how many there were. (Straight
/// into the stack: sideway's poller allocates its batch, 32 entries or
/// 1.5 KiB, past the allocator's thread cache, on every poll, which cost a
/// busy-polling waiter more than the poll itself — callgrind on a soft-RoCE
/// ping-pong: about 370 instructions a poll.)
pub(super) fn poll_raw(
    cq: std::ptr::NonNull<rdma_mummy_sys::ibv_cq>,
    mut each: impl FnMut(&rdma_mummy_sys::ibv_wc),
) -> Result<usize, VerbsError> {
    let mut wc = [const { std::mem::MaybeUninit::<rdma_mummy_sys::ibv_wc>::uninit() }; POLL_BATCH];
    // SAFETY: the caller holds the completion queue alive; `wc` has room
    // for `POLL_BATCH` entries, of which the provider writes the first `n`.
    let n = unsafe {
        rdma_mummy_sys::ibv_poll_cq(cq.as_ptr(), POLL_BATCH as i32, wc.as_mut_ptr().cast())
    };
    if n < 0 {
        return Err(verb("ibv_poll_cq")(io::Error::from_raw_os_error(-n)));
    }
    for w in &wc[..n as usize] {
        // SAFETY: the provider wrote the first `n` entries.
        each(unsafe { w.assume_init_ref() });
    }
    Ok(n as usize)
}
