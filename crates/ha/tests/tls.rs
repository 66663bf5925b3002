//! etcd over TLS with client certificates (a real etcd started by the test with
//! `--client-cert-auth`, certificates made by `openssl`): a master and clients given the
//! CA and a client certificate elect, serve and read the op-log back after a handover.
//! Without TLS, with a CA that did not sign etcd's certificate, or without a client
//! certificate, calls fail within their deadline and nothing is served. Needs the `etcd`
//! and `openssl` binaries (scripts/setup.sh).

#[path = "../../store/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use pagewire_ha::testkit::{EtcdCluster, TestCerts, leader_first};
use pagewire_ha::{Access, Etcd, HaConfig, HaMaster, Tls, client_config_as};
use pagewire_store::{MasterConfig, PutOptions, StoreClient};
use pagewire_transport::BackendKind;

use common::{Buf, fill};

const PAGE: usize = 16 << 10;

fn tls(
    ca: &std::path::Path,
    client: Option<&(std::path::PathBuf, std::path::PathBuf)>,
) -> Result<Access> {
    let s = |p: &std::path::Path| p.to_str().expect("UTF-8 path").to_string();
    let client = client.map(|(c, k)| (s(c), s(k)));
    let t = Tls::from_pem_files(
        &s(ca),
        client.as_ref().map(|(c, k)| (c.as_str(), k.as_str())),
    )?;
    Ok(Access {
        user: None,
        tls: Some(t),
    })
}

fn master(url: &str, access: Access) -> Result<HaMaster> {
    let mut ha = HaConfig::new(url);
    ha.cluster_id = "tls".into();
    ha.lease_ttl = Duration::from_secs(2);
    ha.poll = Duration::from_millis(50);
    ha.access = Some(access);
    let cfg = MasterConfig {
        listen: "127.0.0.1:0".parse()?,
        ..MasterConfig::default()
    };
    Ok(HaMaster::start(cfg, ha)?)
}

fn client(url: &str, access: Access, segment: u64) -> Result<StoreClient> {
    let by = Instant::now() + Duration::from_secs(5);
    let mut c = client_config_as(url, "tls", access, by)?;
    c.engine = common::engine(BackendKind::Tcp);
    c.segment_size = segment;
    c.timeout = Duration::from_secs(8);
    Ok(StoreClient::connect(c)?)
}

#[test]
fn the_store_runs_on_etcd_over_tls_and_plain_or_untrusted_peers_get_nothing() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("pagewire-etcd-certs-{}", std::process::id()));
    let certs = TestCerts::make(&dir);
    let cluster = EtcdCluster::start_tls(1, &certs);
    let url = cluster.url();
    let key = pagewire_ha::leader_key("tls");

    // Refused: plain TCP to a TLS port, a CA that did not sign etcd's certificate, no
    // client certificate. Each fails within its deadline (2 s).
    for (what, access) in [
        ("plain TCP", Access::default()),
        ("another CA", tls(&certs.other_ca, Some(&certs.client))?),
        ("no client certificate", tls(&certs.ca, None)?),
    ] {
        let e = Etcd::connect_as(&url, access)?;
        let t = Instant::now();
        let r = e.get(&key, t + Duration::from_secs(2));
        let took = t.elapsed();
        match r {
            Err(err) if took < Duration::from_millis(2500) => println!("{what}: {err}"),
            other => bail!("{what}: {other:?} after {took:?}"),
        }
    }

    // Trusted both ways: two masters, a node and a client.
    let good = tls(&certs.ca, Some(&certs.client))?;
    let a = master(&url, good.clone())?;
    let b = master(&url, good.clone())?;
    let Some([leader, standby]) = leader_first(a, b, Duration::from_secs(10)) else {
        bail!("no leader within 10 s");
    };
    let node = client(&url, good.clone(), 16 << 20)?;
    let c = client(&url, good, 0)?;
    let mut src = Buf::new(&c, PAGE);
    let mut dst = Buf::new(&c, PAGE);
    fill("k", 7, &mut src.mem);
    let r = c.put(&["k"], &[[src.span(0, PAGE)]], &PutOptions::default())?;
    ensure!(r == [Ok(())], "{r:?}");
    leader.shutdown();
    ensure!(
        standby.wait_leader(Duration::from_secs(10)).is_some(),
        "no handover"
    );
    let t = Instant::now();
    loop {
        dst.mem.fill(0);
        let r = c.get(&["k"], &[[dst.span(0, PAGE)]])?;
        if r == [Ok(PAGE as u64)] {
            ensure!(dst.mem == src.mem, "other bytes");
            break;
        }
        ensure!(t.elapsed() < Duration::from_secs(10), "{r:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    node.close();
    c.close();
    standby.shutdown();
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
