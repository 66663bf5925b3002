//! `pagewire store master|serve` and `pagewire bench store` through the binary: a master
//! and a storage node as processes, the benchmark against them (JSON, bytes verified),
//! and the in-process form.
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn pagewire() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagewire"))
}

/// Kills the child when dropped.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `pagewire args` and returns it with its first stdout line.
fn spawn(args: &[&str]) -> (Kill, String) {
    let mut c = pagewire()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn pagewire");
    let out = c.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("pagewire {args:?} printed nothing"));
    (Kill(c), line)
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = pagewire().args(args).output().expect("spawn pagewire");
    assert!(
        out.status.success(),
        "pagewire {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON record")
}

#[test]
fn master_serve_and_bench_store_as_processes() {
    let (_m, line) = spawn(&["store", "master", "--listen", "127.0.0.1:0"]);
    let addr = line
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let (_n, line) = spawn(&[
        "store",
        "serve",
        "--master",
        &addr,
        "--segment",
        "64M",
        "--listen",
        "127.0.0.1:0",
        "--transport",
        "tcp",
    ]);
    assert!(line.contains("64.0 MiB segment"), "{line}");
    let r = json(&[
        "bench",
        "store",
        "--master",
        &addr,
        "--transport",
        "tcp",
        "--model",
        "mimo-v2",
        "--layers",
        "2",
        "--pages",
        "8",
        "-n",
        "3",
        "--warmup",
        "1",
        "--verify",
        "--json",
    ]);
    assert_eq!(r["test"], "store");
    assert_eq!(r["verified"], true);
    assert_eq!(r["in_process"], false);
    assert_eq!(r["objects_per_batch"], 16);
    assert_eq!(r["put"]["batches"], 3);
    assert!(r["get"]["mib_s"].as_f64().unwrap() > 0.0);
    assert!(r["put"]["p99_ms"].as_f64().unwrap() >= r["put"]["p50_ms"].as_f64().unwrap());
}

#[test]
fn bench_store_in_process_and_flag_errors() {
    let r = json(&[
        "bench",
        "store",
        "--transport",
        "loopback",
        "--model",
        "deepseek-v3",
        "--layers",
        "2",
        "--pages",
        "4",
        "-n",
        "2",
        "--verify",
        "--json",
    ]);
    assert_eq!(r["in_process"], true);
    assert_eq!(r["objects_per_batch"], 4, "MLA: one object per page");
    let out = pagewire()
        .args([
            "bench",
            "store",
            "--master",
            "127.0.0.1:1",
            "--transport",
            "loopback",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
    let out = pagewire()
        .args([
            "store",
            "serve",
            "--master",
            "127.0.0.1:1",
            "--segment",
            "0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
