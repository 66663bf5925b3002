//! A store segment costs no memory until objects land in it: set-up of a 3200 MB segment
//! (SGLang's default) over TCP grows the process's resident set by well under 100 MB, and
//! the pages an object lands in are touched by the data path. (Over verbs, registration
//! pins the whole segment: that is the device's cost, docs/store.md.)

mod common;

use anyhow::{Result, ensure};
use common::{Buf, client_cfg, fill};
use pagewire_store::{Master, MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

/// This process's resident set, in bytes.
fn rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS"))?;
    Ok(kb << 10)
}

#[test]
fn a_3200_mb_segment_is_resident_only_where_objects_land() -> Result<()> {
    let master = Master::start(MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    })?;
    let addr = master.local_addr().to_string();
    let before = rss()?;
    let mut cfg = client_cfg(&addr, BackendKind::Tcp, 3200 << 20);
    cfg.local_copy = false;
    let node = StoreClient::connect(cfg)?;
    let grown = rss()?.saturating_sub(before);
    eprintln!(
        "3200 MB segment mounted; resident set grew {} MiB",
        grown >> 20
    );
    ensure!(
        grown < 100 << 20,
        "set-up made {} MiB resident",
        grown >> 20
    );

    // 64 MiB of objects land: the node's memory grows by about that, and they read back.
    let client = StoreClient::connect(client_cfg(&addr, BackendKind::Tcp, 0))?;
    let page = 1 << 20;
    let mut src = Buf::new(&client, page);
    let dst = Buf::new(&client, page);
    let before = rss()?;
    for i in 0..64 {
        let key = format!("lazy-{i}");
        fill(&key, 3, &mut src.mem);
        let r = client.put(
            &[key.as_str()],
            &[[src.span(0, page)]],
            &PutOptions::default(),
        )?;
        ensure!(r == [Ok(())], "{key}: {r:?}");
    }
    let landed = rss()?.saturating_sub(before);
    eprintln!(
        "64 MiB of objects landed; resident set grew {} MiB",
        landed >> 20
    );
    ensure!(
        landed >= 60 << 20,
        "objects landed without touching memory? {landed}"
    );
    for i in 0..64 {
        let key = format!("lazy-{i}");
        fill(&key, 3, &mut src.mem);
        let g = client.get(&[key.as_str()], &[[dst.span(0, page)]])?;
        ensure!(g == [Ok(page as u64)] && dst.mem == src.mem, "{key}");
    }
    client.close();
    node.close();
    Ok(())
}
