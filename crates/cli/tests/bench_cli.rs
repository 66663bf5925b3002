//! `pagewire bench` end to end through the binary: in-process runs on the loopback and
//! TCP backends, a server and a client in two processes (with a foreign connection the
//! server must shrug off), the JSON records, and flag errors.
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pagewire() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pagewire"))
}

fn run(args: &[&str]) -> Output {
    let out = pagewire().args(args).output().expect("spawn pagewire");
    if !out.status.success() {
        panic!(
            "pagewire {args:?} failed\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Data rows of a perftest-style table: the lines after the column header.
fn rows(stdout: &str, header_start: &str) -> Vec<Vec<String>> {
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with(header_start));
    assert!(lines.next().is_some(), "no table header in:\n{stdout}");
    lines
        .take_while(|l| !l.starts_with("---"))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn write_sweep_in_process_on_loopback_and_tcp() {
    for transport in ["loopback", "tcp"] {
        let out = run(&[
            "bench",
            "write",
            "--local",
            "--transport",
            transport,
            "-s",
            "64K",
            "-n",
            "50",
            "--verify",
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(stdout.contains("RDMA_Write BW Test"), "{stdout}");
        assert!(
            stdout.contains(&format!("Transport type  : {transport}")),
            "{stdout}"
        );
        let r = rows(&stdout, " #bytes     #iterations    BW peak[MiB/sec]");
        assert_eq!(r.len(), 1, "{stdout}");
        assert_eq!(r[0][0], "65536");
        assert_eq!(r[0][1], "50");
        let avg: f64 = r[0][3].parse().unwrap();
        assert!(avg > 0.0, "{stdout}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("OK"));
    }
}

#[test]
fn read_bidirectional_and_latency_in_process() {
    let out = run(&[
        "bench",
        "read",
        "--local",
        "--transport",
        "tcp",
        "-s",
        "4096",
        "-n",
        "20",
        "-b",
        "--verify",
        "--report_gbits",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("RDMA_Read Bidirectional BW Test"),
        "{stdout}"
    );
    assert_eq!(
        rows(&stdout, " #bytes     #iterations    BW peak[Gb/sec]").len(),
        1,
        "{stdout}"
    );

    let out = run(&[
        "bench",
        "lat",
        "--local",
        "--transport",
        "loopback",
        "-n",
        "50",
        "--verify",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let r = rows(&stdout, " #bytes #iterations    t_min[usec]");
    assert_eq!(r.len(), 1, "{stdout}");
    assert_eq!(r[0].len(), 9, "{stdout}");
    let (min, typ, max): (f64, f64, f64) = (
        r[0][2].parse().unwrap(),
        r[0][4].parse().unwrap(),
        r[0][3].parse().unwrap(),
    );
    assert!(min <= typ && typ <= max, "{stdout}");

    // Both ping paths (a prepared batch started again, and a new batch per ping) over
    // TCP, with memory polling and verification; and --submit-each only for lat.
    for extra in [&["--poll-memory"][..], &["--submit-each"], &[]] {
        let mut args = vec![
            "bench",
            "lat",
            "--local",
            "--transport",
            "tcp",
            "-n",
            "50",
            "--verify",
        ];
        args.extend(extra);
        let stdout = String::from_utf8(run(&args).stdout).unwrap();
        assert_eq!(
            rows(&stdout, " #bytes #iterations    t_min[usec]").len(),
            1,
            "{extra:?}: {stdout}"
        );
    }
    // --submit-each belongs to lat only: write refuses it by name.
    let out = pagewire()
        .args([
            "bench",
            "write",
            "--local",
            "--transport",
            "tcp",
            "--submit-each",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--submit-each"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--perform_warm_up` (perftest's flag): one unmeasured TX depth before each size, for
/// both directions of a bidirectional run; refused by the latency test.
#[test]
fn perform_warm_up_before_each_size() {
    for test in ["write", "read"] {
        let out = run(&[
            "bench",
            test,
            "--local",
            "--transport",
            "tcp",
            "-a",
            "-n",
            "20",
            "-b",
            "--perform_warm_up",
            "--verify",
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        let r = rows(&stdout, " #bytes     #iterations    BW peak[MiB/sec]");
        assert_eq!(r.len(), 23, "{test}: {stdout}");
        assert!(r.iter().all(|row| row[1] == "20"), "{test}: {stdout}");
    }
    let out = pagewire()
        .args([
            "bench",
            "lat",
            "--local",
            "--transport",
            "tcp",
            "--perform_warm_up",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--perform_warm_up"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn json_gives_one_record_per_size() {
    let out = run(&[
        "bench",
        "write",
        "--local",
        "--transport",
        "loopback",
        "-a",
        "-n",
        "5",
        "--json",
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let recs: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect(l))
        .collect();
    assert_eq!(recs.len(), 23);
    assert_eq!(recs[0]["bytes"], 2);
    assert_eq!(recs[22]["bytes"], 8 << 20);
    assert!(
        recs.iter()
            .all(|r| r["bw_avg_mib_s"].as_f64().unwrap() > 0.0)
    );
}

#[test]
fn server_ignores_foreign_connections_then_serves_a_client() {
    let port = free_port().to_string();
    let server = pagewire()
        .args([
            "bench",
            "write",
            "--server",
            "-p",
            &port,
            "--transport",
            "tcp",
            "-s",
            "8K",
            "-n",
            "20",
            "--verify",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the listener, then send it garbage and a peer with the wrong parameters.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = loop {
        match TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("server never listened: {e}"),
        }
    };
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    drop(s);
    let wrong = pagewire()
        .args([
            "bench",
            "write",
            "127.0.0.1",
            "-p",
            &port,
            "--transport",
            "tcp",
            "-s",
            "8K",
            "-n",
            "30",
            "--verify",
        ])
        .output()
        .unwrap();
    assert!(!wrong.status.success());
    assert!(
        String::from_utf8_lossy(&wrong.stderr).contains("iters"),
        "{}",
        String::from_utf8_lossy(&wrong.stderr)
    );
    // The right client.
    let client = run(&[
        "bench",
        "write",
        "127.0.0.1",
        "-p",
        &port,
        "--transport",
        "tcp",
        "-s",
        "8K",
        "-n",
        "20",
        "--verify",
    ]);
    let stdout = String::from_utf8(client.stdout).unwrap();
    assert_eq!(
        rows(&stdout, " #bytes     #iterations")[0][0],
        "8192",
        "{stdout}"
    );
    let sout = server.wait_with_output().unwrap();
    let serr = String::from_utf8_lossy(&sout.stderr);
    assert!(sout.status.success(), "server failed: {serr}");
    assert!(serr.contains("foreign or malformed"), "{serr}");
    assert!(serr.contains("refused client"), "{serr}");
    // The server prints the same table (the client's result).
    let sstdout = String::from_utf8(sout.stdout).unwrap();
    assert_eq!(
        rows(&sstdout, " #bytes     #iterations")[0][0],
        "8192",
        "{sstdout}"
    );
}

#[test]
fn pages_cross_layout_verified() {
    let out = run(&[
        "bench",
        "pages",
        "--local",
        "--transport",
        "tcp",
        "--model",
        "mimo-v2",
        "--layers",
        "2",
        "--pages",
        "4",
        "--pool-pages",
        "16",
        "--src-layout",
        "layer_first",
        "--dst-layout",
        "page_first_direct",
        "-n",
        "3",
        "--verify",
        "--json",
    ]);
    let rec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rec["verified"], true, "{rec}");
    assert_eq!(rec["pages"], 4);
    assert_eq!(rec["src_layout"], "layer_first");
    assert!(rec["segments_raw"].as_u64().unwrap() >= rec["segments_plan"].as_u64().unwrap());
    for model in ["llama3-8b", "deepseek-v3"] {
        let out = run(&[
            "bench",
            "pages",
            "--local",
            "--transport",
            "loopback",
            "--model",
            model,
            "--layers",
            "2",
            "--pattern",
            "fragmented",
            "--pages",
            "8",
            "-n",
            "2",
            "--verify",
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            stdout.contains("verify                     : OK"),
            "{stdout}"
        );
    }
}

/// `--timeout` bounds each wait, not the run: a run longer than it (many batches of 1024
/// scattered ops here) must finish. The server used to give up waiting for the client's end after one
/// `--timeout`, drop its engine, and the client failed with "peer gone".
#[test]
fn pages_run_may_outlast_timeout() {
    let mut iters = 200u32;
    loop {
        let t0 = Instant::now();
        let n = iters.to_string();
        let out = run(&[
            "bench",
            "pages",
            "--local",
            "--transport",
            "loopback",
            "--model",
            "mimo-v2",
            "--layers",
            "2",
            "--pages",
            "4",
            "--pool-pages",
            "16",
            "--src-layout",
            "page_first",
            "--dst-layout",
            "page_head",
            "-n",
            &n,
            "--timeout",
            "1",
            "--verify",
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            stdout.contains("verify                     : OK"),
            "{stdout}"
        );
        // Grow the run until it really outlasted the timeout.
        if t0.elapsed() > Duration::from_millis(2500) || iters >= 200 << 8 {
            break;
        }
        iters *= 4;
    }
}

/// The same for the perftest-style tests: a `--duration` run longer than `--timeout`.
#[test]
fn write_run_may_outlast_timeout() {
    for transport in ["loopback", "tcp"] {
        let out = run(&[
            "bench",
            "write",
            "--local",
            "--transport",
            transport,
            "-s",
            "4K",
            "--duration",
            "2.5",
            "--timeout",
            "1",
            "--verify",
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(stdout.contains("RDMA_Write BW Test"), "{stdout}");
    }
}

#[test]
fn bad_flags_fail_with_a_message() {
    for args in [
        &["bench", "write", "-s", "0"][..],
        &["bench", "write", "-n", "2"],
        &["bench", "write", "--transport", "pigeon"],
        &["bench", "lat", "-b"],
        &["bench", "write", "--transport", "loopback", "--server"],
        &["bench", "pages", "--layout", "sideways"],
        &["bench", "pages", "--pages", "10", "--pool-pages", "5"],
    ] {
        let out = pagewire().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

/// A client that says a valid hello and then never connects its engine is dropped after
/// the handshake deadline; the server then serves the next client.
#[test]
fn server_survives_a_client_that_vanishes_after_hello() {
    let port = free_port();
    let ps = port.to_string();
    let common = [
        "--transport",
        "tcp",
        "-s",
        "8K",
        "-n",
        "20",
        "--timeout",
        "2",
    ];
    let mut sargs = vec!["bench", "write", "--server", "-p", &ps];
    sargs.extend(common);
    let server = pagewire()
        .args(&sargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = loop {
        match TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("server never listened: {e}"),
        }
    };
    let body = serde_json::json!({
        "msg": "hello", "version": 1, "test": "write",
        "params": {"sizes": [8192], "iters": 20, "duration": null, "margin": 0.0, "qps": 1,
                   "tx_depth": 20, "cq_mod": 10, "bidirectional": false, "verify": false,
                   "transport": "tcp", "poll_memory": false, "submit_each": false}
    })
    .to_string();
    let mut frame = b"PWB1".to_vec();
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body.as_bytes());
    s.write_all(&frame).unwrap();
    // Read the welcome, then vanish without connecting an engine.
    let mut head = [0u8; 8];
    std::io::Read::read_exact(&mut s, &mut head).unwrap();
    assert_eq!(&head[..4], b"PWB1");
    drop(s);
    // The server is still waiting out the vanished client: give the welcome time.
    let mut cargs = vec!["bench", "write", "127.0.0.1", "-p", &ps];
    cargs.extend(&common[..6]);
    cargs.extend(["--timeout", "20"]);
    let client = run(&cargs);
    assert_eq!(
        rows(
            &String::from_utf8(client.stdout).unwrap(),
            " #bytes     #iterations"
        )[0][0],
        "8192"
    );
    let sout = server.wait_with_output().unwrap();
    let serr = String::from_utf8_lossy(&sout.stderr);
    assert!(sout.status.success(), "{serr}");
    assert!(serr.contains("client setup failed"), "{serr}");
}
