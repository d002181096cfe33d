//! Transfers through the C ABI: submitting requests (once, or prepared
//! and posted again), notifications.

use std::ffi::c_char;

use super::kvxfer_result::*;
use super::{
    Fail, KVXFER_OP_READ, KVXFER_OP_WRITE, KVXFER_SUBMIT_DURABLE, KVXFER_SUBMIT_INTEGRITY, Kind,
    boundary, descs, free_handle, hand_out, issue, kvxfer_agent, kvxfer_prepared, kvxfer_request,
    kvxfer_result, kvxfer_status, kvxfer_submit_flags, live, non_null, slice, text,
};
use kvxfer_core::TransferRequest;

/// Validates and submits a transfer; on success `*out` is a status handle
/// to free with `kvxfer_status_free`.
///
/// # Safety
/// `request` and the arrays and strings it points to are valid for the call
/// (the library copies what it keeps); `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_submit(
    agent: *const kvxfer_agent,
    request: *const kvxfer_request,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    // SAFETY: forwarded contract.
    unsafe { kvxfer_agent_submit_flags(agent, request, 0, out) }
}

/// `kvxfer_agent_submit` with `flags` (`KVXFER_SUBMIT_*`, or-ed; 0 is
/// `kvxfer_agent_submit`).
///
/// # Safety
/// As `kvxfer_agent_submit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_submit_flags(
    agent: *const kvxfer_agent,
    request: *const kvxfer_request,
    flags: kvxfer_submit_flags,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(request, "request")?;
        non_null(out, "out")?;
        if flags & !(KVXFER_SUBMIT_DURABLE | KVXFER_SUBMIT_INTEGRITY) != 0 {
            return Err(Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("unknown submit flags {flags:#x}"),
            ));
        }
        // SAFETY: non-null and valid per the contract.
        let mut req = unsafe { request_from(&*request)? };
        req.durable = flags & KVXFER_SUBMIT_DURABLE != 0;
        req.integrity = flags & KVXFER_SUBMIT_INTEGRITY != 0;
        let status = a.agent.submit_transfer(&req)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_status { status }), Kind::Status) }
    })
}

/// The Rust request a C request describes.
///
/// # Safety
/// As `kvxfer_agent_submit`'s `request`.
unsafe fn request_from(r: &kvxfer_request) -> Result<TransferRequest, Fail> {
    // SAFETY: the arrays are valid for their counts.
    let local = unsafe { descs(r.local_type, r.local, r.local_count, "request.local")? };
    // SAFETY: as above.
    let remote = unsafe { descs(r.remote_type, r.remote, r.remote_count, "request.remote")? };
    // SAFETY: NUL-terminated per the contract.
    let name = unsafe { text(r.remote_agent, "request.remote_agent")? };
    let mut req = match r.op {
        KVXFER_OP_WRITE => TransferRequest::write(local, remote, name),
        KVXFER_OP_READ => TransferRequest::read(local, remote, name),
        other => {
            return Err(Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("unknown operation {other}"),
            ));
        }
    };
    if !r.sync_message.is_null() {
        // SAFETY: valid for `sync_message_len` reads.
        let m = unsafe { slice(r.sync_message, r.sync_message_len, "request.sync_message")? };
        req = req.with_sync_message(m.to_vec());
    }
    Ok(req)
}

/// Resolves a request once for repeated submission: checked now (local
/// registration, remote agent and exported range), its local regions held
/// until `kvxfer_prepared_free`.
///
/// # Safety
/// As `kvxfer_agent_submit`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_prepare(
    agent: *const kvxfer_agent,
    request: *const kvxfer_request,
    out: *mut *mut kvxfer_prepared,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(request, "request")?;
        non_null(out, "out")?;
        // SAFETY: non-null and valid per the contract.
        let req = unsafe { request_from(&*request)? };
        let prepared = a.agent.prepare_transfer(&req)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_prepared { prepared }), Kind::Prepared) }
    })
}

/// Submits a prepared transfer (of this agent) once more; `out` receives
/// its status as `kvxfer_agent_submit`'s.
///
/// # Safety
/// `prepared` is a handle from `kvxfer_agent_prepare` (checked); `out` is
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_submit_prepared(
    agent: *const kvxfer_agent,
    prepared: *const kvxfer_prepared,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: checked against the handle table.
        let p = unsafe { live(prepared, Kind::Prepared, "prepared")? };
        non_null(out, "out")?;
        let status = a.agent.submit_prepared(&p.prepared)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe { hand_out(out, Box::new(kvxfer_status { status }), Kind::Status) }
    })
}

/// Frees a prepared transfer, releasing its hold on the local regions
/// (statuses of its submissions stay valid). NULL is a no-op.
///
/// # Safety
/// `prepared` is NULL or a handle from `kvxfer_agent_prepare` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_prepared_free(prepared: *mut kvxfer_prepared) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(prepared, Kind::Prepared, "prepared") })
}

/// Sends a sync message not tied to a transfer, ordered after the data of
/// every transfer submitted earlier to `remote`. `out` may be NULL (fire and
/// forget); otherwise it receives a status that completes on delivery.
///
/// # Safety
/// `remote` is NUL-terminated; `msg` is valid for `len` reads; `out` is NULL
/// or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_notify(
    agent: *const kvxfer_agent,
    remote: *const c_char,
    msg: *const u8,
    len: usize,
    out: *mut *mut kvxfer_status,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let remote = unsafe { text(remote, "remote")? };
        // SAFETY: valid for `len` reads.
        let m = unsafe { slice(msg, len, "msg")? }.to_vec();
        let status = a.agent.notify_sync_message(remote, m)?;
        if !out.is_null() {
            let p = issue(Box::new(kvxfer_status { status }), Kind::Status);
            // SAFETY: non-null and valid for a write.
            unsafe { *out = p };
        }
        Ok(KVXFER_OK)
    })
}
