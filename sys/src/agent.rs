//! Agents through the C ABI: making and freeing them, their descriptors
//! and connection info, loading and forgetting peers.

use std::ffi::c_char;
use std::time::Duration;

use super::kvxfer_result::*;
use super::{
    Fail, Kind, boundary, descs, free_handle, hand_out, kvxfer_agent, kvxfer_mem_desc,
    kvxfer_mem_type, kvxfer_options, kvxfer_result, live, non_null, slice, text, write_out,
};
use kvxfer_core::{AgentConfig, Backend, Error, MemoryType};

/// Creates an agent called `name` on `backend` (`"auto"`, `"tcp"`, `"shm"`,
/// `"rdma"`, `"fabric"`, or `"inproc"`: agents of this process only, each transfer a
/// copy done before `kvxfer_submit` returns),
/// with optional settings (`options` may be NULL).
///
/// # Safety
/// Strings are NUL-terminated; `options` is NULL or points at
/// `options->struct_size` readable bytes; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_new(
    name: *const c_char,
    backend: *const c_char,
    options: *const kvxfer_options,
    out: *mut *mut kvxfer_agent,
) -> kvxfer_result {
    boundary(|| {
        non_null(out, "out")?;
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { text(name, "name")? };
        // SAFETY: as above.
        let backend: Backend = unsafe { text(backend, "backend")? }.parse()?;
        let mut cfg = AgentConfig::new(name);
        if !options.is_null() {
            // SAFETY: non-null; the caller's struct holds `struct_size` bytes,
            // and we read only fields that fit in it.
            let size = unsafe { (*options).struct_size };
            let has = |end: usize| size >= end;
            let o = options;
            macro_rules! field {
                ($f:ident: $t:ty) => {{
                    let end = std::mem::offset_of!(kvxfer_options, $f) + std::mem::size_of::<$t>();
                    if has(end) {
                        // SAFETY: the field lies within the `struct_size`
                        // bytes the caller provides; no reference to the
                        // (possibly shorter) struct is formed.
                        Some(unsafe { std::ptr::addr_of!((*o).$f).read_unaligned() })
                    } else {
                        None
                    }
                }};
            }
            if let Some(p) = field!(listen: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                let s = unsafe { text(p, "options.listen")? };
                cfg = cfg.with_listen(s.parse().map_err(|e| {
                    Fail::new(
                        KVXFER_ERR_INVALID_ARGUMENT,
                        format!("options.listen {s:?}: {e}"),
                    )
                })?);
            }
            if let Some(p) = field!(advertise: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                cfg = cfg.with_advertise(unsafe { text(p, "options.advertise")? });
            }
            if let Some(n) = field!(streams_per_peer: u32).filter(|&n| n > 0) {
                cfg = cfg.with_streams_per_peer(n as usize);
            }
            if let Some(ms) = field!(io_timeout_ms: u32).filter(|&n| n > 0) {
                cfg = cfg.with_io_timeout(Duration::from_millis(ms.into()));
            }
            if let Some(ms) = field!(connect_timeout_ms: u32).filter(|&n| n > 0) {
                cfg = cfg.with_connect_timeout(Duration::from_millis(ms.into()));
            }
            if let Some(n) = field!(rdma_qps_per_peer: u32).filter(|&n| n > 0) {
                cfg = cfg.with_rdma_qps_per_peer(n as usize);
            }
            if let Some(n) = field!(rdma_ack_timeout: u32).filter(|&n| n > 0) {
                // Out of range (including > 255): the agent's validation
                // names the field.
                cfg = cfg.with_rdma_ack_timeout(u8::try_from(n).unwrap_or(u8::MAX));
            }
            if let Some(n) = field!(rdma_no_shared_receive_queue: u32) {
                cfg = cfg.with_rdma_srq(n == 0);
            }
            if let Some(p) = field!(secret_file: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                let path = unsafe { text(p, "options.secret_file")? };
                cfg = cfg.with_credential(
                    kvxfer_core::Credential::from_file(path).map_err(Error::from)?,
                );
            }
            if let Some(n) = field!(insecure: u32) {
                cfg = cfg.with_insecure(n != 0);
            }
            if let Some(p) = field!(require_dram_transport: *const c_char).filter(|p| !p.is_null())
            {
                // SAFETY: NUL-terminated per the contract.
                let t = unsafe { text(p, "options.require_dram_transport")? };
                let kind: kvxfer_core::TransportKind =
                    t.parse().map_err(kvxfer_core::Error::from)?;
                cfg = cfg.with_required_transport(MemoryType::Dram, kind);
            }
            if let Some(p) = field!(etcd_endpoints: *const c_char).filter(|p| !p.is_null()) {
                // SAFETY: NUL-terminated per the contract.
                let eps = unsafe { text(p, "options.etcd_endpoints")? };
                let mut etcd = kvxfer_core::EtcdConfig::new(eps.split(',').map(str::trim));
                if let Some(p) = field!(etcd_prefix: *const c_char).filter(|p| !p.is_null()) {
                    // SAFETY: NUL-terminated per the contract.
                    etcd = etcd.with_prefix(unsafe { text(p, "options.etcd_prefix")? });
                }
                if let Some(s) = field!(etcd_lease_ttl_s: u32).filter(|&s| s > 0) {
                    etcd = etcd.with_lease_ttl(Duration::from_secs(s.into()));
                }
                if let Some(p) = field!(etcd_ca_file: *const c_char).filter(|p| !p.is_null()) {
                    // SAFETY: NUL-terminated per the contract.
                    let mut tls =
                        kvxfer_core::EtcdTls::new(unsafe { text(p, "options.etcd_ca_file")? });
                    let cert = field!(etcd_cert_file: *const c_char).filter(|p| !p.is_null());
                    let key = field!(etcd_key_file: *const c_char).filter(|p| !p.is_null());
                    if let (Some(c), Some(k)) = (cert, key) {
                        // SAFETY: NUL-terminated per the contract.
                        let (c, k) = unsafe {
                            (
                                text(c, "options.etcd_cert_file")?,
                                text(k, "options.etcd_key_file")?,
                            )
                        };
                        tls = tls.with_client_cert(c, k);
                    }
                    etcd = etcd.with_tls(tls);
                }
                cfg = cfg.with_etcd(etcd);
            }
        }
        let agent = kvxfer_core::make_transfer_agent(backend, cfg)?;
        // SAFETY: `out` was checked non-null and is valid for a write.
        unsafe {
            hand_out(
                out,
                Box::new(kvxfer_agent {
                    agent: agent.into(),
                    stores: Default::default(),
                }),
                Kind::Agent,
            )
        }
    })
}

/// Destroys an agent: closes its connections, fails its transfers in
/// flight, joins its threads. NULL is a no-op.
///
/// # Safety
/// No other call on `agent` may run concurrently or follow.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_free(agent: *mut kvxfer_agent) -> kvxfer_result {
    // SAFETY: see `free_handle`.
    boundary(|| unsafe { free_handle(agent, Kind::Agent, "agent") })
}

/// Writes the encoded local agent descriptor into `buf` and its length to
/// `out_len` (also when the buffer is too small: call with `cap = 0` to
/// learn the size).
///
/// # Safety
/// `buf` is valid for `cap` writes (or NULL); `out_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_local_desc(
    agent: *const kvxfer_agent,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        let bytes = a.agent.local_agent_desc().encode();
        // SAFETY: forwarded contract.
        unsafe { write_out(&bytes, false, buf, cap, out_len) }
    })
}

/// Loads a remote agent from an encoded descriptor; writes its name
/// (NUL-terminated) to `name_buf` when that is non-NULL. When `name_buf`
/// is too small nothing is loaded: the call returns
/// `KVXFER_ERR_BUFFER_TOO_SMALL` with the name's length in `name_len`.
///
/// # Safety
/// `desc` is valid for `len` reads; `name_buf` is NULL or valid for
/// `name_cap` writes; `name_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_load_remote(
    agent: *const kvxfer_agent,
    desc: *const u8,
    len: usize,
    name_buf: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: `desc` is valid for `len` reads.
        let bytes = unsafe { slice(desc, len, "desc")? };
        let d = kvxfer_core::AgentDesc::decode(bytes).map_err(Error::from)?;
        name_fits(&d.name, name_buf, name_cap, name_len)?;
        a.agent.load_remote_agent(&d)?;
        // SAFETY: forwarded contract.
        unsafe { name_out(&d.name, name_buf, name_cap, name_len) }
    })
}

/// Finds the agent `name` in the metadata store (`options.etcd_endpoints`
/// or `KVXFER_ETCD`), fetches its descriptor from it and loads it; watched
/// from then on (its requests fail with `KVXFER_ERR_PEER_GONE` once it
/// leaves the store, and it is resolved again on the next request).
///
/// # Safety
/// `name` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_load_remote_by_name(
    agent: *const kvxfer_agent,
    name: *const c_char,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { text(name, "name")? };
        a.agent.load_remote_agent_by_name(name)?;
        Ok(KVXFER_OK)
    })
}

/// Fails with `KVXFER_ERR_BUFFER_TOO_SMALL` (the length in `len`) when
/// `name` and its NUL do not fit a non-NULL `buf` of `cap` bytes: checked
/// before anything is done, so a too-small buffer changes nothing.
fn name_fits(name: &str, buf: *mut c_char, cap: usize, len: *mut usize) -> Result<(), Fail> {
    if buf.is_null() || cap > name.len() {
        return Ok(());
    }
    if !len.is_null() {
        // SAFETY: non-null and valid per the callers' contract.
        unsafe { *len = name.len() };
    }
    Err(Fail::new(
        KVXFER_ERR_BUFFER_TOO_SMALL,
        format!(
            "the name needs {} bytes, buffer has {cap}; nothing was loaded",
            name.len() + 1
        ),
    ))
}

/// Writes the agent name an encoded descriptor carries (NUL-terminated),
/// without loading it.
///
/// # Safety
/// `desc` is valid for `len` reads; `name_buf` is NULL or valid for
/// `name_cap` writes; `name_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_desc_name(
    desc: *const u8,
    len: usize,
    name_buf: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: `desc` is valid for `len` reads.
        let bytes = unsafe { slice(desc, len, "desc")? };
        let d = kvxfer_core::AgentDesc::decode(bytes).map_err(Error::from)?;
        // SAFETY: forwarded contract.
        unsafe { name_out(&d.name, name_buf, name_cap, name_len) }
    })
}

/// Fetches a remote agent's encoded descriptor from its connection info
/// (`host:port`) without loading it; `kvxfer_agent_load_remote` loads it.
/// Writes the needed length to `out_len` (with `KVXFER_ERR_BUFFER_TOO_SMALL`
/// when `buf` is NULL or smaller).
///
/// # Safety
/// `connection_info` is NUL-terminated; `buf` is NULL or valid for `cap`
/// writes; `out_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_fetch_remote_desc(
    agent: *const kvxfer_agent,
    connection_info: *const c_char,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let info = unsafe { text(connection_info, "connection_info")? };
        let d = a.agent.fetch_remote_agent_desc(info)?;
        // SAFETY: forwarded contract.
        unsafe { write_out(&d.encode(), false, buf, cap, out_len) }
    })
}

/// # Safety
/// As `write_out`; a NULL `buf` means "not wanted".
unsafe fn name_out(
    name: &str,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> Result<kvxfer_result, Fail> {
    if buf.is_null() {
        if !len.is_null() {
            // SAFETY: non-null and valid per the contract.
            unsafe { *len = name.len() };
        }
        return Ok(KVXFER_OK);
    }
    // SAFETY: forwarded contract.
    unsafe { write_out(name.as_bytes(), true, buf.cast(), cap, len) }
}

/// Fetches a remote agent's descriptor from its connection info
/// (`host:port`) and loads it; writes its name as `kvxfer_agent_load_remote`
/// (a too-small `name_buf` loads nothing).
///
/// # Safety
/// As `kvxfer_agent_load_remote`; `connection_info` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_load_remote_by_connection(
    agent: *const kvxfer_agent,
    connection_info: *const c_char,
    name_buf: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let info = unsafe { text(connection_info, "connection_info")? };
        let d = a.agent.fetch_remote_agent_desc(info)?;
        name_fits(&d.name, name_buf, name_cap, name_len)?;
        a.agent.load_remote_agent(&d)?;
        // SAFETY: forwarded contract.
        unsafe { name_out(&d.name, name_buf, name_cap, name_len) }
    })
}

/// Forgets a remote agent; its transfers in flight fail.
///
/// # Safety
/// `name` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_invalidate_remote(
    agent: *const kvxfer_agent,
    name: *const c_char,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        // SAFETY: NUL-terminated per the contract.
        let name = unsafe { text(name, "name")? };
        a.agent.invalidate_remote_agent(name)?;
        Ok(KVXFER_OK)
    })
}

/// Writes the agent's connection info (`host:port`, NUL-terminated).
///
/// # Safety
/// `buf` is valid for `cap` writes (or NULL); `out_len` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_connection_info(
    agent: *const kvxfer_agent,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        let info = a.agent.local_connection_info();
        // SAFETY: forwarded contract.
        unsafe { write_out(info.as_bytes(), true, buf.cast(), cap, out_len) }
    })
}

/// Whether every descriptor lies in a region `remote` exported (false for
/// an unknown agent), written to `*out`.
///
/// # Safety
/// `remote` is NUL-terminated; `descs` is valid for `count` reads; `out` is
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvxfer_agent_check_remote_descs(
    agent: *const kvxfer_agent,
    remote: *const c_char,
    mem_type: kvxfer_mem_type,
    descs: *const kvxfer_mem_desc,
    count: usize,
    out: *mut bool,
) -> kvxfer_result {
    boundary(|| {
        // SAFETY: checked against the handle table.
        let a = unsafe { live(agent, Kind::Agent, "agent")? };
        non_null(out, "out")?;
        // SAFETY: NUL-terminated per the contract.
        let remote = unsafe { text(remote, "remote")? };
        // SAFETY: valid for `count` reads.
        let d = unsafe { self::descs(mem_type, descs, count, "descs")? };
        let ok = a.agent.check_remote_descs(remote, &d);
        // SAFETY: non-null and valid for a write.
        unsafe { *out = ok };
        Ok(KVXFER_OK)
    })
}
