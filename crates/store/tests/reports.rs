//! One client cannot make the cluster refuse puts (issue 29, item 4). Two attackers, both
//! with the master's trust (the master has no token here): a store client whose engine
//! has the wrong transport token puts at 10 Hz, so every transfer of its fails and it
//! reports the nodes; and a raw connection sends a bare `Report` naming every segment
//! every 100 ms. Meanwhile an honest client's puts must all succeed with their bytes, and
//! the failing client is the one held back. TCP on 127.0.0.1.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Result, ensure};
use common::{Buf, authenticated, client_cfg, fill, frame, reply};
use pagewire_store::proto::{Request, Response};
use pagewire_store::{ClientConfig, Master, MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

const NODE_TOKEN: &str = "nodes-and-honest-clients";
const PAGE: usize = 64 << 10;

fn cfg(m: SocketAddr, token: &str, segment: u64) -> ClientConfig {
    let mut c = client_cfg(&m.to_string(), BackendKind::Tcp, segment);
    c.token = Some(token.into());
    c.local_copy = false;
    c.timeout = Duration::from_secs(5);
    c
}

/// A raw master connection that said Hello and asked for `key`, so that the master named
/// the segments of its replicas to it: its reports of them count as evidence.
fn informed_reporter(m: SocketAddr, key: &str) -> Result<(TcpStream, Vec<u64>)> {
    let mut s = authenticated(m)?;
    let get = Request::Get {
        lease: false,
        keys: vec![key.as_bytes().to_vec()],
    };
    s.write_all(&frame(&get, 2))?;
    let Response::Found(f) = reply(&mut s)? else {
        anyhow::bail!("no Found");
    };
    Ok((s, f.segments.iter().map(|s| s.id).collect()))
}

#[test]
fn one_client_cannot_stop_puts_everywhere() -> Result<()> {
    let mut mc = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    mc.core.heartbeat_ms = 1_000;
    let master = Master::start(mc)?;
    let m = master.local_addr();
    let nodes: Vec<StoreClient> = (0..2)
        .map(|_| StoreClient::connect(cfg(m, NODE_TOKEN, 64 << 20)))
        .collect::<Result<_, _>>()?;
    let honest = StoreClient::connect(cfg(m, NODE_TOKEN, 0))?;
    let mut src = Buf::new(&honest, PAGE);
    let mut dst = Buf::new(&honest, PAGE);
    let two = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    fill("seed", 1, &mut src.mem);
    ensure!(honest.put(&["seed"], &[[src.span(0, PAGE)]], &two)? == [Ok(())]);

    let stop = Arc::new(AtomicBool::new(false));
    // Attacker 1: the wrong transport token, putting at 10 Hz.
    let wrong = StoreClient::connect(cfg(m, "a-wrong-token", 0))?;
    let wrong_codes = Arc::new(AtomicUsize::new(0));
    let t1 = {
        let (stop, codes) = (stop.clone(), wrong_codes.clone());
        let two = two.clone();
        std::thread::spawn(move || -> Result<()> {
            let buf = Buf::new(&wrong, PAGE);
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("wrong-{i}");
                let r = wrong.put(&[key.as_str()], &[[buf.span(0, PAGE)]], &two)?;
                ensure!(r[0].is_err(), "a put with the wrong token succeeded");
                codes.fetch_add(1, Ordering::Relaxed);
                i += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            wrong.close();
            Ok(())
        })
    };
    // Attacker 2: a bare Report of every segment every 100 ms.
    let (mut raw, segs) = informed_reporter(m, "seed")?;
    ensure!(segs.len() == 2, "{segs:?}");
    let reports = Arc::new(AtomicUsize::new(0));
    let t2 = {
        let (stop, reports) = (stop.clone(), reports.clone());
        std::thread::spawn(move || -> Result<()> {
            let mut id = 10;
            while !stop.load(Ordering::Relaxed) {
                let r = Request::Report {
                    suspects: segs.clone(),
                };
                raw.write_all(&frame(&r, id))?;
                reply(&mut raw)?;
                reports.fetch_add(1, Ordering::Relaxed);
                id += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        })
    };
    std::thread::sleep(Duration::from_millis(500));

    // 100 puts of the honest client, each read back.
    let mut failed = Vec::new();
    for i in 0..100 {
        let key = format!("honest-{i}");
        fill(&key, 2, &mut src.mem);
        let r = honest.put(&[key.as_str()], &[[src.span(0, PAGE)]], &two)?;
        if r[0].is_err() {
            failed.push((i, r[0]));
            continue;
        }
        dst.mem.fill(0);
        let g = honest.get(&[key.as_str()], &[[dst.span(0, PAGE)]])?;
        ensure!(g[0] == Ok(PAGE as u64), "get {key}: {:?}", g[0]);
        ensure!(dst.mem == src.mem, "{key}: wrong bytes");
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    t1.join().expect("attacker 1")?;
    t2.join().expect("attacker 2")?;
    eprintln!(
        "honest puts failed: {failed:?}; the wrong-token client put {} times, the raw \
         reporter sent {} reports",
        wrong_codes.load(Ordering::Relaxed),
        reports.load(Ordering::Relaxed)
    );
    ensure!(failed.is_empty(), "honest puts failed: {failed:?}");
    ensure!(
        reports.load(Ordering::Relaxed) >= 10,
        "the reporter did not run"
    );
    // The failing client is the one held back: the master reserves nothing for it, so
    // its revoked puts (space held for `revoke_grace_ms`, 5 s) stop taking space. Held
    // now: the honest objects, the seed, and at most a few of its puts (unchecked, about
    // 50 of them would be, 10 a second for 5 s).
    let used = master.stats().used;
    let honest_bytes = 2 * 101 * PAGE as u64;
    eprintln!(
        "space in use: {} KiB, of which the honest client's {} KiB",
        used >> 10,
        honest_bytes >> 10
    );
    ensure!(
        used <= honest_bytes + 2 * 16 * PAGE as u64,
        "the wrong-token client still reserves space: {used} bytes in use"
    );
    ensure!(master.stats().segments == 2);
    honest.close();
    for n in nodes {
        n.close();
    }
    Ok(())
}
