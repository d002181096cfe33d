//! Target-side bookkeeping of one initiator's requests, free of I/O.
//!
//! Segments of a request may arrive on several streams, and the request's
//! `Commit` (which carries the total segment count and the sync message) may
//! arrive before or after them. A request finishes when its commit has
//! arrived and as many segments as it announced have been processed; only
//! then is its sync message released, so the message always follows the
//! request's data.

use std::collections::HashMap;

use crate::error::RejectReason;

#[derive(Debug, Default)]
struct Progress {
    done: u64,
    expected: Option<u64>,
    error: Option<RejectReason>,
    sync: Option<Vec<u8>>,
}

/// A finished request: deliver `sync` if `outcome` is `Ok`, then acknowledge.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Finished {
    /// Request id.
    pub(crate) req: u64,
    /// First refusal among the request's segments, if any.
    pub(crate) outcome: Result<(), RejectReason>,
    /// The sync message to deliver (only present on success).
    pub(crate) sync: Option<Vec<u8>>,
}

/// Requests of one initiator that are not finished yet.
#[derive(Debug, Default)]
pub(crate) struct RequestTable {
    open: HashMap<u64, Progress>,
}

impl RequestTable {
    /// Records one processed segment (or fence) of `req`.
    pub(crate) fn segment(
        &mut self,
        req: u64,
        result: Result<(), RejectReason>,
    ) -> Option<Finished> {
        self.segments(req, 1, result)
    }

    /// Records `n` segments of `req` with one outcome (a write list).
    pub(crate) fn segments(
        &mut self,
        req: u64,
        n: u64,
        result: Result<(), RejectReason>,
    ) -> Option<Finished> {
        let p = self.open.entry(req).or_default();
        p.done += n;
        if let Err(r) = result {
            p.error.get_or_insert(r);
        }
        self.try_finish(req)
    }

    /// Records the commit of `req`: `segments` in total, and its sync message.
    /// Returns `Err` when more segments than announced were already seen.
    pub(crate) fn commit(
        &mut self,
        req: u64,
        segments: u64,
        sync: Option<Vec<u8>>,
    ) -> Result<Option<Finished>, &'static str> {
        let p = self.open.entry(req).or_default();
        if p.expected.is_some() {
            return Err("request committed twice");
        }
        if p.done > segments {
            return Err("more segments than the commit announced");
        }
        p.expected = Some(segments);
        p.sync = sync;
        Ok(self.try_finish(req))
    }

    fn try_finish(&mut self, req: u64) -> Option<Finished> {
        let p = self.open.get(&req)?;
        if p.expected != Some(p.done) {
            return None;
        }
        let p = self.open.remove(&req)?;
        let outcome = match p.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        let sync = if outcome.is_ok() { p.sync } else { None };
        Some(Finished { req, outcome, sync })
    }

    /// Requests still open.
    #[cfg(test)]
    pub(crate) fn open_count(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_after_segments() {
        let mut t = RequestTable::default();
        assert_eq!(t.segment(1, Ok(())), None);
        assert_eq!(t.segment(1, Ok(())), None);
        let f = t.commit(1, 2, Some(b"hi".to_vec())).unwrap().unwrap();
        assert_eq!(f.outcome, Ok(()));
        assert_eq!(f.sync.as_deref(), Some(&b"hi"[..]));
        assert_eq!(t.open_count(), 0);
    }

    #[test]
    fn commit_before_segments_waits_for_all() {
        let mut t = RequestTable::default();
        assert_eq!(t.commit(7, 3, Some(vec![1])).unwrap(), None);
        assert_eq!(t.segment(7, Ok(())), None);
        assert_eq!(t.segment(7, Ok(())), None);
        let f = t.segment(7, Ok(())).unwrap();
        assert_eq!(f.sync, Some(vec![1]));
    }

    #[test]
    fn refused_segment_withholds_sync() {
        let mut t = RequestTable::default();
        t.segment(3, Err(RejectReason::BadKey));
        t.segment(3, Err(RejectReason::NotRegistered));
        let f = t.commit(3, 2, Some(vec![9])).unwrap().unwrap();
        assert_eq!(f.outcome, Err(RejectReason::BadKey));
        assert_eq!(f.sync, None);
    }

    #[test]
    fn data_less_request_finishes_at_commit() {
        let mut t = RequestTable::default();
        let f = t.commit(4, 0, Some(vec![])).unwrap().unwrap();
        assert_eq!(f.sync, Some(vec![]));
    }

    #[test]
    fn protocol_errors() {
        let mut t = RequestTable::default();
        t.segment(5, Ok(()));
        t.segment(5, Ok(()));
        assert!(t.commit(5, 1, None).is_err());
        let mut t = RequestTable::default();
        t.commit(6, 2, None).unwrap();
        assert!(t.commit(6, 2, None).is_err());
    }
}
