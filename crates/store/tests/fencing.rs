//! Sessions are fenced by the data path: a put reserved under one session of a segment
//! never lands in that segment once a later session hands the same space to other
//! objects.
//!
//! In one process, per backend: writers reserve space, the master restarts on the same
//! port, the storage node mounts its segment again (registering it anew), another client
//! fills the very offsets the old reservations cover and reads them back, and only then
//! do the old writers write. One old writer already holds the node's old description (it
//! wrote before), so its bytes go out under the old key and the node's engine or NIC
//! refuses them; the other connects afresh and refuses to send at all. Every object of
//! the new session must read back with its own bytes afterwards. `cluster.rs` does the
//! same with separate processes stopped by SIGSTOP.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{Buf, client_cfg, fill};
use pagewire_store::{Code, Master, MasterConfig, PutOptions, Span, StoreClient};
use pagewire_transport::BackendKind;

const MIB: usize = 1 << 20;

fn master_on(listen: std::net::SocketAddr) -> Result<Master> {
    let mut cfg = MasterConfig {
        listen,
        ..MasterConfig::default()
    };
    // Short, so that the version before the fence (which held a remounted segment back
    // for one lease) reaches the overwrite within the test's time too.
    cfg.core.lease_ttl_ms = 1_000;
    Ok(Master::start(cfg)?)
}

fn pure_client(addr: &str, kind: BackendKind, local_copy: bool) -> Result<StoreClient> {
    let mut cfg = client_cfg(addr, kind, 0);
    cfg.local_copy = local_copy;
    Ok(StoreClient::connect(cfg)?)
}

fn session_change_fences_old_writers(kind: BackendKind, local_copy: bool) -> Result<()> {
    let seg = 48 * MIB;
    let old_size = 16 * MIB;
    let m1 = master_on("127.0.0.1:0".parse()?)?;
    let listen = m1.local_addr();
    let addr = listen.to_string();
    let node = StoreClient::connect(client_cfg(&addr, kind, seg as u64))?;
    // Writer `warm` has talked to the node before (it holds the node's old keys),
    // writer `cold` has not.
    let warm = pure_client(&addr, kind, local_copy)?;
    let cold = pure_client(&addr, kind, local_copy)?;
    let mut wsrc = Buf::new(&warm, old_size);
    let mut csrc = Buf::new(&cold, old_size);
    fill("warm-up", 1, &mut wsrc.mem[..MIB]);
    let one = PutOptions::default();
    let r = warm.put(&["warm-up"], &[[wsrc.span(0, MIB)]], &one)?;
    ensure!(r == [Ok(())], "warm-up put: {r:?}");
    ensure!(
        warm.remove(&["warm-up"], true)? == [Code::Ok],
        "warm-up removed"
    );
    fill("old-warm", 9, &mut wsrc.mem);
    fill("old-cold", 9, &mut csrc.mem);
    let res_w = warm.reserve(&["old-warm"], &[old_size as u64], &one)?;
    let res_c = cold.reserve(&["old-cold"], &[old_size as u64], &one)?;
    let old: Vec<(u64, u64)> = [&res_w, &res_c]
        .iter()
        .map(|r| {
            let t = &r.items()[0].as_ref().expect("reserved")[0];
            (t.addr, t.addr + old_size as u64)
        })
        .collect();

    // A new session: the master restarts, the node comes back through its heartbeat.
    m1.shutdown();
    drop(m1);
    let m2 = master_on(listen)?;
    let t0 = Instant::now();
    while m2.stats().segments < 1 {
        ensure!(
            t0.elapsed() < Duration::from_secs(15),
            "node did not remount"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // Another client fills the segment's first 32 MiB, which the old reservations cover.
    let b = pure_client(&addr, kind, local_copy)?;
    let n = 32;
    let keys: Vec<String> = (0..n).map(|i| format!("new_{i}")).collect();
    let mut bsrc = Buf::new(&b, n * MIB);
    let bdst = Buf::new(&b, n * MIB);
    for (i, k) in keys.iter().enumerate() {
        fill(k, 2, &mut bsrc.mem[i * MIB..(i + 1) * MIB]);
    }
    let parts: Vec<[Span; 1]> = (0..n).map(|i| [bsrc.span(i * MIB, MIB)]).collect();
    let mut todo: Vec<usize> = (0..n).collect();
    let until = Instant::now() + Duration::from_secs(10);
    while !todo.is_empty() {
        ensure!(Instant::now() < until, "new puts kept failing: {todo:?}");
        let ks: Vec<&String> = todo.iter().map(|&i| &keys[i]).collect();
        let ps: Vec<[Span; 1]> = todo.iter().map(|&i| parts[i]).collect();
        let r = b.put(&ks, &ps, &one)?;
        todo = todo
            .into_iter()
            .zip(r)
            .filter(|(_, r)| r.is_err())
            .map(|(i, _)| i)
            .collect();
        if !todo.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let placed = b.query(&keys, false)?;
    let overlapping = placed
        .iter()
        .filter(|l| {
            let a = l.as_ref().expect("published").replicas[0].addr;
            old.iter().any(|&(s, e)| a < e && s < a + MIB as u64)
        })
        .count();
    ensure!(
        overlapping >= 16,
        "only {overlapping} new objects sit where the old reservations were"
    );

    // The old writers write now: nothing may land.
    let w = res_w.write(&[[wsrc.span(0, old_size)]]);
    let c = res_c.write(&[[csrc.span(0, old_size)]]);
    for (who, r) in [("warm", &w), ("cold", &c)] {
        match r {
            Ok(codes) => ensure!(
                codes[0] == Err(Code::TransferFailed),
                "{who} writer of the old session: {codes:?}"
            ),
            Err(e) => eprintln!("{who} writer of the old session: call failed: {e}"),
        }
    }

    let dparts: Vec<[Span; 1]> = (0..n).map(|i| [bdst.span(i * MIB, MIB)]).collect();
    let got = b.get(&keys, &dparts)?;
    let mut want = vec![0u8; MIB];
    let mut wrong = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        ensure!(got[i] == Ok(MIB as u64), "{k}: {:?}", got[i]);
        fill(k, 2, &mut want);
        if bdst.mem[i * MIB..(i + 1) * MIB] != want[..] {
            wrong.push(k.clone());
        }
    }
    ensure!(
        wrong.is_empty(),
        "{} of {n} objects of the new session read back with other bytes: {wrong:?}",
        wrong.len()
    );
    // The old writers' clients work in the new session.
    let r = warm.put(&["after"], &[[wsrc.span(0, MIB)]], &one)?;
    ensure!(
        r == [Ok(())],
        "put after the session change: {r:?} {:?}",
        m2.stats()
    );
    drop((warm, cold, b, node));
    m2.shutdown();
    Ok(())
}

/// A read lease of the old session reads nothing of the new one: the old key is refused.
fn transfers_go_out_only_under_the_named_key(kind: BackendKind) -> Result<()> {
    let m = master_on("127.0.0.1:0".parse()?)?;
    let addr = m.local_addr().to_string();
    let node = StoreClient::connect(client_cfg(&addr, kind, 8 * MIB as u64))?;
    let c = pure_client(&addr, kind, false)?;
    let mut src = Buf::new(&c, MIB);
    fill("k", 3, &mut src.mem);
    ensure!(c.put(&["k"], &[[src.span(0, MIB)]], &PutOptions::default())? == [Ok(())]);
    let l = c.query(&["k"], false)?.remove(0).ok().context("found")?;
    let seg = node.segment().context("segment")?;
    ensure!(
        l.replicas[0].base == seg.0,
        "{:?} vs {seg:?}",
        l.replicas[0]
    );
    let exposed = node.engine().exposed_regions();
    ensure!(
        exposed
            .iter()
            .any(|r| r.addr == seg.0 && r.rkey == l.replicas[0].rkey),
        "the master names the key the node registered: {exposed:?} vs {:?}",
        l.replicas[0]
    );
    drop((c, node));
    m.shutdown();
    Ok(())
}

macro_rules! suite {
    ($m:ident, $kind:expr $(, $ignore:meta)?) => {
        mod $m {
            use super::*;
            #[test]
            $(#[$ignore])?
            fn session_change_fences_old_writers() -> Result<()> {
                super::session_change_fences_old_writers($kind, false)
            }
            #[test]
            $(#[$ignore])?
            fn session_change_fences_old_local_copies() -> Result<()> {
                super::session_change_fences_old_writers($kind, true)
            }
            #[test]
            $(#[$ignore])?
            fn transfers_go_out_only_under_the_named_key() -> Result<()> {
                super::transfers_go_out_only_under_the_named_key($kind)
            }
        }
    };
}

suite!(loopback, BackendKind::Loopback);
suite!(tcp, BackendKind::Tcp);
suite!(
    verbs,
    BackendKind::Verbs,
    ignore = "needs an RDMA device (RDMA_DEVICE): runs in the soft-RoCE guest"
);
