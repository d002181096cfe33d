//! Why a cluster credential could not be had, and the least a secret
//! must be: the agent layer's error names these, so they live apart from
//! the handshake's cryptography.

#![forbid(unsafe_code)]

/// Shortest credential accepted, in bytes.
pub const MIN_SECRET_LEN: usize = 16;
/// Least estimated strength of a credential accepted, in bits (see
/// [`Credential::new`](crate::auth::Credential::new)).
pub const MIN_SECRET_BITS: u32 = 128;
/// Fewest distinct bytes a credential must have (a repeated byte or a
/// short repeated pattern is refused whatever its length).
pub const MIN_SECRET_DISTINCT: usize = 8;

/// Why a credential could not be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CredentialError {
    /// Shorter than [`MIN_SECRET_LEN`] bytes.
    #[error("a cluster secret must be at least {MIN_SECRET_LEN} bytes, got {0}")]
    TooShort(usize),
    /// Long enough, but guessable: its estimated strength is under
    /// [`MIN_SECRET_BITS`] as a password cracker would count it (the
    /// kinds of characters, common words, runs of sequences and keyboard
    /// rows, repeats), or it has fewer than [`MIN_SECRET_DISTINCT`]
    /// distinct bytes.
    #[error(
        "the cluster secret is too weak: about {bits} bits as a guesser counts them (kinds of characters, common words, sequences, repeats), {distinct} distinct bytes (at least {MIN_SECRET_BITS} bits and {MIN_SECRET_DISTINCT} distinct bytes). Make one from a random source: `head -c 32 /dev/urandom > secret` for KVXFER_SECRET_FILE, or `openssl rand -hex 32` for KVXFER_SECRET"
    )]
    TooWeak {
        /// The estimated strength, in bits.
        bits: u32,
        /// Distinct bytes in it.
        distinct: usize,
    },
    /// The secret file could not be read.
    #[error("cannot read the cluster secret file {path}: {reason}")]
    Unreadable {
        /// The file.
        path: String,
        /// The OS error.
        reason: String,
    },
}
