//! The master under connection floods from the address its clients use (127.0.0.1):
//! silent sockets held open plus a stream of new ones must not keep a new client out,
//! nor an existing client and a storage node from coming back after a master restart;
//! and one connection cannot buffer more request bytes than `max_buffered` allows.

mod common;

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::{authenticated, client_cfg, frame, reply};
use pagewire_store::proto::{self, Request, Response};
use pagewire_store::{Code, Master, MasterConfig, StoreClient};
use pagewire_transport::BackendKind;

/// Normal set-up time of a client on loopback, with margin for a loaded host.
const SET_UP: Duration = Duration::from_secs(2);

/// `n` connections that never send a byte.
fn silent(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok())
        .collect()
}

/// A thread opening a silent connection every `every` (keeping the latest 64 open) until
/// stopped; it goes on through a master restart (connects then fail for a while).
struct Reconnecting {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<usize>>,
}

impl Reconnecting {
    fn start(addr: SocketAddr, every: Duration) -> Reconnecting {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held = VecDeque::new();
            let mut opened = 0;
            while !s.load(Ordering::Relaxed) {
                if let Ok(c) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                    opened += 1;
                    held.push_back(c);
                    if held.len() > 64 {
                        held.pop_front();
                    }
                }
                std::thread::sleep(every);
            }
            opened
        });
        Reconnecting {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap())
    }
}

impl Drop for Reconnecting {
    fn drop(&mut self) {
        self.stop();
    }
}

fn master_cfg(listen: SocketAddr) -> MasterConfig {
    let mut cfg = MasterConfig {
        listen,
        ..MasterConfig::default()
    };
    // Clients notice a restart within a heartbeat or two.
    cfg.core.heartbeat_ms = 200;
    cfg
}

/// Calls `f` until it succeeds or `limit` passes; the time it took.
fn time_until(limit: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if f() {
            return Some(t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// 64 silent sockets and ~13 new ones a second, all from 127.0.0.1: a new client sets up
/// in its normal time, and after a master restart under the same flood the existing
/// client's calls go through again and the storage node remounts.
#[test]
fn silent_floods_from_the_clients_address_lock_nobody_out() -> Result<()> {
    let kind = BackendKind::Loopback;
    let m1 = Master::start(master_cfg("127.0.0.1:0".parse()?))?;
    let addr = m1.local_addr();
    let a = addr.to_string();
    let node = StoreClient::connect(client_cfg(&a, kind, 1 << 20))?;
    let old = StoreClient::connect(client_cfg(&a, kind, 0))?;
    ensure!(m1.stats().segments == 1);

    let idle = silent(addr, 64);
    ensure!(idle.len() == 64, "{} silent sockets", idle.len());
    let mut flood = Reconnecting::start(addr, Duration::from_millis(75));
    std::thread::sleep(Duration::from_millis(300));

    let t0 = Instant::now();
    let new = StoreClient::connect(client_cfg(&a, kind, 0))?;
    new.stats()?;
    let first = t0.elapsed();
    eprintln!("new client set up and answered under the flood in {first:?}");
    ensure!(first < SET_UP, "set-up took {first:?}");

    // Let the flood run a while before the restart.
    std::thread::sleep(Duration::from_millis(500));

    // Restart on the same port; the flood goes on, and 64 fresh silent sockets wait for
    // the new master before any client comes back.
    drop(idle);
    m1.shutdown();
    drop(m1);
    let m2 = Master::start(master_cfg(addr))?;
    let restarted = Instant::now();
    let idle = silent(addr, 64);
    ensure!(idle.len() == 64, "{} silent sockets", idle.len());

    let back = time_until(Duration::from_secs(10), || old.stats().is_ok());
    eprintln!("existing client's calls go through {back:?} after the restart");
    ensure!(
        back.is_some_and(|d| d < SET_UP),
        "existing client: {back:?}"
    );
    let remounted = time_until(Duration::from_secs(10), || m2.stats().segments == 1)
        .map(|_| restarted.elapsed());
    eprintln!("storage node remounted {remounted:?} after the restart");
    ensure!(remounted.is_some_and(|d| d < SET_UP), "node: {remounted:?}");
    let t0 = Instant::now();
    let another = StoreClient::connect(client_cfg(&a, kind, 0))?;
    another.stats()?;
    let second = t0.elapsed();
    eprintln!("new client set up after the restart in {second:?}");
    ensure!(second < SET_UP, "set-up took {second:?}");

    let opened = flood.stop();
    eprintln!("the flood opened {opened} connections besides 2 x 64 silent ones");
    ensure!(opened >= 8, "the flood did not run ({opened})");
    drop(idle);
    for c in [another, new, old, node] {
        c.close();
    }
    Ok(())
}

/// A `Get` header announcing `len` body bytes.
fn big_header(len: u32) -> Vec<u8> {
    let mut b = frame(
        &Request::Get {
            lease: false,
            keys: vec![],
        },
        7,
    );
    b.truncate(proto::HEADER_LEN);
    b[12..16].copy_from_slice(&len.to_le_bytes());
    b
}

/// With `max_buffered` of 1 MiB, a connection holding all of it in an unfinished frame
/// keeps no client from saying Hello, but another's frame fails with `NoSpace`
/// (answered, then closed); once the first connection goes, the budget is whole again.
#[test]
fn request_bytes_buffered_across_connections_are_capped() -> Result<()> {
    let mut cfg = master_cfg("127.0.0.1:0".parse()?);
    cfg.max_frame = 1 << 20;
    cfg.max_buffered = 1 << 20;
    let master = Master::start(cfg)?;
    let addr = master.local_addr();

    let mut hog = authenticated(addr)?;
    hog.write_all(&big_header(1 << 20))?;
    hog.write_all(&vec![0u8; (1 << 20) - 1])?;
    std::thread::sleep(Duration::from_millis(500));

    let mut late = authenticated(addr)?;
    late.write_all(&big_header(256 << 10))?;
    late.write_all(&vec![0u8; 256 << 10])?;
    match reply(&mut late)? {
        Response::Error { code, .. } => ensure!(code == Code::NoSpace, "{code:?}"),
        other => anyhow::bail!("expected NoSpace, got {other:?}"),
    }
    ensure!(
        matches!(late.read(&mut [0u8; 1]), Ok(0) | Err(_)),
        "not closed"
    );

    // The hog leaves: its bytes go back, and a frame of the whole budget fits.
    drop(hog);
    let keys: Vec<Vec<u8>> = (0..240u32)
        .map(|i| format!("{i:04}").repeat(1000).into_bytes())
        .collect();
    let get = frame(&Request::Get { lease: false, keys }, 9);
    ensure!(get.len() > 900 << 10 && get.len() - proto::HEADER_LEN <= 1 << 20);
    // The hog's thread sees the close within moments; each try is a fresh connection.
    let ok = time_until(Duration::from_secs(5), || {
        let Ok(mut s) = authenticated(addr) else {
            return false;
        };
        s.write_all(&get).is_ok() && matches!(reply(&mut s), Ok(Response::Found(_)))
    });
    ensure!(ok.is_some(), "a full-size frame after the hog left");
    Ok(())
}
