//! The registry of transports: which an agent on each backend uses, in
//! order of preference, opened. The one file of the engine that names
//! every transport; the core (every other engine file outside the
//! transports' own) names none (`tests/layering.rs`).

use crate::agent::{AgentConfig, Backend};
use crate::engine::ctx::{AgentRef, Ctx};
use crate::engine::shm::Shm;
use crate::engine::tcp::Tcp;
use crate::engine::transport::Transport;
use crate::engine::{Inner, inproc, rdma, storage};
use crate::error::Error;
use std::sync::Arc;

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

/// The shm transport of an agent on `backend` with `instance` on host
/// `host`, when the backend uses it (see `Shm::open`).
pub(in crate::engine) fn shm(
    backend: Backend,
    config: &AgentConfig,
    instance: u64,
    host: &str,
) -> Option<Arc<Shm>> {
    Shm::open(backend, config, instance, host)
}

/// The transport of requests to the agent's own storage (FILE, BLK and
/// OBJ regions): its I/O engine and object stores, in this process.
pub(in crate::engine) fn own_storage() -> Arc<dyn Transport> {
    Arc::new(storage::OwnStorage)
}

/// Tells the transports that need the agent itself (not only its state)
/// that it is open: the in-process transport lists it where this
/// process's other agents find it.
pub(in crate::engine) fn opened(inner: &Arc<Inner>) {
    if inner.mode == Backend::InProcess {
        inproc::enlist(inner.instance, AgentRef::to(inner));
    }
}

/// Tells them that it closes: no in-process initiator copies into it
/// after this returns.
pub(in crate::engine) fn closing(inner: &Inner) {
    inproc::delist(Ctx::of(inner));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::TransportKind;
    use crate::desc::AgentDesc;
    use crate::desc::{ExportedRegion, RegionKey, TransportOffer};
    use crate::engine::shm::frames as cma_wire;
    use crate::engine::shm::frames::LocalAccess;
    use crate::engine::storage;
    use crate::engine::transport::Link;
    use crate::engine::transport::choose;
    use crate::memory::MemoryDesc;
    use crate::memory::MemoryType;

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

        fn connect(&self, _cx: Ctx<'_>, _peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
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
            assert!(!storage::OwnStorage.moves(l, r, &peer));
        }
        for (l, r) in [(Dram, File), (Vram, Blk)] {
            assert!(tcp.moves(l, r, &peer) && storage_only.moves(l, r, &peer));
            assert!(storage::OwnStorage.moves(l, r, &peer));
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
        assert!(storage::OwnStorage.moves(Dram, Obj, &peer));
        assert!(storage::OwnStorage.moves(Vram, Obj, &peer));
        assert!(!storage::OwnStorage.moves(File, Obj, &peer));
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
