//! The smallest HTTP/1.1 client etcd's JSON gateway needs: a `POST` of a
//! JSON body on a connection of its own, answered with a JSON body
//! (`Content-Length` or chunked); and the same request read as a stream of
//! newline-separated JSON messages (a watch). Every read and write has a
//! deadline, and a stream can be shut down from another thread (its
//! socket is shared with a [`Closer`]), so no thread is ever stuck in it.
//! Response heads are parsed by `httparse`. With a [`TlsClient`] (feature
//! `etcd-tls`) the same runs over TLS (rustls).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Largest response head, and largest single JSON message, accepted.
const MAX_HEAD: usize = 16 << 10;
const MAX_BODY: usize = 64 << 20;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HttpError {
    /// Connecting, sending or receiving failed (or timed out).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The server answered with a non-2xx status.
    #[error("HTTP {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The answer is not HTTP as this client reads it.
    #[error("malformed HTTP answer: {0}")]
    Malformed(String),
}

fn malformed(s: impl Into<String>) -> HttpError {
    HttpError::Malformed(s.into())
}

/// Shuts a streaming request's socket down from another thread.
#[derive(Clone, Default)]
pub(crate) struct Closer(Arc<Mutex<Option<TcpStream>>>);

impl Closer {
    /// Ends the stream (its reader gets an error or end of stream).
    pub(crate) fn close(&self) {
        if let Some(s) = self.0.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// TLS to the server: the client configuration and the name its
/// certificate must hold (default: the endpoint's host).
#[cfg(feature = "etcd-tls")]
pub(crate) struct TlsClient {
    config: std::sync::Arc<rustls::ClientConfig>,
    name: Option<rustls::pki_types::ServerName<'static>>,
}

/// TLS to the server (this build has none: never made).
#[cfg(not(feature = "etcd-tls"))]
pub(crate) enum TlsClient {}

#[cfg(feature = "etcd-tls")]
impl TlsClient {
    /// From the CA file, the optional client certificate and key, and the
    /// optional server name; what is wrong with them.
    pub(crate) fn new(tls: &super::EtcdTls) -> Result<Self, String> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(&tls.ca_file)
            .map_err(|e| format!("{}: {e}", tls.ca_file.display()))?;
        for c in certs {
            let c = c.map_err(|e| format!("{}: {e}", tls.ca_file.display()))?;
            roots
                .add(c)
                .map_err(|e| format!("{}: {e}", tls.ca_file.display()))?;
        }
        if roots.is_empty() {
            return Err(format!("{}: no certificate in it", tls.ca_file.display()));
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        let config = match &tls.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| format!("{}: {e}", cert.display()))?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("{}: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| e.to_string())?
            }
        };
        let name = match &tls.server_name {
            Some(n) => Some(
                ServerName::try_from(n.clone()).map_err(|e| format!("server name {n:?}: {e}"))?,
            ),
            None => None,
        };
        Ok(TlsClient {
            config: std::sync::Arc::new(config),
            name,
        })
    }

    /// A TLS session to `endpoint` (`host:port`).
    fn session(&self, endpoint: &str) -> io::Result<rustls::ClientConnection> {
        let name = match &self.name {
            Some(n) => n.clone(),
            None => {
                let host = endpoint
                    .rsplit_once(':')
                    .map_or(endpoint, |(h, _)| h)
                    .trim_start_matches('[')
                    .trim_end_matches(']');
                rustls::pki_types::ServerName::try_from(host.to_owned())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
            }
        };
        rustls::ClientConnection::new(std::sync::Arc::clone(&self.config), name)
            .map_err(io::Error::other)
    }
}

/// An open request whose answer is being read.
struct Conn {
    sock: TcpStream,
    /// The TLS session over `sock`, when there is one.
    #[cfg(feature = "etcd-tls")]
    tls: Option<Box<rustls::ClientConnection>>,
    buf: Vec<u8>,
    deadline: Option<Instant>,
}

impl Conn {
    fn open(endpoint: &str, deadline: Instant, tls: Option<&TlsClient>) -> Result<Self, HttpError> {
        let mut last = None;
        for a in endpoint.to_socket_addrs()? {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    #[cfg(feature = "etcd-tls")]
                    let tls = tls.map(|t| t.session(endpoint)).transpose()?.map(Box::new);
                    #[cfg(not(feature = "etcd-tls"))]
                    if let Some(t) = tls {
                        match *t {}
                    }
                    return Ok(Conn {
                        sock: s,
                        #[cfg(feature = "etcd-tls")]
                        tls,
                        buf: Vec::new(),
                        deadline: Some(deadline),
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(HttpError::Io(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {endpoint}"))
        })))
    }

    /// Applies the deadline to the socket before a blocking call.
    fn arm(&self) -> io::Result<()> {
        let t = match self.deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "etcd request"));
                }
                Some(left)
            }
            None => None,
        };
        self.sock.set_read_timeout(t)?;
        self.sock.set_write_timeout(t)
    }

    fn send(&mut self, host: &str, path: &str, body: &[u8]) -> Result<(), HttpError> {
        self.arm()?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let mut msg = head.into_bytes();
        msg.extend_from_slice(body);
        #[cfg(feature = "etcd-tls")]
        if let Some(t) = self.tls.as_deref_mut() {
            let mut s = rustls::Stream::new(t, &mut self.sock);
            s.write_all(&msg)?;
            return Ok(s.flush()?);
        }
        self.sock.write_all(&msg)?;
        Ok(())
    }

    /// Reads what the server sent next (through TLS when there is a
    /// session).
    fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        #[cfg(feature = "etcd-tls")]
        if let Some(t) = self.tls.as_deref_mut() {
            return rustls::Stream::new(t, &mut self.sock).read(buf);
        }
        self.sock.read(buf)
    }

    /// Reads more bytes into the buffer before the deadline; false at the
    /// end of the stream.
    fn fill(&mut self) -> Result<bool, HttpError> {
        self.arm()?;
        self.fill_untimed()
    }

    /// The response head: status, and how the body is framed.
    fn head(&mut self) -> Result<(u16, Framing), HttpError> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&self.buf) {
                Ok(httparse::Status::Complete(n)) => {
                    let status = resp.code.unwrap_or(0);
                    let mut framing = Framing::Close;
                    for h in resp.headers.iter() {
                        let v = std::str::from_utf8(h.value).unwrap_or("").trim();
                        if h.name.eq_ignore_ascii_case("transfer-encoding")
                            && v.eq_ignore_ascii_case("chunked")
                        {
                            framing = Framing::Chunked;
                        } else if h.name.eq_ignore_ascii_case("content-length")
                            && framing == Framing::Close
                        {
                            let len = v
                                .parse()
                                .map_err(|_| malformed(format!("content-length {v:?}")))?;
                            framing = Framing::Length(len);
                        }
                    }
                    self.buf.drain(..n);
                    return Ok((status, framing));
                }
                Ok(httparse::Status::Partial) => {
                    if self.buf.len() > MAX_HEAD {
                        return Err(malformed("response head too large"));
                    }
                    if !self.fill()? {
                        return Err(malformed("connection closed in the response head"));
                    }
                }
                Err(e) => return Err(malformed(e.to_string())),
            }
        }
    }

    /// The next piece of a chunked body (`None` after the last chunk).
    fn chunk(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        let line_end = loop {
            if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                break i;
            }
            if self.buf.len() > MAX_HEAD {
                return Err(malformed("chunk size line too long"));
            }
            if !self.fill()? {
                return Err(malformed("connection closed before a chunk"));
            }
        };
        let line =
            std::str::from_utf8(&self.buf[..line_end]).map_err(|_| malformed("chunk size"))?;
        let size_text = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| malformed(format!("chunk size {size_text:?}")))?;
        if size > MAX_BODY {
            return Err(malformed("chunk too large"));
        }
        while self.buf.len() < line_end + 2 + size + 2 {
            if !self.fill()? {
                return Err(malformed("connection closed inside a chunk"));
            }
        }
        let data = self.buf[line_end + 2..line_end + 2 + size].to_vec();
        self.buf.drain(..line_end + 2 + size + 2);
        Ok((size > 0).then_some(data))
    }

    /// The whole body.
    fn body(&mut self, framing: Framing) -> Result<Vec<u8>, HttpError> {
        match framing {
            Framing::Length(n) => {
                if n > MAX_BODY {
                    return Err(malformed("body too large"));
                }
                while self.buf.len() < n {
                    if !self.fill()? {
                        return Err(malformed("connection closed inside the body"));
                    }
                }
                Ok(self.buf[..n].to_vec())
            }
            Framing::Chunked => {
                let mut out = Vec::new();
                while let Some(c) = self.chunk()? {
                    out.extend_from_slice(&c);
                    if out.len() > MAX_BODY {
                        return Err(malformed("body too large"));
                    }
                }
                Ok(out)
            }
            Framing::Close => {
                while self.fill()? {
                    if self.buf.len() > MAX_BODY {
                        return Err(malformed("body too large"));
                    }
                }
                Ok(std::mem::take(&mut self.buf))
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(usize),
    Chunked,
    Close,
}

/// `POST`s `body` to `http://{endpoint}{path}` and returns the answer's
/// body, all before `deadline`.
pub(crate) fn post(
    endpoint: &str,
    path: &str,
    body: &[u8],
    deadline: Instant,
    tls: Option<&TlsClient>,
) -> Result<Vec<u8>, HttpError> {
    let mut c = Conn::open(endpoint, deadline, tls)?;
    c.send(endpoint, path, body)?;
    let (status, framing) = c.head()?;
    let body = c.body(framing)?;
    if !(200..300).contains(&status) {
        return Err(HttpError::Status {
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
        });
    }
    Ok(body)
}

/// A streaming answer: newline-separated JSON messages.
pub(crate) struct Stream {
    conn: Conn,
    framing: Framing,
    /// Bytes of the body not yet split into messages.
    pending: Vec<u8>,
    closer: Closer,
}

impl Stream {
    /// `POST`s `body` and reads the answer's head before `deadline`; the
    /// messages are then read with no deadline of their own (until
    /// `closer` ends the stream, or the server does).
    pub(crate) fn open(
        endpoint: &str,
        path: &str,
        body: &[u8],
        deadline: Instant,
        closer: &Closer,
        tls: Option<&TlsClient>,
    ) -> Result<Self, HttpError> {
        let mut conn = Conn::open(endpoint, deadline, tls)?;
        *closer.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.sock.try_clone()?);
        conn.send(endpoint, path, body)?;
        let (status, framing) = conn.head()?;
        if !(200..300).contains(&status) {
            let body = conn.body(framing).unwrap_or_default();
            return Err(HttpError::Status {
                status,
                body: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
            });
        }
        conn.deadline = None;
        Ok(Stream {
            conn,
            framing,
            pending: Vec::new(),
            closer: closer.clone(),
        })
    }

    /// The next message; `None` at the end of the stream.
    pub(crate) fn next_message(&mut self) -> Result<Option<Vec<u8>>, HttpError> {
        loop {
            if let Some(i) = self.pending.iter().position(|&b| b == b'\n') {
                let msg: Vec<u8> = self.pending.drain(..=i).collect();
                let msg = msg.trim_ascii();
                if msg.is_empty() {
                    continue;
                }
                return Ok(Some(msg.to_vec()));
            }
            if self.pending.len() > MAX_BODY {
                return Err(malformed("stream message too large"));
            }
            let more = match self.framing {
                Framing::Chunked => self.conn.chunk()?,
                Framing::Length(_) | Framing::Close => {
                    if self.conn.buf.is_empty() && !self.conn.fill_untimed()? {
                        None
                    } else {
                        Some(std::mem::take(&mut self.conn.buf))
                    }
                }
            };
            match more {
                Some(bytes) => self.pending.extend_from_slice(&bytes),
                None => {
                    let rest = std::mem::take(&mut self.pending);
                    let rest = rest.trim_ascii();
                    return Ok((!rest.is_empty()).then(|| rest.to_vec()));
                }
            }
        }
    }
}

impl Conn {
    /// Reads more bytes into the buffer, under the socket's read timeout
    /// as it is set; false at the end of the stream.
    fn fill_untimed(&mut self) -> Result<bool, HttpError> {
        let mut chunk = [0u8; 8192];
        let n = loop {
            match self.read_some(&mut chunk) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
        };
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n > 0)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        *self.closer.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    /// A one-shot server answering with `answer` after reading the request.
    fn serve(answer: &'static [u8]) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            s.write_all(answer).unwrap();
        });
        addr
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn bodies_by_length_and_by_chunks() {
        let a = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{\"a\":1}");
        assert_eq!(post(&a, "/x", b"{}", soon(), None).unwrap(), b"{\"a\":1}");
        let a = serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4;x=y\r\n\":2}\r\n0\r\n\r\n");
        assert_eq!(post(&a, "/x", b"{}", soon(), None).unwrap(), b"{\"a\":2}");
        let a = serve(b"HTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope");
        assert!(matches!(
            post(&a, "/x", b"{}", soon(), None),
            Err(HttpError::Status { status: 404, .. })
        ));
        let a = serve(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
        assert!(matches!(
            post(&a, "/x", b"{}", soon(), None),
            Err(HttpError::Malformed(_))
        ));
        let a = serve(b"garbage\r\n\r\n");
        assert!(matches!(
            post(&a, "/x", b"{}", soon(), None),
            Err(HttpError::Malformed(_))
        ));
    }

    #[test]
    fn a_stream_splits_messages_across_chunks() {
        let a = serve(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\n{\"a\":\r\n6\r\n1}\n{\"b\r\n5\r\n\":2}\n\r\n0\r\n\r\n",
        );
        let closer = Closer::default();
        let mut s = Stream::open(&a, "/w", b"{}", soon(), &closer, None).unwrap();
        assert_eq!(s.next_message().unwrap().unwrap(), b"{\"a\":1}");
        assert_eq!(s.next_message().unwrap().unwrap(), b"{\"b\":2}");
        assert_eq!(s.next_message().unwrap(), None);
    }

    #[test]
    fn a_closer_ends_a_blocked_stream_and_deadlines_hold() {
        // A server that answers the head, then says nothing more.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            s.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap();
            // Held open until the client goes.
            let _ = s.read(&mut buf);
            let (mut s2, _) = l.accept().unwrap();
            let _ = s2.read(&mut buf);
            let _ = s2.read(&mut buf);
        });
        let closer = Closer::default();
        let mut s = Stream::open(&addr, "/w", b"{}", soon(), &closer, None).unwrap();
        let c = closer.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            c.close();
        });
        assert!(s.next_message().is_err());
        t.join().unwrap();
        // A request that gets no answer ends at its deadline.
        let e = post(
            &addr,
            "/x",
            b"{}",
            Instant::now() + Duration::from_millis(200),
            None,
        )
        .unwrap_err();
        assert!(
            matches!(&e, HttpError::Io(io) if matches!(io.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)),
            "{e}"
        );
        drop(s);
        server.join().unwrap();
    }
}
