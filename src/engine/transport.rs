//! The transports an engine may use, and the choice among them per peer
//! and memory type.
//!
//! Each [`Transport`] is a value the engine holds: it says which memory it
//! moves to a peer, whether a peer's descriptor lets it reach that peer
//! (and if not, why), and it connects a [`Link`]. The engine keeps the
//! transports its [`Backend`] allows, in order of preference
//! ([`for_backend`]); a peer's transport for a memory type is the first
//! that moves that memory and reaches the peer ([`choose`]), and when none
//! does the error lists every transport's reason.

#![forbid(unsafe_code)]

use crate::agent::{AgentConfig, Backend, TransferRequest, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::cma::Shm;
use crate::engine::indexed::IndexedSegs;
use crate::engine::requests::Finished;
use crate::engine::socket_link::TcpLink;
use crate::engine::submit::{PreparedHold, Resolved};
use crate::engine::target::{Conn, HeldSync, violation};
use crate::engine::wire::status;
use crate::engine::{Engine, Inner, Peer, attach, inproc, rdma, wire};
use crate::error::{Error, RejectReason};
use crate::memory::MemoryType;
use crate::metrics::Counter;
use crate::registry::RegionGuard;
use crate::registry::Registrar;
use crate::small::Few;
use crate::status::Prepared;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

/// One way of moving data to a peer.
pub(in crate::engine) trait Transport: Send + Sync {
    /// What it is, as every status reports it.
    fn kind(&self) -> TransportKind;

    /// Whether it moves a request between this agent's memory of type
    /// `local` and `peer`'s of type `remote` (host memory on both sides
    /// only, unless the transport says otherwise). The one answer to
    /// "does this transport move that memory": choosing a transport and
    /// checking a request both ask it.
    fn moves(&self, local: MemoryType, remote: MemoryType, _peer: &AgentDesc) -> bool {
        local == MemoryType::Dram && remote == MemoryType::Dram
    }

    /// Whether it reaches `peer`, or why not.
    fn reach(&self, peer: &AgentDesc) -> Result<(), String>;

    /// What this agent's descriptor offers of it for peers to read before
    /// they connect ([`TransportOffer`]); `None` when it needs no offer
    /// (peers reach it through the side channel alone).
    fn offer(&self) -> Option<Vec<u8>> {
        None
    }

    /// What it adds to this agent's descriptor `desc`, for a requester on
    /// host `host` (`None`: one that did not say), beyond its offer: the
    /// descriptor's fields for same-host peers (cross-memory attach: the
    /// process to attach to, and the CUDA IPC handles of its exported GPU
    /// memory for a requester on this host). By default nothing.
    fn describe(&self, _inner: &Inner, _desc: &mut AgentDesc, _host: Option<&str>) {}

    /// The descriptor `desc` of a peer being loaded, completed with what
    /// this transport needs of it that the peer gives only when asked
    /// (cross-memory attach: its GPU memory's IPC handles); `None` when it
    /// needs nothing more, or could not get it. By default `None`.
    fn complete(&self, _inner: &Inner, _desc: &AgentDesc) -> Option<AgentDesc> {
        None
    }

    /// The counters it keeps of its own, for the agent's metrics. By
    /// default none.
    fn counters(&self) -> Vec<Counter> {
        Vec::new()
    }

    /// Its registrations of this agent's regions with its device, when it
    /// has one: requests on it carry the regions' keys of this transport
    /// (local ones from the handles, remote ones from the peer's
    /// descriptor) rather than the agents' access keys.
    fn registrar(&self) -> Option<&dyn Registrar> {
        None
    }

    /// Whether a request's remote regions are the peer's exported ones, to
    /// be resolved against its descriptor (`false`: the transport resolves
    /// them itself).
    fn resolves_remote(&self) -> bool {
        true
    }

    /// Longest sync message a request on it carries.
    fn max_sync(&self) -> usize {
        usize::MAX
    }

    /// Opens a link to `peer` (which it reaches).
    fn connect(&self, inner: &Inner, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error>;

    /// Target side: a link of this transport attaches to connection `sock`
    /// of the authenticated initiator `remote` with its message `msg`
    /// ([`attach::attach`]): the answer, and what serves the link while the
    /// connection lasts; or the status refusing it. By default it takes
    /// none ([`status::NO_TRANSPORT`]).
    fn accept(
        &self,
        _inner: &Inner,
        _remote: &str,
        _sock: &TcpStream,
        _msg: &[u8],
    ) -> Result<(Vec<u8>, Option<attach::Attachment>), u16> {
        Err(status::NO_TRANSPORT)
    }

    /// Target side: one of this transport's own frames
    /// ([`Frame::Transport`], its transport fields `head`) came on data
    /// connection `c`; the transport reads its body, answers, and returns
    /// the request it finished, if any. By default it takes none: a
    /// protocol violation, which closes the connection.
    fn serve_frame(
        &self,
        _inner: &Inner,
        _c: &mut Conn<'_, '_, '_>,
        _head: &wire::TransportHead,
    ) -> io::Result<Option<Finished<HeldSync>>> {
        Err(violation(format!("{} takes no frames", self.kind())))
    }

    /// Starts what serves it beside the agent's connections (a thread of
    /// its own), once the agent listens. By default nothing.
    ///
    /// # Errors
    /// It could not be started: the agent does not open.
    fn start(&self, _inner: &Inner) -> io::Result<()> {
        Ok(())
    }

    /// Stops what [`start`](Self::start) started (the agent is closing,
    /// and accepts no more connections) and waits for it.
    fn stop(&self) {}

    /// Target side: the session of a link of the authenticated initiator
    /// `remote`, named by its `ticket`, opened (before the initiator hears
    /// of it); what this
    /// transport keeps for it, which the engine tells of the session's
    /// requests until [`close_session`](Self::close_session). By default
    /// nothing.
    fn open_session(&self, _ticket: u128, _remote: &str) -> Option<Arc<dyn SessionState>> {
        None
    }

    /// Target side: the session `ticket` closed (its last connection
    /// ended): let go of what [`open_session`](Self::open_session) made.
    fn close_session(&self, _ticket: u128) {}

    /// The shared pool registered as region `key` was deregistered (no
    /// request holds it): every peer this transport let map it must have
    /// unmapped it when this returns (within the agent's I/O timeout, after
    /// which a silent peer is cut off). By default nothing was handed out.
    fn revoke(&self, _inner: &Inner, _key: u64) {}
}

/// What a transport keeps at the target for one initiator's session
/// ([`Transport::open_session`]): the engine tells it when the session's
/// requests commit and finish, and lets its holds expire.
pub(in crate::engine) trait SessionState: Send + Sync {
    /// The refusal `req`'s commit must carry for this transport's part in
    /// it (a hold of it expired), if any.
    fn commit_refusal(&self, _req: u64) -> Option<RejectReason> {
        None
    }

    /// `req` finished (before its sync message is delivered and its
    /// acknowledgement sent): nothing of it is touched any more.
    fn finished(&self, _req: u64) {}

    /// Holds of requests older than `lifetime` expire (called at most
    /// about once a second while a connection of the session lives).
    fn sweep(&self, _lifetime: Duration) {}
}

/// An open connection to one peer, made by the transport its path names
/// ([`Transport::connect`]). The engine checks and resolves a request (agent,
/// shape, memory type, local holds, the peer's keys) and hands it to the
/// peer's link; the link moves the data and completes the status.
pub(in crate::engine) trait Link: Send + Sync {
    /// Whether it broke: the next request opens a new one.
    fn is_broken(&self) -> bool;

    /// Breaks it (the first cause wins): its requests in flight fail with
    /// `cause` once nothing touches their memory any more.
    fn fail(&self, cause: Error);

    /// Waits until its threads have ended (after [`fail`](Self::fail)).
    fn join(&self);

    /// Starts a checked and resolved request; never blocks on the peer.
    fn submit(self: Arc<Self>, sub: Submission<'_>) -> Result<TransferStatus, Error>;

    /// Posts `req` again, unchanged since this link last took it, without
    /// resolving it (the engine checked that the agent is open and that
    /// this is the peer's current link); `None`, with nothing held or
    /// posted, when the link keeps no such request: the engine submits it
    /// in full. By default it keeps none.
    fn resubmit(
        &self,
        _engine: &Engine,
        _req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        None
    }

    /// Lets go of what it remembers of earlier requests (see
    /// [`resubmit`](Self::resubmit)): the peer's descriptor was loaded
    /// again, and its keys may have changed.
    fn forget(&self) {}

    /// What a [`PreparedTransfer`] of `req` keeps. By default the holds on
    /// its local regions only: the request is resolved again on every
    /// submission.
    fn prepare(
        self: Arc<Self>,
        _engine: &Engine,
        _peer: Arc<Peer>,
        _req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<Box<dyn Prepared>, Error> {
        Ok(PreparedHold::keep(resolved))
    }

    /// What a [`PreparedTransfer`] made by index keeps, when the link
    /// takes such transfers' pairs whole (`guards`: holds on the local
    /// list's regions; `bytes`: what the pairs move), and the number of
    /// pieces after merging. `None`: the link plans requests only (the
    /// pairs are then made into one).
    fn prepare_indexed(
        self: Arc<Self>,
        _peer: Arc<Peer>,
        _segs: &Arc<IndexedSegs>,
        _bytes: u64,
        _guards: Few<RegionGuard>,
    ) -> Option<(Box<dyn Prepared>, usize)> {
        None
    }
}

/// A request on its way to a link: checked, its local regions held, its
/// remote keys resolved.
pub(in crate::engine) struct Submission<'a> {
    pub(in crate::engine) engine: &'a Engine,
    pub(in crate::engine) req: &'a TransferRequest,
    pub(in crate::engine) resolved: Resolved,
    /// The sync message (taken apart from the request, which the caller
    /// keeps).
    pub(in crate::engine) sync: Option<Vec<u8>>,
    /// Ordered after every earlier request to the peer (a data-less
    /// notification).
    pub(in crate::engine) fence: bool,
    /// The registry's generation read before the local regions were held.
    pub(in crate::engine) generation: u64,
}

/// TCP streams: reaches every peer (their endpoints were already reached
/// for the descriptor). It also carries requests to a peer's storage (FILE
/// and BLK regions, which its agent reads and writes), for agents of every
/// socket backend.
pub(in crate::engine) struct Tcp {
    /// Whether it moves host memory too (else storage only: the backend
    /// moves host memory another way).
    pub(in crate::engine) host_memory: bool,
}

impl Transport for Tcp {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn moves(&self, local: MemoryType, remote: MemoryType, _peer: &AgentDesc) -> bool {
        // GPU memory through staging buffers, on either side.
        local.is_virtual_address()
            && match remote {
                MemoryType::Dram | MemoryType::Vram => self.host_memory,
                MemoryType::File | MemoryType::Blk => true,
                // A peer's objects from host memory: assembled and PUT by
                // its agent, or GET into its bounce buffer.
                MemoryType::Obj => local == MemoryType::Dram,
            }
    }

    fn reach(&self, _peer: &AgentDesc) -> Result<(), String> {
        Ok(())
    }

    fn connect(&self, inner: &Inner, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        Ok(TcpLink::open(inner, peer)?)
    }
}

/// The transports with a device of their own that an agent on `backend`
/// uses, opened (in order of preference; `config` records what they chose).
///
/// # Errors
/// A transport the backend requires that cannot open its device.
pub(in crate::engine) fn open_devices(
    backend: Backend,
    config: &mut AgentConfig,
) -> Result<Vec<Arc<dyn Transport>>, Error> {
    let mut v: Vec<Arc<dyn Transport>> = Vec::new();
    if let Some(t) = rdma::transport::Rdma::open(backend, config)? {
        v.push(Arc::new(t));
    }
    #[cfg(feature = "fabric")]
    if let Some(t) = crate::engine::fabric::Fabric::open(backend, config)? {
        v.push(Arc::new(t));
    }
    #[cfg(not(feature = "fabric"))]
    if backend == Backend::Fabric {
        return Err(Error::BackendUnavailable {
            backend: "fabric",
            reason: "kvxfer was built without the `fabric` feature".into(),
        });
    }
    Ok(v)
}

/// The transports of an agent on `backend` (`devices`: those with a device
/// of their own it opened, see [`open_devices`]), in order of preference:
/// `auto` prefers cross-memory attach on this host, then RDMA (when this
/// agent has a device), then TCP. The shm and RDMA backends reach a peer's
/// storage over TCP.
pub(in crate::engine) fn for_backend(
    backend: Backend,
    devices: Vec<Arc<dyn Transport>>,
    shm: Option<Arc<Shm>>,
) -> Vec<Arc<dyn Transport>> {
    let shm = shm.map(|s| s as Arc<dyn Transport>);
    let tcp = |host_memory| Arc::new(Tcp { host_memory }) as Arc<dyn Transport>;
    match backend {
        Backend::Tcp => vec![tcp(true)],
        Backend::Shm => shm.into_iter().chain([tcp(false)]).collect(),
        Backend::Rdma | Backend::Fabric => devices.into_iter().chain([tcp(false)]).collect(),
        Backend::InProcess => vec![Arc::new(inproc::InProcess)],
        Backend::Auto => shm.into_iter().chain(devices).chain([tcp(true)]).collect(),
    }
}

/// The transport to `peer` for requests between this agent's memory of
/// type `local` and the peer's of type `remote`: the first of `transports`
/// that moves them and reaches the peer.
///
/// # Errors
/// [`Error::BackendUnavailable`] naming `backend`, with every transport's
/// reason, when none does.
pub(in crate::engine) fn choose(
    transports: &[Arc<dyn Transport>],
    backend: Backend,
    peer: &AgentDesc,
    local: MemoryType,
    remote: MemoryType,
) -> Result<Arc<dyn Transport>, Error> {
    let mut why = Vec::new();
    for t in transports {
        if !t.moves(local, remote, peer) {
            why.push(format!("{}: does not move {remote} memory", t.kind()));
            continue;
        }
        match t.reach(peer) {
            Ok(()) => {
                if !why.is_empty() {
                    tracing::info!(remote = %peer.name, mem_type = %remote, transport = %t.kind(), passed_over = %why.join("; "), "data path chosen after others");
                }
                return Ok(Arc::clone(t));
            }
            Err(reason) => why.push(format!("{}: {reason}", t.kind())),
        }
    }
    Err(Error::BackendUnavailable {
        backend: backend.as_str(),
        reason: format!(
            "remote agent {:?}, {remote} memory: {}",
            peer.name,
            why.join("; ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{ExportedRegion, RegionKey, TransportOffer};
    use crate::engine::cma_wire;
    use crate::engine::cma_wire::LocalAccess;
    use crate::engine::storage_link;
    use crate::memory::MemoryDesc;

    /// What the RDMA transport answers, without a device.
    struct Rdma;

    impl Transport for Rdma {
        fn kind(&self) -> TransportKind {
            TransportKind::Rdma
        }

        fn moves(&self, local: MemoryType, remote: MemoryType, _peer: &AgentDesc) -> bool {
            rdma::transport::moves(local, remote)
        }

        fn reach(&self, peer: &AgentDesc) -> Result<(), String> {
            rdma::transport::reach(peer)
        }

        fn connect(&self, _inner: &Inner, _peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
            unreachable!("not connected in these tests")
        }
    }

    fn shm_on(host: &str) -> Option<Arc<Shm>> {
        let config = AgentConfig::new("t").with_shm_delegate(false);
        Shm::open(Backend::Shm, &config, 7, host)
    }

    fn rdma_if(has_device: bool) -> Vec<Arc<dyn Transport>> {
        has_device
            .then(|| Arc::new(Rdma) as Arc<dyn Transport>)
            .into_iter()
            .collect()
    }

    fn desc(rdma: bool, local: Option<(&str, u32)>) -> AgentDesc {
        AgentDesc {
            name: "peer".into(),
            instance: 7,
            endpoints: vec!["127.0.0.1:1".into()],
            regions: Vec::new(),
            transports: rdma
                .then(|| TransportOffer {
                    name: "rdma".into(),
                    info: b"rxe0".to_vec(),
                })
                .into_iter()
                .chain(local.map(|(host, pid)| TransportOffer {
                    name: "shm".into(),
                    info: cma_wire::encode_offer(&LocalAccess {
                        host: host.into(),
                        pid,
                        probe_addr: 0,
                    }),
                }))
                .collect(),
        }
    }

    #[test]
    fn auto_prefers_shm_then_rdma_then_tcp() {
        let auto = for_backend(Backend::Auto, rdma_if(true), shm_on("this-host"));
        let kinds: Vec<_> = auto.iter().map(|t| t.kind()).collect();
        assert_eq!(
            kinds,
            [TransportKind::Shm, TransportKind::Rdma, TransportKind::Tcp]
        );
        // Another host with a device: RDMA; without one: TCP.
        let other = desc(true, Some(("other-host", 1)));
        let dram = MemoryType::Dram;
        let kind = |ts: &[Arc<dyn Transport>], peer: &AgentDesc| {
            choose(ts, Backend::Auto, peer, dram, dram).unwrap().kind()
        };
        assert_eq!(kind(&auto, &other), TransportKind::Rdma);
        let plain = desc(false, None);
        assert_eq!(kind(&auto, &plain), TransportKind::Tcp);
        // No device here: RDMA is not in the list at all.
        let no_dev = for_backend(Backend::Auto, rdma_if(false), shm_on("this-host"));
        assert_eq!(kind(&no_dev, &other), TransportKind::Tcp);
    }

    #[test]
    fn no_transport_is_a_typed_error_with_every_reason() {
        let rdma = for_backend(Backend::Rdma, rdma_if(true), None);
        let dram = MemoryType::Dram;
        let e = choose(&rdma, Backend::Rdma, &desc(false, None), dram, dram)
            .map(|t| t.kind())
            .unwrap_err();
        match e {
            Error::BackendUnavailable { backend, reason } => {
                assert_eq!(backend, "rdma");
                assert!(reason.contains("no RDMA device"), "{reason}");
            }
            other => panic!("{other}"),
        }
        let shm = for_backend(Backend::Shm, rdma_if(false), shm_on("h"));
        let e = choose(
            &shm,
            Backend::Shm,
            &desc(true, Some(("elsewhere", 1))),
            dram,
            dram,
        )
        .map(|t| t.kind())
        .unwrap_err();
        assert!(
            matches!(&e, Error::BackendUnavailable { backend: "shm", reason } if reason.contains("another host")),
            "{e}"
        );
        // A memory type no transport moves: each says so.
        let auto = for_backend(Backend::Auto, rdma_if(true), shm_on("h"));
        let e = choose(
            &auto,
            Backend::Auto,
            &desc(true, None),
            MemoryType::Vram,
            MemoryType::Obj,
        )
        .map(|t| t.kind())
        .unwrap_err();
        let text = e.to_string();
        for k in ["shm", "rdma", "tcp"] {
            assert!(text.contains(&format!("{k}: does not move")), "{text}");
        }
    }

    /// One answer to "which memory does a transport move": the pairs of
    /// (this agent's, the peer's) memory types each transport takes.
    #[test]
    fn each_transport_says_which_memory_it_moves() {
        use MemoryType::{Blk, Dram, File, Obj, Vram};
        let mut peer = desc(true, Some(("h", 1)));
        let tcp = Tcp { host_memory: true };
        let storage_only = Tcp { host_memory: false };
        let shm_arc = shm_on("h").expect("the shm backend has the shm transport");
        let shm: &Shm = &shm_arc;
        for (l, r) in [(Dram, Dram), (Vram, Dram), (Dram, Vram), (Vram, Vram)] {
            assert!(tcp.moves(l, r, &peer), "tcp {l}->{r}");
            assert!(Rdma.moves(l, r, &peer), "rdma {l}->{r}");
            assert!(inproc::InProcess.moves(l, r, &peer), "inproc {l}->{r}");
            assert!(!storage_only.moves(l, r, &peer));
            assert!(!storage_link::OwnStorage.moves(l, r, &peer));
        }
        for (l, r) in [(Dram, File), (Vram, Blk)] {
            assert!(tcp.moves(l, r, &peer) && storage_only.moves(l, r, &peer));
            assert!(storage_link::OwnStorage.moves(l, r, &peer));
            assert!(!Rdma.moves(l, r, &peer) && !shm.moves(l, r, &peer));
        }
        for t in [&Rdma as &dyn Transport, shm] {
            assert!(!t.moves(Dram, Obj, &peer) && !t.moves(File, Dram, &peer));
        }
        // A peer's objects: through its agent, from host memory.
        assert!(tcp.moves(Dram, Obj, &peer) && storage_only.moves(Dram, Obj, &peer));
        assert!(!tcp.moves(Vram, Obj, &peer) && !tcp.moves(File, Dram, &peer));
        // Objects: the agent's own storage, from host memory or GPU memory
        // (through a host buffer per HTTP request); never from storage.
        assert!(storage_link::OwnStorage.moves(Dram, Obj, &peer));
        assert!(storage_link::OwnStorage.moves(Vram, Obj, &peer));
        assert!(!storage_link::OwnStorage.moves(File, Obj, &peer));
        // Cross-memory attach: host memory, and the target's GPU memory
        // (CUDA IPC) when its GPU is on this host.
        assert!(shm.moves(Dram, Dram, &peer));
        assert!(!shm.moves(Dram, Vram, &peer) && !shm.moves(Vram, Dram, &peer));
        // A GPU region without its IPC handle (a descriptor served to a
        // requester that did not ask): not through shm.
        peer.regions.push(ExportedRegion {
            mem_type: Vram,
            desc: MemoryDesc::new(0x10_0000, 4096, 0),
            key: 5,
            keys: Vec::new(),
            align: 1,
        });
        assert!(!shm.moves(Dram, Vram, &peer));
        let (i, _) = peer.offer("shm").unwrap();
        peer.regions[0].keys.push(RegionKey {
            transport: i,
            key: cma_wire::encode_ipc_key(0, &[3; 64]),
        });
        assert!(shm.moves(Dram, Vram, &peer) && shm.moves(Vram, Vram, &peer));
        assert!(!shm.moves(Vram, Dram, &peer));
        let elsewhere = desc(true, Some(("elsewhere", 1)));
        peer.transports[usize::from(i)] = elsewhere.transports[usize::from(i)].clone();
        assert!(!shm.moves(Dram, Vram, &peer));
    }
}
