//! First run and everyday use, through the binary: perftest's server semantics (no
//! address = a server for one client), errors that name their cause on the side where
//! the command was typed, the TCP header and the JSON records, the help texts, and the
//! main job's memory.
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pagewire() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagewire"))
}

fn run(args: &[&str]) -> Output {
    pagewire().args(args).output().expect("spawn pagewire")
}

fn ok(args: &[&str]) -> Output {
    let out = run(args);
    assert!(
        out.status.success(),
        "pagewire {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(args: &[&str]) -> Child {
    pagewire()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pagewire")
}

fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for a child for at most `secs`, killing it after that.
fn finish(mut c: Child, secs: u64) -> Output {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while c.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            panic!(
                "still running after {secs} s; stderr:\n{}",
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    c.wait_with_output().unwrap()
}

/// Data rows after the column header, split on whitespace.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with(" #bytes"));
    assert!(lines.next().is_some(), "no table in:\n{stdout}");
    lines
        .take_while(|l| !l.starts_with("---"))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// `bench write` with no address is the server, as `ib_write_bw` is: it listens, serves
/// exactly one client, prints the report and exits. Two processes, TCP.
#[test]
fn write_without_address_serves_one_client_then_exits() {
    let port = free_port();
    let p = port.to_string();
    let common = [
        "--transport",
        "tcp",
        "-s",
        "8K",
        "-n",
        "20",
        "--verify",
        "-p",
        &p,
    ];
    let mut sargs = vec!["bench", "write"];
    sargs.extend(common);
    let server = spawn(&sargs);
    wait_listening(port);
    let mut cargs = vec!["bench", "write", "127.0.0.1"];
    cargs.extend(common);
    let client = ok(&cargs);
    assert_eq!(rows(&text(&client.stdout))[0][0], "8192");
    let sout = finish(server, 60);
    let serr = text(&sout.stderr);
    assert!(sout.status.success(), "server: {serr}");
    assert!(serr.contains("waiting for one client"), "{serr}");
    // The server prints the same table, then has exited: nothing listens any more.
    assert_eq!(rows(&text(&sout.stdout))[0][0], "8192");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

/// `--local` runs both ends in this process (and `--server` is still accepted).
#[test]
fn local_runs_both_ends_here() {
    let out = ok(&[
        "bench",
        "read",
        "--local",
        "--transport",
        "tcp",
        "-s",
        "4K",
        "-n",
        "20",
        "--verify",
    ]);
    assert_eq!(rows(&text(&out.stdout))[0][0], "4096");
    assert!(text(&out.stderr).contains("OK"));
    // A server given --server and an address at once is refused by clap.
    let out = run(&["bench", "write", "--server", "127.0.0.1"]);
    assert!(!out.status.success());
}

/// Whether this host can open an RDMA device, according to `pagewire devices --json`,
/// and if not, why.
fn rdma_here() -> (bool, String) {
    let out = ok(&["devices", "--json", "--no-pair-test"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let usable = v["rdma"]["usable"].as_bool().unwrap();
    (
        usable,
        v["rdma"]["reason"].as_str().unwrap_or("").to_string(),
    )
}

/// An RDMA device named with `-d` that does not exist is an error that names it, on
/// every side (never a silent TCP fallback).
#[test]
fn a_device_that_does_not_exist_is_an_error_naming_it() {
    let p = free_port().to_string();
    for args in [
        &["bench", "write", "-d", "nosuchdev", "-p", &p][..],
        &["bench", "write", "-d", "nosuchdev", "127.0.0.1", "-p", &p],
        &["bench", "write", "-d", "nosuchdev", "--local"],
        &["bench", "pages", "-d", "nosuchdev", "--local"],
    ] {
        let out = run(args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains("\"nosuchdev\" not found"), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}: a report was printed");
    }
}

/// `--transport verbs` on a host without a usable RDMA device exits non-zero on both
/// sides, each saying why (the reason `pagewire devices` gives). On a host with one,
/// the same two processes run a real verbs test instead.
#[test]
fn verbs_without_rdma_says_why_on_both_sides() {
    let (usable, reason) = rdma_here();
    let port = free_port();
    let p = port.to_string();
    let common = ["--transport", "verbs", "-s", "4K", "-n", "20", "-p", &p];
    let mut sargs = vec!["bench", "write"];
    sargs.extend(common);
    let mut cargs = vec!["bench", "write", "127.0.0.1"];
    cargs.extend(common);
    if usable {
        let server = spawn(&sargs);
        wait_listening(port);
        ok(&cargs);
        assert!(finish(server, 120).status.success());
        return;
    }
    assert!(!reason.is_empty());
    // The server fails before it listens, the client before it connects: neither
    // depends on the other to learn what is wrong.
    for args in [&sargs, &cargs] {
        let out = run(args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            err.contains("verbs") && err.contains(&reason),
            "{args:?}: {err}"
        );
        assert!(!err.contains("failed to fill whole buffer"), "{err}");
    }
}

/// Flags that mean nothing on the chosen transport are refused, saying so.
#[test]
fn verbs_only_flags_are_refused_on_tcp() {
    for args in [
        &[
            "bench",
            "write",
            "--local",
            "--transport",
            "tcp",
            "-d",
            "mlx5_0",
        ][..],
        &["bench", "lat", "--local", "--transport", "tcp", "-x", "3"],
        &[
            "bench",
            "read",
            "--local",
            "--transport",
            "loopback",
            "--progress",
            "auto",
        ],
        &["bench", "pages", "--local", "--transport", "tcp", "-i", "2"],
    ] {
        let out = run(args);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            err.contains("applies to the verbs transport only"),
            "{args:?}: {err}"
        );
    }
    let out = run(&["bench", "write", "--transport", "loopback"]);
    assert!(text(&out.stderr).contains("--local"));
}

/// Every run of digits replaced by `N`.
fn mask_numbers(l: &str) -> String {
    let mut out = String::new();
    for c in l.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('N') {
                out.push('N');
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The TCP header through the binary: TCP's fields, in this order, and none of the
/// RDMA-only ones (addresses and ports vary and are masked).
#[test]
fn golden_tcp_header_from_the_binary() {
    let out = ok(&[
        "bench",
        "write",
        "--local",
        "--transport",
        "tcp",
        "-s",
        "4K",
        "-n",
        "20",
    ]);
    let stdout = text(&out.stdout);
    let masked: Vec<String> = stdout
        .lines()
        .take_while(|l| !l.starts_with(" #bytes"))
        .map(|l| {
            if l.contains(" address: ") {
                mask_numbers(l)
            } else {
                l.to_string()
            }
        })
        .collect();
    let want = [
        "---------------------------------------------------------------------------------------",
        "                    RDMA_Write BW Test",
        " Transport type  : tcp",
        " Streams         : 1",
        " TX depth        : 20",
        " Ops per batch   : 10",
        " Buffer          : 8192[B] per end",
        " Data ex. method : Ethernet",
        "---------------------------------------------------------------------------------------",
        " local address: N.N.N.N:N data port N, N stream(s)",
        " remote address: N.N.N.N:N data port N, N stream(s)",
        "---------------------------------------------------------------------------------------",
    ];
    assert_eq!(masked, want, "\n{stdout}");
    for rdma_only in ["SRQ", "inline", "CQ Moderation", "Mtu", "GID"] {
        assert!(!stdout.contains(rdma_only), "{rdma_only} in:\n{stdout}");
    }
}

/// `--json`: one record per size, each with the verification result (null without
/// `--verify`), for bandwidth and latency.
#[test]
fn json_records_carry_the_verification_result() {
    for (args, verified) in [
        (
            &[
                "bench",
                "write",
                "--local",
                "--transport",
                "tcp",
                "-s",
                "4K",
                "-n",
                "20",
                "--json",
                "--verify",
            ][..],
            serde_json::Value::Bool(true),
        ),
        (
            &[
                "bench",
                "lat",
                "--local",
                "--transport",
                "tcp",
                "-n",
                "50",
                "--json",
                "--verify",
            ],
            serde_json::Value::Bool(true),
        ),
        (
            &[
                "bench",
                "read",
                "--local",
                "--transport",
                "loopback",
                "-a",
                "-n",
                "5",
                "--json",
            ],
            serde_json::Value::Null,
        ),
    ] {
        let out = ok(args);
        let recs: Vec<serde_json::Value> = text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect();
        assert!(!recs.is_empty());
        for r in &recs {
            assert_eq!(r["verified"], verified, "{args:?}: {r}");
        }
        // JSON mode prints no progress bar and no text on stdout.
        assert!(recs.iter().all(|r| r.is_object()));
    }
}

/// Every command's and subcommand's `--help` ends with examples of the binary.
#[test]
fn every_help_ends_with_examples() {
    for cmd in [
        &[][..],
        &["bench"],
        &["bench", "write"],
        &["bench", "read"],
        &["bench", "lat"],
        &["bench", "pages"],
        &["layout"],
        &["layout", "meta"],
        &["layout", "pd-plan"],
        &["layout", "plan"],
        &["devices"],
    ] {
        let mut args = cmd.to_vec();
        args.push("--help");
        let help = text(&ok(&args).stdout);
        let tail: Vec<&str> = help.lines().rev().take_while(|l| !l.is_empty()).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        assert_eq!(tail.first(), Some(&"Examples:"), "{cmd:?}:\n{help}");
        assert!(
            tail[1..].iter().all(|l| l.starts_with("  pagewire")
                || l.starts_with("  #")
                || l.starts_with("      ")),
            "{cmd:?}:\n{help}"
        );
    }
    // The binary's and bench's help say what no address, an address and --local mean.
    let top = text(&ok(&["--help"]).stdout);
    assert!(top.contains("With no arguments"), "{top}");
    let bench = text(&ok(&["bench", "--help"]).stdout);
    for needle in ["no address", "server's address", "--local"] {
        assert!(bench.contains(needle), "{needle}: {bench}");
    }
}

/// `layout meta --model` gives the same answer as every geometry flag by hand, and a
/// missing flag is named with the others in one line.
#[test]
fn layout_meta_takes_a_model_preset() {
    let by_hand = ok(&[
        "layout",
        "meta",
        "--pool",
        "mha",
        "--layers",
        "32",
        "--heads",
        "8",
        "--head-dim",
        "128",
        "--page-size",
        "16",
        "--dtype-bytes",
        "2",
        "--layout",
        "page_first",
        "--capacity",
        "64",
        "--base",
        "0x1000",
        "--indices",
        "16..48",
        "--json",
    ]);
    let preset = ok(&[
        "layout",
        "meta",
        "--model",
        "llama3-8b",
        "--layout",
        "page_first",
        "--capacity",
        "64",
        "--base",
        "0x1000",
        "--indices",
        "16..48",
        "--json",
    ]);
    assert_eq!(text(&preset.stdout), text(&by_hand.stdout));
    // A flag given with the preset overrides it.
    let fewer = ok(&[
        "layout",
        "meta",
        "--model",
        "llama3-8b",
        "--layers",
        "2",
        "--layout",
        "page_first",
        "--capacity",
        "64",
        "--base",
        "0",
        "--indices",
        "0..16",
    ]);
    assert!(
        text(&fewer.stdout).contains("L=2 P=16 H=8 D=128"),
        "{}",
        text(&fewer.stdout)
    );
    let out = run(&["layout", "meta", "--model", "deepseek-v3"]);
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("--layout, --capacity, --base, --indices are required"),
        "{err}"
    );
}

/// `pagewire devices`: text and JSON agree, and without a device both say why.
#[test]
fn devices_says_why_in_text_and_json() {
    let out = ok(&["devices", "--json", "--no-pair-test"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rdma = &v["rdma"];
    let n = rdma["devices"].as_array().unwrap().len();
    assert_eq!(rdma["available"].as_bool().unwrap(), n > 0, "{rdma}");
    let txt = text(&ok(&["devices", "--no-pair-test"]).stdout);
    if n == 0 {
        let reason = rdma["reason"].as_str().unwrap();
        assert!(
            !reason.is_empty() && rdma["reason_code"].is_string(),
            "{rdma}"
        );
        assert!(txt.contains(&format!("  none: {reason}")), "{txt}");
    } else {
        for d in rdma["devices"].as_array().unwrap() {
            assert!(txt.contains(d["name"].as_str().unwrap()), "{txt}");
        }
    }
}

/// The main job (no arguments) fits a small machine: its own report of its peak
/// resident memory stays under 300 MB.
#[test]
fn main_job_fits_a_small_machine() {
    let out = ok(&[]);
    let err = text(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("peak resident memory"))
        .unwrap_or_else(|| panic!("no memory line in:\n{err}"));
    let mb: f64 = line
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no figure in {line:?}"));
    assert!(mb < 300.0, "{line}");
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("verify                     : OK"),
        "{stdout}"
    );
    assert!(stdout.contains("Pool            : 32 pages"), "{stdout}");
}

/// `pagewire devices --sysfs-root`: the recorded two-socket tree's NICs, GPUs and rail
/// preference per NUMA node and GPU (from the rule, or from the priority list), in text
/// and JSON.
#[test]
fn devices_shows_the_rail_choice_of_a_recorded_tree() {
    let tree = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../transport/tests/data/sysfs-2node"
    );
    let txt = text(&ok(&["devices", "--no-pair-test", "--sysfs-root", tree]).stdout);
    for want in [
        "NUMA nodes: 0, 1",
        "mlx5_3   node 1  400 Gb/s",
        "rxe0     node ?  10 Gb/s       no PCI device",
        "cuda:2 pci 0000:a3:00.0  node 1",
        "cpu:0                    mlx5_0,mlx5_1 / rxe0 / mlx5_3,mlx5_2  (rule)",
        "cuda:0 gpu:0000:03:00.0  mlx5_0 / mlx5_1 / rxe0 / mlx5_3,mlx5_2  (rule)",
        "first tier: same PCIe switch (4 hops)",
    ] {
        assert!(txt.contains(want), "{want:?} not in:\n{txt}");
    }
    let out = ok(&[
        "devices",
        "--json",
        "--no-pair-test",
        "--sysfs-root",
        tree,
        "--rail-priority",
        "cpu:1=mlx5_0",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pref = v["topology"]["preference"].as_array().unwrap();
    let cpu1 = pref.iter().find(|p| p["memory"] == "cpu:1").unwrap();
    assert_eq!(
        cpu1["tiers"],
        serde_json::json!([["mlx5_0"], ["mlx5_1", "mlx5_2", "mlx5_3", "rxe0"]])
    );
    assert_eq!(cpu1["source"], "priority list: cpu:1");
    let gpu1 = pref
        .iter()
        .find(|p| p["memory"] == "gpu:0000:83:00.0")
        .unwrap();
    assert_eq!(gpu1["tiers"][0], serde_json::json!(["mlx5_2"]));
    assert_eq!(gpu1["source"], "rule");
    // A bad list is reported, not a crash.
    let txt = text(&ok(&["devices", "--no-pair-test", "--rail-priority", "cpu:x=a"]).stdout);
    assert!(txt.contains("rail_priority"), "{txt}");
}
