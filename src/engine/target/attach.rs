//! Transports that set something up beside a link's control stream (RDMA:
//! a queue pair) exchange one message each way over it, in `Attach` and
//! `Attached` frames that name the transport: the initiator's link sends
//! its message after the handshake ([`attach`]); the target finds the
//! transport of that name among its own and hands it the message
//! ([`Transport::accept`]), and keeps what the transport returns (a
//! receive thread, say) until the connection ends. The engine reads
//! neither message; a new transport adds no frame.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agent::TransportKind;
use crate::engine::Inner;
use crate::engine::ctx::Ctx;
use crate::engine::handshake::send;
use crate::engine::sock::timeout_or;
use crate::engine::sock::{FrameReader, ProgressClock, UntilDeadline};
use crate::engine::target::Conn;
use crate::engine::wire::{ATTACH_MAX, ATTACH_NAME_MAX, Frame, HEADER_LEN, status};
use crate::error::Error;

/// What a target transport keeps for an attached link while its
/// connection lasts (dropped when the connection ends).
pub(in crate::engine) type Attachment = Box<dyn Send>;

/// Sends `transport`'s message `msg` to `remote` on `sock` (a link's
/// stream, past its handshake) and waits, until `timeout`, for the target
/// transport's answer: `Ok(Ok(answer))`, or `Ok(Err(status))` when the
/// target refused (`status::NO_TRANSPORT`: it does not offer the
/// transport; `status::ATTACH_FAILED`: its side failed).
///
/// # Errors
/// The connection's ([`Error::ConnectionLost`], [`Error::Timeout`]), and
/// [`Error::ProtocolViolation`] for an answer that is not `Attached`.
pub(in crate::engine) fn attach(
    remote: &str,
    sock: &TcpStream,
    clock: &ProgressClock,
    timeout: Duration,
    transport: TransportKind,
    msg: &[u8],
) -> Result<Result<Vec<u8>, u16>, Error> {
    let name = transport.as_str().as_bytes();
    let (Ok(name_len), Ok(len)) = (u8::try_from(name.len()), u32::try_from(msg.len())) else {
        return Err(Error::InvalidRequest("attach message too long".into()));
    };
    if name_len > ATTACH_NAME_MAX || len > ATTACH_MAX {
        return Err(Error::InvalidRequest("attach message too long".into()));
    }
    let conn_err = |e: io::Error| Error::ConnectionLost {
        remote: remote.to_owned(),
        cause: Arc::new(e),
    };
    let violation = |detail: String| Error::ProtocolViolation {
        remote: remote.to_owned(),
        detail,
    };
    let hdr = Frame::Attach { name_len, len }.encode();
    let body = [name, msg].concat();
    send(sock.as_fd(), &hdr, &body, clock, timeout).map_err(conn_err)?;
    let mut reader = FrameReader::new(sock.as_raw_fd(), clock);
    reader.set_deadline(Some(Instant::now() + timeout));
    let mut idle = UntilDeadline;
    let what = "transport attach";
    let raw = reader
        .next_header(&mut idle)
        .map_err(|e| timeout_or(e, what, timeout, conn_err))?
        .ok_or_else(|| conn_err(io::ErrorKind::UnexpectedEof.into()))?;
    match Frame::decode(&raw) {
        Ok(Frame::Attached {
            status: status::OK,
            len,
        }) => reader
            .read_vec(len as usize, &mut idle)
            .map(Ok)
            .map_err(|e| timeout_or(e, what, timeout, conn_err)),
        Ok(Frame::Attached { status: st, .. }) => Ok(Err(st)),
        Ok(other) => Err(violation(format!("bad attach answer {other:?}"))),
        Err(e) => Err(violation(e.to_string())),
    }
}

impl Inner {
    /// Target side of an `Attach` frame (its header read; `name_len` and
    /// `len` from it) on connection `c`: its transport name and message
    /// read, handed to this agent's transport of that name, whose answer
    /// (or the refusal) goes back in `Attached`; what the transport keeps
    /// goes into `attached`, dropped when the connection ends.
    pub(in crate::engine) fn serve_attach(
        &self,
        c: &mut Conn<'_, '_, '_>,
        (name_len, len): (u8, u32),
        attached: &mut Vec<Attachment>,
    ) -> io::Result<()> {
        let name = c.reader.read_vec_mid_frame(usize::from(name_len), c.idle)?;
        let msg = c.reader.read_vec(len as usize, c.idle)?;
        let outcome = match self.transports.iter().find(|t| names(&name, t.kind())) {
            Some(t) => t.accept(Ctx::of(self), &c.session.remote, c.sock, &msg),
            None => Err(status::NO_TRANSPORT),
        };
        let outcome = outcome.map(|(answer, keep)| {
            attached.extend(keep);
            answer
        });
        let (hdr, body) = answer(&outcome);
        send(
            c.sock.as_fd(),
            &hdr,
            body,
            c.idle.clock,
            self.config.io_timeout,
        )
    }
}

/// The `Attached` frame answering an attach with `outcome` (the target
/// transport's answer, or the status refusing it), header and body.
fn answer(outcome: &Result<Vec<u8>, u16>) -> ([u8; HEADER_LEN], &[u8]) {
    match outcome {
        Ok(a) => {
            let len = u32::try_from(a.len()).unwrap_or(u32::MAX).min(ATTACH_MAX);
            let hdr = Frame::Attached {
                status: status::OK,
                len,
            }
            .encode();
            (hdr, &a[..len as usize])
        }
        Err(st) => (
            Frame::Attached {
                status: *st,
                len: 0,
            }
            .encode(),
            &[],
        ),
    }
}

/// Whether `name` (an `Attach` frame's) names `transport`.
fn names(name: &[u8], transport: TransportKind) -> bool {
    name == transport.as_str().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_carry_the_transports_message_or_a_bare_refusal() {
        let ok = Ok(vec![7; 28]);
        let (hdr, body) = answer(&ok);
        assert_eq!(
            Frame::decode(&hdr).unwrap(),
            Frame::Attached {
                status: status::OK,
                len: 28
            }
        );
        assert_eq!(body, &[7; 28][..]);
        let (hdr, body) = answer(&Err(status::NO_TRANSPORT));
        assert_eq!(
            Frame::decode(&hdr).unwrap(),
            Frame::Attached {
                status: status::NO_TRANSPORT,
                len: 0
            }
        );
        assert!(body.is_empty());
        assert!(names(b"rdma", TransportKind::Rdma) && !names(b"rdm", TransportKind::Rdma));
        // The codec refuses what no transport sends.
        let mut bad = Frame::Attach {
            name_len: 4,
            len: ATTACH_MAX,
        }
        .encode();
        bad[4..8].copy_from_slice(&(ATTACH_MAX + 1).to_le_bytes());
        assert!(Frame::decode(&bad).is_err());
    }
}
