//! Replays the minimized `cargo fuzz` corpus of the store's protocol decoder through the
//! fuzz target's own entry points on stable Rust, so every test run checks the inputs that
//! fuzzing found to reach new code (fuzzing itself needs nightly; docs/store.md says how).
//! With `PW_WRITE_SEEDS=DIR` it also writes one valid frame of every kind to DIR, the
//! seeds a fuzzing session starts from.

use pagewire_store::fuzzing;
use pagewire_transport::fuzzing::unhex;

const CORPUS: &str = include_str!("data/store_proto_decode.corpus");

/// The inputs of a corpus file ([`unhex`]'s lines; blank lines and `#` comments skipped).
fn corpus_inputs(text: &str, name: &str) -> Vec<Vec<u8>> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .map(|(i, l)| unhex(l).unwrap_or_else(|| panic!("{name} corpus line {}: not hex", i + 1)))
        .collect()
}

/// One corpus line.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn store_protocol_corpus_decodes_without_panicking() {
    use pagewire_store::proto;
    let mut inputs = 0;
    // Frame kinds whose body decoder accepted at least one seed of this version: a
    // corpus of frames the header check refuses would fuzz the header only.
    let mut reached = std::collections::BTreeMap::<u8, usize>::new();
    for bytes in corpus_inputs(CORPUS, "protocol") {
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

const IPC_CORPUS: &str = include_str!("data/store_ipc_decode.corpus");

/// The dummy-client protocol's corpus (fuzz target `store_ipc_decode`): every input
/// decodes or is refused without panicking, and every frame kind has an input its body
/// decoder accepts. With `PW_WRITE_IPC_CORPUS=FILE` it writes the hand-made corpus the
/// file started from: the valid frames, then each cut short, with a count inflated, and
/// with its kind changed.
#[test]
fn ipc_protocol_corpus_decodes_without_panicking() {
    use pagewire_store::ipc;
    if let Ok(path) = std::env::var("PW_WRITE_IPC_CORPUS") {
        let mut out = String::from(
            "# Corpus of fuzz/fuzz_targets/store_ipc_decode.rs, one input per line, hex (\"-\" = empty).\n\
             # Replayed by tests/fuzz_corpus.rs, which fails unless every frame kind has an input\n\
             # that its body decoder accepts. Seeds: one valid frame of every kind\n\
             # (ipc::sample_frames); below them hostile variants of each (`PW_WRITE_IPC_CORPUS=FILE\n\
             # cargo test -p pagewire-store --test fuzz_corpus ipc` writes this file); scripts/fuzz.sh\n\
             # rewrites the part after the seeds.\n# seeds: the valid frames\n",
        );
        let frames = ipc::sample_frames();
        for f in &frames {
            out += &format!("{}\n", hex(f));
        }
        out += "# minimized: hand-made hostile variants\n-\n";
        for f in &frames {
            out += &format!("{}\n", hex(&f[..f.len() / 2]));
            let mut g = f.clone();
            if g.len() > ipc::HEADER_LEN + 4 {
                g[ipc::HEADER_LEN..ipc::HEADER_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
                out += &format!("{}\n", hex(&g));
            }
            let mut g = f.clone();
            g[6] ^= 0x80;
            out += &format!("{}\n", hex(&g));
            let mut g = f.clone();
            g[8..12].copy_from_slice(&(ipc::MAX_FRAME + 1).to_le_bytes());
            out += &format!("{}\n", hex(&g));
        }
        std::fs::write(path, out).unwrap();
    }
    let mut inputs = 0;
    let mut reached = std::collections::BTreeSet::new();
    for bytes in corpus_inputs(IPC_CORPUS, "ipc") {
        if fuzzing::decode_ipc_frame(&bytes) {
            reached.insert(bytes[6]);
        }
        fuzzing::decode_ipc_bodies(&bytes);
        inputs += 1;
    }
    assert!(inputs >= 50, "only {inputs} ipc corpus inputs");
    let kinds: Vec<u8> = (1..=11).chain([0x81, 0x82, 0x8f]).collect();
    let missing: Vec<u8> = kinds.into_iter().filter(|k| !reached.contains(k)).collect();
    assert!(
        missing.is_empty(),
        "no ipc seed decodes for kinds {missing:02x?}"
    );
}

const OPLOG_CORPUS: &str = include_str!("data/store_oplog_decode.corpus");

/// The op-log's corpus (fuzz target `store_oplog_decode`): every input decodes or is
/// refused without panicking, and inputs that decode cover every record kind. With
/// `PW_WRITE_OPLOG_CORPUS=FILE` it writes the hand-made corpus the file started from:
/// a batch of every record kind, each record alone, then each batch cut short, with its
/// count inflated, its version and its first tag changed.
#[test]
fn oplog_corpus_decodes_without_panicking() {
    use pagewire_store::oplog::{self, Record};
    if let Ok(path) = std::env::var("PW_WRITE_OPLOG_CORPUS") {
        let mut out = String::from(
            "# Corpus of fuzz/fuzz_targets/store_oplog_decode.rs, one input per line, hex (\"-\" = empty).\n\
             # Replayed by tests/fuzz_corpus.rs, which fails unless inputs that decode cover every\n\
             # record kind. Seeds: a batch of every kind and each record alone\n\
             # (oplog::sample_records); below them hostile variants (`PW_WRITE_OPLOG_CORPUS=FILE\n\
             # cargo test -p pagewire-store --test fuzz_corpus oplog` writes this file); scripts/fuzz.sh\n\
             # rewrites the part after the seeds.\n# seeds: valid batches\n",
        );
        let recs = oplog::sample_records();
        let mut batches = vec![oplog::encode(&recs), oplog::encode(&[])];
        batches.extend(recs.iter().map(|r| oplog::encode(std::slice::from_ref(r))));
        for b in &batches {
            out += &format!("{}\n", hex(b));
        }
        out += "# minimized: hand-made hostile variants\n-\n";
        for b in &batches {
            out += &format!("{}\n", hex(&b[..b.len() / 2]));
            let mut g = b.clone();
            g[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
            out += &format!("{}\n", hex(&g));
            let mut g = b.clone();
            g[0] ^= 0x80;
            out += &format!("{}\n", hex(&g));
            if b.len() > 5 {
                let mut g = b.clone();
                g[5] = 0x7f;
                out += &format!("{}\n", hex(&g));
            }
        }
        std::fs::write(path, out).unwrap();
    }
    let mut inputs = 0;
    let mut kinds = std::collections::BTreeSet::new();
    for bytes in corpus_inputs(OPLOG_CORPUS, "oplog") {
        if fuzzing::decode_oplog(&bytes) {
            for r in oplog::decode(&bytes).unwrap() {
                kinds.insert(match r {
                    Record::Mount { .. } => "mount",
                    Record::Remount { .. } => "remount",
                    Record::Unmount { .. } => "unmount",
                    Record::Publish { .. } => "publish",
                    Record::Remove { .. } => "remove",
                });
            }
        }
        inputs += 1;
    }
    assert!(inputs >= 30, "only {inputs} oplog corpus inputs");
    assert_eq!(kinds.len(), 5, "record kinds reached: {kinds:?}");
}
