//! The authentication exchange that opens every connection to an agent's
//! listener (the cryptography is in [`crate::auth`]): the initiator's side,
//! run before its first request on a new connection, and the target's side,
//! run before the target answers anything.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::{MAC_LEN, NONCE_LEN, Nonce, Transcript, nonce};
use crate::config::SecurityConfig;
use crate::error::Error;

use crate::engine::sock::ktls;
use crate::engine::sock::{FrameReader, IdlePolicy, ProgressClock, UntilDeadline, iov, writev_all};
use crate::engine::wire::{Frame, HEADER_LEN, status};

/// Idle policy of the target's side: abandoned when `stop` says the agent
/// is closing (the reader's deadline ends a stalled exchange).
struct AbandonWhen<'a>(&'a dyn Fn() -> bool);

impl IdlePolicy for AbandonWhen<'_> {
    fn on_idle(&mut self, _mid_frame: bool) -> io::Result<()> {
        if (self.0)() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "agent closing",
            ));
        }
        Ok(())
    }
}

/// Writes a header and an optional body in one call.
pub(in crate::engine) fn send(
    sock: BorrowedFd<'_>,
    hdr: &[u8; HEADER_LEN],
    body: &[u8],
    clock: &ProgressClock,
    timeout: Duration,
) -> io::Result<()> {
    let mut iovs = [
        iov(hdr.as_ptr(), HEADER_LEN),
        iov(body.as_ptr(), body.len()),
    ];
    let n = if body.is_empty() { 1 } else { 2 };
    // SAFETY: both iovecs point into live borrows for the call.
    unsafe { writev_all(sock.as_raw_fd(), &mut iovs[..n], clock, timeout) }
}

fn nonce_of(body: &[u8]) -> Nonce {
    body[..NONCE_LEN].try_into().expect("length checked")
}

/// The initiator's side: proves this agent holds its credential (when it
/// has one, in `security`) and checks that the target holds it too and is
/// called `expect` (when known); asks for the connection to be encrypted
/// when `security` says so (with a credential only), and encrypts it (see
/// [`ktls::encrypt`]) when the target says so. Returns the target's name.
///
/// # Errors
/// [`Error::AuthFailed`] when either side's proof fails, the credentials
/// differ in presence, or encryption was asked and the target did not
/// agree (a target of an older protocol); [`Error::Timeout`] after
/// `timeout`; connection errors, and a failure to encrypt, as
/// [`Error::Connect`].
pub(super) fn initiate(
    sock: &TcpStream,
    security: &SecurityConfig,
    me: &str,
    expect: Option<&str>,
    remote: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<String, Error> {
    let (cred, encrypt) = (security.credential.as_ref(), security.encrypt);
    let clock = ProgressClock::new();
    let io_err = |e: io::Error| initiator_io_error(remote, timeout, e);
    let mine = nonce();
    let mut body = mine.to_vec();
    body.extend_from_slice(me.as_bytes());
    let ask = encrypt && cred.is_some();
    let hello = Frame::AuthHello {
        keyed: cred.is_some(),
        encrypt: ask,
        body_len: body.len() as u32,
    };
    send(sock.as_fd(), &hello.encode(), &body, &clock, timeout).map_err(io_err)?;
    let mut idle = UntilDeadline;
    let mut reader = FrameReader::new(sock.as_raw_fd(), &clock);
    reader.set_deadline(Some(deadline));
    let (keyed, encrypted, body) = read_challenge(&mut reader, &mut idle, remote, timeout)?;
    let theirs = nonce_of(&body);
    let (tag, name) = if keyed {
        body[NONCE_LEN..].split_at(MAC_LEN)
    } else {
        (&[][..], &body[NONCE_LEN..])
    };
    let name = String::from_utf8(name.to_vec())
        .map_err(|_| auth_failed(remote, "the target's name is not UTF-8".into()))?;
    if let Some(want) = expect
        && want != name
    {
        return Err(auth_failed(
            remote,
            format!("the target calls itself {name:?}, not {want:?}"),
        ));
    }
    let Some(cred) = cred else {
        // Neither side has a credential (the target would have said
        // AUTH_REQUIRED otherwise): nothing to prove.
        return Ok(name);
    };
    if !keyed {
        return Err(auth_failed(
            remote,
            "the target has no cluster credential; this agent does not send data to or \
             accept data from an unauthenticated target"
                .into(),
        ));
    }
    let t = Transcript {
        initiator_nonce: mine,
        target_nonce: theirs,
        initiator: me.as_bytes(),
        target: name.as_bytes(),
    };
    if !cred.verify_target(&t, tag) {
        return Err(auth_failed(
            remote,
            "the target's proof does not check out (another cluster secret?)".into(),
        ));
    }
    if ask && !encrypted {
        return Err(auth_failed(
            remote,
            "this agent encrypts its connections and the target did not agree to".into(),
        ));
    }
    let proof = cred.initiator_tag(&t);
    send(
        sock.as_fd(),
        &Frame::AuthProof.encode(),
        &proof,
        &clock,
        timeout,
    )
    .map_err(io_err)?;
    let raw = reader
        .next_header(&mut idle)
        .map_err(io_err)?
        .ok_or_else(|| io_err(io::ErrorKind::UnexpectedEof.into()))?;
    match Frame::decode(&raw) {
        Ok(Frame::AuthResult { status: status::OK }) => {
            if encrypted {
                // The target sends nothing more before this side's next
                // frame, which goes encrypted.
                let keys = cred.stream_keys(&t);
                ktls::encrypt(
                    sock.as_fd(),
                    &keys.initiator_to_target,
                    &keys.target_to_initiator,
                )
                .map_err(io_err)?;
            }
            Ok(name)
        }
        Ok(Frame::AuthResult { .. }) => Err(auth_failed(
            remote,
            "the target refused this agent's proof (another cluster secret?)".into(),
        )),
        other => Err(Error::ProtocolViolation {
            remote: remote.to_owned(),
            detail: format!("expected an authentication result, got {other:?}"),
        }),
    }
}

/// The target's challenge: whether it is keyed, whether the connection is
/// to be encrypted, and its body (nonce, tag when keyed, name).
fn read_challenge(
    reader: &mut FrameReader<'_>,
    idle: &mut UntilDeadline,
    remote: &str,
    timeout: Duration,
) -> Result<(bool, bool, Vec<u8>), Error> {
    let io_err = |e: io::Error| initiator_io_error(remote, timeout, e);
    let raw = reader
        .next_header(idle)
        .map_err(io_err)?
        .ok_or_else(|| io_err(io::ErrorKind::UnexpectedEof.into()))?;
    let (keyed, encrypt, body_len) = match Frame::decode(&raw) {
        Ok(Frame::AuthChallenge {
            status: status::OK,
            keyed,
            encrypt,
            body_len,
        }) => (keyed, encrypt, body_len),
        Ok(Frame::AuthChallenge {
            status: status::AUTH_REQUIRED,
            ..
        }) => {
            return Err(auth_failed(
                remote,
                "the target requires a cluster credential and this agent has none \
                 (KVXFER_SECRET_FILE, AgentConfig::with_credential)"
                    .into(),
            ));
        }
        other => {
            return Err(Error::ProtocolViolation {
                remote: remote.to_owned(),
                detail: format!("expected an authentication challenge, got {other:?}"),
            });
        }
    };
    let body = reader.read_vec(body_len as usize, idle).map_err(io_err)?;
    Ok((keyed, encrypt, body))
}

/// An initiator's I/O error during the handshake: a timeout, or a failed
/// connection to `remote`.
fn initiator_io_error(remote: &str, timeout: Duration, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::TimedOut {
        Error::Timeout {
            what: "authentication handshake",
            after: timeout,
        }
    } else {
        Error::Connect {
            addr: remote.to_owned(),
            cause: Arc::new(e),
        }
    }
}

fn auth_failed(remote: &str, reason: String) -> Error {
    Error::AuthFailed {
        remote: remote.to_owned(),
        reason,
    }
}

/// What the target's side of the exchange concluded.
pub(super) enum Verdict {
    /// The initiator proved it holds the credential (or neither side has
    /// one); it is served under this name only.
    Accepted(String),
    /// Refused (answered, when the protocol has an answer); close the
    /// connection.
    Refused(String),
}

/// The target's side on `sock`: reads the `AuthHello`, answers, checks
/// the proof. Nothing but this exchange is answered before it returns
/// `Accepted`. The caller bounds it with the reader's deadline
/// ([`FrameReader::set_deadline`]); `stop` abandons it when the agent
/// closes. The connection is encrypted (see [`ktls::encrypt`]) when
/// `security` says so or the initiator asks, both sides keyed: from before
/// anything more is read or sent.
///
/// # Errors
/// Socket errors, the reader's deadline passing, frames out of place (as
/// `InvalidData`), and the kernel's refusal to encrypt.
pub(super) fn respond(
    sock: BorrowedFd<'_>,
    reader: &mut FrameReader<'_>,
    stop: &dyn Fn() -> bool,
    security: &SecurityConfig,
    me: &str,
    clock: &ProgressClock,
    timeout: Duration,
) -> io::Result<Verdict> {
    let (cred, encrypt) = (security.credential.as_ref(), security.encrypt);
    let idle = &mut AbandonWhen(stop);
    let bad = |d: String| io::Error::new(io::ErrorKind::InvalidData, d);
    let Some(raw) = reader.next_header(idle)? else {
        return Ok(Verdict::Refused("closed before authenticating".into()));
    };
    let (keyed, asked, body_len) = match Frame::decode(&raw) {
        Ok(Frame::AuthHello {
            keyed,
            encrypt,
            body_len,
        }) => (keyed, encrypt, body_len),
        other => {
            return Err(bad(format!(
                "expected an authentication hello first, got {other:?}"
            )));
        }
    };
    let body = reader.read_vec(body_len as usize, idle)?;
    let theirs = nonce_of(&body);
    let name = String::from_utf8(body[NONCE_LEN..].to_vec())
        .map_err(|_| bad("initiator name is not UTF-8".into()))?;
    if name.is_empty() {
        return Err(bad("empty initiator name".into()));
    }
    let Some(cred) = cred else {
        // No credential here: unauthenticated service (loopback, or
        // `insecure`). A keyed initiator decides for itself to go away.
        let mut out = nonce().to_vec();
        out.extend_from_slice(me.as_bytes());
        let hdr = Frame::AuthChallenge {
            status: status::OK,
            keyed: false,
            encrypt: false,
            body_len: out.len() as u32,
        };
        send(sock, &hdr.encode(), &out, clock, timeout)?;
        return Ok(Verdict::Accepted(name));
    };
    if !keyed {
        let hdr = Frame::AuthChallenge {
            status: status::AUTH_REQUIRED,
            keyed: false,
            encrypt: false,
            body_len: 0,
        };
        send(sock, &hdr.encode(), &[], clock, timeout)?;
        return Ok(Verdict::Refused(format!(
            "{name:?} has no cluster credential"
        )));
    }
    let mine = nonce();
    let t = Transcript {
        initiator_nonce: theirs,
        target_nonce: mine,
        initiator: name.as_bytes(),
        target: me.as_bytes(),
    };
    let mut out = mine.to_vec();
    out.extend_from_slice(&cred.target_tag(&t));
    out.extend_from_slice(me.as_bytes());
    // Either side asking is enough.
    let encrypted = encrypt || asked;
    let hdr = Frame::AuthChallenge {
        status: status::OK,
        keyed: true,
        encrypt: encrypted,
        body_len: out.len() as u32,
    };
    send(sock, &hdr.encode(), &out, clock, timeout)?;
    let Some(raw) = reader.next_header(idle)? else {
        return Ok(Verdict::Refused(format!(
            "{name:?} closed instead of proving its credential (another cluster secret?)"
        )));
    };
    match Frame::decode(&raw) {
        Ok(Frame::AuthProof) => {}
        other => {
            return Err(bad(format!(
                "expected an authentication proof, got {other:?}"
            )));
        }
    }
    let proof = reader.read_vec(MAC_LEN, idle)?;
    let ok = cred.verify_initiator(&t, &proof);
    let st = if ok { status::OK } else { status::AUTH_FAILED };
    send(
        sock,
        &Frame::AuthResult { status: st }.encode(),
        &[],
        clock,
        timeout,
    )?;
    if ok && encrypted {
        let keys = cred.stream_keys(&t);
        ktls::encrypt(sock, &keys.target_to_initiator, &keys.initiator_to_target)?;
    }
    Ok(if ok {
        Verdict::Accepted(name)
    } else {
        Verdict::Refused(format!(
            "{name:?}'s proof does not check out (another cluster secret?)"
        ))
    })
}

/// The target's side of the connection handshake on `fd` (for the fuzz
/// targets): whether it accepted.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_respond(
    fd: std::os::fd::BorrowedFd<'_>,
    cred: Option<&crate::auth::Credential>,
) -> std::io::Result<bool> {
    use crate::engine::sock::{FrameReader, ProgressClock};
    use std::os::fd::AsRawFd;
    use std::time::Duration;
    let clock = ProgressClock::new();
    let mut reader = FrameReader::new(fd.as_raw_fd(), &clock);
    reader.set_deadline(Some(std::time::Instant::now() + Duration::from_secs(1)));
    let security = SecurityConfig {
        credential: cred.cloned(),
        ..SecurityConfig::default()
    };
    let v = respond(
        fd,
        &mut reader,
        &|| false,
        &security,
        "target",
        &clock,
        Duration::from_secs(1),
    )?;
    Ok(matches!(v, Verdict::Accepted(_)))
}
