//! The transfer engine's metadata server on etcd: Mooncake's
//! `TransferEngine.initialize(host, "etcd://h:p[;h:p]", ...)`.
//!
//! [`EtcdDirectory`] is `pagewire_mooncake`'s [`MetadataDirectory`] on etcd: an engine's
//! [`SegmentDescriptor`] lives under [`segment_key`] (`pagewire/te/segments/<name>`, or
//! `pagewire/te/<cluster>/segments/<name>` with `MC_METADATA_CLUSTER_ID`), attached to an
//! etcd lease of [`SEGMENT_TTL`] that a thread of the directory renews every third of
//! it. Closing the engine revokes the lease, which deletes the key; an engine that dies
//! without closing loses its name when the lease runs out. A name is created only if
//! absent, so a second live engine cannot take it over. [`new_engine`] picks the
//! directory or the P2P handshake by the metadata address, for the Python and C layers.

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pagewire_mooncake::{
    DEFAULT_HANDSHAKE_TIMEOUT, DirectoryError, Error as TeError, MetadataDirectory, Options,
    SegmentDescriptor, TransferEngine,
};

use crate::error::HaError;
use crate::etcd::{Created, Etcd};

/// Lifetime of a segment name's lease: how long a name outlives an engine that died
/// without closing (and how long a restarted engine waits to take its old name back).
pub const SEGMENT_TTL: Duration = Duration::from_secs(5);
/// Root of pagewire's transfer-engine keys (Mooncake's is `mooncake/`).
pub const KEY_ROOT: &str = "pagewire/te/";

/// The etcd key of segment `name`: `pagewire/te/[<cluster>/]segments/<name>`, the cluster
/// from `MC_METADATA_CLUSTER_ID` as Mooncake reads it (empty: none).
pub fn segment_key(cluster: &str, name: &str) -> String {
    let mut k = String::from(KEY_ROOT);
    if !cluster.is_empty() {
        k.push_str(cluster);
        if !cluster.ends_with('/') {
            k.push('/');
        }
    }
    k.push_str("segments/");
    k.push_str(name);
    k
}

impl From<HaError> for DirectoryError {
    fn from(e: HaError) -> DirectoryError {
        match e {
            HaError::Misuse { reason } => DirectoryError::Misuse { reason },
            HaError::Timeout { what, after } => DirectoryError::Timeout { what, after },
            e => DirectoryError::Unavailable {
                what: "etcd",
                reason: e.to_string(),
                source: Some(Arc::new(e)),
            },
        }
    }
}

/// One published name: its current lease, and whether it was withdrawn.
#[derive(Debug)]
struct Lease {
    id: i64,
    withdrawn: bool,
}

/// A published name's renewal thread (stopped when `stop` is dropped).
#[derive(Debug)]
struct Keeper {
    lease: Arc<Mutex<Lease>>,
    _stop: mpsc::Sender<()>,
}

/// Segment names on etcd. See the module documentation.
#[derive(Debug)]
pub struct EtcdDirectory {
    etcd: Etcd,
    cluster: String,
    ttl: Duration,
    published: Mutex<HashMap<String, Keeper>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EtcdDirectory {
    /// A directory on the etcd members of `url` (`etcd://h:p[;h:p]`), with the cluster id
    /// of `MC_METADATA_CLUSTER_ID`. Connecting is lazy: an unreachable etcd shows at the
    /// first call.
    pub fn connect(url: &str, deadline: Instant) -> Result<EtcdDirectory, HaError> {
        let cluster = std::env::var("MC_METADATA_CLUSTER_ID").unwrap_or_default();
        Self::with_settings(url, &cluster, SEGMENT_TTL, deadline)
    }

    /// [`Self::connect`] with an explicit cluster id and lease TTL (at least 2 s).
    pub fn with_settings(
        url: &str,
        cluster: &str,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<EtcdDirectory, HaError> {
        if ttl < Duration::from_secs(2) {
            return Err(HaError::Misuse {
                reason: format!("segment lease TTL {ttl:?} is under 2 s"),
            });
        }
        Ok(EtcdDirectory {
            etcd: Etcd::connect(url, deadline)?,
            cluster: cluster.to_owned(),
            ttl,
            published: Mutex::new(HashMap::new()),
        })
    }

    fn key(&self, name: &str) -> String {
        segment_key(&self.cluster, name)
    }
}

/// Grants a lease of `ttl` and creates `key` = `desc` on it, if absent; the lease is
/// revoked again when the key is held by someone else or the creation failed.
fn claim(
    etcd: &Etcd,
    ttl: Duration,
    key: &str,
    desc: &SegmentDescriptor,
    deadline: Instant,
) -> Result<i64, DirectoryError> {
    let (lease, _) = etcd.grant(ttl, deadline)?;
    let created = etcd.create_with_lease(key, &desc.encode(), lease, deadline);
    if let Ok(Created::Won(_)) = created {
        return Ok(lease);
    }
    // Best effort: a lease left behind expires by itself.
    let _ = etcd.revoke(lease, deadline);
    match created? {
        Created::Held(entry) => Err(DirectoryError::Taken {
            name: desc.name.clone(),
            holder: SegmentDescriptor::decode(&entry.value)
                .map_or_else(|_| "an unreadable entry".into(), |d| d.rpc),
        }),
        Created::Won(_) => Ok(lease),
    }
}

impl MetadataDirectory for EtcdDirectory {
    fn publish(&self, desc: &SegmentDescriptor, deadline: Instant) -> Result<(), DirectoryError> {
        let key = self.key(&desc.name);
        let id = claim(&self.etcd, self.ttl, &key, desc, deadline)?;
        let lease = Arc::new(Mutex::new(Lease {
            id,
            withdrawn: false,
        }));
        let (stop, stopped) = mpsc::channel::<()>();
        let renew = Renewal {
            etcd: self.etcd.clone(),
            ttl: self.ttl,
            key,
            desc: desc.clone(),
            lease: lease.clone(),
            period: self.ttl / 3,
        };
        let spawned = std::thread::Builder::new()
            .name("pagewire-te-lease".into())
            .spawn(move || renew.run(&stopped));
        if let Err(e) = spawned {
            let _ = self.etcd.revoke(id, deadline);
            return Err(DirectoryError::Unavailable {
                what: "start the lease renewal thread",
                reason: e.to_string(),
                source: Some(Arc::new(e)),
            });
        }
        let old = lock(&self.published).insert(desc.name.clone(), Keeper { lease, _stop: stop });
        if let Some(old) = old {
            // The same directory published the name twice (two engines on one
            // directory cannot: the second finds the key held); the older lease goes.
            let _ = withdraw(&self.etcd, &old, deadline);
        }
        Ok(())
    }

    fn resolve(
        &self,
        name: &str,
        deadline: Instant,
    ) -> Result<Option<SegmentDescriptor>, DirectoryError> {
        let Some(entry) = self.etcd.get(&self.key(name), deadline)? else {
            return Ok(None);
        };
        SegmentDescriptor::decode(&entry.value)
            .map(Some)
            .map_err(|reason| DirectoryError::Malformed {
                name: name.to_owned(),
                reason,
            })
    }

    fn remove(&self, name: &str, deadline: Instant) -> Result<(), DirectoryError> {
        let Some(k) = lock(&self.published).remove(name) else {
            return Ok(());
        };
        withdraw(&self.etcd, &k, deadline).map_err(DirectoryError::from)
    }

    fn describe(&self) -> String {
        format!(
            "etcd://{} under {}",
            self.etcd.endpoints().join(";"),
            self.key("")
        )
    }
}

impl Drop for EtcdDirectory {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(1);
        for (_, k) in lock(&self.published).drain() {
            let _ = withdraw(&self.etcd, &k, deadline);
        }
    }
}

/// Marks a name withdrawn (its thread stops renewing and never claims it again) and
/// revokes its lease, which deletes the key.
fn withdraw(etcd: &Etcd, k: &Keeper, deadline: Instant) -> Result<(), HaError> {
    let id = {
        let mut l = lock(&k.lease);
        l.withdrawn = true;
        l.id
    };
    etcd.revoke(id, deadline)
}

/// The renewal thread of one published name.
struct Renewal {
    etcd: Etcd,
    ttl: Duration,
    key: String,
    desc: SegmentDescriptor,
    lease: Arc<Mutex<Lease>>,
    period: Duration,
}

impl Renewal {
    /// Renews every `period` until the name is withdrawn (its sender dropped). A lease
    /// that etcd no longer knows (etcd unreachable for longer than the TTL) is replaced
    /// and the name claimed again, unless another engine took it meanwhile.
    fn run(self, stopped: &mpsc::Receiver<()>) {
        loop {
            match stopped.recv_timeout(self.period) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            let id = lock(&self.lease).id;
            match self.etcd.keep_alive(id, Instant::now() + self.period) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(key = %self.key, error = %e, "renewing the segment's lease failed");
                    continue;
                }
            }
            // Under the lock: a withdrawal waits for this claim and revokes its lease.
            let mut l = lock(&self.lease);
            if l.withdrawn {
                return;
            }
            let deadline = Instant::now() + self.period;
            let claimed = claim(&self.etcd, self.ttl, &self.key, &self.desc, deadline);
            match claimed {
                Ok(lease) => {
                    tracing::warn!(key = %self.key, "the segment's lease had expired; published again");
                    l.id = lease;
                }
                Err(DirectoryError::Taken { .. }) => {
                    tracing::error!(key = %self.key, "the segment's lease expired and another engine took the name");
                    return;
                }
                Err(e) => {
                    tracing::warn!(key = %self.key, error = %e, "publishing the segment again failed");
                }
            }
        }
    }
}

/// Starts a Mooncake transfer engine for a metadata address: `"P2PHANDSHAKE"` as
/// [`TransferEngine::new`]; `etcd://h:p[;h:p]` (or, as Mooncake reads it, a bare
/// `h:p` list without a scheme) with an [`EtcdDirectory`]; anything else is refused
/// by [`TransferEngine::new`]. Every etcd call finishes within the handshake timeout.
pub fn new_engine(
    metadata: &str,
    local_hostname: &str,
    opts: Options,
) -> Result<TransferEngine, TeError> {
    let url = if metadata.starts_with("etcd://") {
        metadata.to_owned()
    } else if metadata != "P2PHANDSHAKE"
        && !metadata.contains("://")
        && crate::parse_endpoints(&format!("etcd://{metadata}")).is_ok()
    {
        format!("etcd://{metadata}")
    } else {
        return TransferEngine::new(metadata, local_hostname, opts);
    };
    let within = opts.handshake_timeout.unwrap_or(DEFAULT_HANDSHAKE_TIMEOUT);
    let dir = EtcdDirectory::connect(&url, Instant::now() + within)
        .map_err(|e| TeError::directory("connecting to the metadata server", e.into()))?;
    TransferEngine::with_directory(local_hostname, opts, Arc::new(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(
            segment_key("", "prefill-0"),
            "pagewire/te/segments/prefill-0"
        );
        assert_eq!(segment_key("c1", "a:1"), "pagewire/te/c1/segments/a:1");
        assert_eq!(segment_key("c1/", "x"), "pagewire/te/c1/segments/x");
    }
}
