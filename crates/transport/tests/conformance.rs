//! The transport conformance suite: written once in `conformance/suite.rs` (the tests any
//! transport passes, also run on the simulated pair by `conformance_sim.rs`) and
//! `conformance/io.rs` (the tests that need real sockets or threads), instantiated per
//! backend by `backend_suite!` (loopback and tcp always; verbs with the `verbs` feature:
//! `#[ignore]`d on a host, run in the soft-RoCE VM with `--include-ignored` and
//! `RDMA_DEVICE`).
//!
//! Every transfer is verified byte for byte on the receiving side, with guard bytes
//! around the target to catch stray writes. `PAGEWIRE_TEST_MAX_BYTES` caps the size
//! sweep (default 64 MiB) for slow links such as rxe under TCG; `PAGEWIRE_TEST_MANY_OPS`
//! sets the op count of the one-huge-batch test (default 200,000; 16,384 with SOFTROCE=1).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::*;
use pagewire_transport::{Access, BackendKind, Batch, Error};

/// What the portable tests see: real engines, threads and the wall clock.
mod env {
    pub use crate::common::*;
    pub use std::thread::{sleep, spawn, yield_now};
    use std::time::{Duration, Instant};

    pub fn now() -> Instant {
        Instant::now()
    }

    pub fn elapsed(t: Instant) -> Duration {
        t.elapsed()
    }
}

#[path = "conformance/suite.rs"]
mod portable;

#[path = "conformance/io.rs"]
mod io;

mod suite {
    pub use crate::io::*;
    pub use crate::portable::*;
}

macro_rules! backend_suite {
    ($name:ident, $kind:expr, $progress:expr, $attrs:tt, [$($test:ident),* $(,)?]) => {
        mod $name {
            use super::*;
            $(suite_test!($attrs, $name, $kind, $progress, $test);)*
        }
    };
}

/// One test of a backend suite, with the suite's attributes (`[#[ignore = ".."]]` or `[]`).
macro_rules! suite_test {
    ([$(#[$m:meta])*], $name:ident, $kind:expr, $progress:expr, $test:ident) => {
        #[test]
        $(#[$m])*
        fn $test() {
            common::PROGRESS.set($progress);
            common::require($kind, stringify!($test));
            let t0 = Instant::now();
            suite::$test($kind).unwrap();
            eprintln!("{}::{} took {:?}", stringify!($name), stringify!($test), t0.elapsed());
        }
    };
}

/// The suite's tests in which every engine that must make progress is inside a call, so
/// they hold under manual progress too, plus `$extra`. Left out of the manual run: tests
/// in which a sender submits and then only the receiver is inside a call
/// (`write_read_sizes`, `notifications_in_order`, `many_small_ops`: a notification that
/// must follow data on other QPs is posted once that data's completions are reaped, by a
/// call on the sender's engine), and the handshake tests, which reap nothing.
macro_rules! caller_driven_suite {
    ($name:ident, $kind:expr, $progress:expr, $attrs:tt $(, $extra:ident)* $(,)?) => {
        backend_suite!($name, $kind, $progress, $attrs, [
            layout_plan_pages,
            notify_only,
            blocked_poster_does_not_starve_others,
            prepared,
            concurrency,
            cancellation,
            deadlines,
            peer_dies_mid_batch,
            permissions,
            registration_and_mr_split,
            redescribe,
            $($extra),*
        ]);
    };
}

macro_rules! all_backends {
    ($($name:ident => $kind:expr, $attrs:tt),* $(,)?) => {
        $(
            caller_driven_suite!(
                $name,
                $kind,
                pagewire_transport::ProgressMode::Auto,
                $attrs,
                write_read_sizes,
                notifications_in_order,
                refused_write_is_not_notified,
                many_small_ops,
                hostile_handshakes,
                handshake_flood,
                token_refusals_are_counted,
                known_on_both_sides_when_connect_returns,
                tokens_and_mismatch,
            );
        )*
    };
}

all_backends!(loopback => BackendKind::Loopback, [], tcp => BackendKind::Tcp, []);
// Verbs needs a device: reported as ignored on a host, run for real in the soft-RoCE VM
// (`scripts/rdma-vm.sh test`, which passes --include-ignored).
#[cfg(feature = "verbs")]
all_backends!(verbs => BackendKind::Verbs, [#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]]);

// Verbs again with manual progress (no completion thread).
#[cfg(feature = "verbs")]
caller_driven_suite!(
    verbs_manual,
    BackendKind::Verbs,
    pagewire_transport::ProgressMode::Manual,
    [#[ignore = "needs an RDMA device: runs in scripts/rdma-vm.sh"]],
);

/// TCP only: a peer *process* killed in the middle of a batch (re-executes this test
/// binary in the peer role).
#[test]
fn tcp_peer_process_killed_mid_batch() {
    peer_process_killed().unwrap();
}

const ROLE_ENV: &str = "PAGEWIRE_TEST_ROLE";

/// The peer role: only active in the child process.
#[test]
fn peer_role_helper() {
    if std::env::var(ROLE_ENV).as_deref() != Ok("tcp-peer") {
        return;
    }
    let e = engine(BackendKind::Tcp).expect("engine");
    let (buf, _) = buffer(
        &e,
        max_bytes().clamp(4 << 20, 64 << 20) as usize,
        Access::ALL,
    )
    .expect("buffer");
    println!("LISTEN {} {:#x}", e.local_addr(), buf.addr());
    std::io::stdout().flush().ok();
    // Serve until killed (bounded, so an orphan cannot live forever).
    std::thread::sleep(Duration::from_secs(120));
}

fn peer_process_killed() -> Result<()> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "peer_role_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, "tcp-peer")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut lines = std::io::BufReader::new(stdout).lines();
    let (addr, base) = loop {
        let line = lines.next().context("child exited before listening")??;
        // libtest prints "test peer_role_helper ... " on the same line first.
        if let Some(rest) = line.split("LISTEN ").nth(1) {
            let mut it = rest.split_whitespace();
            let addr: std::net::SocketAddr = it.next().context("addr")?.parse()?;
            let base =
                u64::from_str_radix(it.next().context("base")?.trim_start_matches("0x"), 16)?;
            break (addr, base);
        }
    };
    let a = engine(BackendKind::Tcp)?;
    let n = max_bytes().clamp(4 << 20, 64 << 20) as usize;
    let (mut src, _) = buffer(&a, n, Access::LOCAL_WRITE)?;
    fill_pattern(&mut src, 8);
    let peer = a.connect(addr)?;
    let chunk = 1 << 20;
    let mk = || chunked_writes(src.addr(), base, n, chunk);
    // One good round first: the child is really serving.
    a.submit(peer, mk())?.wait(secs(30))?;
    let h = a.submit(peer, mk())?;
    child.kill()?;
    let t0 = Instant::now();
    let mut result = h.wait(secs(25));
    while result.is_ok() {
        result = a.submit(peer, mk()).and_then(|h| h.wait(secs(25)));
    }
    let _ = child.wait();
    let e = result.expect_err("loop exits on error");
    ensure!(
        matches!(e, Error::PeerGone { .. } | Error::Timeout { .. }),
        "unexpected error {e:?}"
    );
    ensure!(
        t0.elapsed() < Duration::from_secs(25),
        "took {:?}",
        t0.elapsed()
    );
    ensure!(
        matches!(
            a.submit(peer, Batch::new().write(src.addr(), base, 1)),
            Err(Error::PeerGone { .. })
        ),
        "submit after death must fail fast"
    );
    Ok(())
}

/// TCP only: hostile bytes on the *data* port. A stream with a wrong session is refused;
/// with the right session, requests outside the exposed memory or with a wrong key are
/// refused without touching memory, a malformed header drops the stream, and the real
/// connection keeps working.
#[test]
fn tcp_hostile_data_streams() {
    hostile_data_streams().unwrap();
}

fn hostile_data_streams() -> Result<()> {
    use pagewire_transport::EndpointInfo;
    let (a, b) = (engine(BackendKind::Tcp)?, engine(BackendKind::Tcp)?);
    let (mut src, _) = buffer(&a, 4096, Access::LOCAL_WRITE)?;
    fill_pattern(&mut src, 31);
    let (exp, _) = buffer(&b, 8192, Access::ALL)?;
    let (hidden, _) = buffer(&b, 4096, Access::LOCAL_WRITE)?;
    let (ab, _) = connect(&a, &b)?;
    let EndpointInfo::Tcp {
        data_port, session, ..
    } = a.peer_info(ab)?.remote_endpoint
    else {
        bail!("not a TCP endpoint");
    };
    let rkey = a.peer_regions(ab)?[0].rkey;
    let data = std::net::SocketAddr::from(([127, 0, 0, 1], data_port));
    let hello = |sid: u64| {
        let mut h = Vec::new();
        h.extend_from_slice(b"PGWS");
        h.extend_from_slice(&2u16.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&sid.to_le_bytes());
        h
    };
    let req = |kind: u8, rkey: u32, seq: u64, addr: u64, len: u64| {
        let mut r = vec![0u8; 40];
        r[0] = kind;
        r[4..8].copy_from_slice(&rkey.to_le_bytes());
        r[8..16].copy_from_slice(&seq.to_le_bytes());
        r[16..24].copy_from_slice(&addr.to_le_bytes());
        r[24..32].copy_from_slice(&len.to_le_bytes());
        r
    };
    // Closed = EOF or reset, not a read timeout.
    let closed = |s: &mut TcpStream| -> bool {
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        match s.read(&mut [0u8; 16]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    };
    // Garbage and a wrong session are dropped.
    let mut g = TcpStream::connect(data)?;
    g.write_all(b"GET / HTTP/1.1\r\n\r\n")?;
    ensure!(closed(&mut g), "garbage stream not dropped");
    let mut w = TcpStream::connect(data)?;
    w.write_all(&hello(session ^ 1))?;
    ensure!(closed(&mut w), "wrong session not dropped");
    // The right session: requests are validated one by one.
    let mut s = TcpStream::connect(data)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(&hello(session))?;
    let mut ok = [0u8; 4];
    s.read_exact(&mut ok)?;
    ensure!(&ok == b"OK\0\0");
    let status = |s: &mut TcpStream, r: Vec<u8>, payload: usize| -> Result<u32> {
        s.write_all(&r)?;
        s.write_all(&vec![0xAB; payload])?;
        let mut resp = [0u8; 16];
        s.read_exact(&mut resp)?;
        Ok(u32::from_le_bytes(resp[8..12].try_into()?))
    };
    ensure!(
        status(&mut s, req(1, rkey, 1, hidden.addr(), 16), 16)? == 1,
        "hidden write"
    );
    ensure!(
        status(&mut s, req(1, rkey ^ 0x55, 2, exp.addr(), 16), 16)? == 2,
        "bad key"
    );
    ensure!(
        status(&mut s, req(1, rkey, 3, exp.addr() + 8190, 16), 16)? == 1,
        "write across the end"
    );
    ensure!(
        status(&mut s, req(2, rkey, 4, hidden.addr(), 16), 0)? == 1,
        "hidden read"
    );
    // A burst (more-follows flag) of a refused WRITE and a NOTIFY flagged to ride in it:
    // both acks come at the burst's end, the NOTIFY's skipped (5), and no tag surfaces.
    let mut refused = req(1, rkey, 5, hidden.addr(), 16);
    refused[1] = 1;
    let mut in_burst = req(3, 0, 6, 0, 0);
    in_burst[2] = 1;
    in_burst[32..36].copy_from_slice(&99u32.to_le_bytes());
    s.write_all(&refused)?;
    s.write_all(&[0xAB; 16])?;
    s.write_all(&in_burst)?;
    let mut acks = [0u8; 32];
    s.read_exact(&mut acks)?;
    let st = |r: &[u8]| u32::from_le_bytes(r[8..12].try_into().expect("4 bytes"));
    ensure!(
        (st(&acks[..16]), st(&acks[16..])) == (1, 5),
        "burst statuses {:?}",
        (st(&acks[..16]), st(&acks[16..]))
    );
    ensure!(
        b.try_notification().is_none(),
        "a skipped NOTIFY surfaced its tag"
    );
    // Malformed header: unknown kind, the in-burst flag on a WRITE, an absurd length.
    // Each drops the stream.
    s.write_all(&req(9, rkey, 7, exp.addr(), 16))?;
    ensure!(closed(&mut s), "unknown kind not dropped");
    let mut s1 = TcpStream::connect(data)?;
    s1.write_all(&hello(session))?;
    s1.read_exact(&mut ok)?;
    let mut flagged = req(1, rkey, 8, exp.addr(), 16);
    flagged[2] = 1;
    s1.write_all(&flagged)?;
    ensure!(closed(&mut s1), "in-burst flag on a WRITE not dropped");
    let mut s2 = TcpStream::connect(data)?;
    s2.write_all(&hello(session))?;
    s2.read_exact(&mut ok)?;
    s2.write_all(&req(1, rkey, 6, exp.addr(), u64::MAX))?;
    ensure!(closed(&mut s2), "absurd length not dropped");
    ensure!(
        all_eq(&exp.to_vec(), 0) && all_eq(&hidden.to_vec(), 0),
        "hostile requests wrote memory"
    );
    // The real connection is unaffected.
    a.submit(ab, Batch::new().write(src.addr(), exp.addr(), 4096))?
        .wait(secs(30))?;
    ensure!(exp.read_vec(..4096) == src.to_vec());
    Ok(())
}
