//! Replays the minimized `cargo fuzz` corpus of the handshake decoder through the fuzz
//! target's own entry points, on stable Rust, so every test run (CI included) checks the
//! inputs that fuzzing found to reach new code. Fuzzing itself needs nightly:
//! `scripts/fuzz.sh` (run by `scripts/test.sh` when nightly is installed) fuzzes for a
//! bounded time and writes what it found back into this corpus.

use pagewire_transport::fuzzing;
use pagewire_transport::fuzzing::unhex;

const CORPUS: &str = include_str!("data/handshake_decode.corpus");

#[test]
fn handshake_corpus_decodes_without_panicking() {
    let mut inputs = 0;
    for (i, line) in CORPUS.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bytes = unhex(line).unwrap_or_else(|| panic!("corpus line {}: not hex", i + 1));
        // What the fuzz target does with each input: a whole frame, then every body kind.
        let _ = fuzzing::decode_handshake(&bytes);
        fuzzing::decode_bodies(&bytes);
        inputs += 1;
    }
    assert!(inputs >= 100, "only {inputs} corpus inputs");
}

#[test]
fn unhex_reads_the_corpus_format() {
    assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
    assert_eq!(unhex("-"), Some(vec![]));
    assert_eq!(unhex("abc"), None);
    assert_eq!(unhex("zz"), None);
}
