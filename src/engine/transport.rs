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

use crate::agent::{Backend, TransferRequest, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::indexed::IndexedSegs;
use crate::engine::requests::Finished;
use crate::engine::target::attach;
use crate::engine::target::{Conn, HeldSync, SessionState, violation};
use crate::engine::wire::status;
use crate::engine::{Peer, wire};
use crate::error::Error;
use crate::memory::MemoryType;
use crate::metrics::Counter;
use crate::registry::RegionGuard;
use crate::registry::Registrar;
use crate::small::Few;
use crate::status::Prepared;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;

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
    fn describe(&self, _cx: Ctx<'_>, _desc: &mut AgentDesc, _host: Option<&str>) {}

    /// The descriptor `desc` of a peer being loaded, completed with what
    /// this transport needs of it that the peer gives only when asked
    /// (cross-memory attach: its GPU memory's IPC handles); `None` when it
    /// needs nothing more, or could not get it. By default `None`.
    fn complete(&self, _cx: Ctx<'_>, _desc: &AgentDesc) -> Option<AgentDesc> {
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
    fn connect(&self, cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error>;

    /// Target side: a link of this transport attaches to connection `sock`
    /// of the authenticated initiator `remote` with its message `msg`
    /// ([`attach::attach`]): the answer, and what serves the link while the
    /// connection lasts; or the status refusing it. By default it takes
    /// none ([`status::NO_TRANSPORT`]).
    fn accept(
        &self,
        _cx: Ctx<'_>,
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
        _cx: Ctx<'_>,
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
    fn start(&self, _cx: Ctx<'_>) -> io::Result<()> {
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
    fn revoke(&self, _cx: Ctx<'_>, _key: u64) {}
}

/// A request's local and remote keys, and the holds on its local regions.
pub(in crate::engine) struct Resolved {
    pub(in crate::engine) guards: Few<RegionGuard>,
    /// The transport's local keys, one per local descriptor (transports
    /// that register regions only, see [`Transport::registrar`]).
    pub(in crate::engine) local_keys: Few<u64>,
    /// Access keys of the remote regions (transports that do not register
    /// regions).
    pub(in crate::engine) keys: Vec<u64>,
    /// The transport's remote keys, one per remote descriptor (transports
    /// that register regions only).
    pub(in crate::engine) remote_keys: Few<RemoteKey>,
}

/// A remote region's key on a transport that registers regions, and where
/// the region starts (for transports that address a region by offset).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::engine) struct RemoteKey {
    /// The key (the first one, of a key of several).
    pub(in crate::engine) key: u64,
    /// The region's first address.
    pub(in crate::engine) base: u64,
    /// A key wider than 64 bits, read as several (little-endian each): one
    /// per device of a transport that registers the region with several
    /// (the libfabric transport's rails). `None` for a key of one.
    pub(in crate::engine) keys: Option<Arc<[u64]>>,
    /// The region's access key (the descriptor's `key`), which a transport
    /// that seals its keys in descriptors opens them with.
    pub(in crate::engine) access: u64,
}

/// What a [`PreparedTransfer`] keeps when its transport plans nothing
/// ahead: its local regions held (as on the other paths), nothing else;
/// each submission resolves the request afresh.
pub(in crate::engine) struct PreparedHold {
    _guards: Few<RegionGuard>,
}

impl PreparedHold {
    /// The holds of `resolved`, as a prepared transfer keeps them.
    pub(in crate::engine) fn keep(resolved: Resolved) -> Box<dyn Prepared> {
        Box::new(PreparedHold {
            _guards: resolved.guards,
        })
    }
}

impl Prepared for PreparedHold {
    fn post(&self, _: Option<&[u8]>, _: bool) -> Option<Result<TransferStatus, Error>> {
        None
    }
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
        _cx: Ctx<'_>,
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
        _cx: Ctx<'_>,
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
    pub(in crate::engine) cx: Ctx<'a>,
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
