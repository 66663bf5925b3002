//! Detection answers when CUDA is off: typed "unavailable", never a panic.
//! `PAGEWIRE_CUDA=0` forces that answer even on a GPU machine, so this test
//! checks the same paths everywhere. One test per process: the probe is cached.

use pagewire_gpudirect::{GpuError, GpuPath, Unavailable, detect_path, probe};
use pagewire_transport::{BackendKind, Engine, EngineConfig};

#[test]
fn disabled_cuda_gives_typed_answers_everywhere() {
    // SAFETY: set before any other thread of this test binary reads the
    // environment (this file holds a single test, and nothing ran before it).
    unsafe { std::env::set_var("PAGEWIRE_CUDA", "0") };
    assert_eq!(probe::cuda().unwrap_err(), Unavailable::DisabledByEnv);
    assert!(
        probe::cuda()
            .unwrap_err()
            .to_string()
            .contains("PAGEWIRE_CUDA=0")
    );

    #[cfg(feature = "cuda")]
    {
        let e = pagewire_gpudirect::CudaCopyEngine::new(0).unwrap_err();
        assert!(
            matches!(e, GpuError::Unavailable(Unavailable::DisabledByEnv)),
            "{e}"
        );
    }

    // Path detection through a real engine: staged, with the reason.
    let engine = Engine::new(
        EngineConfig::builder()
            .backend(BackendKind::Loopback)
            .listen("127.0.0.1:0".parse().unwrap())
            .build()
            .unwrap(),
    )
    .unwrap();
    let d = detect_path(&engine, 0);
    assert_eq!(d.path, GpuPath::Staged);
    assert!(d.reason.contains("CUDA unavailable"), "{}", d.reason);
}
