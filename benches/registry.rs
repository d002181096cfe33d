//! Region lookup cost: `RegionMap::find` over many registrations.
use criterion::{Criterion, criterion_group, criterion_main};
use kvxfer::memory::{MemoryDesc, MemoryType, RegionMap};
use std::hint::black_box;

fn lookup(c: &mut Criterion) {
    let mut m = RegionMap::new();
    for i in 0..10_000u64 {
        m.insert(MemoryType::Dram, MemoryDesc::new(i * 8192, 4096, 0), i)
            .unwrap();
    }
    c.bench_function("region_map_find_10k", |b| {
        let mut i = 0u64;
        b.iter(|| {
            i = (i + 7919) % 10_000;
            black_box(m.find(MemoryType::Dram, &MemoryDesc::new(i * 8192 + 100, 64, 0)))
        })
    });
}

criterion_group!(benches, lookup);
criterion_main!(benches);
