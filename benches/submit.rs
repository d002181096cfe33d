//! The cost of posting a request: `submit_transfer` of 4,096 scattered
//! 4 KiB descriptors (random local and remote order, nothing merges) to a
//! TCP peer, the submission alone (the transfer is waited for outside the
//! timed part); and the same request prepared once, then posted. The
//! Python front ends' per-call figure builds on these.
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvxfer::{
    AgentConfig, Backend, MemoryDesc, MemoryDescs, MemoryType, TransferRequest, make_transfer_agent,
};

const N: usize = 4096;
const BLK: usize = 4096;

/// A permutation of `0..n` from a small xorshift generator.
fn permutation(n: usize, mut seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

fn submit(c: &mut Criterion) {
    let target = make_transfer_agent(Backend::Tcp, AgentConfig::new("bench-target")).unwrap();
    let init = make_transfer_agent(Backend::Tcp, AgentConfig::new("bench-init")).unwrap();
    let src = vec![1u8; N * BLK];
    let dst = vec![0u8; N * BLK];
    // SAFETY: both buffers outlive the agents' use of them: every transfer
    // is waited for, and the agents drop before the buffers.
    unsafe {
        init.register_memory(&MemoryDescs::dram(&src)).unwrap();
        target.register_memory(&MemoryDescs::dram(&dst)).unwrap();
    }
    init.load_remote_agent(&target.local_agent_desc()).unwrap();
    let (s, d) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    let descs = |base: u64, order: &[usize]| {
        MemoryDescs::new(
            MemoryType::Dram,
            order
                .iter()
                .map(|&k| MemoryDesc::new(base + (k * BLK) as u64, BLK as u64, 0))
                .collect(),
        )
    };
    let req = TransferRequest::write(
        descs(s, &permutation(N, 7)),
        descs(d, &permutation(N, 11)),
        "bench-target",
    )
    .with_sync_message(b"x".to_vec());
    // Wall time of the call, and the caller's CPU time in it: on a small
    // machine the link's threads start moving data at once and take the
    // cores, so the wall figure there counts time the caller was not run.
    c.bench_function("submit_tcp_4096_scattered", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t0 = Instant::now();
                let st = init.submit_transfer(black_box(&req)).unwrap();
                spent += t0.elapsed();
                st.wait_success(Duration::from_secs(60)).unwrap();
            }
            spent
        })
    });
    c.bench_function("submit_tcp_4096_scattered_cpu", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t0 = thread_cpu();
                let st = init.submit_transfer(black_box(&req)).unwrap();
                spent += thread_cpu() - t0;
                st.wait_success(Duration::from_secs(60)).unwrap();
            }
            spent
        })
    });
    // The same request prepared once (its segments planned), then posted:
    // the cost of preparing, and of each post.
    c.bench_function("prepare_tcp_4096_scattered_cpu", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t0 = thread_cpu();
                let p = init.prepare_transfer(black_box(&req)).unwrap();
                spent += thread_cpu() - t0;
                init.submit_prepared(&p)
                    .unwrap()
                    .wait_success(Duration::from_secs(60))
                    .unwrap();
            }
            spent
        })
    });
    let prepared = init.prepare_transfer(&req).unwrap();
    c.bench_function("submit_prepared_tcp_4096_scattered_cpu", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t0 = thread_cpu();
                let st = init.submit_prepared(black_box(&prepared)).unwrap();
                spent += thread_cpu() - t0;
                st.wait_success(Duration::from_secs(60)).unwrap();
            }
            spent
        })
    });
    drop(prepared);
    drop(init);
    drop(target);
}

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a constant
    // every Linux has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = submit
}
criterion_main!(benches);
