//! Object storage (`MemoryType::Obj`): objects in an S3-compatible store
//! as transfer targets.
//!
//! An agent opens an object ([`TransferAgent::open_object`]) in a store
//! ([`ObjectStore`]: endpoint, bucket, region, credentials) and gets a
//! handle; OBJ descriptors name a byte range of it (`addr` = offset in the
//! object, `device_id` = handle) and are registered like FILE regions. A
//! request to the agent itself with OBJ remote descriptors then moves host
//! memory (GPU memory through a host buffer per HTTP request, copied out
//! before it is sent or in after it arrived):
//!
//! - **WRITE** = PUT: a descriptor writes its object whole (its `addr` must
//!   be 0; objects are immutable, there is no partial write), as one PUT up
//!   to [`ObjectStoreConfig::part_size`], else as a multipart upload whose parts
//!   go in parallel (aborted when one fails). Durable once the PUT or the
//!   completion of the upload has been answered.
//! - **READ** = ranged GET of `[addr, addr + len)` straight into the local
//!   memory, in parallel parts of at most `part_size` bytes.
//!
//! Each store has its own worker threads (at most
//! [`ObjectStoreConfig::parallel`] HTTP requests in flight) and connection pool,
//! started with its first transfer; the library's threading stays
//! synchronous (no async runtime). Throttling (`SlowDown`, 429, 503), server
//! errors and refused or reset connections are retried with exponential
//! backoff ([`ObjectStoreConfig::retries`] times, each request within its deadline);
//! everything else fails the request at once with an [`ObjError`] that
//! names what failed.
//!
//! Files: `mod.rs` (the store's configuration and errors), `client.rs`
//! (one S3 operation, signed with `rusty-s3`, over `ureq`: retries and
//! error mapping), `pool.rs` (the workers and a request's batch of
//! operations).
//!
//! [`TransferAgent::open_object`]: crate::TransferAgent::open_object

pub(crate) mod client;
pub mod error;
pub(crate) mod pool;

pub use error::{ObjError, ObjErrorKind};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;

/// Parts of a multipart upload (and ranged reads) are at least this big
/// (S3's minimum part size, but for the last).
pub const PART_SIZE_MIN: u64 = 5 << 20;
/// And at most this big (S3's maximum).
pub const PART_SIZE_MAX: u64 = 5 << 30;
/// S3's largest number of parts in one upload.
pub const PARTS_MAX: u64 = 10_000;

/// An S3-compatible object store: where OBJ regions live.
///
/// Cloning is cheap and shares the store's connection pool and worker
/// threads: open every object of one bucket from clones of one value.
#[derive(Clone)]
pub struct ObjectStore {
    pub(crate) inner: Arc<client::Client>,
}

impl fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.inner.config;
        f.debug_struct("ObjectStore")
            .field("endpoint", &c.endpoint)
            .field("bucket", &c.bucket)
            .field("region", &c.region)
            .field("access_key", &c.access_key)
            .finish_non_exhaustive()
    }
}

/// What an [`ObjectStore`] is made from: the store's address and the
/// credentials, with the transfer settings.
#[derive(Clone)]
pub struct ObjectStoreConfig {
    /// The endpoint, `http://host:port` or `https://host` (AWS:
    /// `https://s3.<region>.amazonaws.com`).
    pub endpoint: String,
    /// The bucket.
    pub bucket: String,
    /// The region the requests are signed for (`us-east-1` by default).
    pub region: String,
    /// The access key id.
    pub access_key: String,
    /// The secret access key.
    pub secret_key: String,
    /// A session token (temporary credentials).
    pub session_token: Option<String>,
    /// Virtual-hosted-style URLs (`bucket.host/key`) instead of path-style
    /// (`host/bucket/key`, the default: what S3-compatible servers take).
    pub virtual_hosted: bool,
    /// The size of a multipart upload's parts and of ranged reads' pieces
    /// (8 MiB by default; 5 MiB to 5 GiB).
    pub part_size: u64,
    /// HTTP requests in flight at once, and worker threads (8 by default).
    pub parallel: usize,
    /// The deadline of one HTTP request, connection to last byte (30 s by
    /// default).
    pub timeout: Duration,
    /// How often a throttled or failed request is tried again (4 by
    /// default).
    pub retries: u32,
}

impl fmt::Debug for ObjectStoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStoreConfig")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .field("part_size", &self.part_size)
            .field("parallel", &self.parallel)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .finish_non_exhaustive()
    }
}

impl ObjectStoreConfig {
    /// A store at `endpoint` with explicit credentials, default settings.
    pub fn new(
        endpoint: impl Into<String>,
        bucket: impl Into<String>,
        access_key: impl Into<String>,
        secret_key: impl Into<String>,
    ) -> Self {
        ObjectStoreConfig {
            endpoint: endpoint.into(),
            bucket: bucket.into(),
            region: "us-east-1".into(),
            access_key: access_key.into(),
            secret_key: secret_key.into(),
            session_token: None,
            virtual_hosted: false,
            part_size: 8 << 20,
            parallel: 8,
            timeout: Duration::from_secs(30),
            retries: 4,
        }
    }

    /// The store of `bucket` as the AWS tools find it: credentials from
    /// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and `AWS_SESSION_TOKEN`,
    /// else the profile (`AWS_PROFILE`, else `default`) of
    /// `AWS_SHARED_CREDENTIALS_FILE` (`~/.aws/credentials`); the region from
    /// `AWS_REGION`, `AWS_DEFAULT_REGION`, else the profile in
    /// `AWS_CONFIG_FILE` (`~/.aws/config`), else `us-east-1`; the endpoint
    /// from `AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`,
    /// `AWS_ENDPOINT_OVERRIDE` (NIXL's name), else AWS's for the region.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when no credentials are found.
    pub fn from_env(bucket: impl Into<String>) -> Result<Self, Error> {
        Self::from_env_with(bucket, &StoreOptions::default())
    }

    /// [`from_env`](Self::from_env) with what `options` gives taking the
    /// place of what the environment says (credentials given there need
    /// none in the environment; a region given there also picks AWS's
    /// endpoint for it when none is named).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when no credentials are found.
    pub fn from_env_with(bucket: impl Into<String>, options: &StoreOptions) -> Result<Self, Error> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let home = env("HOME").unwrap_or_default();
        let creds_file = env("AWS_SHARED_CREDENTIALS_FILE")
            .unwrap_or_else(|| format!("{home}/.aws/credentials"));
        let config_file = env("AWS_CONFIG_FILE").unwrap_or_else(|| format!("{home}/.aws/config"));
        let from_file = |file: &str, section: &str, key: &str| {
            let text = std::fs::read_to_string(file).ok()?;
            ini_value(&text, section, key)
        };
        let creds_section = profile.clone();
        let config_section = if profile == "default" {
            "default".to_owned()
        } else {
            format!("profile {profile}")
        };
        let given = options.access_key.clone().zip(options.secret_key.clone());
        let (access_key, secret_key, session_token) = match given {
            Some((a, s)) => (a, s, options.session_token.clone()),
            None => match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
                (Some(a), Some(s)) => (a, s, env("AWS_SESSION_TOKEN")),
                _ => {
                    let get = |k| from_file(&creds_file, &creds_section, k);
                    match (get("aws_access_key_id"), get("aws_secret_access_key")) {
                        (Some(a), Some(s)) => (a, s, get("aws_session_token")),
                        _ => {
                            return Err(Error::InvalidConfig(format!(
                                "object store: no credentials (AWS_ACCESS_KEY_ID and \
                                 AWS_SECRET_ACCESS_KEY, or profile {profile:?} in {creds_file})"
                            )));
                        }
                    }
                }
            },
        };
        let region = options
            .region
            .clone()
            .or_else(|| env("AWS_REGION"))
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .or_else(|| from_file(&config_file, &config_section, "region"))
            .unwrap_or_else(|| "us-east-1".into());
        let endpoint = options
            .endpoint
            .clone()
            .or_else(|| env("AWS_ENDPOINT_URL_S3"))
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| env("AWS_ENDPOINT_OVERRIDE"))
            .or_else(|| from_file(&config_file, &config_section, "endpoint_url"))
            .unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
        let mut c = ObjectStoreConfig::new(endpoint, bucket, access_key, secret_key);
        c.region = region;
        c.session_token = session_token;
        if let Some(v) = options.virtual_hosted {
            c.virtual_hosted = v;
        }
        Ok(c)
    }

    /// Checks the settings and makes the store (no request is sent).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`]: an endpoint that is no `http` or `https`
    /// URL with a host, an empty bucket, a part size out of 5 MiB..5 GiB,
    /// no parallelism, a zero timeout.
    pub fn build(self) -> Result<ObjectStore, Error> {
        let bad = |what: String| Err(Error::InvalidConfig(format!("object store: {what}")));
        if self.bucket.is_empty() {
            return bad("an empty bucket name".into());
        }
        if !(PART_SIZE_MIN..=PART_SIZE_MAX).contains(&self.part_size) {
            return bad(format!(
                "part size {} out of {PART_SIZE_MIN}..={PART_SIZE_MAX}",
                self.part_size
            ));
        }
        if self.parallel == 0 || self.parallel > 256 {
            return bad(format!("parallel {} out of 1..=256", self.parallel));
        }
        if self.timeout.is_zero() {
            return bad("a zero timeout".into());
        }
        Ok(ObjectStore {
            inner: Arc::new(client::Client::new(self)?),
        })
    }
}

impl ObjectStore {
    /// Its configuration.
    pub fn config(&self) -> &ObjectStoreConfig {
        &self.inner.config
    }

    /// Creates the bucket (a test's or a tool's convenience; kvxfer never
    /// creates buckets by itself). Succeeds when this caller already owns
    /// it.
    ///
    /// # Errors
    /// [`Error::Object`] as the store answered.
    pub fn create_bucket(&self) -> Result<(), Error> {
        Ok(self.inner.create_bucket()?)
    }

    /// The size of object `key`, `None` when it does not exist.
    ///
    /// # Errors
    /// [`Error::Object`] as the store answered (a missing bucket, denied
    /// access, ...).
    pub fn object_size(&self, key: &str) -> Result<Option<u64>, Error> {
        Ok(self.inner.head(key)?)
    }

    /// Deletes object `key` (no error when it does not exist).
    ///
    /// # Errors
    /// [`Error::Object`] as the store answered.
    pub fn delete_object(&self, key: &str) -> Result<(), Error> {
        Ok(self.inner.delete(key)?)
    }
}

/// Object stores by bucket and [`StoreOptions`], made on first use from
/// the AWS environment and the options: what the C and Python fronts open
/// objects in, one connection pool per bucket and options.
#[derive(Default)]
pub struct ObjectStores {
    stores: std::sync::Mutex<std::collections::HashMap<(String, StoreOptions), ObjectStore>>,
}

/// What a front takes from its caller in place of the environment when it
/// opens a store ([`ObjectStores::get_with`]): each `None` is left to the
/// environment, as [`ObjectStoreConfig::from_env`] finds it.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct StoreOptions {
    /// The endpoint (`http://host:port`).
    pub endpoint: Option<String>,
    /// The region requests are signed for.
    pub region: Option<String>,
    /// The access key id (with `secret_key`).
    pub access_key: Option<String>,
    /// The secret access key (with `access_key`).
    pub secret_key: Option<String>,
    /// A session token (with the keys given here).
    pub session_token: Option<String>,
    /// Virtual-hosted-style URLs.
    pub virtual_hosted: Option<bool>,
}

impl fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreOptions")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .field("virtual_hosted", &self.virtual_hosted)
            .finish_non_exhaustive()
    }
}

impl ObjectStores {
    /// The store of `bucket` at `endpoint` (the environment's when `None`,
    /// see [`ObjectStoreConfig::from_env`]).
    ///
    /// # Errors
    /// As [`ObjectStoreConfig::from_env`] and [`ObjectStoreConfig::build`].
    pub fn get(&self, endpoint: Option<&str>, bucket: &str) -> Result<ObjectStore, Error> {
        let options = StoreOptions {
            endpoint: endpoint.map(str::to_owned),
            ..StoreOptions::default()
        };
        self.get_with(bucket, &options)
    }

    /// The store of `bucket` with `options` in place of what the
    /// environment says (see [`ObjectStoreConfig::from_env_with`]); one per
    /// bucket and options.
    ///
    /// # Errors
    /// As [`ObjectStoreConfig::from_env_with`] and [`ObjectStoreConfig::build`].
    pub fn get_with(&self, bucket: &str, options: &StoreOptions) -> Result<ObjectStore, Error> {
        let mut stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        let k = (bucket.to_owned(), options.clone());
        if let Some(s) = stores.get(&k) {
            return Ok(s.clone());
        }
        let s = ObjectStoreConfig::from_env_with(bucket, options)?.build()?;
        stores.insert(k, s.clone());
        Ok(s)
    }
}

/// The value of `key` in `[section]` of an INI text (the AWS files).
fn ini_value(text: &str, section: &str, key: &str) -> Option<String> {
    let mut inside = false;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((k, v)) = line.split_once('=')
            && k.trim() == key
        {
            return Some(v.trim().to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ini_values_are_found_in_their_section_only() {
        let text = "[default]\nregion = eu-west-1\n[profile other]\nregion=us-west-2\n\
                    endpoint_url = http://x:1\n";
        assert_eq!(ini_value(text, "default", "region").unwrap(), "eu-west-1");
        assert_eq!(
            ini_value(text, "profile other", "region").unwrap(),
            "us-west-2"
        );
        assert_eq!(ini_value(text, "default", "endpoint_url"), None);
        assert_eq!(ini_value(text, "missing", "region"), None);
    }

    #[test]
    fn bad_settings_are_refused_before_any_request() {
        let ok = || ObjectStoreConfig::new("http://127.0.0.1:9", "b", "a", "s");
        assert!(ok().build().is_ok());
        let mut c = ok();
        c.part_size = 1 << 20;
        assert!(matches!(c.build(), Err(Error::InvalidConfig(_))));
        let mut c = ok();
        c.parallel = 0;
        assert!(matches!(c.build(), Err(Error::InvalidConfig(_))));
        let mut c = ok();
        c.bucket.clear();
        assert!(matches!(c.build(), Err(Error::InvalidConfig(_))));
        let mut c = ok();
        c.endpoint = "ftp://host".into();
        assert!(matches!(c.build(), Err(Error::InvalidConfig(_))));
        let mut c = ok();
        c.endpoint = "not a url".into();
        assert!(matches!(c.build(), Err(Error::InvalidConfig(_))));
    }
}
