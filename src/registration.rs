//! Registering memory that Rust owns, without `unsafe`.
//!
//! [`TransferAgent::register_memory`] takes raw descriptors and is `unsafe`:
//! peers write registered memory at any time, which Rust code holding a
//! reference to it must not see. A [`Registration`] makes that a borrow:
//! it takes the buffer by `&mut` for as long as it lives (no other code can
//! read or write it meanwhile), and deregisters it when dropped — waiting,
//! if a transfer still uses it, until that transfer has finished (every
//! transfer ends within the agent's I/O timeout), so the buffer is never
//! released while a peer can still reach it.
//!
//! ```
//! use std::time::Duration;
//! use kvxfer::{AgentConfig, Backend, Registration, TransferRequest, make_transfer_agent};
//!
//! let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("gen-0")).unwrap();
//! let initiator = make_transfer_agent(Backend::Tcp, AgentConfig::new("ctx-0")).unwrap();
//! let mut src = vec![7u8; 4096];
//! let mut dst = vec![0u8; 4096];
//! let s = Registration::new(initiator.as_ref(), &mut src).unwrap();
//! let d = Registration::new(target.as_ref(), &mut dst).unwrap();
//! let name = initiator
//!     .load_remote_agent_by_connection(&target.local_connection_info())
//!     .unwrap();
//! initiator
//!     .submit_transfer(&TransferRequest::write(s.descs(), d.descs(), name))
//!     .unwrap()
//!     .wait_success(Duration::from_secs(5))
//!     .unwrap();
//! drop(d); // deregistered: the buffer is ours again
//! assert!(dst.iter().all(|&b| b == 7));
//! ```
//!
//! While registered, the buffer cannot be touched:
//!
//! ```compile_fail
//! # use kvxfer::{AgentConfig, Backend, Registration, make_transfer_agent};
//! let agent = make_transfer_agent(Backend::Tcp, AgentConfig::new("a")).unwrap();
//! let mut buf = vec![0u8; 4096];
//! let reg = Registration::new(agent.as_ref(), &mut buf).unwrap();
//! buf[0] = 1; // error: `buf` is borrowed by the registration
//! drop(reg);
//! ```

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use crate::agent::TransferAgent;
use crate::error::Error;
use crate::memory::{MemoryDesc, MemoryDescs, MemoryType};

/// A buffer registered with an agent for as long as this guard lives; see
/// the [module documentation](self).
///
/// Drop order: the guard deregisters first (waiting out transfers that
/// still use the buffer), then its borrows of the buffer and the agent end.
#[must_use = "dropping the registration deregisters the buffer at once"]
pub struct Registration<'a> {
    agent: &'a dyn TransferAgent,
    descs: MemoryDescs,
    /// Deregistered already (by [`deregister`](Self::deregister)).
    released: bool,
    /// The buffer, borrowed exclusively: peers write it while registered.
    _buf: PhantomData<&'a mut [u8]>,
}

impl<'a> Registration<'a> {
    /// Registers `buf` (host memory) with `agent`.
    ///
    /// # Errors
    /// As [`TransferAgent::register_memory`]: an empty buffer, or one that
    /// overlaps a registration that exists.
    pub fn new(agent: &'a dyn TransferAgent, buf: &'a mut [u8]) -> Result<Self, Error> {
        let descs = MemoryDescs::new(
            MemoryType::Dram,
            vec![MemoryDesc::new(
                buf.as_mut_ptr() as u64,
                buf.len() as u64,
                0,
            )],
        );
        // SAFETY: `buf` is borrowed exclusively for `'a`, which outlives
        // this guard; the guard deregisters it before that borrow ends (on
        // drop, after every transfer using it has finished), so the range
        // stays valid while registered and no Rust code accesses it
        // meanwhile.
        unsafe { agent.register_memory(&descs)? };
        Ok(Self {
            agent,
            descs,
            released: false,
            _buf: PhantomData,
        })
    }

    /// The whole buffer, as descriptors for a request.
    pub fn descs(&self) -> MemoryDescs {
        self.descs.clone()
    }

    /// `len` bytes at `offset` into the buffer, as descriptors for a
    /// request.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the range does not lie in the buffer.
    pub fn range(&self, offset: u64, len: u64) -> Result<MemoryDescs, Error> {
        let whole = self.descs.descs[0];
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= whole.len => Ok(MemoryDescs::new(
                MemoryType::Dram,
                vec![MemoryDesc::new(whole.addr + offset, len, 0)],
            )),
            _ => Err(Error::InvalidRequest(format!(
                "range of {len} bytes at {offset} is not inside the registered buffer of {} bytes",
                whole.len
            ))),
        }
    }

    /// Deregisters now, waiting for transfers that use the buffer to finish
    /// (as dropping does), and reports how it went.
    ///
    /// # Errors
    /// [`Error::NotARegistration`] when the buffer had been deregistered
    /// already through the raw API (nothing to undo then).
    pub fn deregister(mut self) -> Result<(), Error> {
        self.released = true;
        release(self.agent, &self.descs)
    }
}

impl std::fmt::Debug for Registration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("agent", &self.agent.name())
            .field("descs", &self.descs)
            .finish()
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        if !self.released
            && let Err(e) = release(self.agent, &self.descs)
        {
            tracing::warn!(agent = %self.agent.name(), %e, "registration already gone at drop");
        }
    }
}

/// Deregisters `descs`, retrying while transfers still use them.
fn release(agent: &dyn TransferAgent, descs: &MemoryDescs) -> Result<(), Error> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(50);
    let mut warned = false;
    loop {
        match agent.deregister_memory(descs) {
            Err(Error::RegionBusy { in_flight, .. }) => {
                if !warned && start.elapsed() > Duration::from_secs(5) {
                    warned = true;
                    tracing::warn!(
                        agent = %agent.name(),
                        in_flight,
                        "a registration being dropped waits for transfers still using it"
                    );
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}
