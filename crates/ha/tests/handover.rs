//! A leader that shuts down hands over to a standby, and a client's next call reaches
//! the new leader: the time from the old leader's key going (its lease revoked) to the
//! first answered call is printed
//! (with default settings, masters in this process, a real etcd on 127.0.0.1). Needs
//! the `etcd` binary (scripts/setup.sh).

#[path = "../../store/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::{HaConfig, HaMaster, Role, client_config};
use pagewire_store::{MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

use common::{Buf, fill};

const PAGE: usize = 16 << 10;

fn master(etcd: &EtcdCluster) -> Result<HaMaster> {
    let mut ha = HaConfig::new(etcd.url());
    ha.cluster_id = "h".into();
    ha.lease_ttl = Duration::from_secs(2);
    let cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    Ok(HaMaster::start(cfg, ha)?)
}

fn client(etcd: &EtcdCluster, segment: u64) -> Result<StoreClient> {
    let mut c = client_config(&etcd.url(), "h", Instant::now() + Duration::from_secs(5))?;
    c.engine = common::engine(BackendKind::Tcp);
    c.segment_size = segment;
    c.timeout = Duration::from_secs(5);
    Ok(StoreClient::connect(c)?)
}

/// The one of `ms` that leads within 10 s.
fn leading(ms: &[HaMaster]) -> Result<usize> {
    let by = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(i) = ms.iter().position(|m| matches!(m.role(), Role::Leader(_))) {
            return Ok(i);
        }
        ensure!(Instant::now() < by, "no leader within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_client_reaches_the_new_leader_soon_after_a_shutdown() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let mut ms = (0..4)
        .map(|_| master(&cluster))
        .collect::<Result<Vec<_>>>()?;
    leading(&ms)?;
    let node = client(&cluster, 16 << 20)?;
    let c = client(&cluster, 0)?;
    let mut src = Buf::new(&c, PAGE);
    fill("k", 1, &mut src.mem);
    let r = c.put(&["k"], &[[src.span(0, PAGE)]], &PutOptions::default())?;
    ensure!(r == [Ok(())], "{r:?}");
    let mut took = Vec::new();
    for _ in 0..3 {
        let i = leading(&ms)?;
        let going = ms.remove(i);
        std::thread::scope(|s| -> Result<()> {
            s.spawn(|| going.shutdown());
            // The old leader stands by once its lease is revoked (its key gone with it).
            let by = Instant::now() + Duration::from_secs(5);
            while going.role() != Role::Standby {
                ensure!(Instant::now() < by, "the leader did not stand down");
                std::thread::sleep(Duration::from_micros(200));
            }
            let start = Instant::now();
            loop {
                let r = c.exist(&["k"]);
                if matches!(r.as_deref(), Ok([Ok(true)])) {
                    break;
                }
                ensure!(
                    start.elapsed() < Duration::from_secs(10),
                    "no answer within 10 s: {r:?}"
                );
            }
            took.push(start.elapsed());
            Ok(())
        })?;
    }
    let ms_of: Vec<String> = took
        .iter()
        .map(|d| format!("{:.0}", d.as_secs_f64() * 1e3))
        .collect();
    println!(
        "handover on shutdown (default poll settings): leader key revoked -> a client's call \
         answered by the new leader after {} ms",
        ms_of.join(", ")
    );
    node.close();
    c.close();
    ensure!(leading(&ms).is_ok());
    let _ = ms.first().context("masters left")?;
    Ok(())
}
