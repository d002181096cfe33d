//! The RDMA transport: the agent's device and what it shares among its
//! connections (the shared receive queue), its regions' registrations,
//! and the choice of peers it reaches.

use std::net::TcpStream;
use std::sync::{Arc, Mutex};

use crate::agent::{AgentConfig, Backend, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::ctx::Ctx;
use crate::engine::rdma::RdmaLink;
use crate::engine::status;
use crate::engine::target::attach;
use crate::engine::transport::{Link, Transport};
use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryType};
use crate::registry::{GpuRegion, RegionHandle, Registrar};
use crate::verbs::{Device, Registered};

use super::recv::SrqReceiver;

/// RDMA queue pairs to peers that offer a device (this agent has one, or
/// the transport would not be in its list).
pub(in crate::engine) struct Rdma {
    /// The device.
    pub(in crate::engine) device: Arc<Device>,
    /// Whether GPU memory the device cannot register is registered without
    /// it (an `auto` agent moves it over its other transports) rather than
    /// refused.
    gpu_optional: bool,
    /// The shared receive queue and its thread, made at the first RDMA
    /// connection accepted (when `rdma_srq` is set and the device has
    /// shared receive queues).
    pub(in crate::engine) srq: Mutex<SrqState>,
}

/// Whether incoming RDMA connections share a receive queue.
pub(in crate::engine) enum SrqState {
    /// Not tried yet.
    Untried,
    /// In use.
    Ready(Arc<SrqReceiver>),
    /// Off by configuration, or the device could not make one: each
    /// connection posts its own receive buffers and runs its own thread.
    PerQueuePair,
}

impl Rdma {
    /// The transport of an agent on `backend`, when it uses one: `rdma`
    /// opens its device or fails; `auto` uses one if it finds one. With
    /// several devices and none named, the one nearest the configured GPU
    /// (recorded in `config`).
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`]: an `rdma` agent without a usable
    /// device.
    pub(in crate::engine) fn open(
        backend: Backend,
        config: &mut AgentConfig,
    ) -> Result<Option<Self>, Error> {
        if !matches!(backend, Backend::Rdma | Backend::Auto) {
            return Ok(None);
        }
        if config.rdma.device.is_none()
            && std::env::var_os("KVXFER_RDMA_DEVICE").is_none()
            && let Some(nic) = config.rdma.near_gpu.and_then(crate::gpu::nearest_nic)
        {
            tracing::info!(agent = %config.name, device = %nic, gpu = ?config.rdma.near_gpu, "RDMA device nearest the GPU");
            config.rdma.device = Some(nic);
        }
        let device = match Device::open(config.rdma.device.as_deref(), config.rdma.gid_index) {
            Ok(d) => d,
            Err(e) if backend == Backend::Rdma => {
                return Err(Error::BackendUnavailable {
                    backend: "rdma",
                    reason: e.to_string(),
                });
            }
            Err(e) => {
                tracing::info!(agent = %config.name, reason = %e, "no RDMA device; auto uses shm and tcp");
                return Ok(None);
            }
        };
        if backend == Backend::Auto {
            tracing::info!(agent = %config.name, device = device.name(), gid_index = device.gid_index(), "RDMA device with an active port found; auto uses rdma to remote hosts (shm on this host where possible)");
        }
        Ok(Some(Self {
            device: Arc::new(device),
            // GPU memory the device cannot register: refused by an `rdma`
            // agent, moved over its other transports by `auto`.
            gpu_optional: backend == Backend::Auto,
            srq: Mutex::new(SrqState::Untried),
        }))
    }
}

impl Transport for Rdma {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn moves(&self, local: MemoryType, remote: MemoryType, _peer: &AgentDesc) -> bool {
        moves(local, remote)
    }

    fn reach(&self, peer: &AgentDesc) -> Result<(), String> {
        reach(peer)
    }

    fn offer(&self) -> Option<Vec<u8>> {
        Some(self.device.name().as_bytes().to_vec())
    }

    fn registrar(&self) -> Option<&dyn Registrar> {
        Some(self)
    }

    fn max_sync(&self) -> usize {
        super::SYNC_MSG_MAX
    }

    fn connect(&self, cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        Ok(RdmaLink::open(cx, &self.device, peer)?)
    }

    fn accept(
        &self,
        cx: Ctx<'_>,
        remote: &str,
        sock: &TcpStream,
        msg: &[u8],
    ) -> Result<(Vec<u8>, Option<attach::Attachment>), u16> {
        // A malformed queue pair: refused like one that cannot connect.
        let theirs = super::accept::qp_from_msg(msg).ok_or(status::ATTACH_FAILED)?;
        let (mine, receiver) = self.accept_qp(cx, &theirs, remote, sock)?;
        Ok((super::accept::qp_msg(&mine), Some(Box::new(receiver))))
    }
}

/// Whether RDMA moves memory of type `local` to and from a peer's of type
/// `remote`: host and GPU memory (GPU memory registered for GPUDirect RDMA;
/// a local region without such a registration is refused when the request
/// is resolved).
pub(in crate::engine) fn moves(local: MemoryType, remote: MemoryType) -> bool {
    local.is_virtual_address() && remote.is_virtual_address()
}

/// Whether RDMA reaches `peer`: it offers a device.
pub(in crate::engine) fn reach(peer: &AgentDesc) -> Result<(), String> {
    match peer.offer(TransportKind::Rdma.as_str()) {
        Some(_) => Ok(()),
        None => Err("the remote agent has no RDMA device".into()),
    }
}

/// A region's registration with the device.
#[derive(Debug)]
struct RdmaRegion(Registered);

impl RegionHandle for RdmaRegion {
    fn local_key(&self) -> u64 {
        u64::from(self.0.lkey())
    }

    fn remote_key(&self, _access: u64) -> Vec<u8> {
        self.0.rkey().to_le_bytes().to_vec()
    }
}

impl Registrar for Rdma {
    fn name(&self) -> &'static str {
        TransportKind::Rdma.as_str()
    }

    unsafe fn register(
        &self,
        mem_type: MemoryType,
        desc: &MemoryDesc,
        gpu: Option<&GpuRegion>,
    ) -> Result<Option<Box<dyn RegionHandle>>, Error> {
        let mr = match (mem_type, gpu) {
            // Storage ranges are file offsets: never registered.
            (MemoryType::File | MemoryType::Blk | MemoryType::Obj, _) => return Ok(None),
            // GPU memory: GPUDirect RDMA (dma-buf, else peer memory).
            // SAFETY: forwarded contract (the range stays allocated while
            // registered).
            (_, Some(g)) => match unsafe { crate::gpu::register_rdma(&self.device, desc, g) } {
                Ok(mr) => mr,
                Err(Error::Gpu(e @ crate::gpu::GpuError::RdmaRegistration { .. }))
                    if self.gpu_optional =>
                {
                    tracing::warn!(error = %e, "GPU memory registered without GPUDirect RDMA: RDMA peers cannot reach it");
                    return Ok(None);
                }
                Err(e) => return Err(e),
            },
            (_, None) => {
                // SAFETY: as above.
                unsafe { self.device.register(desc.addr, desc.len) }.map_err(|e| Error::Rdma {
                    remote: String::new(),
                    source: Arc::new(e),
                })?
            }
        };
        Ok(Some(Box::new(RdmaRegion(mr))))
    }
}
