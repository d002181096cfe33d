//! The cross-memory path's frames on its link's control stream, carried in
//! the engine's [`Frame::Transport`] with the shm transport's code: the
//! engine routes them to this transport and reads nothing of them. Pure
//! encode/decode; layout in `docs/wire-format.md`.
//!
//! In the header's transport fields: `status` holds the frame's kind (low
//! byte) and its flags (high byte); `id` the request.
//!
//! Also what the transport puts in a descriptor: its offer (the process a
//! same-host peer attaches to, [`encode_offer`]) and a GPU region's key
//! (the CUDA IPC handle of its allocation, [`encode_ipc_key`]).

#![forbid(unsafe_code)]

use crate::engine::wire::{
    CommitOp, Frame, HEADER_LEN, MAX_CONTROL_BODY, TransportHead, WireError, flags_op, mem_code,
    mem_from_code, op_flags,
};
use crate::memory::MemoryType;
use crate::proto::TransportKind;

/// How a peer on the same host may reach an agent's memory directly
/// (cross-memory attach): what the shm transport offers in its descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LocalAccess {
    /// Host identity: the kernel's boot id. Agents with different values
    /// are on different hosts (or different boots) and never attach.
    pub(crate) host: String,
    /// The agent's process id, in its own pid namespace.
    pub(crate) pid: u32,
    /// Address of an 8-byte word in the agent's memory holding its
    /// instance: a peer that reads it back through cross-memory attach has
    /// proved it reaches this very process (same pid namespace, permission
    /// granted).
    pub(crate) probe_addr: u64,
}

/// Longest host id an offer carries, in bytes.
const MAX_HOST_ID: usize = 256;
/// Bytes of a GPU region's key: where the region starts in its allocation
/// (u64 LE), then the allocation's IPC handle.
const IPC_KEY_LEN: usize = 8 + 64;
/// Bytes of a VMM region's key: offset and size, u64 LE.
const VMM_KEY_LEN: usize = 16;

/// The shm transport's offer in a descriptor: the agent's process id
/// (u32 LE), the address of its probe word (u64 LE), then its host id
/// (the kernel boot id, UTF-8).
pub(crate) fn encode_offer(a: &LocalAccess) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + a.host.len());
    out.extend_from_slice(&a.pid.to_le_bytes());
    out.extend_from_slice(&a.probe_addr.to_le_bytes());
    out.extend_from_slice(a.host.as_bytes());
    out
}

/// Decodes an offer written by [`encode_offer`].
///
/// # Errors
/// Why it is not one (too short, a host id empty, too long or not UTF-8).
pub(crate) fn decode_offer(info: &[u8]) -> Result<LocalAccess, String> {
    if info.len() < 13 || info.len() > 12 + MAX_HOST_ID {
        return Err(format!(
            "malformed cross-memory offer ({} bytes)",
            info.len()
        ));
    }
    let host = std::str::from_utf8(&info[12..])
        .map_err(|_| "malformed cross-memory offer (host id not UTF-8)".to_string())?;
    Ok(LocalAccess {
        host: host.to_owned(),
        pid: u32::from_le_bytes(info[..4].try_into().expect("length checked")),
        probe_addr: u64::from_le_bytes(info[4..12].try_into().expect("length checked")),
    })
}

/// Whether an offer written by [`encode_offer`] names host `host` (what
/// [`decode_offer`] would say, without a copy: it is asked per request).
pub(crate) fn offer_is_on(info: &[u8], host: &str) -> bool {
    info.len() > 12 && info.len() <= 12 + MAX_HOST_ID && &info[12..] == host.as_bytes()
}

/// A GPU region's key with the shm transport: where the region starts in
/// its allocation (`offset`), then the allocation's CUDA IPC `handle`.
pub(crate) fn encode_ipc_key(offset: u64, handle: &[u8; 64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(IPC_KEY_LEN);
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(handle);
    out
}

/// A VMM GPU region's key with the shm transport: where the region starts
/// in its allocation (`offset`) and the allocation's size; the initiator
/// asks for the allocation's descriptor on the pool channel.
pub(crate) fn encode_vmm_key(offset: u64, size: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(VMM_KEY_LEN);
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out
}

/// Decodes a key written by [`encode_vmm_key`]: `(offset, size)`, or
/// `None` when it is not one.
pub(crate) fn decode_vmm_key(key: &[u8]) -> Option<(u64, u64)> {
    if key.len() != VMM_KEY_LEN {
        return None;
    }
    let word = |i: usize| key[i..i + 8].try_into().ok().map(u64::from_le_bytes);
    Some((word(0)?, word(8)?))
}

/// Decodes a key written by [`encode_ipc_key`]: `(offset, handle)`, or
/// `None` when it is not one.
pub(crate) fn decode_ipc_key(key: &[u8]) -> Option<(u64, [u8; 64])> {
    if key.len() != IPC_KEY_LEN {
        return None;
    }
    let offset = u64::from_le_bytes(key[..8].try_into().ok()?);
    Some((offset, key[8..].try_into().ok()?))
}

/// Most pieces in one [`CmaFrame::Delegate`].
pub(crate) const DELEGATE_MAX: u32 = 1 << 16;
/// Bytes per entry of a delegate's table: target address, initiator
/// address, length, u64 LE.
pub(crate) const DELEGATE_ENTRY: usize = 24;

const K_GRANT: u8 = 1;
const K_DELEGATE: u8 = 2;
const K_GRANTED: u8 = 3;

/// A cross-memory frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CmaFrame {
    /// Asks the target to admit direct access to a range ([`Grant`]).
    Grant(Grant),
    /// After `Granted`: asks the target to do the request's copy itself
    /// ([`Delegate`]).
    Delegate(Delegate),
    /// Target → initiator: the answer to a request's grants, all admitted
    /// (OK) or the first refusal; also the answer to its `Delegate`.
    Granted {
        /// Request id.
        req: u64,
        /// `status::OK` or a reject code.
        status: u16,
    },
}

/// A `Grant` frame: asks the target to admit direct access to
/// `[addr, addr + len)` of the region keyed `key` until the request's
/// commit; one of `total` grants of the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Grant {
    /// Request id.
    pub(crate) req: u64,
    /// Memory type of the region.
    pub(crate) mem_type: MemoryType,
    /// Start of the range.
    pub(crate) addr: u64,
    /// Length of the range.
    pub(crate) len: u64,
    /// Region access key.
    pub(crate) key: u64,
    /// Number of grants the request asks for.
    pub(crate) total: u32,
}

/// A `Delegate` frame: asks the target to do the request's copy itself
/// (its side of the copy is the contiguous one, and the kernel pins the
/// *other* process's pages one iovec at a time), then to commit the
/// request with the sync message. A table of `count` (target address,
/// initiator address, length) triples follows (24 bytes each,
/// little-endian), then the sync message (`sync_len` bytes). The initiator
/// is the process `pid`, proven by reading `instance` at `probe_addr`
/// there. The target answers `Granted` (OK: copied and committed, an `Ack`
/// follows; `DELEGATE_REFUSED`: the initiator copies and commits itself;
/// `DELEGATE_FAILED`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Delegate {
    /// Request id.
    pub(crate) req: u64,
    /// Direction of the request (the target reads from the initiator for a
    /// WRITE).
    pub(crate) op: CommitOp,
    /// Pieces (1 to [`DELEGATE_MAX`]).
    pub(crate) count: u32,
    /// The initiator's process id.
    pub(crate) pid: u32,
    /// Where the initiator's instance id can be read.
    pub(crate) probe_addr: u64,
    /// The initiator's instance id.
    pub(crate) instance: u64,
    /// Length of the sync message (0: none).
    pub(crate) sync_len: u32,
    /// Whether a sync message is present (it may be empty).
    pub(crate) has_sync: bool,
}

impl CmaFrame {
    /// Bytes that follow the header (a delegate's table and sync message).
    pub(crate) fn body_len(&self) -> u64 {
        match *self {
            CmaFrame::Delegate(Delegate {
                count, sync_len, ..
            }) => u64::from(count) * DELEGATE_ENTRY as u64 + u64::from(sync_len),
            _ => 0,
        }
    }

    /// Encodes the header (a [`Frame::Transport`] of the shm transport).
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let head = match *self {
            CmaFrame::Grant(Grant {
                req,
                mem_type,
                addr,
                len,
                key,
                total,
            }) => TransportHead {
                status: kind_flags(K_GRANT, mem_code(mem_type)),
                aux: total,
                id: req,
                addr,
                len,
                key,
            },
            CmaFrame::Delegate(Delegate {
                req,
                op,
                count,
                pid,
                probe_addr,
                instance,
                sync_len,
                has_sync,
            }) => TransportHead {
                status: kind_flags(K_DELEGATE, op_flags(op, has_sync)),
                aux: count,
                id: req,
                addr: probe_addr,
                len: u64::from(sync_len) << 32 | u64::from(pid),
                key: instance,
            },
            CmaFrame::Granted { req, status } => TransportHead {
                status: kind_flags(K_GRANTED, 0),
                aux: u32::from(status),
                id: req,
                ..TransportHead::default()
            },
        };
        Frame::Transport {
            transport: TransportKind::Shm,
            head,
        }
        .encode()
    }

    /// Decodes the transport fields of a shm [`Frame::Transport`].
    ///
    /// # Errors
    /// A [`WireError`] for unknown kinds, unknown memory types, oversized
    /// sync messages and fields that make no sense for the kind.
    pub(crate) fn decode(h: &TransportHead) -> Result<Self, WireError> {
        let [kind, flags] = h.status.to_le_bytes();
        Ok(match kind {
            K_GRANT => {
                if h.len == 0 || h.addr.checked_add(h.len).is_none() {
                    return Err(WireError::BadField("grant range"));
                }
                if h.aux == 0 {
                    return Err(WireError::BadField("grant total"));
                }
                CmaFrame::Grant(Grant {
                    req: h.id,
                    mem_type: mem_from_code(flags)?,
                    addr: h.addr,
                    len: h.len,
                    key: h.key,
                    total: h.aux,
                })
            }
            K_DELEGATE => {
                if !(1..=DELEGATE_MAX).contains(&h.aux) {
                    return Err(WireError::BadField("delegate table length"));
                }
                let sync_len = (h.len >> 32) as u32;
                if sync_len > MAX_CONTROL_BODY {
                    return Err(WireError::BodyTooLarge(sync_len));
                }
                CmaFrame::Delegate(Delegate {
                    req: h.id,
                    op: flags_op(flags).ok_or(WireError::BadField("delegate op"))?,
                    count: h.aux,
                    pid: h.len as u32,
                    probe_addr: h.addr,
                    instance: h.key,
                    sync_len,
                    has_sync: flags & 0x80 != 0,
                })
            }
            K_GRANTED => CmaFrame::Granted {
                req: h.id,
                status: u16::try_from(h.aux).map_err(|_| WireError::BadField("grant status"))?,
            },
            _ => return Err(WireError::BadField("cross-memory frame kind")),
        })
    }
}

/// A frame's kind and flags in its `status` field.
fn kind_flags(kind: u8, flags: u8) -> u16 {
    u16::from_le_bytes([kind, flags])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn offer_and_ipc_key_round_trip_and_refuse_what_they_are_not() {
        let a = LocalAccess {
            host: "boot-id".into(),
            pid: 4242,
            probe_addr: 0x7fff_0000_1234,
        };
        assert_eq!(decode_offer(&encode_offer(&a)), Ok(a.clone()));
        let good = encode_offer(&a);
        assert!(offer_is_on(&good, "boot-id"));
        assert!(!offer_is_on(&good, "boot-i") && !offer_is_on(&good[..12], ""));
        assert!(decode_offer(&good[..12]).is_err());
        let mut long = good.clone();
        long.extend_from_slice(&[b'x'; MAX_HOST_ID]);
        assert!(decode_offer(&long).is_err());
        let mut bad_utf8 = good[..12].to_vec();
        bad_utf8.push(0xff);
        assert!(decode_offer(&bad_utf8).is_err());
        let key = encode_ipc_key(0x100, &[9; 64]);
        assert_eq!(decode_ipc_key(&key), Some((0x100, [9; 64])));
        assert_eq!(decode_ipc_key(&key[..71]), None);
        assert_eq!(decode_ipc_key(&[key.clone(), vec![0]].concat()), None);
        let vmm = encode_vmm_key(0x40, 2 << 20);
        assert_eq!(decode_vmm_key(&vmm), Some((0x40, 2 << 20)));
        assert_eq!(decode_ipc_key(&vmm), None);
        assert_eq!(decode_vmm_key(&key), None);
        assert_eq!(decode_vmm_key(&vmm[..15]), None);
    }

    fn decode(hdr: &[u8; HEADER_LEN]) -> Result<CmaFrame, WireError> {
        match Frame::decode(hdr)? {
            Frame::Transport {
                transport: TransportKind::Shm,
                head,
            } => CmaFrame::decode(&head),
            other => panic!("not a shm frame: {other:?}"),
        }
    }

    fn samples() -> Vec<CmaFrame> {
        vec![
            CmaFrame::Grant(Grant {
                req: 14,
                mem_type: MemoryType::Dram,
                addr: 4096,
                len: 1 << 20,
                key: 99,
                total: 2,
            }),
            CmaFrame::Grant(Grant {
                req: u64::MAX,
                mem_type: MemoryType::Vram,
                addr: 0,
                len: u64::MAX,
                key: 0,
                total: u32::MAX,
            }),
            CmaFrame::Granted { req: 14, status: 1 },
            CmaFrame::Granted {
                req: 0,
                status: u16::MAX,
            },
            CmaFrame::Delegate(Delegate {
                req: 15,
                op: CommitOp::Write,
                count: 4096,
                pid: 4242,
                probe_addr: 0x7fff_0000_1000,
                instance: 0xdead_beef_cafe,
                sync_len: 77,
                has_sync: true,
            }),
            CmaFrame::Delegate(Delegate {
                req: 16,
                op: CommitOp::Read,
                count: 1,
                pid: u32::MAX,
                probe_addr: 0,
                instance: 0,
                sync_len: 0,
                has_sync: false,
            }),
        ]
    }

    #[test]
    fn round_trip_inside_transport_frames() {
        for f in samples() {
            let hdr = f.encode();
            // The engine sees a frame of the shm transport, nothing more.
            assert_eq!(hdr[0], 24);
            assert_eq!(decode(&hdr).unwrap(), f);
        }
    }

    #[test]
    fn rejects_nonsense() {
        let delegate = |count, sync_len| {
            CmaFrame::Delegate(Delegate {
                req: 1,
                op: CommitOp::Write,
                count,
                pid: 1,
                probe_addr: 0,
                instance: 0,
                sync_len,
                has_sync: true,
            })
            .encode()
        };
        for count in [0, DELEGATE_MAX + 1] {
            assert_eq!(
                decode(&delegate(count, 0)),
                Err(WireError::BadField("delegate table length"))
            );
        }
        assert_eq!(
            decode(&delegate(1, MAX_CONTROL_BODY + 1)),
            Err(WireError::BodyTooLarge(MAX_CONTROL_BODY + 1))
        );
        // Bytes 2 and 3: kind and flags.
        let mut bad_op = delegate(1, 0);
        bad_op[3] = 0x83;
        assert_eq!(decode(&bad_op), Err(WireError::BadField("delegate op")));
        let mut bad_kind = delegate(1, 0);
        bad_kind[2] = 9;
        assert_eq!(
            decode(&bad_kind),
            Err(WireError::BadField("cross-memory frame kind"))
        );
        let grant = |addr, len, total| {
            CmaFrame::Grant(Grant {
                req: 1,
                mem_type: MemoryType::Dram,
                addr,
                len,
                key: 1,
                total,
            })
            .encode()
        };
        for (addr, len) in [(0, 0), (u64::MAX, 2)] {
            assert_eq!(
                decode(&grant(addr, len, 1)),
                Err(WireError::BadField("grant range"))
            );
        }
        assert_eq!(
            decode(&grant(0, 1, 0)),
            Err(WireError::BadField("grant total"))
        );
        let mut bad_mem = grant(0, 1, 1);
        bad_mem[3] = 9;
        assert_eq!(decode(&bad_mem), Err(WireError::UnknownMemoryType(9)));
        let mut big_status = CmaFrame::Granted { req: 1, status: 0 }.encode();
        big_status[4..8].copy_from_slice(&0x1_0000u32.to_le_bytes());
        assert_eq!(
            decode(&big_status),
            Err(WireError::BadField("grant status"))
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(status in any::<u16>(), aux in any::<u32>(), words in prop::array::uniform4(any::<u64>())) {
            let head = TransportHead { status, aux, id: words[0], addr: words[1], len: words[2], key: words[3] };
            if let Ok(f) = CmaFrame::decode(&head) {
                // Whatever decodes re-encodes to something that decodes the same.
                prop_assert_eq!(decode(&f.encode()).unwrap(), f);
            }
        }
    }
}
