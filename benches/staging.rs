//! The GPU staging pipeline on the CPU: `HostCopyEngine` (memcpy worker threads
//! standing in for CUDA streams) with an in-memory wire.
//!
//! `cargo bench -p pagewire-benches --bench staging`. Throughput is bytes/s of the
//! whole staged transfer. What this measures is the pipeline's own overhead and
//! overlap on this CPU, not a GPU: on a GPU machine use `scripts/gpu-check.sh`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagewire_gpudirect::staging::plan_chunks;
use pagewire_gpudirect::testing::{MemWire, NullWire};
use pagewire_gpudirect::{CopyEngine, HostCopyEngine, Segment, StagedPipeline, StagingConfig};

const BYTES: usize = 16 << 20;

fn cfg(chunk_size: usize, depth: usize) -> StagingConfig {
    StagingConfig {
        chunk_size,
        depth,
        timeout: Duration::from_secs(30),
    }
}

fn staged_write(c: &mut Criterion) {
    let mut g = c.benchmark_group("staged_write_16MiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(10);
    for &(chunk, depth) in &[
        (64 << 10, 4),
        (256 << 10, 4),
        (1 << 20, 4),
        (4 << 20, 4),
        (1 << 20, 1),
    ] {
        let id = format!("chunk{}K_depth{depth}", chunk >> 10);
        // Ring only: the copy side of the pipeline.
        let copy = HostCopyEngine::default();
        let src = copy.alloc_device(BYTES).expect("alloc");
        let seg = [Segment {
            local_off: 0,
            remote_off: 0,
            len: BYTES as u64,
        }];
        let mut p =
            StagedPipeline::new(copy, NullWire::new(), cfg(chunk, depth)).expect("pipeline");
        g.bench_function(BenchmarkId::new("null_wire", &id), |b| {
            b.iter(|| black_box(p.write(src.span(), &seg, None).expect("write")))
        });
        // Copy and wire both doing memcpy on their own threads: overlap matters.
        let copy = HostCopyEngine::default();
        let src = copy.alloc_device(BYTES).expect("alloc");
        let mut p =
            StagedPipeline::new(copy, MemWire::new(BYTES), cfg(chunk, depth)).expect("pipeline");
        g.bench_function(BenchmarkId::new("mem_wire", &id), |b| {
            b.iter(|| black_box(p.write(src.span(), &seg, Some(1)).expect("write")))
        });
    }
    g.finish();
}

fn chunk_planning(c: &mut Criterion) {
    // 100k KV pages of 16 KiB scattered on the remote side, packed into 2 MiB chunks.
    let segs: Vec<Segment> = (0..100_000u64)
        .map(|i| Segment {
            local_off: i * 16384,
            remote_off: (i * 7919 % 100_000) * 16384,
            len: 16384,
        })
        .collect();
    let mut g = c.benchmark_group("plan_chunks");
    g.throughput(Throughput::Elements(segs.len() as u64));
    g.bench_function("100k_pages_16KiB_into_2MiB", |b| {
        b.iter(|| black_box(plan_chunks(&segs, 2 << 20)))
    });
    g.finish();
}

criterion_group!(benches, staged_write, chunk_planning);
criterion_main!(benches);
