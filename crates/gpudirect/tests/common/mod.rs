//! Helpers shared by the gpudirect integration tests: a data pattern, transport
//! engines per backend, and one test per host backend from a single body.
// Each test binary uses a subset.
#![allow(dead_code, unused_macros, unused_imports)]

use pagewire_gpudirect::Segment;
use pagewire_transport::{BackendKind, Engine, EngineConfig};

/// `len` bytes that differ between seeds at every position and do not repeat within
/// 32 MiB, so a page landing at the wrong offset is caught.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8 ^ (i >> 17) as u8)
        .collect()
}

/// One segment of `len` bytes at offset 0 on both sides.
pub fn whole(len: u64) -> [Segment; 1] {
    [Segment {
        local_off: 0,
        remote_off: 0,
        len,
    }]
}

/// A transport engine of `kind` on localhost, or `None` with a SKIP line where the
/// backend is unavailable here.
pub fn engine(kind: BackendKind) -> Option<Engine> {
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

/// One `#[test]` per host backend, each running `$run(kind)`:
/// `host_backend_tests!(run => test_on_loopback, test_on_tcp);`
macro_rules! host_backend_tests {
    ($run:path => $loopback:ident, $tcp:ident) => {
        #[test]
        fn $loopback() {
            $run(pagewire_transport::BackendKind::Loopback);
        }

        #[test]
        fn $tcp() {
            $run(pagewire_transport::BackendKind::Tcp);
        }
    };
}
pub(crate) use host_backend_tests;
