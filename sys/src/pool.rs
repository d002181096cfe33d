//! Shared pools through the C ABI (see the Rust `kvxfer::pool`): host
//! memory in a memory file that same-host shm peers map once and copy
//! with plain loads and stores.

use std::os::fd::BorrowedFd;

use super::kvxfer_result::*;
use super::{
    Fail, Kind, boundary, free_handle, hand_out, kvxfer_agent, kvxfer_mem_desc, kvxfer_result,
    live, non_null,
};

/// A shared pool: memory mapped shared from a memory file. Thread-safe;
/// free once, after the last call. A registration holds the memory mapped
/// until it is deregistered, even when the handle is freed first.
pub struct kvxfer_pool {
    pool: kvxfer_core::SharedPool,
}

/// Makes a zero-filled pool of `size` bytes (`memfd_create`) and writes
/// its handle to `out`.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_pool_new(size: usize, out: *mut *mut kvxfer_pool) -> kvxfer_result {
    boundary(|| {
        non_null(out, "out")?;
        let pool = kvxfer_core::SharedPool::new(size)?;
        // SAFETY: non-null and valid for a write per the contract.
        unsafe { hand_out(out, Box::new(kvxfer_pool { pool }), Kind::Pool) }
    })
}

/// Makes a pool over all of the memory file `fd` (a `memfd`, or a file
/// under `/dev/shm`, open for reading and writing; duplicated: the caller
/// keeps `fd`) and writes its handle to `out`.
///
/// # Safety
/// `fd` is an open descriptor; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_pool_from_fd(fd: i32, out: *mut *mut kvxfer_pool) -> kvxfer_result {
    boundary(|| {
        non_null(out, "out")?;
        if fd < 0 {
            return Err(Fail::new(
                KVXFER_ERR_INVALID_ARGUMENT,
                format!("bad file descriptor {fd}"),
            ));
        }
        // SAFETY: open per the contract; borrowed only to duplicate it.
        let owned = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map_err(kvxfer_core::Error::from)?;
        let pool = kvxfer_core::SharedPool::from_fd(owned)?;
        // SAFETY: non-null and valid for a write per the contract.
        unsafe { hand_out(out, Box::new(kvxfer_pool { pool }), Kind::Pool) }
    })
}

/// Writes the pool's first byte's address to `out_addr` and its size to
/// `out_len`.
///
/// # Safety
/// `out_addr` and `out_len` are valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_pool_memory(
    pool: *const kvxfer_pool,
    out_addr: *mut *mut u8,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let p = unsafe { live(pool, Kind::Pool, "pool")? };
        non_null(out_addr, "out_addr")?;
        non_null(out_len, "out_len")?;
        // SAFETY: checked non-null; valid for writes per the contract.
        unsafe {
            *out_addr = p.pool.as_ptr();
            *out_len = p.pool.len();
        }
        Ok(KVXFER_OK)
    })
}

/// Registers all of `pool` with `agent` as one host-memory region that
/// same-host shm peers map (read only when `read_only` is not 0), and
/// writes its descriptor to `out_desc` (to deregister it with
/// `kvxfer_agent_deregister_memory`, which also revokes every peer's
/// mapping before it returns).
///
/// # Safety
/// `out_desc` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_register_shared_pool(
    agent: *const kvxfer_agent,
    pool: *const kvxfer_pool,
    read_only: u32,
    out_desc: *mut kvxfer_mem_desc,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: checked against the handle table.
        let p = unsafe { live(pool, Kind::Pool, "pool")? };
        non_null(out_desc, "out_desc")?;
        let access = if read_only != 0 {
            kvxfer_core::PoolAccess::ReadOnly
        } else {
            kvxfer_core::PoolAccess::ReadWrite
        };
        let d = a.agent.register_shared_pool(&p.pool, access)?.descs[0];
        // SAFETY: checked non-null; valid for a write per the contract.
        unsafe {
            *out_desc = kvxfer_mem_desc {
                addr: d.addr,
                len: d.len,
                device_id: d.device_id,
            }
        };
        Ok(KVXFER_OK)
    })
}

/// Frees a pool handle. Its memory stays mapped while an agent still has
/// it registered. NULL is a no-op.
///
/// # Safety
/// No other call on `pool` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_pool_free(pool: *mut kvxfer_pool) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(pool, Kind::Pool, "pool") })
}
