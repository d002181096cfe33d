//! The cross-memory path at the target: grants (ranges admitted and held
//! until the request's commit, so the initiator's direct copy lands in
//! registered memory only), and delegated copies done here for a proven
//! initiator whose side is the contiguous one. The engine hands the shm
//! transport its frames ([`CmaFrame`], in `Transport` frames);
//! [`Inner::serve_cma`] serves them.

use super::*;
use crate::engine::cma::Shm;
use crate::engine::cma_wire::Delegate;
use crate::engine::wire::TransportHead;

/// Most grants one request may announce, and most grants a session may
/// hold at once.
const GRANTS_MAX: u32 = 1 << 16;
/// Most requests of a session with grants pending at once (an initiator
/// grants one request at a time per link).
const GRANTED_REQUESTS_MAX: usize = 1 << 10;

impl Inner {
    /// Serves one frame of the shm transport `shm` (its header's
    /// transport fields `head`) on connection `c`: the request it
    /// finished, if any.
    pub(in crate::engine) fn serve_cma(
        &self,
        shm: &Shm,
        c: &mut Conn<'_, '_, '_>,
        head: &TransportHead,
    ) -> io::Result<Option<Finished<HeldSync>>> {
        let frame = CmaFrame::decode(head).map_err(|e| violation(e.to_string()))?;
        c.idle.header_in(frame.body_len());
        match frame {
            CmaFrame::Grant {
                req,
                mem_type,
                addr,
                len,
                key,
                total,
            } => {
                self.grant(c, req, mem_type, (addr, len), key, total)?;
                Ok(None)
            }
            CmaFrame::Delegate(d) => self.delegate(shm, c, &d),
            CmaFrame::Granted { .. } => Err(violation("a grant answer sent to a target")),
        }
    }

    /// Admits one `Grant` of `req`; once all `total` have come, answers
    /// `Granted` (the first refusal, or OK).
    fn grant(
        &self,
        c: &mut Conn<'_, '_, '_>,
        req: u64,
        mem_type: MemoryType,
        (addr, len): (u64, u64),
        key: u64,
        total: u32,
    ) -> io::Result<()> {
        // GPU memory is granted for an initiator that copies through CUDA
        // IPC (it opened the allocation's handle from the descriptor).
        let admitted = if mem_type == MemoryType::Vram {
            self.registry.admit_memory(mem_type, addr, len, key)
        } else {
            self.registry.admit_remote(mem_type, addr, len, key)
        };
        let answer = {
            let mut grants = lock(&c.session.grants);
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
                self.config.io_timeout,
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
        shm: &Shm,
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
            .read_vec_mid_frame(count as usize * cma_wire::DELEGATE_ENTRY, c.idle)?;
        let sync = c.read_sync(&self.inbox, has_sync, sync_len)?;
        let answer = |st| {
            c.send(
                &[CmaFrame::Granted { req, status: st }.encode()],
                self.config.io_timeout,
            )
        };
        let gpu = lock(&session.grants).get(&req).is_some_and(|g| g.gpu);
        // From the check to the end of the copy without effective
        // capabilities: the kernel lets them reach only a process the
        // proven owner (this process's user) could reach alone, whatever
        // the initiator became meanwhile (a set-user-id program, another
        // owner).
        let unprivileged = match shm::Unprivileged::enter() {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::warn!(agent = %self.config.name, error = %e, "cannot drop capabilities; not copying for initiators");
                None
            }
        };
        let pid = match unprivileged
            .as_ref()
            .and_then(|_| self.may_copy_for(session, pid, probe_addr, instance))
        {
            Some(pid) if !gpu => pid,
            _ => {
                drop(unprivileged);
                answer(status::DELEGATE_REFUSED)?;
                return Ok(None);
            }
        };
        let (spans, expired) = lock(&session.grants)
            .get(&req)
            .map(|g| (g.spans.clone(), g.refused.is_some()))
            .unwrap_or_default();
        if expired {
            drop(unprivileged);
            lock(&session.grants).remove(&req);
            answer(status::DELEGATE_FAILED)?;
            return Ok(None);
        }
        let pieces = delegated_pieces(&table, &spans).map_err(violation)?;
        let dir = match op {
            CommitOp::Write => shm::Direction::Read,
            CommitOp::Read => shm::Direction::Write,
        };
        // SAFETY: every local range lies inside a span granted for this
        // request (checked above), in a region this agent registered, whose
        // registrant promised it stays valid while registered; the
        // request's grant guards keep it registered until the commit below.
        let copied = unsafe {
            shm::copy_parallel(
                pid,
                dir,
                &pieces,
                self.config.shm.copy_threads,
                PARALLEL_COPY_MIN,
                &|| false,
            )
        };
        drop(unprivileged);
        match copied {
            Ok(_) => {
                shm.count_delegated();
                answer(status::OK)?;
                commit(self, session, req, 0, sync)
            }
            Err(e) => {
                tracing::warn!(agent = %self.config.name, remote = %session.remote, req, error = %e, "delegated cross-memory copy failed");
                lock(&session.grants).remove(&req);
                answer(status::DELEGATE_FAILED)?;
                Ok(None)
            }
        }
    }

    /// The process this agent copies for on behalf of `session`'s
    /// initiator, which says it is process `pid` with `instance` readable
    /// at `probe_addr`: only when delegation is on, the kernel proved on the
    /// local socket that `pid` is the session's initiator (owned by this
    /// process's user), it is another process than this one, and it still
    /// lives and runs the program it was proven in with the probe word in
    /// place, and this thread reaches it (checked at every request; called
    /// without effective capabilities, so a process its owner could not
    /// reach alone, for the security modules too, is refused here rather
    /// than failing the copy). A pid taken from the frame alone is never
    /// trusted.
    pub(in crate::engine) fn may_copy_for(
        &self,
        session: &Session,
        pid: u32,
        probe_addr: u64,
        instance: u64,
    ) -> Option<u32> {
        if !self.config.shm.delegate {
            return None;
        }
        if pid == std::process::id() {
            tracing::warn!(agent = %self.config.name, remote = %session.remote, "refused a delegated copy into this very process");
            return None;
        }
        let proven = lock(&session.proven);
        let Some(peer) = proven.as_ref() else {
            tracing::warn!(agent = %self.config.name, remote = %session.remote, claimed = pid, "refused a delegated copy: the initiator never proved which process it is");
            return None;
        };
        match peer.check(probe_addr, instance) {
            Ok(p) if p == pid => {
                let access = LocalAccess {
                    host: self.host.clone(),
                    pid,
                    probe_addr,
                };
                match shm::probe(&access, instance, &self.host) {
                    Ok(()) => Some(p),
                    Err(why) => {
                        tracing::info!(agent = %self.config.name, remote = %session.remote, %why, "not copying for this initiator; it copies itself");
                        None
                    }
                }
            }
            Ok(p) => {
                tracing::warn!(agent = %self.config.name, remote = %session.remote, claimed = pid, proven = p, "refused a delegated copy: the initiator did not prove it is that process");
                None
            }
            Err(why) => {
                tracing::warn!(agent = %self.config.name, remote = %session.remote, pid, why, "refused a delegated copy");
                None
            }
        }
    }
}
