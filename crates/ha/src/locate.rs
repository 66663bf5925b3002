//! Clients find the leading master through etcd: one watch on the leader key keeps the
//! leader's address and epoch at hand, so that a look costs nothing while the watch is
//! open, and a change reaches waiting callers as etcd reports it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_store::{ClientConfig, MasterLocator, StoreError};

use crate::error::{HaError, Result};
use crate::etcd::{Access, Entry, Etcd};
use crate::leader::leader_key;
use crate::watch::{EventKind, Watch, WatchSpec, Watched};

/// Longest one look at etcd may take: the member asked may be the one that died, and
/// the next look goes to another.
const ONE_LOOK: Duration = Duration::from_secs(1);
/// Longest a caller waits on the watch before it checks that the watch is still open.
const WATCH_WAIT: Duration = Duration::from_secs(1);

/// What the locator knows of the leader key.
#[derive(Debug, Default)]
struct Known {
    /// Started at the first look (none for a locator never asked).
    watch: Option<Arc<Watch>>,
    /// The leader as of revision `rev` (`None`: no leader, or a key that is not an
    /// address).
    leader: Option<(String, u64)>,
    /// The revision `leader` is as of (0: never read).
    rev: i64,
    /// The watch said changes up to this revision may have been missed: what is known
    /// holds until a read at or after it (0: nothing missed).
    missed: i64,
    /// A thread waits on the watch and applies what it brings; the others wait on the
    /// locator's condvar.
    pumping: bool,
}

impl Known {
    /// The leader (`Some(None)`: none) if what is known is current: read once, kept up
    /// by a watch that is open and missed nothing since.
    fn current(&self) -> Option<Option<(String, u64)>> {
        let live = self.watch.as_ref().is_some_and(|w| w.live());
        (live && self.rev > 0 && self.missed == 0).then(|| self.leader.clone())
    }

    /// Takes what a read or an event at revision `rev` says, unless something newer
    /// is known already.
    fn learn(&mut self, entry: Option<&Entry>, rev: i64) {
        if rev >= self.missed {
            self.missed = 0;
        }
        if rev < self.rev {
            return;
        }
        self.rev = rev;
        self.leader = entry.and_then(|e| {
            let addr = std::str::from_utf8(&e.value).ok()?;
            Some((addr.to_string(), e.create_revision as u64))
        });
    }
}

/// Follows a cluster's leader key: the leader's address and epoch.
#[derive(Debug)]
pub struct EtcdLocator {
    etcd: Etcd,
    key: String,
    poll: Duration,
    known: Mutex<Known>,
    changed: Condvar,
}

impl EtcdLocator {
    /// Connects to etcd at `url` (`etcd://h:p;h:p`) by `deadline`, for masters of
    /// `cluster_id`.
    pub fn connect(url: &str, cluster_id: &str, deadline: Instant) -> Result<EtcdLocator> {
        Ok(EtcdLocator::new(Etcd::connect(url, deadline)?, cluster_id))
    }

    /// A locator for masters of `cluster_id` on a connection already made (several
    /// locators may share one).
    pub fn new(etcd: Etcd, cluster_id: &str) -> EtcdLocator {
        EtcdLocator {
            etcd,
            key: leader_key(cluster_id),
            poll: Duration::from_millis(50),
            known: Mutex::new(Known::default()),
            changed: Condvar::new(),
        }
    }

    /// The leader now, if there is one: `(address, epoch)` (a read of etcd, not of what
    /// the watch reported).
    pub fn leader(&self, deadline: Instant) -> Result<Option<(String, u64)>> {
        let (entry, rev) = self.etcd.get_at(&self.key, deadline)?;
        self.known().learn(entry.as_ref(), rev);
        let Some(e) = entry else {
            return Ok(None);
        };
        let addr = String::from_utf8(e.value).map_err(|_| HaError::Unavailable {
            what: "read the leader key",
            reason: format!("{} does not hold an address", self.key),
            source: None,
        })?;
        Ok(Some((addr, e.create_revision as u64)))
    }

    /// Whether the watch on the leader key is open and what it brought is applied
    /// (for tests and diagnostics).
    pub fn following(&self) -> bool {
        self.known().current().is_some()
    }

    /// Watch streams opened so far (0: not started).
    pub fn watch_opens(&self) -> u64 {
        self.known().watch.as_ref().map_or(0, |w| w.opens())
    }

    fn known(&self) -> MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the watch if it is not: from after what was read, else from now.
    fn start(&self, k: &mut Known) -> Arc<Watch> {
        k.watch
            .get_or_insert_with(|| {
                let from = if k.rev > 0 { k.rev + 1 } else { 0 };
                Arc::new(self.etcd.watch(WatchSpec::key(&self.key).from(from)))
            })
            .clone()
    }

    /// Waits until `until` for the watch to bring something (or for another waiter to
    /// apply what it brought), and applies it; reads the key again when the watch says
    /// changes were missed.
    fn pump(&self, until: Instant) {
        let mut k = self.known();
        let watch = self.start(&mut k);
        if k.pumping {
            let left = until.saturating_duration_since(Instant::now());
            let _ = self.changed.wait_timeout(k, left);
            return;
        }
        k.pumping = true;
        drop(k);
        let got = watch.next(until);
        let mut k = self.known();
        match got {
            Some(Watched::Events(events)) => {
                for e in events.iter().filter(|e| e.key == self.key) {
                    let entry = (e.kind == EventKind::Put).then(|| Entry {
                        value: e.value.clone(),
                        create_revision: e.create_revision,
                    });
                    k.learn(entry.as_ref(), e.mod_revision);
                }
            }
            Some(Watched::Resync(r)) => k.missed = k.missed.max(r.max(1)),
            None => {}
        }
        let reread = k.missed != 0;
        drop(k);
        if reread {
            // Within the caller's time; a read that fails leaves it to the next look.
            let by = until.min(Instant::now() + ONE_LOOK);
            if let Ok((entry, rev)) = self.etcd.get_at(&self.key, by) {
                self.known().learn(entry.as_ref(), rev);
            }
        }
        self.known().pumping = false;
        self.changed.notify_all();
    }
}

impl MasterLocator for EtcdLocator {
    fn locate(&self, deadline: Instant) -> pagewire_store::Result<(String, u64)> {
        let start = Instant::now();
        loop {
            let current = self.known().current();
            let found = match &current {
                // None now: the watch tells when one appears.
                Some(l) => Ok(l.clone()),
                // The watch is not open (yet), or missed changes: a read.
                None => {
                    let r = self.leader(deadline.min(Instant::now() + ONE_LOOK));
                    // The watch starts from after what was read.
                    self.start(&mut self.known());
                    r
                }
            };
            let err = match found {
                Ok(Some(l)) => return Ok(l),
                Ok(None) => StoreError::Timeout {
                    what: "a master leader to appear in etcd",
                    after: start.elapsed(),
                },
                // Waiting would not change etcd's mind.
                Err(e @ HaError::Denied { .. }) => return Err(e.into()),
                Err(e) => e.into(),
            };
            let now = Instant::now();
            if now >= deadline || (current.is_none() && now + self.poll >= deadline) {
                return Err(err);
            }
            // While the watch is not open, a look every poll.
            let wait = if current.is_some() {
                WATCH_WAIT
            } else {
                self.poll
            };
            self.pump(deadline.min(now + wait));
        }
    }

    fn wait_change(&self, epoch: u64, deadline: Instant) -> Option<u64> {
        loop {
            if let Some(l) = self.known().current() {
                let now = l.map_or(0, |(_, e)| e);
                if now != epoch {
                    return Some(now);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            self.pump(deadline.min(now + WATCH_WAIT));
        }
    }
}

/// Client settings for `master`: with an `etcd://` address, a locator that follows the
/// leader of `cluster_id` (connected by `deadline`), or one per shard when the cluster
/// has several ([`crate::shard`]); otherwise [`ClientConfig::new`].
pub fn client_config(master: &str, cluster_id: &str, deadline: Instant) -> Result<ClientConfig> {
    let access = if master.starts_with("etcd://") {
        Access::from_env()?
    } else {
        Access::default()
    };
    client_config_as(master, cluster_id, access, deadline)
}

/// [`client_config`] with etcd's user and TLS from `access`, whatever the environment
/// says. Reads the cluster's shard count, so wrong credentials fail here, with
/// [`HaError::Denied`].
pub fn client_config_as(
    master: &str,
    cluster_id: &str,
    access: Access,
    deadline: Instant,
) -> Result<ClientConfig> {
    let mut cfg = ClientConfig::new(master);
    if master.starts_with("etcd://") {
        let etcd = Etcd::connect_as(master, access)?;
        match crate::shard::shard_locators(&etcd, cluster_id, deadline)? {
            Some(shards) => cfg.shards = shards,
            None => cfg.locator = Some(Arc::new(EtcdLocator::new(etcd, cluster_id))),
        }
    }
    Ok(cfg)
}
