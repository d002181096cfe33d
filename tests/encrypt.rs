//! Encrypted connections (`SecurityConfig::encrypt`: TLS 1.3 records,
//! AES-128-GCM, keys from each connection's handshake), seen from the
//! wire: two TCP agents of this process, the initiator reaching the target
//! through a proxy that keeps what it carries and can flip a bit of it.
//! Encrypted, the capture holds no stretch of the data moved either way,
//! and a byte changed on the way fails the request instead of landing; in
//! the clear the same capture holds the data (the test's premise). The
//! records are the kernel's where it has TLS, else made in user space
//! (`KVXFER_KTLS=0` asks for those): this host has no kernel TLS; the test
//! command runs the suite again in the soft-RoCE guest, whose kernel has,
//! both ways, and against a peer process that makes its records in user
//! space.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvxfer::{AgentConfig, Backend, Credential, Error, TransferRequest, make_transfer_agent};

mod common;
use common::proxy::{Dir, Pair};
use common::{PeerProc, dram, fill, first_mismatch, peer_main, register};

/// Entry point of the peer process (see `common::peer_main`).
#[test]
fn peer_process_entry() {
    if std::env::var_os("KVXFER_PEER").is_some() {
        peer_main();
    }
}

const WAIT: Duration = Duration::from_secs(30);

fn credential() -> Credential {
    Credential::new(b"encrypt-test-3c9f0a7e51d2b84f6e0c".to_vec()).unwrap()
}

/// Which records this process makes, for the log.
fn records() -> String {
    let user = std::env::var("KVXFER_KTLS").is_ok_and(|v| v.trim() == "0");
    match kvxfer::kernel_tls_available() {
        Ok(()) if !user => "the kernel's (kTLS)".into(),
        Ok(()) => "user space's (KVXFER_KTLS=0)".into(),
        Err(why) => format!("user space's ({why})"),
    }
}

/// The data moved: a line of text over and over, as a prompt's KV would
/// not be, so that any 32 bytes of it in a capture are found.
fn plaintext(len: usize) -> Vec<u8> {
    let line = b"KVXFER-PLAINTEXT user prompt: the quick brown fox 0123456789\n";
    line.iter().copied().cycle().take(len).collect()
}

/// Whether `hay` holds any 32-byte stretch of `line`'s repetition.
fn holds_plaintext(hay: &[u8]) -> bool {
    let p = plaintext(2 * 64);
    let windows: Vec<&[u8]> = (0..62).map(|o| &p[o..o + 32]).collect();
    hay.windows(32).any(|w| windows.contains(&w))
}

/// A target and an initiator holding one credential, encrypting as asked,
/// the initiator reaching the target through a proxy.
fn pair(init_encrypts: bool, target_encrypts: bool, dir: Dir, at: u64) -> Pair {
    Pair::start(
        AgentConfig::new("enc-init")
            .with_credential(credential())
            .with_encryption(init_encrypts)
            .with_streams_per_peer(1),
        AgentConfig::new("enc-target")
            .with_credential(credential())
            .with_encryption(target_encrypts),
        dir,
        at,
    )
}

/// A 1 MiB WRITE of the plaintext and a READ of it back, both landing
/// whole; whether the capture holds plaintext each way.
fn write_and_read(p: &Pair) -> (bool, bool) {
    let len = 1 << 20;
    let src = plaintext(len);
    let dst = vec![0u8; len];
    let back = vec![0u8; len];
    register(p.init.as_ref(), &src);
    register(p.init.as_ref(), &back);
    register(p.target.as_ref(), &dst);
    p.load();
    let one = |b: &[u8]| dram([(b.as_ptr() as u64, len as u64)]);
    p.init
        .submit_transfer(
            &TransferRequest::write(one(&src), one(&dst), &p.name)
                .with_sync_message(b"a secret sync message".to_vec()),
        )
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert!(dst == src, "the WRITE landed whole");
    p.init
        .submit_transfer(&TransferRequest::read(one(&back), one(&dst), &p.name))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
    assert!(back == src, "the READ landed whole");
    let up = p.proxy.captured[0].lock().unwrap();
    let down = p.proxy.captured[1].lock().unwrap();
    assert!(up.len() > len && down.len() > len, "the proxy carried both");
    let secret = b"a secret sync message";
    assert_eq!(
        holds_plaintext(&up),
        up.windows(secret.len()).any(|w| w == secret),
        "the payload and the sync message go alike"
    );
    (holds_plaintext(&up), holds_plaintext(&down))
}

#[test]
fn an_agent_that_encrypts_needs_a_credential() {
    let Err(e) = make_transfer_agent(Backend::Tcp, AgentConfig::new("enc").with_encryption(true))
    else {
        panic!("an agent without a credential encrypts");
    };
    assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    make_transfer_agent(
        Backend::Tcp,
        AgentConfig::new("enc")
            .with_credential(credential())
            .with_encryption(true),
    )
    .unwrap();
}

/// In the clear the capture holds the data both ways (the proxy sees
/// what an eavesdropper would); encrypted, whichever side asked, it holds
/// none of it, and both requests land whole.
#[test]
fn encrypted_connections_carry_no_plaintext() {
    println!("records: {}", records());
    let clear = write_and_read(&pair(false, false, Dir::Up, 0));
    assert_eq!(
        clear,
        (true, true),
        "in the clear the capture holds the data"
    );
    for (init, target) in [(true, true), (true, false), (false, true)] {
        let seen = write_and_read(&pair(init, target, Dir::Up, 0));
        assert_eq!(
            seen,
            (false, false),
            "initiator encrypts: {init}, target encrypts: {target}"
        );
    }
}

/// A bit flipped on the way, in either direction, fails the request
/// (the record's tag does not check out) instead of landing changed data,
/// and the next request, on a new connection, lands whole.
#[test]
fn a_byte_changed_on_the_wire_fails_the_request() {
    println!("records: {}", records());
    for dir in [Dir::Up, Dir::Down] {
        let len = 1 << 20;
        let p = pair(true, true, dir, 300 << 10);
        let src = plaintext(len);
        let dst = vec![0u8; len];
        register(p.init.as_ref(), &src);
        register(p.target.as_ref(), &dst);
        p.load();
        let one = |b: &[u8]| dram([(b.as_ptr() as u64, len as u64)]);
        let req = || match dir {
            Dir::Up => TransferRequest::write(one(&src), one(&dst), &p.name),
            Dir::Down => TransferRequest::read(one(&src), one(&dst), &p.name),
        };
        p.proxy.armed.store(true, Ordering::Release);
        let outcome = p
            .init
            .submit_transfer(&req())
            .and_then(|s| s.wait_success(WAIT));
        assert_eq!(p.proxy.flipped.load(Ordering::Relaxed), 1, "a bit flipped");
        let e = outcome.expect_err("a request whose bytes changed on the wire succeeded");
        assert!(
            matches!(
                e,
                Error::ConnectionLost { .. } | Error::Transport { .. } | Error::Io(_)
            ),
            "{dir:?}: {e}"
        );
        // The next one lands whole.
        p.init
            .submit_transfer(&req())
            .unwrap()
            .wait_success(WAIT)
            .unwrap();
    }
}

/// Against a peer process that encrypts its records in user space
/// (`KVXFER_KTLS=0`), this one with the kernel's where it has them: the
/// two make the same records (a WRITE and a READ land whole), and a peer
/// that does not encrypt is still made to by this side's asking.
#[test]
fn kernel_and_user_space_records_interoperate() {
    println!("records here: {}; the peer's: user space's", records());
    let secret = "encrypt-test-3c9f0a7e51d2b84f6e0c";
    let len = 1u64 << 20;
    for peer_encrypts in ["1", "0"] {
        let mut peer = PeerProc::spawn(
            "enc-peer",
            len,
            5,
            &[
                ("KVXFER_SECRET", secret),
                ("KVXFER_ENCRYPT", peer_encrypts),
                ("KVXFER_KTLS", "0"),
            ],
        );
        let init = make_transfer_agent(
            Backend::Tcp,
            AgentConfig::new("enc-init")
                .with_credential(credential())
                .with_encryption(true),
        )
        .unwrap();
        let mut src = vec![0u8; len as usize];
        fill(&mut src, 9, 0);
        let back = vec![0u8; len as usize];
        register(init.as_ref(), &src);
        register(init.as_ref(), &back);
        let name = init.load_remote_agent_by_connection(&peer.conn).unwrap();
        let one = |b: &[u8]| dram([(b.as_ptr() as u64, len)]);
        init.submit_transfer(&TransferRequest::write(
            one(&src),
            peer.range(0, len),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
        assert_eq!(peer.cmd(&format!("check 9 0 {len}")), "OK");
        init.submit_transfer(&TransferRequest::read(
            one(&back),
            peer.range(0, len),
            &name,
        ))
        .unwrap()
        .wait_success(WAIT)
        .unwrap();
        assert_eq!(first_mismatch(&back, 9, 0), None);
        peer.kill();
    }
}
