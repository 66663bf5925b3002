//! Clients find the leading master through etcd.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pagewire_store::{ClientConfig, MasterLocator, StoreError};

use crate::error::{HaError, Result};
use crate::etcd::Etcd;
use crate::leader::leader_key;

/// Reads a cluster's leader key: the leader's address and epoch.
#[derive(Debug)]
pub struct EtcdLocator {
    etcd: Etcd,
    key: String,
    poll: Duration,
}

impl EtcdLocator {
    /// Connects to etcd at `url` (`etcd://h:p;h:p`) by `deadline`, for masters of
    /// `cluster_id`.
    pub fn connect(url: &str, cluster_id: &str, deadline: Instant) -> Result<EtcdLocator> {
        Ok(EtcdLocator {
            etcd: Etcd::connect(url, deadline)?,
            key: leader_key(cluster_id),
            poll: Duration::from_millis(50),
        })
    }

    /// The leader now, if there is one: `(address, epoch)`.
    pub fn leader(&self, deadline: Instant) -> Result<Option<(String, u64)>> {
        let Some(e) = self.etcd.get(&self.key, deadline)? else {
            return Ok(None);
        };
        let addr = String::from_utf8(e.value).map_err(|_| HaError::Unavailable {
            what: "read the leader key",
            reason: format!("{} does not hold an address", self.key),
            source: None,
        })?;
        Ok(Some((addr, e.create_revision as u64)))
    }
}

impl MasterLocator for EtcdLocator {
    fn locate(&self, deadline: Instant) -> pagewire_store::Result<(String, u64)> {
        let start = Instant::now();
        loop {
            // One look may not take the whole deadline: etcd's member may be the one
            // that died, and the next look goes to another.
            let by = deadline.min(Instant::now() + Duration::from_secs(1));
            let err = match self.leader(by) {
                Ok(Some(l)) => return Ok(l),
                Ok(None) => StoreError::Timeout {
                    what: "a master leader to appear in etcd",
                    after: start.elapsed(),
                },
                Err(e) => e.into(),
            };
            if Instant::now() + self.poll >= deadline {
                return Err(err);
            }
            std::thread::sleep(self.poll);
        }
    }
}

/// Client settings for `master`: with an `etcd://` address, a locator that follows the
/// leader of `cluster_id` (connected by `deadline`), or one per shard when the cluster
/// has several ([`crate::shard`]); otherwise [`ClientConfig::new`].
pub fn client_config(master: &str, cluster_id: &str, deadline: Instant) -> Result<ClientConfig> {
    let mut cfg = ClientConfig::new(master);
    if master.starts_with("etcd://") {
        match crate::shard::shard_locators(master, cluster_id, deadline)? {
            Some(shards) => cfg.shards = shards,
            None => {
                cfg.locator = Some(Arc::new(EtcdLocator::connect(
                    master, cluster_id, deadline,
                )?))
            }
        }
    }
    Ok(cfg)
}
