//! What headers alone cost the master: sockets announcing 16 MiB bodies and then sending
//! nothing, before and after `Hello`. The master runs in this process, so its memory is
//! this process's resident set. One test in this file, so nothing else runs beside it.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{authenticated, client_cfg};
use pagewire_store::proto::{self, Hello, Request};
use pagewire_store::{Master, MasterConfig, StoreClient};
use pagewire_transport::BackendKind;

/// Allowed growth of the resident set while the sockets are held (the old behaviour was
/// 16 MiB per socket: 1 GiB for the first batch).
const BOUND: u64 = 64 << 20;

/// This process's resident set, in bytes.
fn rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("VmRSS in /proc/self/status")?;
    Ok(kb << 10)
}

/// A header of `req`'s kind announcing a 16 MiB body.
fn announcing_16_mib(req: &Request) -> Vec<u8> {
    let mut b = Vec::new();
    req.encode(3, &mut b);
    b.truncate(proto::HEADER_LEN);
    b[12..16].copy_from_slice(&proto::DEFAULT_MAX_FRAME.to_le_bytes());
    b
}

fn hello() -> Request {
    Request::Hello(Hello {
        token: Vec::new(),
        client_id: 0,
        endpoint: "127.0.0.1:9".into(),
    })
}

/// The resident set's growth over `base` once it stops rising for a moment (the master's
/// threads have read the headers by then), at most `within`.
fn settled_growth(base: u64, within: Duration) -> Result<u64> {
    let t0 = Instant::now();
    let mut last = rss()?;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = rss()?;
        if now <= last || t0.elapsed() > within {
            return Ok(now.max(last).saturating_sub(base));
        }
        last = now;
    }
}

#[test]
fn headers_alone_cost_the_master_no_body_memory() -> Result<()> {
    let kind = BackendKind::Loopback;
    let master = Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    })?;
    let addr = master.local_addr();
    let a = addr.to_string();
    let honest = StoreClient::connect(client_cfg(&a, kind, 0))?;
    honest.stats()?;
    let base = rss()?;

    // 64 sockets before Hello: a Hello header announcing 16 MiB, then silence.
    let pre: Vec<TcpStream> = (0..64)
        .map(|_| -> Result<TcpStream> {
            let mut s = TcpStream::connect(addr)?;
            s.write_all(&announcing_16_mib(&hello()))?;
            Ok(s)
        })
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(300));
    let g1 = settled_growth(base, Duration::from_secs(3))?;
    eprintln!(
        "64 pre-Hello sockets announcing 16 MiB: RSS {} MiB -> +{} KiB",
        base >> 20,
        g1 >> 10
    );
    ensure!(
        g1 < BOUND,
        "pre-Hello headers grew the RSS by {} MiB",
        g1 >> 20
    );

    // 128 sockets after Hello (no token is set): a Get header announcing 16 MiB, then
    // silence.
    let post: Vec<TcpStream> = (0..128)
        .map(|_| -> Result<TcpStream> {
            let mut s = authenticated(addr)?;
            s.write_all(&announcing_16_mib(&Request::Get {
                lease: false,
                keys: vec![],
            }))?;
            Ok(s)
        })
        .collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(300));
    let g2 = settled_growth(base, Duration::from_secs(3))?;
    eprintln!(
        "and 128 authenticated sockets announcing 16 MiB: +{} KiB over the base",
        g2 >> 10
    );
    ensure!(g2 < BOUND, "headers grew the RSS by {} MiB", g2 >> 20);

    // Clients are served all along.
    honest.stats()?;
    let t0 = Instant::now();
    let new = StoreClient::connect(client_cfg(&a, kind, 0))?;
    new.stats()?;
    ensure!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    drop((pre, post));
    new.close();
    honest.close();
    Ok(())
}
