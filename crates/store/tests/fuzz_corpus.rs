//! Replays the minimized `cargo fuzz` corpus of the store's protocol decoder through the
//! fuzz target's own entry points on stable Rust, so every test run checks the inputs that
//! fuzzing found to reach new code (fuzzing itself needs nightly; docs/store.md says how).
//! With `PW_WRITE_SEEDS=DIR` it also writes one valid frame of every kind to DIR, the
//! seeds a fuzzing session starts from.

use pagewire_store::fuzzing;
use pagewire_transport::fuzzing::unhex;

const CORPUS: &str = include_str!("data/store_proto_decode.corpus");

#[test]
fn store_protocol_corpus_decodes_without_panicking() {
    use pagewire_store::proto;
    let mut inputs = 0;
    // Frame kinds whose body decoder accepted at least one seed of this version: a
    // corpus of frames the header check refuses would fuzz the header only.
    let mut reached = std::collections::BTreeMap::<u8, usize>::new();
    for (i, line) in CORPUS.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bytes = unhex(line).unwrap_or_else(|| panic!("corpus line {}: not hex", i + 1));
        let _ = fuzzing::decode_frame(&bytes);
        fuzzing::decode_bodies(&bytes);
        if let Ok((h, body)) = proto::split_frame(&bytes, proto::DEFAULT_MAX_FRAME)
            && (proto::decode_request(h.kind, body).is_ok()
                || proto::decode_response(h.kind, body).is_ok())
        {
            *reached.entry(h.kind).or_default() += 1;
        }
        inputs += 1;
    }
    assert!(inputs >= 50, "only {inputs} corpus inputs");
    let kinds: Vec<u8> = (1..=14).chain(0x81..=0x88).chain([0x8f]).collect();
    let missing: Vec<u8> = kinds
        .iter()
        .copied()
        .filter(|k| !reached.contains_key(k))
        .collect();
    assert!(
        missing.is_empty(),
        "no seed of protocol version {} reaches the body decoder of kinds {missing:02x?} (reached: {reached:02x?})",
        proto::VERSION
    );
}

#[test]
fn every_sample_frame_decodes() {
    let frames = fuzzing::sample_frames();
    assert_eq!(frames.len(), 23);
    for (i, f) in frames.iter().enumerate() {
        assert!(fuzzing::decode_frame(f), "sample {i} does not decode");
    }
    if let Ok(dir) = std::env::var("PW_WRITE_SEEDS") {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, f) in frames.iter().enumerate() {
            std::fs::write(format!("{dir}/seed-{i:02}"), f).unwrap();
        }
    }
}
