//! Masters elected through etcd: every master campaigns for one leader key; the winner
//! answers clients, the others listen without answering until the key is free again.
//!
//! * **Campaign.** A standby watches its cluster's keys (the leader key and the op-log)
//!   and looks at the leader key when etcd reports it deleted, or every
//!   [`HaConfig::recheck`] in case a watch missed something. When it is absent, the standby grants
//!   itself a lease and creates the key attached to that lease, in one transaction that
//!   succeeds only if the key is still absent. The key holds the leader's address; the
//!   revision that created it is the leader's epoch, which grows with every new leader.
//! * **Leading.** The leader renews its lease every fifth of its TTL. It may answer until
//!   `sent + TTL - margin`, where `sent` is when the renewal that etcd granted was sent:
//!   etcd received it later, so its expiry is later still, and another master can win
//!   only after that. The [`Authority`] checked before every reply holds that instant, so
//!   a leader whose process was stopped past it writes nothing when it resumes.
//! * **Losing the lease** (etcd says it is gone, or renewals fail until the authority
//!   lapsed, or an op-log write failed): the master's connections close, its metadata is
//!   dropped, and it stands by again on the same address with an empty master, which
//!   reads the op-log from its start.
//! * **The op-log** ([`crate::oplog`]): a standby applies the entries its watch delivers,
//!   in order, and reads etcd (a serializable read: no raft round) only when they leave a
//!   gap, after a resync and at every re-check; the winner reads the log to its end with
//!   a linearizable read, promotes its metadata and starts its journal before it answers.
//! * **While the watch is not open** (etcd unreachable, a member changing) or after a
//!   failed look, a standby looks every [`HaConfig::poll`] instead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pagewire_store::{Authority, Master, MasterConfig};

use crate::error::{HaError, Result};
use crate::etcd::{Access, Created, Etcd, Read};
use crate::oplog::{EtcdJournal, Follower, JournalConfig, Keys};
use crate::watch::{EventKind, Watch, WatchSpec, Watched};

/// The leader key of a cluster's masters.
pub fn leader_key(cluster_id: &str) -> String {
    format!("pagewire-store/{cluster_id}/leader")
}

/// Op-log entries between two snapshots, by default.
pub const DEFAULT_SNAPSHOT_EVERY: u64 = 4096;

/// How masters coordinate through etcd.
#[derive(Debug, Clone)]
pub struct HaConfig {
    /// etcd's members: `etcd://h:p;h:p`.
    pub etcd: String,
    /// Masters with the same id (on the same etcd) elect one leader among them.
    pub cluster_id: String,
    /// The leader's lease (whole seconds, at least 2: etcd's own floor for its default
    /// election timeout). A dead leader is replaced within about this time; a leader
    /// keeps leading through an election among etcd's members (about 1-2 s with etcd's
    /// default 1 s election timeout) only if the lease outlasts it.
    pub lease_ttl: Duration,
    /// How often a standby looks at the leader key and the op-log while its watch on
    /// them is not open, and after a look that failed.
    pub poll: Duration,
    /// How often a standby looks anyway while its watch is open: a safety net (etcd
    /// reports every change as it happens).
    pub recheck: Duration,
    /// Deadline of one etcd call.
    pub call_timeout: Duration,
    /// The address written in the leader key, for clients (default: the listener's,
    /// which must then name an interface, not `0.0.0.0`).
    pub advertise: Option<String>,
    /// Op-log entries between two snapshots (at least 1).
    pub snapshot_every: u64,
    /// The etcd user and TLS settings. `None`: what the environment says
    /// ([`Access::from_env`]: `PAGEWIRE_ETCD_USER`, `PAGEWIRE_ETCD_PASSWORD`,
    /// `PAGEWIRE_ETCD_CA`, ...).
    pub access: Option<Access>,
}

impl HaConfig {
    /// Defaults around an etcd address: cluster `default`, a 5 s lease, 100 ms polls
    /// without a watch, a re-check every second with one.
    pub fn new(etcd: impl Into<String>) -> HaConfig {
        HaConfig {
            etcd: etcd.into(),
            cluster_id: "default".into(),
            lease_ttl: Duration::from_secs(5),
            poll: Duration::from_millis(100),
            recheck: Duration::from_secs(1),
            call_timeout: Duration::from_secs(1),
            advertise: None,
            snapshot_every: DEFAULT_SNAPSHOT_EVERY,
            access: None,
        }
    }

    /// A connection to etcd as [`HaConfig::access`] says.
    pub(crate) fn connect_etcd(&self) -> Result<Etcd> {
        let access = match &self.access {
            Some(a) => a.clone(),
            None => Access::from_env()?,
        };
        Etcd::connect_as(&self.etcd, access)
    }

    /// Room kept between the local end of a leader's authority and etcd's expiry of its
    /// lease (clock rates, scheduling): a tenth of the TTL, at least 200 ms.
    fn margin(&self) -> Duration {
        (self.lease_ttl / 10).max(Duration::from_millis(200))
    }
}

/// Where a master stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Not leading: connections are closed unanswered.
    Standby,
    /// Leading under this epoch.
    Leader(u64),
}

struct Shared {
    stop: AtomicBool,
    role: Mutex<Role>,
    /// The master this one runs now (replaced by an empty one when it is deposed).
    master: Mutex<Option<Master>>,
}

impl Shared {
    fn master(&self) -> std::sync::MutexGuard<'_, Option<Master>> {
        self.master.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A master that takes part in an election through etcd.
pub struct HaMaster {
    shared: Arc<Shared>,
    addr: std::net::SocketAddr,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for HaMaster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HaMaster")
            .field("addr", &self.addr)
            .field("role", &self.role())
            .finish()
    }
}

impl HaMaster {
    /// Binds the master's listener (answering nothing yet), connects to etcd and starts
    /// campaigning.
    pub fn start(mut cfg: MasterConfig, ha: HaConfig) -> Result<HaMaster> {
        if ha.lease_ttl < Duration::from_secs(2) || ha.lease_ttl.subsec_nanos() != 0 {
            return Err(HaError::Misuse {
                reason: format!("lease TTL {:?}: whole seconds, at least 2 s", ha.lease_ttl),
            });
        }
        if ha.snapshot_every == 0 {
            return Err(HaError::Misuse {
                reason: "snapshot_every: at least 1 entry".into(),
            });
        }
        if !crate::shard::valid_cluster_id(&ha.cluster_id) {
            return Err(HaError::Misuse {
                reason: format!(
                    "cluster id {:?}: non-empty, without '/' (or a shard's, `<id>/shard/<i>`)",
                    ha.cluster_id
                ),
            });
        }
        let etcd = ha.connect_etcd()?;
        // Credentials etcd refuses fail the start: the master could never lead. (etcd
        // unreachable does not: the master stands by until it answers; one call's
        // deadline at most goes to finding out.)
        if let Err(e @ HaError::Denied { .. }) = etcd.get(
            &leader_key(&ha.cluster_id),
            Instant::now() + ha.call_timeout,
        ) {
            return Err(e);
        }
        let authority = Authority::new();
        cfg.authority = Some(authority.clone());
        let master = Master::start(cfg.clone()).map_err(HaError::Master)?;
        let addr = master.local_addr();
        let advertise = match &ha.advertise {
            Some(a) => a.clone(),
            None if addr.ip().is_unspecified() => {
                return Err(HaError::Misuse {
                    reason: format!(
                        "the master listens on {addr}: give the address clients reach it at \
                         (--advertise)"
                    ),
                });
            }
            None => addr.to_string(),
        };
        // Later masters bind the port this one got.
        cfg.listen = addr;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            role: Mutex::new(Role::Standby),
            master: Mutex::new(Some(master)),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pagewire-ha-campaign".into())
            .spawn(move || {
                let mut c = Campaign {
                    etcd,
                    key: leader_key(&ha.cluster_id),
                    follower: Follower::new(Keys::new(&ha.cluster_id)),
                    watch: None,
                    delivered: Vec::new(),
                    ha,
                    cfg,
                    advertise,
                    authority,
                    shared: s,
                };
                c.run();
            })
            .map_err(|e| HaError::Io {
                what: "spawn the campaign thread",
                source: Arc::new(e),
            })?;
        Ok(HaMaster {
            shared,
            addr,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The listener's address.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Leading or standing by, now.
    pub fn role(&self) -> Role {
        *self.shared.role.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The counts of the master this one runs now (none once it stopped). A standby's
    /// are those of an empty master.
    pub fn stats(&self) -> Option<pagewire_store::Stats> {
        self.shared.master().as_ref().map(Master::stats)
    }

    /// Waits up to `timeout` for this master to lead; its epoch.
    pub fn wait_leader(&self, timeout: Duration) -> Option<u64> {
        let by = Instant::now() + timeout;
        loop {
            if let Role::Leader(e) = self.role() {
                return Some(e);
            }
            if Instant::now() > by {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops: gives up leadership (the key goes at once, so a standby takes over without
    /// waiting for the lease), closes every connection. Idempotent.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Release);
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }

    /// Blocks until [`HaMaster::shutdown`] is called from another thread.
    pub fn wait(&self) {
        while !self.shared.stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for HaMaster {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Renewals per lease TTL: frequent, so that a renewal held up (etcd electing a new raft
/// leader) leaves most of the TTL to retry in.
const RENEWALS_PER_TTL: u32 = 5;

/// Longest a standby waits on its watch before it checks for a shutdown.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// What a standby looks at next.
#[derive(Debug, Clone, Copy)]
struct Due {
    /// The op-log, for new entries.
    follow: bool,
    /// Read them from etcd (else the entries the watch delivered may do).
    read: bool,
    /// The leader key, to bid if it is free.
    campaign: bool,
}

impl Due {
    const BOTH: Due = Due {
        follow: true,
        read: true,
        campaign: true,
    };
    const NONE: Due = Due {
        follow: false,
        read: false,
        campaign: false,
    };
}

/// A won election.
struct Won {
    epoch: u64,
    lease: i64,
    /// The lease's TTL as etcd granted it.
    ttl: Duration,
    /// When the lease was asked for.
    sent: Instant,
}

/// The campaign thread's state.
struct Campaign {
    etcd: Etcd,
    ha: HaConfig,
    cfg: MasterConfig,
    key: String,
    /// This master's place in the op-log (while standing by, and when it wins).
    follower: Follower,
    /// The cluster's keys, watched while standing by.
    watch: Option<Watch>,
    /// Op-log entries the watch delivered, `(key, value)`, not applied yet.
    delivered: Vec<(String, Vec<u8>)>,
    advertise: String,
    authority: Authority,
    shared: Arc<Shared>,
}

impl Campaign {
    fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    fn set_role(&self, r: Role) {
        *self.shared.role.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }

    fn by(&self) -> Instant {
        Instant::now() + self.ha.call_timeout
    }

    fn run(&mut self) {
        let mut complained = false;
        let mut behind = false;
        // What the last wait asks for: both at first.
        let mut due = Due::BOTH;
        while !self.stopping() {
            // A standby keeps its metadata current, so that winning costs little.
            if due.follow {
                match self.follow_up(due.read) {
                    Ok(_) => behind = false,
                    Err(e) if !behind => {
                        tracing::warn!(etcd = %self.ha.etcd, "store master (standby): reading the op-log: {e}");
                        behind = true;
                    }
                    Err(_) => {}
                }
            }
            if due.campaign {
                match self.try_win() {
                    Ok(Some(won)) => {
                        complained = false;
                        // A leader writes the log itself: no need to hear it back.
                        self.watch = None;
                        self.delivered.clear();
                        self.lead(won);
                        due = Due::BOTH;
                        continue;
                    }
                    Ok(None) => complained = false,
                    Err(e) if !complained => {
                        tracing::warn!(etcd = %self.ha.etcd, "store master (standby): {e}");
                        complained = true;
                    }
                    Err(_) => {}
                }
            }
            due = self.wait(!behind && !complained);
        }
        self.authority.revoke();
        let old = self.shared.master().take();
        if let Some(m) = old {
            m.shutdown();
        }
    }

    /// Waits for a reason to look again: the leader key deleted, new op-log entries,
    /// changes the watch may have missed, or a period (the re-check while the watch is
    /// open and the last look went well, else the poll).
    fn wait(&mut self, healthy: bool) -> Due {
        let keys = Keys::new(&self.ha.cluster_id);
        let watch = self.watch.get_or_insert_with(|| {
            // The entries' values, so that the standby need not read them again (etcd
            // sends them anyway); not the snapshots'. A standby lagging by 8 MiB of
            // entries reads etcd instead.
            let prefix = format!("pagewire-store/{}/", self.ha.cluster_id);
            self.etcd.watch(
                WatchSpec::prefix(prefix)
                    .values_under(keys.entries())
                    .max_value_bytes(8 << 20)
                    .capacity(256),
            )
        });
        let start = Instant::now();
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                return Due::NONE;
            }
            let period = if healthy && watch.live() {
                self.ha.recheck
            } else {
                self.ha.poll
            };
            let until = start + period;
            let now = Instant::now();
            if now >= until {
                return Due::BOTH;
            }
            // Short slices: a shutdown is noticed soon.
            let events = match watch.next(until.min(now + STOP_CHECK)) {
                None => continue,
                Some(Watched::Resync(_)) => return Due::BOTH,
                Some(Watched::Events(events)) => events,
            };
            let mut due = Due::NONE;
            for e in events {
                if e.key == self.key {
                    // A new leader needs nothing from a standby; a deleted key is a
                    // chance to win.
                    due.campaign |= e.kind == EventKind::Delete;
                } else if e.kind == EventKind::Put && e.key.starts_with(keys.entries()) {
                    due.follow = true;
                    self.delivered.push((e.key, e.value));
                } else if e.kind == EventKind::Put && keys.is_log_key(&e.key) {
                    // A snapshot: the entries it covers were delivered, or a gap in
                    // them makes the follower read.
                    due.follow = true;
                }
            }
            if due.follow || due.campaign {
                return due;
            }
        }
    }

    /// Applies the entries the watch delivered, or reads etcd when `read` or when they
    /// leave a gap.
    fn follow_up(&mut self, read: bool) -> Result<u64> {
        let delivered = std::mem::take(&mut self.delivered);
        if !read {
            let guard = self.shared.master();
            let Some(m) = guard.as_ref() else {
                return Ok(0);
            };
            let before = self.follower.applied();
            if self.follower.apply_delivered(m, &delivered)? {
                return Ok(self.follower.applied() - before);
            }
        }
        self.follow(Read::Serializable)
    }

    /// Applies the op-log's new entries to this master's metadata. A standby that only
    /// keeps up reads [`Read::Serializable`]: a linearizable read per entry would cost
    /// etcd a raft round each, on the data path's CPUs when they are shared.
    fn follow(&mut self, read: Read) -> Result<u64> {
        let guard = self.shared.master();
        let Some(m) = guard.as_ref() else {
            return Ok(0);
        };
        self.follower
            .catch_up(&self.etcd, m, read, self.ha.call_timeout)
    }

    /// One look at the leader key, and a bid when it is free.
    fn try_win(&mut self) -> Result<Option<Won>> {
        if self.etcd.get(&self.key, self.by())?.is_some() {
            return Ok(None);
        }
        let sent = Instant::now();
        let (lease, ttl) = self.etcd.grant(self.ha.lease_ttl, self.by())?;
        let r = self
            .etcd
            .create_with_lease(&self.key, self.advertise.as_bytes(), lease, self.by());
        match r {
            Ok(Created::Won(rev)) => Ok(Some(Won {
                epoch: rev as u64,
                lease,
                ttl,
                sent,
            })),
            Ok(Created::Held(_)) => {
                let _ = self.etcd.revoke(lease, self.by());
                Ok(None)
            }
            Err(e) => {
                let _ = self.etcd.revoke(lease, self.by());
                Err(e)
            }
        }
    }

    /// Leads until the lease is lost or the master stops.
    fn lead(&mut self, won: Won) {
        let Won {
            epoch,
            lease,
            ttl,
            sent,
        } = won;
        let margin = self.ha.margin();
        // The whole log first: no entry can be added any more by the previous leader (its
        // writes are conditioned on its epoch, and the leader key is ours now).
        let caught_up = Instant::now();
        let journal = match self.take_over(epoch) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(
                    epoch,
                    "store master: won, but cannot take over the op-log: {e}; resigning"
                );
                // Nothing was promoted: the master stands by as it was.
                let _ = self.etcd.revoke(lease, self.by());
                return;
            }
        };
        self.authority
            .grant_until(sent + ttl.saturating_sub(margin));
        self.set_role(Role::Leader(epoch));
        tracing::info!(
            epoch,
            addr = %self.advertise,
            log = self.follower.applied(),
            catch_up_ms = caught_up.elapsed().as_millis() as u64,
            "store master: leading"
        );
        let period = ttl / RENEWALS_PER_TTL;
        let mut next = sent + period;
        let lost = loop {
            if journal.failure().is_some() {
                break Some("an op-log write failed");
            }
            if self.stopping() {
                // Resign: the key goes with the lease, so a standby need not wait it out.
                self.authority.revoke();
                let _ = self.etcd.revoke(lease, self.by());
                break None;
            }
            let now = Instant::now();
            if now < next {
                std::thread::sleep((next - now).min(Duration::from_millis(50)));
                continue;
            }
            let sent = Instant::now();
            let by = (sent + period).min(sent + self.ha.call_timeout);
            match self.renew(lease, epoch, by) {
                Ok(Ok(())) => {
                    // etcd restarts the lease's full TTL when it receives the renewal,
                    // which is after `sent`.
                    self.authority
                        .grant_until(sent + ttl.saturating_sub(margin));
                    next = sent + period;
                }
                Ok(Err(why)) => break Some(why),
                Err(e) => {
                    if !self.authority.is_valid() {
                        tracing::warn!("store master: lease renewal failed: {e}");
                        break Some("lease renewals failed until the lease may have expired");
                    }
                    // Retried soon: the authority lapses by itself if none succeeds.
                    next = Instant::now() + Duration::from_millis(100);
                }
            }
        };
        self.authority.revoke();
        journal.close();
        self.set_role(Role::Standby);
        if let Some(lost) = lost {
            // Best effort: the lease may be gone already, or etcd out of reach.
            let _ = self.etcd.revoke(lease, self.by());
            tracing::warn!(
                epoch,
                "store master: no longer leading ({lost}); standing by"
            );
            self.restart_empty();
        }
    }

    /// Renews the lease and checks that the leader key is still this leader's (created
    /// at `epoch`): a key deleted by hand would otherwise let a standby lead beside it.
    /// `Ok(Err(why))`: leadership is lost.
    fn renew(
        &self,
        lease: i64,
        epoch: u64,
        by: Instant,
    ) -> Result<std::result::Result<(), &'static str>> {
        if !self.etcd.keep_alive(lease, by)? {
            return Ok(Err("etcd says the lease expired"));
        }
        match self.etcd.get(&self.key, by)? {
            Some(e) if e.create_revision as u64 == epoch => Ok(Ok(())),
            _ => Ok(Err("the leader key is gone or another master's")),
        }
    }

    /// Reads the op-log to its end, promotes the master and starts its journal.
    fn take_over(&mut self, epoch: u64) -> Result<Arc<EtcdJournal>> {
        // To the log's end: the journal writes from the entry after this read's last.
        self.follow(Read::Linearizable)?;
        let journal = EtcdJournal::start(
            self.etcd.clone(),
            Keys::new(&self.ha.cluster_id),
            epoch,
            self.follower.applied() + 1,
            self.authority.clone(),
            JournalConfig {
                snapshot_every: self.ha.snapshot_every,
                call_timeout: self.ha.call_timeout,
            },
        )?;
        if let Some(m) = &*self.shared.master() {
            m.set_epoch(epoch);
            m.promote();
            m.set_journal(Some(journal.clone()));
        }
        Ok(journal)
    }

    /// Drops the deposed leader's state: a new, empty master on the same address, that
    /// answers nothing until it wins again (and reads the op-log from its start).
    fn restart_empty(&mut self) {
        self.follower.reset();
        // The old one goes first: the new one binds its address.
        let old = self.shared.master().take();
        if let Some(m) = old {
            m.shutdown();
        }
        loop {
            match Master::start(self.cfg.clone()) {
                Ok(m) => {
                    *self.shared.master() = Some(m);
                    return;
                }
                Err(e) => {
                    tracing::warn!("store master: rebinding {} failed: {e}", self.cfg.listen);
                    if self.stopping() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        }
    }
}
