//! Entry points for the `cargo fuzz` targets in `fuzz/` (feature
//! `fuzzing`; not part of the API). Each takes arbitrary bytes, runs them
//! through what a peer's bytes reach in the library, and panics only on a
//! bug: a decoder or state machine that panics, or a round trip that does
//! not hold.

use std::os::fd::AsFd;

use crate::desc::{AgentDesc, DESC_VERSION};
use crate::engine::requests::RequestTable;
use crate::engine::shm::frames::{CmaFrame, Delegate};
use crate::engine::wire::{CommitOp, Frame, HEADER_LEN};
use crate::status::TransportKind;

/// `AgentDesc::decode`: never panics; whatever decodes encodes back to
/// the same descriptor.
pub fn agent_desc(data: &[u8]) {
    // The corpus outlives format versions: its bodies are also tried as
    // this version's, so that a version bump does not leave every seed
    // stopped at the version check.
    let mut current = data.to_vec();
    if let Some(v) = current.get_mut(4..6) {
        v.copy_from_slice(&DESC_VERSION.to_le_bytes());
    }
    // And with its checksum made to match, so that the decoder behind it
    // is reached.
    let mut sealed = current.clone();
    if let Some(n) = sealed.len().checked_sub(4) {
        let crc = crate::integrity::crc32c(&sealed[..n]);
        sealed[n..].copy_from_slice(&crc.to_le_bytes());
    }
    for bytes in [data, &current, &sealed] {
        if let Ok(d) = AgentDesc::decode(bytes) {
            let again = AgentDesc::decode(&d.encode()).expect("an encoded descriptor decodes");
            assert_eq!(again, d);
        }
    }
}

/// TCP frames and the target's request table: the input is a sequence of
/// 40-byte headers, each followed by the bodies a target would read for it
/// (write-list and cross-memory delegate tables); decoded frames drive the request
/// table as the target's connection loop does.
pub fn tcp_frames(data: &[u8]) {
    let mut table: RequestTable = RequestTable::default();
    let mut rest = data;
    while rest.len() >= HEADER_LEN {
        let (hdr, tail) = rest.split_at(HEADER_LEN);
        rest = tail;
        let hdr: &[u8; HEADER_LEN] = hdr.try_into().expect("split at HEADER_LEN");
        let Ok(frame) = Frame::decode(hdr) else {
            continue;
        };
        // Whatever decodes encodes to a header that decodes the same.
        assert_eq!(Frame::decode(&frame.encode()), Ok(frame.clone()));
        let reject = |bit: bool| {
            if bit {
                Err(crate::RejectReason::BadKey)
            } else {
                Ok(())
            }
        };
        match frame {
            Frame::Write { req, len, .. } | Frame::ReadReq { req, len, .. } => {
                let _ = table.segments(req, 1, reject(len % 3 == 0));
            }
            Frame::Fence { req } => {
                let _ = table.segments(req, 1, Ok(()));
            }
            Frame::WriteList {
                req, count, total, ..
            } => {
                let n = count as usize * crate::engine::wire::WRITE_LIST_ENTRY;
                let body = &rest[..n.min(rest.len())];
                rest = &rest[body.len()..];
                let ok = crate::engine::write_list_pieces(body, total).is_ok();
                let _ = table.segments(req, u64::from(count), reject(!ok));
            }
            Frame::Transport {
                transport: TransportKind::Shm,
                head,
            } => {
                // The shm transport's frames decode (or not) without
                // panicking, and re-encode to the same.
                let Ok(f) = CmaFrame::decode(&head) else {
                    continue;
                };
                let again = match Frame::decode(&f.encode()) {
                    Ok(Frame::Transport { head, .. }) => CmaFrame::decode(&head),
                    other => panic!("a shm frame re-encoded as {other:?}"),
                };
                assert_eq!(again, Ok(f.clone()));
                let CmaFrame::Delegate(Delegate { req, count, op, .. }) = f else {
                    continue;
                };
                let n = count as usize * crate::engine::shm::frames::DELEGATE_ENTRY;
                let body = &rest[..n.min(rest.len())];
                rest = &rest[body.len()..];
                // Grants: one span a request, from its id.
                let spans = [(req & 0xffff_f000, req >> 48)];
                if crate::engine::shm::plan::delegated_pieces(body, &spans).is_ok()
                    && op == CommitOp::Write
                {
                    let _ = table.commit(req, 0, None);
                }
            }
            Frame::Commit {
                req,
                segments,
                has_sync,
                ..
            } => {
                let _ = table.commit(req, segments, has_sync.then(Vec::new));
            }
            _ => {}
        }
    }
}

/// KV-cache messages and what a context rank computes from a peer's
/// request: chunks (2-byte length prefixes) reassembled per sender, each
/// request's state checked against a fixed context state, its rank mapping
/// and its block fragments computed.
pub fn kv_wire(data: &[u8]) {
    use crate::cache::wire::{Msg, Reassembler};
    use crate::cache::{Attention, CacheState, DataType};
    let now = std::time::Instant::now();
    let mut r = Reassembler::default();
    let mut rest = data;
    while rest.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let (chunk, tail) = rest[2..].split_at(n);
        rest = tail;
        let from = if n % 2 == 0 { "a" } else { "b" };
        // Odd lengths as they are (the checksum refuses them), even ones
        // with their checksum made to match.
        let mut chunk = chunk.to_vec();
        if n % 2 == 0 {
            crate::cache::wire::reseal(&mut chunk);
        }
        let Ok(Some(msg)) = r.feed(from, &chunk, now) else {
            continue;
        };
        // Whatever decodes encodes back to the same message.
        let mut again = Reassembler::default();
        let mut out = None;
        for c in msg.encode() {
            out = again
                .feed("x", &c, now)
                .expect("an encoded message decodes");
        }
        assert_eq!(out.as_ref(), Some(&msg));
        if let Msg::Request(info) = msg {
            for ctx in [
                CacheState::new(32, 8, 128, 16, DataType::Bf16, Attention::Default, 2, 1),
                CacheState::new(
                    61,
                    1,
                    576,
                    64,
                    DataType::Fp8,
                    Attention::Mla { kv_factor: 1 },
                    4,
                    2,
                ),
            ] {
                crate::cache::context_plan(&ctx, 0, &info);
            }
        }
    }
}

/// The target's side of the connection handshake, over a socket pair
/// holding the input as what the initiator sent: never panics, and without
/// the right proof never accepts a keyed initiator.
pub fn handshake(data: &[u8]) {
    use std::io::Write;
    // Inputs up to the socket buffer: nothing to wait for.
    let data = &data[..data.len().min(64 << 10)];
    let cred = crate::auth::Credential::new(
        (0..32u8)
            .map(|i| i.wrapping_mul(151) ^ 0x5a)
            .collect::<Vec<u8>>(),
    )
    .expect("32 distinct bytes, not a pattern");
    for keyed in [false, true] {
        let (mut peer, mine) = std::os::unix::net::UnixStream::pair().expect("socketpair");
        peer.write_all(data).expect("socket buffer");
        peer.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let verdict = crate::engine::fuzz_respond(mine.as_fd(), keyed.then_some(&cred));
        assert!(
            !(keyed && matches!(verdict, Ok(true))),
            "a keyed target accepted an initiator that cannot know the MAC over its fresh nonce"
        );
    }
}

/// Every input of the committed corpora (`fuzz/corpus/<target>`) through
/// its entry point: the fuzzers' findings stay fixed in the test command,
/// which runs no fuzzer (`ci/fuzz.sh` does).
#[cfg(test)]
mod corpus {
    use std::path::Path;

    fn replay(target: &str, run: fn(&[u8])) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).expect("the committed corpus") {
            let path = entry.expect("a corpus entry").path();
            let data = std::fs::read(&path).expect("a corpus input");
            let outcome = std::panic::catch_unwind(|| run(&data));
            assert!(outcome.is_ok(), "{target} panicked on {}", path.display());
            n += 1;
        }
        assert!(n > 0, "no input in {}", dir.display());
    }

    #[test]
    fn agent_desc_corpus() {
        replay("agent_desc", super::agent_desc);
    }

    #[test]
    fn tcp_frames_corpus() {
        replay("tcp_frames", super::tcp_frames);
    }

    #[test]
    fn kv_wire_corpus() {
        replay("kv_wire", super::kv_wire);
    }

    #[test]
    fn handshake_corpus() {
        replay("handshake", super::handshake);
    }
}
