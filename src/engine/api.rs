//! [`TransferAgent`] for [`Engine`]: the contract's methods, each a few
//! lines over the engine's registry, peers and submit path.

use crate::agent::{
    PreparedTransfer, SyncMessages, TransferAgent, TransferRequest, TransferStatus,
};
use crate::desc::AgentDesc;
use crate::engine::peer::fetch_desc;
use crate::engine::{Engine, Peer, SUPPORTED, StorageRoute, lock};
use crate::error::Error;
use crate::memory::{MemoryDescs, MemoryType};
use crate::small::Few;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

impl TransferAgent for Engine {
    fn name(&self) -> &str {
        &self.inner.config.name
    }

    fn backend_name(&self) -> &'static str {
        self.inner.mode.as_str()
    }

    fn open_storage(&self, spec: &crate::storage::StorageSpec) -> Result<u32, Error> {
        self.inner.storage.open(spec)
    }

    fn adopt_storage(&self, fd: std::os::fd::OwnedFd) -> Result<u32, Error> {
        self.inner.storage.adopt(fd)
    }

    fn open_object(
        &self,
        store: &crate::storage::obj::ObjectStore,
        key: &str,
    ) -> Result<u32, Error> {
        self.inner.storage.open_object(store, key)
    }

    fn close_storage(&self, handle: u32) -> Result<(), Error> {
        let in_use = self.inner.registry.has_device_regions(handle);
        self.inner.storage.close(handle, in_use)
    }

    fn remote_transport(&self, name: &str) -> Result<&'static str, Error> {
        Ok(self.inner.peer(name)?.transport.kind().as_str())
    }

    unsafe fn register_memory(&self, descs: &MemoryDescs) -> Result<(), Error> {
        let storage = matches!(
            descs.mem_type,
            MemoryType::File | MemoryType::Blk | MemoryType::Obj
        );
        if storage {
            for d in &descs.descs {
                self.inner.storage.check_region(descs.mem_type, d)?;
            }
        }
        let mut gpu = Vec::new();
        if descs.mem_type == MemoryType::Vram {
            for d in &descs.descs {
                gpu.push(crate::gpu::admit_registration(d)?);
            }
        }
        // SAFETY: forwarded contract of `register_memory`.
        unsafe { self.register_with(descs, &gpu, None) }
    }

    fn register_shared_pool(
        &self,
        pool: &crate::pool::SharedPool,
        access: crate::pool::PoolAccess,
    ) -> Result<MemoryDescs, Error> {
        let descs = pool.descs();
        let share = crate::pool::Share {
            pool: Arc::clone(pool.mapping()),
            writable: access == crate::pool::PoolAccess::ReadWrite,
        };
        // SAFETY: the registration holds the pool's mapping (`share`), so
        // the range stays mapped while registered; the application reaches
        // the pool's bytes only through raw pointers.
        unsafe { self.register_with(&descs, &[], Some(&share)) }?;
        Ok(descs)
    }

    fn deregister_memory(&self, descs: &MemoryDescs) -> Result<(), Error> {
        for region in self.inner.registry.deregister(descs)? {
            // Host memory used with storage: out of the ring's registered
            // buffers before the caller may free it.
            if let Some(Some(slot)) = region.storage_slot.get() {
                self.inner.storage.forget_buffer(*slot);
            }
            // A shared pool: every peer's mapping of it goes before this
            // returns.
            if region.share.is_some() {
                for t in &self.inner.transports {
                    t.revoke(self.ctx(), region.key);
                }
            }
        }
        Ok(())
    }

    fn local_agent_desc(&self) -> AgentDesc {
        // Handed around by the application: without GPU handles (a peer on
        // this host that can open them asks this agent for them).
        self.inner.desc_for(None)
    }

    fn load_remote_agent(&self, desc: &AgentDesc) -> Result<(), Error> {
        desc.validate()?;
        let with_handles;
        let completed = self
            .inner
            .transports
            .iter()
            .find_map(|t| t.complete(self.ctx(), desc));
        let desc = match completed {
            Some(d) => {
                with_handles = d;
                &with_handles
            }
            None => desc,
        };
        let regions = desc.region_map()?;
        let transport = self.inner.choose_transport(desc, MemoryType::Dram)?;
        // The peer's storage is reached through its agent: on this
        // transport when it moves FILE memory, else on a lane of its own.
        let storage = match self.inner.choose_transport(desc, MemoryType::File) {
            Ok(t) if Arc::ptr_eq(&t, &transport) => StorageRoute::Same,
            Ok(t) => StorageRoute::Lane(Arc::new(Peer::new(
                desc.clone(),
                regions.clone(),
                t,
                StorageRoute::Same,
            ))),
            Err(e) => StorageRoute::Unreachable(e),
        };
        let mut peers = self.inner.peers.write().unwrap_or_else(|p| p.into_inner());
        let peer = Arc::new(Peer::new(desc.clone(), regions, transport, storage));
        // Same process: keep the live links, refresh the regions.
        if let Some(old) = peers.get(&desc.name)
            && old.desc.instance == desc.instance
            && Arc::ptr_eq(&old.transport, &peer.transport)
        {
            // What the links planned against the old descriptor's keys
            // goes with it.
            let take_over = |new: &Peer, old: &Peer| {
                let link = lock(&old.link).take();
                if let Some(l) = &link {
                    l.forget();
                }
                *lock(&new.link) = link;
            };
            take_over(&peer, old);
            if let (StorageRoute::Lane(new), StorageRoute::Lane(old)) =
                (&peer.storage, &old.storage)
                && Arc::ptr_eq(&new.transport, &old.transport)
            {
                take_over(new, old);
            }
        }
        if let Some(old) = peers.insert(desc.name.clone(), Arc::clone(&peer)) {
            old.retire();
            // Links the new entry did not take over (another instance).
            for l in old.take_links() {
                l.fail(Error::StaleAgent {
                    remote: desc.name.clone(),
                    addr: desc.endpoints.join(","),
                });
            }
        }
        drop(peers);
        // Connect now, so the first transfer does not pay for connection
        // setup. A failure is not fatal: the first transfer retries.
        if let Err(e) = peer.link(&self.inner) {
            tracing::info!(remote = %desc.name, error = %e, "eager connect failed; will retry on first transfer");
        }
        Ok(())
    }

    fn metrics_text(&self) -> String {
        self.inner.render_metrics()
    }

    fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        #[cfg(feature = "metrics-endpoint")]
        return self.metrics_server.as_ref().map(|m| m.addr);
        #[cfg(not(feature = "metrics-endpoint"))]
        None
    }

    fn load_remote_agent_by_name(&self, name: &str) -> Result<(), Error> {
        self.load_by_name(name)
    }

    fn fetch_remote_agent_desc(&self, connection_info: &str) -> Result<AgentDesc, Error> {
        fetch_desc(self.ctx(), connection_info)
    }

    fn remote_agent_desc(&self, name: &str) -> Result<AgentDesc, Error> {
        Ok(self.inner.peer(name)?.desc.clone())
    }

    fn invalidate_remote_agent(&self, name: &str) -> Result<(), Error> {
        let peer = self
            .inner
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
            .ok_or_else(|| Error::UnknownAgent(name.to_owned()))?;
        self.inner
            .close_peer(&peer, || Error::UnknownAgent(name.to_owned()));
        Ok(())
    }

    fn local_connection_info(&self) -> String {
        self.inner.endpoint.clone()
    }

    fn submit_transfer(&self, request: &TransferRequest) -> Result<TransferStatus, Error> {
        self.room_for_one()?;
        if let Some(r) = self.resubmit(request) {
            return r;
        }
        self.submit(request, request.sync_message.clone(), false)
    }

    fn prepare_transfer(&self, request: &TransferRequest) -> Result<PreparedTransfer, Error> {
        let kept = self.prepare(request)?;
        Ok(PreparedTransfer::new(
            request.clone(),
            self.inner.instance,
            Some(kept),
        ))
    }

    fn prepare_transfer_owned(&self, request: TransferRequest) -> Result<PreparedTransfer, Error> {
        let kept = self.prepare(&request)?;
        Ok(PreparedTransfer::new(
            request,
            self.inner.instance,
            Some(kept),
        ))
    }

    fn prepare_desc_list(
        &self,
        descs: MemoryDescs,
        remote_agent: Option<&str>,
    ) -> Result<Arc<crate::indexed::PreparedDescList>, Error> {
        self.prepare_list(descs, remote_agent)
    }

    fn prepare_indexed(
        &self,
        request: crate::indexed::IndexedRequest,
    ) -> Result<PreparedTransfer, Error> {
        self.prepare_indexed_request(request)
    }

    fn submit_prepared(&self, prepared: &PreparedTransfer) -> Result<TransferStatus, Error> {
        if prepared.owner() != self.inner.instance {
            return Err(Error::InvalidRequest(
                "the transfer was prepared by another agent".into(),
            ));
        }
        self.room_for_one()?;
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        // One made by index has no request until asked (and moves no
        // storage).
        let durable = prepared.indexed.is_none() && prepared.request().durable;
        if let Some(r) = prepared
            .resolved
            .as_deref()
            .and_then(|p| p.post(prepared.sync_message(), durable))
        {
            return r;
        }
        let req = prepared.request();
        self.submit(req, req.sync_message.clone(), false)
    }

    fn notify_sync_message(&self, remote: &str, message: Vec<u8>) -> Result<TransferStatus, Error> {
        let req = TransferRequest::write(
            MemoryDescs::new(MemoryType::Dram, Vec::new()),
            MemoryDescs::new(MemoryType::Dram, Vec::new()),
            remote,
        );
        self.room_for_one()?;
        self.submit(&req, Some(message), true)
    }

    fn take_sync_messages(&self) -> SyncMessages {
        self.inner.inbox.take()
    }

    fn wait_sync_messages(&self, timeout: Duration) -> SyncMessages {
        self.inner.inbox.wait(timeout)
    }

    fn wait_sync_messages_timed(&self, timeout: Duration) -> crate::agent::TimedSyncMessages {
        self.inner.inbox.wait_timed(timeout)
    }

    fn wait_sync_batch(&self, timeout: Duration) -> crate::agent::SyncBatch {
        self.inner.inbox.wait_batch(timeout)
    }

    fn wake_sync_waiters(&self) {
        self.inner.inbox.wake();
    }

    fn sync_waker(&self) -> crate::agent::SyncWaker {
        crate::agent::SyncWaker(Arc::clone(&self.inner.inbox))
    }

    fn check_remote_descs(&self, remote: &str, descs: &MemoryDescs) -> bool {
        if remote == self.inner.config.name {
            return self.inner.registry.contains_all(descs);
        }
        let Ok(peer) = self.inner.peer(remote) else {
            return false;
        };
        descs
            .descs
            .iter()
            .all(|d| peer.regions.find(descs.mem_type, d).is_some())
    }
}

impl Engine {
    /// Registers `descs` (all or none) with the registry and every
    /// transport that registers memory (`gpu`: where GPU memory lies in its
    /// allocations; `share`: a shared pool's file).
    ///
    /// # Safety
    /// As [`TransferAgent::register_memory`].
    unsafe fn register_with(
        &self,
        descs: &MemoryDescs,
        gpu: &[crate::registry::GpuRegion],
        share: Option<&crate::pool::Share>,
    ) -> Result<(), Error> {
        let registrars: Few<&dyn crate::registry::Registrar> = self
            .inner
            .transports
            .iter()
            .filter_map(|t| t.registrar())
            .collect();
        // SAFETY: forwarded contract.
        unsafe {
            self.inner.registry.register(
                descs,
                SUPPORTED,
                self.inner.mode.as_str(),
                &registrars,
                gpu,
                share,
            )
        }
    }
}
