//! Regions registered with the libfabric transport: one registration per
//! rail (`FabricRegion`), honouring the provider's registration modes
//! (keys of the provider's or of the agent's choosing, local descriptors,
//! GPU memory through `FI_MR_HMEM`); a region of several rails
//! (`Registered`) keeps its descriptors in the transport's `DescTable`
//! and gives peers the rails' keys, 8 bytes each, sealed (`Seal`): the
//! descriptor a peer reads holds each key XORed with a pad that only the
//! agent's authenticated peers can compute.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hmac::{Hmac, KeyInit, Mac};
use kvxfer_fabric as ffi;
use sha2::Sha256;

use super::endpoint::Endpoint;
use super::{Fabric, FabricError, check, fabric_err};
use crate::agent::TransportKind;
use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryType};
use crate::registry::{GpuRegion, RegionHandle, Registrar};

/// The memory descriptors, one per rail, of the regions registered with
/// several rails, by the local key their handles give the engine (an id of
/// this table's; a region of one rail gives its descriptor itself).
#[derive(Default)]
pub(super) struct DescTable {
    next: AtomicU64,
    by_id: std::sync::RwLock<HashMap<u64, Arc<[u64]>, crate::small::FastHash>>,
}

impl DescTable {
    /// The descriptors of region `id`, while it is registered.
    pub(super) fn get(&self, id: u64) -> Option<Arc<[u64]>> {
        let t = self.by_id.read().unwrap_or_else(|p| p.into_inner());
        t.get(&id).cloned()
    }

    fn insert(&self, descs: Arc<[u64]>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut t = self.by_id.write().unwrap_or_else(|p| p.into_inner());
        t.insert(id, descs);
        id
    }

    fn remove(&self, id: u64) {
        let mut t = self.by_id.write().unwrap_or_else(|p| p.into_inner());
        t.remove(&id);
    }
}

/// A region's registration with the domain.
#[derive(Debug)]
pub(super) struct FabricRegion {
    mr: *mut ffi::fid_mr,
    pub(super) desc: u64,
    pub(super) key: u64,
    /// Keeps the domain open while registered (dropped after `drop` has
    /// closed the registration).
    _ep: Arc<Endpoint>,
}

// SAFETY: the registration is used through the thread-safe domain only.
unsafe impl Send for FabricRegion {}
// SAFETY: as above.
unsafe impl Sync for FabricRegion {}

impl Drop for FabricRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, closed once; the domain is still open
        // (`_ep`).
        unsafe { ffi::fi_close(&mut (*self.mr).fid) };
    }
}

impl Registrar for Fabric {
    fn name(&self) -> &'static str {
        TransportKind::Fabric.as_str()
    }

    unsafe fn register(
        &self,
        mem_type: MemoryType,
        desc: &MemoryDesc,
        gpu: Option<&GpuRegion>,
    ) -> Result<Option<Box<dyn RegionHandle>>, Error> {
        let cuda = match (mem_type, gpu) {
            (MemoryType::Dram, _) => None,
            (MemoryType::Vram, Some(g)) if self.offer.hmem => Some(g.device),
            // Storage, and GPU memory without FI_HMEM: not registered.
            _ => return Ok(None),
        };
        let access = ffi::FI_READ | ffi::FI_WRITE | ffi::FI_REMOTE_READ | ffi::FI_REMOTE_WRITE;
        // On every rail; on a failure, what was registered on the others
        // is closed as the collected ones drop.
        let regs = self
            .rails
            .all
            .iter()
            // SAFETY: by this function's contract, the range stays
            // allocated while registered.
            .map(|shared| unsafe {
                FabricRegion::register(&shared.ep, desc.addr, desc.len, cuda, access)
            })
            .collect::<Result<Vec<_>, _>>();
        let e = match regs {
            Ok(regs) => {
                // A region of several rails: its descriptors in the table.
                let id = (regs.len() > 1).then(|| {
                    let descs: Arc<[u64]> = regs.iter().map(|r| r.desc).collect();
                    self.rails.descs.insert(descs)
                });
                return Ok(Some(Box::new(Registered {
                    regs,
                    id,
                    table: Arc::clone(&self.rails.descs),
                    seal: Arc::clone(&self.seal),
                })));
            }
            Err(e) => e,
        };
        match cuda {
            // The provider moves device memory, but this libfabric cannot
            // register GPU memory (built without CUDA, or no driver): the
            // region stays registered with the agent, and requests to it
            // on this transport fail, naming the missing registration.
            Some(device) => {
                tracing::warn!(device, error = %e, "libfabric did not register GPU memory; requests to it over fabric will fail");
                Ok(None)
            }
            None => Err(fabric_err("", e)),
        }
    }
}

/// A region's registrations, one per rail (in order): its local key for
/// the engine is its one rail's descriptor, or, with several rails, its id
/// in the transport's [`DescTable`], which holds their descriptors while it
/// is registered; its remote key is the rails' keys, 8 bytes each, sealed.
#[derive(Debug)]
struct Registered {
    regs: Vec<FabricRegion>,
    /// Its id in `table` (several rails only).
    id: Option<u64>,
    table: Arc<DescTable>,
    seal: Arc<Seal>,
}

impl std::fmt::Debug for DescTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DescTable").finish_non_exhaustive()
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Out of the table first; the registrations close after (`regs`).
        if let Some(id) = self.id {
            self.table.remove(id);
        }
    }
}

impl RegionHandle for Registered {
    fn local_key(&self) -> u64 {
        match (self.id, self.regs.first()) {
            (Some(id), _) => id,
            (None, Some(r)) => r.desc,
            (None, None) => 0,
        }
    }

    fn remote_key(&self, access: u64) -> Vec<u8> {
        self.regs
            .iter()
            .enumerate()
            .flat_map(|(rail, r)| (r.key ^ self.seal.pad(access, rail)).to_le_bytes())
            .collect()
    }
}

/// What an agent's libfabric keys are sealed with in its descriptor: 32
/// random bytes of the transport's, never published, given only in the
/// answer to an attach, that is to a peer that passed the handshake on
/// the agent's side channel (with a cluster secret: a member). A key `k`
/// of rail `r` of a region with access key `a` (the descriptor's `key`) is
/// published as `k ^ pad(a, r)`; the pad is HMAC-SHA256 under the seal, so
/// a descriptor's reader without the seal learns nothing of `k`.
pub(super) struct Seal([u8; SEAL_LEN]);

/// Bytes of a [`Seal`].
pub(super) const SEAL_LEN: usize = 32;

impl Seal {
    /// A new random seal.
    pub(super) fn new() -> Self {
        Self(crate::auth::random_bytes())
    }

    /// A peer's seal, from its attach answer.
    pub(super) fn from_bytes(b: [u8; SEAL_LEN]) -> Self {
        Self(b)
    }

    /// Its bytes, for the attach answer.
    pub(super) fn bytes(&self) -> &[u8; SEAL_LEN] {
        &self.0
    }

    /// The pad of rail `rail`'s key of the region with access key
    /// `access`: the first 8 bytes (little-endian) of HMAC-SHA256 under the
    /// seal over a label, `access` (LE) and `rail` (one byte).
    pub(super) fn pad(&self, access: u64, rail: usize) -> u64 {
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC takes keys of any length");
        m.update(b"kvxfer fabric key\0");
        m.update(&access.to_le_bytes());
        m.update(&[u8::try_from(rail).unwrap_or(u8::MAX)]);
        let out = m.finalize().into_bytes();
        let mut b = [0u8; 8];
        b.copy_from_slice(&out[..8]);
        u64::from_le_bytes(b)
    }

    /// `key` (a descriptor's, of rail `rail` of the region with access key
    /// `access`) opened.
    pub(super) fn open(&self, key: u64, access: u64, rail: usize) -> u64 {
        key ^ self.pad(access, rail)
    }
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seal(..)")
    }
}

impl FabricRegion {
    /// Registers `[addr, addr + len)` (GPU memory of CUDA device `cuda`
    /// when given) with the endpoint's domain for `access` (`FI_READ`,
    /// `FI_REMOTE_WRITE`, …), bound to the endpoint where the provider
    /// asks (`FI_MR_ENDPOINT`).
    ///
    /// # Safety
    /// The range stays allocated until the region is dropped.
    pub(super) unsafe fn register(
        ep: &Arc<Endpoint>,
        addr: u64,
        len: u64,
        cuda: Option<u32>,
        access: u32,
    ) -> Result<Self, FabricError> {
        let iov = ffi::iovec {
            iov_base: addr as *mut c_void,
            iov_len: len as usize,
        };
        let mut attr = ffi::fi_mr_attr {
            mr_iov: &iov,
            iov_count: 1,
            access: u64::from(access),
            // Random: the key is what a peer on the fabric must know (with
            // the address) to reach the region (providers with
            // FI_MR_PROV_KEY choose their own).
            requested_key: crate::auth::random_u64(),
            ..Default::default()
        };
        if let Some(d) = cuda {
            attr.iface = ffi::fi_hmem_iface_FI_HMEM_CUDA;
            attr.device.cuda = i32::try_from(d).unwrap_or(i32::MAX);
        }
        let mut mr = ptr::null_mut();
        // SAFETY: the caller keeps the range allocated while registered;
        // the registration is closed with the region (FabricRegion::drop),
        // which is made as soon as the registration exists.
        unsafe {
            check(
                "fi_mr_regattr",
                i64::from(ffi::fi_mr_regattr(ep.domain, &attr, 0, &mut mr)),
            )?;
            let mut region = FabricRegion {
                mr,
                desc: ffi::fi_mr_desc(mr) as u64,
                key: 0,
                _ep: Arc::clone(ep),
            };
            if ep.mr_mode & u64::from(ffi::FI_MR_ENDPOINT) != 0 {
                let rc = ep.with_ep(|e| ffi::fi_mr_bind(mr, &mut (*e).fid, 0))?;
                check("fi_mr_bind", i64::from(rc))?;
                check("fi_mr_enable", i64::from(ffi::fi_mr_enable(mr)))?;
            }
            region.key = ffi::fi_mr_key(mr);
            Ok(region)
        }
    }
}
