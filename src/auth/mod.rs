//! The cluster credential and the connection handshake's cryptography:
//! HMAC-SHA256 over both sides' nonces and names, checked in constant time.
//! Pure: no I/O (the exchange itself runs in `tcp`); randomness comes from
//! the operating system's source.
//!
//! Every connection to an agent's listener opens with this exchange, before
//! anything else is answered (layout in `docs/wire-format.md`):
//!
//! 1. initiator → target `AuthHello`: a fresh 32-byte nonce `nc`, whether it
//!    holds a credential, its agent name `a`;
//! 2. target → initiator `AuthChallenge`: its nonce `ns`, its name `b`, and
//!    (keyed) `HMAC(K, "kvxfer-auth-v1 target" ‖ T)`;
//! 3. initiator → target `AuthProof`: `HMAC(K, "kvxfer-auth-v1 initiator" ‖ T)`;
//! 4. target → initiator `AuthResult`.
//!
//! where `T = nc ‖ ns ‖ len(a) ‖ a ‖ len(b) ‖ b` (lengths as u32 LE). Each
//! side proves it holds `K` over the other's fresh nonce, so neither answer
//! can be replayed, and the initiator's name is bound to the connection:
//! the target serves it under that name only. See `docs/security.md`.

#![forbid(unsafe_code)]

use std::fmt;
use std::path::Path;

use hkdf::Hkdf;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

pub use crate::proto::{MAC_LEN, NONCE_LEN};

pub(crate) mod error;
mod strength;
pub use error::{CredentialError, MIN_SECRET_BITS, MIN_SECRET_DISTINCT, MIN_SECRET_LEN};

/// A handshake nonce.
pub type Nonce = [u8; NONCE_LEN];
/// A handshake MAC.
pub type Tag = [u8; MAC_LEN];

/// The cluster's shared secret: every agent of a cluster holds the same one.
/// Its `Debug` shows no byte of it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    secret: Vec<u8>,
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credential({} bytes, redacted)", self.secret.len())
    }
}

/// Estimated strength of `secret` in bits, as a password cracker would
/// guess it: a text secret cut into its cheapest pieces (characters of the
/// kinds it uses, common words, runs of sequences and keyboard rows,
/// repeats), a binary one 8 bits a byte of its shortest repeating unit;
/// and how many distinct bytes it has. An upper bound for a secret someone
/// chose: it only refuses what is surely weak (an offline guess needs one
/// recorded handshake).
pub fn secret_strength(secret: &[u8]) -> (u32, usize) {
    let mut seen = [false; 256];
    for &b in secret {
        seen[usize::from(b)] = true;
    }
    let distinct = seen.iter().filter(|&&s| s).count();
    (strength::guess_bits(secret).floor() as u32, distinct)
}

impl Credential {
    /// A credential from the secret's bytes: at least [`MIN_SECRET_LEN`]
    /// bytes, and at least [`MIN_SECRET_BITS`] by [`secret_strength`] with
    /// [`MIN_SECRET_DISTINCT`] distinct bytes.
    ///
    /// # Errors
    /// [`CredentialError::TooShort`], [`CredentialError::TooWeak`].
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, CredentialError> {
        let secret = secret.into();
        if secret.len() < MIN_SECRET_LEN {
            return Err(CredentialError::TooShort(secret.len()));
        }
        let (bits, distinct) = secret_strength(&secret);
        if bits < MIN_SECRET_BITS || distinct < MIN_SECRET_DISTINCT {
            return Err(CredentialError::TooWeak { bits, distinct });
        }
        Ok(Self { secret })
    }

    /// A credential read from a file: its contents, without trailing
    /// whitespace (a newline an editor added is not part of the secret).
    ///
    /// # Errors
    /// [`CredentialError::Unreadable`] or [`CredentialError::TooShort`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, CredentialError> {
        let path = path.as_ref();
        let mut bytes = std::fs::read(path).map_err(|e| CredentialError::Unreadable {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        while bytes.last().is_some_and(|b| b.is_ascii_whitespace()) {
            bytes.pop();
        }
        Self::new(bytes)
    }

    /// The credential the environment names: the file `KVXFER_SECRET_FILE`,
    /// else the value of `KVXFER_SECRET`; `None` when neither is set.
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file) and [`new`](Self::new).
    pub fn from_env() -> Result<Option<Self>, CredentialError> {
        if let Some(p) = std::env::var_os("KVXFER_SECRET_FILE").filter(|p| !p.is_empty()) {
            return Self::from_file(p).map(Some);
        }
        match std::env::var_os("KVXFER_SECRET").filter(|s| !s.is_empty()) {
            Some(s) => Self::new(s.into_encoded_bytes()).map(Some),
            None => Ok(None),
        }
    }

    fn mac(&self, label: &[u8], t: &Transcript<'_>) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.secret)
            .expect("HMAC takes keys of any length");
        m.update(label);
        m.update(&t.initiator_nonce);
        m.update(&t.target_nonce);
        for name in [t.initiator, t.target] {
            m.update(&(name.len() as u32).to_le_bytes());
            m.update(name);
        }
        m
    }

    /// The target's proof over `t`.
    pub fn target_tag(&self, t: &Transcript<'_>) -> Tag {
        self.mac(TARGET_LABEL, t).finalize().into_bytes().into()
    }

    /// The initiator's proof over `t`.
    pub fn initiator_tag(&self, t: &Transcript<'_>) -> Tag {
        self.mac(INITIATOR_LABEL, t).finalize().into_bytes().into()
    }

    /// Whether `tag` is the target's proof over `t` (constant time).
    pub fn verify_target(&self, t: &Transcript<'_>, tag: &[u8]) -> bool {
        self.mac(TARGET_LABEL, t).verify_slice(tag).is_ok()
    }

    /// Whether `tag` is the initiator's proof over `t` (constant time).
    pub fn verify_initiator(&self, t: &Transcript<'_>, tag: &[u8]) -> bool {
        self.mac(INITIATOR_LABEL, t).verify_slice(tag).is_ok()
    }
}

impl Credential {
    fn seal_mac(&self, key: &[u8], value: &[u8]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.secret)
            .expect("HMAC takes keys of any length");
        m.update(STORE_LABEL);
        m.update(&(key.len() as u32).to_le_bytes());
        m.update(key);
        m.update(value);
        m
    }

    /// The seal of a metadata-store entry: `value` published under `key`
    /// by an agent holding this credential.
    pub fn seal(&self, key: &[u8], value: &[u8]) -> Tag {
        self.seal_mac(key, value).finalize().into_bytes().into()
    }

    /// Whether `tag` is the seal of `value` under `key` (constant time).
    pub fn verify_seal(&self, key: &[u8], value: &[u8], tag: &[u8]) -> bool {
        self.seal_mac(key, value).verify_slice(tag).is_ok()
    }
}

impl Credential {
    /// The keys of an encrypted stream whose handshake covered `t`:
    /// HKDF-SHA256 with this secret as input keying material, salt
    /// [`STREAM_SALT`] and info a direction's label then `t` as the proofs
    /// cover it, 28 bytes per direction (an AES-128-GCM key, then the
    /// 12-byte IV its record nonces are made from). Each connection's
    /// nonces are fresh, so are its keys.
    pub(crate) fn stream_keys(&self, t: &Transcript<'_>) -> StreamKeys {
        let hk = Hkdf::<Sha256>::new(Some(STREAM_SALT), &self.secret);
        let mut covered =
            Vec::with_capacity(2 * NONCE_LEN + 8 + t.initiator.len() + t.target.len());
        covered.extend_from_slice(&t.initiator_nonce);
        covered.extend_from_slice(&t.target_nonce);
        for name in [t.initiator, t.target] {
            covered.extend_from_slice(&(name.len() as u32).to_le_bytes());
            covered.extend_from_slice(name);
        }
        let direction = |label: &[u8]| {
            let mut okm = [0u8; 28];
            hk.expand_multi_info(&[label, &covered], &mut okm)
                .expect("28 bytes is within HKDF-SHA256's output");
            let mut d = DirectionKey {
                key: [0; 16],
                iv: [0; 12],
            };
            d.key.copy_from_slice(&okm[..16]);
            d.iv.copy_from_slice(&okm[16..]);
            d
        };
        StreamKeys {
            initiator_to_target: direction(b"kvxfer-stream-v1 initiator to target"),
            target_to_initiator: direction(b"kvxfer-stream-v1 target to initiator"),
        }
    }
}

/// The salt of [`Credential::stream_keys`].
const STREAM_SALT: &[u8] = b"kvxfer-stream-v1";

/// The keys of one direction of an encrypted stream.
pub(crate) struct DirectionKey {
    /// The AES-128-GCM key.
    pub(crate) key: [u8; 16],
    /// The IV a record's nonce is made from (TLS 1.3: XOR its sequence
    /// number).
    pub(crate) iv: [u8; 12],
}

impl fmt::Debug for DirectionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DirectionKey(redacted)")
    }
}

/// Both directions' keys of an encrypted stream.
#[derive(Debug)]
pub(crate) struct StreamKeys {
    /// What the initiator sends.
    pub(crate) initiator_to_target: DirectionKey,
    /// What the target sends.
    pub(crate) target_to_initiator: DirectionKey,
}

const STORE_LABEL: &[u8] = b"kvxfer-store-v1";
const TARGET_LABEL: &[u8] = b"kvxfer-auth-v1 target";
const INITIATOR_LABEL: &[u8] = b"kvxfer-auth-v1 initiator";

/// What both proofs of one handshake cover.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    /// The initiator's nonce.
    pub initiator_nonce: Nonce,
    /// The target's nonce.
    pub target_nonce: Nonce,
    /// The initiator's agent name.
    pub initiator: &'a [u8],
    /// The target's agent name.
    pub target: &'a [u8],
}

/// A fresh nonce from the operating system's random source.
///
/// # Panics
/// When the OS has no random source to offer (`getrandom` fails): no
/// credential check can be trusted then.
pub fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).expect("the OS random source failed");
    n
}

/// A random 64-bit value from the operating system's random source: access
/// keys, instance ids, queue-pair sequence numbers.
///
/// # Panics
/// As [`nonce`].
pub fn random_u64() -> u64 {
    getrandom::u64().expect("the OS random source failed")
}

/// Random bytes from the operating system's random source.
///
/// # Panics
/// As [`nonce`].
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).expect("the OS random source failed");
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's keys differ by direction, by connection (nonces), by
    /// name and by secret, and both sides derive the same.
    #[test]
    fn stream_keys_are_per_direction_connection_and_secret() {
        let c = Credential::new(*b"0f3a9c1e7b2d4f6a8c0e1b3d5f7a9c2e").unwrap();
        let other = Credential::new(*b"9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b").unwrap();
        let t = transcript(b"gen", b"ctx");
        let k = c.stream_keys(&t);
        let again = c.stream_keys(&t);
        assert_eq!(k.initiator_to_target.key, again.initiator_to_target.key);
        assert_eq!(k.target_to_initiator.iv, again.target_to_initiator.iv);
        assert_ne!(k.initiator_to_target.key, k.target_to_initiator.key);
        assert_ne!(k.initiator_to_target.iv, k.target_to_initiator.iv);
        let mut fresh = t;
        fresh.target_nonce = [9; NONCE_LEN];
        assert_ne!(
            c.stream_keys(&fresh).initiator_to_target.key,
            k.initiator_to_target.key
        );
        let renamed = transcript(b"gen2", b"ctx");
        assert_ne!(
            c.stream_keys(&renamed).initiator_to_target.key,
            k.initiator_to_target.key
        );
        assert_ne!(
            other.stream_keys(&t).initiator_to_target.key,
            k.initiator_to_target.key
        );
        assert_eq!(
            format!("{:?}", k.initiator_to_target),
            "DirectionKey(redacted)"
        );
    }

    fn transcript<'a>(a: &'a [u8], b: &'a [u8]) -> Transcript<'a> {
        Transcript {
            initiator_nonce: [1; NONCE_LEN],
            target_nonce: [2; NONCE_LEN],
            initiator: a,
            target: b,
        }
    }

    #[test]
    fn proofs_verify_with_the_same_secret_only() {
        let k = Credential::new(*b"9f2c4e81d07b3a65-e2f8c1d94a0b7e36").unwrap();
        let other = Credential::new(*b"9f2c4e81d07b3a65-e2f8c1d94a0b7e37").unwrap();
        let t = transcript(b"gen-0", b"ctx-0");
        assert!(k.verify_target(&t, &k.target_tag(&t)));
        assert!(k.verify_initiator(&t, &k.initiator_tag(&t)));
        assert!(!other.verify_target(&t, &k.target_tag(&t)));
        assert!(!other.verify_initiator(&t, &k.initiator_tag(&t)));
        // One side's proof never passes for the other's.
        assert!(!k.verify_initiator(&t, &k.target_tag(&t)));
        assert!(!k.verify_target(&t, &k.initiator_tag(&t)));
        assert!(!k.verify_target(&t, &k.target_tag(&t)[..31]));
    }

    #[test]
    fn proofs_bind_nonces_and_names() {
        let k = Credential::new(random_bytes::<32>().to_vec()).unwrap();
        let t = transcript(b"gen-0", b"ctx-0");
        let tag = k.initiator_tag(&t);
        let mut moved = t;
        moved.initiator_nonce[0] ^= 1;
        assert!(!k.verify_initiator(&moved, &tag));
        let mut moved = t;
        moved.target_nonce[31] ^= 0x80;
        assert!(!k.verify_initiator(&moved, &tag));
        assert!(!k.verify_initiator(&transcript(b"ctx-0", b"ctx-0"), &tag));
        assert!(!k.verify_initiator(&transcript(b"gen-0", b"ctx-1"), &tag));
        // Lengths are framed: the boundary between the names counts.
        assert!(!k.verify_initiator(&transcript(b"gen-0c", b"tx-0"), &tag));
    }

    #[test]
    fn tag_layout_is_label_nonces_and_framed_names() {
        // HMAC-SHA256, key the bytes 0..32, over the label and an
        // all-zero transcript with empty names: fixed, so the wire format
        // cannot drift unnoticed.
        let key: Vec<u8> = (0..32).collect();
        let k = Credential::new(key.clone()).unwrap();
        let t = Transcript {
            initiator_nonce: [0; NONCE_LEN],
            target_nonce: [0; NONCE_LEN],
            initiator: b"",
            target: b"",
        };
        let mut msg = INITIATOR_LABEL.to_vec();
        msg.extend_from_slice(&[0u8; 72]);
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&key).unwrap();
        m.update(&msg);
        let want: Tag = m.finalize().into_bytes().into();
        assert_eq!(k.initiator_tag(&t), want);
    }

    #[test]
    fn short_secrets_and_debug() {
        assert_eq!(
            Credential::new(*b"short").unwrap_err(),
            CredentialError::TooShort(5)
        );
        let k = Credential::new(*b"Do not print me, ever: 42!").unwrap();
        assert!(!format!("{k:?}").contains("print"));
    }

    /// Guessable secrets are refused, typed, whatever their length; random
    /// ones of 128 bits pass.
    #[test]
    fn weak_secrets_are_refused() {
        for weak in [
            &b"0123456789abcdef"[..],                    // a sequence twice
            b"passwordpassword",                         // a word, repeated
            &[7u8; 64],                                  // one byte repeated
            b"abababababababababababababababab",         // two bytes repeated
            b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa1",         // few distinct
            b"abcdefghabcdefghabcdefghabcdefgh",         // a run, four times
            b"0123456701234567012345670123456701234567", // a run, five times
            b"Password1Password1Password1",              // a word and a digit, three times
            b"0123456789abcdef0123456789abcdef",         // two runs, twice
            b"ci-cluster-secret-12345-6789",             // words and runs
        ] {
            assert!(
                matches!(
                    Credential::new(weak.to_vec()),
                    Err(CredentialError::TooWeak { .. })
                ),
                "{}",
                String::from_utf8_lossy(weak)
            );
        }
        let e = Credential::new(*b"abcdefghabcdefghabcdefghabcdefgh").unwrap_err();
        assert!(e.to_string().contains("about 10 bits"), "{e}");
        for strong in [
            random_bytes::<16>().to_vec(),                // 128 random bits
            b"3f9a0c7d2e41b8a6c5d9e0f1a2b3c4d5".to_vec(), // 32 random hex digits
            b"Zq7#mP2v!Lr9@xW4&nB6$kT1".to_vec(),         // 24 random printable
        ] {
            assert!(Credential::new(strong.clone()).is_ok(), "{strong:?}");
        }
    }

    #[test]
    fn secret_file_drops_trailing_newline() {
        let dir = std::env::temp_dir().join(format!("kvxfer-auth-{}", random_u64()));
        std::fs::write(&dir, b"9f2c4e81d07b3a65-e2f8c1d94a0b7e36\n").unwrap();
        let k = Credential::from_file(&dir).unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!(
            k,
            Credential::new(*b"9f2c4e81d07b3a65-e2f8c1d94a0b7e36").unwrap()
        );
        assert!(matches!(
            Credential::from_file("/nonexistent/kvxfer-secret"),
            Err(CredentialError::Unreadable { .. })
        ));
    }

    #[test]
    fn random_values_differ() {
        assert_ne!(nonce(), nonce());
        assert_ne!(random_u64(), random_u64());
    }
}
