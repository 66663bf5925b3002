//! "GPU" pages staged through the host copy engine over real transport engines
//! (in-process loopback, and TCP where it is available), end to end, byte-exact.

use std::time::{Duration, Instant};

use pagewire_gpudirect::{
    CopyEngine, EngineWire, GpuError, HostCopyEngine, Segment, StagedPipeline, StagingConfig,
};
use pagewire_transport::{Access, BackendKind, HostBuffer};

mod common;
use common::{engine, host_backend_tests, pattern};

const T: Duration = Duration::from_secs(20);

fn run(kind: BackendKind) {
    let (Some(prefill), Some(decode)) = (engine(kind), engine(kind)) else {
        return;
    };
    let page = 12_288usize; // 3 host pages, not a multiple of the chunk
    let pages = 64usize;
    let len = page * pages;

    // Decode side: a host KV pool exposed for writes and reads.
    let pool = HostBuffer::new(len).unwrap();
    decode
        .register(
            &pool,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let peer = prefill.connect(decode.local_addr()).unwrap();

    // Prefill side: "GPU" pages (host stand-in memory behind the host copy engine).
    let copy = HostCopyEngine::default();
    let gpu = copy.alloc_device(len).unwrap();
    let data = pattern(len, 5);
    copy.upload(&gpu, 0, &data, T).unwrap();
    // Local page i -> remote page (i * 7) % pages (a permutation: 7 and 64 coprime).
    let segs: Vec<Segment> = (0..pages)
        .map(|i| Segment {
            local_off: (i * page) as u64,
            remote_off: ((i * 7 % pages) * page) as u64,
            len: page as u64,
        })
        .collect();

    let wire = EngineWire::new(prefill.clone(), peer, pool.addr());
    let cfg = StagingConfig {
        chunk_size: 40_000,
        depth: 3,
        timeout: T,
    };
    let mut p = StagedPipeline::new(copy, wire, cfg).unwrap();
    let stats = p.write(gpu.span(), &segs, Some(0xbeef)).unwrap();
    assert_eq!(stats.bytes, len as u64);

    let note = decode
        .poll_notification(Instant::now() + T)
        .expect("notification");
    assert_eq!(note.tag, 0xbeef);
    for i in 0..pages {
        let r = (i * 7 % pages) * page;
        assert!(
            pool.read_vec(r..r + page) == data[i * page..(i + 1) * page],
            "{kind:?}: page {i} differs"
        );
    }
    assert!(
        decode.try_notification().is_none(),
        "exactly one notification"
    );

    // And back: staged READ into a second "GPU" buffer, same plan.
    let back = p.copy_engine().alloc_device(len).unwrap();
    p.read(back.span(), &segs).unwrap();
    let mut out = vec![0u8; len];
    p.copy_engine().download(&back, 0, &mut out, T).unwrap();
    assert!(out == data, "{kind:?}: staged read differs");

    // A plan outside the peer's exposed region fails typed, without notification.
    let bad = [Segment {
        local_off: 0,
        remote_off: len as u64 - 10,
        len: 20,
    }];
    let err = p.write(gpu.span(), &bad, Some(1)).unwrap_err();
    assert!(matches!(err, GpuError::ChunkFailed { .. }), "{err}");
    assert!(
        decode
            .poll_notification(Instant::now() + Duration::from_millis(200))
            .is_none()
    );
}

host_backend_tests!(run => staged_gpu_pages_over_loopback, staged_gpu_pages_over_tcp);

#[test]
fn gpu_engine_picks_staged_on_loopback_and_moves_plans() {
    use pagewire_gpudirect::{GpuEngine, GpuMode, GpuPath, GpuTransfer};
    use pagewire_transport::Op;
    use std::sync::Arc;

    let (Some(prefill), Some(decode)) =
        (engine(BackendKind::Loopback), engine(BackendKind::Loopback))
    else {
        return;
    };
    let page = 8192usize;
    let pages = 32usize;
    let len = page * pages;
    let pool = HostBuffer::new(len).unwrap();
    decode.register(&pool, Access::ALL).unwrap();
    let peer = prefill.connect(decode.local_addr()).unwrap();

    let copy: Arc<dyn CopyEngine> = Arc::new(HostCopyEngine::default());
    let cfg = StagingConfig {
        chunk_size: 20_000,
        depth: 2,
        timeout: T,
    };
    let ge = GpuEngine::new(prefill.clone(), copy.clone(), cfg).unwrap();
    let gpu = Arc::new(copy.alloc_device(len).unwrap());
    let data = pattern(len, 42);
    copy.upload(&gpu, 0, &data, T).unwrap();

    // Forcing direct on a transport that reads host memory only is refused.
    let err = ge
        .register_gpu(gpu.clone(), Access::ALL, GpuMode::Direct)
        .unwrap_err();
    assert!(matches!(err, GpuError::ModeUnavailable { .. }), "{err}");
    let info = ge
        .register_gpu(gpu.clone(), Access::ALL, GpuMode::Auto)
        .unwrap();
    assert_eq!(info.decision.path, GpuPath::Staged);
    assert!(
        info.decision.reason.contains("no RDMA device"),
        "{}",
        info.decision.reason
    );

    // Even pages go out, in reverse order, as a (src, dst, len) plan.
    let base = gpu.ptr().0;
    let plan: Vec<(u64, u64, u64)> = (0..pages / 2)
        .map(|k| {
            let i = 2 * k;
            (
                base + (i * page) as u64,
                pool.addr() + ((pages - 1 - i) * page) as u64,
                page as u64,
            )
        })
        .collect();
    let t = ge
        .submit_plan(peer, info.id, Op::Write, &plan, Some(3))
        .unwrap();
    assert!(matches!(t, GpuTransfer::Staged(_)));
    assert_eq!(t.wait(Instant::now() + T).unwrap(), (len / 2) as u64);
    assert_eq!(decode.poll_notification(Instant::now() + T).unwrap().tag, 3);
    for k in 0..pages / 2 {
        let i = 2 * k;
        let r = (pages - 1 - i) * page;
        assert!(
            pool.read_vec(r..r + page) == data[i * page..(i + 1) * page],
            "page {i}"
        );
    }

    // Read the same pages back into the odd slots of the GPU region.
    let back: Vec<(u64, u64, u64)> = plan
        .iter()
        .map(|&(g, r, l)| (r, g + page as u64, l))
        .collect();
    ge.submit_plan(peer, info.id, Op::Read, &back, None)
        .unwrap();
    let mut out = vec![0u8; len];
    copy.download(&gpu, 0, &mut out, T).unwrap();
    for k in 0..pages / 2 {
        let i = 2 * k;
        assert!(
            out[(i + 1) * page..(i + 2) * page] == data[i * page..(i + 1) * page],
            "page {i}"
        );
    }

    // Plans outside the region are refused before any I/O.
    let outside = [(base + len as u64, pool.addr(), 16)];
    assert!(
        ge.submit_plan(peer, info.id, Op::Write, &outside, Some(9))
            .is_err()
    );
    let below = [(base - 1, pool.addr(), 16)];
    assert!(matches!(
        ge.submit_plan(peer, info.id, Op::Write, &below, Some(9)),
        Err(GpuError::OutOfRange { .. })
    ));
    ge.deregister(info.id).unwrap();
    assert!(matches!(
        ge.region(info.id),
        Err(GpuError::UnknownRegion(_))
    ));
}
