//! The store's op-log on etcd: the leader's [`EtcdJournal`] writes every request's
//! changes before the reply goes out, and standbys' [`Follower`]s apply them in order.
//!
//! Keys, under `pagewire-store/<cluster id>/`:
//! * `oplog/<seq>` (`seq` zero-padded to 20 digits, so that key order is log order): one
//!   entry, an encoded batch of records ([`pagewire_store::oplog`]). Written in one
//!   transaction that succeeds only if the leader key's create revision is still the
//!   writer's epoch and the entry does not exist yet: a deposed leader's write fails at
//!   etcd, whatever its clock says.
//! * `snapshot/<seq>/<i>`: chunk `i` of the metadata after entry `seq`, and
//!   `snapshot/latest` = `"<seq> <chunks>"`. Written every `snapshot_every` entries;
//!   entries up to `seq` and older snapshots are then deleted and etcd's history compacted.
//!
//! Group commit: requests whose records arrive while a transaction is in flight go into
//! the next one, so the master does not serialize on etcd's latency.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pagewire_store::oplog::{self, Journal, JournalError, Record};
use pagewire_store::{Authority, Master};

use crate::error::{HaError, Result};
use crate::etcd::{Etcd, Guarded, Read};

/// Largest encoded entry or snapshot chunk (etcd refuses requests past 1.5 MiB by default).
pub const MAX_ENTRY: usize = 1 << 20;

/// Most entries one read of the log returns.
const READ_BATCH: i64 = 256;

/// Most chunks a snapshot may name (bounds what a hostile `latest` can make a reader do).
const MAX_CHUNKS: u64 = 1 << 16;

/// The op-log's keys for one cluster.
#[derive(Debug, Clone)]
pub struct Keys {
    /// The leader key (its create revision is the epoch).
    pub leader: String,
    oplog: String,
    snapshot: String,
}

/// `prefix` with its last byte incremented: the end of the range of keys under it.
fn range_end(prefix: &str) -> String {
    let mut b = prefix.as_bytes().to_vec();
    *b.last_mut().expect("non-empty prefix") += 1;
    String::from_utf8(b).expect("ASCII prefix")
}

impl Keys {
    /// The keys of cluster `cluster_id`.
    pub fn new(cluster_id: &str) -> Keys {
        Keys {
            leader: crate::leader::leader_key(cluster_id),
            oplog: format!("pagewire-store/{cluster_id}/oplog/"),
            snapshot: format!("pagewire-store/{cluster_id}/snapshot/"),
        }
    }

    /// Whether `key` is one of the op-log's entries or snapshot keys.
    pub(crate) fn is_log_key(&self, key: &str) -> bool {
        key.starts_with(&self.oplog) || key.starts_with(&self.snapshot)
    }

    /// The prefix of the op-log's entries (not of its snapshots).
    pub(crate) fn entries(&self) -> &str {
        &self.oplog
    }

    /// The key of entry `seq`.
    pub fn entry(&self, seq: u64) -> String {
        format!("{}{seq:020}", self.oplog)
    }

    fn latest(&self) -> String {
        format!("{}latest", self.snapshot)
    }

    fn chunk(&self, seq: u64, i: u64) -> String {
        format!("{}{seq:020}/{i:06}", self.snapshot)
    }

    fn seq_of(&self, key: &str) -> Result<u64> {
        key.strip_prefix(&self.oplog)
            .filter(|s| s.len() == 20)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| HaError::Log {
                what: key.to_string(),
                reason: "not an op-log entry key".into(),
            })
    }
}

/// Settings of a leader's journal.
#[derive(Debug, Clone)]
pub struct JournalConfig {
    /// Entries between snapshots.
    pub snapshot_every: u64,
    /// Deadline of one etcd call.
    pub call_timeout: Duration,
}

enum Item {
    Records(u64, Vec<Record>),
    Snapshot(Vec<Record>),
}

#[derive(Default)]
struct State {
    queue: VecDeque<Item>,
    /// Tickets handed out (one per request with records).
    appended: u64,
    /// Tickets whose records are in etcd.
    committed: u64,
    failed: Option<JournalError>,
    stop: bool,
    /// Entries written since the last snapshot.
    since_snapshot: u64,
    /// A snapshot is queued or being written.
    snapshotting: bool,
}

struct Inner {
    state: Mutex<State>,
    cv: Condvar,
    cfg: JournalConfig,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A leader's op-log writer: one thread that commits queued records to etcd, merging
/// whatever queued while its last transaction was in flight.
pub struct EtcdJournal {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for EtcdJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.inner.state();
        f.debug_struct("EtcdJournal")
            .field("appended", &st.appended)
            .field("committed", &st.committed)
            .field("failed", &st.failed)
            .finish()
    }
}

impl EtcdJournal {
    /// Starts the writer of the leader whose term is `epoch`, at entry `next_seq`. On a
    /// failed write it revokes `authority` at once (the master must not answer from a
    /// state the log may not have), and every wait fails from then on.
    pub fn start(
        etcd: Etcd,
        keys: Keys,
        epoch: u64,
        next_seq: u64,
        authority: Authority,
        cfg: JournalConfig,
    ) -> Result<Arc<EtcdJournal>> {
        let inner = Arc::new(Inner {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            cfg,
        });
        let mut w = Writer {
            inner: inner.clone(),
            etcd,
            keys,
            epoch: epoch as i64,
            seq: next_seq,
            last_rev: 0,
            authority,
        };
        let thread = std::thread::Builder::new()
            .name("pagewire-oplog".into())
            .spawn(move || w.run())
            .map_err(|e| HaError::Io {
                what: "spawn the op-log writer",
                source: Arc::new(e),
            })?;
        Ok(Arc::new(EtcdJournal {
            inner,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Why the journal failed, if it did (the leader then stands down).
    pub fn failure(&self) -> Option<JournalError> {
        self.inner.state().failed.clone()
    }

    /// Stops the writer (after what it is writing); later waits fail. Idempotent.
    pub fn close(&self) {
        {
            let mut st = self.inner.state();
            st.stop = true;
            if st.failed.is_none() {
                st.failed = Some(JournalError::Deposed);
            }
        }
        self.inner.cv.notify_all();
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }
}

impl Drop for EtcdJournal {
    fn drop(&mut self) {
        self.close();
    }
}

impl Journal for EtcdJournal {
    fn append(&self, records: Vec<Record>) -> u64 {
        let mut st = self.inner.state();
        if records.is_empty() {
            return st.appended;
        }
        st.appended += 1;
        let t = st.appended;
        st.queue.push_back(Item::Records(t, records));
        drop(st);
        self.inner.cv.notify_all();
        t
    }

    fn wait(&self, ticket: u64, deadline: Instant) -> std::result::Result<(), JournalError> {
        let mut st = self.inner.state();
        loop {
            if st.committed >= ticket {
                return Ok(());
            }
            if let Some(e) = &st.failed {
                return Err(e.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(JournalError::Timeout);
            }
            st = self
                .inner
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn snapshot_due(&self) -> bool {
        let st = self.inner.state();
        !st.snapshotting && st.since_snapshot >= self.inner.cfg.snapshot_every
    }

    fn append_snapshot(&self, records: Vec<Record>) {
        let mut st = self.inner.state();
        st.snapshotting = true;
        st.queue.push_back(Item::Snapshot(records));
        drop(st);
        self.inner.cv.notify_all();
    }
}

struct Writer {
    inner: Arc<Inner>,
    etcd: Etcd,
    keys: Keys,
    epoch: i64,
    /// The next entry's number.
    seq: u64,
    /// The revision of the last write.
    last_rev: i64,
    authority: Authority,
}

impl Writer {
    fn run(&mut self) {
        loop {
            let items: Vec<Item> = {
                let mut st = self.inner.state();
                while st.queue.is_empty() && !st.stop {
                    st = self.inner.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                if st.stop || st.failed.is_some() {
                    return;
                }
                st.queue.drain(..).collect()
            };
            let mut group = Vec::new();
            let mut ticket = None;
            for item in items {
                match item {
                    Item::Records(t, recs) => {
                        group.extend(recs);
                        ticket = Some(t);
                    }
                    Item::Snapshot(recs) => {
                        if !self.commit(&mut group, ticket.take()) {
                            return;
                        }
                        if !self.snapshot(recs) {
                            return;
                        }
                    }
                }
            }
            if !self.commit(&mut group, ticket) {
                return;
            }
        }
    }

    fn fail(&self, e: JournalError) {
        // No reply may go out from a state the log may not hold.
        self.authority.revoke();
        tracing::warn!("store master: {e}; standing down");
        self.inner.state().failed = Some(e);
        self.inner.cv.notify_all();
    }

    /// Writes one guarded key; `false` (and the journal failed) when it did not land.
    /// A failed call is tried again while this master may still answer (etcd electing
    /// a new raft leader takes a second or two).
    fn put(&mut self, key: String, value: Vec<u8>, absent: bool) -> bool {
        loop {
            let by = Instant::now() + self.inner.cfg.call_timeout;
            let r = self.etcd.put_guarded(
                &self.keys.leader,
                self.epoch,
                &key,
                value.clone(),
                absent,
                by,
            );
            let e = match r {
                Ok(Guarded::Done(rev)) => {
                    self.last_rev = rev;
                    return true;
                }
                Ok(Guarded::NotOwner) => JournalError::Deposed,
                // Written by an earlier try that seemed to fail (here, or inside the etcd
                // client, which goes on with the next member when one is slow): only this
                // term writes entries from its first one on.
                Ok(Guarded::Exists) => match self.etcd.get(&key, by) {
                    Ok(Some(e)) if e.value == value => return true,
                    Ok(_) => JournalError::Failed(format!("{key} holds another entry")),
                    Err(e) => JournalError::Failed(e.to_string()),
                },
                Err(e) if self.authority.is_valid() && !self.inner.state().stop => {
                    tracing::debug!("store master: op-log write of {key} failed, retrying: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                Err(e) => JournalError::Failed(e.to_string()),
            };
            self.fail(e);
            return false;
        }
    }

    /// Commits `group` as entries (one, unless it is past [`MAX_ENTRY`]) and marks
    /// `ticket` committed.
    fn commit(&mut self, group: &mut Vec<Record>, ticket: Option<u64>) -> bool {
        let Some(ticket) = ticket else {
            return true;
        };
        for chunk in oplog::encode_chunks(group, MAX_ENTRY) {
            let key = self.keys.entry(self.seq);
            if !self.put(key, chunk, true) {
                return false;
            }
            self.seq += 1;
            self.inner.state().since_snapshot += 1;
        }
        group.clear();
        let mut st = self.inner.state();
        st.committed = st.committed.max(ticket);
        drop(st);
        self.inner.cv.notify_all();
        true
    }

    /// Writes a snapshot after the last entry, then deletes what it makes useless. Only
    /// a lost epoch fails the journal; other failures leave the log as it was (longer).
    fn snapshot(&mut self, records: Vec<Record>) -> bool {
        let seq = self.seq - 1;
        let chunks = oplog::encode_chunks(&records, MAX_ENTRY);
        let n = chunks.len() as u64;
        let started = Instant::now();
        for (i, c) in chunks.into_iter().enumerate() {
            if !self.put(self.keys.chunk(seq, i as u64), c, false) {
                return false;
            }
        }
        if !self.put(self.keys.latest(), format!("{seq} {n}").into_bytes(), false) {
            return false;
        }
        {
            let mut st = self.inner.state();
            st.since_snapshot = 0;
            st.snapshotting = false;
        }
        let by = Instant::now() + self.inner.cfg.call_timeout;
        let oplog_from = self.keys.entry(0);
        let snap_from = self.keys.chunk(0, 0);
        let r = self
            .etcd
            .delete_range(&oplog_from, &self.keys.entry(seq + 1), by)
            .and_then(|_| {
                self.etcd
                    .delete_range(&snap_from, &self.keys.chunk(seq, 0), by)
            })
            .and_then(|_| self.etcd.compact(self.last_rev, by));
        match r {
            Ok(()) => tracing::info!(
                seq,
                chunks = n,
                records = records.len(),
                ms = started.elapsed().as_millis() as u64,
                "store master: op-log snapshot written, older entries deleted"
            ),
            Err(e) => tracing::warn!(seq, "store master: op-log clean-up after a snapshot: {e}"),
        }
        true
    }
}

/// A standby's reader of the op-log: loads the latest snapshot, then applies entries in
/// order to its master.
#[derive(Debug)]
pub struct Follower {
    keys: Keys,
    /// The last entry applied (0: none).
    applied: u64,
}

impl Follower {
    /// A reader that has applied nothing (its master's metadata must be empty).
    pub fn new(keys: Keys) -> Follower {
        Follower { keys, applied: 0 }
    }

    /// The last entry applied.
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Starts over (the master's metadata was dropped).
    pub fn reset(&mut self) {
        self.applied = 0;
    }

    /// Applies every entry etcd holds after the last one applied, loading the latest
    /// snapshot first when the entries after it are gone. Returns how many entries were
    /// applied. Stops at the first entry or snapshot that does not decode (typed
    /// [`HaError::Log`]): skipping one could skip a removal.
    ///
    /// With [`Read::Serializable`] it applies what the answering member has, which may
    /// lag the log's end but is a prefix of it: entries are created in order and deleted
    /// only after a snapshot covers them, so any committed state shows either the next
    /// entry, nothing after the last applied one, or a snapshot past it. A standby that
    /// follows the log reads this way (no raft round per entry for etcd); one that takes
    /// over must read [`Read::Linearizable`], to its end.
    pub fn catch_up(
        &mut self,
        etcd: &Etcd,
        master: &Master,
        read: Read,
        timeout: Duration,
    ) -> Result<u64> {
        let mut applied = 0;
        let mut loads = 0;
        let end = range_end(&self.keys.oplog);
        loop {
            let by = Instant::now() + timeout;
            let from = self.keys.entry(self.applied + 1);
            let got = etcd.range(&from, &end, READ_BATCH, read, by)?;
            let gap = match got.first() {
                Some((k, _)) => self.keys.seq_of(k)? != self.applied + 1,
                None => self
                    .latest(etcd, read, by)?
                    .is_some_and(|(s, _)| s > self.applied),
            };
            if gap {
                // Twice at most: a snapshot replaced under the first load; more is a log
                // with a hole no snapshot covers.
                loads += 1;
                if loads > 2 {
                    return Err(HaError::Log {
                        what: from,
                        reason: "entries are missing after the latest snapshot".into(),
                    });
                }
                self.load_snapshot(etcd, master, read, by)?;
                continue;
            }
            let n = got.len() as i64;
            for (k, v) in got {
                let seq = self.keys.seq_of(&k)?;
                if seq != self.applied + 1 {
                    // Deleted under the read by a snapshot: the next round loads it.
                    break;
                }
                self.apply_entry(master, &k, &v)?;
                self.applied = seq;
                applied += 1;
            }
            if n < READ_BATCH {
                return Ok(applied);
            }
        }
    }

    /// Applies entries that a watch delivered with their values, `(key, value)` in
    /// revision order, without asking etcd: those already applied are skipped. `Ok(false)`
    /// when they do not go on from the last entry applied (the watch opened after an
    /// entry, or a snapshot replaced some): the caller reads etcd with
    /// [`Follower::catch_up`] instead. Stops at an entry that does not decode, as
    /// `catch_up` does.
    pub fn apply_delivered(
        &mut self,
        master: &Master,
        entries: &[(String, Vec<u8>)],
    ) -> Result<bool> {
        for (k, v) in entries {
            let seq = self.keys.seq_of(k)?;
            if seq <= self.applied {
                continue;
            }
            if seq != self.applied + 1 {
                return Ok(false);
            }
            self.apply_entry(master, k, v)?;
            self.applied = seq;
        }
        Ok(true)
    }

    fn apply_entry(&self, master: &Master, key: &str, value: &[u8]) -> Result<()> {
        let recs = oplog::decode(value).map_err(|e| HaError::Log {
            what: key.to_string(),
            reason: e.to_string(),
        })?;
        let misfits = master.apply_log(&recs);
        if misfits > 0 {
            tracing::warn!(key = %key, misfits, "store standby: op-log records that do not fit the metadata");
        }
        Ok(())
    }

    fn latest(&self, etcd: &Etcd, read: Read, by: Instant) -> Result<Option<(u64, u64)>> {
        let Some(e) = etcd.get_read(&self.keys.latest(), read, by)? else {
            return Ok(None);
        };
        let bad = || HaError::Log {
            what: self.keys.latest(),
            reason: format!(
                "{:?} is not \"<seq> <chunks>\"",
                String::from_utf8_lossy(&e.value)
            ),
        };
        let s = std::str::from_utf8(&e.value).map_err(|_| bad())?;
        let (seq, n) = s.split_once(' ').ok_or_else(bad)?;
        let seq: u64 = seq.parse().map_err(|_| bad())?;
        let n: u64 = n.parse().map_err(|_| bad())?;
        if n == 0 || n > MAX_CHUNKS {
            return Err(bad());
        }
        Ok(Some((seq, n)))
    }

    fn load_snapshot(
        &mut self,
        etcd: &Etcd,
        master: &Master,
        read: Read,
        by: Instant,
    ) -> Result<()> {
        let Some((seq, n)) = self.latest(etcd, read, by)? else {
            return Err(HaError::Log {
                what: self.keys.latest(),
                reason: format!(
                    "entries after {} are missing and no snapshot exists",
                    self.applied
                ),
            });
        };
        let mut records = Vec::new();
        for i in 0..n {
            let key = self.keys.chunk(seq, i);
            let Some(e) = etcd.get_read(&key, read, by)? else {
                return Err(HaError::Log {
                    what: key,
                    reason: "snapshot chunk missing (a newer snapshot replaced it?)".into(),
                });
            };
            records.extend(oplog::decode(&e.value).map_err(|e| HaError::Log {
                what: key.clone(),
                reason: e.to_string(),
            })?);
        }
        master.reset_metadata();
        let misfits = master.apply_log(&records);
        if misfits > 0 {
            tracing::warn!(
                seq,
                misfits,
                "store standby: snapshot records that do not fit"
            );
        }
        tracing::info!(
            seq,
            records = records.len(),
            "store standby: op-log snapshot loaded"
        );
        self.applied = seq;
        Ok(())
    }
}
