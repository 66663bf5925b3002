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
    spawn_cmd(pagewire(), args)
}

/// As [`spawn`], from a prepared command (environment).
fn spawn_cmd(mut cmd: Command, args: &[&str]) -> (Kill, String) {
    let mut c = cmd
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

/// `pagewire` with `PAGEWIRE_TOKEN` set.
fn with_token(token: &str) -> Command {
    let mut c = pagewire();
    c.env("PAGEWIRE_TOKEN", token);
    c
}

/// The first `127.0.0.1:port` in a process's first line (its listening address).
fn addr_in(line: &str) -> String {
    line.split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .trim_end_matches(',')
        .to_string()
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
    let addr = addr_in(&line);
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

/// `PAGEWIRE_TOKEN` guards a `store serve` node's engine (so its segment), not only its
/// master link: an engine without the token is refused with `TokenMismatch`, one with it
/// connects.
#[test]
fn serve_guards_its_segment_with_pagewire_token() {
    use pagewire_transport::{BackendKind, Engine, EngineConfig, Error, HandshakeError};
    let (_m, line) = spawn_cmd(
        with_token("sesame"),
        &["store", "master", "--listen", "127.0.0.1:0"],
    );
    let addr = addr_in(&line);
    let (_n, line) = spawn_cmd(
        with_token("sesame"),
        &[
            "store",
            "serve",
            "--master",
            &addr,
            "--segment",
            "8M",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
        ],
    );
    let node = line
        .split_whitespace()
        .skip_while(|w| *w != "at")
        .nth(1)
        .unwrap_or_else(|| panic!("no endpoint in {line:?}"))
        .to_string();
    let engine = |token: Option<&str>| {
        let mut b = EngineConfig::builder()
            .backend(BackendKind::Tcp)
            .listen("127.0.0.1:0".parse().unwrap());
        if let Some(t) = token {
            b = b.token(t);
        }
        Engine::new(b.build().unwrap()).unwrap()
    };
    match engine(None).connect(node.as_str()) {
        Err(Error::Handshake(HandshakeError::TokenMismatch)) => {}
        other => panic!("tokenless engine: {other:?}"),
    }
    let ok = engine(Some("sesame"));
    let peer = ok.connect(node.as_str()).expect("the token connects");
    assert!(
        ok.peer_regions(peer)
            .unwrap()
            .iter()
            .any(|r| r.len == 8 << 20)
    );
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

/// `pagewire store client` as a process: a dummy client (this test) with the token puts
/// from its shared memory and a second dummy reads the bytes back; a dummy without the
/// token is refused; a bad `--address` is a usage error.
#[test]
fn store_client_serves_dummies_with_the_token() {
    use pagewire_store::{Code, DummyClient, DummyConfig, PutOptions, SharedBuf, Span, StoreError};
    let (_m, line) = spawn_cmd(
        with_token("sesame"),
        &["store", "master", "--listen", "127.0.0.1:0"],
    );
    let addr = addr_in(&line);
    let dummies = format!("@pagewire-cli-test-{}", std::process::id());
    let (_c, line) = spawn_cmd(
        with_token("sesame"),
        &[
            "store",
            "client",
            "--master",
            &addr,
            "--segment",
            "16M",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
            "--address",
            &dummies,
        ],
    );
    assert!(
        line.starts_with("pagewire store client: 16.0 MiB segment"),
        "{line}"
    );
    assert!(
        line.contains(&format!("dummy clients at {dummies}")),
        "{line}"
    );
    let cfg = |token: Option<&str>| {
        let mut c = DummyConfig::new(dummies.parse().unwrap());
        c.token = token.map(str::to_string);
        c
    };
    match DummyClient::connect(cfg(None)) {
        Err(StoreError::Rejected {
            code: Code::Unauthorized,
            ..
        }) => {}
        other => panic!("tokenless dummy: {other:?}"),
    }
    let a = DummyClient::connect(cfg(Some("sesame"))).expect("dummy a");
    let src = SharedBuf::new(1 << 20).unwrap();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + 3) as u8).collect();
    src.write(0, &data).unwrap();
    a.register_buffer(src.addr(), src.len()).unwrap();
    let r = a
        .put(
            &["k"],
            &[[Span::new(src.addr(), 1 << 20)]],
            &PutOptions::default(),
        )
        .unwrap();
    assert_eq!(r, [Ok(())]);
    let b = DummyClient::connect(cfg(Some("sesame"))).expect("dummy b");
    let dst = SharedBuf::new(1 << 20).unwrap();
    b.register_buffer(dst.addr(), dst.len()).unwrap();
    let r = b.get(&["k"], &[[Span::new(dst.addr(), 1 << 20)]]).unwrap();
    assert_eq!(r, [Ok(1 << 20)]);
    let mut got = vec![0u8; 1 << 20];
    dst.read(0, &mut got).unwrap();
    assert!(got == data, "bytes differ");

    let out = pagewire()
        .args([
            "store",
            "client",
            "--master",
            "127.0.0.1:1",
            "--segment",
            "8M",
            "--address",
            "nonsense",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("server_address"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `store master --ha etcd://...` twice on a real etcd (started here), `store serve` and
/// `bench store` given the etcd address: the benchmark runs against the leader, and
/// again after the leader is killed (the other one leads; the node remounts).
#[test]
fn masters_on_etcd_serve_and_bench_store_through_etcd() {
    let etcd = pagewire_ha::testkit::EtcdCluster::start(1);
    let url = etcd.url();
    let master = |_: u8| {
        spawn(&[
            "store",
            "master",
            "--listen",
            "127.0.0.1:0",
            "--ha",
            &url,
            "--cluster-id",
            "cli",
            "--ha-lease-s",
            "2",
            "--snapshot-every",
            "16",
            "--heartbeat-ms",
            "200",
        ])
    };
    let (a, line) = master(0);
    assert!(line.contains("campaigning through etcd://"), "{line}");
    let a_addr = addr_in(&line);
    let (b, line) = master(1);
    let b_addr = addr_in(&line);
    let (_n, line) = spawn(&[
        "store",
        "serve",
        "--master",
        &url,
        "--cluster-id",
        "cli",
        "--segment",
        "64M",
        "--listen",
        "127.0.0.1:0",
        "--transport",
        "tcp",
    ]);
    assert!(line.contains("64.0 MiB segment"), "{line}");
    let bench = || {
        pagewire()
            .args([
                "bench",
                "store",
                "--master",
                &url,
                "--cluster-id",
                "cli",
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
            ])
            .output()
            .expect("spawn pagewire")
    };
    let out = bench();
    assert!(
        out.status.success(),
        "bench store: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(r["verified"], true);

    let by = std::time::Instant::now() + Duration::from_secs(5);
    let loc = pagewire_ha::EtcdLocator::connect(&url, "cli", by).expect("etcd");
    let (leader, _) = loc.leader(by).expect("etcd").expect("a leader");
    let (mut leading, _standing_by) = if leader == a_addr {
        (a, b)
    } else {
        assert_eq!(leader, b_addr, "the leader key names neither master");
        (b, a)
    };
    let _ = leading.0.kill();
    let _ = leading.0.wait();
    let mut last = String::new();
    for _ in 0..10 {
        let out = bench();
        if out.status.success() {
            let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
            assert_eq!(r["verified"], true);
            return;
        }
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        std::thread::sleep(Duration::from_secs(1));
    }
    panic!("bench store after the master was killed: {last}");
}

/// Two shards through the binary: `store master --shards 2 --shard i` for each shard,
/// `store serve` (its segment carved in two) and `bench store --verify` given the etcd
/// address; a master started with `--shards 3` in the same cluster refuses to start.
#[test]
fn sharded_masters_serve_and_bench_store_through_etcd() {
    let etcd = pagewire_ha::testkit::EtcdCluster::start(1);
    let url = etcd.url();
    let master = |shards: &str, shard: &str| {
        let mut c = pagewire();
        c.args([
            "store",
            "master",
            "--listen",
            "127.0.0.1:0",
            "--ha",
            &url,
            "--cluster-id",
            "sh",
            "--ha-lease-s",
            "2",
            "--shards",
            shards,
            "--shard",
            shard,
        ]);
        c
    };
    let (_m0, line) = spawn_cmd(master("2", "0"), &[]);
    assert!(line.contains("shard 0 of 2"), "{line}");
    let (_m1, line) = spawn_cmd(master("2", "1"), &[]);
    assert!(line.contains("shard 1 of 2"), "{line}");
    let out = master("3", "0").output().expect("spawn pagewire");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("has 2 shard(s)"),
        "{err}"
    );
    let (_n, line) = spawn(&[
        "store",
        "serve",
        "--master",
        &url,
        "--cluster-id",
        "sh",
        "--segment",
        "64M",
        "--listen",
        "127.0.0.1:0",
        "--transport",
        "tcp",
    ]);
    assert!(line.contains("carved into 2 parts"), "{line}");
    let r = json(&[
        "bench",
        "store",
        "--master",
        &url,
        "--cluster-id",
        "sh",
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
        "--clients",
        "2",
        "--verify",
        "--json",
    ]);
    assert_eq!(r["verified"], true);
}
