//! The in-process transport ([`Backend::InProcess`]): agents of one process
//! reach each other through a directory of this process, and a transfer is
//! a plain copy between their registered memory, done in the submitting
//! thread — no socket, no thread, no wait. The target's checks are the
//! ones its listener makes on every other path (the region registered, the
//! access key of the loaded descriptor current, room in its inbox for the
//! sync message), all made before the first byte moves: a refused request
//! changes nothing and fails its status with [`Error::RemoteRejected`], as
//! on the other paths.
//!
//! A dropped target is delisted first and then waits until copies into it
//! that have begun are over (its `door`): when its drop returns, no
//! in-process initiator touches its memory.

use std::sync::LazyLock;

use crate::agent::{DataPath, TransferOp, TransferStatus, TransportKind};
use crate::desc::AgentDesc;
use crate::engine::ctx::{AgentRef, Ctx, LiveAgent};
use crate::engine::lock;
use crate::engine::transport::Transport;
use crate::engine::transport::{Link, Submission};
use crate::error::Error;
use crate::memory::MemoryType;
use crate::registry::RegionGuard;
use crate::small::{FastHash, Few};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// The in-process agents of this process, by instance.
static AGENTS: LazyLock<Mutex<HashMap<u64, AgentRef, FastHash>>> =
    LazyLock::new(|| Mutex::new(HashMap::default()));

/// Lists `agent`, with `instance`, in the directory (an agent on
/// [`Backend::InProcess`]).
pub(in crate::engine) fn enlist(instance: u64, agent: AgentRef) {
    lock(&AGENTS).insert(instance, agent);
}

/// Takes the agent of `cx` out of the directory, then closes its door:
/// returns once no copy into or out of its memory is under way, and none
/// starts.
pub(in crate::engine) fn delist(cx: Ctx<'_>) {
    lock(&AGENTS).remove(&cx.instance());
    cx.close_door();
}

/// The agent of this process with `instance`, if it is listed.
fn find(instance: u64) -> Option<LiveAgent> {
    lock(&AGENTS).get(&instance).and_then(AgentRef::live)
}

/// Reaches agents of this process made on [`Backend::InProcess`].
pub(in crate::engine) struct InProcess;

impl Transport for InProcess {
    fn kind(&self) -> TransportKind {
        TransportKind::InProcess
    }

    fn moves(&self, local: MemoryType, remote: MemoryType, _peer: &AgentDesc) -> bool {
        // Plain copies between host and GPU memory, either side.
        local.is_virtual_address() && remote.is_virtual_address()
    }

    fn reach(&self, peer: &AgentDesc) -> Result<(), String> {
        match find(peer.instance) {
            Some(t) if t.ctx().name() == peer.name => Ok(()),
            Some(t) => Err(format!(
                "the agent of this process with that instance is called {:?}",
                t.ctx().name()
            )),
            None => {
                Err("the remote agent is not an agent of this process on the inproc backend".into())
            }
        }
    }

    fn connect(&self, cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<dyn Link>, Error> {
        Ok(LocalLink::open(cx, peer)?)
    }
}

/// A link to an agent of this process.
struct LocalLink {
    target: AgentRef,
    remote: String,
    path: Arc<DataPath>,
    /// Set by [`Link::fail`] (the first cause wins).
    broken: Mutex<Option<Error>>,
    /// Where its requests' outcomes are counted.
    meter: Arc<crate::metrics::Meter>,
}

impl LocalLink {
    /// A link to `peer`, found in the directory.
    fn open(cx: Ctx<'_>, peer: &AgentDesc) -> Result<Arc<Self>, Error> {
        let target = find(peer.instance).ok_or_else(|| gone(&peer.name))?;
        Ok(Arc::new(LocalLink {
            target: target.weak(),
            remote: peer.name.clone(),
            path: Arc::new(DataPath {
                transport: TransportKind::InProcess,
                device: None,
                mechanism: "in-process copy (memmove) by the submitting thread",
            }),
            broken: Mutex::new(None),
            meter: cx.metrics().meter(TransportKind::InProcess, &peer.name),
        }))
    }

    /// Checks everything the target would, then copies and delivers the
    /// sync message; `Err` from the target's side ([`Error::RemoteRejected`],
    /// the target gone) is the request's outcome.
    fn carry_out(&self, sub: Submission<'_>) -> Result<(), Error> {
        let Submission {
            cx,
            req,
            resolved,
            sync,
            ..
        } = sub;
        let live = self.target.live().ok_or_else(|| gone(&self.remote))?;
        // Held while copying: the target's drop waits for it.
        let open = live.door();
        let target = live.ctx();
        if !*open || target.closing() {
            return Err(gone(&self.remote));
        }
        // Every admission, and the message's room, before any copy.
        let refused = |reason| Error::RemoteRejected {
            remote: self.remote.clone(),
            reason,
            landed: crate::error::Landed::Nothing,
        };
        let mut holds: Few<RegionGuard> = Few::new();
        for (d, &key) in req.remote.descs.iter().zip(&resolved.keys) {
            let g = target
                .registry()
                .admit_memory(req.remote.mem_type, d.addr, d.len, key)
                .map_err(refused)?;
            if !holds
                .last()
                .is_some_and(|h| Arc::ptr_eq(h.region(), g.region()))
            {
                holds.push(g);
            }
        }
        let room = match &sync {
            Some(m) => Some(
                target
                    .inbox()
                    .reserve(&cx.config().name, m.len() as u64)
                    .map_err(refused)?,
            ),
            None => None,
        };
        // GPU memory on either side: the driver copies (with the context of
        // the GPU side's device).
        let pairs = req.local.descs.iter().zip(&req.remote.descs);
        let ends = |l: &crate::memory::MemoryDesc, r: &crate::memory::MemoryDesc| match req.op {
            TransferOp::Write => (l.addr, r.addr),
            TransferOp::Read => (r.addr, l.addr),
        };
        // Both ranges of each pair lie inside registered regions held for
        // the copy — the local one by `resolved.guards`, the remote one by
        // `holds`, admitted by the target's registry — and a registration
        // promises its range stays allocated while registered
        // (`TransferAgent::register_memory`); the target cannot finish
        // dropping while `open` is held.
        let gpu = [&req.local, &req.remote]
            .into_iter()
            .find(|d| d.mem_type == MemoryType::Vram);
        if let Some(g) = gpu {
            // GPU memory on either side: the driver copies, all pieces at
            // once, with the context of the GPU side's device.
            let pieces: Vec<(u64, u64, u64)> = pairs
                .map(|(l, r)| {
                    let (from, to) = ends(l, r);
                    (to, from, l.len)
                })
                .collect();
            let device = g.descs.first().map_or(0, |d| d.device_id);
            // Both ends GPU memory of that one device: its kernels reach
            // every range.
            let all_device = [&req.local, &req.remote].iter().all(|d| {
                d.mem_type == MemoryType::Vram && d.descs.iter().all(|x| x.device_id == device)
            });
            // SAFETY: as above; a GPU range was checked to be device memory
            // when registered, and the copies are waited for before this
            // returns.
            unsafe { crate::gpu::copy_many(&pieces, device, all_device) }?;
        } else {
            for (l, r) in pairs {
                let (from, to) = ends(l, r);
                let len = l.len as usize;
                // End-to-end integrity: the source's CRC32C before the copy,
                // the destination's after it.
                // SAFETY: as above.
                let sent = req
                    .integrity
                    .then(|| crate::integrity::crc32c(unsafe { bytes(from, len) }));
                // SAFETY: as above; `copy` allows the ranges to overlap (an
                // agent writing to itself).
                unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) };
                // SAFETY: as above.
                let got = sent.map(|_| crate::integrity::crc32c(unsafe { bytes(to, len) }));
                if sent != got {
                    if req.op == TransferOp::Write {
                        target
                            .metrics()
                            .integrity_failures
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    return Err(Error::Integrity {
                        remote: self.remote.clone(),
                        what: format!(
                            "the copy to {to:#x}..{:#x} did not match the CRC32C of its source",
                            to + l.len
                        ),
                    });
                }
            }
        }
        if let (Some(room), Some(m)) = (room, sync) {
            target.inbox().deliver(room, m);
        }
        drop(holds);
        drop(resolved.guards);
        Ok(())
    }
}

/// The bytes of `[addr, addr + len)`.
///
/// # Safety
/// The range must be readable for as long as the slice is used.
unsafe fn bytes<'a>(addr: u64, len: usize) -> &'a [u8] {
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
}

/// The error of a target that no longer exists in this process.
fn gone(remote: &str) -> Error {
    Error::ConnectionLost {
        remote: remote.to_owned(),
        cause: Arc::new(io::Error::new(
            io::ErrorKind::NotConnected,
            "the in-process agent was dropped",
        )),
    }
}

impl Link for LocalLink {
    fn is_broken(&self) -> bool {
        lock(&self.broken).is_some() || self.target.gone()
    }

    fn fail(&self, cause: Error) {
        lock(&self.broken).get_or_insert(cause);
    }

    fn join(&self) {}

    fn submit(self: Arc<Self>, sub: Submission<'_>) -> Result<TransferStatus, Error> {
        if let Some(e) = lock(&self.broken).clone() {
            return Err(e);
        }
        let (id, completion) = sub
            .cx
            .in_flight()
            .start(&self.meter, sub.req.local.total_len());
        completion.complete(self.carry_out(sub));
        Ok(TransferStatus::new(id, completion, Arc::clone(&self.path)))
    }
}
