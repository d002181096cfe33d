//! A transfer's status through the C ABI (waits, aborts, its path and
//! id, completion callbacks) and completion queues.

use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use super::kvxfer_result::*;
use super::{
    Fail, Kind, boundary, free_handle, hand_out, kvxfer_complete_fn, kvxfer_completion, kvxfer_cq,
    kvxfer_result, kvxfer_status, live, non_null,
};
use kvxfer_core::{CompletionQueue, Error, TransferState};

/// Writes whether the transfer has finished (successfully or not).
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_is_completed(
    status: *const kvxfer_status,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = s.status.is_completed() };
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (a negative value: until the transfer ends,
/// which the agent's I/O timeout bounds). Returns `KVXFER_OK` on success,
/// `KVXFER_IN_PROGRESS` if still running, or the transfer's error code
/// (message in `kvxfer_last_error`). May be called again after any result.
///
/// # Safety
/// None beyond a valid or NULL handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_wait(
    status: *const kvxfer_status,
    timeout_ms: i64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let state = if timeout_ms < 0 {
            loop {
                if let TransferState::Completed = s.status.wait(Duration::from_secs(3600))? {
                    break TransferState::Completed;
                }
            }
        } else {
            s.status.wait(Duration::from_millis(timeout_ms as u64))?
        };
        Ok(match state {
            TransferState::Completed => KVXFER_OK,
            TransferState::InProgress => KVXFER_IN_PROGRESS,
        })
    })
}

/// Writes whether the transfer finished and no byte of it can land any
/// more, in either agent's memory: false while it runs, and after a
/// failure that broke the connection (`KVXFER_ERR_PEER_TIMEOUT`,
/// `KVXFER_ERR_CONNECTION_LOST`, ...) until `kvxfer_status_wait_settled`
/// proved it. Until then, treat a WRITE's destination as still being
/// written.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_is_settled(
    status: *const kvxfer_status,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = s.status.is_settled() };
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (at least 0) in all for the transfer to finish
/// and for proof that no byte of it can land any more: after a failure
/// that broke the connection, the target is asked to end the broken
/// link's streams. Returns `KVXFER_OK` once settled, whatever the
/// transfer's outcome; `KVXFER_ERR_TIMEOUT` when the transfer or the
/// target's answer did not come in time (a stopped target);
/// `KVXFER_ERR_UNSETTLED` on libfabric while the target still runs; the
/// error of reaching the target otherwise. May be called again.
///
/// # Safety
/// None beyond a valid or NULL handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_wait_settled(
    status: *const kvxfer_status,
    timeout_ms: i64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let timeout = u64::try_from(timeout_ms)
            .map_err(|_| Error::InvalidRequest("timeout_ms must be at least 0".into()))?;
        s.status.wait_settled(Duration::from_millis(timeout))?;
        Ok(KVXFER_OK)
    })
}

/// Asks for the transfer to be aborted and writes whether it was still
/// running (`*out`: true; false when it had already finished, its outcome
/// standing). Does not block: nothing more of the request is sent, its
/// sync message is not delivered, READ data still arriving is dropped;
/// `kvxfer_status_wait` then returns `KVXFER_ERR_ABORTED` once what was
/// already sent is done, after which no byte of the transfer changes in
/// either agent's memory (or `KVXFER_OK`, when everything had been sent
/// before the abort).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_abort(
    status: *const kvxfer_status,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let running = s.status.abort();
        if !out.is_null() {
            // SAFETY: non-null and valid for a write (contract).
            unsafe { *out = running };
        }
        Ok(KVXFER_OK)
    })
}

/// Writes the transport that carries (or carried) the transfer: a static
/// NUL-terminated `"tcp"`, `"shm"`, `"rdma"`, `"fabric"`, `"inproc"` or
/// `"storage"`.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_transport(
    status: *const kvxfer_status,
    out: *mut *const c_char,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        let name: &'static CStr = s.status.data_path().transport.as_cstr();
        // SAFETY: non-null and valid for a write.
        unsafe { *out = name.as_ptr() };
        Ok(KVXFER_OK)
    })
}

/// Writes the request id (unique per agent).
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_id(
    status: *const kvxfer_status,
    out: *mut u64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = s.status.id() };
        Ok(KVXFER_OK)
    })
}

/// The outcome code of a finished transfer.
fn outcome_code(outcome: Result<(), Error>) -> kvxfer_result {
    match outcome {
        Ok(()) => KVXFER_OK,
        Err(e) => Fail::from(e).code,
    }
}

/// Calls `callback(user_data, outcome)` once when the transfer finishes
/// (at once when it already has), on the process's callback thread, never
/// on a thread of the library: one that blocks holds up the callbacks
/// after it, not the transfers. Keep it short (post to an event loop,
/// write to a pipe, signal a condition). The status handle may be freed
/// before it runs.
///
/// # Safety
/// `callback` is safe to call from any thread with `user_data`, which must
/// stay valid until it has run.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_on_complete(
    status: *const kvxfer_status,
    callback: kvxfer_complete_fn,
    user_data: *mut c_void,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        let Some(cb) = callback else {
            return Err(Fail::new(KVXFER_ERR_NULL_ARGUMENT, "callback is NULL"));
        };
        // Carried as an integer: the caller vouches for it on any thread.
        let data = user_data as usize;
        s.status.on_complete(move |outcome| {
            let code = outcome_code(outcome);
            // A panic (or unwinding callback) must not cross into the
            // completing thread's caller.
            let _ = catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the caller's contract: `cb` may be called from
                // any thread with `user_data`, still valid.
                unsafe { cb(data as *mut c_void, code) }
            }));
        });
        Ok(KVXFER_OK)
    })
}

/// Makes an empty completion queue.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_new(out: *mut *mut kvxfer_cq) -> kvxfer_result {
    boundary(|| {
        non_null(out, "out")?;
        let cq = CompletionQueue::new()?;
        // SAFETY: non-null and valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_cq { cq }), Kind::Cq) }
    })
}

/// Reports `status`'s outcome on `cq`, with `token`, once it finishes (at
/// once when it has). The status handle may be freed meanwhile.
///
/// # Safety
/// None beyond valid or NULL handles.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_watch(
    cq: *const kvxfer_cq,
    status: *const kvxfer_status,
    token: u64,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let q = unsafe { live(cq, Kind::Cq, "cq")? };
        // SAFETY: checked against the handle table.
        let s = unsafe { live(status, Kind::Status, "status")? };
        q.cq.watch(&s.status, token);
        Ok(KVXFER_OK)
    })
}

/// Writes the queue's file descriptor: readable (`POLLIN`) while an
/// outcome is ready. Owned by the queue: poll it, never read or close it.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_fd(cq: *const kvxfer_cq, out: *mut i32) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let q = unsafe { live(cq, Kind::Cq, "cq")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = std::os::fd::AsRawFd::as_raw_fd(&q.cq) };
        Ok(KVXFER_OK)
    })
}

/// Waits up to `timeout_ms` (0: do not wait; negative: an hour) for at
/// least one outcome, then writes up to `cap` of them to `out` and their
/// number to `*count` (0 on timeout); the rest stay ready.
///
/// # Safety
/// `out` is valid for `cap` writes; `count` for one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_wait(
    cq: *const kvxfer_cq,
    timeout_ms: i64,
    out: *mut kvxfer_completion,
    cap: usize,
    count: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let q = unsafe { live(cq, Kind::Cq, "cq")? };
        non_null(count, "count")?;
        if cap > 0 {
            non_null(out, "out")?;
        }
        let timeout = if timeout_ms < 0 {
            Duration::from_secs(3600)
        } else {
            Duration::from_millis(timeout_ms as u64)
        };
        let got = q.cq.wait_max(timeout, cap);
        for (i, (token, outcome)) in got.iter().enumerate() {
            let c = kvxfer_completion {
                token: *token,
                outcome: outcome_code(outcome.clone()),
            };
            // SAFETY: `i < got.len() <= cap`: inside the caller's array.
            unsafe { *out.add(i) = c };
        }
        // SAFETY: non-null and valid for a write.
        unsafe { *count = got.len() };
        Ok(KVXFER_OK)
    })
}

/// Frees a completion queue handle (outcomes of transfers it still
/// watches are dropped as they come). NULL is a no-op.
///
/// # Safety
/// No other call on `cq` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_cq_free(cq: *mut kvxfer_cq) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(cq, Kind::Cq, "cq") })
}

/// Frees a status handle (does not cancel the transfer). NULL is a no-op.
///
/// # Safety
/// No other call on `status` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_status_free(status: *mut kvxfer_status) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(status, Kind::Status, "status") })
}
