//! Fragment mapping throughput (issue 4 target: ≥ 20 M fragments/s).
//! Llama-3-8B (32 layers, 8 KV heads, head 128, bf16, 16 tokens per block),
//! 4096 tokens: TP2 → TP1 (every fragment is a half-block head run, nothing
//! coalesces: 16,384 fragments per context rank) and TP1 → TP1 with
//! scattered destination blocks (whole blocks: 16,384 runs → 256 fragments).
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvxfer::cache::{Attention, CacheState, DataType, distinct_heads, map_blocks, rank_slice};
use std::hint::black_box;

fn llama(tp: u32) -> CacheState {
    CacheState::new(
        32,
        8 / tp,
        128,
        16,
        DataType::Bf16,
        Attention::Default,
        tp,
        1,
    )
}

fn mapping(c: &mut Criterion) {
    let blocks = 4096 / 16;
    let mut g = c.benchmark_group("fragment_mapping");
    for (name, ctx, gen_s) in [
        ("llama3_8b_tp2_to_tp1", llama(2), llama(1)),
        ("llama3_8b_tp1_to_tp1_scattered", llama(1), llama(1)),
    ] {
        let d = distinct_heads(&ctx, &gen_s);
        let (src, dst) = (rank_slice(&ctx, 0, d), rank_slice(&gen_s, 0, d));
        let sb: Vec<u64> = (0..blocks)
            .map(|i| (1 << 32) + i * src.block_bytes())
            .collect();
        let db: Vec<u64> = (0..blocks)
            .map(|i| (3 << 32) + (blocks - 1 - i) * dst.block_bytes())
            .collect();
        let mut out = Vec::with_capacity(1 << 16);
        let n = map_blocks(&src, &dst, &sb, &db, &mut out)
            .unwrap()
            .fragments;
        g.throughput(Throughput::Elements(n));
        g.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                black_box(map_blocks(&src, &dst, &sb, &db, &mut out).unwrap())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, mapping);
criterion_main!(benches);
