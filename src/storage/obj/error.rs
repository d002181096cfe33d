//! The object store's errors: which request failed, and how.

#![forbid(unsafe_code)]

use std::fmt;

/// What kind of failure an object-store request met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ObjErrorKind {
    /// The bucket does not exist (`NoSuchBucket`).
    NoSuchBucket,
    /// The object does not exist (`NoSuchKey`).
    NoSuchKey,
    /// The credentials were refused (`AccessDenied`, `InvalidAccessKeyId`,
    /// `SignatureDoesNotMatch`, 403).
    AccessDenied,
    /// The bucket's or the user's quota is full (`QuotaExceeded`).
    QuotaExceeded,
    /// The store kept throttling (`SlowDown`, 429, 503) through every retry.
    Throttled,
    /// A range that starts past the object's end, or a body shorter or
    /// longer than the range asked for.
    InvalidRange,
    /// No answer within the request's deadline.
    Timeout,
    /// The store could not be reached (refused, reset, name not resolved)
    /// through every retry.
    Unreachable,
    /// Any other answer: its HTTP status.
    Other(u16),
}

impl fmt::Display for ObjErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ObjErrorKind::NoSuchBucket => f.write_str("no such bucket"),
            ObjErrorKind::NoSuchKey => f.write_str("no such key"),
            ObjErrorKind::AccessDenied => f.write_str("access denied"),
            ObjErrorKind::QuotaExceeded => f.write_str("quota exceeded"),
            ObjErrorKind::Throttled => f.write_str("throttled"),
            ObjErrorKind::InvalidRange => f.write_str("invalid range"),
            ObjErrorKind::Timeout => f.write_str("timed out"),
            ObjErrorKind::Unreachable => f.write_str("unreachable"),
            ObjErrorKind::Other(status) => write!(f, "HTTP {status}"),
        }
    }
}

/// An object-store request that failed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("object store {op} of {bucket}/{key}: {kind}: {detail}")]
pub struct ObjError {
    /// `put`, `get`, `upload part`, `complete upload`, `head`, ...
    pub op: &'static str,
    /// The bucket.
    pub bucket: String,
    /// The object's key (empty for bucket operations).
    pub key: String,
    /// What kind of failure.
    pub kind: ObjErrorKind,
    /// The store's code and message, or the client's error.
    pub detail: String,
}
