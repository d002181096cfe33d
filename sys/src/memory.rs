//! Registering memory through the C ABI.

use super::kvxfer_result::*;
use super::{
    Kind, boundary, descs, kvxfer_agent, kvxfer_mem_desc, kvxfer_mem_type, kvxfer_result, live,
};

/// Registers `count` descriptors of type `mem_type` (all or none).
///
/// # Safety
/// `descs` is valid for `count` reads. Every range must stay allocated
/// while registered, and not be accessed by the caller while a transfer
/// that names it is in flight.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_register_memory(
    agent: *const kvxfer_agent,
    mem_type: kvxfer_mem_type,
    descs: *const kvxfer_mem_desc,
    count: usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: `descs` is valid for `count` reads.
        let d = unsafe { self::descs(mem_type, descs, count, "descs")? };
        // SAFETY: the caller upholds the registration contract above.
        unsafe { a.agent.register_memory(&d)? };
        Ok(KVXFER_OK)
    })
}

/// Deregisters descriptors, each exactly as registered (all or none).
///
/// # Safety
/// `descs` is valid for `count` reads.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_deregister_memory(
    agent: *const kvxfer_agent,
    mem_type: kvxfer_mem_type,
    descs: *const kvxfer_mem_desc,
    count: usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: `descs` is valid for `count` reads.
        let d = unsafe { self::descs(mem_type, descs, count, "descs")? };
        a.agent.deregister_memory(&d)?;
        Ok(KVXFER_OK)
    })
}
