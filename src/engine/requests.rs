//! Target-side bookkeeping of one initiator's requests, free of I/O.
//!
//! Segments of a request may arrive on several streams, and the request's
//! `Commit` (which carries the total segment count and the sync message) may
//! arrive before or after them. A request finishes when its commit has
//! arrived and as many segments as it announced have been processed; only
//! then is its sync message released, so the message always follows the
//! request's data.

#![forbid(unsafe_code)]

use std::collections::HashMap;

use crate::proto::{Landed, RejectReason};

#[derive(Debug)]
struct RequestProgress<M> {
    done: u64,
    /// Of `done`, the segments refused.
    refused: u64,
    expected: Option<u64>,
    error: Option<RejectReason>,
    /// Boxed: most requests carry none, and an open request's entry stays
    /// small (about 50 bytes; a target holds up to `max_open_requests`).
    sync: Option<Box<M>>,
}

impl<M> Default for RequestProgress<M> {
    fn default() -> Self {
        Self {
            done: 0,
            refused: 0,
            expected: None,
            error: None,
            sync: None,
        }
    }
}

/// A finished request: deliver `sync` if `outcome` is `Ok`, then acknowledge.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Finished<M = Vec<u8>> {
    /// Request id.
    pub(crate) req: u64,
    /// First refusal among the request's segments, if any.
    pub(crate) outcome: Result<(), RejectReason>,
    /// What of its data landed (`All` when nothing was refused).
    pub(crate) landed: crate::proto::Landed,
    /// The sync message to deliver (only present on success).
    pub(crate) sync: Option<M>,
}

/// Most requests of one initiator open at once (begun, not finished); one
/// more is a protocol violation. Bounds what a peer can make the target
/// keep.
pub(crate) const MAX_OPEN_REQUESTS: usize = 1 << 16;

/// Requests of one initiator that are not finished yet; `M` is the sync
/// message as the target holds it.
#[derive(Debug)]
pub(crate) struct RequestTable<M = Vec<u8>> {
    open: HashMap<u64, RequestProgress<M>>,
}

impl<M> Default for RequestTable<M> {
    fn default() -> Self {
        Self {
            open: HashMap::new(),
        }
    }
}

impl<M> RequestTable<M> {
    fn entry(&mut self, req: u64) -> Result<&mut RequestProgress<M>, &'static str> {
        if self.open.len() >= MAX_OPEN_REQUESTS && !self.open.contains_key(&req) {
            return Err("too many requests open at once");
        }
        Ok(self.open.entry(req).or_default())
    }

    /// Records `n` processed segments of `req` (a segment, a fence, a
    /// write list's pieces) with one outcome.
    ///
    /// # Errors
    /// When the initiator has [`MAX_OPEN_REQUESTS`] other requests open.
    pub(crate) fn segments(
        &mut self,
        req: u64,
        n: u64,
        result: Result<(), RejectReason>,
    ) -> Result<Option<Finished<M>>, &'static str> {
        let p = self.entry(req)?;
        p.done = p.done.saturating_add(n);
        if let Err(r) = result {
            p.error.get_or_insert(r);
            p.refused = p.refused.saturating_add(n);
        }
        Ok(self.try_finish(req))
    }

    /// Records the commit of `req`: `segments` in total, and its sync message.
    /// Returns `Err` when more segments than announced were already seen, or
    /// as [`segment`](Self::segment).
    pub(crate) fn commit(
        &mut self,
        req: u64,
        segments: u64,
        sync: Option<M>,
    ) -> Result<Option<Finished<M>>, &'static str> {
        let p = self.entry(req)?;
        if p.expected.is_some() {
            return Err("request committed twice");
        }
        if p.done > segments {
            return Err("more segments than the commit announced");
        }
        p.expected = Some(segments);
        p.sync = sync.map(Box::new);
        Ok(self.try_finish(req))
    }

    fn try_finish(&mut self, req: u64) -> Option<Finished<M>> {
        let p = self.open.get(&req)?;
        if p.expected != Some(p.done) {
            return None;
        }
        let p = self.open.remove(&req)?;
        let outcome = match p.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        let sync = if outcome.is_ok() {
            p.sync.map(|b| *b)
        } else {
            None
        };
        // A refusal of no segment (the sync message, a late commit) came
        // after all of the data.
        let landed = match p.refused {
            0 => Landed::All,
            r if r >= p.done => Landed::Nothing,
            _ => Landed::Partly,
        };
        Some(Finished {
            req,
            outcome,
            landed,
            sync,
        })
    }

    /// Requests still open.
    pub(crate) fn open_count(&self) -> usize {
        self.open.len()
    }

    /// Whether `req` is open (begun, not finished).
    pub(crate) fn is_open(&self, req: u64) -> bool {
        self.open.contains_key(&req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_after_segments() {
        let mut t: RequestTable = RequestTable::default();
        assert_eq!(t.segments(1, 1, Ok(())).unwrap(), None);
        assert_eq!(t.segments(1, 1, Ok(())).unwrap(), None);
        let f = t.commit(1, 2, Some(b"hi".to_vec())).unwrap().unwrap();
        assert_eq!(f.outcome, Ok(()));
        assert_eq!(f.sync.as_deref(), Some(&b"hi"[..]));
        assert_eq!(t.open_count(), 0);
    }

    #[test]
    fn a_refusal_says_what_landed() {
        let mut t: RequestTable = RequestTable::default();
        // Refused at its first segment, every segment: nothing landed.
        t.segments(1, 2, Err(RejectReason::NotRegistered)).unwrap();
        let f = t.commit(1, 2, None).unwrap().unwrap();
        assert_eq!(f.landed, Landed::Nothing);
        // A deregistration in the middle.
        t.segments(2, 3, Ok(())).unwrap();
        t.segments(2, 1, Err(RejectReason::NotRegistered)).unwrap();
        let f = t.commit(2, 4, None).unwrap().unwrap();
        assert_eq!(
            (f.outcome, f.landed),
            (Err(RejectReason::NotRegistered), Landed::Partly)
        );
        // Only the message refused, after every segment landed.
        t.segments(3, 2, Ok(())).unwrap();
        t.segments(3, 0, Err(RejectReason::InboxFull)).unwrap();
        let f = t.commit(3, 2, Some(vec![1])).unwrap().unwrap();
        assert_eq!(
            (f.outcome, f.landed, f.sync),
            (Err(RejectReason::InboxFull), Landed::All, None)
        );
    }

    #[test]
    fn commit_before_segments_waits_for_all() {
        let mut t: RequestTable = RequestTable::default();
        assert_eq!(t.commit(7, 3, Some(vec![1])).unwrap(), None);
        assert_eq!(t.segments(7, 1, Ok(())).unwrap(), None);
        assert_eq!(t.segments(7, 1, Ok(())).unwrap(), None);
        let f = t.segments(7, 1, Ok(())).unwrap().unwrap();
        assert_eq!(f.sync, Some(vec![1]));
    }

    #[test]
    fn refused_segment_withholds_sync() {
        let mut t: RequestTable = RequestTable::default();
        t.segments(3, 1, Err(RejectReason::BadKey)).unwrap();
        t.segments(3, 1, Err(RejectReason::NotRegistered)).unwrap();
        let f = t.commit(3, 2, Some(vec![9])).unwrap().unwrap();
        assert_eq!(f.outcome, Err(RejectReason::BadKey));
        assert_eq!(f.sync, None);
    }

    #[test]
    fn aborted_request_finishes_when_the_sent_segments_are_in() {
        let mut t: RequestTable = RequestTable::default();
        assert_eq!(t.commit(8, 5, Some(vec![1])).unwrap(), None);
        assert_eq!(t.segments(8, 1, Ok(())).unwrap(), None);
        // One stream skipped three segments; one sent is still to come.
        assert_eq!(t.segments(8, 3, Err(RejectReason::Aborted)).unwrap(), None);
        let f = t.segments(8, 1, Ok(())).unwrap().unwrap();
        assert_eq!(f.outcome, Err(RejectReason::Aborted));
        assert_eq!(f.sync, None);
        // Nothing skipped (a copy that never began): it still fails.
        t.segments(9, 0, Err(RejectReason::Aborted)).unwrap();
        let f = t.commit(9, 0, Some(vec![2])).unwrap().unwrap();
        assert_eq!((f.outcome, f.sync), (Err(RejectReason::Aborted), None));
    }

    #[test]
    fn data_less_request_finishes_at_commit() {
        let mut t: RequestTable = RequestTable::default();
        let f = t.commit(4, 0, Some(vec![])).unwrap().unwrap();
        assert_eq!(f.sync, Some(vec![]));
    }

    #[test]
    fn protocol_errors() {
        let mut t: RequestTable = RequestTable::default();
        t.segments(5, 1, Ok(())).unwrap();
        t.segments(5, 1, Ok(())).unwrap();
        assert!(t.commit(5, 1, None).is_err());
        let mut t: RequestTable = RequestTable::default();
        t.commit(6, 2, None).unwrap();
        assert!(t.commit(6, 2, None).is_err());
    }

    #[test]
    fn open_requests_are_bounded() {
        let mut t: RequestTable = RequestTable::default();
        for req in 0..MAX_OPEN_REQUESTS as u64 {
            assert_eq!(t.commit(req, 1, None), Ok(None));
        }
        assert!(t.commit(u64::MAX, 1, None).is_err());
        assert!(t.segments(u64::MAX, 1, Ok(())).is_err());
        // Requests already open still progress, and make room.
        assert!(t.segments(0, 1, Ok(())).unwrap().is_some());
        assert_eq!(
            t.commit(u64::MAX, 0, None).unwrap().map(|f| f.req),
            Some(u64::MAX)
        );
    }
}
