//! Cluster metadata: how an agent finds its peers by name.
//!
//! Two ways ([`Metadata`]): **direct** (the default) — peers hand each
//! other descriptors, or fetch them over the side channel from a
//! `host:port` (`load_remote_agent`, `load_remote_agent_by_connection`);
//! and **etcd** v3 — every agent publishes its descriptor under
//! `<prefix>/agents/<name>`, bound to a lease it keeps alive, and
//! `load_remote_agent_by_name` resolves a peer from there (then fetches its
//! current descriptor over the side channel, checking that the same
//! instance answers).
//!
//! With a store, an agent watches the names under the prefix: when a
//! peer's key goes (its lease expired with its process, or it closed) or
//! names another instance (it restarted), the peer is invalidated and its
//! requests in flight fail at once with [`Error::PeerGone`](crate::Error::PeerGone);
//! the next request to a peer loaded by name resolves it again. What a
//! store event means for the loaded peers is decided by `Liveness`, a
//! state machine free of I/O.

#![forbid(unsafe_code)]
// Without the etcd client, nothing feeds the liveness machine.
#![cfg_attr(not(feature = "etcd"), allow(dead_code))]

#[cfg(feature = "etcd")]
pub(crate) mod etcd;
#[cfg(feature = "etcd")]
pub(crate) mod http;

use std::collections::HashMap;
use std::time::Duration;

/// Where an agent publishes itself and finds its peers
/// ([`AgentConfig::metadata`](crate::AgentConfig)).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum Metadata {
    /// No store: descriptors go peer to peer (the default; enough for a
    /// pair of processes), unless `KVXFER_ETCD` names an etcd cluster
    /// ([`AgentConfig::effective_metadata`](crate::AgentConfig::effective_metadata)).
    #[default]
    Direct,
    /// An etcd v3 cluster.
    Etcd(EtcdConfig),
}

/// An etcd v3 cluster as a metadata store. Reached through etcd's JSON
/// gateway (served on the client port of every etcd since 3.3), over HTTP,
/// or HTTPS with [`tls`](Self::tls) (cargo feature `etcd-tls`). Give the
/// agents a cluster credential as well: the descriptors the store holds
/// carry region keys.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EtcdConfig {
    /// Client endpoints, `host:port`, tried in turn.
    pub endpoints: Vec<String>,
    /// Key prefix: several clusters can share one etcd under different
    /// prefixes. Default `/kvxfer`.
    pub prefix: String,
    /// The lease an agent's key is bound to: a process that dies without
    /// closing disappears from the store this long after its last renewal
    /// (renewed every third of it). Default 5 s.
    pub lease_ttl: Duration,
    /// Deadline of one store request (over every endpoint). Default 2 s.
    pub timeout: Duration,
    /// TLS to the endpoints (`None`: plain HTTP).
    pub tls: Option<EtcdTls>,
}

/// TLS to etcd's client port: the server's certificate checked against
/// `ca_file`, and optionally a client certificate for etcd's
/// `--client-cert-auth`.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EtcdTls {
    /// PEM file of the certificate authorities the server's certificate
    /// must chain to.
    pub ca_file: std::path::PathBuf,
    /// PEM files of this client's certificate chain and private key.
    pub client: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// The name the server's certificate must hold (default: the
    /// endpoint's host, a DNS name or an IP address).
    pub server_name: Option<String>,
}

impl EtcdTls {
    /// Servers checked against `ca_file`, no client certificate.
    pub fn new(ca_file: impl Into<std::path::PathBuf>) -> Self {
        EtcdTls {
            ca_file: ca_file.into(),
            client: None,
            server_name: None,
        }
    }

    /// Presents the certificate chain in `cert` with the key in `key`.
    pub fn with_client_cert(
        mut self,
        cert: impl Into<std::path::PathBuf>,
        key: impl Into<std::path::PathBuf>,
    ) -> Self {
        self.client = Some((cert.into(), key.into()));
        self
    }
}

impl EtcdConfig {
    /// A cluster at `endpoints` (`host:port`), with the default prefix,
    /// lease and timeout.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        EtcdConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: "/kvxfer".into(),
            lease_ttl: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
            tls: None,
        }
    }

    /// Talks to the endpoints over TLS.
    pub fn with_tls(mut self, tls: EtcdTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets the key prefix.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the lease time to live (at least 2 s: etcd's minimum).
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the deadline of one store request.
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// The endpoints as one string, for messages.
    pub fn describe(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("etcd {scheme}://{}", self.endpoints.join(","))
    }

    /// The key of agent `name`.
    pub(crate) fn agent_key(&self, name: &str) -> String {
        format!("{}/agents/{name}", self.prefix.trim_end_matches('/'))
    }

    /// The prefix of every agent's key.
    pub(crate) fn agents_prefix(&self) -> String {
        self.agent_key("")
    }

    /// `KVXFER_ETCD` (comma-separated endpoints) with `KVXFER_ETCD_PREFIX`
    /// and `KVXFER_ETCD_LEASE_TTL` (seconds), when set.
    pub(crate) fn from_env() -> Option<Self> {
        let eps = std::env::var("KVXFER_ETCD").ok()?;
        let eps: Vec<String> = eps
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if eps.is_empty() {
            return None;
        }
        let mut c = EtcdConfig::new(eps);
        if let Ok(p) = std::env::var("KVXFER_ETCD_PREFIX") {
            c.prefix = p;
        }
        if let Some(ttl) = std::env::var("KVXFER_ETCD_LEASE_TTL")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            c.lease_ttl = Duration::from_secs(ttl);
        }
        Some(c)
    }
}

/// What the store says about the names under the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StoreEvent {
    /// `name` is published by `instance`.
    Put { name: String, instance: u64 },
    /// `name` is no longer published.
    Delete { name: String },
    /// Everything published now (after a gap in the watch: what changed
    /// meanwhile is inferred).
    Resync(Vec<(String, u64)>),
}

/// What the store last said, by name: the instance published under it.
/// Fed with [`StoreEvent`]s, it says which instances went away (their key
/// deleted or expired, or taken over by another instance), so that peers
/// loaded as those instances are invalidated.
#[derive(Debug, Default)]
pub(crate) struct Liveness {
    published: HashMap<String, u64>,
}

impl Liveness {
    /// Applies `ev`; the `(name, instance)` pairs no longer published.
    pub(crate) fn apply(&mut self, ev: StoreEvent) -> Vec<(String, u64)> {
        match ev {
            StoreEvent::Put { name, instance } => {
                match self.published.insert(name.clone(), instance) {
                    Some(old) if old != instance => vec![(name, old)],
                    _ => Vec::new(),
                }
            }
            StoreEvent::Delete { name } => self
                .published
                .remove(&name)
                .map(|old| vec![(name, old)])
                .unwrap_or_default(),
            StoreEvent::Resync(now) => {
                let now: HashMap<String, u64> = now.into_iter().collect();
                let mut gone: Vec<(String, u64)> = self
                    .published
                    .iter()
                    .filter(|(n, i)| now.get(*n) != Some(i))
                    .map(|(n, i)| (n.clone(), *i))
                    .collect();
                gone.sort();
                self.published = now;
                gone
            }
        }
    }

    /// The instance published under `name`, as last seen.
    #[cfg(test)]
    pub(crate) fn instance(&self, name: &str) -> Option<u64> {
        self.published.get(name).copied()
    }
}

/// The start of a sealed store entry: this, the 32-byte seal, then the
/// descriptor. (An encoded descriptor starts with its version, never
/// `k`.)
const SEALED: &[u8; 8] = b"kvxfer\x01S";

/// What an agent publishes under `key`: its encoded descriptor `desc`,
/// sealed with the cluster credential when it holds one (HMAC-SHA256 over
/// the key and the descriptor), so that a store writer without the secret
/// can neither forge an entry nor move one to another name.
pub(crate) fn seal(cred: Option<&crate::auth::Credential>, key: &str, desc: &[u8]) -> Vec<u8> {
    let Some(cred) = cred else {
        return desc.to_vec();
    };
    let mut v = Vec::with_capacity(SEALED.len() + 32 + desc.len());
    v.extend_from_slice(SEALED);
    v.extend_from_slice(&cred.seal(key.as_bytes(), desc));
    v.extend_from_slice(desc);
    v
}

/// Why a store entry is not taken as an agent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unsealed {
    /// The reader holds a credential and the entry carries no seal.
    NotSealed,
    /// The seal does not check out with the reader's credential (forged,
    /// moved from another key, or sealed with another secret).
    BadSeal,
}

impl std::fmt::Display for Unsealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unsealed::NotSealed => "the entry is not sealed with the cluster credential",
            Unsealed::BadSeal => "the entry's seal does not check out with the cluster credential",
        })
    }
}

/// The descriptor in the entry `value` under `key`: with a credential, only
/// from an entry sealed with it; without, from any entry (the seal, if
/// any, unchecked: such an agent trusts the store).
pub(crate) fn unseal<'v>(
    cred: Option<&crate::auth::Credential>,
    key: &str,
    value: &'v [u8],
) -> Result<&'v [u8], Unsealed> {
    let sealed = value.starts_with(SEALED) && value.len() >= SEALED.len() + 32;
    match (cred, sealed) {
        (None, false) => Ok(value),
        (None, true) => Ok(&value[SEALED.len() + 32..]),
        (Some(_), false) => Err(Unsealed::NotSealed),
        (Some(cred), true) => {
            let (tag, desc) = value[SEALED.len()..].split_at(32);
            if cred.verify_seal(key.as_bytes(), desc, tag) {
                Ok(desc)
            } else {
                Err(Unsealed::BadSeal)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_sealed_to_their_key_with_the_credential() {
        let cred =
            crate::auth::Credential::new(b"7d1f3a9c5e0b8246-c0ffe5a1b9d4e273".to_vec()).unwrap();
        let other =
            crate::auth::Credential::new(b"e84b20c6f1a97d35-5b0e9f2c7a41d6e8".to_vec()).unwrap();
        let desc = [3u8, 1, 2, 3];
        let v = seal(Some(&cred), "/k/agents/a", &desc);
        assert_eq!(unseal(Some(&cred), "/k/agents/a", &v), Ok(&desc[..]));
        // Moved to another name, sealed with another secret, altered, or
        // not sealed at all: refused with a credential.
        assert_eq!(
            unseal(Some(&cred), "/k/agents/b", &v),
            Err(Unsealed::BadSeal)
        );
        assert_eq!(
            unseal(Some(&other), "/k/agents/a", &v),
            Err(Unsealed::BadSeal)
        );
        let mut altered = v.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert_eq!(
            unseal(Some(&cred), "/k/agents/a", &altered),
            Err(Unsealed::BadSeal)
        );
        assert_eq!(
            unseal(Some(&cred), "/k/agents/a", &desc),
            Err(Unsealed::NotSealed)
        );
        assert_eq!(
            unseal(Some(&cred), "/k/agents/a", &v[..v.len() - desc.len() - 1]),
            Err(Unsealed::NotSealed)
        );
        // Without a credential: plain descriptors, and sealed ones read.
        assert_eq!(seal(None, "/k/agents/a", &desc), desc);
        assert_eq!(unseal(None, "/k/agents/a", &desc), Ok(&desc[..]));
        assert_eq!(unseal(None, "/k/agents/a", &v), Ok(&desc[..]));
    }

    fn put(n: &str, i: u64) -> StoreEvent {
        StoreEvent::Put {
            name: n.into(),
            instance: i,
        }
    }

    #[test]
    fn deletions_and_new_instances_are_departures() {
        let mut l = Liveness::default();
        assert!(l.apply(put("a", 1)).is_empty());
        assert!(l.apply(put("b", 2)).is_empty());
        // The same instance again (a republish): nothing went.
        assert!(l.apply(put("a", 1)).is_empty());
        // A restart: the old instance went.
        assert_eq!(l.apply(put("a", 3)), vec![("a".to_owned(), 1)]);
        assert_eq!(l.instance("a"), Some(3));
        assert_eq!(
            l.apply(StoreEvent::Delete { name: "b".into() }),
            vec![("b".to_owned(), 2)]
        );
        // Deleting what was never seen: nothing.
        assert!(l.apply(StoreEvent::Delete { name: "zz".into() }).is_empty());
    }

    #[test]
    fn a_resync_infers_what_changed_during_a_gap() {
        let mut l = Liveness::default();
        for (n, i) in [("a", 1), ("b", 2), ("c", 3)] {
            l.apply(put(n, i));
        }
        // During the gap: b expired, c restarted, d arrived.
        let gone = l.apply(StoreEvent::Resync(vec![
            ("a".into(), 1),
            ("c".into(), 9),
            ("d".into(), 4),
        ]));
        assert_eq!(gone, vec![("b".to_owned(), 2), ("c".to_owned(), 3)]);
        assert_eq!(l.instance("d"), Some(4));
        assert_eq!(l.instance("b"), None);
    }

    #[test]
    fn keys_live_under_the_prefix() {
        let c = EtcdConfig::new(["127.0.0.1:2379"]).with_prefix("/cluster-a/");
        assert_eq!(c.agent_key("ctx-0"), "/cluster-a/agents/ctx-0");
        assert_eq!(c.agents_prefix(), "/cluster-a/agents/");
    }
}
