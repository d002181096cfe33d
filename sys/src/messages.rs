//! Received sync messages through the C ABI: taking and waiting for them,
//! and reading a batch.

use std::ffi::{CString, c_char};
use std::time::Duration;

use super::kvxfer_result::*;
use super::{
    Fail, Kind, boundary, free_handle, issue, kvxfer_agent, kvxfer_messages, kvxfer_result, live,
    non_null,
};

fn messages_handle(m: kvxfer_core::SyncMessages) -> *mut kvxfer_messages {
    let mut groups: Vec<_> = m.into_iter().collect();
    groups.sort_by(|a, b| a.0.cmp(&b.0));
    let items = groups
        .into_iter()
        .flat_map(|(from, msgs)| {
            let from = CString::new(from).unwrap_or_default();
            msgs.into_iter().map(move |m| (from.clone(), m))
        })
        .collect();
    issue(Box::new(kvxfer_messages { items }), Kind::Messages)
}

/// Takes every sync message received so far (possibly none) as a batch:
/// grouped by sending agent (agents in name order), each group in arrival
/// order.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_take_messages(
    agent: *const kvxfer_agent,
    out: *mut *mut kvxfer_messages,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(out, "out")?;
        let h = messages_handle(a.agent.take_sync_messages());
        // SAFETY: non-null and valid for a write.
        unsafe { *out = h };
        Ok(KVXFER_OK)
    })
}

/// As `kvxfer_agent_take_messages`, first waiting up to `timeout_ms` for at
/// least one message (a negative value: until one arrives, or
/// `kvxfer_agent_wake_waiters` is called). Timeouts are `int64_t`
/// milliseconds throughout the API.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_wait_messages(
    agent: *const kvxfer_agent,
    timeout_ms: i64,
    out: *mut *mut kvxfer_messages,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(out, "out")?;
        let timeout = u64::try_from(timeout_ms).map_or(Duration::MAX, Duration::from_millis);
        let m = a.agent.wait_sync_messages(timeout);
        let h = messages_handle(m);
        // SAFETY: non-null and valid for a write.
        unsafe { *out = h };
        Ok(KVXFER_OK)
    })
}

/// Makes every thread now blocked in `kvxfer_agent_wait_messages` on this
/// agent return at once, with what has arrived (possibly nothing); a wait
/// that starts later is not affected. For an event loop that sleeps in
/// `kvxfer_agent_wait_messages` and also takes work from other threads:
/// they call this after queueing work. Thread-safe; `KVXFER_OK` or
/// `KVXFER_ERR_NULL_ARGUMENT` / `KVXFER_ERR_INVALID_HANDLE`.
///
/// # Safety
/// `agent` is a handle from `kvxfer_agent_new` (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_wake_waiters(agent: *const kvxfer_agent) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        a.agent.wake_sync_waiters();
        Ok(KVXFER_OK)
    })
}

/// Writes the number of messages in the batch.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_messages_count(
    messages: *const kvxfer_messages,
    out: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let m = unsafe { live(messages, Kind::Messages, "messages")? };
        non_null(out, "out")?;
        // SAFETY: non-null and valid for a write.
        unsafe { *out = m.items.len() };
        Ok(KVXFER_OK)
    })
}

/// Message `index`: the sending agent's name (NUL-terminated) and the
/// bytes. The pointers stay valid until the batch is freed.
///
/// # Safety
/// The output pointers are valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_messages_get(
    messages: *const kvxfer_messages,
    index: usize,
    agent_name: *mut *const c_char,
    data: *mut *const u8,
    len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let m = unsafe { live(messages, Kind::Messages, "messages")? };
        non_null(agent_name, "agent_name")?;
        non_null(data, "data")?;
        non_null(len, "len")?;
        let (from, bytes) = m.items.get(index).ok_or_else(|| {
            Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("index {index} out of range ({} messages)", m.items.len()),
            )
        })?;
        // SAFETY: all three are non-null and valid for a write.
        unsafe {
            *agent_name = from.as_ptr();
            *data = bytes.as_ptr();
            *len = bytes.len();
        }
        Ok(KVXFER_OK)
    })
}

/// Frees a message batch. NULL is a no-op.
///
/// # Safety
/// No other call on `messages` may run concurrently or follow, and pointers
/// obtained from it are no longer used.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_messages_free(messages: *mut kvxfer_messages) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(messages, Kind::Messages, "messages") })
}
