//! The engine's per-batch cost on the in-process loopback backend, against a plain
//! memcpy of the same bytes: what validation, pinning and batch bookkeeping add on
//! top of moving the data.
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagewire_transport::{Access, BackendKind, Batch, Engine, EngineConfig, HostBuffer};

fn engine() -> Engine {
    let cfg = EngineConfig::builder()
        .backend(BackendKind::Loopback)
        .listen("127.0.0.1:0".parse().expect("literal"))
        .build()
        .expect("loopback config");
    Engine::new(cfg).expect("loopback engine")
}

fn write_vs_memcpy(c: &mut Criterion) {
    let (a, b) = (engine(), engine());
    let max = 8 << 20;
    let src = HostBuffer::new(max).expect("alloc");
    let dst = HostBuffer::new(max).expect("alloc");
    a.register(&src, Access::LOCAL_WRITE).expect("register src");
    b.register(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("register dst");
    let peer = a.connect(b.local_addr()).expect("connect");
    let mut g = c.benchmark_group("loopback_write");
    for size in [4096usize, 65536, 1 << 20, 8 << 20] {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("engine", size), &size, |bench, &size| {
            bench.iter(|| {
                let h = a
                    .submit(
                        peer,
                        Batch::new().write(src.addr(), dst.addr(), size as u64),
                    )
                    .expect("submit");
                h.wait(Instant::now() + Duration::from_secs(10))
                    .expect("wait");
            });
        });
        let mut plain = vec![0u8; size];
        g.bench_with_input(BenchmarkId::new("memcpy", size), &size, |bench, &size| {
            bench.iter(|| {
                src.read_at(0, &mut plain[..size]);
                black_box(&plain);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, write_vs_memcpy);
criterion_main!(benches);
