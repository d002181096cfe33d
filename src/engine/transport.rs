//! The transports an engine may use, and the choice among them per peer
//! and memory type.
//!
//! Each [`Transport`] says which memory types it moves and whether a
//! peer's descriptor lets it reach that peer (and if not, why). The engine
//! keeps the transports its [`Backend`] allows, in order of preference
//! ([`for_backend`]); a peer's path for a memory type is the first that
//! moves that memory and reaches the peer ([`choose`]), and when none does
//! the error lists every transport's reason. Adding a transport is one
//! implementation here, its [`Path`], and its link behaviour.

use super::*;

/// One way of moving data to a peer.
pub(in crate::engine) trait Transport: Send + Sync {
    /// What it is, as every status reports it.
    fn kind(&self) -> TransportKind;

    /// Whether it moves memory of this type (host memory only, unless the
    /// transport says otherwise).
    fn supports(&self, mem_type: MemoryType) -> bool {
        mem_type == MemoryType::Dram
    }

    /// The path to `peer` this way, or why there is none.
    fn reach(&self, peer: &AgentDesc) -> Result<Path, String>;
}

/// TCP streams: reaches every peer (their endpoints were already reached
/// for the descriptor).
pub(in crate::engine) struct Tcp;

impl Transport for Tcp {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn reach(&self, _peer: &AgentDesc) -> Result<Path, String> {
        Ok(Path::Tcp)
    }
}

/// Cross-memory attach: a peer on this host that offers it and whose
/// probe word this process can read.
pub(in crate::engine) struct Shm {
    /// This host's id.
    pub(in crate::engine) host: String,
}

impl Transport for Shm {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn reach(&self, peer: &AgentDesc) -> Result<Path, String> {
        let Some(a) = &peer.local_access else {
            return Err("the remote agent does not offer cross-memory access".into());
        };
        shm::probe(a, peer.instance, &self.host).map(|()| Path::Cma { pid: a.pid })
    }
}

/// RDMA queue pairs: a peer with a device (this agent has one, or the
/// transport would not be in its list).
pub(in crate::engine) struct Rdma;

impl Transport for Rdma {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn reach(&self, peer: &AgentDesc) -> Result<Path, String> {
        match peer.rdma {
            Some(_) => Ok(Path::Rdma),
            None => Err("the remote agent has no RDMA device".into()),
        }
    }
}

/// The transports of an agent on `backend`, in order of preference:
/// `auto` prefers cross-memory attach on this host, then RDMA (when this
/// agent has a device), then TCP.
pub(in crate::engine) fn for_backend(
    backend: Backend,
    has_device: bool,
    host: &str,
) -> Vec<Box<dyn Transport>> {
    let shm = || {
        Box::new(Shm {
            host: host.to_owned(),
        }) as Box<dyn Transport>
    };
    match backend {
        Backend::Tcp => vec![Box::new(Tcp)],
        Backend::Shm => vec![shm()],
        Backend::Rdma => vec![Box::new(Rdma)],
        Backend::Auto => {
            let mut v = vec![shm()];
            if has_device {
                v.push(Box::new(Rdma));
            }
            v.push(Box::new(Tcp));
            v
        }
    }
}

/// The path to `peer` for memory of `mem_type`: the first of `transports`
/// that moves it and reaches the peer.
///
/// # Errors
/// [`Error::BackendUnavailable`] naming `backend`, with every transport's
/// reason, when none does.
pub(in crate::engine) fn choose(
    transports: &[Box<dyn Transport>],
    backend: Backend,
    peer: &AgentDesc,
    mem_type: MemoryType,
) -> Result<Path, Error> {
    let mut why = Vec::new();
    for t in transports {
        if !t.supports(mem_type) {
            why.push(format!("{}: does not move {mem_type} memory", t.kind()));
            continue;
        }
        match t.reach(peer) {
            Ok(path) => {
                if !why.is_empty() {
                    tracing::info!(remote = %peer.name, %mem_type, transport = %t.kind(), passed_over = %why.join("; "), "data path chosen after others");
                }
                return Ok(path);
            }
            Err(reason) => why.push(format!("{}: {reason}", t.kind())),
        }
    }
    Err(Error::BackendUnavailable {
        backend: backend.as_str(),
        reason: format!(
            "remote agent {:?}, {mem_type} memory: {}",
            peer.name,
            why.join("; ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{LocalAccess, RdmaInfo};

    fn desc(rdma: bool, local: Option<(&str, u32)>) -> AgentDesc {
        AgentDesc {
            name: "peer".into(),
            instance: 7,
            backend: BackendKind::Tcp,
            endpoints: vec!["127.0.0.1:1".into()],
            regions: Vec::new(),
            rdma: rdma.then(|| RdmaInfo {
                device: "rxe0".into(),
            }),
            local_access: local.map(|(host, pid)| LocalAccess {
                host: host.into(),
                pid,
                probe_addr: 0,
            }),
        }
    }

    #[test]
    fn auto_prefers_shm_then_rdma_then_tcp() {
        let auto = for_backend(Backend::Auto, true, "this-host");
        let kinds: Vec<_> = auto.iter().map(|t| t.kind()).collect();
        assert_eq!(
            kinds,
            [TransportKind::Shm, TransportKind::Rdma, TransportKind::Tcp]
        );
        // Another host with a device: RDMA; without one: TCP.
        let other = desc(true, Some(("other-host", 1)));
        let dram = MemoryType::Dram;
        assert_eq!(
            choose(&auto, Backend::Auto, &other, dram).unwrap(),
            Path::Rdma
        );
        let plain = desc(false, None);
        assert_eq!(
            choose(&auto, Backend::Auto, &plain, dram).unwrap(),
            Path::Tcp
        );
        // No device here: RDMA is not in the list at all.
        let no_dev = for_backend(Backend::Auto, false, "this-host");
        assert_eq!(
            choose(&no_dev, Backend::Auto, &other, dram).unwrap(),
            Path::Tcp
        );
    }

    #[test]
    fn no_transport_is_a_typed_error_with_every_reason() {
        let rdma = for_backend(Backend::Rdma, true, "h");
        let e = choose(&rdma, Backend::Rdma, &desc(false, None), MemoryType::Dram).unwrap_err();
        match e {
            Error::BackendUnavailable { backend, reason } => {
                assert_eq!(backend, "rdma");
                assert!(reason.contains("no RDMA device"), "{reason}");
            }
            other => panic!("{other}"),
        }
        let shm = for_backend(Backend::Shm, false, "h");
        let e = choose(
            &shm,
            Backend::Shm,
            &desc(true, Some(("elsewhere", 1))),
            MemoryType::Dram,
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::BackendUnavailable { backend: "shm", reason } if reason.contains("another host")),
            "{e}"
        );
        // A memory type no transport moves: each says so.
        let auto = for_backend(Backend::Auto, true, "h");
        let e = choose(&auto, Backend::Auto, &desc(true, None), MemoryType::Vram).unwrap_err();
        let text = e.to_string();
        for k in ["shm", "rdma", "tcp"] {
            assert!(text.contains(&format!("{k}: does not move")), "{text}");
        }
    }
}
