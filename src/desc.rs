//! `AgentDesc`: what one agent tells another so that it can be reached and
//! written to.
//!
//! Encoding (see `docs/wire-format.md`): the 4-byte magic `KVXA`, a
//! little-endian `u16` format version, then the [`AgentDesc`] body in
//! postcard. Decoding checks the magic, the version, the body and its
//! invariants, and reports each failure as a typed [`DescError`]; it never
//! panics on any input.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use crate::memory::{MemoryDesc, MemoryType, RegionMap};

/// Magic bytes that open every encoded [`AgentDesc`].
pub const DESC_MAGIC: [u8; 4] = *b"KVXA";
/// The descriptor format version this build writes and reads.
pub const DESC_VERSION: u16 = 7;
/// Longest agent name accepted, in bytes.
pub const MAX_AGENT_NAME: usize = 256;
/// Most transports one descriptor offers.
pub const MAX_OFFERS: usize = 16;
/// Longest transport name, in bytes.
pub const MAX_TRANSPORT_NAME: usize = 32;
/// Longest transport offer ([`TransportOffer::info`]), in bytes.
pub const MAX_OFFER_INFO: usize = 4096;
/// Longest region key of one transport ([`RegionKey::key`]), in bytes.
pub const MAX_REGION_KEY: usize = 128;

/// Why an encoded [`AgentDesc`] was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescError {
    /// Fewer bytes than the fixed prefix.
    #[error("descriptor truncated: {0} bytes")]
    Truncated(usize),
    /// The bytes do not start with `KVXA`: not a kvxfer descriptor.
    #[error("not a kvxfer agent descriptor (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// Written by a version of kvxfer this build cannot read.
    #[error(
        "agent descriptor format version {found} is not supported (this build reads {supported})"
    )]
    UnsupportedVersion {
        /// Version found.
        found: u16,
        /// Version this build reads.
        supported: u16,
    },
    /// The body does not decode.
    #[error("malformed agent descriptor body: {0}")]
    Malformed(String),
    /// The body decodes but breaks an invariant.
    #[error("inconsistent agent descriptor: {0}")]
    Invalid(String),
}

/// A region a remote agent may read or write, with its access keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedRegion {
    /// The region's memory type.
    pub mem_type: MemoryType,
    /// The registered range.
    pub desc: MemoryDesc,
    /// The key a request through the agent (its side channel: TCP streams,
    /// cross-memory attach, storage) names the region by: a random 64-bit
    /// tag that changes with every registration.
    pub key: u64,
    /// The region's keys with the agent's transports, at most one per
    /// offered transport: what a peer's hardware presents (an RDMA remote
    /// key, a libfabric memory key), or what a peer opens the region by
    /// (the CUDA IPC handle of a GPU region, for a peer on the same host).
    pub keys: Vec<RegionKey>,
    /// What a request's offsets and lengths in the region must be multiples
    /// of: a storage region's direct-I/O block size, 1 otherwise. A power
    /// of two.
    pub align: u32,
}

impl ExportedRegion {
    /// The region's key with transport `transport` (its index in
    /// [`AgentDesc::transports`]), if it has one.
    pub fn key_for(&self, transport: u8) -> Option<&[u8]> {
        self.keys
            .iter()
            .find(|k| k.transport == transport)
            .map(|k| k.key.as_slice())
    }
}

/// One region's key on one transport, of the width that transport uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionKey {
    /// The transport: its index in [`AgentDesc::transports`].
    pub transport: u8,
    /// The key, as the transport encodes it (at most [`MAX_REGION_KEY`]
    /// bytes; integers little-endian).
    pub key: Vec<u8>,
}

/// A transport an agent offers beyond its side channel, with what a peer
/// must know of it before it connects (the connection itself is set up
/// over the side channel).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportOffer {
    /// The transport's name (`rdma`, …), unique in the descriptor.
    pub name: String,
    /// What the transport tells its peers (the RDMA device's name, …), as
    /// it encodes it.
    pub info: Vec<u8>,
}

/// Everything a peer needs to reach an agent and address its memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentDesc {
    /// The agent's name, unique among the agents that talk to each other.
    pub name: String,
    /// Random per-process instance id; a restarted agent has a new one, so a
    /// stale descriptor is detected at connection time.
    pub instance: u64,
    /// Endpoints (`host:port`) of the agent's listener, best first.
    pub endpoints: Vec<String>,
    /// Regions exported for one-sided access.
    pub regions: Vec<ExportedRegion>,
    /// The transports it offers beyond the side channel (RDMA when it has a
    /// device, …), which its regions' [`keys`](ExportedRegion::keys) name.
    pub transports: Vec<TransportOffer>,
}

impl AgentDesc {
    /// The offer of transport `name`, with its index (what region keys
    /// name it by).
    pub fn offer(&self, name: &str) -> Option<(u8, &TransportOffer)> {
        self.transports
            .iter()
            .enumerate()
            .find(|(_, o)| o.name == name)
            .and_then(|(i, o)| Some((u8::try_from(i).ok()?, o)))
    }

    /// Encodes the descriptor (magic, version, postcard body, and the
    /// CRC32C of all of it before, so that a descriptor damaged on its way
    /// — a region key or address with a flipped bit — is refused rather
    /// than used).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.regions.len() * 24);
        out.extend_from_slice(&DESC_MAGIC);
        out.extend_from_slice(&DESC_VERSION.to_le_bytes());
        // Serialising plain data into a Vec cannot fail.
        postcard::to_io(self, &mut out).expect("postcard into Vec is infallible");
        let crc = crate::integrity::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and validates an encoded descriptor.
    ///
    /// # Errors
    /// A [`DescError`] naming the first problem found.
    pub fn decode(bytes: &[u8]) -> Result<Self, DescError> {
        if bytes.len() < 6 {
            return Err(DescError::Truncated(bytes.len()));
        }
        let magic: [u8; 4] = bytes[..4].try_into().expect("length checked");
        if magic != DESC_MAGIC {
            return Err(DescError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != DESC_VERSION {
            return Err(DescError::UnsupportedVersion {
                found: version,
                supported: DESC_VERSION,
            });
        }
        if bytes.len() < 10 {
            return Err(DescError::Truncated(bytes.len()));
        }
        let (bytes, crc) = bytes.split_at(bytes.len() - 4);
        if crc != crate::integrity::crc32c(bytes).to_le_bytes() {
            return Err(DescError::Malformed(
                "the descriptor does not match its CRC32C (damaged)".into(),
            ));
        }
        let (desc, rest): (AgentDesc, &[u8]) = postcard::take_from_bytes(&bytes[6..])
            .map_err(|e| DescError::Malformed(e.to_string()))?;
        if !rest.is_empty() {
            return Err(DescError::Malformed(format!(
                "{} trailing bytes",
                rest.len()
            )));
        }
        desc.validate()?;
        Ok(desc)
    }

    /// Checks the invariants `decode` relies on.
    ///
    /// # Errors
    /// [`DescError::Invalid`] naming the broken invariant.
    pub fn validate(&self) -> Result<(), DescError> {
        if self.name.is_empty() || self.name.len() > MAX_AGENT_NAME {
            return Err(DescError::Invalid(format!(
                "agent name must be 1..={MAX_AGENT_NAME} bytes, got {}",
                self.name.len()
            )));
        }
        if self.endpoints.is_empty() {
            return Err(DescError::Invalid("no endpoint".into()));
        }
        if self.transports.len() > MAX_OFFERS {
            return Err(DescError::Invalid(format!(
                "{} transports offered (at most {MAX_OFFERS})",
                self.transports.len()
            )));
        }
        for (i, o) in self.transports.iter().enumerate() {
            if o.name.is_empty() || o.name.len() > MAX_TRANSPORT_NAME {
                return Err(DescError::Invalid(format!(
                    "transport name must be 1..={MAX_TRANSPORT_NAME} bytes, got {}",
                    o.name.len()
                )));
            }
            if o.info.len() > MAX_OFFER_INFO {
                return Err(DescError::Invalid(format!(
                    "transport {:?} offers {} bytes (at most {MAX_OFFER_INFO})",
                    o.name,
                    o.info.len()
                )));
            }
            if self.transports[..i].iter().any(|p| p.name == o.name) {
                return Err(DescError::Invalid(format!(
                    "transport {:?} offered twice",
                    o.name
                )));
            }
        }
        self.region_map()?;
        Ok(())
    }

    /// The exported regions as a lookup map.
    ///
    /// # Errors
    /// [`DescError::Invalid`] when a region is empty, wraps, or overlaps
    /// another, its alignment is not a power of two, or a key of it names
    /// no offered transport, repeats one, or is too long.
    pub fn region_map(&self) -> Result<RegionMap<ExportedRegion>, DescError> {
        let mut map = RegionMap::new();
        for r in &self.regions {
            if !r.align.is_power_of_two() {
                return Err(DescError::Invalid(format!(
                    "region {:?}: alignment {} is not a power of two",
                    r.desc, r.align
                )));
            }
            for (i, k) in r.keys.iter().enumerate() {
                let bad = if usize::from(k.transport) >= self.transports.len() {
                    Some("names no offered transport")
                } else if r.keys[..i].iter().any(|p| p.transport == k.transport) {
                    Some("repeats a transport")
                } else if k.key.is_empty() || k.key.len() > MAX_REGION_KEY {
                    Some("is empty or too long")
                } else {
                    None
                };
                if let Some(bad) = bad {
                    return Err(DescError::Invalid(format!(
                        "region {:?}: key {i} {bad}",
                        r.desc
                    )));
                }
            }
            map.insert(r.mem_type, r.desc, r.clone())
                .map_err(|e| DescError::Invalid(e.to_string()))?;
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> AgentDesc {
        AgentDesc {
            name: "ctx-0".into(),
            instance: 0xdead_beef,
            endpoints: vec!["127.0.0.1:4000".into()],
            regions: vec![
                ExportedRegion {
                    mem_type: MemoryType::Dram,
                    desc: MemoryDesc::new(0x1000, 4096, 0),
                    key: 7,
                    keys: vec![RegionKey {
                        transport: 0,
                        key: 0x1234u32.to_le_bytes().to_vec(),
                    }],
                    align: 1,
                },
                ExportedRegion {
                    mem_type: MemoryType::Dram,
                    desc: MemoryDesc::new(0x4000, 4096, 0),
                    key: 8,
                    keys: Vec::new(),
                    align: 1,
                },
                ExportedRegion {
                    mem_type: MemoryType::File,
                    desc: MemoryDesc::new(0, 1 << 20, 3),
                    key: 9,
                    keys: Vec::new(),
                    align: 4096,
                },
                ExportedRegion {
                    mem_type: MemoryType::Vram,
                    desc: MemoryDesc::new(0x7f00_0000_0100, 1 << 20, 0),
                    key: 10,
                    // Wider than any integer: a key is what the transport
                    // says it is.
                    keys: vec![RegionKey {
                        transport: 1,
                        key: vec![7; 72],
                    }],
                    align: 1,
                },
            ],
            transports: vec![
                TransportOffer {
                    name: "rdma".into(),
                    info: b"rxe0".to_vec(),
                },
                TransportOffer {
                    name: "shm".into(),
                    info: b"anything the transport encodes".to_vec(),
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        assert_eq!(AgentDesc::decode(&d.encode()).unwrap(), d);
    }

    #[test]
    fn typed_errors() {
        let good = sample().encode();
        assert_eq!(AgentDesc::decode(&good[..3]), Err(DescError::Truncated(3)));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(
            AgentDesc::decode(&bad),
            Err(DescError::BadMagic(_))
        ));
        let mut v1 = good.clone();
        v1[4] = 1;
        assert_eq!(
            AgentDesc::decode(&v1),
            Err(DescError::UnsupportedVersion {
                found: 1,
                supported: DESC_VERSION
            })
        );
        assert!(matches!(
            AgentDesc::decode(&good[..good.len() - 3]),
            Err(DescError::Malformed(_))
        ));
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(matches!(
            AgentDesc::decode(&trailing),
            Err(DescError::Malformed(_))
        ));
        let mut overlapping = sample();
        overlapping.regions[1].desc.addr = 0x1800;
        assert!(matches!(
            AgentDesc::decode(&overlapping.encode()),
            Err(DescError::Invalid(_))
        ));
        let mut odd = sample();
        odd.regions[2].align = 3000;
        assert!(matches!(
            AgentDesc::decode(&odd.encode()),
            Err(DescError::Invalid(e)) if e.contains("power of two")
        ));
        let mut stray_key = sample();
        stray_key.regions[0].keys[0].transport = 2;
        assert!(matches!(
            AgentDesc::decode(&stray_key.encode()),
            Err(DescError::Invalid(e)) if e.contains("no offered transport")
        ));
        let mut twice = sample();
        let k = twice.regions[0].keys[0].clone();
        twice.regions[0].keys.push(k);
        assert!(matches!(
            AgentDesc::decode(&twice.encode()),
            Err(DescError::Invalid(e)) if e.contains("repeats")
        ));
        let mut wide = sample();
        wide.regions[0].keys[0].key = vec![1; MAX_REGION_KEY + 1];
        assert!(matches!(
            AgentDesc::decode(&wide.encode()),
            Err(DescError::Invalid(e)) if e.contains("too long")
        ));
        let mut offered_twice = sample();
        let o = offered_twice.transports[0].clone();
        offered_twice.transports.push(o);
        assert!(matches!(
            AgentDesc::decode(&offered_twice.encode()),
            Err(DescError::Invalid(e)) if e.contains("offered twice")
        ));
        let d = sample();
        assert_eq!(
            d.offer("rdma").map(|(i, o)| (i, o.info.as_slice())),
            Some((0, &b"rxe0"[..]))
        );
        assert!(d.offer("fabric").is_none());
        assert_eq!(d.regions[3].key_for(1), Some(&[7; 72][..]));
        assert_eq!(d.regions[3].key_for(0), None);
        let mut unnamed = sample();
        unnamed.name.clear();
        assert!(matches!(
            AgentDesc::decode(&unnamed.encode()),
            Err(DescError::Invalid(_))
        ));
    }

    proptest! {
        /// Arbitrary bytes after a valid prefix never panic the decoder.
        #[test]
        fn decode_never_panics(body in prop::collection::vec(any::<u8>(), 0..512)) {
            let mut bytes = DESC_MAGIC.to_vec();
            bytes.extend_from_slice(&DESC_VERSION.to_le_bytes());
            bytes.extend_from_slice(&body);
            let _ = AgentDesc::decode(&bytes);
        }

        /// Flipping any byte of a valid encoding never panics the decoder.
        #[test]
        fn corrupted_never_panics(pos in 0usize..200, val in any::<u8>()) {
            let mut bytes = sample().encode();
            let p = pos % bytes.len();
            bytes[p] = val;
            let _ = AgentDesc::decode(&bytes);
        }
    }
}
