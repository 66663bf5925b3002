//! The transport's modules import one way only:
//!
//! `types -> util -> error -> buffer, config -> core -> net, host -> contract -> backends -> engine -> sim -> lib`
//!
//! A module may name only modules to its left (and its own submodules). Backends never
//! name each other (only `backends/mod.rs`, which opens them, does). `core` does no I/O:
//! outside its tests it names no `std::net`, `std::thread`, clock read or `unsafe`; `sim`
//! (the simulated pair, behind the `sim` feature) no thread, socket or clock read.
//!
//! This test reads every file under `src/`, drops comments and string literals, and
//! resolves each `crate::` and `super::` path to the top-level module it names. A new
//! top-level module fails the test until it is given a place in [`ORDER`].

use std::path::{Path, PathBuf};

/// Top-level modules by rank; a file may name only modules of a lower rank. Modules of
/// one rank may not name each other.
const ORDER: &[(&str, u32)] = &[
    ("types", 0),
    ("util", 1),
    ("error", 2),
    ("buffer", 3),
    ("config", 3),
    ("core", 4),
    ("net", 5),
    ("host", 5),
    ("contract", 6),
    ("backends", 7),
    ("engine", 8),
    ("sim", 9),
    ("lib", 10),
];

/// What `core` must not name outside its tests (it is `#![forbid(unsafe_code)]` too).
const CORE_FORBIDDEN: &[&str] = &[
    "std::net",
    "std::thread",
    "Instant::now",
    "SystemTime",
    ".elapsed()",
    "unsafe {",
    "unsafe fn",
    "unsafe impl",
];

/// What the simulated world (`sim`, the conformance suite's deterministic pair) must not
/// name: it runs on one thread, opens no socket and takes its time from its own clock.
const SIM_FORBIDDEN: &[&str] = &[
    "std::thread",
    "TcpStream",
    "TcpListener",
    "UdpSocket",
    "Instant::now",
    "SystemTime",
    ".elapsed()",
];

fn rank(module: &str) -> Option<u32> {
    ORDER.iter().find(|(m, _)| *m == module).map(|&(_, r)| r)
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file: `backends/verbs/conn.rs` -> `[backends, verbs, conn]`,
/// `backends/verbs/mod.rs` -> `[backends, verbs]`, `lib.rs` -> `[lib]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut segs: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if segs.last().is_some_and(|s| s == "mod") && segs.len() > 1 {
        segs.pop();
    }
    segs
}

/// The code of a file without comments and string contents, so that prose and messages
/// never count as imports.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'"' {
            out.push('"');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if i < b.len() && b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            out.push('"');
            i += 1;
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A char literal such as '"' or '\n' (lifetimes have no closing quote).
            let end = b[i + 1..].iter().position(|&c| c == b'\'').unwrap_or(0);
            out.push_str("' '");
            i += end + 2;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Every path a file names, resolved to segments from the crate root, with its line.
fn named_paths(code: &str, file_mod: &[String]) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let test_start = code.find("#[cfg(test)]\nmod ").unwrap_or(usize::MAX);
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let boundary = boundary && (i == 0 || bytes[i - 1] != b'$');
        if boundary && rest.starts_with("crate::") {
            let mut segs = Vec::new();
            let mut j = i + "crate::".len();
            // `crate::{a, b::c}`: each name of the group.
            if code[j..].starts_with('{') {
                let close = code[j..].find('}').map_or(code.len(), |k| j + k);
                for part in code[j + 1..close].split(',') {
                    let name = ident_at(part.trim());
                    if !name.is_empty() {
                        out.push((line_of(code, i), vec![name.to_string()]));
                    }
                }
                i = close;
                continue;
            }
            let name = ident_at(&code[j..]);
            segs.push(name.to_string());
            j += name.len();
            if code[j..].starts_with("::") {
                segs.push(ident_at(&code[j + 2..]).to_string());
            }
            out.push((line_of(code, i), segs));
            i = j;
        } else if boundary && rest.starts_with("super::") {
            // Inside a file's inline test module, `super` is the file's own module.
            let mut base: Vec<String> = file_mod.to_vec();
            if i > test_start {
                base.push("tests".into());
            }
            let mut j = i;
            while code[j..].starts_with("super::") {
                base.pop();
                j += "super::".len();
            }
            let name = ident_at(&code[j..]);
            if !name.is_empty() && name != "self" {
                base.push(name.to_string());
            }
            out.push((line_of(code, i), base));
            i = j;
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    out
}

fn line_of(code: &str, at: usize) -> usize {
    code[..at].matches('\n').count() + 1
}

#[test]
fn imports_point_only_to_earlier_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    all.sort();
    assert!(all.len() > 10, "found the sources under {}", src.display());
    let mut wrong = Vec::new();
    for path in &all {
        let rel = path.strip_prefix(&src).unwrap();
        let file_mod = module_path(rel);
        let top = &file_mod[0];
        let Some(own) = rank(top) else {
            wrong.push(format!(
                "{}: module `{top}` has no place in ORDER (tests/layering.rs)",
                rel.display()
            ));
            continue;
        };
        let code = code_only(&std::fs::read_to_string(path).unwrap());
        for (line, target) in named_paths(&code, &file_mod) {
            let Some(first) = target.first() else {
                continue;
            };
            if first == top {
                // Within one module: only backends must keep apart.
                if top == "backends"
                    && file_mod.len() > 1
                    && target.len() > 1
                    && rank(&target[1]).is_none()
                    && target[1] != file_mod[1]
                    && !target[1].is_empty()
                    && is_backend(&target[1])
                {
                    wrong.push(format!(
                        "{}:{line}: backend `{}` names backend `{}`",
                        rel.display(),
                        file_mod[1],
                        target[1]
                    ));
                }
                continue;
            }
            match rank(first) {
                Some(r) if r < own => {}
                Some(_) => wrong.push(format!(
                    "{}:{line}: `{top}` names `{}`, which is not to its left",
                    rel.display(),
                    target.join("::")
                )),
                // `crate::Engine` and the like: the root's re-exports are `lib`, the top.
                None if top != "lib" => wrong.push(format!(
                    "{}:{line}: `{}` goes through the crate root; name the defining module",
                    rel.display(),
                    target.join("::")
                )),
                None => {}
            }
        }
        // A test-only file (`#![cfg(test)]`, like the simulation) may read the clock.
        if top == "core" && !code.trim_start().starts_with("#![cfg(test)]") {
            let body = code.split("#[cfg(test)]\nmod ").next().unwrap_or("");
            for bad in CORE_FORBIDDEN {
                if let Some(at) = body.find(bad) {
                    wrong.push(format!(
                        "{}:{}: core names `{bad}` (it does no I/O and reads no clock)",
                        rel.display(),
                        line_of(body, at)
                    ));
                }
            }
        }
        if top == "sim" {
            for bad in SIM_FORBIDDEN {
                if let Some(at) = code.find(bad) {
                    wrong.push(format!(
                        "{}:{}: sim names `{bad}` (one thread, no socket, simulated time)",
                        rel.display(),
                        line_of(&code, at)
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that point the wrong way:\n{}",
        wrong.join("\n")
    );
}

fn is_backend(name: &str) -> bool {
    matches!(name, "loopback" | "tcp" | "verbs")
}

#[test]
fn the_checker_sees_what_it_must() {
    let file_mod = vec!["backends".to_string(), "tcp".to_string()];
    let code = code_only(
        "use crate::engine::Engine; // crate::types\nlet s = \"crate::lib\";\nuse super::verbs::X;\nuse crate::{types::PeerId, util};\n",
    );
    let got = named_paths(&code, &file_mod);
    let got: Vec<String> = got.iter().map(|(_, p)| p.join("::")).collect();
    assert_eq!(
        got,
        ["engine::Engine", "backends::verbs", "types", "util"],
        "comments and strings are skipped; `super` and groups resolve"
    );
}
