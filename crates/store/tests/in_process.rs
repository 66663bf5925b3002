//! The store in one process: a master, two storage nodes and clients, once per transport
//! backend (loopback and TCP; the multi-process tests in `cluster.rs` cover separate
//! processes and failures). Clients here copy nothing locally unless a test asks, so the
//! bytes really cross the transport.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::{Buf, client_cfg, fill};
use pagewire_store::{Code, Master, MasterConfig, PutOptions, Span, StoreClient};
use pagewire_transport::BackendKind;

struct Cluster {
    master: Master,
    _nodes: Vec<StoreClient>,
}

fn cluster(kind: BackendKind, segment: u64, lease_ms: u64) -> Result<Cluster> {
    let mut cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    cfg.core.lease_ttl_ms = lease_ms;
    let master = Master::start(cfg)?;
    let addr = master.local_addr().to_string();
    let nodes = (0..2)
        .map(|_| StoreClient::connect(client_cfg(&addr, kind, segment)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Cluster {
        master,
        _nodes: nodes,
    })
}

fn client(c: &Cluster, kind: BackendKind) -> Result<StoreClient> {
    let mut cfg = client_cfg(&c.master.local_addr().to_string(), kind, 0);
    cfg.local_copy = false;
    Ok(StoreClient::connect(cfg)?)
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}_{i}_k")).collect()
}

/// 64 objects of two parts each, two replicas, read back by another client into
/// differently split buffers, byte for byte; replicas sit on distinct segments.
fn round_trip(kind: BackendKind) -> Result<()> {
    let c = cluster(kind, 8 << 20, 10_000)?;
    let (a, b) = (client(&c, kind)?, client(&c, kind)?);
    let page = 16 << 10;
    let n = 64;
    let ks = keys("rt", n);
    let mut src = Buf::new(&a, n * page);
    for (i, k) in ks.iter().enumerate() {
        fill(k, 1, &mut src.mem[i * page..(i + 1) * page]);
    }
    let parts: Vec<Vec<Span>> = (0..n)
        .map(|i| {
            vec![
                src.span(i * page, 1000),
                src.span(i * page + 1000, page - 1000),
            ]
        })
        .collect();
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let r = a.put(&ks, &parts, &opts)?;
    ensure!(r.iter().all(|x| x.is_ok()), "{r:?}");
    let q = b.query(&ks, false)?;
    for l in q {
        let l = l.map_err(|c| anyhow::anyhow!("{c}"))?;
        ensure!(l.size == page as u64 && l.replicas.len() == 2);
        ensure!(l.replicas[0].segment != l.replicas[1].segment);
        ensure!(l.replicas[0].endpoint != l.replicas[1].endpoint);
    }
    let dst = Buf::new(&b, n * page + 100);
    let gparts: Vec<Vec<Span>> = (0..n)
        .map(|i| vec![dst.span(i * page, 7), dst.span(i * page + 7, page - 7)])
        .collect();
    let r = b.get(&ks, &gparts)?;
    ensure!(r.iter().all(|x| *x == Ok(page as u64)), "{r:?}");
    ensure!(dst.mem[..n * page] == src.mem[..], "bytes differ");
    ensure!(
        dst.mem[n * page..].iter().all(|&x| x == 0),
        "wrote past the objects"
    );
    let st = a.stats()?;
    ensure!(st.objects == n as u64 && st.segments == 2, "{st:?}");
    Ok(())
}

/// An existing key keeps its first value; errors per key are typed.
fn first_write_wins_and_typed_errors(kind: BackendKind) -> Result<()> {
    let c = cluster(kind, 4 << 20, 10_000)?;
    let (a, b) = (client(&c, kind)?, client(&c, kind)?);
    let mut one = Buf::new(&a, 8192);
    fill("k", 1, &mut one.mem[..4096]);
    fill("k", 2, &mut one.mem[4096..]);
    let r = a.put(&["k"], &[[one.span(0, 4096)]], &PutOptions::default())?;
    ensure!(r == [Ok(())]);
    let r = a.put(&["k"], &[[one.span(4096, 4096)]], &PutOptions::default())?;
    ensure!(r == [Err(Code::AlreadyExists)], "{r:?}");
    let dst = Buf::new(&b, 8192);
    let r = b.get(&["k"], &[[dst.span(0, 8192)]])?;
    ensure!(r == [Ok(4096)]);
    ensure!(dst.mem[..4096] == one.mem[..4096], "first value kept");
    // Missing key, too-small buffer, unregistered buffers, empty and oversized keys.
    let r = b.get(&["nope"], &[[dst.span(0, 4096)]])?;
    ensure!(r == [Err(Code::NotFound)]);
    let r = b.get(&["k"], &[[dst.span(0, 4095)]])?;
    ensure!(r == [Err(Code::InvalidParams)]);
    let stray = [0u8; 64];
    let r = b.get(&["k"], &[[Span::new(stray.as_ptr() as u64, 64)]])?;
    ensure!(r == [Err(Code::InvalidParams)]);
    let r = a.put(
        &["u"],
        &[[Span::new(stray.as_ptr() as u64, 64)]],
        &PutOptions::default(),
    )?;
    ensure!(r == [Err(Code::InvalidParams)]);
    let long = "x".repeat(5000);
    let r = a.put(
        &["", long.as_str()],
        &[[one.span(0, 1)], [one.span(0, 1)]],
        &PutOptions::default(),
    )?;
    ensure!(r == [Err(Code::InvalidKey), Err(Code::InvalidKey)], "{r:?}");
    ensure!(
        a.put(&["a", "b"], &[[one.span(0, 1)]], &PutOptions::default())
            .is_err()
    );
    ensure!(b.exist(&["k", "nope", ""])? == [Ok(true), Ok(false), Err(Code::InvalidKey)]);
    Ok(())
}

/// A read lease blocks removal (one by one, all, or by pattern) until it ends; force
/// removes anyway.
fn leases(kind: BackendKind) -> Result<()> {
    let c = cluster(kind, 4 << 20, 400)?;
    let (a, b) = (client(&c, kind)?, client(&c, kind)?);
    let src = Buf::new(&a, 4096);
    let dst = Buf::new(&b, 4096);
    for k in ["l1", "l2"] {
        ensure!(a.put(&[k], &[[src.span(0, 4096)]], &PutOptions::default())? == [Ok(())]);
    }
    ensure!(
        b.get(&["l1", "l2"], &[[dst.span(0, 4096)], [dst.span(0, 4096)]])? == [Ok(4096), Ok(4096)]
    );
    ensure!(a.remove(&["l1"], false)? == [Code::HasLease]);
    ensure!(a.remove(&["l2"], true)? == [Code::Ok]);
    std::thread::sleep(Duration::from_millis(500));
    ensure!(a.remove(&["l1", "l1"], false)? == [Code::Ok, Code::NotFound]);
    ensure!(a.remove_all(false)? == 0);
    // By pattern: a leased match stays unless forced; a pattern that does not compile (or
    // needs look-around) is refused as a whole.
    for k in ["rx1", "rx2", "rxz"] {
        ensure!(a.put(&[k], &[[src.span(0, 4096)]], &PutOptions::default())? == [Ok(())]);
    }
    ensure!(b.get(&["rx2"], &[[dst.span(0, 4096)]])? == [Ok(4096)]);
    ensure!(a.remove_matching("^rx[0-9]$", false)? == 1);
    ensure!(a.remove_matching("^rx[0-9]$", true)? == 1);
    ensure!(b.exist(&["rx1", "rx2", "rxz"])? == [Ok(false), Ok(false), Ok(true)]);
    for bad in ["((", "rx(?=z)"] {
        let e = a.remove_matching(bad, true).expect_err(bad);
        ensure!(e.code() == Code::InvalidParams, "{bad}: {e}");
    }
    Ok(())
}

/// A replica in the client's own segment is copied locally; another client reads it
/// through the transport.
fn local_copy_path(kind: BackendKind) -> Result<()> {
    let c = cluster(kind, 4 << 20, 10_000)?;
    let addr = c.master.local_addr().to_string();
    let own = StoreClient::connect(client_cfg(&addr, kind, 4 << 20))?;
    let reader = client(&c, kind)?;
    let mut src = Buf::new(&own, 1 << 16);
    fill("mine", 3, &mut src.mem);
    let opts = PutOptions {
        preferred: Some(own.endpoint().to_string()),
        ..PutOptions::default()
    };
    ensure!(own.put(&["mine"], &[[src.span(0, 1 << 16)]], &opts)? == [Ok(())]);
    let l = reader
        .query(&["mine"], false)?
        .remove(0)
        .map_err(|c| anyhow::anyhow!("{c}"))?;
    ensure!(&*l.replicas[0].endpoint == own.endpoint());
    let dst = Buf::new(&reader, 1 << 16);
    ensure!(reader.get(&["mine"], &[[dst.span(0, 1 << 16)]])? == [Ok(1 << 16)]);
    ensure!(dst.mem == src.mem);
    let back = Buf::new(&own, 1 << 16);
    ensure!(own.get(&["mine"], &[[back.span(0, 1 << 16)]])? == [Ok(1 << 16)]);
    ensure!(back.mem == src.mem);
    Ok(())
}

/// With the master gone, calls fail with a typed error within their deadline.
fn master_gone(kind: BackendKind) -> Result<()> {
    let c = cluster(kind, 1 << 20, 10_000)?;
    let mut cfg = client_cfg(&c.master.local_addr().to_string(), kind, 0);
    cfg.timeout = Duration::from_secs(2);
    let a = StoreClient::connect(cfg)?;
    let src = Buf::new(&a, 4096);
    c.master.shutdown();
    let t0 = Instant::now();
    let e = a
        .put(&["x"], &[[src.span(0, 4096)]], &PutOptions::default())
        .unwrap_err();
    ensure!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    ensure!(
        matches!(e.code(), Code::MasterUnavailable | Code::Timeout),
        "{e}"
    );
    // Set-up against no master fails too, within its connect timeout.
    let mut cfg = client_cfg("127.0.0.1:1", kind, 0);
    cfg.connect_timeout = Duration::from_secs(2);
    let t0 = Instant::now();
    ensure!(StoreClient::connect(cfg).is_err());
    ensure!(t0.elapsed() < Duration::from_secs(3));
    Ok(())
}

macro_rules! suite {
    ($m:ident, $kind:expr) => {
        mod $m {
            use super::*;
            #[test]
            fn round_trip() -> Result<()> {
                super::round_trip($kind)
            }
            #[test]
            fn first_write_wins_and_typed_errors() -> Result<()> {
                super::first_write_wins_and_typed_errors($kind)
            }
            #[test]
            fn leases() -> Result<()> {
                super::leases($kind)
            }
            #[test]
            fn local_copy_path() -> Result<()> {
                super::local_copy_path($kind)
            }
            #[test]
            fn master_gone() -> Result<()> {
                super::master_gone($kind)
            }
        }
    };
}

suite!(loopback, BackendKind::Loopback);
suite!(tcp, BackendKind::Tcp);
