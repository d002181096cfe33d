//! Kernel TLS on a connection's socket: once its handshake agreed to
//! encrypt (`SecurityConfig::encrypt`), each side installs TLS 1.3
//! AES-128-GCM records in both directions with the keys the handshake
//! derived (`Credential::stream_keys`), before it sends or reads another
//! byte. The kernel then encrypts what `sendmsg` sends and decrypts what
//! `readv` reads, straight between the application's memory and its own
//! buffers, so the stream code above stays as it is; a record whose tag
//! does not check out (a byte changed on the wire) fails the read with
//! `EBADMSG`, which ends the connection like any other socket error.
//!
//! Records go with sequence numbers from 0 in each direction; no record
//! but application data is ever sent (no key update: a connection would
//! need 2^64 records to wrap). Where the kernel has no TLS (or
//! `KVXFER_KTLS=0`), the same records are made in user space
//! ([`super::records`]): [`encrypt`] chooses.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::OnceLock;

use crate::auth::DirectionKey;

/// `TCP_ULP` (linux/tcp.h): attaches an upper-layer protocol.
const TCP_ULP: libc::c_int = 31;
/// `SOL_TLS` (linux/socket.h).
const SOL_TLS: libc::c_int = 282;
/// `TLS_TX`, `TLS_RX` (linux/tls.h): a direction's crypto state.
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
/// TLS 1.3 (linux/tls.h `TLS_1_3_VERSION`).
const TLS_1_3_VERSION: u16 = 0x0304;
/// `TLS_CIPHER_AES_GCM_128` (linux/tls.h).
const TLS_CIPHER_AES_GCM_128: u16 = 51;

/// `struct tls12_crypto_info_aes_gcm_128` (linux/tls.h): for TLS 1.3 a
/// record's nonce is `salt ‖ iv` XOR its sequence number.
#[repr(C)]
struct CryptoInfo {
    version: u16,
    cipher_type: u16,
    iv: [u8; 8],
    key: [u8; 16],
    salt: [u8; 4],
    rec_seq: [u8; 8],
}

impl CryptoInfo {
    fn of(k: &DirectionKey) -> Self {
        let mut info = Self {
            version: TLS_1_3_VERSION,
            cipher_type: TLS_CIPHER_AES_GCM_128,
            iv: [0; 8],
            key: k.key,
            salt: [0; 4],
            rec_seq: [0; 8],
        };
        info.salt.copy_from_slice(&k.iv[..4]);
        info.iv.copy_from_slice(&k.iv[4..]);
        info
    }
}

fn setsockopt(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
    v: &[u8],
) -> io::Result<()> {
    // SAFETY: `v` is a live buffer of `v.len()` bytes for the call; the
    // kernel copies it.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            v.as_ptr().cast(),
            v.len() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn bytes_of(info: &CryptoInfo) -> &[u8] {
    // SAFETY: `CryptoInfo` is `repr(C)` of integers and byte arrays with no
    // padding (2 + 2 + 8 + 16 + 4 + 8 = 40 bytes), so all its bytes are
    // initialised; the slice borrows it.
    unsafe {
        std::slice::from_raw_parts(
            std::ptr::from_ref(info).cast::<u8>(),
            std::mem::size_of::<CryptoInfo>(),
        )
    }
}

/// Installs kernel TLS on the connected socket `fd`: what it sends is
/// sealed with `tx`, what it reads opened with `rx`.
///
/// # Errors
/// The kernel's refusal: no TLS upper-layer protocol (`ENOENT`: the `tls`
/// module is absent), or the cipher not offered.
pub(in crate::engine) fn install(
    fd: BorrowedFd<'_>,
    tx: &DirectionKey,
    rx: &DirectionKey,
) -> io::Result<()> {
    setsockopt(fd, libc::SOL_TCP, TCP_ULP, b"tls")?;
    setsockopt(fd, SOL_TLS, TLS_TX, bytes_of(&CryptoInfo::of(tx)))?;
    setsockopt(fd, SOL_TLS, TLS_RX, bytes_of(&CryptoInfo::of(rx)))
}

/// Encrypts the connected socket `fd`, sealing what it sends with `tx` and
/// opening what it reads with `rx`: kernel TLS where the kernel has it and
/// `KVXFER_KTLS` is not `0`, else the same records in user space.
///
/// # Errors
/// The kernel's refusal of a step, or `fd` is not a socket.
pub(in crate::engine) fn encrypt(
    fd: BorrowedFd<'_>,
    tx: &DirectionKey,
    rx: &DirectionKey,
) -> io::Result<()> {
    static KERNEL: OnceLock<bool> = OnceLock::new();
    let kernel = *KERNEL.get_or_init(|| {
        std::env::var("KVXFER_KTLS").map_or(true, |v| v.trim() != "0") && available().is_ok()
    });
    if kernel {
        install(fd, tx, rx)
    } else {
        crate::engine::sock::records::install(fd.as_raw_fd(), tx, rx)
    }
}

/// Whether this kernel offers TLS on TCP sockets with TLS 1.3 AES-128-GCM
/// in both directions (tried once, on a loopback connection of its own);
/// `Err` says why not.
///
/// # Errors
/// Why the kernel refused (no `tls` module, no such cipher), or the
/// loopback connection failed.
pub(crate) fn available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            use std::net::{TcpListener, TcpStream};
            use std::os::fd::AsFd;
            let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let c = TcpStream::connect(l.local_addr().map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            let _accepted = l.accept().map_err(|e| e.to_string())?;
            let k = DirectionKey {
                key: [0; 16],
                iv: [0; 12],
            };
            install(c.as_fd(), &k, &k).map_err(|e| match e.raw_os_error() {
                Some(libc::ENOENT) => "the kernel has no TLS upper-layer protocol (kTLS: the `tls` module is not loaded or not built)".to_owned(),
                _ => format!("the kernel refused TLS 1.3 AES-128-GCM on a socket: {e}"),
            })
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crypto_info_is_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<CryptoInfo>(), 40);
        let k = DirectionKey {
            key: [7; 16],
            iv: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        };
        let info = CryptoInfo::of(&k);
        let b = bytes_of(&info);
        assert_eq!(b[..4], [0x04, 0x03, 51, 0]);
        assert_eq!(b[4..12], [5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(b[12..28], [7; 16]);
        assert_eq!(b[28..32], [1, 2, 3, 4]);
        assert_eq!(b[32..], [0; 8]);
    }
}
