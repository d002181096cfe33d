//! The endpoint of an agent's libfabric transport and everything under it:
//! the provider and domain chosen (`fi_getinfo`), the fabric, domain,
//! completion queue, address vector and the reliable-datagram endpoint
//! itself, opened and closed together.

use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::RwLock;

use kvxfer_fabric as ffi;

use super::{FabricError, check};

/// The libfabric API version asked for: 1.11 (`fi_mr_attr::iface`).
const API_VERSION: u32 = (1 << 16) | 11;

/// The memory-registration modes this transport honours.
const MR_MODES: u64 = (ffi::FI_MR_LOCAL
    | ffi::FI_MR_VIRT_ADDR
    | ffi::FI_MR_ALLOCATED
    | ffi::FI_MR_PROV_KEY
    | ffi::FI_MR_ENDPOINT
    | ffi::FI_MR_HMEM) as u64;

/// The endpoint and everything under it, closed in reverse order of
/// opening: endpoint, address vector, completion queue, domain, fabric;
/// the `fi_info` they were opened from is freed last. Registrations hold an
/// `Arc` of it, so the domain outlives them.
pub(super) struct Endpoint {
    info: *mut ffi::fi_info,
    fabric: *mut ffi::fid_fabric,
    pub(super) domain: *mut ffi::fid_domain,
    pub(super) cq: *mut ffi::fid_cq,
    av: *mut ffi::fid_av,
    ep: *mut ffi::fid_ep,
    /// The provider's registration modes (of [`MR_MODES`]).
    pub(super) mr_mode: u64,
    /// Whether the completion queue has a wait object (`fi_cq_sread`).
    pub(super) waits: bool,
    /// Whether `ep` is still open: read-locked by every call on it (posting,
    /// its name, binding a registration), write-locked to close it early
    /// ([`close_ep`](Self::close_ep)).
    live: RwLock<bool>,
}

// SAFETY: the domain is opened with FI_THREAD_SAFE: every object under it
// may be used from any thread at once.
unsafe impl Send for Endpoint {}
// SAFETY: as above.
unsafe impl Sync for Endpoint {}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close_ep();
        // SAFETY: each object was opened once by `Endpoint::open`, is closed
        // once here (the endpoint by `close_ep`), children before parents;
        // nothing uses them any more (registrations and links hold this
        // value).
        unsafe {
            for f in [
                self.av.cast::<ffi::fid>(),
                self.cq.cast(),
                self.domain.cast(),
                self.fabric.cast(),
            ] {
                if !f.is_null() {
                    ffi::fi_close(f);
                }
            }
            if !self.info.is_null() {
                ffi::fi_freeinfo(self.info);
            }
        }
    }
}

/// The fields of an `fi_info` this transport reads.
pub(super) struct Found {
    pub(super) provider: String,
    pub(super) domain: String,
    pub(super) mr_mode: u64,
    pub(super) hmem: bool,
    pub(super) max_msg: u64,
    pub(super) tx_size: usize,
}

impl Found {
    /// Whether `a` and `b` are of one provider with the same registration
    /// modes (the rails of one agent must be).
    pub(super) fn same_kind(a: &Self, b: &Self) -> bool {
        a.provider == b.provider && a.mr_mode == b.mr_mode
    }
}

/// The `fi_info` list of reliable-datagram endpoints with RMA (`provider`
/// and `domain`: by name; `hmem`: on device memory too), for the caller to
/// free with `fi_freeinfo`.
fn getinfo(
    provider: Option<&CStr>,
    domain: Option<&CStr>,
    hmem: bool,
) -> Result<*mut ffi::fi_info, FabricError> {
    // The first call into libfabric on every path: loads it.
    ffi::load().map_err(FabricError::Unloaded)?;
    // SAFETY: plain libfabric calls; the hints are allocated by fi_dupinfo
    // (of nothing) and freed below, the strings put in them duplicated with
    // strdup (fi_freeinfo frees them).
    unsafe {
        let hints = ffi::fi_dupinfo(ptr::null());
        if hints.is_null() {
            return Err(FabricError::Call {
                call: "fi_dupinfo",
                code: 12,
                text: "out of memory".into(),
            });
        }
        let h = &mut *hints;
        (*h.ep_attr).type_ = ffi::fi_ep_type_FI_EP_RDM;
        h.caps = u64::from(
            ffi::FI_RMA | ffi::FI_READ | ffi::FI_WRITE | ffi::FI_REMOTE_READ | ffi::FI_REMOTE_WRITE,
        );
        if hmem {
            h.caps |= ffi::FI_HMEM;
        }
        // Operation contexts are ours (see `link::OpCtx`), with room for
        // providers that need some.
        h.mode = ffi::FI_CONTEXT | ffi::FI_CONTEXT2;
        (*h.domain_attr).mr_mode = MR_MODES as i32;
        (*h.domain_attr).threading = ffi::fi_threading_FI_THREAD_SAFE;
        // No ordering asked for: the notification waits for delivery.
        (*h.tx_attr).msg_order = u64::from(ffi::FI_ORDER_NONE);
        (*h.tx_attr).op_flags = u64::from(ffi::FI_DELIVERY_COMPLETE);
        if let Some(p) = provider {
            (*h.fabric_attr).prov_name = libc::strdup(p.as_ptr());
        }
        if let Some(d) = domain {
            (*h.domain_attr).name = libc::strdup(d.as_ptr());
        }
        let mut info = ptr::null_mut();
        let rc = ffi::fi_getinfo(API_VERSION, ptr::null(), ptr::null(), 0, hints, &mut info);
        ffi::fi_freeinfo(hints);
        check("fi_getinfo", i64::from(rc))?;
        if info.is_null() {
            return Err(FabricError::Call {
                call: "fi_getinfo",
                code: 61,
                text: "no provider with reliable-datagram endpoints and RMA".into(),
            });
        }
        Ok(info)
    }
}

/// The provider and domain names of each entry of `list` (an `fi_info`
/// list from [`getinfo`], freed here), in order; never empty.
fn names_of(list: *mut ffi::fi_info) -> Vec<(CString, CString)> {
    let mut names = Vec::new();
    // SAFETY: a list fi_getinfo returned, every entry's attributes set;
    // read, then freed once.
    unsafe {
        let mut i = list;
        while !i.is_null() {
            names.push((
                CStr::from_ptr((*(*i).fabric_attr).prov_name).to_owned(),
                CStr::from_ptr((*(*i).domain_attr).name).to_owned(),
            ));
            i = (*i).next;
        }
        ffi::fi_freeinfo(list);
    }
    names
}

/// The first entry of `list` (from [`getinfo`], freed here) on provider
/// `provider` and domain `domain`, alone (for the caller to free): a
/// provider may list other domains than the one asked for.
fn entry_of(
    list: *mut ffi::fi_info,
    provider: &CStr,
    domain: &CStr,
) -> Result<*mut ffi::fi_info, FabricError> {
    // SAFETY: a list fi_getinfo returned, every entry's attributes set;
    // the entry taken is duplicated before the list is freed (once).
    unsafe {
        let mut i = list;
        while !i.is_null()
            && (CStr::from_ptr((*(*i).fabric_attr).prov_name) != provider
                || CStr::from_ptr((*(*i).domain_attr).name) != domain)
        {
            i = (*i).next;
        }
        let one = if i.is_null() {
            ptr::null_mut()
        } else {
            ffi::fi_dupinfo(i)
        };
        ffi::fi_freeinfo(list);
        if one.is_null() {
            return Err(FabricError::Call {
                call: "fi_getinfo",
                code: 61,
                text: format!("provider {provider:?} lists no domain {domain:?}"),
            });
        }
        Ok(one)
    }
}

/// Makes `ip` the source address of the endpoints opened with `info`
/// (its provider's addresses being IP socket addresses of `ip`'s family,
/// and `ip` a specific one), so the endpoint listens where the agent does
/// and nowhere else: an agent on loopback is not reachable through its
/// provider from the host's other interfaces. Otherwise leaves it.
///
/// # Safety
/// `info` is an entry `fi_getinfo` or `fi_dupinfo` returned, not yet used
/// to open anything; its `src_addr` was allocated with `malloc` (freed by
/// `fi_freeinfo`).
unsafe fn bind_source(info: *mut ffi::fi_info, ip: std::net::IpAddr) {
    if ip.is_unspecified() {
        return;
    }
    // SAFETY: `info` is valid (contract).
    let i = unsafe { &mut *info };
    let format = i.addr_format;
    let bytes: Vec<u8> = match ip {
        std::net::IpAddr::V4(v4) if format == ffi::FI_SOCKADDR_IN || format == ffi::FI_SOCKADDR => {
            let sa = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a plain C struct, read as its bytes.
            unsafe { as_bytes(&sa) }
        }
        std::net::IpAddr::V6(v6)
            if format == ffi::FI_SOCKADDR_IN6 || format == ffi::FI_SOCKADDR =>
        {
            let sa = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: 0,
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: as above.
            unsafe { as_bytes(&sa) }
        }
        _ => return,
    };
    // SAFETY: a fresh allocation of the address's size, filled below;
    // `fi_freeinfo` frees it with `free`, as it frees the one replaced.
    unsafe {
        let fresh = libc::malloc(bytes.len()).cast::<u8>();
        if fresh.is_null() {
            return;
        }
        ptr::copy_nonoverlapping(bytes.as_ptr(), fresh, bytes.len());
        libc::free(i.src_addr);
        i.src_addr = fresh.cast();
        i.src_addrlen = bytes.len();
    }
    tracing::debug!(%ip, "libfabric endpoint bound where the agent listens");
}

/// The bytes of a plain C struct.
///
/// # Safety
/// `T` has no padding whose bytes are uninitialised that matters to the
/// reader (the socket address structs, zeroed in full here).
unsafe fn as_bytes<T>(v: &T) -> Vec<u8> {
    // SAFETY: `v` is a live `T` of `size_of::<T>()` bytes (contract).
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

/// Which of a provider's `domains` (in order) is RDMA device `device`'s:
/// the one named after it (`verbs`: `mlx5_0`), or after it with a suffix
/// of the endpoint type (`efa`: `rdmap16s27-rdm`).
fn domain_of_device<'a>(domains: impl IntoIterator<Item = &'a str>, device: &str) -> Option<usize> {
    domains.into_iter().position(|d| {
        d == device
            || d.strip_prefix(device)
                .is_some_and(|rest| rest.starts_with('-'))
    })
}

/// The domains of `domains` (one provider's, in order) of RDMA devices
/// `nics`, in `nics`' order, each once: the rails of an agent whose GPU has
/// several NICs under its PCIe switch (devices without a domain of the
/// provider are left out).
fn domains_of_devices<'a>(domains: &[&'a str], nics: &[String]) -> Vec<&'a str> {
    let mut rails: Vec<&str> = Vec::new();
    for nic in nics {
        if let Some(i) = domain_of_device(domains.iter().copied(), nic)
            && !rails.contains(&domains[i])
        {
            rails.push(domains[i]);
        }
    }
    rails
}

/// `v` (a provider's or domain's name: `what`) as a C string, if given.
fn c_name(what: &'static str, v: Option<&str>) -> Result<Option<CString>, FabricError> {
    v.map(CString::new)
        .transpose()
        .map_err(|_| FabricError::Call {
            call: what,
            code: 0,
            text: "contains a NUL byte".into(),
        })
}

/// Opens the endpoint's completion queue; whether it has a wait object
/// that blocks (`fi_cq_sread` sleeps until the provider signals it). A
/// wait object that only spins (`FI_WAIT_YIELD`, all `shm` offers: its
/// peers cannot wake a process), or one that does not say what it is,
/// would keep a core busy for as long as the agent lives; the queue is
/// then opened without one, and the progress thread polls it while there
/// is something to poll for and parks otherwise (see `progress::progress`).
///
/// # Safety
/// `domain` is an open domain.
unsafe fn open_cq(domain: *mut ffi::fid_domain) -> Result<(*mut ffi::fid_cq, bool), FabricError> {
    let open = |wait_obj| {
        let mut attr = ffi::fi_cq_attr {
            size: 4096,
            format: ffi::fi_cq_format_FI_CQ_FORMAT_CONTEXT,
            wait_obj,
            ..Default::default()
        };
        let mut cq = ptr::null_mut();
        // SAFETY: `domain` is open (the caller's promise); `cq` receives the
        // queue.
        let rc = unsafe { ffi::fi_cq_open(domain, &mut attr, &mut cq, ptr::null_mut()) };
        (rc, cq)
    };
    let (rc, cq) = open(ffi::fi_wait_obj_FI_WAIT_UNSPEC);
    if rc == 0 {
        let mut obj = ffi::fi_wait_obj_FI_WAIT_NONE;
        // SAFETY: `cq` was just opened; FI_GETWAITOBJ writes one
        // `enum fi_wait_obj`.
        let rc = unsafe {
            ffi::fi_control(
                &mut (*cq).fid,
                ffi::FI_GETWAITOBJ as i32,
                (&raw mut obj).cast(),
            )
        };
        // A wait object that does not say what it is (libfabric's spinning
        // one answers nothing) is taken for one that spins.
        if rc == 0 && obj != ffi::fi_wait_obj_FI_WAIT_YIELD && obj != ffi::fi_wait_obj_FI_WAIT_NONE
        {
            return Ok((cq, true));
        }
        // SAFETY: opened above, used by nothing yet.
        unsafe { ffi::fi_close(&mut (*cq).fid) };
    }
    // No wait object, or one that spins: the progress thread polls.
    let (rc, cq) = open(ffi::fi_wait_obj_FI_WAIT_NONE);
    check("fi_cq_open", i64::from(rc))?;
    Ok((cq, false))
}

impl Endpoint {
    /// The domains of RDMA devices `nics` on `provider` (by name, else the
    /// first with reliable-datagram endpoints and RMA), in `nics`' order
    /// (see `domains_of_devices`).
    pub(super) fn domains_near(
        provider: Option<&str>,
        nics: &[String],
    ) -> Result<Vec<String>, FabricError> {
        let prov = c_name("provider name", provider)?;
        let entries = names_of(getinfo(prov.as_deref(), None, false)?);
        let first = &entries[0].0;
        let domains: Vec<&str> = entries
            .iter()
            .filter(|(p, _)| p == first)
            .map(|(_, d)| d.to_str().unwrap_or(""))
            .collect();
        Ok(domains_of_devices(&domains, nics)
            .into_iter()
            .map(str::to_owned)
            .collect())
    }

    /// Finds a provider with reliable-datagram endpoints and RMA (`provider`
    /// and `domain`: by name; `near`: without a domain named, the domain of
    /// that RDMA device if the provider has one) and opens an endpoint on
    /// it.
    ///
    /// `bind`: the address the agent listens on; a socket provider (`tcp`,
    /// `sockets`, under `ofi_rxm` or not) binds its endpoint there (see
    /// [`bind_source`]).
    pub(super) fn open(
        provider: Option<&str>,
        domain: Option<&str>,
        near: Option<&str>,
        bind: Option<std::net::IpAddr>,
    ) -> Result<(Self, Found), FabricError> {
        let mut ep = Endpoint {
            info: ptr::null_mut(),
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            cq: ptr::null_mut(),
            av: ptr::null_mut(),
            ep: ptr::null_mut(),
            mr_mode: 0,
            waits: false,
            live: RwLock::new(true),
        };
        let prov = c_name("provider name", provider)?;
        let dom = c_name("domain name", domain)?;
        // The provider and domain are chosen for host memory (asking for
        // device memory too could pass over the first provider for one that
        // moves it but not between hosts); then the same ones are asked
        // for device memory (FI_HMEM), and taken with it when they move it.
        let entries = names_of(getinfo(prov.as_deref(), dom.as_deref(), false)?);
        // The domains of the first provider that has the domain named (if
        // one is: some providers list others too, whatever the hint): the
        // one of the device nearest the GPU when asked for and there, else
        // the first.
        let named = |i: &usize| dom.as_ref().is_none_or(|d| &entries[*i].1 == d);
        let Some(first) = (0..entries.len()).find(named).map(|i| &entries[i].0) else {
            return Err(FabricError::Call {
                call: "fi_getinfo",
                code: 61,
                text: format!("no provider has a domain named {dom:?}"),
            });
        };
        let domains: Vec<usize> = (0..entries.len())
            .filter(|i| &entries[*i].0 == first && named(i))
            .collect();
        let nearest = near.and_then(|nic| {
            let names = domains.iter().map(|&i| entries[i].1.to_str().unwrap_or(""));
            domain_of_device(names, nic).map(|k| domains[k])
        });
        let (p, d) = &entries[nearest.unwrap_or(domains[0])];
        if let Some(nic) = near {
            if nearest.is_some() {
                tracing::info!(provider = ?p, domain = ?d, device = nic, "libfabric domain of the RDMA device nearest the GPU");
            } else {
                tracing::info!(provider = ?p, domain = ?d, device = nic, "no libfabric domain of the RDMA device nearest the GPU; the provider's first");
            }
        }
        let info = match getinfo(Some(p), Some(d), true).and_then(|l| entry_of(l, p, d)) {
            Ok(hmem) => hmem,
            Err(e) => {
                tracing::debug!(error = %e, provider = ?p, "the provider does not move device memory (FI_HMEM)");
                entry_of(getinfo(Some(p), Some(d), false)?, p, d)?
            }
        };
        // SAFETY: plain libfabric calls on the objects opened here, each
        // kept in `ep` (closed by its drop, children first).
        unsafe {
            ep.info = info;
            // Socket providers only: an RDMA provider's IP address is its
            // device's, which the agent's listening address need not be.
            let sockets = CStr::from_ptr((*(*info).fabric_attr).prov_name)
                .to_string_lossy()
                .split(';')
                .any(|p| p == "tcp" || p == "sockets");
            if let Some(ip) = bind.filter(|_| sockets) {
                bind_source(info, ip);
            }
            let i = &*info;
            let found = Found {
                provider: CStr::from_ptr((*i.fabric_attr).prov_name)
                    .to_string_lossy()
                    .into_owned(),
                domain: CStr::from_ptr((*i.domain_attr).name)
                    .to_string_lossy()
                    .into_owned(),
                mr_mode: (*i.domain_attr).mr_mode as u64 & MR_MODES,
                hmem: i.caps & ffi::FI_HMEM != 0,
                max_msg: ((*i.ep_attr).max_msg_size as u64).max(4096),
                tx_size: (*i.tx_attr).size.max(1),
            };
            ep.mr_mode = found.mr_mode;
            check(
                "fi_fabric",
                i64::from(ffi::fi_fabric(
                    i.fabric_attr,
                    &mut ep.fabric,
                    ptr::null_mut(),
                )),
            )?;
            check(
                "fi_domain",
                i64::from(ffi::fi_domain(
                    ep.fabric,
                    info,
                    &mut ep.domain,
                    ptr::null_mut(),
                )),
            )?;
            (ep.cq, ep.waits) = open_cq(ep.domain)?;
            let mut av_attr = ffi::fi_av_attr {
                type_: ffi::fi_av_type_FI_AV_TABLE,
                ..Default::default()
            };
            check(
                "fi_av_open",
                i64::from(ffi::fi_av_open(
                    ep.domain,
                    &mut av_attr,
                    &mut ep.av,
                    ptr::null_mut(),
                )),
            )?;
            check(
                "fi_endpoint",
                i64::from(ffi::fi_endpoint(
                    ep.domain,
                    info,
                    &mut ep.ep,
                    ptr::null_mut(),
                )),
            )?;
            check(
                "fi_ep_bind(cq)",
                i64::from(ffi::fi_ep_bind(
                    ep.ep,
                    &mut (*ep.cq).fid,
                    u64::from(ffi::FI_TRANSMIT | ffi::FI_RECV),
                )),
            )?;
            check(
                "fi_ep_bind(av)",
                i64::from(ffi::fi_ep_bind(ep.ep, &mut (*ep.av).fid, 0)),
            )?;
            check("fi_enable", i64::from(ffi::fi_enable(ep.ep)))?;
            Ok((ep, found))
        }
    }

    /// `f` of the endpoint object, unless it has been closed.
    pub(super) fn with_ep<R>(
        &self,
        f: impl FnOnce(*mut ffi::fid_ep) -> R,
    ) -> Result<R, FabricError> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        if *live {
            Ok(f(self.ep))
        } else {
            Err(FabricError::Closed)
        }
    }

    /// Closes the endpoint object (once; its queue, address vector and
    /// domain stay open): the provider moves nothing more of the
    /// operations it had under way, and reports none of them.
    pub(super) fn close_ep(&self) {
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        if std::mem::replace(&mut *live, false) && !self.ep.is_null() {
            // SAFETY: opened once by `Endpoint::open`, closed once here,
            // while no call on it runs (`live` is write-locked).
            unsafe { ffi::fi_close(self.ep.cast::<ffi::fid>()) };
        }
    }

    /// The endpoint's address, as peers insert it into their address
    /// vectors.
    pub(super) fn name(&self) -> Result<Vec<u8>, FabricError> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: `buf` has `len` bytes; the endpoint is open (`with_ep`).
        let rc = self.with_ep(|ep| unsafe {
            ffi::fi_getname(&mut (*ep).fid, buf.as_mut_ptr().cast(), &mut len)
        })?;
        check("fi_getname", i64::from(rc))?;
        buf.truncate(len);
        Ok(buf)
    }

    /// Inserts a peer's address; its handle in the address vector.
    pub(super) fn insert(&self, name: &[u8]) -> Result<ffi::fi_addr_t, FabricError> {
        let mut addr: ffi::fi_addr_t = 0;
        // SAFETY: `name` is an address of this provider's format (checked by
        // the provider); one entry, written to `addr`.
        let n = unsafe {
            ffi::fi_av_insert(
                self.av,
                name.as_ptr().cast(),
                1,
                &mut addr,
                0,
                ptr::null_mut(),
            )
        };
        if n != 1 {
            return Err(FabricError::Call {
                call: "fi_av_insert",
                code: i64::from(n.min(0).unsigned_abs()),
                text: "the peer's address was not inserted".into(),
            });
        }
        Ok(addr)
    }

    /// Removes a peer's address.
    pub(super) fn remove(&self, mut addr: ffi::fi_addr_t) {
        // SAFETY: `addr` was inserted by `insert` and is removed once.
        unsafe { ffi::fi_av_remove(self.av, &mut addr, 1, 0) };
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("mr_mode", &self.mr_mode)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket provider's endpoint listens where the agent does: on
    /// loopback for an agent on loopback, whatever interface the provider
    /// would pick first.
    #[test]
    fn a_socket_providers_endpoint_is_bound_where_the_agent_listens() {
        let lo = std::net::IpAddr::from([127, 0, 0, 1]);
        let (ep, _) = Endpoint::open(Some("tcp;ofi_rxm"), None, None, Some(lo)).unwrap();
        let name = ep.name().unwrap();
        eprintln!("bound: {name:?}");
        assert!(name.len() >= 8, "{name:?}");
        assert_eq!(
            u16::from_ne_bytes([name[0], name[1]]),
            libc::AF_INET as u16,
            "{name:?}"
        );
        assert_eq!(name[4..8], [127, 0, 0, 1], "{name:?}");
        let (ep, _) = Endpoint::open(Some("tcp;ofi_rxm"), None, None, None).unwrap();
        eprintln!("unbound: {:?}", ep.name().unwrap());
        // Not a socket address family: left as the provider has it.
        let (ep, _) = Endpoint::open(Some("shm"), None, None, Some(lo)).unwrap();
        assert!(ep.name().is_ok());
    }

    #[test]
    fn a_queue_whose_wait_only_spins_is_opened_without_one() {
        // shm's wait object spins (FI_WAIT_YIELD): blocking in it would
        // keep a core busy for as long as the agent lives.
        let (ep, _) = Endpoint::open(Some("shm"), None, None, None).unwrap();
        assert!(!ep.waits);
        // tcp;ofi_rxm's is a file descriptor its sockets wake.
        let (ep, _) = Endpoint::open(Some("tcp;ofi_rxm"), None, None, None).unwrap();
        assert!(ep.waits);
    }

    #[test]
    fn device_memory_is_asked_of_the_provider_chosen_for_host_memory() {
        // shm moves device memory (FI_HMEM) and then requires FI_MR_HMEM:
        // its registrations name their memory's interface.
        let (ep, found) = Endpoint::open(Some("shm"), None, None, None).unwrap();
        assert!(found.hmem);
        assert_eq!(found.provider, "shm");
        assert_ne!(
            ep.mr_mode & u64::from(ffi::FI_MR_HMEM),
            0,
            "{:#x}",
            ep.mr_mode
        );
        // tcp;ofi_rxm does not: it is opened without, rather than passed
        // over for a provider that does.
        let (ep, found) = Endpoint::open(Some("tcp;ofi_rxm"), None, None, None).unwrap();
        assert!(!found.hmem);
        assert_eq!(found.provider, "tcp;ofi_rxm");
        assert_eq!(ep.mr_mode & u64::from(ffi::FI_MR_HMEM), 0);
    }

    #[test]
    fn the_nearest_devices_domain_is_found_by_its_name() {
        // verbs names a domain after its device; efa adds the endpoint type.
        assert_eq!(domain_of_device(["mlx5_0", "mlx5_1"], "mlx5_1"), Some(1));
        assert_eq!(
            domain_of_device(["rdmap16s27-rdm", "rdmap79s0-rdm"], "rdmap79s0"),
            Some(1)
        );
        // A longer name is another device, and tcp's domains are interfaces.
        assert_eq!(domain_of_device(["mlx5_10", "mlx5_1"], "mlx5_1"), Some(1));
        assert_eq!(domain_of_device(["mlx5_10"], "mlx5_1"), None);
        assert_eq!(domain_of_device(["lo", "eth0"], "mlx5_0"), None);
    }

    #[test]
    fn the_domains_of_several_near_devices_are_rails() {
        let domains = [
            "rdmap16s27-rdm",
            "rdmap16s27-dgrm",
            "rdmap32s27-rdm",
            "rdmap48s27-rdm",
        ];
        let nics = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            domains_of_devices(&domains, &nics(&["rdmap32s27", "rdmap16s27"])),
            vec!["rdmap32s27-rdm", "rdmap16s27-rdm"]
        );
        // A device without a domain is left out; one named twice counts once.
        assert_eq!(
            domains_of_devices(&domains, &nics(&["mlx5_0", "rdmap48s27", "rdmap48s27"])),
            vec!["rdmap48s27-rdm"]
        );
        assert!(domains_of_devices(&domains, &[]).is_empty());
    }

    #[test]
    fn an_endpoint_opens_on_the_domain_of_the_device_asked_for() {
        // tcp's domains are the host's interfaces (at least `lo`): the
        // last one listed stands for the device nearest the GPU.
        let domains: Vec<String> = names_of(getinfo(Some(c"tcp;ofi_rxm"), None, false).unwrap())
            .into_iter()
            .map(|(_, d)| d.to_string_lossy().into_owned())
            .collect();
        let last = domains.last().unwrap();
        let (_ep, found) = Endpoint::open(Some("tcp;ofi_rxm"), None, Some(last), None).unwrap();
        assert_eq!(&found.domain, last, "{domains:?}");
        // A device without a domain of this provider: the provider's first.
        let (_ep, found) = Endpoint::open(Some("tcp;ofi_rxm"), None, Some("mlx5_9"), None).unwrap();
        assert_eq!(found.domain, domains[0]);
        // A domain named is the one opened (tcp lists the others too),
        // whatever device is near; one the provider lacks is an error.
        let (_ep, found) =
            Endpoint::open(Some("tcp;ofi_rxm"), Some(last), Some("mlx5_9"), None).unwrap();
        assert_eq!(&found.domain, last);
        let Err(e) = Endpoint::open(Some("tcp;ofi_rxm"), Some("no-such-nic"), None, None) else {
            panic!("a domain the provider lacks was opened");
        };
        assert!(e.to_string().contains("no-such-nic"), "{e}");
        // A domain named, no provider: the provider that has it, though
        // another (tcp, listing its interfaces whatever the hint) comes
        // first.
        let (_ep, found) = Endpoint::open(None, Some("shm"), None, None).unwrap();
        assert_eq!(
            (found.provider.as_str(), found.domain.as_str()),
            ("shm", "shm")
        );
    }
}
