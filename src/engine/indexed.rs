//! Prepared descriptor lists and transfers made by index: each list
//! resolved once (its local regions, or the peer's keys) and again only
//! when stale; on TCP a transfer's pairs go to the link whole, and its
//! sender threads find the segments (see [`IndexedSegs`]).

#![forbid(unsafe_code)]

use crate::agent::{PreparedTransfer, TransferAgent, TransferOp, TransportKind};
use crate::engine::plan::Seg;
use crate::engine::{Engine, Peer, lock};
use crate::error::Error;
use crate::indexed::{
    Cut, IndexedPairs, IndexedRequest, LocalSide, PreparedDescList, RemoteSide, Resolution,
};
use crate::memory::{MemoryDescs, MemoryType};
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Engine {
    /// [`TransferAgent::prepare_desc_list`].
    pub(in crate::engine) fn prepare_list(
        &self,
        descs: MemoryDescs,
        remote_agent: Option<&str>,
    ) -> Result<Arc<PreparedDescList>, Error> {
        let list =
            PreparedDescList::new(self.inner.instance, remote_agent.map(str::to_owned), descs)?;
        match remote_agent {
            None => {
                self.local_side(&list)?;
            }
            Some(name) if resolvable(list.mem_type()) => {
                let peer = self.peer_or_reload(name)?;
                self.remote_side(&list, &peer)?;
            }
            // Storage: resolved by the requests that name it.
            Some(_) => {}
        }
        Ok(Arc::new(list))
    }

    /// The local side of `list`, resolved again when a deregistration has
    /// happened since.
    fn local_side(&self, list: &PreparedDescList) -> Result<Arc<LocalSide>, Error> {
        let registry = &self.inner.registry;
        let generation = registry.generation();
        if let Some(Resolution::Local(s)) = cached(list)
            && s.generation == generation
        {
            return Ok(s);
        }
        let (regions, of) = registry.locate(list.descs())?;
        let succ = list.successors_within(|i, j| of[i] == of[j]);
        let side = Arc::new(LocalSide {
            generation,
            regions,
            succ: Arc::new(succ),
        });
        store(list, Resolution::Local(Arc::clone(&side)));
        Ok(side)
    }

    /// The remote side of `list` against `peer` (the agent's current
    /// entry), resolved again when the entry changed.
    fn remote_side(
        &self,
        list: &PreparedDescList,
        peer: &Arc<Peer>,
    ) -> Result<Arc<RemoteSide>, Error> {
        if let Some(Resolution::Remote(s)) = cached(list)
            && s.entry == peer.entry
        {
            return Ok(s);
        }
        let descs = list.descs();
        let mut keys = Vec::with_capacity(descs.descs.len());
        let mut hint = None;
        for d in &descs.descs {
            let r = peer.exported(descs.mem_type, d, hint)?;
            hint = Some(r);
            keys.push(r.value.key);
        }
        // Regions have keys of their own (random, 64 bits).
        let succ = list.successors_within(|i, j| keys[i] == keys[j]);
        let side = Arc::new(RemoteSide {
            entry: peer.entry,
            keys,
            succ: Arc::new(succ),
        });
        store(list, Resolution::Remote(Arc::clone(&side)));
        Ok(side)
    }

    /// [`TransferAgent::prepare_indexed`].
    pub(in crate::engine) fn prepare_indexed_request(
        &self,
        req: IndexedRequest,
    ) -> Result<PreparedTransfer, Error> {
        let inner = &self.inner;
        if req.local.owner != inner.instance || req.remote.owner != inner.instance {
            return Err(Error::InvalidRequest(
                "a descriptor list prepared by another agent".into(),
            ));
        }
        if inner.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        let name = req.check_shape()?.to_owned();
        let (lmem, rmem) = (req.local.mem_type(), req.remote.mem_type());
        let data = !req.local_indices.is_empty();
        let peer = self.check_route(lmem, rmem, &name, data)?;
        let local = self.local_side(&req.local)?;
        let kind = peer.transport.kind();
        let remote = if resolvable(rmem) && peer.transport.resolves_remote() {
            Some(self.remote_side(&req.remote, &peer)?)
        } else {
            None
        };
        let rsucc = match &remote {
            Some(r) => Arc::clone(&r.succ),
            None => Arc::new(req.remote.successors()),
        };
        let pairs = Arc::new(IndexedPairs::new(req, Arc::clone(&local.succ), rsucc));
        let bytes = pairs.check_lengths()?;
        // Host memory to a TCP peer: the pairs go to the link as they are.
        if let Some(remote) =
            remote.filter(|_| kind == TransportKind::Tcp && lmem == MemoryType::Dram)
        {
            // Held unless a deregistration came since the list was
            // resolved (then the full path below).
            if let Some(guards) = inner
                .registry
                .hold_current(&local.regions, local.generation)
            {
                let link = peer.link(inner)?;
                let segs = Arc::new(IndexedSegs {
                    pairs: Arc::clone(&pairs),
                    remote,
                    max: inner.config.tcp.segment_size,
                });
                if let Some((kept, runs)) =
                    link.prepare_indexed(Arc::clone(&peer), &segs, bytes, guards)
                {
                    return Ok(PreparedTransfer::indexed(
                        pairs,
                        (bytes, runs),
                        inner.instance,
                        kept,
                    ));
                }
            }
        }
        // Elsewhere: the request its pairs make, prepared as any other.
        let request = pairs.to_request();
        self.prepare_transfer_owned(request)
    }
}

/// Whether lists of this memory type resolve against the peer's exported
/// regions (storage is resolved by the agent that owns it).
fn resolvable(mem: MemoryType) -> bool {
    matches!(mem, MemoryType::Dram | MemoryType::Vram)
}

fn cached(list: &PreparedDescList) -> Option<Resolution> {
    lock(&list.resolved).clone()
}

fn store(list: &PreparedDescList, side: Resolution) {
    *lock(&list.resolved) = Some(side);
}

/// The pairs of a transfer made by index on a TCP link, with what its
/// segments need (the peer's keys, the largest segment): each stream's
/// sender finds its share's segments when it sends them.
pub(in crate::engine) struct IndexedSegs {
    pairs: Arc<IndexedPairs>,
    remote: Arc<RemoteSide>,
    max: u64,
}

impl IndexedSegs {
    /// The walk of its pairs over `streams` streams.
    pub(in crate::engine) fn walk(&self, bytes: u64, streams: usize) -> crate::indexed::Walk {
        self.pairs.walk(bytes, self.max, streams)
    }

    /// The `count` segments from `cut`, into `out` (emptied first).
    pub(in crate::engine) fn expand(&self, cut: Cut, count: usize, out: &mut Vec<Seg>) {
        out.clear();
        let req = &self.pairs.req;
        let (ldescs, rdescs) = (&req.local.descs().descs, &req.remote.descs().descs);
        let mem_type = req.remote.mem_type();
        self.pairs
            .for_each_segment(cut, count, self.max, |k, off, len| {
                let l = ldescs[req.local_indices[k] as usize];
                let j = req.remote_indices[k] as usize;
                let r = rdescs[j];
                out.push(Seg {
                    mem_type,
                    device: r.device_id,
                    local: l.addr + off,
                    local_gpu: None,
                    remote: r.addr + off,
                    len,
                    key: self.remote.keys[j],
                });
            });
    }

    /// The operation.
    pub(in crate::engine) fn op(&self) -> TransferOp {
        self.pairs.req.op
    }
}
