//! One S3 operation at a time: requests presigned with `rusty-s3` (sans
//! I/O), sent with `ureq` (blocking, its own pool of keep-alive
//! connections), retried when the store throttles or fails for a moment,
//! and the store's answers mapped to [`ObjError`]s.

#![forbid(unsafe_code)]

use std::io::Read;
use std::time::{Duration, Instant};

use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use ureq::http::{Method, Request, Response};

use super::{ObjError, ObjErrorKind, ObjectStoreConfig};
use crate::error::Error;

/// How long a presigned URL stays valid: longer than any one request's
/// deadline (the request is signed right before it is sent).
const SIGNED_FOR: Duration = Duration::from_secs(3600);
/// The first retry's wait; doubled each time, at most [`BACKOFF_MAX`].
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Error bodies read at most this much.
const ERROR_BODY_MAX: u64 = 64 << 10;

/// A store's client: its configuration, bucket, credentials and HTTP agent.
pub(crate) struct Client {
    pub(crate) config: ObjectStoreConfig,
    bucket: Bucket,
    creds: Credentials,
    http: ureq::Agent,
    /// The store's worker threads, started with its first transfer.
    pub(crate) pool: std::sync::OnceLock<super::pool::Pool>,
}

/// A failed attempt: the error, and whether trying again may help.
struct Attempt {
    error: ObjError,
    retry: bool,
}

impl Client {
    pub(crate) fn new(config: ObjectStoreConfig) -> Result<Self, Error> {
        let bad = |what: String| Error::InvalidConfig(format!("object store: {what}"));
        let endpoint = url::Url::parse(&config.endpoint)
            .map_err(|e| bad(format!("endpoint {:?}: {e}", config.endpoint)))?;
        let style = if config.virtual_hosted {
            UrlStyle::VirtualHost
        } else {
            UrlStyle::Path
        };
        let bucket = Bucket::new(
            endpoint,
            style,
            config.bucket.clone(),
            config.region.clone(),
        )
        .map_err(|e| bad(format!("endpoint {:?}: {e}", config.endpoint)))?;
        let creds = match &config.session_token {
            Some(t) => Credentials::new_with_token(&config.access_key, &config.secret_key, t),
            None => Credentials::new(&config.access_key, &config.secret_key),
        };
        let http = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(config.timeout))
            .max_idle_connections_per_host(config.parallel * 2)
            .max_idle_connections(config.parallel * 2)
            .user_agent("kvxfer")
            // https endpoints: rustls on the library's one crypto library
            // (ureq is built without a provider of its own).
            .tls_config(
                ureq::tls::TlsConfig::builder()
                    .unversioned_rustls_crypto_provider(std::sync::Arc::new(
                        rustls::crypto::aws_lc_rs::default_provider(),
                    ))
                    .build(),
            )
            .build()
            .new_agent();
        Ok(Client {
            config,
            bucket,
            creds,
            http,
            pool: std::sync::OnceLock::new(),
        })
    }

    fn error(&self, op: &'static str, key: &str, kind: ObjErrorKind, detail: String) -> ObjError {
        ObjError {
            op,
            bucket: self.config.bucket.clone(),
            key: key.to_owned(),
            kind,
            detail,
        }
    }

    /// Runs `make` (a signed request) and `answer` (what a successful
    /// response gives) until it succeeds, fails for good, or the retries or
    /// `deadline` run out.
    fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        deadline: Option<Instant>,
        mut attempt: impl FnMut() -> Result<T, Attempt>,
    ) -> Result<T, ObjError> {
        let mut wait = BACKOFF_FIRST;
        let mut tries = 0;
        loop {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(a) => {
                    tries += 1;
                    let late = deadline.is_some_and(|d| Instant::now() + wait >= d);
                    if !a.retry || tries > self.config.retries || late {
                        return Err(a.error);
                    }
                    tracing::debug!(op, key, error = %a.error, tries, "object store: trying again");
                    // Jitter: up to half the wait again, from the clock.
                    let nanos = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.subsec_nanos());
                    let jitter = wait.mul_f64(f64::from(nanos % 1000) / 2000.0);
                    std::thread::sleep(wait + jitter);
                    wait = (wait * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// Sends one request; a non-2xx answer is an [`Attempt`] with the
    /// store's code.
    fn send(
        &self,
        op: &'static str,
        key: &str,
        method: Method,
        url: url::Url,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<Response<ureq::Body>, Attempt> {
        let mut b = Request::builder().method(method).uri(url.as_str());
        for (k, v) in headers {
            b = b.header(*k, v);
        }
        let req = b.body(body).map_err(|e| Attempt {
            error: self.error(op, key, ObjErrorKind::Other(0), e.to_string()),
            retry: false,
        })?;
        let mut resp = self
            .http
            .run(req)
            .map_err(|e| self.transport_error(op, key, e))?;
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(resp);
        }
        let text = body_text(&mut resp).unwrap_or_default();
        Err(self.status_error(op, key, status, &text))
    }

    fn transport_error(&self, op: &'static str, key: &str, e: ureq::Error) -> Attempt {
        let (kind, retry) = match &e {
            ureq::Error::Timeout(_) => (ObjErrorKind::Timeout, false),
            ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => {
                (ObjErrorKind::Unreachable, true)
            }
            ureq::Error::Io(io) => match io.kind() {
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                    (ObjErrorKind::Timeout, false)
                }
                _ => (ObjErrorKind::Unreachable, true),
            },
            ureq::Error::Protocol(_) => (ObjErrorKind::Unreachable, true),
            _ => (ObjErrorKind::Other(0), false),
        };
        Attempt {
            error: self.error(op, key, kind, e.to_string()),
            retry,
        }
    }

    fn status_error(&self, op: &'static str, key: &str, status: u16, body: &str) -> Attempt {
        let code = xml_field(body, "Code").unwrap_or_default();
        let message = xml_field(body, "Message").unwrap_or_default();
        let (kind, retry) = match (status, code) {
            (_, "NoSuchBucket") => (ObjErrorKind::NoSuchBucket, false),
            (_, "NoSuchKey") => (ObjErrorKind::NoSuchKey, false),
            (404, "") if op == "head" => (ObjErrorKind::NoSuchKey, false),
            (_, "QuotaExceeded") => (ObjErrorKind::QuotaExceeded, false),
            (_, "InvalidRange") | (416, _) => (ObjErrorKind::InvalidRange, false),
            (_, "SlowDown") | (429 | 503, _) => (ObjErrorKind::Throttled, true),
            (403, _) | (_, "AccessDenied" | "InvalidAccessKeyId" | "SignatureDoesNotMatch") => {
                (ObjErrorKind::AccessDenied, false)
            }
            (_, "InternalError" | "RequestTimeout") | (500 | 502 | 504, _) => {
                (ObjErrorKind::Other(status), true)
            }
            _ => (ObjErrorKind::Other(status), false),
        };
        let detail = match (code.is_empty(), message.is_empty()) {
            (true, _) => format!("HTTP {status}"),
            (false, true) => format!("HTTP {status} {code}"),
            (false, false) => format!("HTTP {status} {code}: {message}"),
        };
        Attempt {
            error: self.error(op, key, kind, detail),
            retry,
        }
    }

    /// PUT: the object becomes `body`.
    pub(crate) fn put(
        &self,
        key: &str,
        body: &[u8],
        deadline: Option<Instant>,
    ) -> Result<(), ObjError> {
        self.call("put", key, deadline, || {
            let url = self
                .bucket
                .put_object(Some(&self.creds), key)
                .sign(SIGNED_FOR);
            self.send("put", key, Method::PUT, url, &[], body).map(drop)
        })
    }

    /// Starts a multipart upload of `key`: its id.
    pub(crate) fn create_upload(
        &self,
        key: &str,
        deadline: Option<Instant>,
    ) -> Result<String, ObjError> {
        let op = "create upload";
        self.call(op, key, deadline, || {
            let url = self
                .bucket
                .create_multipart_upload(Some(&self.creds), key)
                .sign(SIGNED_FOR);
            let mut resp = self.send(op, key, Method::POST, url, &[], &[])?;
            let text = body_text(&mut resp).map_err(|e| self.transport_error(op, key, e))?;
            rusty_s3::actions::CreateMultipartUpload::parse_response(&text)
                .map(|r| r.upload_id().to_owned())
                .map_err(|e| Attempt {
                    error: self.error(op, key, ObjErrorKind::Other(200), e.to_string()),
                    retry: false,
                })
        })
    }

    /// Uploads part `number` (from 1): its ETag.
    pub(crate) fn upload_part(
        &self,
        key: &str,
        upload: &str,
        number: u16,
        body: &[u8],
        deadline: Option<Instant>,
    ) -> Result<String, ObjError> {
        let op = "upload part";
        self.call(op, key, deadline, || {
            let url = self
                .bucket
                .upload_part(Some(&self.creds), key, number, upload)
                .sign(SIGNED_FOR);
            let resp = self.send(op, key, Method::PUT, url, &[], body)?;
            resp.headers()
                .get("etag")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .ok_or_else(|| Attempt {
                    error: self.error(op, key, ObjErrorKind::Other(200), "no ETag".into()),
                    retry: false,
                })
        })
    }

    /// Completes an upload of the parts with these ETags, in order.
    pub(crate) fn complete_upload(
        &self,
        key: &str,
        upload: &str,
        etags: &[String],
        deadline: Option<Instant>,
    ) -> Result<(), ObjError> {
        let op = "complete upload";
        self.call(op, key, deadline, || {
            let action = self.bucket.complete_multipart_upload(
                Some(&self.creds),
                key,
                upload,
                etags.iter().map(String::as_str),
            );
            let url = action.sign(SIGNED_FOR);
            let body = action.body();
            let mut resp = self.send(op, key, Method::POST, url, &[], body.as_bytes())?;
            // An error may come with status 200, in the body.
            let text = body_text(&mut resp).map_err(|e| self.transport_error(op, key, e))?;
            if text.contains("<Error>") {
                return Err(self.status_error(op, key, 500, &text));
            }
            Ok(())
        })
    }

    /// Aborts an upload (its parts are dropped by the store); a failure is
    /// logged, not returned (the request has failed already).
    pub(crate) fn abort_upload(&self, key: &str, upload: &str) {
        let op = "abort upload";
        let r = self.call(op, key, None, || {
            let url = self
                .bucket
                .abort_multipart_upload(Some(&self.creds), key, upload)
                .sign(SIGNED_FOR);
            self.send(op, key, Method::DELETE, url, &[], &[]).map(drop)
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "object store: an upload could not be aborted");
        }
    }

    /// Ranged GET of `dst.len()` bytes at `offset` into `dst`.
    pub(crate) fn get_range(
        &self,
        key: &str,
        offset: u64,
        dst: &mut [u8],
        deadline: Option<Instant>,
    ) -> Result<(), ObjError> {
        let op = "get";
        let len = dst.len() as u64;
        if len == 0 {
            return Ok(());
        }
        let range = format!("bytes={offset}-{}", offset + len - 1);
        self.call(op, key, deadline, || {
            let url = self
                .bucket
                .get_object(Some(&self.creds), key)
                .sign(SIGNED_FOR);
            let headers = [("range", range.clone())];
            let mut resp = self.send(op, key, Method::GET, url, &headers, &[])?;
            let short = |detail: String| Attempt {
                error: self.error(op, key, ObjErrorKind::InvalidRange, detail),
                retry: false,
            };
            if let Some(n) = resp
                .headers()
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                && n != len
            {
                return Err(short(format!(
                    "{n} bytes answered for a range of {len} at {offset} (the object is shorter)"
                )));
            }
            let mut body = resp.body_mut().as_reader();
            let mut at = 0;
            while at < dst.len() {
                match body.read(&mut dst[at..]) {
                    Ok(0) => {
                        return Err(short(format!(
                            "the body ended after {at} of {len} bytes at {offset}"
                        )));
                    }
                    Ok(n) => at += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(self.transport_error(op, key, ureq::Error::Io(e))),
                }
            }
            let mut extra = [0u8; 1];
            match body.read(&mut extra) {
                Ok(0) => Ok(()),
                Ok(_) => Err(short(format!(
                    "more than the {len} bytes asked for at {offset}"
                ))),
                Err(e) => Err(self.transport_error(op, key, ureq::Error::Io(e))),
            }
        })
    }

    /// HEAD: the object's size, `None` when it does not exist.
    pub(crate) fn head(&self, key: &str) -> Result<Option<u64>, ObjError> {
        let r = self.call("head", key, None, || {
            let url = self
                .bucket
                .head_object(Some(&self.creds), key)
                .sign(SIGNED_FOR);
            let resp = self.send("head", key, Method::HEAD, url, &[], &[])?;
            Ok(resp
                .headers()
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0))
        });
        match r {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind == ObjErrorKind::NoSuchKey => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// DELETE of an object.
    pub(crate) fn delete(&self, key: &str) -> Result<(), ObjError> {
        self.call("delete", key, None, || {
            let url = self
                .bucket
                .delete_object(Some(&self.creds), key)
                .sign(SIGNED_FOR);
            self.send("delete", key, Method::DELETE, url, &[], &[])
                .map(drop)
        })
    }

    /// Creates the bucket; already owned is success.
    pub(crate) fn create_bucket(&self) -> Result<(), ObjError> {
        let r = self.call("create bucket", "", None, || {
            let url = self.bucket.create_bucket(&self.creds).sign(SIGNED_FOR);
            self.send("create bucket", "", Method::PUT, url, &[], &[])
                .map(drop)
        });
        match r {
            Err(e) if e.detail.contains("BucketAlreadyOwnedByYou") => Ok(()),
            r => r,
        }
    }
}

/// A response's body as text, at most [`ERROR_BODY_MAX`] bytes (S3's
/// XML answers and errors).
fn body_text(resp: &mut Response<ureq::Body>) -> Result<String, ureq::Error> {
    resp.body_mut()
        .with_config()
        .limit(ERROR_BODY_MAX)
        .read_to_string()
}

/// The text of the first `<name>` element of an S3 error body.
fn xml_field<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let start = body.find(&open)? + open.len();
    let end = body[start..].find(&close)? + start;
    Some(&body[start..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_https_endpoint_speaks_tls_through_the_library_provider() {
        // ureq is built without a crypto provider of its own: the client
        // hands it the library's. A server that answers the ClientHello
        // with plain HTTP sees TLS start, and the request fails as a typed
        // error (no panic for want of a provider).
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut first = [0u8; 3];
            s.read_exact(&mut first).unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                .unwrap();
            first
        });
        let mut config = ObjectStoreConfig::new(format!("https://127.0.0.1:{port}"), "b", "a", "s");
        config.retries = 0;
        config.timeout = std::time::Duration::from_secs(20);
        let store = config.build().unwrap();
        assert!(store.object_size("k").is_err());
        // A TLS handshake record (22), version 3.x: a ClientHello.
        assert_eq!(&server.join().unwrap()[..2], &[22, 3]);
    }

    #[test]
    fn error_bodies_give_their_code() {
        let body = "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code>\
                    <Message>gone</Message></Error>";
        assert_eq!(xml_field(body, "Code"), Some("NoSuchKey"));
        assert_eq!(xml_field(body, "Message"), Some("gone"));
        assert_eq!(xml_field(body, "Resource"), None);
        let c = ObjectStoreConfig::new("http://127.0.0.1:9", "b", "a", "s")
            .build()
            .unwrap();
        let kind = |status, body: &str| {
            let a = c.inner.status_error("get", "k", status, body);
            (a.error.kind, a.retry)
        };
        assert_eq!(kind(404, body), (ObjErrorKind::NoSuchKey, false));
        let e = |code: &str| format!("<Error><Code>{code}</Code></Error>");
        assert_eq!(
            kind(404, &e("NoSuchBucket")),
            (ObjErrorKind::NoSuchBucket, false)
        );
        assert_eq!(
            kind(403, &e("QuotaExceeded")),
            (ObjErrorKind::QuotaExceeded, false)
        );
        assert_eq!(
            kind(403, &e("SignatureDoesNotMatch")),
            (ObjErrorKind::AccessDenied, false)
        );
        assert_eq!(kind(503, &e("SlowDown")), (ObjErrorKind::Throttled, true));
        assert_eq!(kind(429, ""), (ObjErrorKind::Throttled, true));
        assert_eq!(
            kind(500, &e("InternalError")),
            (ObjErrorKind::Other(500), true)
        );
        assert_eq!(kind(416, ""), (ObjErrorKind::InvalidRange, false));
        assert_eq!(
            kind(400, &e("InvalidArgument")),
            (ObjErrorKind::Other(400), false)
        );
    }
}
