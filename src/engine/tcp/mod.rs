//! The TCP transport ([`Tcp`]): the data in frames over the link's
//! streams, straight from and into registered memory. Its link is the
//! shared socket link (`socket_link`) with nothing of its own but the
//! streams ([`TcpParts`]); this file opens it and plans and posts each
//! request's segments over the streams, whose threads (`socket_link::streams`) write
//! and read them. Its target side is the engine's own (`target::payload`,
//! and a peer's storage in `target::storage`).

use crate::agent::{DataPath, TransferOp, TransferRequest, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::Peer;
use crate::engine::ctx::Ctx;
use crate::engine::indexed::IndexedSegs;
use crate::engine::plan::plan_segments;
use crate::engine::socket_link::{
    Frames, Job, Pending, Segs, SocketLink, SocketPath, Tail, connect_streams,
};
use crate::engine::transport::Resolved;
use crate::engine::transport::{Link, Submission, Transport};
use crate::error::Error;
use crate::integrity::CHECK_CHUNK;
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use crate::small::Few;
use crate::status::Prepared;
use std::sync::Arc;
use std::sync::atomic::Ordering;

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

    fn connect(&self, cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        Ok(TcpLink::open(cx, peer)?)
    }
}

/// A TCP link: the data in frames over `streams_per_peer` streams.
pub(in crate::engine) type TcpLink = SocketLink<TcpParts>;

/// The TCP transport's part of its link: nothing but the streams.
pub(in crate::engine) struct TcpParts;

impl SocketPath for TcpParts {
    type Job = std::convert::Infallible;

    fn submit(link: Arc<TcpLink>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        link.submit_streams(sub)
    }

    fn prepare(
        link: Arc<TcpLink>,
        cx: Ctx<'_>,
        peer: Arc<Peer>,
        req: &TransferRequest,
        resolved: Resolved,
    ) -> Result<Box<dyn Prepared>, Error> {
        Ok(Box::new(link.prepare_streams(cx, peer, req, resolved)))
    }

    fn prepare_indexed(
        link: Arc<TcpLink>,
        peer: Arc<Peer>,
        segs: &Arc<IndexedSegs>,
        bytes: u64,
        guards: Few<RegionGuard>,
    ) -> Option<(Box<dyn Prepared>, usize)> {
        let (kept, runs) = link.prepare_indexed_streams(peer, segs, bytes, guards);
        Some((Box::new(kept), runs))
    }

    fn run_job(
        _: &SocketLink<Self>,
        _: std::os::fd::RawFd,
        job: Self::Job,
    ) -> Result<Option<Frames>, Error> {
        match job {}
    }
}

impl TcpLink {
    /// Opens `streams_per_peer` streams to `peer`.
    pub(in crate::engine) fn open(cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<Self>, Error> {
        let n = cx.config().tcp.streams_per_peer;
        let streams = connect_streams(cx, peer, n, |_, _, _, _| Ok(()))?;
        let path = DataPath {
            transport: TransportKind::Tcp,
            device: streams.handles[0]
                .sock
                .peer_addr()
                .ok()
                .map(|a| a.to_string()),
            mechanism: "TCP streams; the kernel copies between socket and registered memory",
        };
        Self::start(cx, peer, streams, TcpParts, path)
    }

    /// Submits a request on the TCP streams: its segments spread over
    /// them, the commit (with the sync message) on stream 0 after its own
    /// segments.
    pub(in crate::engine) fn submit_streams(
        self: &Arc<Self>,
        sub: Submission<'_>,
    ) -> Result<TransferStatus, Error> {
        let Submission {
            cx,
            req,
            resolved,
            sync,
            fence,
            ..
        } = sub;
        let plan = self.plan_streams(cx, req, &resolved.keys);
        self.post_streams(&plan, sync, fence, req.durable, resolved.guards)
    }

    /// Prepares `req` for repeated submission: its segments planned once
    /// (posting it then costs a few allocations, whatever its size).
    pub(in crate::engine) fn prepare_streams(
        self: &Arc<Self>,
        cx: Ctx<'_>,
        peer: Arc<Peer>,
        req: &TransferRequest,
        resolved: Resolved,
    ) -> PreparedTcp {
        PreparedTcp {
            link: Arc::clone(self),
            peer,
            plan: self.plan_streams(cx, req, &resolved.keys),
            guards: resolved.guards,
        }
    }

    /// `req`'s segments on this link's streams (`keys`: its remote
    /// regions' access keys).
    fn plan_streams(&self, cx: Ctx<'_>, req: &TransferRequest, keys: &[u64]) -> StreamPlan {
        let max = cx.config().tcp.segment_size;
        // A checked READ's segment is summed whole at each end (just before
        // it is sent, once it landed): no larger than what stays in the
        // core's cache meanwhile. A checked WRITE's is summed a chunk at a
        // time as it goes (`write_checked`, `read_checked`).
        let max = if req.integrity && req.op == TransferOp::Read {
            max.min(CHECK_CHUNK as u64)
        } else {
            max
        };
        let plan = plan_segments(req, keys, max, self.streams.len());
        StreamPlan {
            op: req.op,
            checked: req.integrity,
            segments: plan.iter().map(Vec::len).sum(),
            streams: plan
                .into_iter()
                .map(|v| Segs::Planned(Arc::new(v)))
                .collect(),
            bytes: req.local.total_len(),
        }
    }

    /// Prepares a transfer made by index: its pairs cut into one share per
    /// stream (each stream's sender finds its segments); also the number
    /// of pieces after merging.
    pub(in crate::engine) fn prepare_indexed_streams(
        self: &Arc<Self>,
        peer: Arc<Peer>,
        segs: &Arc<IndexedSegs>,
        bytes: u64,
        guards: Few<RegionGuard>,
    ) -> (PreparedTcp, usize) {
        let walk = segs.walk(bytes, self.streams.len());
        let plan = StreamPlan {
            op: segs.op(),
            checked: false,
            segments: walk.segments,
            streams: walk
                .shares
                .iter()
                .map(|&(cut, count)| Segs::Indexed {
                    segs: Arc::clone(segs),
                    cut,
                    count,
                })
                .collect(),
            bytes,
        };
        let kept = PreparedTcp {
            link: Arc::clone(self),
            peer,
            guards,
            plan,
        };
        (kept, walk.runs)
    }

    /// Posts `plan` as a new request: `guards` hold its local regions until
    /// it completes; `fence` orders it after every earlier request (a
    /// notification without data).
    fn post_streams(
        self: &Arc<Self>,
        plan: &StreamPlan,
        mut sync: Option<Vec<u8>>,
        fence: bool,
        durable: bool,
        guards: Few<RegionGuard>,
    ) -> Result<TransferStatus, Error> {
        let (id, completion) = self.in_flight.start(&self.meter, plan.bytes);
        let n = self.streams.len();
        let total = plan.segments;
        let reads = if plan.op == TransferOp::Read {
            total
        } else {
            0
        };
        let fences = if fence { n - 1 } else { 0 };
        let pending = Pending::new(&completion, reads + 1, guards, None);
        self.insert(id, Arc::clone(&pending))?;
        self.clock.touch();
        // Stream 0 carries the commit, after its own segments; every other
        // stream carries its segments (and a fence, for data-less requests).
        for (k, segs) in plan.streams.iter().enumerate().rev() {
            let tail = if k == 0 {
                Tail::Commit {
                    segments: (total + fences) as u64,
                    sync: sync.take(),
                    durable,
                    checks: Vec::new(),
                }
            } else if fence {
                Tail::Fence
            } else if segs.is_empty() {
                continue;
            } else {
                Tail::None
            };
            let job = Job::Frames(Frames {
                req: id,
                op: plan.op,
                segs: segs.clone(),
                tail,
                pending: Arc::clone(&pending),
                aborted: false,
                checked: plan.checked,
            });
            if self.streams[k].tx.send(job).is_err() {
                self.fail(Error::Closed);
                break;
            }
        }
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }
}

/// A request's segments on each stream of a TCP link.
struct StreamPlan {
    op: TransferOp,
    /// End-to-end integrity: its frames carry seals and CRC32Cs.
    checked: bool,
    streams: Vec<Segs>,
    /// Segments on all streams.
    segments: usize,
    /// Bytes of local memory it moves.
    bytes: u64,
}

/// What a TCP [`PreparedTransfer`] keeps: the link and peer entry it was
/// planned on, holds on its local regions, and its segments.
pub(in crate::engine) struct PreparedTcp {
    link: Arc<TcpLink>,
    peer: Arc<Peer>,
    guards: Few<RegionGuard>,
    plan: StreamPlan,
}

impl crate::status::Prepared for PreparedTcp {
    fn post(&self, sync: Option<&[u8]>, durable: bool) -> Option<Result<TransferStatus, Error>> {
        // Its plan still holds: the peer entry not replaced or
        // invalidated, the link not broken.
        if self.peer.retired.load(Ordering::Acquire) || self.link.is_broken() {
            return None;
        }
        Some(self.link.post_streams(
            &self.plan,
            sync.map(<[u8]>::to_vec),
            false,
            durable,
            self.guards.clone(),
        ))
    }
}
