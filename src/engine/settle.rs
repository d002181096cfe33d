//! Settling a broken link: proof that nothing of its requests lands at the
//! target any more.
//!
//! A socket link that breaks (the target stopped answering, the connection
//! reset) fails its outstanding requests at once, but bytes it handed to
//! the kernel may still be in the target's socket buffers: a target that
//! was only stopped reads and lands them when it resumes. Those requests
//! are reported unsettled ([`TransferStatus::is_settled`]); settling asks
//! the target, on a fresh authenticated connection, to end the link's
//! session ([`Frame::Settle`]). The target stops landing that session's
//! frames, shuts its streams and answers once they all ended. Proof comes
//! three ways: that answer; an answer from another instance of the agent
//! (the old one is gone); or a refused connection to the address the link
//! used (no listener: the agent closed, which joins its connections
//! first, or its process died).
//!
//! [`TransferStatus::is_settled`]: crate::TransferStatus::is_settled

use crate::agent::AgentConfig;
use crate::config::SecurityConfig;
use crate::engine::handshake;
use crate::engine::lock;
use crate::engine::sock::timeout_or;
use crate::engine::sock::{FrameReader, ProgressClock, UntilDeadline};
use crate::engine::tick;
use crate::engine::wire::{Frame, status};
use crate::error::Error;
use crate::status::Settles;
use rustix::fd::{AsFd, AsRawFd};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What settling one broken link needs: where its target listened, who
/// the link was, and how to authenticate again.
pub(in crate::engine) struct Settle {
    /// The target agent's name.
    remote: String,
    /// The address the link's first stream connected to.
    addr: SocketAddr,
    /// The target's instance the link talked to.
    target: u64,
    /// This agent's instance and the link's id, as its `Hello`s named them.
    instance: u64,
    link: u64,
    /// This agent's name, and its credential and whether it encrypts.
    name: String,
    security: SecurityConfig,
    connect_timeout: Duration,
    /// Whether the target ending the link's session proves it (see
    /// `SocketPath::SESSION_SETTLES`); otherwise only its absence does.
    session_proves: bool,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Default)]
struct State {
    settled: bool,
    /// A waiter is asking the target now; others wait for its answer.
    asking: bool,
}

impl Settle {
    pub(in crate::engine) fn new(
        config: &AgentConfig,
        instance: u64,
        remote: &str,
        target: u64,
        addr: SocketAddr,
        link: u64,
        session_proves: bool,
    ) -> Arc<Self> {
        Arc::new(Settle {
            remote: remote.to_owned(),
            addr,
            target,
            instance,
            link,
            name: config.name.clone(),
            security: config.security.clone(),
            connect_timeout: config.connect_timeout,
            session_proves,
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        })
    }

    /// Asks the target once, within `deadline`: `Ok` once nothing of the
    /// link lands there any more.
    fn ask(&self, deadline: Instant) -> Result<(), Error> {
        let left = deadline.saturating_duration_since(Instant::now());
        let sock = match TcpStream::connect_timeout(&self.addr, left.max(Duration::from_millis(1)))
        {
            Ok(s) => s,
            // Nobody listens where the agent did: it closed (after joining
            // its connections) or its process is gone.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(()),
            Err(e) => {
                return Err(timeout_or(e, "settling a broken link", left, |e| {
                    Error::Connect {
                        addr: self.addr.to_string(),
                        cause: Arc::new(e),
                    }
                }));
            }
        };
        let timeout = left.min(self.connect_timeout).max(Duration::from_millis(1));
        sock.set_nodelay(true)?;
        sock.set_read_timeout(Some(tick(timeout)))?;
        sock.set_write_timeout(Some(tick(timeout)))?;
        handshake::initiate(
            &sock,
            &self.security,
            &self.name,
            Some(&self.remote),
            &self.remote,
            deadline,
            timeout,
        )?;
        let clock = ProgressClock::new();
        let lost = |e: io::Error| Error::ConnectionLost {
            remote: self.remote.clone(),
            cause: Arc::new(e),
        };
        let ask = Frame::Settle {
            instance: self.instance,
            link: self.link,
        }
        .encode();
        handshake::send(sock.as_fd(), &ask, &[], &clock, timeout).map_err(lost)?;
        let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
        reader.set_deadline(Some(deadline));
        let raw = reader
            .next_header(&mut UntilDeadline)
            .map_err(|e| timeout_or(e, "settling a broken link", left, lost))?
            .ok_or_else(|| lost(io::ErrorKind::UnexpectedEof.into()))?;
        match Frame::decode(&raw) {
            // Another instance answers where the link's did: that one is gone.
            Ok(Frame::Settled { instance, .. }) if instance != self.target => Ok(()),
            Ok(Frame::Settled {
                status: status::OK, ..
            }) if self.session_proves => Ok(()),
            Ok(Frame::Settled {
                status: status::OK, ..
            }) => Err(Error::StillLanding {
                remote: self.remote.clone(),
            }),
            Ok(Frame::Settled { .. }) => Err(Error::Timeout {
                what: "the target ending a broken link's streams",
                after: left,
            }),
            _ => Err(Error::ProtocolViolation {
                remote: self.remote.clone(),
                detail: "expected an answer to a settle request".into(),
            }),
        }
    }
}

impl Settles for Settle {
    fn is_settled(&self) -> bool {
        lock(&self.state).settled
    }

    fn settle(&self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        {
            let mut st = lock(&self.state);
            loop {
                if st.settled {
                    return Ok(());
                }
                if !st.asking {
                    st.asking = true;
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout {
                        what: "settling a broken link",
                        after: timeout,
                    });
                }
                st = self
                    .cv
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        let r = self.ask(deadline);
        if let Err(e) = &r {
            tracing::debug!(remote = %self.remote, error = %e, "a broken link is not settled yet");
        }
        let mut st = lock(&self.state);
        st.asking = false;
        st.settled |= r.is_ok();
        self.cv.notify_all();
        r
    }
}
