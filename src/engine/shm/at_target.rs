//! The cross-memory path at the target: grants (ranges admitted and held
//! until the request's commit, so the initiator's direct copy lands in
//! registered memory only), and delegated copies done here for a proven
//! initiator whose side is the contiguous one. The engine hands the shm
//! transport its frames ([`CmaFrame`], in `Transport` frames) and tells it
//! of each session's requests ([`CmaSession`]); [`Shm::serve`] serves the
//! frames.

use crate::cross_memory;
use crate::engine::ctx::Ctx;
use crate::engine::requests::Finished;
use crate::engine::shm::Shm;
use crate::engine::shm::frames;
use crate::engine::shm::frames::{CmaFrame, Delegate, Grant};
use crate::engine::shm::plan::delegated_pieces;
use crate::engine::shm::{pool, proof as local_proof};
use crate::engine::sock::ProgressClock;
use crate::engine::target::{Conn, HeldSync, SessionState, commit, violation};
use crate::engine::wire::{CommitOp, TransportHead, status};
use crate::engine::{PARALLEL_COPY_MIN, lock};
use crate::error::RejectReason;
use crate::memory::MemoryType;
use crate::registry::{RegionGuard, Registry};
use std::collections::HashMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most grants one request may announce, and most grants a session may
/// hold at once.
const GRANTS_MAX: u32 = 1 << 16;
/// Most requests of a session with grants pending at once (an initiator
/// grants one request at a time per link).
const GRANTED_REQUESTS_MAX: usize = 1 << 10;

/// What the shm transport keeps for one initiator's session at the
/// target: the grants of its requests, held until each request finishes,
/// and the process proven to be its initiator.
pub(in crate::engine) struct CmaSession {
    /// The authenticated initiator.
    remote: String,
    /// Grants by request, held until the request finishes.
    grants: Mutex<HashMap<u64, Grants>>,
    /// The process proven to be the session's initiator, once it has
    /// presented the session's ticket on the local proof socket: the only
    /// process a delegated copy may touch.
    proven: Mutex<Option<local_proof::ProvenPeer>>,
    /// The channel on which the proven process asks for this agent's
    /// shared pools (see `engine::pool`); a newer one replaces it.
    channel: Mutex<Option<Arc<pool::Served>>>,
}

impl CmaSession {
    /// The state of a new session of the initiator `remote`.
    pub(in crate::engine) fn new(remote: &str) -> Self {
        Self {
            remote: remote.to_owned(),
            grants: Mutex::default(),
            proven: Mutex::default(),
            channel: Mutex::default(),
        }
    }

    /// Serves `conn`, the proven process's local connection, as the
    /// session's pool channel (pools looked up in `registry`), in place of
    /// any it had.
    pub(in crate::engine) fn keep_channel(
        &self,
        conn: UnixStream,
        registry: Arc<Registry>,
        timeout: Duration,
    ) {
        match pool::Served::start(conn, registry, &self.remote, timeout) {
            Ok(c) => {
                let old = lock(&self.channel).replace(c);
                if let Some(old) = old {
                    old.close();
                }
            }
            Err(e) => tracing::debug!(remote = %self.remote, error = %e, "no pool channel"),
        }
    }

    /// Revokes the pool `key` from the session's initiator, if it was
    /// handed one (see [`pool::Served::revoke`]).
    pub(in crate::engine) fn revoke(&self, key: u64, timeout: Duration) {
        let c = lock(&self.channel).clone();
        if let Some(c) = c
            && !c.revoke(key, timeout)
        {
            tracing::warn!(remote = %self.remote, "a peer did not confirm it unmapped a deregistered pool; its pool channel is closed");
        }
    }

    /// Ends the session's pool channel.
    pub(in crate::engine) fn close_channel(&self) {
        let c = lock(&self.channel).take();
        if let Some(c) = c {
            c.close();
        }
    }

    /// Binds `peer`, proven on agent `agent`'s local socket to hold the
    /// session's ticket, as the session's initiator: only the first proof
    /// binds; `true` also for that same process proving again (its pool
    /// channel), `false` for any other.
    pub(in crate::engine::shm) fn prove(&self, agent: &str, peer: local_proof::ProvenPeer) -> bool {
        let mut proven = lock(&self.proven);
        if let Some(p) = proven.as_ref() {
            // The same process again (for a new channel): still bound.
            return p.same_process(&peer);
        }
        tracing::debug!(%agent, remote = %self.remote, "initiator process proven");
        *proven = Some(peer);
        true
    }
}

#[derive(Default)]
struct Grants {
    /// When the first of the request's grants came: they expire the
    /// agent's I/O timeout later.
    since: ProgressClock,
    seen: u32,
    guards: Vec<RegionGuard>,
    /// The admitted ranges, `(addr, len)`: a delegated copy may write (or
    /// read) only inside them.
    spans: Vec<(u64, u64)>,
    refused: Option<RejectReason>,
    /// A span is GPU memory (the initiator copies through CUDA IPC): never
    /// a delegated copy.
    gpu: bool,
    /// A delegated copy runs inside the spans: the grant neither expires
    /// nor is swept until it ended (the copy itself stops at the grant's
    /// lifetime), so its regions stay registered under it.
    copying: bool,
}

/// A delegated copy's hold on its request's grant: the grant is not swept
/// while it lives (dropped once the copy and its commit are over).
struct Copying<'a> {
    state: &'a CmaSession,
    req: u64,
}

impl Drop for Copying<'_> {
    fn drop(&mut self) {
        if let Some(g) = lock(&self.state.grants).get_mut(&self.req) {
            g.copying = false;
        }
    }
}

impl Grants {
    /// Whether the grant is past `lifetime` without its commit, and no
    /// copy runs inside it.
    fn expired(&self, lifetime: Duration) -> bool {
        !self.copying && self.refused.is_none() && self.since.idle() > lifetime
    }
}

impl SessionState for CmaSession {
    /// A request whose grants expired before its commit is refused with
    /// [`RejectReason::GrantExpired`].
    fn commit_refusal(&self, req: u64) -> Option<RejectReason> {
        lock(&self.grants)
            .get(&req)
            .and_then(|g| g.refused.filter(|r| *r == RejectReason::GrantExpired))
    }

    /// The initiator's direct copies of `req` are over: its grants unpin.
    fn finished(&self, req: u64) {
        lock(&self.grants).remove(&req);
    }

    /// Releases the grants of requests granted more than `lifetime` ago
    /// (their commit never came), except those a delegated copy is using:
    /// each becomes a refusal its commit will meet, holding no region.
    fn sweep(&self, lifetime: Duration) {
        let mut grants = lock(&self.grants);
        for g in grants.values_mut() {
            if g.expired(lifetime) {
                g.refused = Some(RejectReason::GrantExpired);
                g.guards.clear();
                g.spans.clear();
            }
        }
    }
}

impl Shm {
    /// Serves one of its frames (its header's transport fields `head`)
    /// on `inner`'s connection `c`: the request it finished, if any.
    pub(in crate::engine) fn serve(
        &self,
        cx: Ctx<'_>,
        c: &mut Conn<'_, '_, '_>,
        head: &TransportHead,
    ) -> io::Result<Option<Finished<HeldSync>>> {
        let frame = CmaFrame::decode(head).map_err(|e| violation(e.to_string()))?;
        c.idle.header_in(frame.body_len());
        let Some(state) = self.session(c.session.ticket) else {
            return Err(violation("a cross-memory frame outside a session"));
        };
        match frame {
            CmaFrame::Grant(g) => {
                Self::grant(cx, &state, c, &g)?;
                Ok(None)
            }
            CmaFrame::Delegate(d) => self.delegate(cx, &state, c, &d),
            CmaFrame::Granted { .. } => Err(violation("a grant answer sent to a target")),
        }
    }

    /// Admits one `Grant` of its request into the session's `state`; once
    /// all the request's grants have come, answers `Granted` (the first
    /// refusal, or OK).
    fn grant(
        cx: Ctx<'_>,
        state: &CmaSession,
        c: &mut Conn<'_, '_, '_>,
        &Grant {
            req,
            mem_type,
            addr,
            len,
            key,
            total,
        }: &Grant,
    ) -> io::Result<()> {
        // GPU memory is granted for an initiator that copies through CUDA
        // IPC (it opened the allocation's handle from the descriptor).
        let admitted = if mem_type == MemoryType::Vram {
            cx.registry().admit_memory(mem_type, addr, len, key)
        } else {
            cx.registry().admit_remote(mem_type, addr, len, key)
        };
        let answer = {
            let mut grants = lock(&state.grants);
            // What a peer makes this session hold is bounded: requests with
            // grants pending, and grants in all of them.
            if total > GRANTS_MAX {
                return Err(violation("more grants announced than a request may have"));
            }
            if !grants.contains_key(&req) && grants.len() >= GRANTED_REQUESTS_MAX {
                return Err(violation("too many requests with grants pending"));
            }
            let held: usize = grants.values().map(|g| g.guards.len()).sum();
            if held >= GRANTS_MAX as usize {
                return Err(violation("too many grants held at once"));
            }
            let g = grants.entry(req).or_default();
            if g.seen >= total {
                return Err(violation("more grants than the request announced"));
            }
            g.seen += 1;
            g.gpu |= mem_type == MemoryType::Vram;
            match admitted {
                Ok(guard) => {
                    g.guards.push(guard);
                    g.spans.push((addr, len));
                }
                Err(r) => {
                    g.refused.get_or_insert(r);
                }
            }
            if g.seen < total {
                None
            } else if let Some(r) = g.refused {
                grants.remove(&req);
                Some(r.code())
            } else {
                Some(status::OK)
            }
        };
        match answer {
            Some(st) => c.send(
                &[CmaFrame::Granted { req, status: st }.encode()],
                cx.config().io_timeout,
            ),
            None => Ok(()),
        }
    }

    /// Serves a `Delegate`: copies the request's pieces (each inside a span
    /// granted for it) from or into the proven initiator's process, answers,
    /// and commits it with its sync message; refuses when this agent does
    /// not copy for that initiator.
    fn delegate(
        &self,
        cx: Ctx<'_>,
        state: &CmaSession,
        c: &mut Conn<'_, '_, '_>,
        d: &Delegate,
    ) -> io::Result<Option<Finished<HeldSync>>> {
        let &Delegate {
            req,
            op,
            count,
            pid,
            probe_addr,
            instance,
            sync_len,
            has_sync,
        } = d;
        let session = c.session;
        // The sync message may follow: no header read-ahead.
        let table = c
            .reader
            .read_vec_mid_frame(count as usize * frames::DELEGATE_ENTRY, c.idle)?;
        let sync = c.read_sync(cx.inbox(), has_sync, sync_len)?;
        let answer = |st| {
            c.send(
                &[CmaFrame::Granted { req, status: st }.encode()],
                cx.config().io_timeout,
            )
        };
        let gpu = lock(&state.grants).get(&req).is_some_and(|g| g.gpu);
        // From the check to the end of the copy without effective
        // capabilities: the kernel lets them reach only a process the
        // proven owner (this process's user) could reach alone, whatever
        // the initiator became meanwhile (a set-user-id program, another
        // owner).
        let unprivileged = match cross_memory::Unprivileged::enter() {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::warn!(agent = %cx.config().name, error = %e, "cannot drop capabilities; not copying for initiators");
                None
            }
        };
        let pid = match unprivileged
            .as_ref()
            .and_then(|_| Self::may_copy_for(cx, state, pid, probe_addr, instance))
        {
            Some(pid) if !gpu => pid,
            _ => {
                drop(unprivileged);
                answer(status::DELEGATE_REFUSED)?;
                return Ok(None);
            }
        };
        // The grant is taken for the copy: no sweep releases its regions
        // until the copy ended, and the copy ends by the grant's lifetime.
        let lifetime = cx.config().io_timeout;
        let taken = lock(&state.grants).get_mut(&req).and_then(|g| {
            if g.refused.is_some() {
                return None;
            }
            g.copying = true;
            let left = lifetime.saturating_sub(g.since.idle());
            Some((g.spans.clone(), Instant::now() + left))
        });
        let Some((spans, copy_by)) = taken else {
            drop(unprivileged);
            lock(&state.grants).remove(&req);
            answer(status::DELEGATE_FAILED)?;
            return Ok(None);
        };
        // Until the commit below (or this frame's end, however it ends).
        let _copying = Copying { state, req };
        let pieces = delegated_pieces(&table, &spans).map_err(violation)?;
        let dir = match op {
            CommitOp::Write => cross_memory::Direction::Read,
            CommitOp::Read => cross_memory::Direction::Write,
        };
        // SAFETY: every local range lies inside a span granted for this
        // request (checked above), in a region this agent registered, whose
        // registrant promised it stays valid while registered; the
        // request's grant guards keep it registered until the commit below
        // (no sweep takes them while `copying` is set).
        let copied = unsafe {
            cross_memory::copy_parallel(
                cross_memory::Peer::Process(pid),
                dir,
                &pieces,
                (cx.config().shm.copy_threads, PARALLEL_COPY_MIN),
                &|| Instant::now() >= copy_by,
                None,
            )
        };
        drop(unprivileged);
        let copied = copied.and_then(|whole| {
            if whole {
                Ok(())
            } else {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the copy ran past its grant's lifetime",
                ))
            }
        });
        match copied {
            Ok(()) => {
                self.count_delegated();
                answer(status::OK)?;
                commit(cx, session, req, 0, sync)
            }
            Err(e) => {
                tracing::warn!(agent = %cx.config().name, remote = %session.remote, req, error = %e, "delegated cross-memory copy failed");
                lock(&state.grants).remove(&req);
                answer(status::DELEGATE_FAILED)?;
                Ok(None)
            }
        }
    }

    /// The process `inner` copies for on behalf of the initiator of the
    /// session `state`, which says it is process `pid` with `instance` readable
    /// at `probe_addr`: only when delegation is on, the kernel proved on the
    /// local socket that `pid` is the session's initiator (owned by this
    /// process's user), it is another process than this one, and it still
    /// lives and runs the program it was proven in with the probe word in
    /// place, and this thread reaches it (checked at every request; called
    /// without effective capabilities, so a process its owner could not
    /// reach alone, for the security modules too, is refused here rather
    /// than failing the copy). A pid taken from the frame alone is never
    /// trusted.
    fn may_copy_for(
        cx: Ctx<'_>,
        state: &CmaSession,
        pid: u32,
        probe_addr: u64,
        instance: u64,
    ) -> Option<u32> {
        if !cx.config().shm.delegate {
            return None;
        }
        if pid == std::process::id() {
            tracing::warn!(agent = %cx.config().name, remote = %state.remote, "refused a delegated copy into this very process");
            return None;
        }
        let proven = lock(&state.proven);
        let Some(peer) = proven.as_ref() else {
            tracing::warn!(agent = %cx.config().name, remote = %state.remote, claimed = pid, "refused a delegated copy: the initiator never proved which process it is");
            return None;
        };
        match peer.check(probe_addr, instance) {
            Ok(p) if p == pid => match cross_memory::probe(pid, probe_addr, instance) {
                Ok(()) => Some(p),
                Err(why) => {
                    tracing::info!(agent = %cx.config().name, remote = %state.remote, %why, "not copying for this initiator; it copies itself");
                    None
                }
            },
            Ok(p) => {
                tracing::warn!(agent = %cx.config().name, remote = %state.remote, claimed = pid, proven = p, "refused a delegated copy: the initiator did not prove it is that process");
                None
            }
            Err(why) => {
                tracing::warn!(agent = %cx.config().name, remote = %state.remote, pid, why, "refused a delegated copy");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grant a delegated copy is using is neither expired nor swept,
    /// however old; once the copy ended it is.
    #[test]
    fn a_grant_in_use_by_a_copy_is_not_swept() {
        let s = CmaSession::new("peer");
        for (req, copying) in [(1, true), (2, false)] {
            let g = Grants {
                copying,
                spans: vec![(0x1000 * req, 16)],
                ..Grants::default()
            };
            lock(&s.grants).insert(req, g);
        }
        // The coarse clock moves in ticks of a few milliseconds.
        std::thread::sleep(Duration::from_millis(30));
        s.sweep(Duration::ZERO);
        {
            let g = lock(&s.grants);
            assert_eq!(g[&1].refused, None);
            assert_eq!(g[&1].spans, vec![(0x1000, 16)]);
            assert_eq!(g[&2].refused, Some(RejectReason::GrantExpired));
            assert!(g[&2].spans.is_empty());
        }
        assert_eq!(s.commit_refusal(1), None);
        assert_eq!(s.commit_refusal(2), Some(RejectReason::GrantExpired));
        lock(&s.grants).get_mut(&1).unwrap().copying = false;
        s.sweep(Duration::ZERO);
        assert_eq!(s.commit_refusal(1), Some(RejectReason::GrantExpired));
    }
}
