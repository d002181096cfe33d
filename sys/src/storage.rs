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

/// Opens object `key` of `bucket` in an S3-compatible store (it need not
/// exist yet) and writes its handle to `out_handle`: the `device_id` of the
/// `KVXFER_MEM_OBJ` descriptors (`addr` = byte offset in the object)
/// registered with `kvxfer_agent_register_memory`. A transfer whose remote
/// agent is this agent's own name then PUTs host memory into the object
/// (a descriptor writes its object whole: `addr` 0; multipart with parallel
/// parts when large) or reads ranges of it (parallel ranged GETs); a peer
/// that loaded this agent does the same through it over TCP.
/// `endpoint` (`http://host:port`, `https://host`) may be NULL: the store
/// is then found as the AWS tools find it, as are the credentials and the
/// region (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
/// `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL(_S3)`,
/// `AWS_ENDPOINT_OVERRIDE`, `~/.aws/credentials` and `config`). Objects of
/// one bucket and endpoint share one connection pool and its workers.
/// Close it with `kvxfer_agent_close_storage`.
///
/// # Safety
/// `bucket` and `key` are NUL-terminated strings, `endpoint` one or NULL;
/// `out_handle` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_open_object(
    agent: *const kvxfer_agent,
    endpoint: *const c_char,
    bucket: *const c_char,
    key: *const c_char,
    out_handle: *mut u32,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let bucket = unsafe { text(bucket, "bucket")? };
        // SAFETY: NUL-terminated per the contract.
        let key = unsafe { text(key, "key")? };
        let endpoint = if endpoint.is_null() {
            None
        } else {
            // SAFETY: NUL-terminated per the contract.
            Some(unsafe { text(endpoint, "endpoint")? })
        };
        non_null(out_handle, "out_handle")?;
        let store = a.stores.get(endpoint, bucket)?;
        let h = a.agent.open_object(&store, key)?;
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
