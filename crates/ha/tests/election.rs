//! Masters of one process on a real etcd: one leads; a leader whose key is deleted by
//! hand steps down within one renewal period and another term begins; a master that
//! shuts down hands over at once. Needs the `etcd` binary (scripts/setup.sh).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::{Etcd, HaConfig, HaMaster, Role, leader_key};
use pagewire_store::MasterConfig;

fn master(etcd: &EtcdCluster) -> Result<HaMaster> {
    let mut ha = HaConfig::new(etcd.url());
    ha.cluster_id = "e".into();
    ha.lease_ttl = Duration::from_secs(2);
    ha.poll = Duration::from_millis(50);
    let cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    Ok(HaMaster::start(cfg, ha)?)
}

/// The one of `ms` that leads within `within`, and its epoch.
fn leader(ms: &[&HaMaster], within: Duration) -> Result<(usize, u64)> {
    let by = Instant::now() + within;
    loop {
        let leading: Vec<(usize, u64)> = ms
            .iter()
            .enumerate()
            .filter_map(|(i, m)| match m.role() {
                Role::Leader(e) => Some((i, e)),
                Role::Standby => None,
            })
            .collect();
        if let [one] = leading.as_slice() {
            return Ok(*one);
        }
        ensure!(Instant::now() < by, "leaders after {within:?}: {leading:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn deleted_key_deposes_and_shutdown_hands_over() -> Result<()> {
    let etcd = EtcdCluster::start(1);
    let a = master(&etcd)?;
    let b = master(&etcd)?;
    let (first, epoch) = leader(&[&a, &b], Duration::from_secs(10))?;

    // The key deleted by hand: the leader sees it at its next renewal (a fifth of the
    // lease, 400 ms) and stands by; a new term begins.
    let client = Etcd::connect(&etcd.url(), Instant::now() + Duration::from_secs(5))?;
    ensure!(client.delete(&leader_key("e"), Instant::now() + Duration::from_secs(2))?);
    let deleted = Instant::now();
    let old = [&a, &b][first];
    while old.role() == Role::Leader(epoch) {
        ensure!(
            deleted.elapsed() < Duration::from_secs(2),
            "the leader kept leading without its key"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let stepped_down = deleted.elapsed();
    let (_, second) = leader(&[&a, &b], Duration::from_secs(5))?;
    ensure!(second > epoch, "epoch {second} after {epoch}");

    // A leader that shuts down revokes its lease: the other leads well within a lease.
    let (i, third) = leader(&[&a, &b], Duration::from_secs(5))?;
    let (going, staying) = if i == 0 { (&a, &b) } else { (&b, &a) };
    let t = Instant::now();
    going.shutdown();
    let e = staying
        .wait_leader(Duration::from_secs(2))
        .context("no handover within 2 s")?;
    ensure!(e > third);
    println!(
        "key deleted: leader stood down after {:.2} s; handover on shutdown {:.2} s",
        stepped_down.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
