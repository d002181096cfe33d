//! The shm transport: same-host peers, no socket for the data.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`Shm`] (the transport: its state on both sides) and the initiator's link: grants, the direct copy (`process_vm_writev`/`readv` in `crate::cross_memory`, stopped between calls by an abort), delegating the copy to the target when its side is the contiguous one, shared pools copied through their mapping, the target's GPU memory through CUDA IPC |
//! | `at_target.rs` | the target's side of a session ([`at_target::CmaSession`]): grants held until the commit, delegated copies for the proven initiator, the pool channel |
//! | `frames.rs` | its frames inside the engine's `Transport` frames, the descriptor's offer and IPC keys (pure) |
//! | `plan.rs` | grants, the delegation choice, `Delegate` tables (pure) |
//! | `proof.rs` | the local proof socket: which process is this initiator (the kernel's answer) |
//! | `pool.rs` | shared pools: the channel on which a target hands its pools' files to a proven initiator and revokes them, and the initiator's mappings |
//!
//! The target's GPU memory is reached the same way as its host memory,
//! through CUDA IPC: its descriptor carries each VRAM region's allocation
//! handle; the initiator opens it (once per allocation, kept until the link
//! closes), and after the grants the copy is the driver's (device to
//! device, or to and from host memory), waited for before the commit, so
//! the sync message is delivered only once the data is in place. Nothing
//! is staged.

use crate::agent::{AgentConfig, Backend, DataPath, TransferOp, TransferStatus, TransportKind};
use crate::desc::{AgentDesc, RegionKey};
use crate::engine::ctx::Ctx;
use crate::engine::peer::fetch_desc;
use crate::engine::requests::Finished;
use crate::engine::shm::at_target::CmaSession;
use crate::engine::shm::frames::{CmaFrame, LocalAccess};
use crate::engine::shm::plan::{GrantRange, grant_ranges, should_delegate};
use crate::engine::sock::{iov, writev_all};
use crate::engine::socket_link::{Frames, Job, Pending, SocketLink, SocketPath, connect_streams};
use crate::engine::target::{Conn, HeldSync, SessionState};
use crate::engine::transport::{Link, Submission, Transport};
use crate::engine::wire::{CommitOp, HEADER_LEN, status};
use crate::engine::{PARALLEL_COPY_MIN, lock, socket_link, tick, wire};
use crate::registry::GpuHandle;

pub(in crate::engine) mod at_target;
pub(crate) mod frames;
pub(crate) mod plan;
mod pool;
mod proof;

use crate::cross_memory;
use crate::cross_memory::Direction;
use crate::error::{Error, RejectReason};
use crate::memory::MemoryType;
use crate::memory::Piece;
use crate::metrics::Counter;
use crate::small::FastHash;
use crossbeam_channel::{Receiver, Sender};
use proof as local_proof;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A cross-memory link: copies by this process, control on one stream.
pub(in crate::engine) type CmaLink = SocketLink<CmaParts>;

/// How a cross-memory request goes on after its grants and copy.
pub(in crate::engine) enum CmaOutcome {
    /// Commit it (after an `Abort` frame when `aborted`: its copy stopped
    /// or never began, and the target releases its grants and drops its
    /// sync message).
    Commit { aborted: bool },
    /// Nothing more to send: it has finished (refused, aborted before
    /// anything was sent), or the target copies and commits it.
    Done,
}

/// What a checked copy learned of its pieces' sums.
#[derive(Debug)]
enum Summed {
    /// Nothing (the copy did not move every byte itself, or a mapped
    /// copy's sides differed): the local sides are summed at the commit.
    NotYet,
    /// Each piece's CRC32C over its local side, summed as it moved, for
    /// the target to check its own side against.
    Local(Vec<u32>),
    /// Both sides compared here as they moved (the target's pool is
    /// mapped in this process) and equal: the target has nothing left to
    /// check.
    Matched,
}

/// Cross-memory attach: a peer on this host that offers it and whose
/// probe word this process can read. It owns what the path needs on both
/// sides: the probe word it publishes, the target's state of each
/// initiator session ([`CmaSession`]: grants and the proven process), the
/// local proof socket on which same-host initiators prove which process
/// they are (so that this agent may copy for them) with the thread serving
/// it, and the count of the copies it did for them.
///
/// Drop order: the agent stops the proof thread ([`Transport::stop`])
/// before it lets go of its state; the socket closes with the transport,
/// and the sessions' grants unpin as each session closes, or with it.
pub(in crate::engine) struct Shm {
    /// This host's id.
    host: String,
    /// Holds the agent's instance; peers read it back to prove direct
    /// access works (its address is in the descriptor).
    probe_word: Box<u64>,
    /// The target's state of each open session, by the session's ticket
    /// (shared with the proof thread, which binds a proven process to it).
    sessions: Arc<Mutex<HashMap<u128, Arc<CmaSession>>>>,
    /// The local proof socket; `None` when this agent never copies for
    /// initiators.
    proofs: Option<Arc<local_proof::Listener>>,
    /// Set when the agent closes: the proof thread ends.
    stopping: Arc<AtomicBool>,
    /// The thread serving `proofs`, while the agent is open.
    proof_thread: Mutex<Option<JoinHandle<()>>>,
    /// Delegated cross-memory copies this agent has done for initiators.
    delegated: AtomicU64,
    /// Requests this agent copied through a target's shared pool mapped
    /// here (shared with its links).
    pooled: Arc<AtomicU64>,
    /// Shared pools on (`ShmConfig::pools`): the pool channel carries
    /// pools and VMM GPU allocations, both ways.
    pools: bool,
}

impl Shm {
    /// The transport of an agent on `backend` (shm and auto use it) with
    /// `instance` on this host `host`; its local proof socket is bound when
    /// the agent copies for initiators (bound before any descriptor naming
    /// `instance` is published, so no other process can hold the name
    /// first).
    pub(in crate::engine) fn open(
        backend: Backend,
        config: &AgentConfig,
        instance: u64,
        host: &str,
    ) -> Option<Arc<Self>> {
        if !matches!(backend, Backend::Shm | Backend::Auto) {
            return None;
        }
        let proofs = if config.shm.delegate || config.shm.pools {
            match local_proof::Listener::bind(instance) {
                Ok(l) => Some(Arc::new(l)),
                Err(e) => {
                    tracing::info!(agent = %config.name, error = %e, "no local proof socket; this agent does not copy for initiators");
                    None
                }
            }
        } else {
            None
        };
        Some(Arc::new(Self {
            host: host.to_owned(),
            probe_word: Box::new(instance),
            sessions: Arc::default(),
            proofs,
            stopping: Arc::default(),
            proof_thread: Mutex::new(None),
            delegated: AtomicU64::new(0),
            pooled: Arc::default(),
            pools: config.shm.pools,
        }))
    }

    /// The target's state of the open session `ticket`.
    pub(in crate::engine) fn session(&self, ticket: u128) -> Option<Arc<CmaSession>> {
        lock(&self.sessions).get(&ticket).cloned()
    }

    /// Where the probe word lies in this process.
    pub(in crate::engine) fn probe_addr(&self) -> u64 {
        &*self.probe_word as *const u64 as u64
    }

    /// Counts one delegated copy done for an initiator.
    pub(in crate::engine) fn count_delegated(&self) {
        self.delegated.fetch_add(1, Ordering::Relaxed);
    }
}

/// `peer`'s cross-memory offer: its index (what its region keys name it
/// by) and the offer decoded (or why it does not decode); `None` when it
/// makes none.
fn local_access(peer: &AgentDesc) -> Option<(u8, Result<LocalAccess, String>)> {
    let (i, o) = peer.offer(TransportKind::Shm.as_str())?;
    Some((i, frames::decode_offer(&o.info)))
}

/// Whether `peer` is on host `host` and gives the CUDA IPC handles of its
/// GPU regions (its descriptor carries their keys with the shm transport):
/// legacy handles, or (`vmm`: this side asks on the pool channel) VMM
/// allocations.
fn gives_ipc_handles(peer: &AgentDesc, host: &str, vmm: bool) -> bool {
    let Some((i, o)) = peer.offer(TransportKind::Shm.as_str()) else {
        return false;
    };
    frames::offer_is_on(&o.info, host)
        && peer.regions.iter().any(|r| {
            r.mem_type == MemoryType::Vram
                && r.key_for(i).is_some_and(|k| {
                    frames::decode_ipc_key(k).is_some()
                        || vmm && frames::decode_vmm_key(k).is_some()
                })
        })
}

impl Transport for Shm {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn moves(&self, local: MemoryType, remote: MemoryType, peer: &AgentDesc) -> bool {
        match (local, remote) {
            (MemoryType::Dram, MemoryType::Dram) => true,
            // The target's GPU memory, through CUDA IPC, when its GPU is on
            // this host.
            (MemoryType::Dram | MemoryType::Vram, MemoryType::Vram) => {
                gives_ipc_handles(peer, &self.host, self.pools)
            }
            _ => false,
        }
    }

    fn reach(&self, peer: &AgentDesc) -> Result<(), String> {
        let (_, a) =
            local_access(peer).ok_or("the remote agent does not offer cross-memory access")?;
        let a = a?;
        if a.host != self.host {
            return Err(format!(
                "remote agent is on another host (host id {} vs {})",
                a.host, self.host
            ));
        }
        cross_memory::probe(a.pid, a.probe_addr, peer.instance)
    }

    /// The process peers on this host attach to (its probe word)
    /// ([`frames::encode_offer`]).
    fn offer(&self) -> Option<Vec<u8>> {
        Some(frames::encode_offer(&LocalAccess {
            host: self.host.clone(),
            pid: std::process::id(),
            probe_addr: self.probe_addr(),
        }))
    }

    fn connect(&self, cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        // Data bypasses the socket; one stream carries the control.
        let pid = local_access(peer)
            .and_then(|(_, a)| a.ok())
            .map_or(0, |a| a.pid);
        Ok(CmaLink::open(cx, self, peer, pid)?)
    }

    /// For a requester on this host, the exported GPU regions' keys: the
    /// CUDA IPC handles of their allocations ([`frames::encode_ipc_key`];
    /// a handle opens its whole allocation: for same-host peers that ask
    /// only).
    fn describe(&self, cx: Ctx<'_>, desc: &mut AgentDesc, host: Option<&str>) {
        if host != Some(self.host.as_str()) {
            return;
        }
        let Some((i, _)) = desc.offer(TransportKind::Shm.as_str()) else {
            return;
        };
        let exports = cx.registry().ipc_exports();
        for r in &mut desc.regions {
            if r.mem_type != MemoryType::Vram {
                continue;
            }
            let key = match exports.get(&r.key) {
                Some((GpuHandle::Ipc(h), offset)) => frames::encode_ipc_key(*offset, h),
                // Its descriptor goes over the pool channel, which this
                // agent serves with pools on only.
                Some((GpuHandle::Vmm(size), offset)) if self.pools => {
                    frames::encode_vmm_key(*offset, *size)
                }
                _ => continue,
            };
            r.keys.push(RegionKey { transport: i, key });
        }
    }

    /// `desc` with its CUDA IPC handles, asked of the agent itself (over
    /// the authenticated side channel, naming this host), when it is a
    /// same-host agent with GPU memory exported whose descriptor came
    /// without them; `None` otherwise, or when the agent does not answer
    /// with them (its GPU memory is then reached by staging over TCP).
    fn complete(&self, cx: Ctx<'_>, desc: &AgentDesc) -> Option<AgentDesc> {
        let (i, access) = local_access(desc)?;
        let vram = || {
            desc.regions
                .iter()
                .filter(|r| r.mem_type == MemoryType::Vram)
        };
        let wanted = desc.instance != cx.instance()
            && access.is_ok_and(|a| a.host == self.host)
            && vram().next().is_some()
            && vram().all(|r| r.key_for(i).is_none());
        if !wanted {
            return None;
        }
        let live = desc.endpoints.iter().find_map(|ep| match fetch_desc(cx, ep) {
            Ok(live) if live.instance == desc.instance => Some(live),
            Ok(_) => None,
            Err(e) => {
                tracing::info!(agent = %cx.config().name, remote = %desc.name, error = %e, "could not ask for GPU handles; its GPU memory is staged over TCP");
                None
            }
        })?;
        let (li, _) = live.offer(TransportKind::Shm.as_str())?;
        let mut out = desc.clone();
        for r in &mut out.regions {
            let handle = live
                .regions
                .iter()
                .find(|l| l.mem_type == r.mem_type && l.key == r.key && l.desc == r.desc)
                .and_then(|l| l.key_for(li));
            if let (MemoryType::Vram, Some(k)) = (r.mem_type, handle) {
                r.keys.push(RegionKey {
                    transport: i,
                    key: k.to_vec(),
                });
            }
        }
        Some(out)
    }

    fn counters(&self) -> Vec<Counter> {
        vec![
            Counter {
                name: "kvxfer_shm_delegated_copies_total",
                help: "Cross-memory copies this agent did for same-host initiators (delegated).",
                value: self.delegated.load(Ordering::Relaxed),
                labels: Vec::new(),
            },
            Counter {
                name: "kvxfer_shm_pool_copies_total",
                help: "Requests this agent copied through a same-host target's shared pool, mapped here.",
                value: self.pooled.load(Ordering::Relaxed),
                labels: Vec::new(),
            },
        ]
    }

    fn serve_frame(
        &self,
        cx: Ctx<'_>,
        c: &mut Conn<'_, '_, '_>,
        head: &wire::TransportHead,
    ) -> io::Result<Option<Finished<HeldSync>>> {
        self.serve(cx, c, head)
    }

    /// Serves the local proof socket, when there is one: a ticket binds
    /// the connecting process to its open session, once.
    fn start(&self, cx: Ctx<'_>) -> io::Result<()> {
        let Some(l) = &self.proofs else {
            return Ok(());
        };
        let (l, sessions, stopping) = (
            Arc::clone(l),
            Arc::clone(&self.sessions),
            Arc::clone(&self.stopping),
        );
        let (name, timeout) = (cx.config().name.clone(), cx.config().connect_timeout);
        let registry = Arc::clone(cx.registry());
        let t = std::thread::Builder::new()
            .name(format!("kvxfer-local-{name}"))
            .spawn(move || {
                let stop = || stopping.load(Ordering::SeqCst);
                l.serve(timeout, &stop, &|ticket, peer| {
                    let s = lock(&sessions).get(&ticket).cloned()?;
                    if !s.prove(&name, peer) {
                        return None;
                    }
                    let registry = Arc::clone(&registry);
                    Some(Box::new(move |conn| {
                        s.keep_channel(conn, registry, timeout)
                    }))
                });
            })?;
        *lock(&self.proof_thread) = Some(t);
        Ok(())
    }

    fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let sessions: Vec<_> = lock(&self.sessions).values().cloned().collect();
        for s in sessions {
            s.close_channel();
        }
        let t = lock(&self.proof_thread).take();
        if let (Some(l), Some(t)) = (&self.proofs, t) {
            l.wake();
            let _ = t.join();
        }
    }

    fn open_session(&self, ticket: u128, remote: &str) -> Option<Arc<dyn SessionState>> {
        let s = Arc::new(CmaSession::new(remote));
        lock(&self.sessions).insert(ticket, Arc::clone(&s));
        Some(s)
    }

    fn close_session(&self, ticket: u128) {
        let s = lock(&self.sessions).remove(&ticket);
        if let Some(s) = s {
            s.close_channel();
        }
    }

    fn revoke(&self, cx: Ctx<'_>, key: u64) {
        let sessions: Vec<_> = lock(&self.sessions).values().cloned().collect();
        for s in sessions {
            s.revoke(key, cx.config().io_timeout);
        }
    }
}

/// The cross-memory part of a socket link.
pub(in crate::engine) struct CmaParts {
    /// The target's process.
    pid: u32,
    /// Threads a large copy is split over.
    copy_threads: usize,
    /// This agent's probe address and instance, sent with `Delegate` so the
    /// target can prove it reaches this process; `None`: never delegate.
    delegate_probe: Option<(u64, u64)>,
    /// Cleared when the target refuses a delegated copy: later requests do
    /// not ask again.
    delegate_ok: AtomicBool,
    /// The target's GPU regions, when it exports IPC handles.
    ipc: Option<IpcPeer>,
    /// The target's shared pools this process maps (see `engine::pool`);
    /// `None`: pools are off here.
    pools: Option<pool::Pools>,
    /// The transport's count of requests copied through a pool.
    pooled: Arc<AtomicU64>,
    /// The request whose grants (or delegate) the link's sender awaits the
    /// target's answer to, while it does (one at a time).
    awaited: Mutex<Option<u64>>,
    /// The reader hands the awaited answer on here.
    answer: (Sender<u16>, Receiver<u16>),
}

impl CmaParts {
    /// The sender is about to ask the target about `req`: its answer is
    /// awaited (before the question goes out, so that no answer comes
    /// unawaited).
    fn await_answer(&self, req: u64) {
        *lock(&self.awaited) = Some(req);
    }

    /// The reader's `Granted` for `req` with `status`: handed on when it is
    /// the awaited answer; `false` (a protocol violation) when no answer
    /// about `req` is awaited.
    fn take_answer(&self, req: u64, status: u16) -> bool {
        let mut awaited = lock(&self.awaited);
        if *awaited != Some(req) {
            return false;
        }
        *awaited = None;
        self.answer.0.try_send(status).is_ok()
    }
}

/// A same-host peer's GPU regions, reached through CUDA IPC: a legacy
/// handle from the descriptor, or (VMM memory) the allocation's file
/// descriptor, asked for on the pool channel.
struct IpcPeer {
    /// The peer is this process: its device addresses are this one's.
    same_process: bool,
    /// By region key: the region's start (the peer's address), its
    /// allocation's handle, and where the region starts in it.
    regions: HashMap<u64, (u64, GpuHandle, u64), FastHash>,
    /// Allocations opened, by allocation and device; closed with the link.
    opened: Mutex<HashMap<(Opened, u32), crate::gpu::IpcMapping>>,
}

/// An allocation of the peer's opened here: by its legacy handle, or (VMM)
/// by its base address in the peer.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Opened {
    Ipc([u8; 64]),
    Vmm(u64),
}

impl IpcPeer {
    /// The IPC regions `peer` exports to agents of host `host` (VMM ones
    /// when `vmm`: this side asks for them on the pool channel).
    fn new(peer: &AgentDesc, host: &str, vmm: bool) -> Option<Self> {
        let (i, a) = local_access(peer)?;
        let a = a.ok().filter(|a| a.host == host)?;
        // A key that is not an IPC key, or whose allocation would start
        // below address 0, gives no handle: requests to its region fail.
        let regions: HashMap<_, _, FastHash> = peer
            .regions
            .iter()
            .filter(|r| r.mem_type == MemoryType::Vram)
            .filter_map(|r| {
                let key = r.key_for(i)?;
                let (offset, handle) = match frames::decode_ipc_key(key) {
                    Some((offset, h)) => (offset, GpuHandle::Ipc(h)),
                    None if vmm => {
                        let (offset, size) = frames::decode_vmm_key(key)?;
                        (offset, GpuHandle::Vmm(size))
                    }
                    None => return None,
                };
                (r.desc.addr >= offset).then_some((r.key, (r.desc.addr, handle, offset)))
            })
            .collect();
        if regions.is_empty() {
            return None;
        }
        Some(IpcPeer {
            same_process: a.pid == std::process::id(),
            regions,
            opened: Mutex::new(HashMap::default()),
        })
    }

    /// Where the peer's address `addr`, in its region `key`, is in this
    /// process (opening the region's allocation on `device` the first
    /// time; a VMM allocation's descriptor asked for on `pools`).
    fn address(
        &self,
        key: u64,
        addr: u64,
        device: u32,
        remote: &str,
        pools: Option<&pool::Pools>,
    ) -> Result<u64, Error> {
        if self.same_process {
            return Ok(addr);
        }
        let &(start, handle, offset) =
            self.regions
                .get(&key)
                .ok_or_else(|| Error::BackendUnavailable {
                    backend: "shm",
                    reason: format!(
                        "remote agent {remote:?} exported a GPU region without a CUDA IPC handle"
                    ),
                })?;
        let which = match handle {
            GpuHandle::Ipc(h) => Opened::Ipc(h),
            GpuHandle::Vmm(_) => Opened::Vmm(start - offset),
        };
        let mut opened = lock(&self.opened);
        let base = match opened.entry((which, device)) {
            std::collections::hash_map::Entry::Occupied(e) => e.get().base(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let mapping = match handle {
                    GpuHandle::Ipc(h) => crate::gpu::IpcMapping::open(device, &h)?,
                    GpuHandle::Vmm(size) => {
                        let (fd, given) = pools.and_then(|p| p.vmm(key)).ok_or_else(|| {
                            Error::BackendUnavailable {
                                backend: "shm",
                                reason: format!(
                                    "remote agent {remote:?} did not hand over its VMM GPU allocation (shared pools off on either side, or its process not proven)"
                                ),
                            }
                        })?;
                        if given != size {
                            return Err(Error::ProtocolViolation {
                                remote: remote.to_owned(),
                                detail: format!(
                                    "a VMM allocation of {given} bytes where its descriptor said {size}"
                                ),
                            });
                        }
                        crate::gpu::IpcMapping::import(device, &fd, size)?
                    }
                };
                v.insert(mapping).base()
            }
        };
        Ok(base + offset + (addr - start))
    }
}

/// A cross-memory request that touches GPU memory: copied by the driver.
struct GpuJob {
    /// The remote pieces' region keys.
    keys: Vec<u64>,
    /// The device whose context copies (the local GPU memory's, else 0).
    device: u32,
    /// Whether the local memory is GPU memory too (both ends then device
    /// memory reachable from `device`'s context: small pieces may go
    /// through one kernel launch).
    local_vram: bool,
}

/// A cross-memory request for the first stream's sender thread: grants,
/// direct copy (or a delegated one), commit.
pub(in crate::engine) struct CmaJob {
    req: u64,
    op: TransferOp,
    pieces: Vec<Piece>,
    /// Each remote piece's region (access key).
    keys: Vec<u64>,
    grants: Vec<GrantRange>,
    sync: Option<Vec<u8>>,
    /// Ask the target to copy (see [`should_delegate`]).
    delegate: bool,
    /// GPU memory: the driver copies (never delegated).
    gpu: Option<GpuJob>,
    /// End-to-end integrity: each piece's remote key (one per piece), so
    /// that the commit carries a check of each (never delegated).
    checked: Option<Vec<u64>>,
    pending: Arc<Pending>,
}

impl SocketPath for CmaParts {
    type Job = CmaJob;

    fn submit(link: Arc<CmaLink>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        link.submit_cma(sub)
    }

    fn on_frame(link: &CmaLink, head: &wire::TransportHead) -> Result<(), Error> {
        match CmaFrame::decode(head) {
            Ok(CmaFrame::Granted { req, status }) => {
                if !link.parts.take_answer(req, status) {
                    return Err(link.violation("a grant answer not awaited"));
                }
                Ok(())
            }
            Ok(other) => Err(link.violation(&format!("unexpected frame {other:?}"))),
            Err(e) => Err(link.violation(&e.to_string())),
        }
    }

    fn run_job(
        link: &CmaLink,
        fd: std::os::fd::RawFd,
        job: CmaJob,
    ) -> Result<Option<Frames>, Error> {
        let CmaJob {
            req,
            op,
            pieces,
            keys,
            grants,
            sync,
            delegate,
            gpu,
            checked,
            pending,
        } = job;
        let delegate = delegate.then_some(sync.as_deref());
        let how = (delegate, gpu.as_ref());
        // A checked copy's per-piece CRC32Cs, summed as it goes.
        let mut sums = Summed::NotYet;
        let summed = checked.is_some().then_some(&mut sums);
        Ok(
            match link.run_cma(
                fd,
                req,
                op,
                (&pieces, &keys),
                &grants,
                how,
                &pending,
                summed,
            )? {
                CmaOutcome::Commit { aborted } => {
                    // The copy is over (an aborted one is refused anyway):
                    // each piece's CRC32C as it lies here, the source of a
                    // WRITE, the destination of a READ; summed by the copy
                    // (right after each call, from cache) or now. None when
                    // the copy compared both sides itself (a mapped pool)
                    // and they matched.
                    let checks = match checked {
                        Some(keys) if !aborted => match sums {
                            Summed::Matched => Vec::new(),
                            Summed::Local(sums) => {
                                let mut t = Vec::with_capacity(pieces.len() * wire::CHECK_ENTRY);
                                for ((p, &k), &c) in pieces.iter().zip(&keys).zip(&sums) {
                                    wire::push_check(&mut t, p.remote, p.len, k, c);
                                }
                                t
                            }
                            // SAFETY: local pieces lie in regions validated
                            // at submit time and held by the request's
                            // guards until it completes.
                            Summed::NotYet => unsafe {
                                socket_link::table(
                                    pieces
                                        .iter()
                                        .zip(&keys)
                                        .map(|(p, &k)| (p.local, p.remote, p.len, k)),
                                )
                            },
                        },
                        _ => Vec::new(),
                    };
                    Some(Frames::commit_beside(
                        req, op, sync, checks, pending, aborted,
                    ))
                }
                CmaOutcome::Done => None,
            },
        )
    }
}

impl CmaLink {
    /// Opens the control stream to `peer`, the process `pid` on this host,
    /// and proves this process to it (so that it may copy for this one)
    /// when delegation is on.
    pub(in crate::engine) fn open(
        cx: Ctx<'_>,
        shm: &Shm,
        peer: &AgentDesc,
        pid: u32,
    ) -> Result<Arc<Self>, Error> {
        let cfg = &cx.config();
        // A target in this very process never copies for it: no proof, no
        // delegation asked.
        let ask = cfg.shm.delegate && pid != std::process::id();
        let mut may_delegate = false;
        let mut session = 0u128;
        let mut proved = None;
        let streams = connect_streams(cx, peer, 1, |_, _, _, ticket| {
            session = ticket;
            if ask {
                // The target copies for this process only once the kernel
                // has told it on its local socket that this is the process.
                match local_proof::prove_and_keep(peer.instance, ticket, cfg.connect_timeout) {
                    Ok(s) => {
                        may_delegate = true;
                        proved = Some(s);
                    }
                    Err(e) => {
                        tracing::debug!(remote = %peer.name, error = %e, "no local proof; the target will not copy for this agent")
                    }
                }
            }
            Ok(())
        })?;
        let parts = CmaParts {
            pid,
            copy_threads: cfg.shm.copy_threads,
            delegate_probe: cfg.shm.delegate.then(|| (shm.probe_addr(), cx.instance())),
            delegate_ok: AtomicBool::new(may_delegate),
            awaited: Mutex::new(None),
            answer: crossbeam_channel::bounded(1),
            ipc: IpcPeer::new(peer, cx.host(), cfg.shm.pools),
            // A target in this very process too: its pool is mapped a
            // second time here, as for any other process.
            pools: cfg.shm.pools.then(|| {
                let wait = cfg.connect_timeout.min(cfg.io_timeout);
                pool::Pools::new(peer.instance, session, wait, proved.take())
            }),
            pooled: Arc::clone(&shm.pooled),
        };
        let path = DataPath {
            transport: TransportKind::Shm,
            device: None,
            mechanism: "cross-memory attach (process_vm_writev/readv), one copy; the target's shared pools mapped here, one memcpy; the target's GPU memory through CUDA IPC, one device copy",
        };
        Self::start(cx, peer, streams, parts, path)
    }

    /// Submits a cross-memory request: the link's first stream grants,
    /// copies (or delegates) and commits it.
    fn submit_cma(self: &Arc<Self>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        let Submission {
            req,
            resolved,
            sync,
            ..
        } = sub;
        let (id, completion) = self.in_flight.start(&self.meter, req.local.total_len());
        let pending = Pending::new(&completion, 1, resolved.guards, None);
        self.insert(id, Arc::clone(&pending))?;
        self.clock.touch();
        let job = Job::Path(CmaJob {
            req: id,
            op: req.op,
            pieces: req
                .local
                .descs
                .iter()
                .zip(&req.remote.descs)
                .map(|(l, r)| Piece {
                    local: l.addr,
                    remote: r.addr,
                    len: l.len,
                })
                .collect(),
            grants: grant_ranges(&req.remote, &resolved.keys),
            keys: resolved.keys.clone(),
            gpu: (req.remote.mem_type == MemoryType::Vram).then(|| GpuJob {
                keys: resolved.keys.clone(),
                device: if req.local.mem_type == MemoryType::Vram {
                    req.local.descs.first().map_or(0, |d| d.device_id)
                } else {
                    0
                },
                local_vram: req.local.mem_type == MemoryType::Vram,
            }),
            delegate: req.remote.mem_type != MemoryType::Vram
                && !req.integrity
                && should_delegate(req),
            checked: req.integrity.then(|| {
                // One key per remote descriptor, as per piece.
                resolved.keys.clone()
            }),
            sync,
            pending,
        });
        if self.streams[0].tx.send(job).is_err() {
            self.fail(Error::Closed);
        }
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }

    /// Waits for the target's answer to a request's grants (or delegate),
    /// awaited since [`CmaParts::await_answer`].
    fn wait_answer(&self) -> Result<u16, Error> {
        loop {
            match self.parts.answer.1.recv_timeout(tick(self.io_timeout)) {
                Ok(st) => return Ok(st),
                Err(_) => {
                    if let Some(e) = &lock(&self.pending).broken {
                        return Err(e.clone());
                    }
                }
            }
        }
    }

    /// Asks the target to do a granted request's copy and commit it with
    /// `sync`. `Ok(true)`: done (its `Ack` completes the request);
    /// `Ok(false)`: refused, the caller copies and commits (and this link
    /// asks no more); `Err`: the target's copy failed, the link is broken.
    fn run_delegate(
        &self,
        fd: std::os::fd::RawFd,
        req: u64,
        op: TransferOp,
        pieces: &[Piece],
        sync: Option<&[u8]>,
        (probe_addr, instance): (u64, u64),
    ) -> Result<bool, Error> {
        let mut table = Vec::with_capacity(pieces.len() * frames::DELEGATE_ENTRY);
        for p in pieces {
            table.extend_from_slice(&p.remote.to_le_bytes());
            table.extend_from_slice(&p.local.to_le_bytes());
            table.extend_from_slice(&p.len.to_le_bytes());
        }
        let hdr = CmaFrame::Delegate(frames::Delegate {
            req,
            op: match op {
                TransferOp::Write => CommitOp::Write,
                TransferOp::Read => CommitOp::Read,
            },
            count: pieces.len() as u32,
            pid: std::process::id(),
            probe_addr,
            instance,
            sync_len: sync.map_or(0, |m| m.len() as u32),
            has_sync: sync.is_some(),
        })
        .encode();
        let body = sync.unwrap_or_default();
        let mut iovs = [
            iov(hdr.as_ptr(), HEADER_LEN),
            iov(table.as_ptr(), table.len()),
            iov(body.as_ptr(), body.len()),
        ];
        self.parts.await_answer(req);
        // SAFETY: the iovecs point into `hdr`, `table` and `body`, alive for
        // the call.
        unsafe { writev_all(fd, &mut iovs, &self.clock, self.io_timeout) }
            .map_err(|e| self.io_error(e))?;
        match self.wait_answer()? {
            status::OK => {
                self.clock.touch();
                Ok(true)
            }
            status::DELEGATE_REFUSED => {
                tracing::debug!(remote = %self.remote, "target declined delegated copies; copying here");
                self.parts.delegate_ok.store(false, Ordering::Relaxed);
                Ok(false)
            }
            st => Err(Error::ConnectionLost {
                remote: self.remote.clone(),
                cause: Arc::new(io::Error::other(format!(
                    "the target's delegated cross-memory copy failed (status {st})"
                ))),
            }),
        }
    }

    /// The copy of a granted request that touches the target's GPU memory:
    /// each piece through the target's opened IPC allocation, all issued
    /// at once, waited for before returning.
    fn copy_gpu(&self, op: TransferOp, pieces: &[Piece], g: &GpuJob) -> Result<(), Error> {
        let ipc = self
            .parts
            .ipc
            .as_ref()
            .ok_or_else(|| Error::BackendUnavailable {
                backend: "shm",
                reason: format!(
                    "remote agent {:?} offers no CUDA IPC access to its GPU memory",
                    self.remote
                ),
            })?;
        let mut abs = Vec::with_capacity(pieces.len());
        // Within one region the mapping is an offset: looked up once per
        // run of pieces in the same region (a KV cache's thousands of
        // fragments mostly share one), as (key, remote address, mapped).
        let mut last: Option<(u64, u64, u64)> = None;
        for (p, &key) in pieces.iter().zip(&g.keys) {
            let remote = match last {
                Some((k, at, mapped)) if k == key => mapped.wrapping_add(p.remote.wrapping_sub(at)),
                _ => {
                    let pools = self.parts.pools.as_ref();
                    let mapped = ipc.address(key, p.remote, g.device, &self.remote, pools)?;
                    last = Some((key, p.remote, mapped));
                    mapped
                }
            };
            abs.push(match op {
                TransferOp::Write => (remote, p.local, p.len),
                TransferOp::Read => (p.local, remote, p.len),
            });
        }
        // SAFETY: local pieces lie in regions validated at submit time and
        // held by the request's guards; remote ones inside spans the target
        // granted (held until the commit that follows this copy), mapped
        // into this process by the allocation's IPC handle (kept open
        // while the link lives).
        unsafe { crate::gpu::copy_many(&abs, g.device, g.local_vram) }?;
        Ok(())
    }

    /// Grants and direct copy of a cross-memory request; `Err`: the link is
    /// broken.
    ///
    /// `sums` (a checked request's): what the copy here learned of the
    /// pieces' sums when it moved every byte.
    #[allow(clippy::too_many_arguments)]
    fn run_cma(
        &self,
        fd: std::os::fd::RawFd,
        req: u64,
        op: TransferOp,
        (pieces, keys): (&[Piece], &[u64]),
        grants: &[GrantRange],
        (delegate, gpu): (Option<Option<&[u8]>>, Option<&GpuJob>),
        pending: &Pending,
        sums: Option<&mut Summed>,
    ) -> Result<CmaOutcome, Error> {
        if pending.completion.abort_requested() {
            // Nothing sent yet: the target never hears of it.
            self.complete_event(req, pending, Err(Error::Aborted));
            return Ok(CmaOutcome::Done);
        }
        if grants.is_empty() {
            return Ok(CmaOutcome::Commit { aborted: false });
        }
        let dir = match op {
            TransferOp::Write => Direction::Write,
            TransferOp::Read => Direction::Read,
        };
        // Host memory in the target's shared pools, mapped here: no grants.
        // The mappings are held until the copy returns, and the target's
        // deregistration of a pool waits until this process has unmapped
        // it (`engine::pool`), which waits for the hold: the pool's bytes
        // are the target's own until the commit, as under a grant.
        let pooled = match (&self.parts.pools, gpu) {
            (Some(p), None) => p.resolve(pieces, keys, op == TransferOp::Write),
            _ => None,
        };
        if let Some(mapped) = pooled.as_ref().and_then(|p| p.hold(pieces)) {
            let stop = || pending.completion.abort_requested();
            let differs = AtomicBool::new(false);
            // SAFETY: local pieces lie in regions validated at submit time
            // and held by the request's guards until it completes (after the
            // commit that follows); the remote ones lie inside the target's
            // pools (checked by `resolve`), mapped readable (and writable for
            // a WRITE), and held mapped by `mapped` until the copy returns.
            let copied = unsafe {
                cross_memory::copy_parallel(
                    cross_memory::Peer::Mapped {
                        differs: sums.is_some().then_some(&differs),
                    },
                    dir,
                    &mapped.pieces,
                    (self.parts.copy_threads, PARALLEL_COPY_MIN),
                    &stop,
                    None,
                )
            }
            .map_err(|e| self.io_error(e))?;
            drop(mapped);
            self.clock.touch();
            if copied {
                self.parts.pooled.fetch_add(1, Ordering::Relaxed);
                if let Some(sums) = sums {
                    // Both sides matched: checked. Where they did not, the
                    // commit carries the sums of this side for the target
                    // to check its own against (it fails there, logged and
                    // counted by the agent whose memory it is).
                    *sums = if differs.into_inner() {
                        Summed::NotYet
                    } else {
                        Summed::Matched
                    };
                }
            }
            return Ok(CmaOutcome::Commit { aborted: !copied });
        }
        let frames: Vec<[u8; HEADER_LEN]> = grants
            .iter()
            .map(|g| {
                CmaFrame::Grant(frames::Grant {
                    req,
                    mem_type: g.mem_type,
                    addr: g.addr,
                    len: g.len,
                    key: g.key,
                    total: grants.len() as u32,
                })
                .encode()
            })
            .collect();
        let mut iovs: Vec<_> = frames.iter().map(|f| iov(f.as_ptr(), HEADER_LEN)).collect();
        // The target releases the grants its I/O timeout after it admits
        // them (later than this): the copy ends by half of it from here.
        let copy_by = self
            .target_timeout
            .map(|t| (std::time::Instant::now() + t / 2, t / 2));
        self.parts.await_answer(req);
        // SAFETY: the iovecs point into `frames`, alive for the call.
        unsafe { writev_all(fd, &mut iovs, &self.clock, self.io_timeout) }
            .map_err(|e| self.io_error(e))?;
        let st = self.wait_answer()?;
        if st != status::OK {
            self.complete_event(
                req,
                pending,
                // Refused grants: nothing was copied.
                Err(Error::RemoteRejected {
                    remote: self.remote.clone(),
                    reason: RejectReason::from_code(st),
                    landed: crate::error::Landed::Nothing,
                }),
            );
            return Ok(CmaOutcome::Done);
        }
        if pending.completion.abort_requested() {
            return Ok(CmaOutcome::Commit { aborted: true });
        }
        let late = || copy_by.is_some_and(|(by, _)| std::time::Instant::now() >= by);
        let too_late = |pending: &Pending| {
            pending.note_error(Error::Timeout {
                what: "cross-memory copy within the target's grant",
                after: copy_by.map_or(Duration::ZERO, |(_, t)| t),
            });
            Ok(CmaOutcome::Commit { aborted: true })
        };
        if late() {
            return too_late(pending);
        }
        if let Some(g) = gpu {
            // A failure here is the request's, not the link's: recorded,
            // then the request is committed as aborted, which releases its
            // grants and keeps its sync message from being delivered.
            if let Err(e) = self.copy_gpu(op, pieces, g) {
                pending.note_error(e);
                return Ok(CmaOutcome::Commit { aborted: true });
            }
            self.clock.touch();
            return Ok(CmaOutcome::Commit { aborted: false });
        }
        // Each call of the copy starts before the grants' deadline (the
        // last may end after it, by one call's time).
        let stop = || pending.completion.abort_requested() || late();
        let mut summed = sums.is_some().then(|| vec![0u32; pieces.len()]);
        if let (Some(sync), Some((probe_addr, instance))) = (delegate, self.parts.delegate_probe)
            && self.parts.delegate_ok.load(Ordering::Relaxed)
            && self.run_delegate(fd, req, op, pieces, sync, (probe_addr, instance))?
        {
            return Ok(CmaOutcome::Done);
        }
        // SAFETY: local pieces lie in regions validated at submit time and
        // held by the request's guards until it completes, which cannot
        // happen before this copy returns (the commit follows it).
        let copied = unsafe {
            cross_memory::copy_parallel(
                cross_memory::Peer::Process(self.parts.pid),
                dir,
                pieces,
                (self.parts.copy_threads, PARALLEL_COPY_MIN),
                &stop,
                summed.as_deref_mut(),
            )
        }
        .map_err(|e| Error::ConnectionLost {
            remote: self.remote.clone(),
            cause: Arc::new(if e.raw_os_error() == Some(libc::ESRCH) {
                io::Error::new(io::ErrorKind::ConnectionReset, "target process exited")
            } else {
                e
            }),
        })?;
        self.clock.touch();
        if !copied && !pending.completion.abort_requested() {
            return too_late(pending);
        }
        if let (Some(sums), Some(summed)) = (sums, summed)
            && copied
        {
            *sums = Summed::Local(summed);
        }
        Ok(CmaOutcome::Commit { aborted: !copied })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reader hands on one answer about the request the sender awaits
    /// one for; any other (unawaited, another request's, a second one) is
    /// refused, which breaks the link as a protocol violation.
    #[test]
    fn only_the_awaited_answer_is_taken() {
        let p = CmaParts {
            pid: 1,
            copy_threads: 1,
            delegate_probe: None,
            delegate_ok: AtomicBool::new(false),
            ipc: None,
            pools: None,
            pooled: Arc::default(),
            awaited: Mutex::new(None),
            answer: crossbeam_channel::bounded(1),
        };
        assert!(!p.take_answer(5, status::OK), "nothing awaited");
        p.await_answer(5);
        assert!(!p.take_answer(6, status::OK), "another request's");
        assert!(p.take_answer(5, 7));
        assert!(!p.take_answer(5, status::OK), "a second answer");
        assert_eq!(p.answer.1.try_recv(), Ok(7));
        assert!(p.answer.1.try_recv().is_err());
    }

    /// A same-host peer's GPU regions are reached by the IPC keys its
    /// descriptor carries; an offer that does not decode, another host's,
    /// or a key that is not an IPC key (or whose allocation would start
    /// below address 0) gives no handle, and a peer without a decodable
    /// offer is not reached, with the reason.
    #[test]
    fn ipc_handles_come_from_the_shm_keys_of_a_same_host_peer() {
        use crate::desc::{ExportedRegion, TransportOffer};
        use crate::memory::MemoryDesc;
        let region = |key: u64, addr: u64, shm_key: Option<Vec<u8>>| ExportedRegion {
            mem_type: MemoryType::Vram,
            desc: MemoryDesc::new(addr, 4096, 0),
            key,
            keys: shm_key
                .map(|key| RegionKey { transport: 1, key })
                .into_iter()
                .collect(),
            align: 1,
        };
        let offer = |host: &str| {
            frames::encode_offer(&LocalAccess {
                host: host.into(),
                pid: std::process::id() + 1,
                probe_addr: 0,
            })
        };
        let mut peer = AgentDesc {
            name: "peer".into(),
            instance: 9,
            endpoints: vec!["127.0.0.1:1".into()],
            regions: vec![
                region(1, 0x10_0000, Some(frames::encode_ipc_key(0x100, &[1; 64]))),
                region(2, 0x20_0000, Some(vec![2; 64])),
                region(3, 0x80, Some(frames::encode_ipc_key(0x100, &[3; 64]))),
                region(4, 0x40_0000, None),
                region(5, 0x50_0000, Some(frames::encode_vmm_key(0x40, 2 << 20))),
            ],
            transports: vec![
                TransportOffer {
                    name: "rdma".into(),
                    info: b"rxe0".to_vec(),
                },
                TransportOffer {
                    name: "shm".into(),
                    info: offer("h"),
                },
            ],
        };
        assert!(gives_ipc_handles(&peer, "h", true));
        let ipc = IpcPeer::new(&peer, "h", true).expect("region 1 has a handle");
        assert!(!ipc.same_process);
        let mut keys: Vec<_> = ipc.regions.keys().copied().collect();
        keys.sort_unstable();
        assert_eq!(keys, [1, 5]);
        assert_eq!(ipc.regions[&1], (0x10_0000, GpuHandle::Ipc([1; 64]), 0x100));
        assert_eq!(ipc.regions[&5], (0x50_0000, GpuHandle::Vmm(2 << 20), 0x40));
        for key in [2, 3, 4] {
            let e = ipc.address(key, 0x20_0000, 0, "peer", None).unwrap_err();
            assert!(e.to_string().contains("without a CUDA IPC handle"), "{e}");
        }
        // A VMM region without a channel to ask for its allocation on.
        let e = ipc.address(5, 0x50_0000, 0, "peer", None).unwrap_err();
        assert!(e.to_string().contains("did not hand over its VMM"), "{e}");
        // With pools off here, VMM keys give no handle.
        let legacy = IpcPeer::new(&peer, "h", false).unwrap();
        assert!(legacy.regions.contains_key(&1) && !legacy.regions.contains_key(&5));
        let mut only_vmm = peer.clone();
        only_vmm.regions.retain(|r| r.key == 5);
        assert!(gives_ipc_handles(&only_vmm, "h", true));
        assert!(!gives_ipc_handles(&only_vmm, "h", false));
        assert!(IpcPeer::new(&only_vmm, "h", false).is_none());
        assert!(IpcPeer::new(&peer, "elsewhere", true).is_none());
        assert!(!gives_ipc_handles(&peer, "elsewhere", true));
        let shm = Shm::open(
            Backend::Shm,
            &AgentConfig::new("t").with_shm_delegate(false),
            7,
            "h",
        )
        .unwrap();
        let config = AgentConfig::new("t").with_shm_delegate(false);
        let there = Shm::open(Backend::Shm, &config, 7, "elsewhere").unwrap();
        let why = there.reach(&peer).unwrap_err();
        assert!(why.contains("another host"), "{why}");
        peer.transports[1].info.truncate(12);
        assert!(IpcPeer::new(&peer, "h", true).is_none());
        assert!(!gives_ipc_handles(&peer, "h", true));
        let why = shm.reach(&peer).unwrap_err();
        assert!(why.contains("malformed cross-memory offer"), "{why}");
        peer.transports.pop();
        let why = shm.reach(&peer).unwrap_err();
        assert!(why.contains("does not offer cross-memory access"), "{why}");
    }
}
