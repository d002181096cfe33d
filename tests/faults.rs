//! Fault injection: a frame-aware proxy between two agents (on the suite's
//! backend, `KVXFER_TEST_BACKEND`) damages one frame per run, drawn from a
//! seed — a flipped bit in a payload or header, a truncated, duplicated,
//! dropped or delayed frame, a stalled (stopped, then resumed) or killed
//! connection — while a checked WRITE (with a sync message) or READ is
//! under way. Over TCP the data crosses the proxy; over shm only the
//! side channel does (grants, commits with their checks, answers).
//!
//! After each run: (ii) the request reached a terminal outcome within its
//! bound; (iii) what is reported complete equals the source, and a WRITE
//! reported complete delivered its message; (i) once a READ has failed,
//! its local destination no longer changes; (iv) the pair then serves a
//! request unharmed; and after every run, (v) no thread or descriptor is
//! left behind. `KVXFER_FAULT_SEEDS` runs more seeds (`ci/fault-soak.sh`).

mod common;

use std::time::{Duration, Instant};

use common::faults::{Dir, Fault, FaultProxy, Plan, Rng};
use common::{dram, fill, first_mismatch, register};
use kvxfer::{AgentConfig, Error, TransferAgent, TransferRequest};

/// Both agents' I/O timeout: a silent peer is declared dead after it.
const IO: Duration = Duration::from_millis(1500);
/// The bound on a request's outcome: a stall past the I/O timeout, then
/// the timeout itself, with room for a loaded machine.
const BOUND: Duration = Duration::from_secs(20);
const LEN: usize = 3 << 20;

struct Pair {
    // Declared first: dropped before the agents (its pumps joined).
    proxy: FaultProxy,
    init: Box<dyn TransferAgent>,
    target: Box<dyn TransferAgent>,
    name: String,
}

fn pair(round: u64) -> Pair {
    let proxy = FaultProxy::start();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let target = common::local_agent(&format!("fault-target-{round}"), |c: AgentConfig| {
        c.with_listen(port)
            .with_advertise(proxy.addr.to_string())
            .with_io_timeout(IO)
    });
    proxy.forward_to(port);
    let init = common::local_agent(&format!("fault-init-{round}"), |c: AgentConfig| {
        c.with_io_timeout(IO).with_segment_size(256 << 10)
    });
    Pair {
        proxy,
        init,
        target,
        name: String::new(),
    }
}

/// Threads and open descriptors of this process.
fn resources() -> (usize, usize) {
    let count = |d: &str| std::fs::read_dir(d).map_or(0, |r| r.count());
    (count("/proc/self/task"), count("/proc/self/fd"))
}

/// Waits (bounded) until this process holds no more threads and
/// descriptors than `base`; panics with what is left.
fn no_leak(base: (usize, usize), seed: u64) {
    let deadline = Instant::now() + BOUND;
    loop {
        let now = resources();
        if now.0 <= base.0 && now.1 <= base.1 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: threads and descriptors {now:?}, {base:?} before"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One run: a checked request under the fault `seed` draws.
fn run(seed: u64) {
    let base = resources();
    let plan = Plan::from_seed(seed, IO.as_millis() as u64);
    let write = Rng(seed).next() % 3 != 0;
    {
        let mut p = pair(seed);
        let mut src = vec![0u8; LEN];
        fill(&mut src, seed, 0);
        let dst = vec![0u8; LEN];
        let back = vec![0u8; LEN];
        register(p.init.as_ref(), &src);
        register(p.init.as_ref(), &back);
        register(p.target.as_ref(), &dst);
        p.name = p
            .init
            .load_remote_agent_by_connection(&p.target.local_connection_info())
            .unwrap();
        // The target's copy is the READ's source: put the pattern there
        // first (unharmed).
        let pieces = |b: &[u8]| {
            let a = b.as_ptr() as u64;
            dram([(a, 1000), (a + 4096, 100_000), (a + (1 << 20), 2 << 20)])
        };
        let put = TransferRequest::write(pieces(&src), pieces(&dst), &p.name).with_integrity();
        p.init
            .submit_transfer(&put)
            .unwrap()
            .wait_success(BOUND)
            .unwrap();
        let _ = p.target.take_sync_messages();

        p.proxy.arm(plan);
        let req = if write {
            TransferRequest::write(pieces(&src), pieces(&dst), &p.name)
                .with_sync_message(seed.to_le_bytes().to_vec())
        } else {
            TransferRequest::read(pieces(&back), pieces(&dst), &p.name)
        }
        .with_integrity();
        let t0 = Instant::now();
        let outcome = match p.init.submit_transfer(&req) {
            Ok(st) => st.wait_success(BOUND),
            Err(e) => Err(e),
        };
        let took = t0.elapsed();
        let applied = p.proxy.disarm();
        let what = format!("seed {seed} {plan:?} applied {applied} write {write}: {outcome:?}");
        // (ii) a terminal outcome within its bound.
        assert!(
            !matches!(outcome, Err(Error::Timeout { .. })) && took < BOUND,
            "{what}, after {took:?}"
        );
        let whole = |b: &[u8]| {
            [(0usize, 1000usize), (4096, 100_000), (1 << 20, 2 << 20)]
                .iter()
                .all(|&(o, l)| first_mismatch(&b[o..o + l], seed, o as u64).is_none())
        };
        match &outcome {
            Ok(()) => {
                // (iii) reported complete: the bytes are the source's.
                if write {
                    assert!(whole(&dst), "{what}: reported complete, bytes differ");
                    let msgs = p.target.take_sync_messages();
                    let mine = msgs.get(p.init.name()).cloned().unwrap_or_default();
                    assert!(
                        mine.contains(&seed.to_le_bytes().to_vec()),
                        "{what}: complete, but its message never came"
                    );
                } else {
                    assert!(whole(&back), "{what}: reported complete, bytes differ");
                }
            }
            Err(e) => {
                assert!(
                    !matches!(
                        e,
                        Error::IntegrityUnsupported { .. } | Error::InvalidRequest(_)
                    ),
                    "{what}: a refusal of the request itself"
                );
                if !write {
                    // (i) the READ failed: its destination is quiet.
                    let snap = back.clone();
                    std::thread::sleep(Duration::from_millis(200));
                    assert!(snap == back, "{what}: bytes landed after the failure");
                }
            }
        }
        // A damaged payload is caught (the one fault that lands silently
        // without the checks).
        if applied && matches!(plan.fault, Fault::FlipBody(_)) && plan.dir == Dir::Up && write {
            assert!(
                outcome.is_err() || whole(&dst),
                "{what}: a flipped bit reported landed"
            );
        }
        // (iv) the pair serves the next request (the link may have to be
        // made again: the first try may meet the old one's end).
        let again = TransferRequest::write(pieces(&src), pieces(&dst), &p.name).with_integrity();
        let deadline = Instant::now() + BOUND;
        loop {
            match p
                .init
                .submit_transfer(&again)
                .and_then(|st| st.wait_success(BOUND))
            {
                Ok(()) => break,
                Err(e) => assert!(Instant::now() < deadline, "{what}: next request: {e}"),
            }
        }
        assert!(whole(&dst), "{what}: the next request's bytes");
    }
    // (v) nothing left behind.
    no_leak(base, seed);
}

#[test]
fn seeded_faults_fail_closed() {
    let seeds: u64 = std::env::var("KVXFER_FAULT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let first: u64 = std::env::var("KVXFER_FAULT_FIRST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut faults = std::collections::BTreeMap::new();
    for seed in first..first + seeds {
        let plan = Plan::from_seed(seed, IO.as_millis() as u64);
        let kind = format!("{:?}", plan.fault);
        *faults
            .entry(kind.split('(').next().unwrap_or_default().to_owned())
            .or_insert(0u32) += 1;
        run(seed);
    }
    println!("{seeds} seeds from {first}, faults drawn: {faults:?}");
}
