//! The libfabric transport (backend `fabric`): one-sided `fi_write` /
//! `fi_read` on a reliable-datagram endpoint (`FI_EP_RDM`), as EFA offers
//! them, on whichever provider libfabric finds (`efa`, `verbs;ofi_rxm`,
//! `tcp;ofi_rxm`, …).
//!
//! The transport owns one endpoint per rail (a domain: one NIC; an agent
//! has one rail, or several when its configuration names several domains),
//! each with its completion queue and address vector, and one progress
//! thread per rail that reads completions (and, on providers with manual
//! progress, moves the target's data). A link is the usual control stream
//! to the peer ([`FabricLink`]), on which an `Attach` named `fabric`
//! fetches the addresses of the peer's endpoints and the seal that opens
//! the region keys its descriptor publishes; a link's requests spread
//! over its lanes (pairs of a local and a remote rail, see `link`).
//! `endpoint` opens the provider's objects; `region` registers memory (a
//! region is registered on every rail, and its key is one per rail);
//! `stripe` cuts a request into operations over a link's lanes; `link`
//! posts them, reads their completions and moves those that fail on one
//! lane to another; this file holds the transport and its shared state.
//!
//! The notification that follows a request's data does not rely on any
//! ordering between RMA and messages (EFA's SRD has none; the endpoint asks
//! for `FI_ORDER_NONE`): writes are posted with `FI_DELIVERY_COMPLETE`, and
//! the request's commit goes out on the control stream only once every one
//! of its operations has completed (see `link`).
//!
//! Memory registration honours the provider's mode bits: `FI_MR_LOCAL`
//! (every operation carries its local descriptor), `FI_MR_VIRT_ADDR`
//! (remote addresses are virtual, else offsets in the region),
//! `FI_MR_PROV_KEY` (else random keys this transport asks for), `FI_MR_ENDPOINT`
//! (registrations bound to the endpoint), `FI_MR_ALLOCATED` (registered
//! memory is the caller's, allocated) and `FI_MR_HMEM` (GPU memory through
//! `fi_mr_regattr` with its CUDA device; device memory, `FI_HMEM`, is asked
//! of the provider chosen for host memory, and taken when it moves it).
//! Keys are up to 64 bits wide, and never published in the clear: the
//! descriptor holds each XORed with a pad derived from the agent's seal
//! (`region::Seal`), which only the answer to an attach carries, so a
//! reader of a published descriptor cannot reach a region through the
//! provider. A provider that registers with a NIC is refused while libfabric's
//! registration cache is on (`cache_refusal`).

mod endpoint;
mod link;
mod progress;
mod region;
mod stripe;
mod tally;

use std::collections::HashMap;
use std::ffi::CStr;
use std::net::{IpAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvxfer_fabric as ffi;

use crate::agent::{AgentConfig, Backend, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::target::attach;
use crate::engine::transport::{Link, Transport};
use crate::engine::{lock, status};
use crate::error::Error;
use crate::memory::MemoryType;
use crate::metrics::Counter;
use crate::registry::Registrar;

use endpoint::{Endpoint, Found};
pub(in crate::engine) use link::FabricLink;
use region::{DescTable, FabricRegion, SEAL_LEN, Seal};

/// Largest single RMA operation (larger pieces are split, so several are
/// in flight at once).
const MAX_OP: u64 = 4 << 20;
/// Most operations in flight on the endpoint (less when its transmit queue
/// is smaller).
const MAX_CREDITS: usize = 1024;
/// How long the progress thread blocks in the completion queue at a time
/// (it is woken early by `fi_cq_signal` when the agent closes).
const WAIT_MS: i32 = 200;
/// Most rails (domains) of one agent: a region's key is 8 bytes a rail, in
/// a descriptor's key of at most `MAX_REGION_KEY` (128) bytes.
const MAX_RAILS: usize = 16;

/// What libfabric reported.
#[derive(Debug, thiserror::Error)]
enum FabricError {
    /// A call failed.
    #[error("{call}: {text} ({code})")]
    Call {
        /// The call.
        call: &'static str,
        /// libfabric's error number (positive).
        code: i64,
        /// `fi_strerror`'s text.
        text: String,
    },
    /// An operation completed with an error.
    #[error("{op} completed with {text} ({code}, provider error {prov})")]
    Completion {
        /// READ or WRITE.
        op: &'static str,
        /// libfabric's error number.
        code: i32,
        /// The provider's own error number.
        prov: i32,
        /// `fi_strerror`'s text.
        text: String,
    },
    /// The endpoint was closed (the agent is closing).
    #[error("the endpoint is closed")]
    Closed,
    /// libfabric could not be loaded (which file, and why).
    #[error("{0}")]
    Unloaded(String),
}

fn strerror(code: i64) -> String {
    let code = i32::try_from(code.unsigned_abs()).unwrap_or(i32::MAX);
    // SAFETY: fi_strerror returns a static string for any number.
    let s = unsafe { CStr::from_ptr(ffi::fi_strerror(code)) };
    s.to_string_lossy().into_owned()
}

/// `rc` of `call` as a result (negative: a libfabric error number).
fn check(call: &'static str, rc: i64) -> Result<i64, FabricError> {
    if rc < 0 {
        Err(FabricError::Call {
            call,
            code: -rc,
            text: strerror(rc),
        })
    } else {
        Ok(rc)
    }
}

/// The agent-level error of a libfabric failure with `remote`.
fn fabric_err(remote: &str, e: FabricError) -> Error {
    Error::Transport {
        transport: "fabric",
        remote: remote.to_owned(),
        source: Arc::new(e),
    }
}

/// What an agent's descriptor offers of its fabric: the provider's name and
/// registration modes, and whether it moves GPU memory.
#[derive(Debug, PartialEq, Eq)]
struct Offer {
    mr_mode: u64,
    hmem: bool,
    provider: String,
}

impl Offer {
    fn encode(&self) -> Vec<u8> {
        let mut v = self.mr_mode.to_le_bytes().to_vec();
        v.push(u8::from(self.hmem));
        v.extend_from_slice(self.provider.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let (mode, rest) = b.split_first_chunk::<8>()?;
        let (&hmem, name) = rest.split_first()?;
        Some(Self {
            mr_mode: u64::from_le_bytes(*mode),
            hmem: hmem == 1,
            provider: String::from_utf8(name.to_vec()).ok()?,
        })
    }
}

/// Operations the endpoint may still take (its transmit queue's depth),
/// and the bytes they may cover (`FabricConfig::max_inflight`; one
/// operation may always be in flight): a poster takes one operation and its
/// length, the progress thread gives them back as it reads completions.
struct Credits {
    cap: usize,
    free: AtomicUsize,
    bytes_cap: u64,
    bytes: AtomicU64,
}

impl Credits {
    fn new(cap: usize, bytes_cap: u64) -> Self {
        Self {
            cap,
            free: AtomicUsize::new(cap),
            bytes_cap,
            bytes: AtomicU64::new(0),
        }
    }

    /// Takes one operation of `len` bytes if there is room for it.
    fn try_take(&self, len: u64) -> bool {
        let fits = |b: u64| (b == 0 || b.saturating_add(len) <= self.bytes_cap).then(|| b + len);
        if self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, fits)
            .is_err()
        {
            return false;
        }
        let taken = self
            .free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if !taken {
            self.bytes.fetch_sub(len, Ordering::AcqRel);
        }
        taken
    }

    /// Gives back `ops` operations covering `bytes`.
    fn give(&self, ops: usize, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.free.fetch_add(ops, Ordering::AcqRel);
    }

    /// Bytes in flight.
    fn bytes_in_flight(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    /// Operations in flight.
    fn in_flight(&self) -> usize {
        self.cap - self.free.load(Ordering::Acquire)
    }

    /// The share of these credits one of `ways` lanes of a link on this
    /// rail may hold: the link holds half the operations and half the
    /// bytes, split `ways` ways (one operation of any length at least), so
    /// that a peer that stops taking data leaves the other half to the
    /// rest.
    fn share(&self, ways: usize) -> Self {
        let ways = ways.max(1);
        Self::new(
            (self.cap / 2 / ways).max(1),
            self.bytes_cap / 2 / ways as u64,
        )
    }
}

/// What the transport's links and a rail's progress thread share: one
/// rail.
struct Shared {
    /// The rail's place among the agent's.
    rail: usize,
    /// Its domain's name.
    domain: String,
    /// Bytes of operations completed on it (its counter in the agent's
    /// metrics).
    moved: AtomicU64,
    /// Lanes of its links taken out of service after an operation on them
    /// failed (its counter in the agent's metrics).
    failovers: AtomicU64,
    ep: Arc<Endpoint>,
    credits: Credits,
    /// Operations waiting for room in the endpoint's queues or in their
    /// link's share of it, posted by the progress thread as completions
    /// free it, the links taking turns.
    backlog: Mutex<link::Backlog>,
    /// The links, for the progress thread's watch over them.
    links: Mutex<Vec<std::sync::Weak<FabricLink>>>,
    /// Polls of the queue by waiting threads so far (the progress thread
    /// stands aside while it grows).
    driven: AtomicU64,
    /// Peers attached to this endpoint as targets: while there are any, a
    /// queue without a wait object is polled without pause (their
    /// operations may need this side's progress, and nothing tells when).
    inbound: Arc<AtomicUsize>,
    /// The progress thread, unparked from its pause while a queue without a
    /// wait object has nothing to poll for (set by the thread as it
    /// starts).
    thread: std::sync::OnceLock<std::thread::Thread>,
    /// What each link to this agent reads as it opens.
    probe: Probe,
    /// Operations in the provider's hands (posted, not completed), those
    /// of abandoned requests too: what the agent's close waits for.
    held: AtomicUsize,
    /// Peers' addresses by name, when they are never removed from the
    /// address vector (`shm`: libfabric 1.17 crashes posting to a peer
    /// removed and inserted again); `None` on other providers, where a
    /// link's address leaves with it.
    kept: Option<Mutex<HashMap<Vec<u8>, ffi::fi_addr_t>>>,
}

impl Shared {
    /// `name`'s address in the address vector, inserted unless kept.
    fn insert_peer(&self, name: &[u8]) -> Result<ffi::fi_addr_t, FabricError> {
        let Some(kept) = &self.kept else {
            return self.ep.insert(name);
        };
        let mut kept = lock(kept);
        if let Some(&a) = kept.get(name) {
            return Ok(a);
        }
        let a = self.ep.insert(name)?;
        kept.insert(name.to_vec(), a);
        Ok(a)
    }

    /// A link's address is no longer used: removed, unless kept.
    fn release_peer(&self, addr: ffi::fi_addr_t) {
        if self.kept.is_none() {
            self.ep.remove(addr);
        }
    }

    /// The links still open.
    fn live_links(&self) -> Vec<Arc<FabricLink>> {
        lock(&self.links)
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }
}

/// Eight registered bytes of each agent, which every link reads from its
/// peer's as it opens, into its own (see `link::warm`): the provider's
/// connection to the peer is then set up before the first request, and
/// the peer has taken this agent in (`shm` on libfabric 1.17 crashes a
/// target that takes in a peer whose endpoint has closed meanwhile).
struct Probe {
    /// Closed before the memory is freed (declared first).
    region: FabricRegion,
    /// Written by peers' reads into it, never read here.
    buf: Box<AtomicU64>,
}

impl Probe {
    fn open(ep: &Arc<Endpoint>) -> Result<Self, FabricError> {
        let buf = Box::new(AtomicU64::new(0));
        let access = ffi::FI_READ | ffi::FI_REMOTE_READ;
        // SAFETY: the box lives as long as this value, which closes the
        // registration first.
        let region = unsafe { FabricRegion::register(ep, buf.as_ptr() as u64, 8, None, access)? };
        Ok(Self { region, buf })
    }

    /// Its address in memory.
    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
}

/// The answer to a libfabric `Attach`, one entry per rail of the target:
/// where the rail's [`Probe`] is, its key, and the rail endpoint's address;
/// then the target's [`Seal`], which opens the keys its descriptor
/// publishes (an initiator's attach carries its rails only). Encoded as
/// the count of rails (u8, 1 to [`MAX_RAILS`]), then per rail the probe's
/// address and key (u64 LE each), the address's length (u16 LE) and the
/// address; then the seal's [`SEAL_LEN`] bytes, or nothing.
#[derive(Debug, PartialEq, Eq)]
struct Answer {
    rails: Vec<RailAnswer>,
    seal: Option<[u8; SEAL_LEN]>,
}

/// One rail of an [`Answer`].
#[derive(Debug, PartialEq, Eq)]
struct RailAnswer {
    probe_addr: u64,
    probe_key: u64,
    name: Vec<u8>,
}

/// Longest endpoint address taken from a peer.
const MAX_NAME: usize = 1024;

impl Answer {
    fn encode(&self) -> Vec<u8> {
        let mut v = vec![u8::try_from(self.rails.len()).unwrap_or(u8::MAX)];
        for r in &self.rails {
            v.extend_from_slice(&r.probe_addr.to_le_bytes());
            v.extend_from_slice(&r.probe_key.to_le_bytes());
            let len = u16::try_from(r.name.len()).unwrap_or(u16::MAX);
            v.extend_from_slice(&len.to_le_bytes());
            v.extend_from_slice(&r.name);
        }
        if let Some(seal) = &self.seal {
            v.extend_from_slice(seal);
        }
        v
    }

    /// `None` unless it holds 1 to [`MAX_RAILS`] rails, each with an
    /// address of 1 to [`MAX_NAME`] bytes, and after them a seal or
    /// nothing.
    fn decode(b: &[u8]) -> Option<Self> {
        let (&n, mut rest) = b.split_first()?;
        if n == 0 || usize::from(n) > MAX_RAILS {
            return None;
        }
        let mut rails = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            let (addr, r) = rest.split_first_chunk::<8>()?;
            let (key, r) = r.split_first_chunk::<8>()?;
            let (len, r) = r.split_first_chunk::<2>()?;
            let len = usize::from(u16::from_le_bytes(*len));
            if len == 0 || len > MAX_NAME || r.len() < len {
                return None;
            }
            let (name, r) = r.split_at(len);
            rails.push(RailAnswer {
                probe_addr: u64::from_le_bytes(*addr),
                probe_key: u64::from_le_bytes(*key),
                name: name.to_vec(),
            });
            rest = r;
        }
        let seal = match rest.len() {
            0 => None,
            SEAL_LEN => Some(rest.try_into().ok()?),
            _ => return None,
        };
        Some(Self { rails, seal })
    }
}

/// A peer attached to this agent's endpoints as a target, counted in
/// every rail's [`Shared::inbound`] while its connection lasts.
struct Inbound(Vec<Arc<AtomicUsize>>);

impl Inbound {
    /// Counts a peer in, and wakes the progress threads to poll for it.
    fn new(rails: &[Arc<Shared>]) -> Self {
        let mut counts = Vec::with_capacity(rails.len());
        for shared in rails {
            shared.inbound.fetch_add(1, Ordering::AcqRel);
            shared.wake();
            counts.push(Arc::clone(&shared.inbound));
        }
        Self(counts)
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        for n in &self.0 {
            n.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Shared {
    /// Wakes the progress thread (it then posts what waits, and watches),
    /// from its wait object or, without one, from its pause between polls.
    fn wake(&self) {
        if self.ep.waits {
            // SAFETY: the queue is open (the endpoint outlives this call).
            unsafe { ffi::fi_cq_signal(self.ep.cq) };
        } else if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// The transport: its rails (an endpoint each, with its progress thread),
/// and what it tells peers.
pub(in crate::engine) struct Fabric {
    /// Never empty.
    rails: Arc<Rails>,
    offer: Offer,
    /// The rails' domains' names (joined by `+`), as statuses report the
    /// device.
    domain: String,
    max_msg: u64,
    /// What its regions' keys are sealed with in the descriptor.
    seal: Arc<Seal>,
    stop: Arc<AtomicBool>,
    /// The rails' progress threads, taken once by `shut`.
    progress: Mutex<Option<Vec<JoinHandle<()>>>>,
}

/// An agent's rails, and the local descriptors of regions registered with
/// several of them.
pub(super) struct Rails {
    all: Vec<Arc<Shared>>,
    descs: Arc<DescTable>,
}

/// The domains an agent's rails open, from the configured names (one, or
/// several separated by commas): `[None]` (one rail, chosen by the
/// provider or the GPU's topology) when none is named.
///
/// # Errors
/// A list with an empty name, or of more than [`MAX_RAILS`].
fn domains_of(named: Option<&str>) -> Result<Vec<Option<String>>, String> {
    let Some(named) = named else {
        return Ok(vec![None]);
    };
    let names: Vec<&str> = named.split(',').map(str::trim).collect();
    if names.iter().any(|n| n.is_empty()) {
        return Err(format!("fabric domain list {named:?} has an empty name"));
    }
    if names.len() > MAX_RAILS {
        return Err(format!(
            "fabric domain list {named:?} names {} domains (at most {MAX_RAILS})",
            names.len()
        ));
    }
    Ok(names.into_iter().map(|n| Some(n.to_owned())).collect())
}

impl Fabric {
    /// The transport of an agent on `backend`, when it uses one: `fabric`
    /// opens an endpoint on each configured domain of the configured
    /// provider, or fails.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`]: no such provider or domain, one
    /// cannot open an endpoint, or the domains differ in provider or
    /// registration modes.
    pub(in crate::engine) fn open(
        backend: Backend,
        config: &mut AgentConfig,
    ) -> Result<Option<Self>, Error> {
        if backend != Backend::Fabric {
            return Ok(None);
        }
        let provider = config
            .fabric
            .provider
            .clone()
            .or_else(|| std::env::var("KVXFER_FABRIC_PROVIDER").ok());
        let domain = config
            .fabric
            .domain
            .clone()
            .or_else(|| std::env::var("KVXFER_FABRIC_DOMAIN").ok());
        let unavailable = |reason: String| Error::BackendUnavailable {
            backend: "fabric",
            reason,
        };
        // Without a domain named: the NICs nearest the agent's GPU (by PCI
        // topology, as the RDMA transport picks its device): a rail on each
        // of those under its PCIe switch when the provider has domains of
        // several, else one on the nearest when the provider has a domain
        // of it.
        let mut near = None;
        let domains = match domain.as_deref() {
            Some(named) => domains_of(Some(named)).map_err(unavailable)?,
            None => {
                let nics = config
                    .fabric
                    .near_gpu
                    .map(crate::gpu::nearest_nics)
                    .unwrap_or_default();
                let mut rails = if nics.len() > 1 {
                    Endpoint::domains_near(provider.as_deref(), &nics).unwrap_or_default()
                } else {
                    Vec::new()
                };
                rails.truncate(MAX_RAILS);
                if rails.len() > 1 {
                    tracing::info!(agent = %config.name, ?rails, "libfabric rails on the NICs under the GPU's PCIe switch");
                    rails.into_iter().map(Some).collect()
                } else {
                    near = nics.into_iter().next();
                    vec![None]
                }
            }
        };
        let mut opened = Vec::with_capacity(domains.len());
        for d in &domains {
            let (ep, found) = Endpoint::open(
                provider.as_deref(),
                d.as_deref(),
                near.as_deref(),
                Some(bind_ip(config.listen.ip(), config.advertise.as_deref())),
            )
            .map_err(|e| unavailable(e.to_string()))?;
            if let Some((_, first)) = opened.first()
                && !Found::same_kind(first, &found)
            {
                let first: &Found = first;
                return Err(unavailable(format!(
                    "fabric rails must share one provider and its registration modes: domain {:?} is {} (modes {:#x}), domain {:?} is {} (modes {:#x})",
                    first.domain,
                    first.provider,
                    first.mr_mode,
                    found.domain,
                    found.provider,
                    found.mr_mode
                )));
            }
            opened.push((ep, found));
        }
        let found = &opened[0].1;
        let env = |k: &str| std::env::var(k).ok();
        if let Some(reason) = cache_refusal(
            &found.provider,
            &CacheEnv {
                max_count: env("FI_MR_CACHE_MAX_COUNT"),
                max_size: env("FI_MR_CACHE_MAX_SIZE"),
                monitor: env("FI_MR_CACHE_MONITOR"),
                efa: env("FI_EFA_MR_CACHE_ENABLE"),
            },
        ) {
            return Err(unavailable(reason));
        }
        let offer = Offer {
            mr_mode: found.mr_mode,
            hmem: opened.iter().all(|(_, f)| f.hmem),
            provider: found.provider.clone(),
        };
        let max_msg = opened
            .iter()
            .map(|(_, f)| f.max_msg)
            .min()
            .unwrap_or(MAX_OP)
            .min(MAX_OP);
        let names: Vec<&str> = opened.iter().map(|(_, f)| f.domain.as_str()).collect();
        let domain = names.join("+");
        let mut all = Vec::with_capacity(opened.len());
        for (rail, (ep, found)) in opened.into_iter().enumerate() {
            tracing::info!(agent = %config.name, rail, provider = %found.provider, domain = %found.domain, mr_mode = format_args!("{:#x}", found.mr_mode), waits = ep.waits, "libfabric endpoint open");
            let ep = Arc::new(ep);
            let probe = Probe::open(&ep).map_err(|e| unavailable(e.to_string()))?;
            all.push(Arc::new(Shared {
                rail,
                domain: found.domain,
                moved: AtomicU64::new(0),
                failovers: AtomicU64::new(0),
                ep,
                credits: Credits::new(found.tx_size.min(MAX_CREDITS), config.fabric.max_inflight),
                backlog: Mutex::default(),
                links: Mutex::default(),
                driven: AtomicU64::new(0),
                inbound: Arc::default(),
                thread: std::sync::OnceLock::new(),
                probe,
                held: AtomicUsize::new(0),
                kept: target_moves(&found.provider).then(Mutex::default),
            }));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::with_capacity(all.len());
        for shared in &all {
            let spawned = {
                let (shared, stop) = (Arc::clone(shared), Arc::clone(&stop));
                std::thread::Builder::new()
                    .name(format!("kvxfer-fabric-{}", config.name))
                    .spawn(move || progress::progress(&shared, &stop))
            };
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // The threads started so far end (nothing is in flight).
                    stop.store(true, Ordering::Release);
                    for s in &all {
                        s.wake();
                    }
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(Some(Self {
            rails: Arc::new(Rails {
                all,
                descs: Arc::default(),
            }),
            offer,
            domain,
            max_msg,
            seal: Arc::new(Seal::new()),
            stop,
            progress: Mutex::new(Some(threads)),
        }))
    }
}

/// Where a socket provider's endpoint listens: where the agent listens, or,
/// for an agent listening on every interface, the address it advertises
/// when that is an IP address (`10.0.0.5:7000`, `[fd00::5]:7000`), so the
/// provider is reachable on the interface peers are told of only.
fn bind_ip(listen: IpAddr, advertise: Option<&str>) -> IpAddr {
    if !listen.is_unspecified() {
        return listen;
    }
    advertise
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .map_or(listen, |a| a.ip())
}

/// Core providers whose registrations are checked in software by the
/// target's provider and end with `fi_close` (no registration cache).
const UNCACHED: &[&str] = &["tcp", "shm", "sockets", "udp", "net"];

/// Core providers that move data through kernel sockets: every poll of
/// their completion queue is system calls.
const OVER_SOCKETS: &[&str] = &["tcp", "sockets", "udp", "net"];

/// Whether threads waiting on small requests poll the completion queue of
/// `provider` themselves. Not on providers over kernel sockets: there a
/// polling waiter is one more busy thread beside the progress threads that
/// the target's data needs, and measured slower (half round trip 1.48× on
/// `tcp;ofi_rxm`, 2 cores) where `shm` and `verbs;ofi_rxm` gained 3× or more
/// (`docs/benchmarks.md`).
fn waiters_poll(provider: &str) -> bool {
    !provider
        .split(';')
        .filter(|p| !p.starts_with("ofi_"))
        .any(|p| OVER_SOCKETS.contains(&p))
}

/// What the environment says of libfabric's registration cache (read once,
/// when an agent opens its endpoint; libfabric reads the same variables).
struct CacheEnv {
    /// `FI_MR_CACHE_MAX_COUNT`.
    max_count: Option<String>,
    /// `FI_MR_CACHE_MAX_SIZE`.
    max_size: Option<String>,
    /// `FI_MR_CACHE_MONITOR`.
    monitor: Option<String>,
    /// `FI_EFA_MR_CACHE_ENABLE` (the efa provider's own switch).
    efa: Option<String>,
}

/// Why an agent may not use `provider` with the environment `env`, if it
/// may not: providers that register with a NIC (verbs, efa, …) keep a
/// closed registration in libfabric's registration cache, still open to
/// remote access, so a region this agent deregistered — or memory it freed
/// and reused — would stay writable by peers holding its key. Such a
/// provider is used only with the cache turned off.
fn cache_refusal(provider: &str, env: &CacheEnv) -> Option<String> {
    let zero = |v: &Option<String>| v.as_deref().is_some_and(|v| v.trim() == "0");
    let off = |v: &Option<String>| {
        v.as_deref()
            .is_some_and(|v| matches!(v.trim(), "0" | "no" | "false" | "off"))
    };
    // The core providers under any utility layers (`ofi_rxm`, `ofi_rxd`)
    // that register with a NIC.
    let caching: Vec<&str> = provider
        .split(';')
        .filter(|p| !p.starts_with("ofi_") && !UNCACHED.contains(p))
        .collect();
    if caching.is_empty()
        || zero(&env.max_count)
        || zero(&env.max_size)
        || env.monitor.as_deref().map(str::trim) == Some("disabled")
        || (caching == ["efa"] && off(&env.efa))
    {
        return None;
    }
    Some(format!(
        "provider {provider} may keep a closed memory registration in libfabric's registration cache, \
         still open to remote access, so a region deregistered (or memory freed) here would stay \
         writable by peers; turn the cache off with FI_MR_CACHE_MAX_COUNT=0 in the environment"
    ))
}

/// Core providers whose target's process moves the data of an operation
/// (its progress copies with cross-memory attach): closing the initiator's
/// endpoint does not stop what it has queued at the target.
const TARGET_MOVES: &[&str] = &["shm"];

/// Whether `provider` stacks on one of [`TARGET_MOVES`].
fn target_moves(provider: &str) -> bool {
    provider.split(';').any(|p| TARGET_MOVES.contains(&p))
}

impl Fabric {
    /// Stops the transport (once; the agent is closing). Its links fail
    /// with `Closed` (their WRITEs at once: `FabricParts::on_fail`); the
    /// progress thread reads the completions of what the provider still
    /// holds, for at most [`CLOSE_GRACE`], and returns. What is still held
    /// then will not complete (a stopped or unreachable peer): the endpoint
    /// is closed, so that nothing of it moves any more, and the requests
    /// still open fail with `Closed`; the operations' contexts, and with
    /// them the endpoint's queue, address vector and domain, are leaked.
    ///
    /// On providers whose target moves the data (`shm`, [`TARGET_MOVES`]),
    /// closing would stop nothing (the target's process copies, once it
    /// runs again) and, on libfabric 1.17, crash a target still taking
    /// this endpoint in: the endpoint is left open, and a READ still
    /// queued at a stopped target may land after its request failed.
    fn shut(&self) {
        let Some(threads) = lock(&self.progress).take() else {
            return;
        };
        let rails = &self.rails.all;
        for shared in rails {
            for l in shared.live_links() {
                l.fail(Error::Closed);
            }
        }
        self.stop.store(true, Ordering::Release);
        for shared in rails {
            shared.wake();
        }
        for t in threads {
            let _ = t.join();
        }
        let held: usize = rails.iter().map(|s| s.held.load(Ordering::Acquire)).sum();
        if held == 0 && rails.iter().all(|s| lock(&s.backlog).is_empty()) {
            return;
        }
        if !target_moves(&self.offer.provider) {
            for shared in rails {
                shared.ep.close_ep();
            }
        }
        tracing::warn!(operations = held, provider = %self.offer.provider, "libfabric operations still in flight at the agent's close; their requests fail");
        // Queued operations (their links broken) are dropped; completions
        // the close flushed are read; the rest are abandoned.
        let mut buf = [ffi::fi_cq_entry::default(); progress::BATCH];
        for shared in rails {
            link::drain(shared);
            while progress::reap(shared, &mut buf, false) > 0 {}
        }
        for shared in rails {
            link::abandon_all(shared, &Error::Closed);
        }
    }
}

/// How long the agent's close waits for its operations in flight.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for Fabric {
    fn drop(&mut self) {
        self.shut();
    }
}

impl Transport for Fabric {
    fn kind(&self) -> TransportKind {
        TransportKind::Fabric
    }

    fn stop(&self) {
        self.shut();
    }

    fn counters(&self) -> Vec<Counter> {
        let labels = |r: &Shared| vec![("rail", r.rail.to_string()), ("domain", r.domain.clone())];
        let rails = &self.rails.all;
        let bytes = rails.iter().map(|r| Counter {
            name: "kvxfer_fabric_rail_bytes_total",
            help: "Bytes of libfabric operations (WRITEs and READs this agent posted) completed, by rail.",
            value: r.moved.load(Ordering::Relaxed),
            labels: labels(r),
        });
        let failovers = rails.iter().map(|r| Counter {
            name: "kvxfer_fabric_lane_failovers_total",
            help: "Lanes of links (pairs of this agent's rail and a peer's) taken out of service after an operation on them failed, their operations moved to other lanes, by this agent's rail.",
            value: r.failovers.load(Ordering::Relaxed),
            labels: labels(r),
        });
        bytes.chain(failovers).collect()
    }

    fn moves(&self, local: MemoryType, remote: MemoryType, peer: &AgentDesc) -> bool {
        use MemoryType::{Dram, Vram};
        let local_ok = local == Dram || (local == Vram && self.offer.hmem);
        // The peer's offer is decoded only for its GPU memory, not on every
        // request between host memories.
        let remote_ok =
            remote == Dram || (remote == Vram && peer_offer(peer).is_some_and(|o| o.hmem));
        local_ok && remote_ok
    }

    fn reach(&self, peer: &AgentDesc) -> Result<(), String> {
        let Some(theirs) = peer_offer(peer) else {
            return Err("the remote agent offers no libfabric endpoint".into());
        };
        if theirs.provider != self.offer.provider {
            return Err(format!(
                "the remote agent's provider is {:?}, this one's {:?}",
                theirs.provider, self.offer.provider
            ));
        }
        let virt = u64::from(ffi::FI_MR_VIRT_ADDR);
        if theirs.mr_mode & virt != self.offer.mr_mode & virt {
            return Err(
                "the remote agent addresses its regions otherwise (FI_MR_VIRT_ADDR)".into(),
            );
        }
        Ok(())
    }

    fn offer(&self) -> Option<Vec<u8>> {
        Some(self.offer.encode())
    }

    fn registrar(&self) -> Option<&dyn Registrar> {
        Some(self)
    }

    fn connect(&self, cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        Ok(FabricLink::open(cx, self, peer)?)
    }

    fn accept(
        &self,
        _cx: Ctx<'_>,
        remote: &str,
        _sock: &TcpStream,
        _msg: &[u8],
    ) -> Result<(Vec<u8>, Option<attach::Attachment>), u16> {
        // One-sided operations need nothing of the initiator here: the
        // answer is this endpoint's address, where its probe is, and the
        // seal that opens the keys the descriptor publishes (the peer
        // passed the handshake). The peer counts as attached until its
        // connection ends.
        let rails = &self.rails.all;
        let answer = answer_of(rails, Some(&self.seal)).map_err(|e| {
            tracing::warn!(remote = %remote, error = %e, "cannot answer a libfabric attach");
            status::ATTACH_FAILED
        })?;
        let inbound: attach::Attachment = Box::new(Inbound::new(rails));
        Ok((answer.encode(), Some(inbound)))
    }
}

/// What `rails` tell a peer: each one's probe and endpoint address, and
/// `seal` (the answer to an attach; what an attach carries has none).
fn answer_of(rails: &[Arc<Shared>], seal: Option<&Seal>) -> Result<Answer, FabricError> {
    let rails = rails
        .iter()
        .map(|shared| {
            shared.ep.name().map(|name| RailAnswer {
                probe_addr: shared.probe.addr(),
                probe_key: shared.probe.region.key,
                name,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Answer {
        rails,
        seal: seal.map(|s| *s.bytes()),
    })
}

/// `peer`'s fabric offer, if it makes one that decodes.
fn peer_offer(peer: &AgentDesc) -> Option<Offer> {
    peer.offer(TransportKind::Fabric.as_str())
        .and_then(|(_, o)| Offer::decode(&o.info))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_round_trips_and_garbage_is_none() {
        let o = Offer {
            mr_mode: u64::from(ffi::FI_MR_VIRT_ADDR | ffi::FI_MR_PROV_KEY),
            hmem: true,
            provider: "efa".into(),
        };
        assert_eq!(Offer::decode(&o.encode()), Some(o));
        assert_eq!(Offer::decode(&[1, 2, 3]), None);
        assert_eq!(Offer::decode(&[0; 8]), None);
    }

    #[test]
    fn an_attach_answer_round_trips_and_a_bad_one_is_none() {
        let rail = |k: u64, name: &[u8]| RailAnswer {
            probe_addr: 0x7f00_1234_5678,
            probe_key: u64::MAX - k,
            name: name.to_vec(),
        };
        let a = Answer {
            rails: vec![rail(3, &[9, 8, 7]), rail(4, &[1; 64])],
            seal: Some([0xa5; SEAL_LEN]),
        };
        let b = a.encode();
        assert_eq!(Answer::decode(&b), Some(a));
        // Cut anywhere, or with a byte more: nothing (cut before its seal:
        // an answer without one).
        let unsealed = b.len() - SEAL_LEN;
        for n in 0..b.len() {
            let d = Answer::decode(&b[..n]);
            assert_eq!(d.is_some(), n == unsealed, "{n} bytes: {d:?}");
        }
        assert_eq!(Answer::decode(&b[..unsealed]).unwrap().seal, None);
        let mut long = b.clone();
        long.push(0);
        assert_eq!(Answer::decode(&long), None, "trailing byte");
        // No rails, too many, an empty address, a too long one.
        assert_eq!(Answer::decode(&[0]), None);
        let many = Answer {
            rails: (0..=MAX_RAILS as u64).map(|k| rail(k, &[1])).collect(),
            seal: None,
        };
        assert_eq!(Answer::decode(&many.encode()), None);
        let empty = Answer {
            rails: vec![rail(0, &[])],
            seal: None,
        };
        assert_eq!(Answer::decode(&empty.encode()), None);
        let huge = Answer {
            rails: vec![rail(0, &vec![1; MAX_NAME + 1])],
            seal: None,
        };
        assert_eq!(Answer::decode(&huge.encode()), None);
    }

    #[test]
    fn a_domain_list_names_the_rails() {
        assert_eq!(domains_of(None), Ok(vec![None]));
        assert_eq!(domains_of(Some("lo")), Ok(vec![Some("lo".into())]));
        assert_eq!(
            domains_of(Some("rdmap16s27-rdm, rdmap32s27-rdm")),
            Ok(vec![
                Some("rdmap16s27-rdm".into()),
                Some("rdmap32s27-rdm".into())
            ])
        );
        assert!(domains_of(Some("a,,b")).unwrap_err().contains("empty name"));
        assert!(domains_of(Some("")).is_err());
        let many = vec!["d"; MAX_RAILS + 1].join(",");
        assert!(domains_of(Some(&many)).unwrap_err().contains("at most 16"));
    }

    #[test]
    fn providers_that_cache_registrations_need_the_cache_off() {
        let env = |count: Option<&str>, monitor: Option<&str>, efa: Option<&str>| CacheEnv {
            max_count: count.map(Into::into),
            max_size: None,
            monitor: monitor.map(Into::into),
            efa: efa.map(Into::into),
        };
        let none = env(None, None, None);
        // Software keys, no cache: nothing to turn off.
        for p in ["tcp;ofi_rxm", "shm", "udp;ofi_rxd", "sockets", "net"] {
            assert_eq!(cache_refusal(p, &none), None, "{p}");
        }
        // A NIC's registrations: refused until the cache is off.
        for p in ["verbs;ofi_rxm", "efa", "psm3", "cxi"] {
            let why = cache_refusal(p, &none).expect(p);
            assert!(why.contains("FI_MR_CACHE_MAX_COUNT=0"), "{why}");
            assert_eq!(cache_refusal(p, &env(Some("0"), None, None)), None, "{p}");
            assert_eq!(cache_refusal(p, &env(None, Some("disabled"), None)), None);
            assert!(cache_refusal(p, &env(Some("1024"), Some("memhooks"), None)).is_some());
        }
        let max_size = CacheEnv {
            max_size: Some("0".into()),
            ..env(None, None, None)
        };
        assert_eq!(cache_refusal("verbs;ofi_rxm", &max_size), None);
        // efa's own switch turns off efa's cache only.
        assert_eq!(cache_refusal("efa", &env(None, None, Some("0"))), None);
        assert!(cache_refusal("verbs;ofi_rxm", &env(None, None, Some("0"))).is_some());
    }

    #[test]
    fn waiters_poll_except_over_kernel_sockets() {
        for p in [
            "verbs;ofi_rxm",
            "efa",
            "shm",
            "verbs;ofi_rxd",
            "psm3",
            "cxi",
        ] {
            assert!(waiters_poll(p), "{p}");
        }
        for p in ["tcp;ofi_rxm", "tcp", "sockets", "udp;ofi_rxd", "net"] {
            assert!(!waiters_poll(p), "{p}");
        }
    }

    /// A raw libfabric client of its own: an endpoint on `tcp;ofi_rxm`
    /// with a registered buffer, and one peer's endpoint address inserted.
    struct RawClient {
        /// Closed before the buffer is freed (declared first).
        region: FabricRegion,
        ep: Arc<Endpoint>,
        peer: ffi::fi_addr_t,
        buf: Box<[u8; 4096]>,
    }

    impl RawClient {
        fn open(peer: &[u8], fill: u8) -> Self {
            let lo = std::net::IpAddr::from([127, 0, 0, 1]);
            let (ep, _) = Endpoint::open(Some("tcp;ofi_rxm"), None, None, Some(lo)).unwrap();
            let ep = Arc::new(ep);
            let buf = Box::new([fill; 4096]);
            let access = ffi::FI_READ | ffi::FI_WRITE;
            // SAFETY: the buffer outlives the registration (field order).
            let region =
                unsafe { FabricRegion::register(&ep, buf.as_ptr() as u64, 4096, None, access) }
                    .unwrap();
            let peer = ep.insert(peer).unwrap();
            Self {
                region,
                ep,
                peer,
                buf,
            }
        }

        /// A 4 KiB WRITE of its buffer to (or READ into it from) `remote`
        /// under `key`: its completion's outcome, or `Err` with none
        /// within 5 s.
        fn op(&mut self, write: bool, remote: u64, key: u64) -> Result<(), String> {
            let iov = ffi::iovec {
                iov_base: self.buf.as_mut_ptr().cast(),
                iov_len: 4096,
            };
            let mut desc = self.region.desc as *mut std::ffi::c_void;
            let rma = ffi::fi_rma_iov {
                addr: remote,
                len: 4096,
                key,
            };
            // The provider's room in the context (FI_CONTEXT2), leaked if
            // no completion comes (the provider may still write it).
            let ctx: &'static mut [*mut std::ffi::c_void; 8] =
                Box::leak(Box::new([std::ptr::null_mut(); 8]));
            let msg = ffi::fi_msg_rma {
                msg_iov: &iov,
                desc: &mut desc,
                iov_count: 1,
                addr: self.peer,
                rma_iov: &rma,
                rma_iov_count: 1,
                context: ctx.as_mut_ptr().cast(),
                data: 0,
            };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            // One completion (or error) from the queue, within 100 ms; the
            // read also drives the provider's progress.
            let reap = || {
                let mut e = [ffi::fi_cq_entry::default(); 1];
                // SAFETY: one entry of the queue's format.
                let n = unsafe {
                    ffi::fi_cq_sread(self.ep.cq, e.as_mut_ptr().cast(), 1, std::ptr::null(), 100)
                };
                if n == 1 {
                    return Some(Ok(()));
                }
                if n == -(ffi::FI_EAVAIL as isize) {
                    let mut err = ffi::fi_cq_err_entry::default();
                    // SAFETY: one error entry into `err`.
                    unsafe { ffi::fi_cq_readerr(self.ep.cq, &mut err, 0) };
                    return Some(Err(format!("failed: {}", strerror(i64::from(err.err)))));
                }
                None
            };
            // Posted again while the provider sets up its connection
            // (EAGAIN).
            loop {
                // SAFETY: the buffer and context outlive the operation
                // (the client waits for its completion below, the context
                // is leaked).
                let rc = self
                    .ep
                    .with_ep(|ep| unsafe {
                        if write {
                            ffi::fi_writemsg(
                                ep,
                                &msg,
                                u64::from(ffi::FI_COMPLETION | ffi::FI_DELIVERY_COMPLETE),
                            )
                        } else {
                            ffi::fi_readmsg(ep, &msg, u64::from(ffi::FI_COMPLETION))
                        }
                    })
                    .unwrap();
                if rc == 0 {
                    break;
                }
                if rc != -(ffi::FI_EAGAIN as isize) || std::time::Instant::now() > deadline {
                    return Err(format!("not posted: {}", strerror(rc as i64)));
                }
                if let Some(r) = reap() {
                    return Err(format!("a completion before the post: {r:?}"));
                }
            }
            while std::time::Instant::now() < deadline {
                if let Some(r) = reap() {
                    return r;
                }
            }
            Err("no completion within 5 s".into())
        }
    }

    /// The attack of round two, again: a raw libfabric client that holds
    /// an agent's published descriptor (the region's address and the key
    /// the descriptor publishes) and its provider endpoint's address (a
    /// port scan finds it) neither reads nor writes the region. The same
    /// client with the key opened by the agent's seal (as an attached peer
    /// opens it) reads the region: the refusal is the key's.
    #[test]
    fn a_raw_client_with_a_published_descriptor_reaches_nothing() {
        let mut config = AgentConfig::new("raw-target");
        config.fabric.provider = Some("tcp;ofi_rxm".into());
        config.fabric.domain = None;
        let fabric = Fabric::open(Backend::Fabric, &mut config).unwrap().unwrap();
        let canary = vec![0x5a_u8; 4096].into_boxed_slice();
        let desc = crate::memory::MemoryDesc::new(canary.as_ptr() as u64, 4096, 0);
        // SAFETY: the canary outlives the registration (dropped first).
        let handle = unsafe { fabric.register(MemoryType::Dram, &desc, None) }
            .unwrap()
            .unwrap();
        // What the agent's descriptor publishes for the region (the
        // registry passes the region's access key; see Registry::exported).
        let access = crate::auth::random_u64();
        let published = u64::from_le_bytes(handle.remote_key(access).try_into().unwrap());
        let name = fabric.rails.all[0].ep.name().unwrap();
        let remote = if fabric.offer.mr_mode & u64::from(ffi::FI_MR_VIRT_ADDR) != 0 {
            desc.addr
        } else {
            0
        };
        // The published key, each operation from a client of its own.
        let mut writer = RawClient::open(&name, 0xee);
        let wrote = writer.op(true, remote, published);
        let mut reader = RawClient::open(&name, 0);
        let read = reader.op(false, remote, published);
        eprintln!("with the published key: write {wrote:?}, read {read:?}");
        assert!(wrote.is_err(), "a WRITE under the published key completed");
        assert!(read.is_err(), "a READ under the published key completed");
        assert!(reader.buf.iter().all(|&b| b == 0), "a READ brought bytes");
        assert!(canary.iter().all(|&b| b == 0x5a), "the canary changed");
        // Nor with another pad: the published key is not the true one.
        let opened = fabric.seal.open(published, access, 0);
        assert_ne!(opened, published);
        // The control: the opened key reads the canary.
        let mut control = RawClient::open(&name, 0);
        control.op(false, remote, opened).unwrap();
        assert!(control.buf.iter().all(|&b| b == 0x5a));
        drop(handle);
    }

    #[test]
    fn a_provider_listens_where_the_agent_listens_or_advertises() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let any = ip("0.0.0.0");
        assert_eq!(
            bind_ip(ip("127.0.0.1"), Some("10.0.0.5:7000")),
            ip("127.0.0.1")
        );
        assert_eq!(bind_ip(any, Some("10.0.0.5:7000")), ip("10.0.0.5"));
        assert_eq!(bind_ip(ip("::"), Some("[fd00::5]:7000")), ip("fd00::5"));
        // A host name, or nothing advertised: every interface, as the agent.
        assert_eq!(bind_ip(any, Some("prefill-0:7000")), any);
        assert_eq!(bind_ip(any, None), any);
    }

    /// A seal's pads differ by region and by rail, and a key sealed by one
    /// agent's seal is opened by it only.
    #[test]
    fn a_key_is_sealed_per_region_and_rail() {
        let (a, b) = (Seal::new(), Seal::new());
        let key = 0x1234_5678_9abc_def0;
        let sealed = key ^ a.pad(7, 0);
        assert_eq!(a.open(sealed, 7, 0), key);
        assert_ne!(b.open(sealed, 7, 0), key);
        assert_ne!(a.pad(7, 0), a.pad(8, 0));
        assert_ne!(a.pad(7, 0), a.pad(7, 1));
        assert_eq!(format!("{a:?}"), "Seal(..)");
    }

    #[test]
    fn an_agent_without_libfabric_is_refused_typed() {
        // In a child process: whether libfabric loaded is the process's.
        if std::env::var_os("KVXFER_FABRIC_CHILD").is_some() {
            let cfg = AgentConfig::new("no-libfabric").with_fabric_provider("tcp;ofi_rxm");
            let Err(e) = crate::make_transfer_agent(Backend::Fabric, cfg) else {
                panic!("a fabric agent opened without libfabric");
            };
            assert!(
                matches!(&e, Error::BackendUnavailable { backend: "fabric", reason }
                    if reason.contains("/nonexistent/libfabric.so.1")),
                "{e}"
            );
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "engine::fabric::tests::an_agent_without_libfabric_is_refused_typed",
            ])
            .env("KVXFER_FABRIC_CHILD", "1")
            .env("KVXFER_LIBFABRIC", "/nonexistent/libfabric.so.1")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && said.contains("1 passed"), "{said}");
    }

    #[test]
    fn credits_run_out_and_come_back() {
        let c = Credits::new(2, 1 << 20);
        assert!(c.try_take(8) && c.try_take(8));
        assert!(!c.try_take(8));
        assert_eq!(c.in_flight(), 2);
        c.give(1, 8);
        assert_eq!(c.in_flight(), 1);
        assert!(c.try_take(8));
    }

    #[test]
    fn a_links_share_is_half_and_never_nothing() {
        let s = Credits::new(64, 64 << 20).share(1);
        assert_eq!((s.cap, s.bytes_cap), (32, 32 << 20));
        // A link with two lanes on the rail: half of it between them.
        let s = Credits::new(64, 64 << 20).share(2);
        assert_eq!((s.cap, s.bytes_cap), (16, 16 << 20));
        let s = Credits::new(1, 64 << 10).share(3);
        assert_eq!(s.cap, 1);
        // A share smaller than one operation still takes one at a time.
        assert!(s.try_take(4 << 20));
        assert!(!s.try_take(1));
    }

    #[test]
    fn bytes_in_flight_are_bounded_but_one_operation_always_fits() {
        let c = Credits::new(16, 1 << 20);
        // Larger than the bound, alone: taken.
        assert!(c.try_take(4 << 20));
        assert!(!c.try_take(1));
        c.give(1, 4 << 20);
        assert!(c.try_take(512 << 10) && c.try_take(512 << 10));
        assert!(!c.try_take(1), "the bound is reached");
        assert_eq!(c.in_flight(), 2);
        c.give(1, 512 << 10);
        assert!(c.try_take(256 << 10));
        assert!(!c.try_take(512 << 10), "256 KiB left");
        assert_eq!(c.in_flight(), 2);
    }
}
