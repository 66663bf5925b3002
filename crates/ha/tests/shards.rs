//! A store whose key space is split over two shards (leader groups) on a real etcd
//! (started by the test on 127.0.0.1), each shard with a leader and a standby master in
//! processes of their own, a storage node and clients in the test: keys land on both
//! shards and read back byte-exact, mixed batches keep the caller's order, and a SIGKILL
//! of one shard's leader fails only that shard's keys until its standby takes over with
//! every object. Also: a master started with another shard count refuses to start. Needs
//! the `etcd` binary (scripts/setup.sh).

#[path = "../../store/tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::process::{Child, ChildStdin};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use pagewire_ha::testkit::EtcdCluster;
use pagewire_ha::{EtcdLocator, HaConfig, HaError, HaMaster, client_config, shard_cluster_id};
use pagewire_store::{Code, MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

use common::{Buf, fill, say, wait_stdin_closed};

const ROLE: &str = "PW_SHARD_ROLE";
const CLUSTER: &str = "t";
const TTL: Duration = Duration::from_secs(2);
const PAGE: usize = 4096;
const OBJECTS: usize = 256;
const SEED: u64 = 11;

fn master_config() -> Result<MasterConfig> {
    let mut cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    cfg.core.heartbeat_ms = 200;
    cfg.core.revoke_grace_ms = 200;
    Ok(cfg)
}

fn ha_config(etcd: &str) -> HaConfig {
    let mut ha = HaConfig::new(etcd);
    ha.cluster_id = CLUSTER.into();
    ha.lease_ttl = TTL;
    ha.poll = Duration::from_millis(50);
    ha
}

/// The child master of shard `PW_SHARD` of `PW_SHARDS`: says `READY addr`, then lives
/// until its stdin closes.
fn run_master() -> Result<()> {
    let shards = std::env::var("PW_SHARDS")?.parse()?;
    let shard = std::env::var("PW_SHARD")?.parse()?;
    let m = HaMaster::start_shard(
        master_config()?,
        ha_config(&std::env::var("PW_ETCD")?),
        shards,
        shard,
    )?;
    say(format!("READY {}", m.local_addr()));
    wait_stdin_closed();
    std::process::exit(0);
}

/// Entry point of the child master; a no-op in the normal test run.
#[test]
fn role() {
    let r = match std::env::var(ROLE).as_deref() {
        Ok("master") => run_master(),
        _ => return,
    };
    if let Err(e) = r {
        say(format!("FATAL {e:#}"));
        std::process::exit(3);
    }
}

/// A master of one shard in a process of its own.
struct MasterProc {
    child: Child,
    _stdin: Option<ChildStdin>,
    _lines: Receiver<String>,
    addr: SocketAddr,
}

impl MasterProc {
    fn spawn(etcd: &str, shards: usize, shard: usize) -> Result<MasterProc> {
        let env = [
            ("PW_ETCD", etcd.to_string()),
            ("PW_SHARDS", shards.to_string()),
            ("PW_SHARD", shard.to_string()),
        ];
        let mut child = common::role_command(ROLE, "master", &env)?.spawn()?;
        let lines = common::tagged_lines(child.stdout.take().context("stdout")?);
        let stdin = child.stdin.take();
        let first = lines.recv_timeout(Duration::from_secs(15));
        let addr = match first.as_deref().map(|l| l.strip_prefix("READY ")) {
            Ok(Some(a)) => a.parse()?,
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("master of shard {shard} said {first:?}");
            }
        };
        Ok(MasterProc {
            child,
            _stdin: stdin,
            _lines: lines,
            addr,
        })
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for MasterProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Shard `shard`'s leader key now: `(address, epoch)`.
fn leader_of(url: &str, shard: usize) -> Result<Option<(String, u64)>> {
    let loc = EtcdLocator::connect(
        url,
        &shard_cluster_id(CLUSTER, shard),
        Instant::now() + Duration::from_secs(5),
    )?;
    Ok(loc.leader(Instant::now() + Duration::from_secs(2))?)
}

/// Shard `shard`'s masters `(leader, standby)` with the leader's epoch, once one leads.
fn leader_and_standby(
    url: &str,
    shard: usize,
    a: MasterProc,
    b: MasterProc,
) -> Result<(MasterProc, MasterProc, u64)> {
    let by = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some((addr, epoch)) = leader_of(url, shard)? {
            if addr == a.addr.to_string() {
                return Ok((a, b, epoch));
            }
            ensure!(
                addr == b.addr.to_string(),
                "shard {shard}'s leader is {addr}"
            );
            return Ok((b, a, epoch));
        }
        ensure!(
            Instant::now() < by,
            "no leader of shard {shard} within 15 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A client of cluster `cluster` with `segment` bytes and `timeout` per call.
fn client(url: &str, cluster: &str, segment: u64, timeout: Duration) -> Result<StoreClient> {
    let mut c = client_config(url, cluster, Instant::now() + Duration::from_secs(5))?;
    c.engine = common::engine(BackendKind::Tcp);
    c.segment_size = segment;
    c.timeout = timeout;
    c.connect_timeout = Duration::from_secs(8);
    Ok(StoreClient::connect(c)?)
}

fn key(i: usize) -> String {
    format!("obj-{i}")
}

/// Reads `keys` with `c` into `dst` (one page each, in order) and checks every page
/// that was read against its pattern; the per-key results.
fn read_back(c: &StoreClient, dst: &mut Buf, keys: &[String]) -> Result<Vec<Result<u64, Code>>> {
    dst.mem.fill(0);
    let parts: Vec<[pagewire_store::Span; 1]> = (0..keys.len())
        .map(|j| [dst.span(j * PAGE, PAGE)])
        .collect();
    let got = c.get(keys, &parts)?;
    let mut want = vec![0u8; PAGE];
    for (j, (k, r)) in keys.iter().zip(&got).enumerate() {
        if r.is_ok() {
            ensure!(*r == Ok(PAGE as u64), "{k}: {r:?}");
            fill(k, SEED, &mut want);
            ensure!(
                dst.mem[j * PAGE..(j + 1) * PAGE] == want[..],
                "{k}: other bytes than its own"
            );
        }
    }
    Ok(got)
}

#[test]
fn two_shards_route_and_survive_one_shard_failover() -> Result<()> {
    if std::env::var(ROLE).is_ok() {
        return Ok(());
    }
    let etcd = EtcdCluster::start(1);
    let url = etcd.url();
    let mut groups = Vec::new();
    for shard in 0..2 {
        let a = MasterProc::spawn(&url, 2, shard)?;
        let b = MasterProc::spawn(&url, 2, shard)?;
        groups.push(leader_and_standby(&url, shard, a, b)?);
    }
    let node = client(&url, CLUSTER, 16 << 20, Duration::from_secs(8))?;
    ensure!(node.shards() == 2, "the node sees {} shards", node.shards());
    let parts = node.segments();
    ensure!(
        parts.len() == 2 && parts.iter().all(|&(_, s)| s == 8 << 20),
        "segment parts {parts:?}"
    );
    let c = client(&url, CLUSTER, 0, Duration::from_secs(8))?;

    // 256 objects in 4 batches of 64, each batch mixing both shards.
    let keys: Vec<String> = (0..OBJECTS).map(key).collect();
    let mut src = Buf::new(&c, OBJECTS * PAGE);
    for (i, k) in keys.iter().enumerate() {
        fill(k, SEED, &mut src.mem[i * PAGE..(i + 1) * PAGE]);
    }
    for batch in 0..OBJECTS / 64 {
        let r = batch * 64..(batch + 1) * 64;
        let spans: Vec<[pagewire_store::Span; 1]> =
            r.clone().map(|i| [src.span(i * PAGE, PAGE)]).collect();
        let put = c.put(&keys[r], &spans, &PutOptions::default())?;
        ensure!(put.iter().all(Result::is_ok), "batch {batch}: {put:?}");
    }
    let owners: Vec<usize> = keys.iter().map(|k| c.shard_of(k.as_bytes())).collect();
    let on = |s: usize| owners.iter().filter(|&&o| o == s).count() as u64;
    ensure!(on(0) > 0 && on(1) > 0, "keys on one shard only");
    // Each shard's leader holds exactly its keys (asked through a client of that shard's
    // leader group alone).
    for shard in 0..2 {
        let direct = client(
            &url,
            &shard_cluster_id(CLUSTER, shard),
            0,
            Duration::from_secs(5),
        )?;
        let objects = direct.stats()?.objects;
        ensure!(
            objects == on(shard),
            "shard {shard} holds {objects}, {} route there",
            on(shard)
        );
        direct.close();
    }
    ensure!(c.stats()?.objects == OBJECTS as u64);
    println!("shard 0: {} objects, shard 1: {}", on(0), on(1));

    // Read back in reverse order, one batch across both shards.
    let mut dst = Buf::new(&c, OBJECTS * PAGE);
    let rev: Vec<String> = keys.iter().rev().cloned().collect();
    let got = read_back(&c, &mut dst, &rev)?;
    ensure!(got.iter().all(Result::is_ok), "{got:?}");

    // Mixed batches keep the caller's order.
    let a0 = (0..OBJECTS).find(|&i| owners[i] == 0).context("shard 0")?;
    let a1 = (0..OBJECTS).find(|&i| owners[i] == 1).context("shard 1")?;
    let missing: Vec<String> = (0..64).map(|i| format!("missing-{i}")).collect();
    let m0 = missing
        .iter()
        .find(|k| c.shard_of(k.as_bytes()) == 0)
        .context("m0")?;
    let m1 = missing
        .iter()
        .find(|k| c.shard_of(k.as_bytes()) == 1)
        .context("m1")?;
    let mixed = [&keys[a1], m0, &keys[a0], m1, ""];
    ensure!(
        c.exist(&mixed)?
            == [
                Ok(true),
                Ok(false),
                Ok(true),
                Ok(false),
                Err(Code::InvalidKey)
            ]
    );
    let gone = [&keys[OBJECTS - 1], m1, &keys[OBJECTS - 2], m0];
    let codes = c.remove(&gone, true)?;
    ensure!(
        codes == [Code::Ok, Code::NotFound, Code::Ok, Code::NotFound],
        "remove: {codes:?}"
    );
    ensure!(c.exist(&gone[..1])? == [Ok(false)]);
    let kept = &keys[..OBJECTS - 2];

    // SIGKILL shard 0's leader. Shard 1's keys keep working throughout; shard 0's fail
    // alone (typed, per key) until its standby leads.
    let (mut leader, _standby, epoch) = groups.remove(0);
    let quick = client(&url, CLUSTER, 0, Duration::from_secs(1))?;
    let mut qdst = Buf::new(&quick, 2 * PAGE);
    let qsrc = Buf::new(&quick, PAGE);
    leader.kill9();
    let killed = Instant::now();
    let mut failed_alone = 0;
    let mut served = 0;
    let mut after = Vec::new();
    let new_epoch = loop {
        // One key of each shard in one batch.
        let got = read_back(&quick, &mut qdst, &[keys[a0].clone(), keys[a1].clone()])?;
        ensure!(
            got[1] == Ok(PAGE as u64),
            "shard 1's key during the outage: {got:?}"
        );
        match got[0] {
            Ok(_) => {}
            Err(Code::Timeout | Code::MasterUnavailable) => failed_alone += 1,
            // The new leader answers before the node remounted its part there.
            Err(Code::NotReady) => {}
            Err(other) => bail!("shard 0's key during the outage: {other:?}"),
        }
        // A new object of shard 1.
        let k = (0..)
            .map(|i| format!("during-{}-{i}", after.len()))
            .find(|k| quick.shard_of(k.as_bytes()) == 1)
            .expect("some key");
        let mut page = vec![0u8; PAGE];
        fill(&k, SEED, &mut page);
        let qs = qsrc.span(0, PAGE);
        // SAFETY: writing the client's own registered buffer, no transfer in flight.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), qs.addr as *mut u8, PAGE) };
        let put = quick.put(&[&k], &[[qs]], &PutOptions::default())?;
        ensure!(
            put == [Ok(())],
            "a put of shard 1 during the outage: {put:?}"
        );
        after.push(k);
        served += 1;
        if let Some((_, e)) = leader_of(&url, 0)?
            && e != epoch
        {
            break e;
        }
        ensure!(
            killed.elapsed() < Duration::from_secs(20),
            "no new leader of shard 0 within 20 s"
        );
    };
    println!(
        "shard 0 failover: new epoch {new_epoch} after {:.2} s; {served} rounds served shard 1, \
         {failed_alone} failed shard 0's key alone",
        killed.elapsed().as_secs_f64()
    );
    ensure!(new_epoch > epoch);
    ensure!(
        failed_alone > 0,
        "no round saw shard 0 down while shard 1 served"
    );

    // Every object published before the kill reads back from the new leader (once the
    // node has remounted its part there), and the ones put meanwhile on shard 1 too.
    let by = Instant::now() + Duration::from_secs(15);
    loop {
        let got = read_back(&c, &mut dst, kept)?;
        if got.iter().all(Result::is_ok) {
            break;
        }
        let bad: Vec<_> = got.iter().filter(|r| r.is_err()).collect();
        ensure!(
            bad.iter().all(|r| matches!(
                r,
                Err(Code::NotReady | Code::Timeout | Code::MasterUnavailable | Code::NotFound)
            )),
            "{bad:?}"
        );
        ensure!(
            Instant::now() < by,
            "{} of {} objects not back after the failover: {:?}",
            bad.len(),
            kept.len(),
            bad.first()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "all {} objects back {:.2} s after the kill",
        kept.len(),
        killed.elapsed().as_secs_f64()
    );
    let got = read_back(&c, &mut dst, &after)?;
    ensure!(got.iter().all(Result::is_ok), "{got:?}");
    quick.close();
    c.close();
    node.close();
    Ok(())
}

#[test]
fn a_master_with_another_shard_count_refuses_to_start() -> Result<()> {
    if std::env::var(ROLE).is_ok() {
        return Ok(());
    }
    let etcd = EtcdCluster::start(1);
    let url = etcd.url();
    let first = HaMaster::start_shard(master_config()?, ha_config(&url), 2, 1)?;
    let e = HaMaster::start_shard(master_config()?, ha_config(&url), 3, 0)
        .err()
        .context("a master with 3 shards started in a cluster of 2")?;
    ensure!(
        matches!(&e, HaError::Misuse { reason } if reason.contains("has 2 shard(s)")),
        "{e}"
    );
    // Nor one of the unsharded layout, nor a shard past the count.
    let e = HaMaster::start_shard(master_config()?, ha_config(&url), 1, 0).err();
    ensure!(matches!(e, Some(HaError::Misuse { .. })), "{e:?}");
    let e = HaMaster::start_shard(master_config()?, ha_config(&url), 2, 2).err();
    ensure!(matches!(e, Some(HaError::Misuse { .. })), "{e:?}");
    // The same count joins.
    let second = HaMaster::start_shard(master_config()?, ha_config(&url), 2, 0)?;
    // An unsharded cluster on the same etcd keeps its layout: one locator, no shards.
    let mut ha = ha_config(&url);
    ha.cluster_id = "plain".into();
    let plain = HaMaster::start_shard(master_config()?, ha, 1, 0)?;
    let cfg = client_config(&url, "plain", Instant::now() + Duration::from_secs(5))?;
    ensure!(cfg.shards.is_empty() && cfg.locator.is_some());
    let cfg = client_config(&url, CLUSTER, Instant::now() + Duration::from_secs(5))?;
    ensure!(cfg.shards.len() == 2);
    plain.shutdown();
    second.shutdown();
    first.shutdown();
    Ok(())
}
