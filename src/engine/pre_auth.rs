//! Incoming connections that have not authenticated yet, and which one
//! gives way when a new one comes and there is no room: free of I/O.
//!
//! A source (an IP address) holds at most `per_source` of them: its next
//! connection evicts its own oldest. When all `total` are taken, a new
//! connection evicts the oldest of the source holding the most. So a flood
//! of idle connections, from one source or a few, never keeps a connection
//! from another source out: it is admitted at once, and lives until it has
//! authenticated or its deadline passes, unless its own source floods.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// The connections still authenticating, by connection id (ids grow, so
/// the map's order is their age).
#[derive(Debug, Default)]
pub(in crate::engine) struct PreAuth {
    conns: BTreeMap<u64, IpAddr>,
}

impl PreAuth {
    /// Admits connection `id` from `ip` within `per_source` and `total`
    /// (both at least 1); returns the connection it evicts, if any.
    pub(in crate::engine) fn admit(
        &mut self,
        id: u64,
        ip: IpAddr,
        per_source: usize,
        total: usize,
    ) -> Option<u64> {
        let mine = self.conns.values().filter(|&&a| a == ip).count();
        let victim = if mine >= per_source {
            self.oldest_of(ip)
        } else if self.conns.len() >= total {
            let mut counts: HashMap<IpAddr, usize> = HashMap::new();
            for &a in self.conns.values() {
                *counts.entry(a).or_default() += 1;
            }
            // The source holding most; among equals, the one whose oldest
            // connection is oldest.
            let most = counts.values().copied().max().unwrap_or(0);
            self.conns
                .iter()
                .find(|(_, a)| counts[*a] == most)
                .map(|(&id, _)| id)
        } else {
            None
        };
        if let Some(v) = victim {
            self.conns.remove(&v);
        }
        self.conns.insert(id, ip);
        victim
    }

    fn oldest_of(&self, ip: IpAddr) -> Option<u64> {
        self.conns
            .iter()
            .find(|(_, a)| **a == ip)
            .map(|(&id, _)| id)
    }

    /// Forgets `id` (authenticated, closed, or evicted already).
    pub(in crate::engine) fn remove(&mut self, id: u64) {
        self.conns.remove(&id);
    }

    /// Connections held.
    #[cfg(test)]
    pub(in crate::engine) fn len(&self) -> usize {
        self.conns.len()
    }
}

/// A connection's place in [`PreAuth`], given up on drop (authenticated,
/// refused, or gone).
pub(in crate::engine) struct PreAuthSlot {
    pub(in crate::engine) table: Arc<Mutex<PreAuth>>,
    pub(in crate::engine) id: u64,
}

impl Drop for PreAuthSlot {
    fn drop(&mut self) {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn a_source_past_its_share_evicts_its_own_oldest() {
        let mut p = PreAuth::default();
        assert_eq!(p.admit(1, ip(9), 2, 10), None);
        assert_eq!(p.admit(2, ip(9), 2, 10), None);
        assert_eq!(p.admit(3, ip(1), 2, 10), None);
        assert_eq!(p.admit(4, ip(9), 2, 10), Some(1));
        assert_eq!(p.admit(5, ip(9), 2, 10), Some(2));
        assert_eq!(p.admit(6, ip(1), 2, 10), None);
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn when_full_the_heaviest_source_gives_way() {
        let mut p = PreAuth::default();
        // Two flooding sources fill the table; 5 holds more.
        for id in 0..4 {
            assert_eq!(p.admit(id, ip(5), 8, 6), None);
        }
        for id in 4..6 {
            assert_eq!(p.admit(id, ip(6), 8, 6), None);
        }
        // A newcomer evicts 5's oldest; then 5 and 6 hold 3 and 2.
        assert_eq!(p.admit(10, ip(1), 8, 6), Some(0));
        assert_eq!(p.admit(11, ip(1), 8, 6), Some(1));
        // Now 5, 6 and 1 hold 2 each: the oldest of them goes (5's).
        assert_eq!(p.admit(12, ip(7), 8, 6), Some(2));
        assert_eq!(p.len(), 6);
        // The newcomers stay until they are done.
        p.remove(10);
        p.remove(11);
        assert_eq!(p.admit(13, ip(1), 8, 6), None);
        assert_eq!(p.len(), 5);
    }

    #[test]
    fn a_slot_is_given_up_on_drop() {
        let table = Arc::new(Mutex::new(PreAuth::default()));
        table.lock().unwrap().admit(7, ip(1), 1, 1);
        drop(PreAuthSlot {
            table: Arc::clone(&table),
            id: 7,
        });
        assert_eq!(table.lock().unwrap().len(), 0);
        // Evicted before: dropping it is harmless.
        drop(PreAuthSlot {
            table: Arc::clone(&table),
            id: 7,
        });
    }
}
