//! The cost of posting a request: `submit_transfer` of 4,096 scattered
//! 4 KiB descriptors (random local and remote order, nothing merges) to a
//! TCP peer, the submission alone (the transfer is waited for outside the
//! timed part); the same request prepared once, then posted; and requests
//! of 4,096 random pairs made by index from two prepared lists, then
//! posted. The Python front ends' per-call figure builds on these.
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvxfer::{
    AgentConfig, Backend, IndexedRequest, MemoryDesc, MemoryDescs, MemoryType, TransferOp,
    TransferRequest, make_transfer_agent,
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
    // Made by index from lists prepared once (NIXL's make_prepped_xfer +
    // transfer): 4,096 random pairs of 4 KiB blocks, new indices each time;
    // the caller's CPU in prepare_indexed, and in submit_prepared.
    let blocks = |base: u64| descs(base, &(0..N).collect::<Vec<_>>());
    let local = init.prepare_desc_list(blocks(s), None).unwrap();
    let remote = init
        .prepare_desc_list(blocks(d), Some("bench-target"))
        .unwrap();
    let mut seed = 1;
    let mut picks = || {
        seed += 2;
        let p: std::sync::Arc<[u32]> = permutation(N, seed).iter().map(|&k| k as u32).collect();
        p
    };
    let mut indexed = |name: &str, post: bool| {
        c.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let req = IndexedRequest {
                        op: TransferOp::Write,
                        local: local.clone(),
                        local_indices: picks(),
                        remote: remote.clone(),
                        remote_indices: picks(),
                        sync_message: Some(b"x".to_vec()),
                        merge: true,
                    };
                    let t0 = thread_cpu();
                    let p = init.prepare_indexed(black_box(req)).unwrap();
                    let t1 = thread_cpu();
                    let st = init.submit_prepared(&p).unwrap();
                    spent += if post { thread_cpu() - t1 } else { t1 - t0 };
                    st.wait_success(Duration::from_secs(60)).unwrap();
                }
                spent
            })
        });
    };
    indexed("prepare_indexed_tcp_4096_scattered_cpu", false);
    indexed("submit_indexed_tcp_4096_scattered_cpu", true);
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
