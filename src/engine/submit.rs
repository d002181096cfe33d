//! The submit path: check, resolve (local holds, remote keys), plan and hand
//! to the link; a request posted again by the peer's link, and prepared
//! transfers.

use crate::agent::{TransferOp, TransferRequest, TransferStatus, TransportKind};
use crate::desc::ExportedRegion;
use crate::engine::transport::{RemoteKey, Resolved, Submission};
use crate::engine::{Engine, Peer, wire};
use crate::error::Error;
use crate::memory::MemoryType;
use crate::small::Few;
use crate::status::Prepared;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Engine {
    /// Whether one more request may be submitted (see
    /// [`Limits::max_requests_in_flight`](crate::Limits::max_requests_in_flight)).
    pub(in crate::engine) fn room_for_one(&self) -> Result<(), Error> {
        let n = self.inner.in_flight.count();
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
            cx: self.ctx(),
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
    ) -> Result<Box<dyn Prepared>, Error> {
        let peer = self.check_request(req)?;
        let resolved = self.resolve(req, req.sync_message.as_deref(), &peer)?;
        let link = peer.link(&self.inner)?;
        link.prepare(self.ctx(), peer, req, resolved)
    }
}

impl Engine {
    /// Posts `req` again through the link of its peer when that link
    /// remembers it (see [`Link::resubmit`]); `None`: submit it in full.
    /// Looks the peer up without loading it again, and never connects.
    pub(in crate::engine) fn resubmit(
        &self,
        req: &TransferRequest,
    ) -> Option<Result<TransferStatus, Error>> {
        let inner = &self.inner;
        // A checked request is submitted in full: what a link remembers
        // posts its data unchecked.
        if req.integrity
            || !req.remote.mem_type.is_virtual_address()
            || inner.closing.load(Ordering::Relaxed)
        {
            return None;
        }
        let link = {
            let peers = inner.peers.read().unwrap_or_else(|p| p.into_inner());
            peers.get(&req.remote_agent)?.current_link()?
        };
        link.resubmit(self.ctx(), req)
    }
}

impl Engine {
    /// The checks of a request that need no registry: the agent open, the
    /// shape, the memory type, the remote agent known. Returns the peer.
    fn check_request(&self, req: &TransferRequest) -> Result<Arc<Peer>, Error> {
        if self.inner.closing.load(Ordering::Relaxed) {
            return Err(Error::Closed);
        }
        req.validate_shape()?;
        let data = !req.local.is_empty();
        let peer = self.check_route(
            req.local.mem_type,
            req.remote.mem_type,
            &req.remote_agent,
            data,
        )?;
        if req.integrity && data {
            check_integrity(req, peer.transport.kind())?;
        }
        if req.remote.mem_type == MemoryType::Obj
            && req.op == TransferOp::Write
            && req.remote_agent != self.inner.config.name
        {
            check_object_writes(req)?;
        }
        Ok(peer)
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
        // Local memory is host or GPU memory.
        let unsupported =
            (!matches!(local_mem, MemoryType::Dram | MemoryType::Vram)).then_some(local_mem);
        if let Some(mem_type) = unsupported.filter(|_| data) {
            return Err(Error::UnsupportedMemoryType {
                mem_type,
                backend: inner.mode.as_str(),
            });
        }
        // The agent's own storage: its self-peer (its own name with host
        // memory is a loaded peer like any other); a peer's storage: the
        // entry whose path moves it.
        let storage = matches!(
            remote_mem,
            MemoryType::File | MemoryType::Blk | MemoryType::Obj
        );
        let peer = if !storage {
            self.peer_or_reload(remote_agent)?
        } else if remote_agent == inner.config.name {
            inner.self_peer()
        } else {
            self.peer_or_reload(remote_agent)?.for_storage()?
        };
        // Memory of other types (GPU memory, either side) only on a
        // transport that moves it: TCP (staged) and in-process copies on
        // either side, RDMA with GPUDirect registrations, cross-memory
        // attach when it is the target's, through CUDA IPC.
        let kind = peer.transport.kind();
        if data && !peer.transport.moves(local_mem, remote_mem, &peer.desc) {
            let gpu = [local_mem, remote_mem].contains(&MemoryType::Vram);
            return Err(Error::UnsupportedMemoryType {
                mem_type: if gpu { MemoryType::Vram } else { remote_mem },
                backend: kind.as_str(),
            });
        }
        // A notification moves no memory: no transport is required for it.
        if !inner.config.required_transports.is_empty() && data {
            let actual = kind;
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
    /// remote ones in what `peer` exported, with the keys of the peer's
    /// transport; checks the sync message's size.
    fn resolve(
        &self,
        req: &TransferRequest,
        sync: Option<&[u8]>,
        peer: &Peer,
    ) -> Result<Resolved, Error> {
        let transport = &*peer.transport;
        let name = transport.kind().as_str();
        let registers = transport.registrar().is_some();
        let mut local = Few::new();
        let guards = self
            .inner
            .registry
            .acquire_local_keyed(&req.local, registers.then_some((name, &mut local)))?;
        let local_keys = local
            .into_iter()
            .collect::<Option<Few<u64>>>()
            .ok_or_else(|| Error::BackendUnavailable {
                backend: name,
                reason: format!(
                    "local {} memory without a registration with this agent's {name} device",
                    req.local.mem_type
                ),
            })?;
        if !transport.resolves_remote() {
            // The remote regions are this agent's own: its storage link
            // resolves (and holds) them.
            return Ok(Resolved {
                guards,
                local_keys,
                keys: Vec::new(),
                remote_keys: Few::new(),
            });
        }
        // The peer's keys of the transport, or the agent's access keys.
        let offered = if registers {
            let (i, _) = peer
                .desc
                .offer(name)
                .ok_or_else(|| Error::BackendUnavailable {
                    backend: name,
                    reason: format!("remote agent {:?} does not offer {name}", req.remote_agent),
                })?;
            Some(i)
        } else {
            None
        };
        // The access keys too where a checked request's target checks the
        // ranges it moved by them (see `wire::push_check`).
        let access_keys = !registers || req.integrity;
        let mut keys = Vec::with_capacity(if access_keys {
            req.remote.descs.len()
        } else {
            0
        });
        let mut remote_keys = Few::new();
        let mut hint = None;
        // The last region's key: descriptors in a row in one region share
        // it (a key of several is not read again for each).
        let mut last: Option<(*const ExportedRegion, RemoteKey)> = None;
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
            if access_keys {
                keys.push(r.value.key);
            }
            if let Some(i) = offered {
                let at: *const ExportedRegion = &r.value;
                let key = match &last {
                    Some((p, k)) if std::ptr::eq(*p, at) => k.clone(),
                    _ => remote_key(&r.value, i).ok_or_else(|| Error::BackendUnavailable {
                        backend: name,
                        reason: format!(
                            "remote agent {:?} exported region {:?} without a {name} registration",
                            req.remote_agent, r.desc
                        ),
                    })?,
                };
                if key.keys.is_some() {
                    last = Some((at, key.clone()));
                }
                remote_keys.push(key);
            }
        }
        let max = transport.max_sync();
        if sync.is_some_and(|m| m.len() > max) {
            return Err(Error::InvalidRequest(format!(
                "sync messages on the {name} path are at most {max} bytes"
            )));
        }
        Ok(Resolved {
            guards,
            local_keys,
            keys,
            remote_keys,
        })
    }
}

/// Whether end-to-end integrity can be checked for `req` over `transport`:
/// host memory on both sides, over TCP (where the target checks each
/// payload as it lands), shm, libfabric and RDMA (where the target checks
/// the ranges the request moved, when it commits: at most
/// [`wire::MAX_CHECKS`] descriptors) or in-process (the copying thread
/// sums both sides).
/// A WRITE to a peer's objects writes each whole: from offset 0, one
/// descriptor per object (as to the agent's own, `engine::storage`).
fn check_object_writes(req: &TransferRequest) -> Result<(), Error> {
    let mut seen = std::collections::HashSet::new();
    for r in &req.remote.descs {
        if r.addr != 0 {
            return Err(Error::InvalidDescriptor {
                desc: *r,
                reason: "a WRITE to an object writes it whole: its offset must be 0",
            });
        }
        if !seen.insert(r.device_id) {
            return Err(Error::InvalidRequest(format!(
                "object handle {} is written by two descriptors of one request",
                r.device_id
            )));
        }
    }
    Ok(())
}

fn check_integrity(req: &TransferRequest, transport: TransportKind) -> Result<(), Error> {
    for mem_type in [req.local.mem_type, req.remote.mem_type] {
        if mem_type != MemoryType::Dram {
            return Err(Error::IntegrityUnsupported {
                reason: format!("for {mem_type} memory (host memory, DRAM, only)"),
            });
        }
    }
    match transport {
        TransportKind::Tcp | TransportKind::InProcess => Ok(()),
        TransportKind::Shm | TransportKind::Fabric | TransportKind::Rdma => {
            if req.remote.descs.len() > wire::MAX_CHECKS as usize {
                return Err(Error::InvalidRequest(format!(
                    "a checked request over {transport} has at most {} descriptors, not {}",
                    wire::MAX_CHECKS,
                    req.remote.descs.len()
                )));
            }
            Ok(())
        }
        _ => Err(Error::IntegrityUnsupported {
            reason: format!(
                "over the {transport} transport (tcp, shm, rdma, fabric and inproc only)"
            ),
        }),
    }
}

/// `region`'s key of the transport offered at index `transport`: a
/// little-endian integer of at most 64 bits, or several 64-bit ones (a key
/// whose length is a multiple of 8 bytes); `None` when it has none of
/// those widths.
fn remote_key(region: &ExportedRegion, transport: u8) -> Option<RemoteKey> {
    let k = region.keys.iter().find(|k| k.transport == transport)?;
    if k.key.len() > 8 {
        if !k.key.len().is_multiple_of(8) {
            return None;
        }
        let keys: Arc<[u64]> = k
            .key
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        return Some(RemoteKey {
            key: keys[0],
            base: region.desc.addr,
            keys: Some(keys),
            access: region.key,
        });
    }
    let mut b = [0u8; 8];
    b.get_mut(..k.key.len())?.copy_from_slice(&k.key);
    Some(RemoteKey {
        key: u64::from_le_bytes(b),
        base: region.desc.addr,
        keys: None,
        access: region.key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::RegionKey;
    use crate::memory::MemoryDesc;

    fn region(keys: Vec<RegionKey>) -> ExportedRegion {
        ExportedRegion {
            mem_type: MemoryType::Dram,
            desc: MemoryDesc::new(0x1000, 4096, 0),
            key: 7,
            keys,
            align: 1,
        }
    }

    #[test]
    fn a_remote_key_is_one_integer_or_several_of_64_bits() {
        let k = |transport, key: &[u8]| RegionKey {
            transport,
            key: key.to_vec(),
        };
        let r = region(vec![k(0, &[1, 2, 3, 4]), k(1, &[9; 7])]);
        let one = remote_key(&r, 0).unwrap();
        assert_eq!((one.key, one.base, one.keys), (0x0403_0201, 0x1000, None));
        assert_eq!(remote_key(&r, 1).unwrap().key, 0x0009_0909_0909_0909);
        assert!(remote_key(&r, 2).is_none(), "no key of that transport");
        let wide: Vec<u8> = [5u64, 6, u64::MAX]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let r = region(vec![k(0, &wide), k(1, &[1; 12])]);
        let several = remote_key(&r, 0).unwrap();
        assert_eq!(several.key, 5);
        assert_eq!(several.keys.as_deref(), Some(&[5, 6, u64::MAX][..]));
        assert!(remote_key(&r, 1).is_none(), "12 bytes: neither width");
    }
}
