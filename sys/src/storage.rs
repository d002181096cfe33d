//! Storage through the C ABI: files and block devices opened by an agent
//! as FILE and BLK regions (see `TransferAgent::open_storage`).

use std::ffi::c_char;

use super::kvxfer_result::*;
use super::{Fail, Kind, boundary, kvxfer_agent, kvxfer_result, live, non_null, text};

/// What `kvxfer_agent_open_storage` opens: one of the `KVXFER_STORAGE_*`
/// values.
pub type kvxfer_storage_kind = u32;
/// A regular file: `KVXFER_MEM_FILE` descriptors.
pub const KVXFER_STORAGE_FILE: kvxfer_storage_kind = 0;
/// A block device, opened with `O_DIRECT`: `KVXFER_MEM_BLK` descriptors.
pub const KVXFER_STORAGE_BLOCK: kvxfer_storage_kind = 1;

/// Opens a file (`KVXFER_STORAGE_FILE`: created and set to `size` bytes
/// when `size` is not 0; `O_DIRECT` when `direct` is not 0) or a block
/// device (`KVXFER_STORAGE_BLOCK`, always `O_DIRECT`) as storage, and
/// writes its handle to `out_handle`: the `device_id` of the
/// `KVXFER_MEM_FILE` / `KVXFER_MEM_BLK` descriptors (`addr` = byte offset)
/// registered with `kvxfer_agent_register_memory`. A transfer whose remote
/// agent is this agent's own name moves host memory to and from them.
///
/// # Safety
/// `path` is a NUL-terminated string; `out_handle` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_open_storage(
    agent: *const kvxfer_agent,
    path: *const c_char,
    kind: kvxfer_storage_kind,
    size: u64,
    direct: u32,
    out_handle: *mut u32,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let path = unsafe { text(path, "path")? };
        non_null(out_handle, "out_handle")?;
        let spec = match kind {
            KVXFER_STORAGE_FILE => {
                let s = kvxfer_core::StorageSpec::file(path).direct(direct != 0);
                if size > 0 { s.create(size) } else { s }
            }
            KVXFER_STORAGE_BLOCK => kvxfer_core::StorageSpec::block(path),
            other => {
                return Err(Fail::new(
                    KVXFER_ERR_INVALID_ARGUMENT,
                    format!("unknown storage kind {other}"),
                ));
            }
        };
        let h = a.agent.open_storage(&spec)?;
        // SAFETY: checked non-null; valid for a write per the contract.
        unsafe { *out_handle = h };
        Ok(KVXFER_OK)
    })
}

/// Closes storage `handle`; refused (`KVXFER_ERR_INVALID_ARGUMENT`) while
/// ranges of it are registered.
///
/// # Safety
/// `agent` is a live agent.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_close_storage(
    agent: *const kvxfer_agent,
    handle: u32,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        a.agent.close_storage(handle)?;
        Ok(KVXFER_OK)
    })
}
