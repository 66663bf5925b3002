//! Locators created and dropped many times leave no thread and no file descriptor
//! behind (their runtime, connections and watch go with them). A test binary of its
//! own: it counts this process's threads and descriptors. Needs the `etcd` binary
//! (scripts/setup.sh).

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use pagewire_ha::etcd::Created;
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::{Etcd, EtcdLocator, leader_key};
use pagewire_store::MasterLocator;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// A locator that located the leader and followed one change through its watch.
fn one_round(url: &str, epoch: u64) -> Result<()> {
    let loc = EtcdLocator::connect(url, "r", Instant::now() + Duration::from_secs(3))?;
    let (_, e) = loc.locate(Instant::now() + Duration::from_secs(3))?;
    ensure!(e == epoch);
    let by = Instant::now() + Duration::from_secs(3);
    while !loc.following() {
        ensure!(Instant::now() < by, "the watch did not open");
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

#[test]
fn locators_created_and_dropped_leave_no_thread_or_fd() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let etcd = Etcd::connect(&cluster.url(), Instant::now() + Duration::from_secs(3))?;
    let (lease, _) = etcd.grant(
        Duration::from_secs(60),
        Instant::now() + Duration::from_secs(3),
    )?;
    let Created::Won(epoch) = etcd.create_with_lease(
        &leader_key("r"),
        b"127.0.0.1:1",
        lease,
        Instant::now() + Duration::from_secs(3),
    )?
    else {
        anyhow::bail!("leader key held");
    };
    // One round first: whatever is set up once per process (logging, DNS) is counted
    // in the baseline.
    one_round(&cluster.url(), epoch as u64)?;
    std::thread::sleep(Duration::from_millis(200));
    let (threads, fds) = (count("/proc/self/task"), count("/proc/self/fd"));
    for _ in 0..50 {
        one_round(&cluster.url(), epoch as u64)?;
    }
    // A dropped runtime's threads are joined on drop; sockets close with it.
    let by = Instant::now() + Duration::from_secs(5);
    let (mut t, mut f);
    loop {
        (t, f) = (count("/proc/self/task"), count("/proc/self/fd"));
        if (t <= threads && f <= fds) || Instant::now() > by {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "50 locators created, used and dropped: threads {threads} -> {t}, descriptors {fds} -> {f}"
    );
    ensure!(t <= threads, "threads {threads} -> {t}");
    ensure!(f <= fds, "descriptors {fds} -> {f}");
    Ok(())
}
