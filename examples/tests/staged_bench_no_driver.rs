//! The staged bench with CUDA turned off by `PAGEWIRE_CUDA=0`, so that this checks the
//! same paths on a GPU machine as on a host without one. One test per process: the
//! probe is cached.

use pagewire_examples::staged_bench::pick_engine;
use pagewire_gpudirect::GpuError;

#[test]
fn the_staged_bench_falls_back_to_the_host_or_refuses() {
    // SAFETY: set before any other thread of this test binary reads the
    // environment (this file holds a single test, and nothing ran before it).
    unsafe { std::env::set_var("PAGEWIRE_CUDA", "0") };
    let (copy, why) = pick_engine(0, false).unwrap();
    assert_eq!(copy.name(), "host");
    assert!(why.contains("CUDA unavailable"), "{why}");
    assert!(matches!(
        pick_engine(0, true),
        Err(GpuError::Unavailable(_))
    ));
}
