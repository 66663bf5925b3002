//! etcd with authentication on (a real etcd started by the test, auth enabled through
//! etcd's own API, tokens that expire after 2 s): masters, a storage node and a client
//! given a user elect a leader, serve, write and follow the op-log (snapshots and
//! compaction included) and hand over; their tokens are renewed as they expire. Without
//! a user, with a wrong password, or as a user whose role does not cover the store's
//! keys, a master fails to start and a client to set up, at once and typed
//! (`HaError::Denied`), not at its deadline. Needs the `etcd` binary (scripts/setup.sh).

#[path = "../../store/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use etcd_client::{Client, Permission};
use pagewire_ha::testkit::{EtcdCluster, leader_first};
use pagewire_ha::{Access, Credentials, Etcd, HaConfig, HaError, HaMaster, client_config_as};
use pagewire_store::{MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

use common::{Buf, fill};

const PAGE: usize = 16 << 10;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(3)
}

/// Users `root`, `kv` (read and write under `pagewire-store/`) and `outsider` (under
/// `elsewhere/` only), then authentication on.
fn enable_auth(url: &str) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let endpoint = format!("http://{}", url.trim_start_matches("etcd://"));
    rt.block_on(async {
        let mut c = Client::connect([endpoint], None).await?;
        c.role_add("root").await?;
        c.user_add("root", "root-pw", None).await?;
        c.user_grant_role("root", "root").await?;
        c.role_add("store").await?;
        c.role_grant_permission(
            "store",
            Permission::read_write("pagewire-store/").with_prefix(),
        )
        .await?;
        c.user_add("kv", "s3cret", None).await?;
        c.user_grant_role("kv", "store").await?;
        c.role_add("other").await?;
        c.role_grant_permission("other", Permission::read_write("elsewhere/").with_prefix())
            .await?;
        c.user_add("outsider", "pw2", None).await?;
        c.user_grant_role("outsider", "other").await?;
        c.auth_enable().await?;
        anyhow::Ok(())
    })
}

/// As `user`, without TLS.
fn as_user(user: Option<Credentials>) -> Access {
    Access { user, tls: None }
}

fn ha(url: &str, user: Option<Credentials>) -> HaConfig {
    let mut ha = HaConfig::new(url);
    ha.cluster_id = "auth".into();
    ha.lease_ttl = Duration::from_secs(2);
    ha.poll = Duration::from_millis(50);
    // Snapshots (and etcd compactions) every 4 entries, under the same user.
    ha.snapshot_every = 4;
    ha.access = Some(as_user(user));
    ha
}

fn master(url: &str, user: Option<Credentials>) -> pagewire_ha::Result<HaMaster> {
    let cfg = MasterConfig {
        listen: "127.0.0.1:0".parse().expect("address"),
        ..MasterConfig::default()
    };
    HaMaster::start(cfg, ha(url, user))
}

fn client(url: &str, user: Credentials, segment: u64) -> Result<StoreClient> {
    let mut c = client_config_as(url, "auth", as_user(Some(user)), soon())?;
    c.engine = common::engine(BackendKind::Tcp);
    c.segment_size = segment;
    c.timeout = Duration::from_secs(8);
    Ok(StoreClient::connect(c)?)
}

/// `r` is `Denied`, and came within 1 s.
fn denied<T: std::fmt::Debug>(what: &str, start: Instant, r: pagewire_ha::Result<T>) -> Result<()> {
    let took = start.elapsed();
    match r {
        Err(HaError::Denied { .. }) if took < Duration::from_secs(1) => Ok(()),
        Err(HaError::Denied { .. }) => bail!("{what}: refused only after {took:?}"),
        other => bail!("{what}: {other:?}"),
    }
}

#[test]
fn the_store_runs_on_an_etcd_with_authentication_and_refuses_wrong_users() -> Result<()> {
    // What the masters warn of (a refused snapshot or compaction) shows with the output.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stderr)
        .try_init();
    let cluster = EtcdCluster::start_with(1, &["--auth-token-ttl=2"]);
    let url = cluster.url();
    let kv = Credentials::new("kv", "s3cret")?;
    // A user for an etcd without authentication is a mistake too (credentials that guard
    // nothing).
    let t = Instant::now();
    let e = Etcd::connect_as(&url, as_user(Some(kv.clone())))?;
    denied("authentication off", t, e.get("k", soon()))?;
    enable_auth(&url)?;
    let wrong = Credentials::new("kv", "not-it")?;
    let outsider = Credentials::new("outsider", "pw2")?;
    ensure!(
        !format!("{kv:?}").contains("s3cret"),
        "Debug shows the password"
    );

    // Refusals: typed, at once, for every kind of caller.
    let key = pagewire_ha::leader_key("auth");
    for (what, user) in [
        ("no user", None),
        ("wrong password", Some(wrong.clone())),
        ("a user without the store's keys", Some(outsider.clone())),
    ] {
        let t = Instant::now();
        let e = Etcd::connect_as(&url, as_user(user.clone()))?;
        denied(
            what,
            t,
            e.get(&key, Instant::now() + Duration::from_secs(5)),
        )?;
        let t = Instant::now();
        denied(what, t, master(&url, user.clone()))?;
        if let Some(u) = user {
            let t = Instant::now();
            let r = client_config_as(
                &url,
                "auth",
                as_user(Some(u)),
                Instant::now() + Duration::from_secs(5),
            );
            denied(what, t, r.map(|_| ()))?;
        }
    }

    // The right user: two masters, a node and a client.
    let a = master(&url, Some(kv.clone()))?;
    let b = master(&url, Some(kv.clone()))?;
    let Some([leader, standby]) = leader_first(a, b, Duration::from_secs(10)) else {
        bail!("no leader within 10 s");
    };
    let node = client(&url, kv.clone(), 32 << 20)?;
    let c = client(&url, kv.clone(), 0)?;
    let mut src = Buf::new(&c, PAGE);
    let mut dst = Buf::new(&c, PAGE);
    let put = |k: &str, src: &mut Buf| -> Result<()> {
        fill(k, 1, &mut src.mem);
        let r = c.put(&[k], &[[src.span(0, PAGE)]], &PutOptions::default())?;
        ensure!(r == [Ok(())], "put {k}: {r:?}");
        Ok(())
    };
    let mut keys = Vec::new();
    for i in 0..6 {
        let k = format!("before-{i}");
        put(&k, &mut src)?;
        keys.push(k);
    }
    // Past the tokens' 2 s: every caller's token is renewed by itself, including that of
    // a connection idle all along (etcd extends a token each time it is used).
    let idle = Etcd::connect_as(&url, as_user(Some(kv.clone())))?;
    ensure!(idle.get(&key, soon())?.is_some(), "no leader key");
    std::thread::sleep(Duration::from_millis(3500));
    ensure!(
        idle.get(&key, soon())?.is_some(),
        "no leader key after the token expired"
    );
    for i in 0..6 {
        let k = format!("after-{i}");
        put(&k, &mut src)?;
        keys.push(k);
    }
    // The standby follows the log through its own (renewed) token; the leader hands over.
    let standby_epoch_before = standby.role();
    leader.shutdown();
    standby
        .wait_leader(Duration::from_secs(10))
        .with_context(|| format!("no handover (standby was {standby_epoch_before:?})"))?;
    let t = Instant::now();
    for k in &keys {
        fill(k, 1, &mut src.mem);
        loop {
            dst.mem.fill(0);
            let r = c.get(&[k.as_str()], &[[dst.span(0, PAGE)]])?;
            if r == [Ok(PAGE as u64)] {
                ensure!(dst.mem == src.mem, "{k}: other bytes");
                break;
            }
            // NotReady until the node has remounted on the new leader.
            ensure!(t.elapsed() < Duration::from_secs(10), "{k}: {r:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    println!(
        "etcd with authentication (tokens of 2 s): {} objects put across a token expiry read \
         back from the new leader {:.2} s after the handover",
        keys.len(),
        t.elapsed().as_secs_f64()
    );
    node.close();
    c.close();
    standby.shutdown();
    Ok(())
}
