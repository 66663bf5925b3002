//! The `pagewire layout` contract: JSON shapes on the worked examples E1-E5 of
//! `crates/layout/src/worked_examples.rs`, and one-line errors with a non-zero exit.

use std::process::{Command, Output};

use serde_json::Value;

fn pagewire(args: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pagewire"))
        .args(args.split_whitespace())
        .output()
        .expect("run pagewire")
}

/// Run, require success, parse stdout as one JSON object.
fn json(args: &str) -> Value {
    let out = pagewire(args);
    assert!(
        out.status.success(),
        "pagewire {args}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON line: {text}");
    serde_json::from_str(&text).unwrap()
}

/// Run, require failure with exactly one stderr line that contains every `needle`.
fn fails(args: &str, needles: &[&str]) {
    let out = pagewire(args);
    assert!(!out.status.success(), "pagewire {args} should fail");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "one error line: {err:?}");
    assert!(err.starts_with("pagewire: error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "{err:?} should mention {n:?}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout on error");
}

fn nums(v: &Value, key: &str) -> Vec<u64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The keys, sorted (serde_json's `Value` does not keep their order; see
/// `json_keys_are_in_contract_order` for the order).
fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    k.sort();
    k
}

const MHA: &str = "layout meta --pool mha --layers 2 --page-size 4 --capacity 32 --heads 2 \
                   --head-dim 3 --dtype-bytes 2 --base 0x1000 --indices 8..16 --json";
const SPLIT: &str = "layout meta --pool mha-split --layers 2 --page-size 4 --capacity 32 \
                     --heads 2 --head-dim 3 --v-head-dim 2 --dtype-bytes 2 --base 0x1000 \
                     --v-base 0x9000 --indices 8..16 --json";
const MLA: &str = "layout meta --pool mla --layers 2 --page-size 4 --capacity 32 --kv-dim 5 \
                   --dtype-bytes 2 --base 4096 --indices 8,9,10,11,12..16 --json";

#[test]
fn e1_symmetric_page_major() {
    for layout in ["page_first", "page_first_direct", "page_head"] {
        let v = json(&format!("{MHA} --layout {layout}"));
        assert_eq!(keys(&v), ["lens", "ptrs"]);
        assert_eq!(
            nums(&v, "ptrs"),
            [0x10C0, 0x13C0, 0x1120, 0x1420],
            "{layout}"
        );
        assert_eq!(nums(&v, "lens"), [96; 4]);
        let v = json(&format!("{MHA} --layout {layout} --v-base 0x9000"));
        assert_eq!(nums(&v, "ptrs"), [0x10C0, 0x90C0, 0x1120, 0x9120]);
    }
}

#[test]
fn e2_symmetric_layer_first() {
    let v = json(&format!("{MHA} --layout layer_first"));
    assert_eq!(
        nums(&v, "ptrs"),
        [
            0x1060, 0x1360, 0x11E0, 0x14E0, 0x1090, 0x1390, 0x1210, 0x1510
        ]
    );
    assert_eq!(nums(&v, "lens"), [48; 8]);
    let v = json(&format!("{MHA} --layout layer_first --layer 1"));
    assert_eq!(nums(&v, "ptrs"), [0x11E0, 0x14E0]);
    assert_eq!(nums(&v, "lens"), [96, 96]);
}

#[test]
fn e3_asymmetric() {
    for layout in ["page_first", "page_first_direct"] {
        let v = json(&format!("{SPLIT} --layout {layout}"));
        assert_eq!(nums(&v, "ptrs"), [0x10C0, 0x9080, 0x1120, 0x90C0]);
        assert_eq!(nums(&v, "lens"), [96, 64, 96, 64]);
    }
    let v = json(&format!("{SPLIT} --layout layer_first"));
    assert_eq!(
        nums(&v, "ptrs"),
        [
            0x1060, 0x9040, 0x11E0, 0x9140, 0x1090, 0x9060, 0x1210, 0x9160
        ]
    );
    assert_eq!(nums(&v, "lens"), [48, 32, 48, 32, 48, 32, 48, 32]);
    let v = json(&format!("{SPLIT} --layout layer_first --coalesce"));
    assert_eq!(nums(&v, "ptrs"), [0x1060, 0x11E0, 0x9040, 0x9140]);
    assert_eq!(nums(&v, "lens"), [96, 96, 64, 64]);
}

#[test]
fn e4_split_heads() {
    let v = json(&format!("{MHA} --layout page_head --split-heads 2"));
    assert_eq!(
        nums(&v, "ptrs"),
        [
            0x10C0, 0x13C0, 0x10F0, 0x13F0, 0x1120, 0x1420, 0x1150, 0x1450
        ]
    );
    assert_eq!(nums(&v, "lens"), [48; 8]);
    let v = json(&format!("{SPLIT} --layout page_head --split-heads 2"));
    assert_eq!(
        nums(&v, "ptrs"),
        [
            0x10C0, 0x9080, 0x10F0, 0x90A0, 0x1120, 0x90C0, 0x1150, 0x90E0
        ]
    );
    assert_eq!(nums(&v, "lens"), [48, 32, 48, 32, 48, 32, 48, 32]);
}

#[test]
fn e5_mla_and_pd_plan() {
    for layout in ["page_first", "page_first_direct"] {
        let v = json(&format!("{MLA} --layout {layout}"));
        assert_eq!(nums(&v, "ptrs"), [0x10A0, 0x10F0]);
        assert_eq!(nums(&v, "lens"), [80, 80]);
    }
    let v = json(&format!("{MLA} --layout layer_first"));
    assert_eq!(nums(&v, "ptrs"), [0x1050, 0x1190, 0x1078, 0x11B8]);
    assert_eq!(nums(&v, "lens"), [40; 4]);

    let v = json(
        "layout pd-plan --src-k 0x100000,0x110000 --dst-k 0x800000,0x810000 \
         --src-v 0x120000,0x130000 --dst-v 0x820000,0x830000 --k-item-len 48 \
         --v-item-len 32 --src-pages 2..4,5 --dst-pages 10,11,20 --json",
    );
    assert_eq!(keys(&v), ["dsts", "lens", "srcs"]);
    assert_eq!(
        nums(&v, "srcs"),
        [
            0x100060, 0x1000F0, 0x110060, 0x1100F0, 0x120040, 0x1200A0, 0x130040, 0x1300A0
        ]
    );
    assert_eq!(
        nums(&v, "dsts"),
        [
            0x8001E0, 0x8003C0, 0x8101E0, 0x8103C0, 0x820140, 0x820280, 0x830140, 0x830280
        ]
    );
    assert_eq!(nums(&v, "lens"), [96, 48, 96, 48, 64, 32, 64, 32]);

    // MLA: one group; V item length defaults to K's.
    let v = json(
        "layout pd-plan --src-k 0,1000 --dst-k 5000,6000 --k-item-len 10 \
         --src-pages 0,1 --dst-pages 3,4 --json",
    );
    assert_eq!(nums(&v, "srcs"), [0, 1000]);
    assert_eq!(nums(&v, "dsts"), [5030, 6030]);
    assert_eq!(nums(&v, "lens"), [20, 20]);
}

#[test]
fn json_keys_are_in_contract_order() {
    let out = pagewire(&format!("{MHA} --layout page_first"));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("{\"ptrs\":["), "{text}");
    assert!(text.contains("],\"lens\":["), "{text}");
    let out = pagewire(
        "layout pd-plan --src-k 0 --dst-k 0 --k-item-len 8 --src-pages 1 --dst-pages 2 --json",
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text, "{\"srcs\":[8],\"dsts\":[16],\"lens\":[8]}\n");
}

#[test]
fn tables_without_json() {
    let out = pagewire(&MHA.replace(" --json", " --layout page_first"));
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("0x10c0"), "{text}");
    assert!(text.contains("SGLang-exact"), "{text}");
    assert!(text.contains("4 entries, 384 bytes"), "{text}");
    let out = pagewire(&SPLIT.replace(" --json", " --layout page_head"));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("extension"), "{text}");
}

#[test]
fn cross_layout_and_head_split_plans() {
    // page_first host pool to a layer_first pool: every byte moves, runs are token rows.
    let v = json(
        "layout plan --pool mha --layers 2 --page-size 4 --heads 2 --head-dim 3 \
         --dtype-bytes 2 --src-layout page_first --dst-layout layer_first --src-capacity 32 \
         --dst-capacity 64 --src-base 0x1000 --dst-base 0x100000 --src-pages 2,3 \
         --dst-pages 5,6 --json",
    );
    assert_eq!(nums(&v, "lens").iter().sum::<u64>(), 2 * 2 * 96);
    assert_eq!(nums(&v, "srcs")[0], 0x10C0);
    // Same layout: one run per buffer for two adjacent pages.
    let v = json(
        "layout plan --pool mha --layers 2 --page-size 4 --heads 2 --head-dim 3 \
         --dtype-bytes 2 --src-layout page_head --dst-layout page_head --src-capacity 32 \
         --dst-capacity 32 --src-base 0x1000 --dst-base 0x100000 --src-pages 2,3 \
         --dst-pages 5,6 --json",
    );
    assert_eq!(nums(&v, "lens"), [192, 192]);
    // TP 1 -> TP 2, destination rank 1: the second head of each page, 48 bytes per page.
    let v = json(
        "layout plan --pool mha --layers 2 --page-size 4 --src-heads 2 --dst-heads 1 \
         --dst-tp-rank 1 --head-dim 3 --dtype-bytes 2 --src-layout page_head \
         --dst-layout page_head --src-capacity 32 --dst-capacity 32 --src-base 0x1000 \
         --dst-base 0x100000 --src-pages 2 --dst-pages 2 --json",
    );
    assert_eq!(nums(&v, "srcs"), [0x10C0 + 48, 0x13C0 + 48]);
    assert_eq!(nums(&v, "lens"), [48, 48]);
}

#[test]
fn sglang_checks_mode() {
    // SGLang reads only each page's first slot and does not floor it (symmetric pool).
    let v = json(&format!(
        "{} --layout page_first_direct --checks sglang",
        MHA.replace("8..16", "9,0,0,0")
    ));
    assert_eq!(nums(&v, "ptrs"), [0x1000 + 9 * 24, 0x1300 + 9 * 24]);
    // The asymmetric pool floors it to the page start.
    let v = json(&format!(
        "{} --layout page_first_direct --checks sglang",
        SPLIT.replace("8..16", "9,0,0,0")
    ));
    assert_eq!(nums(&v, "ptrs"), [0x10C0, 0x9080]);
    fails(
        &format!("{} --layout page_first", MHA.replace("8..16", "9,0,0,0")),
        &["slot 9", "multiple of the page size"],
    );
    fails(
        &format!("{MHA} --layout page_first --checks loose"),
        &["--checks", "loose"],
    );
}

#[test]
fn errors_are_one_line_and_name_the_problem() {
    let pf = format!("{MHA} --layout page_first");
    fails(
        &pf.replace("8..16", "8..15"),
        &["index count 7", "page size 4"],
    );
    fails(
        &pf.replace("8..16", "8,9,11,10"),
        &["slot 11", "consecutive"],
    );
    fails(
        &pf.replace("8..16", "9..13"),
        &["slot 9", "multiple of the page size"],
    );
    fails(
        &pf.replace("8..16", "32..36"),
        &["slot 32", "capacity of 32"],
    );
    fails(&pf.replace("8..16", "8..x"), &["--indices", "\"x\""]);
    fails(&pf.replace("0x1000", "0xzz"), &["--base", "0xzz"]);
    fails(&pf.replace(" --base 0x1000", ""), &["--base is required"]);
    fails(&pf.replace("--layers 2", "--layers 0"), &["layers", "0"]);
    fails(
        &pf.replace("page_first", "page_middle"),
        &["--layout", "page_middle"],
    );
    fails(
        &pf.replace("--capacity 32", "--capacity 30"),
        &["capacity = 30"],
    );
    fails(
        &format!("{pf} --split-heads 2"),
        &["page_head", "page_first"],
    );
    fails(
        &format!("{MHA} --layout page_head --split-heads 3"),
        &["split factor 3", "2 heads"],
    );
    fails(
        &format!("{MHA} --layout page_head --split-heads 0"),
        &["split factor 0"],
    );
    fails(&format!("{MLA} --layout page_head"), &["page_head", "mla"]);
    fails(
        &format!("{MLA} --layout page_first --heads 2"),
        &["heads = 2", "mla"],
    );
    fails(
        &format!("{pf} --v-head-dim 2"),
        &["v_head_dim = 2", "mha-split"],
    );
    fails(
        &format!(
            "{} --layout page_first",
            SPLIT.replace(" --v-base 0x9000", "")
        ),
        &["V base"],
    );
    fails(
        &pf.replace("0x1000", "0xffffffffffffff00"),
        &["overflow", "K buffer"],
    );
    fails(
        "layout meta --pool mha --layout layer_first --layers 1000000000000 --page-size 1 \
         --capacity 1 --heads 1 --head-dim 1 --dtype-bytes 1 --base 0 --indices 0 --json",
        &["2000000000000 entries", "limit"],
    );
    fails(
        "layout pd-plan --src-k 0x100000,0x110000 --dst-k 0x800000 --k-item-len 48 \
         --src-pages 2 --dst-pages 10 --json",
        &["per-layer base lists", "2 vs 1"],
    );
    fails(
        "layout pd-plan --src-k 0 --dst-k 0 --k-item-len 48 --src-pages 1,2 --dst-pages 1 --json",
        &["page lists", "2 vs 1"],
    );
    fails(
        "layout pd-plan --src-k 0xffffffffffffff00 --dst-k 0 --k-item-len 48 --src-pages 9 \
         --dst-pages 1 --json",
        &["overflow"],
    );
    fails(
        "layout plan --pool mha --layers 2 --page-size 4 --heads 2 --head-dim 3 \
         --dtype-bytes 2 --src-layout page_first --dst-layout layer_first --src-capacity 32 \
         --dst-capacity 32 --src-base 0x1000 --dst-base 0x100000 --src-pages 1,2 \
         --dst-pages 5,5 --json",
        &["destination page 5"],
    );
    fails(
        "layout plan --pool mha --layers 2 --page-size 4 --heads 2 --head-dim 3 \
         --dtype-bytes 2 --src-layout page_first --dst-layout layer_first --src-capacity 32 \
         --dst-capacity 32 --src-base 0x1000 --dst-base 0x100000 --src-pages 1 \
         --dst-pages 8 --json",
        &["page 8", "8 pages"],
    );
    fails(
        "layout pd-plan --src-k 0 --dst-k 0 --src-v 0 --k-item-len 48 --src-pages 1 \
         --dst-pages 1 --json",
        &["--src-v needs --dst-v"],
    );
}

/// Argument errors caught by the parser (unknown flag, missing value) are one line too.
#[test]
fn parser_errors_are_one_line() {
    fails("layout meta --bogus 1", &["--bogus"]);
    fails("layout pd-plan --src-k", &["--src-k"]);
    fails("layout frobnicate", &["frobnicate"]);
}
