//! Fault injection: a frame-aware proxy between two agents (on the suite's
//! backend, `KVXFER_TEST_BACKEND`) damages one frame per run, drawn from a
//! seed — a flipped bit in a payload or header, a truncated, duplicated,
//! dropped or delayed frame, a stalled (stopped, then resumed) or killed
//! connection — while a checked WRITE (with a sync message) or READ is
//! under way. Over TCP the data crosses the proxy; over shm, libfabric
//! and RDMA only the side channel does (grants, commits with their
//! checks, answers). On shm every other seed's target memory is a shared
//! pool, copied through the initiator's mapping of it.
//!
//! After each run: (ii) the request reached a terminal outcome within its
//! bound; (iii) what is reported complete equals the source, and a WRITE
//! reported complete delivered its message; (i) once a READ has failed,
//! its local destination no longer changes; (iv) the pair then serves a
//! request unharmed; and after every run, (v) no thread or descriptor is
//! left behind. `KVXFER_FAULT_SEEDS` (default 8) runs more seeds (`ci/fault-soak.sh`).

mod common;

use std::time::{Duration, Instant};

use common::faults::{Dir, Fault, FaultProxy, Plan, Rng};
use common::{dram, fill, first_mismatch, pooled_copies, register};
use kvxfer::{AgentConfig, Error, PoolAccess, SharedPool, TransferAgent, TransferRequest};

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

/// Whether the suite's backend checks requests end to end (elsewhere they
/// go unchecked: their data does not cross the proxy, only their control).
fn checks() -> bool {
    matches!(common::expected_transport(), "tcp" | "shm" | "inproc")
}

/// `r`, checked where the backend checks.
fn maybe_checked(r: TransferRequest) -> TransferRequest {
    if checks() { r.with_integrity() } else { r }
}

/// One run: a (checked) request under the fault `seed` draws.
fn run(seed: u64) {
    let base = resources();
    let plan = Plan::from_seed(seed, IO.as_millis() as u64);
    let write = !Rng(seed).next().is_multiple_of(3);
    {
        // On shm, every other seed's target memory is a shared pool, which
        // the initiator maps and copies (and checks) itself. (Declared
        // before the agents: dropped after them.)
        let pool = (common::expected_transport() == "shm" && seed % 2 == 1)
            .then(|| SharedPool::new(LEN).unwrap());
        let mut p = pair(seed);
        let mut src = vec![0u8; LEN];
        fill(&mut src, seed, 0);
        let back = vec![0u8; LEN];
        register(p.init.as_ref(), &src);
        register(p.init.as_ref(), &back);
        let owned;
        let dst: &[u8] = match &pool {
            Some(pool) => {
                p.target
                    .register_shared_pool(pool, PoolAccess::ReadWrite)
                    .unwrap();
                // SAFETY: the pool's `LEN` bytes stay mapped until it drops,
                // after the agents and `dst`'s last use; the agents write
                // them only while a request runs, this thread reads them
                // between.
                unsafe { std::slice::from_raw_parts(pool.as_ptr(), LEN) }
            }
            None => {
                owned = vec![0u8; LEN];
                register(p.target.as_ref(), &owned);
                &owned
            }
        };
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
        let put = maybe_checked(TransferRequest::write(pieces(&src), pieces(dst), &p.name));
        p.init
            .submit_transfer(&put)
            .unwrap()
            .wait_success(BOUND)
            .unwrap();
        let _ = p.target.take_sync_messages();

        p.proxy.arm(plan);
        let req = maybe_checked(if write {
            TransferRequest::write(pieces(&src), pieces(dst), &p.name)
                .with_sync_message(seed.to_le_bytes().to_vec())
        } else {
            TransferRequest::read(pieces(&back), pieces(dst), &p.name)
        });
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
                    assert!(whole(dst), "{what}: reported complete, bytes differ");
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
                outcome.is_err() || whole(dst),
                "{what}: a flipped bit reported landed"
            );
        }
        // (iv) the pair serves the next request (the link may have to be
        // made again: the first try may meet the old one's end).
        let again = maybe_checked(TransferRequest::write(pieces(&src), pieces(dst), &p.name));
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
        assert!(whole(dst), "{what}: the next request's bytes");
        if pool.is_some() {
            // The pool was mapped and copied through, not granted.
            assert!(pooled_copies(p.init.as_ref()) > 0, "{what}: not pooled");
        }
    }
    // (v) nothing left behind.
    no_leak(base, seed);
}

#[test]
fn seeded_faults_fail_closed() {
    let seeds: u64 = std::env::var("KVXFER_FAULT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
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
    // Then KV requests, a quarter as many (each is three agents, two
    // requests and, where a message is lost, the protocol's timeouts). One
    // test: the leak check counts the process's threads, which another
    // test running beside it would move.
    for seed in first..first + seeds.div_ceil(4) {
        run_kv(seed);
    }
    println!("{} KV seeds from {first}", seeds.div_ceil(4));
}

/// One KV run: two context ranks (TP2) write a request into one
/// generation rank (TP1) whose agent sits behind the proxy, whole or layer
/// by layer, while the fault `seed` draws hits what the context ranks send
/// it (data, messages) or what comes back.
fn run_kv(seed: u64) {
    use kvxfer::cache::pattern::{check_block, fill_block};
    use kvxfer::cache::{
        Attention, CacheError, CacheReceiver, CacheSender, CacheState, DataType, ReceiverConfig,
        RecvRequest, SenderConfig, distinct_heads, rank_slice,
    };
    use std::sync::Arc;

    let base = resources();
    let plan = Plan::from_seed(seed, IO.as_millis() as u64);
    let layerwise = Rng(seed ^ 0xa5a5).next().is_multiple_of(2);
    let ctx_s = CacheState::new(8, 4, 64, 16, DataType::Bf16, Attention::Default, 2, 1);
    let gen_s = CacheState::new(8, 8, 64, 16, DataType::Bf16, Attention::Default, 1, 1);
    let d = distinct_heads(&ctx_s, &gen_s);
    const BLOCKS: u32 = 6;
    {
        let proxy = FaultProxy::start();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let gen_agent: Arc<dyn TransferAgent> = Arc::from(common::local_agent(
            &format!("kvf-gen-{seed}"),
            |c: AgentConfig| {
                c.with_listen(port)
                    .with_advertise(proxy.addr.to_string())
                    .with_io_timeout(IO)
            },
        ));
        proxy.forward_to(port);
        let gen_slice = rank_slice(&gen_s, 0, d);
        let bb = gen_slice.block_bytes() as usize;
        let pool = vec![0u8; bb * BLOCKS as usize];
        register(gen_agent.as_ref(), &pool);
        let mut ctx_pools = Vec::new();
        let mut ctx_agents: Vec<Arc<dyn TransferAgent>> = Vec::new();
        for r in 0..2u32 {
            let a: Arc<dyn TransferAgent> = Arc::from(common::local_agent(
                &format!("kvf-ctx{r}-{seed}"),
                |c: AgentConfig| c.with_io_timeout(IO),
            ));
            let slice = rank_slice(&ctx_s, r, d);
            let cb = slice.block_bytes() as usize;
            let mut p = vec![0u8; cb * BLOCKS as usize];
            for b in 0..BLOCKS as usize {
                fill_block(&ctx_s, &slice, &mut p[b * cb..(b + 1) * cb], b as u32);
            }
            register(a.as_ref(), &p);
            ctx_pools.push(p);
            ctx_agents.push(a);
        }
        let sc = SenderConfig {
            timeout: Duration::from_secs(4),
            batch_bytes: 64 << 10,
            ..SenderConfig::default()
        };
        let senders: Vec<CacheSender> = ctx_agents
            .iter()
            .enumerate()
            .map(|(r, a)| {
                CacheSender::new(Arc::clone(a), ctx_s.clone(), r as u32, None, sc.clone()).unwrap()
            })
            .collect();
        let conns: Vec<String> = ctx_agents
            .iter()
            .map(|a| a.local_connection_info())
            .collect();
        let receiver = CacheReceiver::new(
            Arc::clone(&gen_agent),
            gen_s.clone(),
            0,
            ctx_s.clone(),
            &conns,
            ReceiverConfig {
                timeout: Duration::from_secs(4),
                settle_timeout: Duration::from_secs(2),
                integrity: checks(),
                ..ReceiverConfig::default()
            },
        )
        .unwrap();
        let gen_blocks = |p: &[u8]| -> Vec<u64> {
            (0..BLOCKS)
                .map(|b| p.as_ptr() as u64 + u64::from(b) * bb as u64)
                .collect()
        };
        let ctx_blocks = |r: usize| -> Vec<u64> {
            let cb = rank_slice(&ctx_s, r as u32, d).block_bytes();
            (0..BLOCKS)
                .map(|b| ctx_pools[r].as_ptr() as u64 + u64::from(b) * cb)
                .collect()
        };
        let whole = |p: &[u8]| {
            (0..BLOCKS as usize).all(|b| {
                check_block(
                    &gen_s,
                    &gen_slice,
                    &p[b * bb..(b + 1) * bb],
                    b as u32,
                    BLOCKS * 16,
                )
                .is_none()
            })
        };
        type Outcomes = (Result<(), CacheError>, Vec<Result<(), CacheError>>, Vec<u8>);
        let one = |id: u64, faulty: bool| -> Outcomes {
            if faulty {
                proxy.arm(plan);
            }
            let h = receiver
                .request(RecvRequest {
                    request_id: id,
                    ctx_dp_rank: 0,
                    blocks: gen_blocks(&pool),
                    last_block_key: None,
                })
                .unwrap();
            let sends: Vec<_> = senders
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    if layerwise {
                        let h = s.begin(id, ctx_blocks(r)).unwrap();
                        for l in s.held_layers() {
                            s.layers_ready(id, l..l + 1).unwrap();
                        }
                        h
                    } else {
                        s.send(id, ctx_blocks(r)).unwrap()
                    }
                })
                .collect();
            let recv = h.wait(BOUND).map(|_| ());
            let recv = match recv {
                // The one outcome that says blocks may still change: wait
                // for the ranks to confirm.
                Err(CacheError::Unsettled { .. }) => match h.wait_settled(BOUND) {
                    Ok(()) => Err(CacheError::Closed),
                    // A rank's confirmation was lost (a dropped or damaged
                    // message): the library cannot prove the blocks quiet,
                    // and says so; nothing to check.
                    Err(e) => Err(CacheError::Unsettled {
                        request_id: id,
                        ranks: Vec::new(),
                        cause: Box::new(e),
                    }),
                },
                other => other,
            };
            // The blocks as the outcome found them.
            let snap = pool.clone();
            let sent = sends.iter().map(|s| s.wait(BOUND).map(|_| ())).collect();
            (recv, sent, snap)
        };
        let t0 = Instant::now();
        let (recv, sent, snap) = one(1, true);
        let took = t0.elapsed();
        let applied = proxy.disarm();
        let what = format!(
            "kv seed {seed} {plan:?} applied {applied} layerwise {layerwise}: {recv:?} {sent:?}"
        );
        // (ii) every party ended within its bound.
        assert!(took < BOUND * 2, "{what}, after {took:?}");
        for s in &sent {
            assert!(
                !matches!(s, Err(CacheError::Timeout { after, .. }) if *after >= BOUND),
                "{what}"
            );
        }
        // (i) once the generation side has its outcome, its blocks are
        // quiet.
        if !matches!(recv, Err(CacheError::Unsettled { .. })) {
            std::thread::sleep(Duration::from_millis(300));
            assert!(snap == pool, "{what}: bytes landed after the outcome");
        }
        // (iii) reported complete: the blocks are the source's.
        if recv.is_ok() {
            assert!(whole(&pool), "{what}: reported complete, blocks differ");
        }
        // (iv) the next request completes.
        let mut next = 2;
        loop {
            let (r, s, _) = one(next, false);
            if r.is_ok() && s.iter().all(Result::is_ok) {
                break;
            }
            assert!(next < 4, "{what}: request {next} after it: {r:?} {s:?}");
            next += 1;
        }
        assert!(whole(&pool), "{what}: the next request's blocks");
        drop((receiver, senders));
    }
    // (v) nothing left behind.
    no_leak(base, seed);
}
