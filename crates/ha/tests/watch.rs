//! Watches on a real etcd (started by the test on 127.0.0.1): events as they happen, a
//! start from compacted history, a watch whose member is killed or stopped, and the
//! locator and standbys that follow the leader key with them (the time from a change
//! in etcd to whoever follows it seeing it is printed). Needs the `etcd` binary
//! (scripts/setup.sh).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pagewire_ha::etcd::Created;
use pagewire_ha::oplog::{EtcdJournal, JournalConfig, Keys};
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::watch::{EventKind, WatchEvent};
use pagewire_ha::{Etcd, EtcdLocator, HaConfig, HaMaster, Role, WatchSpec, Watched, leader_key};
use pagewire_store::oplog::{Journal, Record};
use pagewire_store::{Authority, MasterConfig, MasterLocator};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(3)
}

/// Events from `w` until `n` arrived (a resync is an error), within 10 s.
fn events(w: &pagewire_ha::Watch, n: usize) -> Result<Vec<WatchEvent>> {
    let by = Instant::now() + Duration::from_secs(10);
    let mut got = Vec::new();
    while got.len() < n {
        match w.next(by) {
            Some(Watched::Events(e)) => got.extend(e),
            Some(Watched::Resync(r)) => bail!("resync at {r} after {got:?}"),
            None => bail!("{} events of {n} within 10 s: {got:?}", got.len()),
        }
    }
    Ok(got)
}

/// The resync a watch from now begins with, within 5 s.
fn opened(w: &pagewire_ha::Watch) -> Result<i64> {
    match w.next(Instant::now() + Duration::from_secs(5)) {
        Some(Watched::Resync(r)) => Ok(r),
        other => bail!("a watch from now began with {other:?}"),
    }
}

/// The endpoints of `etcd` with member `first` first (clients start with it).
fn url_starting_with(etcd: &EtcdCluster, first: usize) -> String {
    let mut hosts: Vec<String> = pagewire_ha::parse_endpoints(&etcd.url()).expect("own url");
    let h = hosts.remove(first);
    hosts.insert(0, h);
    format!("etcd://{}", hosts.join(";"))
}

/// Takes the leader key of `cluster` with `addr` under a lease of 10 s: `(lease, epoch)`.
fn take(etcd: &Etcd, cluster: &str, addr: &str) -> Result<(i64, u64)> {
    let (lease, _) = etcd.grant(Duration::from_secs(10), soon())?;
    match etcd.create_with_lease(&leader_key(cluster), addr.as_bytes(), lease, soon())? {
        Created::Won(rev) => Ok((lease, rev as u64)),
        Created::Held(e) => bail!("leader key held: {e:?}"),
    }
}

#[test]
fn a_watch_delivers_puts_and_deletes_then_resyncs_from_compacted_history() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let etcd = Etcd::connect(&cluster.url(), soon())?;
    let w = etcd.watch(WatchSpec::prefix("p/"));
    let start = opened(&w)?;
    etcd.put_guarded("none", 0, "p/a", b"1".to_vec(), false, soon())?;
    etcd.put_guarded("none", 0, "p/b", b"2".to_vec(), false, soon())?;
    etcd.put_guarded("none", 0, "q", b"x".to_vec(), false, soon())?;
    ensure!(etcd.delete("p/a", soon())?);
    let got = events(&w, 3)?;
    let seen: Vec<(EventKind, &str, &[u8])> = got
        .iter()
        .map(|e| (e.kind, e.key.as_str(), e.value.as_slice()))
        .collect();
    ensure!(
        seen == [
            (EventKind::Put, "p/a", &b"1"[..]),
            (EventKind::Put, "p/b", &b"2"[..]),
            (EventKind::Delete, "p/a", &b""[..]),
        ],
        "{got:?}"
    );
    ensure!(got[0].mod_revision > start && got[0].create_revision == got[0].mod_revision);
    ensure!(
        got.windows(2)
            .all(|p| p[0].mod_revision < p[1].mod_revision)
    );

    // A watch from a revision etcd compacted away: a resync, then later events.
    let (_, now) = etcd.get_at("p/b", soon())?;
    etcd.compact(now, soon())?;
    let old = etcd.watch(WatchSpec::prefix("p/").from(start + 1));
    let r = opened(&old).context("from compacted history")?;
    ensure!(r >= now, "resync at {r}, compacted at {now}");
    etcd.put_guarded("none", 0, "p/c", b"3".to_vec(), false, soon())?;
    let got = events(&old, 1)?;
    ensure!(got[0].key == "p/c" && got[0].value == b"3", "{got:?}");

    // A consumer that lags past the queue gets a resync, not a longer queue.
    let small = etcd.watch(WatchSpec::key("k").capacity(2).without_values());
    opened(&small)?;
    for i in 0..5 {
        etcd.put_guarded("none", 0, "k", vec![i], false, soon())?;
    }
    etcd.put_guarded("none", 0, "end", vec![], false, soon())?;
    std::thread::sleep(Duration::from_millis(300));
    match small.next(soon()) {
        Some(Watched::Resync(_)) => {}
        other => bail!("5 events into a queue of 2: {other:?}"),
    }
    // So does one that lags past the queue's bytes of values; values are kept only
    // under the prefix asked for.
    let bytes = etcd.watch(
        WatchSpec::prefix("v/")
            .values_under("v/kept/")
            .max_value_bytes(2500)
            .capacity(100),
    );
    opened(&bytes)?;
    etcd.put_guarded("none", 0, "v/kept/a", vec![1; 1000], false, soon())?;
    etcd.put_guarded("none", 0, "v/other", vec![2; 5000], false, soon())?;
    let got = events(&bytes, 2)?;
    ensure!(
        got[0].value == [1; 1000] && got[1].value.is_empty(),
        "{got:?}"
    );
    for i in 0..3 {
        etcd.put_guarded("none", 0, "v/kept/b", vec![i; 1000], false, soon())?;
    }
    std::thread::sleep(Duration::from_millis(300));
    match bytes.next(soon()) {
        Some(Watched::Resync(_)) => {}
        other => bail!("3000 bytes of values into a queue of 2500: {other:?}"),
    }
    Ok(())
}

#[test]
fn a_watch_moves_to_another_member_when_its_member_is_killed() -> Result<()> {
    let mut cluster = EtcdCluster::start(3);
    // The watch starts on member 0; the writer starts on member 1.
    let etcd = Etcd::connect(&cluster.url(), soon())?;
    let writer = Etcd::connect(&url_starting_with(&cluster, 1), soon())?;
    let w = etcd.watch(WatchSpec::key("k"));
    opened(&w)?;
    writer.put_guarded("none", 0, "k", b"1".to_vec(), false, soon())?;
    ensure!(events(&w, 1)?[0].value == b"1");

    let raft_leader = cluster.raft_leader() == Some(0);
    cluster.kill(0);
    let killed = Instant::now();
    // Written while the watch has no member: delivered once it resumes elsewhere.
    let by = Instant::now() + Duration::from_secs(10);
    for v in [b"2", b"3"] {
        while writer
            .put_guarded("none", 0, "k", v.to_vec(), false, soon())
            .is_err()
        {
            ensure!(Instant::now() < by, "no write within 10 s of the kill");
        }
    }
    let written = killed.elapsed();
    let got = events(&w, 2)?;
    let took = killed.elapsed();
    let values: Vec<&[u8]> = got.iter().map(|e| e.value.as_slice()).collect();
    ensure!(values == [b"2", b"3"], "{got:?}");
    ensure!(w.opens() >= 2, "opens {}", w.opens());
    writer.put_guarded("none", 0, "k", b"4".to_vec(), false, soon())?;
    ensure!(events(&w, 1)?[0].value == b"4");
    println!(
        "watch: its member killed (raft leader: {raft_leader}); two changes written by {:.2} s \
         after the kill, delivered by {:.2} s (no duplicate), {} streams opened",
        written.as_secs_f64(),
        took.as_secs_f64(),
        w.opens()
    );
    Ok(())
}

#[test]
fn the_locator_follows_the_leader_key_as_it_changes() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let etcd = Etcd::connect(&cluster.url(), soon())?;
    let loc = EtcdLocator::connect(&cluster.url(), "l", soon())?;

    // No leader: locate waits on the watch and answers as soon as one appears.
    let mut lags = Vec::new();
    let (mut lease, mut epoch) = std::thread::scope(|s| -> Result<_> {
        let t = s.spawn(|| {
            let r = loc.locate(Instant::now() + Duration::from_secs(5));
            (r, Instant::now())
        });
        std::thread::sleep(Duration::from_millis(400));
        let (lease, epoch) = take(&etcd, "l", "127.0.0.1:1001")?;
        let put = Instant::now();
        let (r, answered) = t.join().expect("locate panicked");
        ensure!(r? == ("127.0.0.1:1001".into(), epoch));
        lags.push(answered.saturating_duration_since(put));
        Ok((lease, epoch))
    })?;
    ensure!(loc.following(), "the watch is not open after a locate");

    // Changes: the time from etcd's answer to the locator knowing.
    for i in 0..5 {
        let addr = format!("127.0.0.1:{}", 1002 + i);
        // Deleted: a waiter on the old epoch hears of it.
        let (gone, heard) = std::thread::scope(|s| -> Result<_> {
            let t = s.spawn(|| {
                let r = loc.wait_change(epoch, Instant::now() + Duration::from_secs(5));
                (r, Instant::now())
            });
            std::thread::sleep(Duration::from_millis(50));
            etcd.revoke(lease, soon())?;
            let gone = Instant::now();
            let (r, heard) = t.join().expect("wait_change panicked");
            ensure!(r == Some(0), "after the key's deletion: {r:?}");
            Ok((gone, heard))
        })?;
        lags.push(heard.saturating_duration_since(gone));
        // A new leader: locate answers it at once.
        let (l, e) = take(&etcd, "l", &addr)?;
        let put = Instant::now();
        let got = loop {
            let got = loc.locate(Instant::now() + Duration::from_secs(5))?;
            if got.1 == e {
                break got;
            }
            ensure!(put.elapsed() < Duration::from_secs(2), "still {got:?}");
        };
        lags.push(put.elapsed());
        ensure!(got == (addr, e));
        (lease, epoch) = (l, e);
    }
    // Answers from what the watch brought cost no etcd call.
    let t = Instant::now();
    for _ in 0..1000 {
        loc.locate(soon())?;
    }
    let per = t.elapsed() / 1000;
    let max = lags.iter().max().copied().unwrap_or_default();
    let mean = lags.iter().sum::<Duration>() / lags.len() as u32;
    println!(
        "locator: leader key deleted or created -> locator knows: mean {:.1} ms, max {:.1} ms \
         over {} changes (the old locator polled every 50 ms and read etcd at every look); \
         a locate with a leader known: {per:?}",
        mean.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3,
        lags.len()
    );
    ensure!(max < Duration::from_millis(500), "lags {lags:?}");
    Ok(())
}

#[test]
fn the_locator_recovers_when_its_watch_resumes_in_compacted_history() -> Result<()> {
    let cluster = EtcdCluster::start(3);
    // The locator's watch on a member that is not raft leader, so that the others
    // keep serving writes while it is stopped.
    let victim = match cluster.raft_leader() {
        Some(0) => 1,
        _ => 0,
    };
    let loc = EtcdLocator::connect(&url_starting_with(&cluster, victim), "c", soon())?;
    let writer = Etcd::connect(&url_starting_with(&cluster, (victim + 1) % 3), soon())?;
    let (lease, epoch) = take(&writer, "c", "127.0.0.1:2001")?;
    ensure!(loc.locate(soon())?.1 == epoch);
    let by = Instant::now() + Duration::from_secs(5);
    while !loc.following() {
        ensure!(Instant::now() < by, "the locator's watch did not open");
        std::thread::sleep(Duration::from_millis(10));
    }

    // The watch's member stops answering; meanwhile the leader changes and etcd's
    // history is compacted past where the watch stands.
    cluster.pause(victim);
    let paused = Instant::now();
    writer.revoke(lease, soon())?;
    let (_, epoch2) = take(&writer, "c", "127.0.0.1:2002")?;
    for i in 0..10 {
        writer.put_guarded("none", 0, "filler", vec![i], false, soon())?;
    }
    let (_, now) = writer.get_at("filler", soon())?;
    writer.compact(now, soon())?;
    let compacted = Instant::now();

    let got = loop {
        let got = loc.wait_change(epoch, Instant::now() + Duration::from_secs(1));
        if got == Some(epoch2) {
            break got;
        }
        ensure!(
            paused.elapsed() < Duration::from_secs(15),
            "the locator did not follow within 15 s: {got:?}"
        );
    };
    let took = compacted.elapsed();
    ensure!(got == Some(epoch2));
    ensure!(loc.locate(soon())? == ("127.0.0.1:2002".into(), epoch2));
    let opens = loc.watch_opens();
    cluster.resume(victim);
    println!(
        "locator: watch member stopped, leader changed and history compacted; the new leader \
         known {:.2} s after the compaction ({opens} watch streams opened)",
        took.as_secs_f64()
    );
    ensure!(opens >= 2, "the watch never moved: {opens}");
    Ok(())
}

fn standby_master(etcd: &EtcdCluster, cluster: &str) -> Result<HaMaster> {
    let mut ha = HaConfig::new(etcd.url());
    ha.cluster_id = cluster.into();
    ha.lease_ttl = Duration::from_secs(2);
    // Long periods: only the watch can explain a quick reaction.
    ha.poll = Duration::from_secs(3);
    ha.recheck = Duration::from_secs(10);
    let cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    Ok(HaMaster::start(cfg, ha)?)
}

#[test]
fn a_standby_campaigns_when_the_key_goes_and_applies_entries_as_they_come() -> Result<()> {
    let cluster = EtcdCluster::start(1);
    let etcd = Etcd::connect(&cluster.url(), soon())?;
    // The test plays the leader: its key and its journal.
    let (lease, epoch) = take(&etcd, "s", "127.0.0.1:3001")?;
    let authority = Authority::new();
    authority.grant_until(Instant::now() + Duration::from_secs(60));
    let journal = EtcdJournal::start(
        etcd.clone(),
        Keys::new("s"),
        epoch,
        1,
        authority,
        JournalConfig {
            snapshot_every: 1000,
            call_timeout: Duration::from_secs(2),
        },
    )?;
    let m = standby_master(&cluster, "s")?;
    std::thread::sleep(Duration::from_millis(500));
    ensure!(m.role() == Role::Standby);

    let mut lags = Vec::new();
    for i in 1..=5u64 {
        let t = journal.append(vec![Record::Mount {
            segment: i,
            endpoint: format!("127.0.0.1:{}", 4000 + i),
            base: 0x10_0000 * i,
            size: 1 << 20,
            rkey: i as u32,
            owner: 7,
        }]);
        journal.wait(t, soon())?;
        let written = Instant::now();
        while m.stats().context("stopped")?.segments < i {
            ensure!(
                written.elapsed() < Duration::from_secs(2),
                "entry {i} not applied within 2 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        lags.push(written.elapsed());
    }
    journal.close();

    etcd.revoke(lease, soon())?;
    let gone = Instant::now();
    let e = m
        .wait_leader(Duration::from_secs(2))
        .context("the standby did not lead within 2 s of the key's deletion")?;
    let took = gone.elapsed();
    ensure!(e > epoch);
    ensure!(m.stats().context("stopped")?.segments == 5);
    let max = lags.iter().max().copied().unwrap_or_default();
    println!(
        "standby (poll 3 s, re-check 10 s): op-log entry in etcd -> applied: max {:.1} ms over \
         {} entries; leader key deleted -> leading {:.1} ms",
        max.as_secs_f64() * 1e3,
        lags.len(),
        took.as_secs_f64() * 1e3
    );
    ensure!(took < Duration::from_millis(1500), "took {took:?}");
    Ok(())
}
