//! etcd v3 through its JSON gateway: the few calls the directory needs
//! (lease grant, keep-alive and revoke; put-if-absent; get; list a prefix;
//! watch a prefix), each bounded by the configured timeout over every
//! endpoint; and the [`Directory`]: an agent's publication (its key, its
//! lease kept alive with back-off while the store is unreachable) and its
//! watch of the prefix, whose events go through [`Liveness`] to the
//! agent.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::{Value, json};

use super::http::{self, Closer, HttpError};
use super::{EtcdConfig, Liveness, StoreEvent, seal, unseal};
use crate::auth::Credential;
use crate::desc::AgentDesc;
use crate::error::Error;

/// The etcd client: the configuration, and the endpoint that answered
/// last (tried first).
pub(crate) struct Client {
    cfg: EtcdConfig,
    good: AtomicUsize,
    tls: Option<http::TlsClient>,
}

/// One key's value, the lease it is bound to (0: none) and the revision
/// that last wrote it.
pub(crate) struct Entry {
    pub(crate) value: Vec<u8>,
    pub(crate) lease: i64,
    pub(crate) mod_revision: i64,
}

/// Keys with their values, and the store's revision when they were read.
pub(crate) type Listing = (Vec<(String, Vec<u8>)>, i64);

/// The end of the key range of every key starting with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// An int64 as the gateway writes it (a string), or a number.
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn b64(v: &Value) -> Vec<u8> {
    v.as_str()
        .and_then(|s| B64.decode(s).ok())
        .unwrap_or_default()
}

impl Client {
    pub(crate) fn new(cfg: EtcdConfig) -> Result<Self, Error> {
        if cfg.endpoints.is_empty() {
            return Err(Error::InvalidConfig("etcd: no endpoint".into()));
        }
        if cfg.lease_ttl < Duration::from_secs(2) {
            return Err(Error::InvalidConfig(format!(
                "etcd: lease TTL {:?} is under etcd's minimum of 2 s",
                cfg.lease_ttl
            )));
        }
        let tls = match &cfg.tls {
            None => None,
            #[cfg(feature = "etcd-tls")]
            Some(t) => Some(
                http::TlsClient::new(t)
                    .map_err(|e| Error::InvalidConfig(format!("etcd TLS: {e}")))?,
            ),
            #[cfg(not(feature = "etcd-tls"))]
            Some(_) => {
                return Err(Error::InvalidConfig(
                    "this build of kvxfer has no TLS to etcd (cargo feature `etcd-tls`)".into(),
                ));
            }
        };
        Ok(Client {
            cfg,
            good: AtomicUsize::new(0),
            tls,
        })
    }

    pub(crate) fn config(&self) -> &EtcdConfig {
        &self.cfg
    }

    fn store_error(&self, reason: impl Into<String>) -> Error {
        Error::MetadataStore {
            store: self.cfg.describe(),
            reason: reason.into(),
        }
    }

    /// `POST`s `body` to `path` on the endpoints in turn (the last good one
    /// first) until one answers, within the timeout.
    fn call(&self, path: &str, body: &Value) -> Result<Value, Error> {
        let deadline = Instant::now() + self.cfg.timeout;
        let body = body.to_string().into_bytes();
        let n = self.cfg.endpoints.len();
        let first = self.good.load(Ordering::Relaxed) % n;
        let mut last = None;
        for k in 0..n {
            let i = (first + k) % n;
            if Instant::now() >= deadline {
                break;
            }
            match http::post(
                &self.cfg.endpoints[i],
                path,
                &body,
                deadline,
                self.tls.as_ref(),
            ) {
                Ok(answer) => {
                    self.good.store(i, Ordering::Relaxed);
                    return serde_json::from_slice(&answer)
                        .map_err(|e| self.store_error(format!("{path}: undecodable answer: {e}")));
                }
                // The server answered: another endpoint of the same
                // cluster would say the same.
                Err(e @ HttpError::Status { .. }) => {
                    return Err(self.store_error(format!("{path}: {e}")));
                }
                Err(e) => last = Some(format!("{}: {e}", self.cfg.endpoints[i])),
            }
        }
        Err(self.store_error(format!(
            "{path}: unreachable ({})",
            last.unwrap_or_else(|| "timed out".into())
        )))
    }

    /// A new lease of the configured time to live.
    pub(crate) fn grant(&self) -> Result<i64, Error> {
        let ttl = self.cfg.lease_ttl.as_secs().max(2);
        let r = self.call("/v3/lease/grant", &json!({ "TTL": ttl }))?;
        let id = int(&r["ID"]);
        if id == 0 {
            return Err(self.store_error(format!("lease grant refused: {r}")));
        }
        Ok(id)
    }

    /// Renews `lease`; its remaining time to live (0: it expired).
    pub(crate) fn keep_alive(&self, lease: i64) -> Result<i64, Error> {
        let r = self.call("/v3/lease/keepalive", &json!({ "ID": lease.to_string() }))?;
        Ok(int(&r["result"]["TTL"]))
    }

    /// Revokes `lease` (its keys go at once).
    pub(crate) fn revoke(&self, lease: i64) -> Result<(), Error> {
        self.call("/v3/lease/revoke", &json!({ "ID": lease.to_string() }))
            .map(|_| ())
    }

    /// Puts `value` under `key`, bound to `lease`, only if no key is there;
    /// whether it did.
    pub(crate) fn put_if_absent(&self, key: &str, value: &[u8], lease: i64) -> Result<bool, Error> {
        let k = B64.encode(key);
        let r = self.call(
            "/v3/kv/txn",
            &json!({
                "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
                "success": [{ "request_put": { "key": k, "value": B64.encode(value), "lease": lease.to_string() } }],
            }),
        )?;
        Ok(r["succeeded"].as_bool().unwrap_or(false))
    }

    /// Puts `value` under `key`, bound to `lease`, whatever is there.
    pub(crate) fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), Error> {
        self.call(
            "/v3/kv/put",
            &json!({ "key": B64.encode(key), "value": B64.encode(value), "lease": lease.to_string() }),
        )
        .map(|_| ())
    }

    /// Puts `value` under `key`, bound to `lease`, only if the key was
    /// last written at `mod_revision`; whether it did.
    pub(crate) fn replace_if(
        &self,
        key: &str,
        mod_revision: i64,
        value: &[u8],
        lease: i64,
    ) -> Result<bool, Error> {
        let k = B64.encode(key);
        let r = self.call(
            "/v3/kv/txn",
            &json!({
                "compare": [{ "key": k, "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision.to_string() }],
                "success": [{ "request_put": { "key": k, "value": B64.encode(value), "lease": lease.to_string() } }],
            }),
        )?;
        Ok(r["succeeded"].as_bool().unwrap_or(false))
    }

    /// Whether `lease` still lives (granted, not expired nor revoked).
    pub(crate) fn lease_alive(&self, lease: i64) -> Result<bool, Error> {
        let r = self.call("/v3/lease/timetolive", &json!({ "ID": lease.to_string() }))?;
        Ok(int(&r["TTL"]) > 0)
    }

    /// The value under `key`.
    pub(crate) fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        Ok(self.entry(key)?.map(|e| e.value))
    }

    /// The entry under `key`: value, lease and revision.
    pub(crate) fn entry(&self, key: &str) -> Result<Option<Entry>, Error> {
        let r = self.call("/v3/kv/range", &json!({ "key": B64.encode(key) }))?;
        Ok(r["kvs"]
            .as_array()
            .and_then(|kvs| kvs.first())
            .map(|kv| Entry {
                value: b64(&kv["value"]),
                lease: int(&kv["lease"]),
                mod_revision: int(&kv["mod_revision"]),
            }))
    }

    /// Every key under `prefix` with its value, and the store's revision.
    pub(crate) fn list(&self, prefix: &str) -> Result<Listing, Error> {
        let r = self.call(
            "/v3/kv/range",
            &json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix.as_bytes())) }),
        )?;
        let kvs = r["kvs"]
            .as_array()
            .map(|kvs| {
                kvs.iter()
                    .map(|kv| {
                        (
                            String::from_utf8_lossy(&b64(&kv["key"])).into_owned(),
                            b64(&kv["value"]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok((kvs, int(&r["header"]["revision"])))
    }

    /// A watch of every key under `prefix` from revision `from` on.
    fn watch(&self, prefix: &str, from: i64, closer: &Closer) -> Result<http::Stream, Error> {
        let body = json!({ "create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix.as_bytes())),
            "start_revision": from.to_string(),
        }})
        .to_string();
        let deadline = Instant::now() + self.cfg.timeout;
        let n = self.cfg.endpoints.len();
        let first = self.good.load(Ordering::Relaxed) % n;
        let mut last = String::from("timed out");
        for k in 0..n {
            let ep = &self.cfg.endpoints[(first + k) % n];
            match http::Stream::open(
                ep,
                "/v3/watch",
                body.as_bytes(),
                deadline,
                closer,
                self.tls.as_ref(),
            ) {
                Ok(s) => return Ok(s),
                Err(e) => last = format!("{ep}: {e}"),
            }
        }
        Err(self.store_error(format!("watch: {last}")))
    }
}

/// The agent name a key under `prefix` names.
fn name_of<'k>(prefix: &str, key: &'k str) -> Option<&'k str> {
    key.strip_prefix(prefix).filter(|n| !n.is_empty())
}

/// The instance a published value names; `None` for what is not a
/// descriptor of the agent `name` (foreign or malformed data, or, with a
/// credential, an entry not sealed with it: ignored).
fn instance_of(cred: Option<&Credential>, key: &str, name: &str, value: &[u8]) -> Option<u64> {
    let value = match unseal(cred, key, value) {
        Ok(v) => v,
        Err(why) => {
            tracing::warn!(name, %why, "an entry in the store not from an agent of this cluster; ignored");
            return None;
        }
    };
    match AgentDesc::decode(value) {
        Ok(d) if d.name == name => Some(d.instance),
        Ok(d) => {
            tracing::warn!(key_name = name, desc_name = %d.name, "a descriptor under another agent's name in the store; ignored");
            None
        }
        Err(e) => {
            tracing::warn!(name, error = %e, "malformed data in the store; ignored");
            None
        }
    }
}

/// What the directory calls when instances leave: `(name, instance)`.
pub(crate) type OnGone = Arc<dyn Fn(&str, u64) + Send + Sync>;

/// Shared between the directory and its threads.
struct Shared {
    client: Client,
    key: String,
    /// The entry as published (sealed with `cred` when there is one).
    value: Vec<u8>,
    cred: Option<Credential>,
    lease: AtomicI64,
    closing: AtomicBool,
    /// Wakes the keep-alive thread early (closing).
    bell: (Mutex<()>, Condvar),
    closer: Closer,
}

/// An agent's presence in the store: published under its name for as long
/// as this lives, and watching the others.
///
/// Drop order: the threads are stopped and joined first, then the lease
/// is revoked (the key goes at once, so peers learn without waiting for it
/// to expire).
pub(crate) struct Directory {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Directory {
    /// Publishes agent `name` (its encoded descriptor `desc`, sealed with
    /// `cred` when given) under a new lease — refused with
    /// [`Error::NameTaken`] while another live agent holds the name; an
    /// entry that is no live agent's (bound to no lease or a gone one, or,
    /// with a credential, not sealed with it) is taken over — and starts
    /// renewing the lease and watching the prefix (departures go to
    /// `on_gone`; an entry of its own replaced or deleted by another
    /// writer is put back).
    pub(crate) fn start(
        cfg: EtcdConfig,
        name: &str,
        desc: &[u8],
        cred: Option<Credential>,
        on_gone: OnGone,
    ) -> Result<Self, Error> {
        let client = Client::new(cfg)?;
        let key = client.config().agent_key(name);
        let value = seal(cred.as_ref(), &key, desc);
        let lease = client.grant()?;
        let published = client
            .put_if_absent(&key, &value, lease)
            .and_then(|put| match put {
                true => Ok(true),
                false => take_over_stale(&client, cred.as_ref(), &key, &value, lease),
            });
        match published {
            Ok(true) => {}
            Ok(false) => {
                let _ = client.revoke(lease);
                return Err(Error::NameTaken {
                    name: name.to_owned(),
                    store: client.config().describe(),
                });
            }
            Err(e) => {
                let _ = client.revoke(lease);
                return Err(e);
            }
        }
        tracing::info!(agent = name, key = %key, lease, "published in the metadata store");
        let shared = Arc::new(Shared {
            client,
            key,
            value,
            cred,
            lease: AtomicI64::new(lease),
            closing: AtomicBool::new(false),
            bell: (Mutex::new(()), Condvar::new()),
            closer: Closer::default(),
        });
        let mut threads = Vec::new();
        let s = Arc::clone(&shared);
        threads.push(
            std::thread::Builder::new()
                .name(format!("kvxfer-lease-{name}"))
                .spawn(move || keep_alive(&s))?,
        );
        let s = Arc::clone(&shared);
        let watcher = std::thread::Builder::new()
            .name(format!("kvxfer-watch-{name}"))
            .spawn(move || watch(&s, &on_gone));
        match watcher {
            Ok(t) => threads.push(t),
            Err(e) => {
                let d = Directory { shared, threads };
                drop(d);
                return Err(e.into());
            }
        }
        Ok(Directory { shared, threads })
    }

    /// The descriptor published under `name`, decoded.
    ///
    /// # Errors
    /// [`Error::UnknownAgent`] when no live agent holds the name;
    /// [`Error::MetadataStore`] when the store cannot be reached; a
    /// descriptor error for data under the name that is not one.
    pub(crate) fn resolve(&self, name: &str) -> Result<AgentDesc, Error> {
        let client = &self.shared.client;
        let key = client.config().agent_key(name);
        let value = client
            .get(&key)?
            .ok_or_else(|| Error::UnknownAgent(name.to_owned()))?;
        let value = unseal(self.shared.cred.as_ref(), &key, &value).map_err(|why| {
            Error::MetadataStore {
                store: client.config().describe(),
                reason: format!("the entry for {name:?}: {why}"),
            }
        })?;
        let desc = AgentDesc::decode(value)?;
        if desc.name != name {
            return Err(Error::MetadataStore {
                store: client.config().describe(),
                reason: format!(
                    "the entry for {name:?} holds the descriptor of {:?}",
                    desc.name
                ),
            });
        }
        Ok(desc)
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        let s = &self.shared;
        s.closing.store(true, Ordering::SeqCst);
        {
            let _g = s.bell.0.lock().unwrap_or_else(|p| p.into_inner());
            s.bell.1.notify_all();
        }
        s.closer.close();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let lease = s.lease.load(Ordering::SeqCst);
        if lease != 0
            && let Err(e) = s.client.revoke(lease)
        {
            tracing::warn!(key = %s.key, error = %e, "could not revoke the lease; the key expires with it");
        }
    }
}

/// Sleeps up to `d`, or until the directory closes; whether it is closing.
fn pause(s: &Shared, d: Duration) -> bool {
    let g = s.bell.0.lock().unwrap_or_else(|p| p.into_inner());
    let _ = s
        .bell
        .1
        .wait_timeout_while(g, d, |_| !s.closing.load(Ordering::SeqCst));
    s.closing.load(Ordering::SeqCst)
}

/// Renews the lease every third of its time to live; while the store is
/// unreachable, retries with back-off; when the lease has expired
/// meanwhile, publishes again under a new one.
fn keep_alive(s: &Shared) {
    let period = s.client.config().lease_ttl / 3;
    let mut wait = period;
    let mut backoff = Duration::from_millis(100);
    while !pause(s, wait) {
        let lease = s.lease.load(Ordering::SeqCst);
        match s.client.keep_alive(lease) {
            Ok(ttl) if ttl > 0 => {
                wait = period;
                backoff = Duration::from_millis(100);
            }
            Ok(_) => {
                tracing::warn!(key = %s.key, "the lease expired (the store was out of reach); publishing again");
                match republish(s) {
                    Ok(()) => wait = period,
                    Err(e) => {
                        tracing::warn!(key = %s.key, error = %e, "publishing again failed; retrying");
                        wait = backoff;
                        backoff = (backoff * 2).min(period);
                    }
                }
            }
            Err(e) => {
                tracing::debug!(key = %s.key, error = %e, "lease renewal failed; retrying");
                wait = backoff;
                backoff = (backoff * 2).min(period);
            }
        }
    }
}

/// Puts `value` under `key` (bound to `lease`) over an entry that is no
/// live agent's: bound to no lease (agents always publish under one) or
/// to one that is gone, or, with a credential, not sealed with it (no
/// agent of this cluster wrote it). Whether it did; `Ok(false)` when a
/// live agent's entry is there.
fn take_over_stale(
    client: &Client,
    cred: Option<&Credential>,
    key: &str,
    value: &[u8],
    lease: i64,
) -> Result<bool, Error> {
    let Some(e) = client.entry(key)? else {
        // Gone meanwhile: publish as usual.
        return client.put_if_absent(key, value, lease);
    };
    let why = if e.lease == 0 {
        "bound to no lease"
    } else if unseal(cred, key, &e.value).is_err() {
        "not sealed with the cluster credential"
    } else if !client.lease_alive(e.lease)? {
        "its lease is gone"
    } else {
        return Ok(false);
    };
    let took = client.replace_if(key, e.mod_revision, value, lease)?;
    if took {
        tracing::warn!(key, why, "took over a stale entry under this agent's name");
    }
    Ok(took)
}

/// Puts the agent's own entry back after another writer replaced or
/// deleted it (logged; the store's ACLs should keep such writers out).
fn restore(s: &Shared) {
    if s.closing.load(Ordering::SeqCst) {
        return;
    }
    let lease = s.lease.load(Ordering::SeqCst);
    match s.client.put(&s.key, &s.value, lease) {
        Ok(()) => {
            tracing::warn!(key = %s.key, "this agent's entry was replaced or deleted in the store; put back")
        }
        Err(e) => {
            tracing::warn!(key = %s.key, error = %e, "could not put this agent's entry back; the lease renewal will")
        }
    }
}

/// Puts the key again under a new lease.
fn republish(s: &Shared) -> Result<(), Error> {
    let lease = s.client.grant()?;
    if s.client.put_if_absent(&s.key, &s.value, lease)? {
        s.lease.store(lease, Ordering::SeqCst);
        Ok(())
    } else {
        let _ = s.client.revoke(lease);
        Err(Error::MetadataStore {
            store: s.client.config().describe(),
            reason: format!("{} was taken by another agent meanwhile", s.key),
        })
    }
}

/// Watches the prefix until the directory closes: lists it (a resync),
/// then follows its changes; after any break, waits (with back-off) and
/// starts over.
fn watch(s: &Shared, on_gone: &OnGone) {
    let prefix = s.client.config().agents_prefix();
    let mut live = Liveness::default();
    let mut backoff = Duration::from_millis(100);
    let max = s.client.config().lease_ttl / 3;
    while !s.closing.load(Ordering::SeqCst) {
        match watch_once(s, &prefix, &mut live, on_gone) {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                if s.closing.load(Ordering::SeqCst) {
                    return;
                }
                tracing::debug!(error = %e, "watching the store failed; starting over");
                if pause(s, backoff) {
                    return;
                }
                backoff = (backoff * 2).min(max);
            }
        }
    }
}

/// Feeds `ev` to `live` and reports the departures.
fn feed(live: &mut Liveness, ev: StoreEvent, on_gone: &OnGone) {
    for (name, instance) in live.apply(ev) {
        tracing::info!(name, instance, "an agent left the store");
        on_gone(&name, instance);
    }
}

fn watch_once(
    s: &Shared,
    prefix: &str,
    live: &mut Liveness,
    on_gone: &OnGone,
) -> Result<(), Error> {
    let (kvs, revision) = s.client.list(prefix)?;
    let cred = s.cred.as_ref();
    // Its own entry as it should be, else put back.
    if kvs.iter().all(|(k, v)| *k != s.key || *v != s.value) {
        restore(s);
    }
    let now = kvs
        .iter()
        .filter_map(|(k, v)| {
            let name = name_of(prefix, k)?;
            Some((name.to_owned(), instance_of(cred, k, name, v)?))
        })
        .collect();
    feed(live, StoreEvent::Resync(now), on_gone);
    let mut stream = s.client.watch(prefix, revision + 1, &s.closer)?;
    if s.closing.load(Ordering::SeqCst) {
        return Ok(());
    }
    let broken = |e: HttpError| Error::MetadataStore {
        store: s.client.config().describe(),
        reason: format!("watch: {e}"),
    };
    while let Some(msg) = stream.next_message().map_err(broken)? {
        let Ok(v) = serde_json::from_slice::<Value>(&msg) else {
            continue;
        };
        let result = &v["result"];
        if result["canceled"].as_bool() == Some(true) {
            // Compacted past our revision, or refused: list again.
            return Ok(());
        }
        for ev in result["events"].as_array().into_iter().flatten() {
            let key = String::from_utf8_lossy(&b64(&ev["kv"]["key"])).into_owned();
            let Some(name) = name_of(prefix, &key) else {
                continue;
            };
            let deleted = ev["type"].as_str() == Some("DELETE");
            if key == s.key {
                // Its own entry, changed by another writer (or deleted with
                // its lease, which the renewal handles): put back.
                if deleted || b64(&ev["kv"]["value"]) != s.value {
                    restore(s);
                }
                continue;
            }
            let ev = if deleted {
                StoreEvent::Delete {
                    name: name.to_owned(),
                }
            } else {
                match instance_of(cred, &key, name, &b64(&ev["kv"]["value"])) {
                    Some(instance) => StoreEvent::Put {
                        name: name.to_owned(),
                        instance,
                    },
                    None => continue,
                }
            };
            feed(live, ev, on_gone);
        }
    }
    Err(Error::MetadataStore {
        store: s.client.config().describe(),
        reason: "the watch ended".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_end_past_every_key_under_them() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }

    #[test]
    fn names_come_from_keys_under_the_prefix_only() {
        assert_eq!(name_of("/k/agents/", "/k/agents/ctx-1"), Some("ctx-1"));
        assert_eq!(name_of("/k/agents/", "/k/agents/"), None);
        assert_eq!(name_of("/k/agents/", "/other/x"), None);
        assert_eq!(
            instance_of(None, "/k/agents/x", "x", b"not a descriptor"),
            None
        );
    }
}
