//! A store cluster's shard map on etcd: how many leader groups split its key space.
//!
//! * `pagewire-store/<cluster>/shards` holds the shard count S in ASCII decimal. The first
//!   master started through [`HaMaster::start_shard`] creates it (if absent, in one
//!   transaction, without a lease: it outlives every master); a master started with
//!   another count refuses to start.
//! * With S = 1 the cluster is laid out as an unsharded one: its masters campaign for
//!   `pagewire-store/<cluster>/leader` and log under `pagewire-store/<cluster>/oplog/`.
//! * With S > 1, shard `i`'s masters are a leader group of their own under the cluster id
//!   `<cluster>/shard/<i>` ([`shard_cluster_id`]): leader key, op-log and snapshots under
//!   `pagewire-store/<cluster>/shard/<i>/`, each group elected and logged exactly as an
//!   unsharded cluster.
//! * Clients read S once at set-up ([`shard_locators`], called by
//!   [`crate::client_config`]) and route each key to `pagewire_store::shard::shard_of`.
//!   The count of a running cluster cannot change: there is no resharding.

use std::sync::Arc;
use std::time::Instant;

use pagewire_store::shard::MAX_SHARDS;
use pagewire_store::{MasterConfig, MasterLocator};

use crate::error::{HaError, Result};
use crate::etcd::{Created, Etcd};
use crate::leader::{HaConfig, HaMaster};
use crate::locate::EtcdLocator;

/// The key holding a cluster's shard count.
pub fn shards_key(cluster_id: &str) -> String {
    format!("pagewire-store/{cluster_id}/shards")
}

/// The cluster id of shard `shard`'s leader group in a cluster of several shards.
pub fn shard_cluster_id(cluster_id: &str, shard: usize) -> String {
    format!("{cluster_id}/shard/{shard}")
}

/// A cluster id masters may campaign under: a plain id (non-empty, without `/`), or a
/// shard's id `<plain>/shard/<i>`.
pub(crate) fn valid_cluster_id(id: &str) -> bool {
    let plain = |s: &str| !s.is_empty() && !s.contains('/');
    if plain(id) {
        return true;
    }
    let mut parts = id.split('/');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(c), Some("shard"), Some(i), None)
            if plain(c) && !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit())
    )
}

/// Parses a shard count as etcd holds it (written by anyone with access: hostile).
fn parse_count(key: &str, value: &[u8]) -> Result<usize> {
    std::str::from_utf8(value)
        .ok()
        .filter(|s| !s.is_empty() && s.len() <= 4 && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| (1..=MAX_SHARDS).contains(&n))
        .ok_or_else(|| HaError::Misuse {
            reason: format!(
                "etcd key {key} holds {:?}, not a shard count (1 to {MAX_SHARDS})",
                String::from_utf8_lossy(&value[..value.len().min(32)])
            ),
        })
}

/// The shard count of `cluster_id`, if one was written.
pub fn read_shards(etcd: &Etcd, cluster_id: &str, deadline: Instant) -> Result<Option<usize>> {
    let key = shards_key(cluster_id);
    match etcd.get(&key, deadline)? {
        Some(e) => parse_count(&key, &e.value).map(Some),
        None => Ok(None),
    }
}

/// Writes `shards` as `cluster_id`'s count unless one is there; a different count there is
/// `Misuse` (the cluster was set up with another number of shards).
pub fn claim_shards(etcd: &Etcd, cluster_id: &str, shards: usize, deadline: Instant) -> Result<()> {
    let key = shards_key(cluster_id);
    // Lease 0 is etcd's "no lease": the count outlives the masters.
    let there = match etcd.create_with_lease(&key, shards.to_string().as_bytes(), 0, deadline)? {
        Created::Won(_) => return Ok(()),
        Created::Held(e) => parse_count(&key, &e.value)?,
    };
    if there != shards {
        return Err(HaError::Misuse {
            reason: format!(
                "cluster {cluster_id:?} has {there} shard(s) ({key}), this master was started \
                 with {shards}: start it with --shards {there} (a running cluster cannot be \
                 resharded)"
            ),
        });
    }
    Ok(())
}

impl HaMaster {
    /// Starts a master of shard `shard` of a cluster of `shards` shards (the cluster id is
    /// `ha.cluster_id`): checks the shard map (creating it if absent, refusing a different
    /// count), then campaigns in the shard's leader group ([`HaMaster::start`]). With one
    /// shard this is a master of the unsharded cluster, as [`HaMaster::start`].
    pub fn start_shard(
        cfg: MasterConfig,
        mut ha: HaConfig,
        shards: usize,
        shard: usize,
    ) -> Result<HaMaster> {
        if !(1..=MAX_SHARDS).contains(&shards) || shard >= shards {
            return Err(HaError::Misuse {
                reason: format!(
                    "shard {shard} of {shards}: the count is 1 to {MAX_SHARDS} and the shard \
                     below it"
                ),
            });
        }
        if ha.cluster_id.is_empty() || ha.cluster_id.contains('/') {
            return Err(HaError::Misuse {
                reason: format!("cluster id {:?}: non-empty, without '/'", ha.cluster_id),
            });
        }
        let etcd = ha.connect_etcd()?;
        claim_shards(
            &etcd,
            &ha.cluster_id,
            shards,
            Instant::now() + ha.call_timeout * 5,
        )?;
        drop(etcd);
        if shards > 1 {
            ha.cluster_id = shard_cluster_id(&ha.cluster_id, shard);
        }
        HaMaster::start(cfg, ha)
    }
}

/// One leader locator per shard of `cluster_id` when it has several, sharing `etcd`;
/// `None` for an unsharded cluster (no count written, or 1).
pub fn shard_locators(
    etcd: &Etcd,
    cluster_id: &str,
    deadline: Instant,
) -> Result<Option<Vec<Arc<dyn MasterLocator>>>> {
    let n = match read_shards(etcd, cluster_id, deadline)? {
        Some(n) if n > 1 => n,
        _ => return Ok(None),
    };
    Ok(Some(
        (0..n)
            .map(|i| {
                let l = EtcdLocator::new(etcd.clone(), &shard_cluster_id(cluster_id, i));
                Arc::new(l) as Arc<dyn MasterLocator>
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids() {
        assert!(valid_cluster_id("kv1"));
        assert!(valid_cluster_id("kv1/shard/0"));
        assert!(valid_cluster_id(&shard_cluster_id("kv1", 17)));
        for bad in [
            "",
            "a/b",
            "kv1/shard/",
            "kv1/shard/x",
            "/shard/1",
            "a/shard/1/x",
        ] {
            assert!(!valid_cluster_id(bad), "{bad:?}");
        }
        assert_eq!(shards_key("kv1"), "pagewire-store/kv1/shards");
        assert_eq!(
            crate::leader_key(&shard_cluster_id("kv1", 1)),
            "pagewire-store/kv1/shard/1/leader"
        );
    }

    #[test]
    fn counts_are_parsed_as_hostile() {
        assert_eq!(parse_count("k", b"2").unwrap(), 2);
        assert_eq!(parse_count("k", b"256").unwrap(), 256);
        for bad in [
            &b""[..],
            b"0",
            b"257",
            b"-1",
            b" 2",
            b"2\n",
            b"99999999999",
            b"\xff",
        ] {
            assert!(parse_count("k", bad).is_err(), "{bad:?}");
        }
    }
}
