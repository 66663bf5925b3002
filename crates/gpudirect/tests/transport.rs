//! "GPU" pages staged through the host copy engine over real transport engines
//! (in-process loopback, and TCP where it is available), end to end, byte-exact.

use std::time::{Duration, Instant};

use pagewire_gpudirect::{
    CopyEngine, EngineWire, GpuError, HostCopyEngine, Segment, StagedPipeline, StagingConfig,
};
use pagewire_transport::{Access, BackendKind, Engine, EngineConfig, HostBuffer};

const T: Duration = Duration::from_secs(20);

fn engine(kind: BackendKind) -> Option<Engine> {
    let cfg = EngineConfig::builder()
        .backend(kind)
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .unwrap();
    match Engine::new(cfg) {
        Ok(e) => Some(e),
        Err(e) => {
            eprintln!("SKIP {kind:?}: engine unavailable: {e}");
            None
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

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
            pool[r..r + page] == data[i * page..(i + 1) * page],
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

#[test]
fn staged_gpu_pages_over_loopback() {
    run(BackendKind::Loopback);
}

#[test]
fn staged_gpu_pages_over_tcp() {
    run(BackendKind::Tcp);
}
