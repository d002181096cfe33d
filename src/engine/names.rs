//! Peers by name through the metadata store ([`crate::metadata`]): the
//! agent's publication (started with the agent, revoked first when it
//! closes), resolution by name, and the store's departures turned into
//! invalidated peers whose requests fail with [`Error::PeerGone`].

use std::collections::HashSet;

use crate::agent::TransferAgent;
use crate::desc::AgentDesc;
use crate::engine::peer::fetch_desc;
use crate::engine::{Engine, Inner, Peer, lock};
use crate::error::Error;
use std::sync::{Arc, Mutex};

/// The agent's side of the metadata store.
#[derive(Default)]
pub(in crate::engine) struct Names {
    /// Its publication and watch (etcd), while the agent is open.
    #[cfg(feature = "etcd")]
    directory: Mutex<Option<Arc<crate::metadata::etcd::Directory>>>,
    /// Peers loaded by name: resolved again after they leave.
    by_name: Mutex<HashSet<String>>,
}

impl Names {
    /// Whether `name` was loaded by name (and so is resolved again).
    fn loaded_by_name(&self, name: &str) -> bool {
        lock(&self.by_name).contains(name)
    }

    /// Ends the publication (the key goes from the store at once) and the
    /// watch.
    pub(in crate::engine) fn close(&self) {
        #[cfg(feature = "etcd")]
        drop(lock(&self.directory).take());
    }
}

impl Inner {
    /// Publishes the agent in the configured store, if any.
    pub(in crate::engine) fn publish(self: &Arc<Self>) -> Result<(), Error> {
        match self.config.effective_metadata() {
            crate::metadata::Metadata::Direct => Ok(()),
            #[cfg(feature = "etcd")]
            crate::metadata::Metadata::Etcd(cfg) => {
                let me = Arc::downgrade(self);
                let on_gone: crate::metadata::etcd::OnGone = Arc::new(move |name, instance| {
                    if let Some(inner) = me.upgrade() {
                        inner.peer_gone(name, instance);
                    }
                });
                let dir = crate::metadata::etcd::Directory::start(
                    cfg,
                    &self.config.name,
                    // Without GPU handles: every reader of the store would
                    // have them. Same-host peers get them from the live
                    // descriptor they fetch.
                    &self.desc_for(None).encode(),
                    self.config.security.credential.clone(),
                    on_gone,
                )?;
                *lock(&self.names.directory) = Some(Arc::new(dir));
                Ok(())
            }
            #[cfg(not(feature = "etcd"))]
            crate::metadata::Metadata::Etcd(_) => Err(Error::InvalidConfig(
                "this build of kvxfer has no etcd support (cargo feature `etcd`)".into(),
            )),
        }
    }

    /// `name`, published by `instance`, left the store: a peer loaded as
    /// that instance is invalidated, its requests failing with `PeerGone`.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    fn peer_gone(&self, name: &str, instance: u64) {
        let peer = {
            let mut peers = self.peers.write().unwrap_or_else(|p| p.into_inner());
            match peers.get(name) {
                Some(p) if p.desc.instance == instance => peers.remove(name),
                _ => None,
            }
        };
        let Some(peer) = peer else {
            return;
        };
        tracing::info!(agent = %self.config.name, remote = name, instance, "peer left the metadata store; its requests fail");
        self.close_peer(&peer, || Error::PeerGone {
            remote: name.to_owned(),
        });
        // Event loops waiting on messages look at their peers again (the
        // KV-cache receiver fails requests awaiting this one).
        self.inbox.wake();
    }

    /// The descriptor published under `name`.
    fn resolve_name(&self, name: &str) -> Result<AgentDesc, Error> {
        #[cfg(feature = "etcd")]
        if let Some(dir) = lock(&self.names.directory).clone() {
            return dir.resolve(name);
        }
        Err(Error::InvalidConfig(format!(
            "no metadata store to resolve {name:?} in (configure one: AgentConfig::with_etcd or \
             KVXFER_ETCD)"
        )))
    }
}

impl Engine {
    /// Resolves `name` in the store, fetches the live descriptor from the
    /// published endpoints (the published instance must answer) and loads
    /// it.
    pub(in crate::engine) fn load_by_name(&self, name: &str) -> Result<(), Error> {
        let inner = &self.inner;
        let published = inner.resolve_name(name)?;
        let mut last = None;
        for ep in &published.endpoints {
            match fetch_desc(crate::engine::ctx::Ctx::of(inner), ep) {
                Ok(live) if live.instance == published.instance => {
                    lock(&inner.names.by_name).insert(name.to_owned());
                    return self.load_remote_agent(&live);
                }
                Ok(_) => {
                    last = Some(Error::StaleAgent {
                        remote: name.to_owned(),
                        addr: ep.clone(),
                    })
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::UnknownAgent(name.to_owned())))
    }

    /// The loaded peer `name`; one loaded by name that left is resolved
    /// again ([`Error::PeerGone`] while it is not back).
    pub(in crate::engine) fn peer_or_reload(&self, name: &str) -> Result<Arc<Peer>, Error> {
        match self.inner.peer(name) {
            Err(Error::UnknownAgent(_)) if self.inner.names.loaded_by_name(name) => {
                match self.load_by_name(name) {
                    Ok(()) => self.inner.peer(name),
                    Err(Error::UnknownAgent(_)) => Err(Error::PeerGone {
                        remote: name.to_owned(),
                    }),
                    Err(e) => Err(e),
                }
            }
            r => r,
        }
    }
}
