//! A hand-written wire client, as a non-Rust or hostile peer would speak
//! it: 40-byte little-endian headers (`docs/wire-format.md`), no kvxfer
//! code on the sending side except the public credential's MAC.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvxfer::auth::{Credential, Transcript};

pub const HELLO: u8 = 1;
pub const HELLO_ACK: u8 = 2;
pub const DESC_REQUEST: u8 = 3;
pub const DESC_REPLY: u8 = 4;
pub const WRITE: u8 = 5;
pub const READ_REQ: u8 = 6;
pub const READ_DATA: u8 = 7;
pub const COMMIT: u8 = 8;
pub const ACK: u8 = 9;
pub const WRITE_LIST: u8 = 15;
pub const AUTH_HELLO: u8 = 17;
pub const AUTH_CHALLENGE: u8 = 18;
pub const AUTH_PROOF: u8 = 19;
pub const AUTH_RESULT: u8 = 20;
pub const ABORT: u8 = 21;
/// A transport's own frame: `flags` names the transport, `status` holds
/// the transport's frame kind (low byte) and flags (high byte).
pub const TRANSPORT: u8 = 24;
/// The shm (cross-memory) transport's code in `TRANSPORT` frames.
pub const SHM: u8 = 2;
/// Its frame kinds.
pub const SHM_GRANT: u8 = 1;
pub const SHM_DELEGATE: u8 = 2;
pub const SHM_GRANTED: u8 = 3;

pub const ST_OK: u16 = 0;
pub const ST_ABORTED: u16 = 7;
pub const ST_DELEGATE_REFUSED: u16 = 14;
pub const ST_AUTH_REQUIRED: u16 = 16;
pub const ST_AUTH_FAILED: u16 = 17;

/// A frame header's fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hdr {
    pub kind: u8,
    pub flags: u8,
    pub status: u16,
    pub aux: u32,
    pub id: u64,
    pub addr: u64,
    pub len: u64,
    pub key: u64,
}

impl Hdr {
    pub fn new(kind: u8) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }

    /// A frame of the shm transport of kind `kind` with flags `flags`.
    pub fn shm(kind: u8, flags: u8) -> Self {
        Self {
            kind: TRANSPORT,
            flags: SHM,
            status: u16::from_le_bytes([kind, flags]),
            ..Self::default()
        }
    }

    /// Whether it is the shm transport's frame of kind `kind`.
    pub fn is_shm(&self, kind: u8) -> bool {
        self.kind == TRANSPORT && self.flags == SHM && self.status.to_le_bytes()[0] == kind
    }

    pub fn bytes(&self) -> [u8; 40] {
        let mut b = [0u8; 40];
        b[0] = self.kind;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.status.to_le_bytes());
        b[4..8].copy_from_slice(&self.aux.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.key.to_le_bytes());
        b
    }

    /// With its seal, where `docs/wire-format.md` asks for one: a
    /// `Commit`, and a checked `Write` or `ReadReq`, carry the low 16 bits
    /// of the CRC32C of the header (`status` zero) in `status`.
    pub fn sealed(mut self) -> Self {
        let checked = self.flags & 0x80 != 0;
        if self.kind == COMMIT || (checked && (self.kind == WRITE || self.kind == READ_REQ)) {
            self.status = 0;
            self.status = crc32c(&self.bytes()) as u16;
        }
        self
    }

    pub fn parse(b: &[u8; 40]) -> Self {
        let w = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap());
        Self {
            kind: b[0],
            flags: b[1],
            status: u16::from_le_bytes([b[2], b[3]]),
            aux: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            id: w(8..16),
            addr: w(16..24),
            len: w(24..32),
            key: w(32..40),
        }
    }
}

/// CRC32C (Castagnoli, reflected), bit by bit: the checksum the wire
/// format names, independent of the library's implementation.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// One raw connection.
pub struct RawConn {
    pub s: TcpStream,
}

impl RawConn {
    pub fn connect(addr: &str) -> Self {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Self { s }
    }

    /// Sends `h` (sealed where the protocol seals it) and `body`.
    pub fn send(&mut self, h: Hdr, body: &[u8]) -> std::io::Result<()> {
        let mut v = h.sealed().bytes().to_vec();
        v.extend_from_slice(body);
        self.s.write_all(&v)
    }

    /// The next header; `None` when the target closed the connection.
    pub fn recv(&mut self) -> Option<Hdr> {
        let mut b = [0u8; 40];
        self.s.read_exact(&mut b).ok()?;
        Some(Hdr::parse(&b))
    }

    pub fn body(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).unwrap();
        v
    }

    /// Whether the target closed the connection without sending a byte
    /// more (within the read timeout).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }

    /// The authentication exchange as agent `name`, with `cred` when given.
    /// `Err(status)` when the target refused.
    pub fn auth(&mut self, name: &str, cred: Option<&Credential>) -> Result<(), u16> {
        let nonce = [0x5au8; 32];
        let mut body = nonce.to_vec();
        body.extend_from_slice(name.as_bytes());
        let mut h = Hdr::new(AUTH_HELLO);
        h.flags = u8::from(cred.is_some());
        h.aux = body.len() as u32;
        self.send(h, &body).unwrap();
        let c = self.recv().ok_or(u16::MAX)?;
        assert_eq!(c.kind, AUTH_CHALLENGE);
        if c.status != ST_OK {
            return Err(c.status);
        }
        let body = self.body(c.aux as usize);
        let Some(cred) = cred else {
            assert_eq!(c.flags, 0, "a keyed target must refuse an unkeyed hello");
            return Ok(());
        };
        let t = Transcript {
            initiator_nonce: nonce,
            target_nonce: body[..32].try_into().unwrap(),
            initiator: name.as_bytes(),
            target: &body[64..],
        };
        let mut p = Hdr::new(AUTH_PROOF);
        p.aux = 32;
        self.send(p, &cred.initiator_tag(&t)).unwrap();
        let r = self.recv().ok_or(u16::MAX)?;
        assert_eq!(r.kind, AUTH_RESULT);
        if r.status == ST_OK {
            Ok(())
        } else {
            Err(r.status)
        }
    }

    /// `Hello` as `name` for a new link; the target's `HelloAck`.
    pub fn hello(&mut self, name: &str, link: u64) -> Option<Hdr> {
        let mut h = Hdr::new(HELLO);
        h.id = 0x1234_5679;
        h.status = 7; // protocol version (docs/wire-format.md)
        h.len = link;
        h.aux = name.len() as u32;
        self.send(h, name.as_bytes()).ok()?;
        self.recv()
    }

    /// The target's encoded descriptor.
    pub fn desc(&mut self) -> Option<Vec<u8>> {
        self.send(Hdr::new(DESC_REQUEST), &[]).ok()?;
        let h = self.recv()?;
        assert_eq!(h.kind, DESC_REPLY);
        Some(self.body(h.aux as usize))
    }
}
