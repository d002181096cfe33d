//! The submit path: check, resolve (local holds, remote keys), plan and hand
//! to the link; the prepared-transfer and repeated-request caches of the
//! RDMA small-request path.

use super::*;

impl Engine {
    /// Whether one more request may be submitted (see
    /// [`Limits::max_requests_in_flight`](crate::Limits::max_requests_in_flight)).
    pub(in crate::engine) fn room_for_one(&self) -> Result<(), Error> {
        let n = self.inner.in_flight.load(Ordering::Relaxed);
        if n >= self.inner.config.limits.max_requests_in_flight {
            return Err(Error::WouldBlock { in_flight: n });
        }
        Ok(())
    }

    /// Submits `req` with `sync` as its sync message (taken apart from the
    /// request, which the caller keeps): checked, resolved, and handed to
    /// the peer's link, whatever its transport.
    pub(in crate::engine) fn submit(
        &self,
        req: &TransferRequest,
        sync: Option<Vec<u8>>,
        fence: bool,
    ) -> Result<TransferStatus, Error> {
        let generation = self.inner.registry.generation();
        let peer = self.check_request(req)?;
        let resolved = self.resolve(req, sync.as_deref(), &peer)?;
        let link = peer.link(&self.inner)?;
        link.submit(Submission {
            engine: self,
            peer: &peer,
            req,
            resolved,
            sync,
            fence,
            generation,
        })
    }

    /// What a [`PreparedTransfer`] of `req` keeps: checked and resolved,
    /// then whatever its link plans ahead.
    pub(in crate::engine) fn prepare(
        &self,
        req: &TransferRequest,
    ) -> Result<Box<dyn std::any::Any + Send + Sync>, Error> {
        let peer = self.check_request(req)?;
        let resolved = self.resolve(req, req.sync_message.as_deref(), &peer)?;
        let link = peer.link(&self.inner)?;
        link.prepare(self, peer, req, resolved)
    }
}

/// What a [`PreparedTransfer`] keeps when its transport plans nothing
/// ahead: its local regions held (as on RDMA), nothing else.
pub(in crate::engine) struct PreparedHold {
    pub(in crate::engine) _guards: Few<RegionGuard>,
}

impl PreparedHold {
    /// The holds of `resolved`, as a prepared transfer keeps them.
    pub(in crate::engine) fn keep(resolved: Resolved) -> Box<dyn std::any::Any + Send + Sync> {
        Box::new(PreparedHold {
            _guards: resolved.guards,
        })
    }
}

impl Engine {
    /// A new request's id and its status, counted in flight and, once it
    /// finishes, in `meter` (a request of `bytes`); its waiters drive
    /// nothing (the link's threads complete it).
    pub(in crate::engine) fn new_request(
        &self,
        meter: &Arc<crate::metrics::Meter>,
        bytes: u64,
    ) -> (u64, Arc<Completion>) {
        let inner = &self.inner;
        let id = inner.next_req.fetch_add(1, Ordering::Relaxed);
        let c = Completion::counted(None, Some(&inner.in_flight)).metered(Some(meter), bytes);
        (id, c)
    }
}

/// Largest request (in descriptors) [`SubmitCache`] remembers: the cache
/// is for latency-bound requests sent again and again; comparing a large
/// request costs what resolving it does.
pub(in crate::engine) const CACHE_MAX_DESCS: usize = 4;

/// The resolution of the last small RDMA request `submit_transfer` took,
/// reused when the next one is the same (same operation, agent and
/// descriptors) and still valid: the peer entry not retired, the link not
/// broken, no deregistration since (the registry's generation). What a
/// caller resubmitting one request gets from
/// [`submit_prepared`](TransferAgent::submit_prepared), without preparing;
/// unlike a prepared transfer it holds no region.
pub(in crate::engine) struct SubmitCache {
    pub(in crate::engine) op: TransferOp,
    pub(in crate::engine) remote_agent: String,
    pub(in crate::engine) local: MemoryDescs,
    pub(in crate::engine) remote: MemoryDescs,
    /// Registry generation read before the regions were resolved.
    pub(in crate::engine) generation: u64,
    pub(in crate::engine) regions: Few<Arc<crate::registry::LocalRegion>>,
    /// Shared with the submissions in flight: a hit takes one reference
    /// (no copy of the work requests) and lets the cache go.
    pub(in crate::engine) planned: Arc<Planned>,
}

impl SubmitCache {
    pub(in crate::engine) fn matches(&self, req: &TransferRequest) -> bool {
        self.op == req.op
            && self.remote_agent == req.remote_agent
            && self.local == req.local
            && self.remote == req.remote
    }
}

/// A [`RdmaLink::post_express`] hold for holds already taken: moves `taken`
/// into the lane's list.
pub(in crate::engine) fn hold_all(
    into: &mut Few<RegionGuard>,
    taken: &mut Few<RegionGuard>,
) -> bool {
    std::mem::swap(into, taken);
    true
}

/// An RDMA request resolved against one peer entry and one link, ready to
/// post again (kept by [`SubmitCache`] and by prepared transfers).
pub(in crate::engine) struct Planned {
    pub(in crate::engine) peer: Arc<Peer>,
    pub(in crate::engine) link: Arc<RdmaLink>,
    pub(in crate::engine) wrs: Few<rdma::Wr>,
    /// `Some` for requests whose waiters poll the completion queue.
    pub(in crate::engine) driver: Option<std::sync::Weak<dyn Progress>>,
}

impl Planned {
    /// Whether it still holds: the peer entry not replaced or invalidated,
    /// the link not broken.
    pub(in crate::engine) fn current(&self) -> bool {
        !self.peer.retired.load(Ordering::Acquire) && !self.link.is_broken()
    }
}

/// What an RDMA [`PreparedTransfer`] keeps: the plan, and holds on the
/// local regions (registered, their keys valid, while it lives).
pub(in crate::engine) struct PreparedRdma {
    pub(in crate::engine) planned: Planned,
    pub(in crate::engine) guards: Few<RegionGuard>,
}

/// A request's local and remote keys, and the holds on its local regions.
pub(in crate::engine) struct Resolved {
    pub(in crate::engine) guards: Few<RegionGuard>,
    /// RDMA local keys, one per local descriptor (RDMA path only).
    pub(in crate::engine) lkeys: Few<u32>,
    /// Access keys of the remote regions (socket paths).
    pub(in crate::engine) keys: Vec<u64>,
    /// RDMA remote keys, one per remote descriptor (RDMA path only).
    pub(in crate::engine) rkeys: Few<u32>,
}

impl Engine {
    /// The checks of a request that need no registry: the agent open, the
    /// shape, the memory type, the remote agent known. Returns the peer.
    pub(in crate::engine) fn check_request(
        &self,
        req: &TransferRequest,
    ) -> Result<Arc<Peer>, Error> {
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        req.validate_shape()?;
        self.check_route(
            req.local.mem_type,
            req.remote.mem_type,
            &req.remote_agent,
            !req.local.is_empty(),
        )
    }

    /// The checks of a request that need neither the registry nor its
    /// descriptors: the memory types, the remote agent known and a path to
    /// it that moves them (`data`: the request moves memory, it is not a
    /// notification alone). Returns the peer.
    pub(in crate::engine) fn check_route(
        &self,
        local_mem: MemoryType,
        remote_mem: MemoryType,
        remote_agent: &str,
        data: bool,
    ) -> Result<Arc<Peer>, Error> {
        let inner = &self.inner;
        // Local memory is host or GPU memory; OBJ (an object store) is a
        // target no path reaches.
        let unsupported = if !matches!(local_mem, MemoryType::Dram | MemoryType::Vram) {
            Some(local_mem)
        } else {
            (remote_mem == MemoryType::Obj).then_some(MemoryType::Obj)
        };
        if let Some(mem_type) = unsupported.filter(|_| data) {
            return Err(Error::UnsupportedMemoryType {
                mem_type,
                backend: inner.mode.as_str(),
            });
        }
        // The agent's own storage: its self-peer (its own name with host
        // memory is a loaded peer like any other); a peer's storage: the
        // entry whose path moves it.
        let storage = matches!(remote_mem, MemoryType::File | MemoryType::Blk);
        let peer = if !storage {
            self.peer_or_reload(remote_agent)?
        } else if remote_agent == inner.config.name {
            inner.self_peer()
        } else {
            self.peer_or_reload(remote_agent)?.for_storage()?
        };
        // GPU memory, on either side, only on a path that moves it: TCP
        // (staged) and in-process copies on either side; cross-memory
        // attach when it is the target's, through CUDA IPC.
        let gpu = [local_mem, remote_mem].contains(&MemoryType::Vram);
        if gpu && data {
            let ipc = matches!(peer.path, Path::Cma { .. })
                && remote_mem == MemoryType::Vram
                && peer.desc.gpu.as_ref().is_some_and(|g| g.host == inner.host);
            if !peer.path.moves_vram() && !ipc {
                return Err(Error::UnsupportedMemoryType {
                    mem_type: MemoryType::Vram,
                    backend: peer.path.kind().as_str(),
                });
            }
        }
        // A notification moves no memory: no transport is required for it.
        if !inner.config.required_transports.is_empty() && data {
            let actual = peer.path.kind();
            for mem_type in [local_mem, remote_mem] {
                if let Some(required) = inner.config.required_transport(mem_type)
                    && required != actual
                {
                    return Err(Error::TransportRequired {
                        remote: remote_agent.to_owned(),
                        mem_type,
                        required,
                        actual,
                    });
                }
            }
        }
        Ok(peer)
    }

    /// Looks `req`'s descriptors up: local ones in the registry (held),
    /// remote ones in what `peer` exported; checks the sync message's size.
    pub(in crate::engine) fn resolve(
        &self,
        req: &TransferRequest,
        sync: Option<&[u8]>,
        peer: &Peer,
    ) -> Result<Resolved, Error> {
        let rdma = peer.path == Path::Rdma;
        let mut lkeys = Few::new();
        let guards = self
            .inner
            .registry
            .acquire_local_keyed(&req.local, rdma.then_some(&mut lkeys))?;
        if rdma && req.local.mem_type == MemoryType::Vram && lkeys.contains(&0) {
            // GPU memory an `auto` agent's NIC could not register.
            return Err(Error::BackendUnavailable {
                backend: "rdma",
                reason: "local GPU memory without a GPUDirect RDMA registration".into(),
            });
        }
        if peer.path == Path::Storage {
            // The remote regions are this agent's own: its storage link
            // resolves (and holds) them.
            return Ok(Resolved {
                guards,
                lkeys,
                keys: Vec::new(),
                rkeys: Few::new(),
            });
        }
        // Access keys for the socket paths, remote keys for RDMA.
        let mut keys = Vec::with_capacity(if rdma { 0 } else { req.remote.descs.len() });
        let mut rkeys = Few::new();
        let mut hint = None;
        for d in &req.remote.descs {
            let r = peer.exported(req.remote.mem_type, d, hint)?;
            hint = Some(r);
            if r.value.align > 1 {
                // A peer's storage opened for direct I/O: refused here, before
                // anything is sent, as the peer would refuse it.
                for (what, value) in [("offset", d.addr), ("length", d.len)] {
                    if !value.is_multiple_of(u64::from(r.value.align)) {
                        return Err(Error::Misaligned {
                            handle: u64::from(d.device_id),
                            what,
                            value,
                            block: r.value.align,
                        });
                    }
                }
            }
            if !rdma {
                keys.push(r.value.key);
            } else {
                rkeys.push(r.value.rkey.ok_or_else(|| Error::BackendUnavailable {
                    backend: "rdma",
                    reason: format!(
                        "remote agent {:?} exported region {:?} without an RDMA registration",
                        req.remote_agent, r.desc
                    ),
                })?);
            }
        }
        if rdma && sync.is_some_and(|m| m.len() > rdma::SYNC_MSG_MAX) {
            return Err(Error::InvalidRequest(format!(
                "sync messages on the RDMA path are at most {} bytes",
                rdma::SYNC_MSG_MAX
            )));
        }
        Ok(Resolved {
            guards,
            lkeys,
            keys,
            rkeys,
        })
    }

    /// Keeps `req`'s resolution for the next identical submission (in the
    /// entry's own allocations when there is one).
    pub(in crate::engine) fn remember(
        &self,
        req: &TransferRequest,
        generation: u64,
        guards: &[RegionGuard],
        planned: Planned,
    ) {
        let Ok(mut slot) = self.inner.submit_cache.try_lock() else {
            return;
        };
        let regions = guards.iter().map(|g| Arc::clone(g.region())).collect();
        match slot.as_deref_mut() {
            Some(c) => {
                c.op = req.op;
                c.remote_agent.clone_from(&req.remote_agent);
                c.local.mem_type = req.local.mem_type;
                c.local.descs.clone_from(&req.local.descs);
                c.remote.mem_type = req.remote.mem_type;
                c.remote.descs.clone_from(&req.remote.descs);
                c.generation = generation;
                c.regions = regions;
                c.planned = Arc::new(planned);
            }
            None => {
                *slot = Some(Box::new(SubmitCache {
                    op: req.op,
                    remote_agent: req.remote_agent.clone(),
                    local: req.local.clone(),
                    remote: req.remote.clone(),
                    generation,
                    regions,
                    planned: Arc::new(planned),
                }))
            }
        }
    }

    /// The latency-bound case in one pass: `req` is the request that
    /// [`SubmitCache`] holds, still valid, one data work request without a
    /// sync message, and the link's express lane takes it. The region holds
    /// go straight into the lane, and the status comes back alone (two
    /// words): no `Result` of this layer's error moved through the calls of
    /// the general path, which on soft-RoCE's 8-byte ping-pong was a fifth
    /// of the library's instructions before the post (the git history of `docs/benchmarks.md`).
    /// `None`, with nothing held or claimed: [`submit_cached`](Self::submit_cached)
    /// and the general path decide (a hit the lane turns away, taken by
    /// another request, is looked up once more there: rare, and the lookup
    /// is a few compares).
    pub(in crate::engine) fn express_cached(
        &self,
        req: &TransferRequest,
    ) -> Option<TransferStatus> {
        if req.sync_message.is_some() {
            return None;
        }
        let slot = self.inner.submit_cache.try_lock().ok()?;
        let c = self.cache_hit(&slot, req)?;
        let p = &c.planned;
        let (Some(driver), [wr]) = (&p.driver, p.wrs.as_slice()) else {
            return None;
        };
        let id = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        let registry = &self.inner.registry;
        let hold = |g: &mut Few<RegionGuard>| registry.hold_into(&c.regions, c.generation, g);
        let completion = p.link.post_express(id, req.op, wr, hold, driver)?;
        let path = Arc::clone(&p.link.path);
        drop(slot);
        Some(TransferStatus::new(id, completion, path))
    }

    /// The entry of the submit cache (`slot`, its lock held) when it holds
    /// `req` and is still valid: the peer entry and the link current, the
    /// agent not closing.
    pub(in crate::engine) fn cache_hit<'a>(
        &self,
        slot: &'a Option<Box<SubmitCache>>,
        req: &TransferRequest,
    ) -> Option<&'a SubmitCache> {
        if req.local.descs.len() > CACHE_MAX_DESCS {
            return None;
        }
        let c = slot.as_deref().filter(|c| c.matches(req))?;
        (c.planned.current() && !self.inner.closing.load(Ordering::Relaxed)).then_some(c)
    }

    /// Submits `req` from [`SubmitCache`] when it holds this request, still
    /// valid; `None`: resolve it in full.
    pub(in crate::engine) fn submit_cached(
        &self,
        req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        if req
            .sync_message
            .as_ref()
            .is_some_and(|m| m.len() > rdma::SYNC_MSG_MAX)
        {
            return None;
        }
        let slot = self.inner.submit_cache.try_lock().ok()?;
        let c = self.cache_hit(&slot, req)?;
        let guards = self.inner.registry.hold_current(&c.regions, c.generation)?;
        // Posted with the entry still locked (no reference on the plan
        // taken and dropped): nothing on the posting path takes this lock,
        // and a thread that finds it taken meanwhile resolves in full.
        let p = &c.planned;
        let r = self.post_planned(
            &p.link,
            req.op,
            Cow::Borrowed(&p.wrs),
            req.sync_message.clone(),
            guards,
            &p.driver,
        );
        drop(slot);
        Some(r)
    }

    /// Posts planned RDMA work requests as request `id`: its status, whose
    /// waiters drive `driver` (`None`: the progress thread completes it).
    pub(in crate::engine) fn post_planned(
        &self,
        link: &Arc<RdmaLink>,
        op: TransferOp,
        wrs: std::borrow::Cow<'_, Few<rdma::Wr>>,
        sync: Option<Vec<u8>>,
        mut guards: Few<RegionGuard>,
        driver: &Option<std::sync::Weak<dyn Progress>>,
    ) -> Result<TransferStatus, Error> {
        let id = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        if let (None, Some(d), [wr]) = (&sync, driver, wrs.as_slice())
            && let Some(c) = link.post_express(id, op, wr, |g| hold_all(g, &mut guards), d)
        {
            // No clock touched: the link's idle check watches the table,
            // which express requests stay out of (their queue pair's own
            // timeouts fail them).
            return Ok(TransferStatus::new(id, c, Arc::clone(&link.path)));
        }
        let driven = driver.is_some();
        let bytes = wrs.iter().map(|w| w.len).sum();
        let completion = Completion::counted(driver.clone(), Some(&self.inner.in_flight))
            .metered(Some(&link.meter), bytes);
        // A sync message is two events: its SEND's completion, and the
        // target's acknowledgement that it delivered it.
        let events = wrs.len() + 2 * usize::from(sync.is_some());
        if events == 0 {
            completion.complete(Ok(()));
            return Ok(TransferStatus::new(id, completion, Arc::clone(&link.path)));
        }
        let pending = Arc::new(Pending {
            completion: Arc::clone(&completion),
            outstanding: AtomicUsize::new(events),
            error: Mutex::new(None),
            failed: AtomicBool::new(false),
            guards: Mutex::new(guards),
            granted: OnceLock::new(),
            undriven: (!driven).then(|| Arc::clone(&link.parts.undriven)),
        });
        link.insert(id, Arc::clone(&pending))?;
        link.clock.touch();
        if !driven {
            // Counted before posting: the progress threads must be on
            // the completion queue by the time it completes.
            link.parts.undriven.fetch_add(1, Ordering::AcqRel);
            link.wake_progress();
        }
        link.post_rdma(id, op, wrs.into_owned(), sync, &pending);
        Ok(TransferStatus::new(id, completion, Arc::clone(&link.path)))
    }
}
