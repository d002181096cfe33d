//! End-to-end integrity checksums: CRC32C (Castagnoli), the checksum of
//! iSCSI, ext4 and NVMe-oF data digests, computed with the CPU's carry-less
//! multiply or CRC instructions (chosen at run time by `crc-fast`).
//! Pure functions over byte slices; the engine decides what they cover.

#![forbid(unsafe_code)]

use crc_fast::{CrcAlgorithm, Digest};

/// The CRC32C of `bytes`.
pub(crate) fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// The CRC32C of `a` followed by `b`, from the CRC32Cs of each and the
/// length of `b`.
pub(crate) fn crc32c_combine(a: u32, b: u32, b_len: u64) -> u32 {
    crc_fast::checksum_combine(CrcAlgorithm::Crc32Iscsi, a.into(), b.into(), b_len) as u32
}

/// Bytes a receiver checks at a time, right after they land: small enough
/// to be still in the core's cache, large enough for few calls.
pub(crate) const CHECK_CHUNK: usize = 256 << 10;

/// A CRC32C over pieces fed in turn (a write list's payloads, a payload
/// checked as it lands).
pub(crate) struct Crc32c(Digest);

impl Crc32c {
    /// Over nothing yet.
    pub(crate) fn new() -> Self {
        Crc32c(Digest::new(CrcAlgorithm::Crc32Iscsi))
    }

    /// Adds the next piece.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The CRC32C of every piece, in order.
    pub(crate) fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::{Crc32c, crc32c, crc32c_combine};

    #[test]
    fn known_values() {
        // RFC 3720, B.4, and the CRC catalogue's check value.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn pieces_equal_the_whole() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        let whole = crc32c(&data);
        for cut in [0, 1, 63, 4096, 99_999, 100_000] {
            let (a, b) = data.split_at(cut);
            let mut d = Crc32c::new();
            d.update(a);
            d.update(b);
            assert_eq!(d.finish(), whole, "cut {cut}");
            let joined = crc32c_combine(crc32c(a), crc32c(b), b.len() as u64);
            assert_eq!(joined, whole, "combined at {cut}");
        }
    }

    #[test]
    fn one_flipped_bit_anywhere_is_seen() {
        let mut data = vec![0x5au8; 4096];
        let good = crc32c(&data);
        for bit in (0..data.len() * 8).step_by(97) {
            data[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(crc32c(&data), good, "bit {bit}");
            data[bit / 8] ^= 1 << (bit % 8);
        }
    }
}
