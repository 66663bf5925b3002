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
    let mut reached = std::collections::BTreeMap::<u8, usize>::new();
    for (i, line) in CORPUS.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bytes = unhex(line).unwrap_or_else(|| panic!("corpus line {}: not hex", i + 1));
        // What the fuzz target does with each input: a whole frame, then every body kind.
        let _ = fuzzing::decode_handshake(&bytes);
        fuzzing::decode_bodies(&bytes);
        if let Some(kind) = fuzzing::frame_kind(&bytes) {
            *reached.entry(kind).or_default() += 1;
        }
        inputs += 1;
    }
    assert!(inputs >= 100, "only {inputs} corpus inputs");
    // A corpus whose frames all stop at the header checks (an old version, say) would fuzz
    // the header only: every kind needs a seed that its body decoder accepts.
    let missing: Vec<u8> = fuzzing::FRAME_KINDS
        .into_iter()
        .filter(|k| !reached.contains_key(k))
        .collect();
    assert!(
        missing.is_empty(),
        "no seed of the current handshake version reaches the body decoder of kinds \
         {missing:?} (reached: {reached:?})"
    );
}

#[test]
fn every_sample_frame_decodes() {
    let frames = fuzzing::sample_frames();
    let kinds: std::collections::BTreeSet<u8> = frames
        .iter()
        .map(|f| fuzzing::frame_kind(f).expect("a sample frame decodes"))
        .collect();
    assert!(
        fuzzing::FRAME_KINDS.iter().all(|k| kinds.contains(k)),
        "{kinds:?}"
    );
    // `PW_WRITE_SEEDS=DIR`: the samples as files, the seeds of a fuzzing session.
    if let Ok(dir) = std::env::var("PW_WRITE_SEEDS") {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, f) in frames.iter().enumerate() {
            std::fs::write(format!("{dir}/seed-{i:02}"), f).unwrap();
        }
    }
}

#[test]
fn unhex_reads_the_corpus_format() {
    assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
    assert_eq!(unhex("-"), Some(vec![]));
    assert_eq!(unhex("abc"), None);
    assert_eq!(unhex("zz"), None);
}
