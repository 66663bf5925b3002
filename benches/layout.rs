//! Segment generation throughput of `pagewire-layout` over 1,000,000 pages.
//!
//! Throughput is in segments (or transfers) per second: criterion's `elem/s`. Run with
//! `cargo bench -p pagewire-benches --bench layout`. The model is a Llama-3-8B-like MHA
//! shard (32 layers, 8 KV heads of 128, bf16) and a DeepSeek-like MLA pool (61 layers,
//! 576-wide latent); the page lists are spread (every other page) so that nothing coalesces
//! away and every page costs its full segments.
//!
//! `PAGEWIRE_BENCH_CLOCK=cpu` times each batch with the benchmark thread's CPU time
//! (`/proc/thread-self/schedstat`, scheduler-tick resolution) instead of the wall clock:
//! on a shared, overloaded machine that is the figure for "one core", since time spent
//! waiting for a CPU is left out.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Bencher, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagewire_layout::{
    Component, Layout, PdBuffers, Pool, PoolGeometry, PoolKind, Segment, Segments, TransferPlan,
    pd_connector_plan_into, plan_into,
};

const PAGES: u64 = 1_000_000;

fn mha(page_size: u64, layers: u64) -> PoolGeometry {
    PoolGeometry::builder(PoolKind::Mha)
        .layers(layers)
        .page_size(page_size)
        .heads(8)
        .head_dim(128)
        .dtype_bytes(2)
        .capacity(2 * PAGES * page_size)
        .build()
        .expect("geometry")
}

fn mla(page_size: u64) -> PoolGeometry {
    PoolGeometry::builder(PoolKind::Mla)
        .layers(61)
        .page_size(page_size)
        .kv_dim(576)
        .dtype_bytes(2)
        .capacity(2 * PAGES * page_size)
        .build()
        .expect("geometry")
}

/// Every other page: 1,000,000 pages, no two adjacent.
fn spread_pages() -> Vec<u64> {
    (0..PAGES).map(|p| 2 * p).collect()
}

/// Nanoseconds this thread has run on a CPU, if the kernel exposes it.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// `b.iter(f)`, timed by the wall clock or, with `PAGEWIRE_BENCH_CLOCK=cpu`, by thread CPU
/// time.
fn run<R>(b: &mut Bencher<'_>, mut f: impl FnMut() -> R) {
    let cpu = std::env::var("PAGEWIRE_BENCH_CLOCK").is_ok_and(|v| v == "cpu");
    if !cpu {
        b.iter(f);
        return;
    }
    b.iter_custom(|iters| {
        let (t0, w0) = (thread_cpu_ns(), Instant::now());
        for _ in 0..iters {
            black_box(f());
        }
        match (t0, thread_cpu_ns()) {
            (Some(a), Some(z)) => Duration::from_nanos(z.saturating_sub(a)),
            // No schedstat: fall back to the wall clock.
            _ => w0.elapsed(),
        }
    });
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
}

/// The visitor form (no allocation at all) and the SGLang-shaped lists (reused buffers).
fn page_meta(c: &mut Criterion) {
    let pages = spread_pages();
    let mut g = c.benchmark_group("layout/page_meta_1M_pages");
    let pools = [
        ("mha_page_first", mha(64, 32), Layout::PageFirst),
        ("mha_page_head", mha(64, 32), Layout::PageHead),
        ("mha_layer_first", mha(64, 32), Layout::LayerFirst),
        ("mla_page_first_direct", mla(64), Layout::PageFirstDirect),
    ];
    for (name, geometry, layout) in pools {
        let pool = Pool::new(geometry, layout, 1 << 40, None).expect("pool");
        let segments = PAGES * pool.entries_per_page() as u64;
        g.throughput(Throughput::Elements(segments));
        g.bench_function(BenchmarkId::new("visit", name), |b| {
            run(b, || {
                let mut acc = 0u64;
                pool.for_each_page_segment(black_box(&pages), |_, s: Segment| {
                    acc = acc.wrapping_add(s.addr ^ s.len);
                })
                .expect("in range");
                black_box(acc)
            })
        });
        if layout == Layout::LayerFirst {
            // 64 entries per page: the lists would take 1 GiB; the visitor is the measure.
            continue;
        }
        let mut out = Segments::default();
        g.bench_function(BenchmarkId::new("lists", name), |b| {
            run(b, || {
                pool.page_meta_for_pages_into(black_box(&pages), &mut out)
                    .expect("in range");
                black_box(out.len())
            })
        });
    }
    g.finish();
}

/// SGLang's own entry point: token slots, P per page, every slot validated (strict checks).
fn token_indices(c: &mut Criterion) {
    let page_size = 16;
    let geometry = mha(page_size, 32);
    let pool = Pool::new(geometry, Layout::PageFirst, 1 << 40, None).expect("pool");
    let tokens: Vec<u64> = spread_pages()
        .iter()
        .flat_map(|&p| p * page_size..(p + 1) * page_size)
        .collect();
    let mut g = c.benchmark_group("layout/token_indices_1M_pages");
    g.throughput(Throughput::Elements(PAGES * 2));
    let mut out = Segments::default();
    g.bench_function("mha_page_first_P16_strict", |b| {
        run(b, || {
            pool.page_meta_into(black_box(&tokens), &mut out)
                .expect("valid");
            black_box(out.len())
        })
    });
    let head = Pool::new(geometry, Layout::PageHead, 1 << 40, None).expect("pool");
    g.throughput(Throughput::Elements(PAGES * 2 * 4));
    g.bench_function("mha_page_head_split4_P16_strict", |b| {
        run(b, || {
            let mut acc = 0u64;
            head.for_each_split_heads_segment(black_box(&tokens), 4, |c, s| {
                acc = acc.wrapping_add(s.addr ^ u64::from(c == Component::V));
            })
            .expect("valid");
            black_box(acc)
        })
    });
    g.finish();
}

/// Transfer plans over 1,000,000 scattered page pairs.
fn plans(c: &mut Criterion) {
    let src_pages = spread_pages();
    let dst_pages: Vec<u64> = src_pages.iter().map(|p| p + 1).collect();
    let mut g = c.benchmark_group("layout/plan_1M_pages");

    // SGLang's PD connector plan, 2 layers of K and V (4 transfers per page pair).
    let layers = 2u64;
    let bases = |b: u64| -> Vec<u64> { (0..layers).map(|l| b + (l << 36)).collect() };
    let (sk, dk, sv, dv) = (
        bases(1 << 40),
        bases(2 << 40),
        bases(3 << 40),
        bases(4 << 40),
    );
    let groups = [
        PdBuffers {
            src: &sk,
            dst: &dk,
            item_len: 64 * 8 * 128 * 2,
        },
        PdBuffers {
            src: &sv,
            dst: &dv,
            item_len: 64 * 8 * 128 * 2,
        },
    ];
    g.throughput(Throughput::Elements(PAGES * 2 * layers));
    let mut out = TransferPlan::new();
    g.bench_function("pd_connector_L2", |b| {
        run(b, || {
            pd_connector_plan_into(&groups, black_box(&src_pages), &dst_pages, &mut out)
                .expect("plan");
            black_box(out.len())
        })
    });

    // Same-layout host-to-host plan: one run per page and buffer.
    let geometry = mha(64, 32);
    let src = Pool::new(geometry, Layout::PageFirst, 1 << 40, None).expect("pool");
    let dst = Pool::new(geometry, Layout::PageFirst, 1 << 44, None).expect("pool");
    g.throughput(Throughput::Elements(PAGES * 2));
    g.bench_function("page_first_to_page_first", |b| {
        run(b, || {
            plan_into(
                &src,
                &dst,
                black_box(&src_pages),
                &dst_pages,
                Default::default(),
                &mut out,
            )
            .expect("plan");
            black_box(out.len())
        })
    });
    g.finish();

    // Cross-layout, page_first host pool to a layer_first pool: one transfer per
    // (buffer, layer, token), so 1,000 pages already give 4,096,000 transfers.
    let few: Vec<u64> = (0..1000).map(|p| 2 * p).collect();
    let dst_lf = Pool::new(geometry, Layout::LayerFirst, 1 << 44, None).expect("pool");
    let mut g = c.benchmark_group("layout/plan_cross_layout_1k_pages");
    g.throughput(Throughput::Elements(1000 * 2 * 32 * 64));
    g.bench_function("page_first_to_layer_first", |b| {
        run(b, || {
            plan_into(
                &src,
                &dst_lf,
                black_box(&few),
                &few,
                Default::default(),
                &mut out,
            )
            .expect("plan");
            black_box(out.len())
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = page_meta, token_indices, plans
}
criterion_main!(benches);
