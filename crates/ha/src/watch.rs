//! Watches on etcd keys behind a synchronous facade: one task on the [`Etcd`] runtime
//! reads a watch stream and hands its events to a bounded, condvar-guarded queue that a
//! thread waits on with its own deadline.
//!
//! The task keeps the watch going by itself:
//! * **A member fails** (refused, closed, silent past the gRPC keep-alive, or without a
//!   raft leader): the task opens the watch on the next member, from the first revision
//!   it has not delivered whole, and drops what it delivered already.
//! * **History compacted** under the watch (etcd answers with a compact revision): the
//!   events in between are gone. The task opens a watch from the current revision and
//!   tells the consumer [`Watched::Resync`]: read the current state again.
//! * **The consumer lags** past the queue's capacity: the queue is emptied and the
//!   consumer told [`Watched::Resync`] as well; nothing grows without bound.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use etcd_client::{WatchFilterType, WatchOptions};

use crate::error::HaError;
use crate::etcd::{Etcd, Members};

/// Longest the task waits for a member to open a watch before it tries the next.
const OPEN_WITHIN: Duration = Duration::from_secs(2);
/// Pauses between failed opens: doubled from the first to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_LAST: Duration = Duration::from_secs(1);

/// What a watch covers.
#[derive(Debug, Clone)]
pub struct WatchSpec {
    key: String,
    prefix: bool,
    from: i64,
    capacity: usize,
    values: bool,
    /// Values are kept only for keys under this prefix (all, when empty).
    values_under: String,
    max_value_bytes: usize,
    puts_only: bool,
}

impl WatchSpec {
    /// One key, from now, values kept, a queue of 16 events holding at most 16 MiB of
    /// values.
    pub fn key(key: impl Into<String>) -> WatchSpec {
        WatchSpec {
            key: key.into(),
            prefix: false,
            from: 0,
            capacity: 16,
            values: true,
            values_under: String::new(),
            max_value_bytes: 16 << 20,
            puts_only: false,
        }
    }

    /// Every key that starts with `prefix` (every key for an empty one).
    pub fn prefix(prefix: impl Into<String>) -> WatchSpec {
        WatchSpec {
            prefix: true,
            ..WatchSpec::key(prefix)
        }
    }

    /// The first revision delivered (`0`, the default: from the revision the watch opens
    /// at, announced by a [`Watched::Resync`] so that the consumer reads the state once).
    pub fn from(mut self, revision: i64) -> WatchSpec {
        self.from = revision.max(0);
        self
    }

    /// Most events queued for the consumer (at least 1).
    pub fn capacity(mut self, events: usize) -> WatchSpec {
        self.capacity = events.max(1);
        self
    }

    /// Events without their values (a consumer that only needs to know what changed).
    pub fn without_values(mut self) -> WatchSpec {
        self.values = false;
        self
    }

    /// Values only for keys that start with `prefix`; other events come without theirs.
    pub fn values_under(mut self, prefix: impl Into<String>) -> WatchSpec {
        self.values = true;
        self.values_under = prefix.into();
        self
    }

    /// Most bytes of values queued for the consumer (etcd's values reach 1.5 MiB by
    /// default): past it the queue overflows as past its capacity.
    pub fn max_value_bytes(mut self, bytes: usize) -> WatchSpec {
        self.max_value_bytes = bytes;
        self
    }

    /// Deletions are not delivered (etcd filters them out).
    pub fn puts_only(mut self) -> WatchSpec {
        self.puts_only = true;
        self
    }
}

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Created or overwritten.
    Put,
    /// Deleted (by hand, by a range delete, or with its lease).
    Delete,
}

/// One change of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key (bytes that are not UTF-8 replaced).
    pub key: String,
    /// The new value (empty for a delete, or without values).
    pub value: Vec<u8>,
    /// The revision that created the key (0 for a delete).
    pub create_revision: i64,
    /// The revision of this change.
    pub mod_revision: i64,
}

/// What a consumer gets from [`Watch::next`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watched {
    /// Changes in revision order.
    Events(Vec<WatchEvent>),
    /// Changes up to this revision may have been missed (history compacted, the queue
    /// overflowed, or the watch started from now): read the current state (a read at or
    /// after it), then apply only later events. Later events follow from its next revision.
    Resync(i64),
}

#[derive(Debug, Default)]
struct State {
    events: VecDeque<WatchEvent>,
    /// Bytes of the queued events' values.
    bytes: usize,
    resync: Option<i64>,
    /// A watch stream is open on a member now.
    open: bool,
    /// Why the last open or stream failed.
    error: Option<HaError>,
    /// Watch streams opened (the first included).
    opens: u64,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    capacity: usize,
    max_value_bytes: usize,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn resync(&self, revision: i64) {
        let mut st = self.state();
        st.events.clear();
        st.bytes = 0;
        st.resync = Some(st.resync.map_or(revision, |r| r.max(revision)));
        drop(st);
        self.cv.notify_all();
    }

    fn push(&self, events: Vec<WatchEvent>) {
        let mut st = self.state();
        for e in events {
            if st.resync.is_some_and(|r| e.mod_revision <= r) {
                continue;
            }
            if st.events.len() >= self.capacity || st.bytes + e.value.len() > self.max_value_bytes {
                // The consumer lags: it reads the state again instead.
                st.events.clear();
                st.bytes = 0;
                st.resync = Some(e.mod_revision);
                continue;
            }
            st.bytes += e.value.len();
            st.events.push_back(e);
        }
        drop(st);
        self.cv.notify_all();
    }

    fn set_open(&self, open: bool, error: Option<HaError>) {
        let mut st = self.state();
        st.open = open;
        if open {
            st.opens += 1;
        }
        if error.is_some() {
            st.error = error;
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// A watch on a key or a range of keys; stops when dropped.
#[derive(Debug)]
pub struct Watch {
    shared: Arc<Shared>,
    task: tokio::task::AbortHandle,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watch {
    /// Waits until `deadline` for changes: a resync first if one is due, else every
    /// event queued. `None` when the deadline passed first.
    pub fn next(&self, deadline: Instant) -> Option<Watched> {
        let mut st = self.shared.state();
        loop {
            if let Some(r) = st.resync.take() {
                return Some(Watched::Resync(r));
            }
            if !st.events.is_empty() {
                st.bytes = 0;
                return Some(Watched::Events(st.events.drain(..).collect()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether the consumer misses nothing now: a stream is open and no resync is due.
    /// While not, what it learned from the watch may be out of date.
    pub fn live(&self) -> bool {
        let st = self.shared.state();
        st.open && st.resync.is_none()
    }

    /// Why the last attempt to open the watch, or the last stream, failed.
    pub fn last_error(&self) -> Option<HaError> {
        self.shared.state().error.clone()
    }

    /// Watch streams opened so far (more than one: the watch moved or restarted).
    pub fn opens(&self) -> u64 {
        self.shared.state().opens
    }
}

impl Etcd {
    /// Starts watching what `spec` names, on this connection's runtime, beginning with
    /// the member that answered last. Returns at once; the watch opens in the background
    /// and [`Watch::live`] says when it is open.
    pub fn watch(&self, spec: WatchSpec) -> Watch {
        let (rt, members, member) = self.parts();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            capacity: spec.capacity,
            max_value_bytes: spec.max_value_bytes,
        });
        let task = rt.spawn(run(members, member, spec, shared.clone()));
        Watch {
            shared,
            task: task.abort_handle(),
        }
    }
}

/// Why a stream ended.
enum Ended {
    /// The member or the path to it failed: the next member, after a pause.
    Failed(HaError),
    /// History was compacted past where the watch stood: again from now.
    Compacted,
}

/// Where the watch stands: every event before revision `from` is delivered, and the
/// first `delivered` of `from`'s own (a revision's events may span several responses,
/// and a stream that breaks between them is opened again at that revision).
#[derive(Debug, Clone, Copy)]
struct Cursor {
    /// 0: from whatever revision the next stream opens at.
    from: i64,
    delivered: usize,
}

impl Cursor {
    /// Whether an event of revision `rev` is new, moving the cursor past it.
    /// `replayed`: events of `from` the current stream sent so far (0 when it opened).
    fn admit(&mut self, rev: i64, replayed: &mut usize) -> bool {
        if rev < self.from {
            return false;
        }
        if rev == self.from {
            *replayed += 1;
            if *replayed <= self.delivered {
                return false;
            }
            self.delivered += 1;
        } else {
            *self = Cursor {
                from: rev,
                delivered: 1,
            };
            *replayed = 1;
        }
        true
    }
}

/// The watch task: opens streams until it is aborted.
async fn run(members: Arc<Members>, mut member: usize, spec: WatchSpec, shared: Arc<Shared>) {
    let n = members.len();
    let mut at = Cursor {
        from: spec.from,
        delivered: 0,
    };
    let mut pause = BACKOFF_FIRST;
    loop {
        let mut opts = WatchOptions::new()
            .with_start_revision(at.from)
            // Large revisions come in pieces below etcd's request size, not as one
            // message past the client's decoding limit.
            .with_fragment();
        if spec.prefix {
            opts = opts.with_prefix();
        }
        if spec.puts_only {
            opts = opts.with_filters([WatchFilterType::NoDelete]);
        }
        let key = spec.key.clone();
        let open = async {
            let mut c = members.client(member).await?;
            c.watch(key, Some(opts)).await
        };
        let opened = tokio::time::timeout(OPEN_WITHIN, open).await;
        let ended = match opened {
            Ok(Ok(mut stream)) => read(&mut stream, &spec, &shared, &mut at, &mut pause).await,
            Ok(Err(e)) => Ended::Failed(HaError::from_etcd("etcd watch", e)),
            Err(_) => Ended::Failed(HaError::Timeout {
                what: "etcd watch",
                after: OPEN_WITHIN,
            }),
        };
        match ended {
            Ended::Compacted => {
                shared.set_open(false, None);
                at = Cursor {
                    from: 0,
                    delivered: 0,
                };
            }
            Ended::Failed(e) => {
                tracing::debug!(member, "etcd watch on {:?} failed: {e}", spec.key);
                shared.set_open(false, Some(e));
                member = (member + 1) % n;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(BACKOFF_LAST);
            }
        }
    }
}

/// Reads one stream until it ends, delivering its events.
async fn read(
    stream: &mut etcd_client::WatchStream,
    spec: &WatchSpec,
    shared: &Shared,
    at: &mut Cursor,
    pause: &mut Duration,
) -> Ended {
    // Events of `at.from` this stream sent (the first ones repeat what was delivered).
    let mut replayed = 0usize;
    loop {
        let msg = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                return Ended::Failed(HaError::Unavailable {
                    what: "etcd watch",
                    reason: "the member closed the stream".into(),
                    source: None,
                });
            }
            Err(e) => return Ended::Failed(HaError::from_etcd("etcd watch", e)),
        };
        if msg.compact_revision() != 0 {
            tracing::debug!(
                compacted = msg.compact_revision(),
                from = at.from,
                "etcd watch on {:?}: history compacted, starting over",
                spec.key
            );
            return Ended::Compacted;
        }
        if msg.canceled() {
            return Ended::Failed(HaError::Unavailable {
                what: "etcd watch",
                reason: format!("canceled by etcd: {}", msg.cancel_reason()),
                source: None,
            });
        }
        if msg.created() {
            *pause = BACKOFF_FIRST;
            if at.from == 0 {
                // From now: what came before is the consumer's to read.
                let now = msg.header().map_or(0, |h| h.revision());
                shared.resync(now);
                *at = Cursor {
                    from: now + 1,
                    delivered: 0,
                };
            }
            shared.set_open(true, None);
            continue;
        }
        let mut out = Vec::with_capacity(msg.events().len());
        for kv in msg.events().iter().filter_map(|ev| ev.kv()) {
            if at.admit(kv.mod_revision(), &mut replayed) {
                let keep = spec.values && kv.key().starts_with(spec.values_under.as_bytes());
                out.push(to_event(kv, keep));
            }
        }
        shared.push(out);
    }
}

fn to_event(kv: &etcd_client::KeyValue, values: bool) -> WatchEvent {
    // A deleted key comes with version 0 (the crate's event type panics on a type number
    // it does not know, and every byte from the network is hostile).
    let kind = if kv.version() == 0 {
        EventKind::Delete
    } else {
        EventKind::Put
    };
    WatchEvent {
        kind,
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: if values && kind == EventKind::Put {
            kv.value().to_vec()
        } else {
            Vec::new()
        },
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds one stream's revisions through the cursor: those admitted.
    fn stream(at: &mut Cursor, revs: &[i64]) -> Vec<i64> {
        let mut replayed = 0;
        revs.iter()
            .copied()
            .filter(|&r| at.admit(r, &mut replayed))
            .collect()
    }

    #[test]
    fn a_stream_opened_again_delivers_each_event_once() {
        let mut at = Cursor {
            from: 5,
            delivered: 0,
        };
        // Revision 7 has three events; the stream breaks after two of them.
        assert_eq!(stream(&mut at, &[5, 6, 7, 7]), [5, 6, 7, 7]);
        assert_eq!((at.from, at.delivered), (7, 2));
        // The next stream opens at 7 and sends all of it again, then more.
        assert_eq!(stream(&mut at, &[7, 7, 7, 8, 8]), [7, 8, 8]);
        assert_eq!((at.from, at.delivered), (8, 2));
        // A stream that sends nothing new, then breaks.
        assert_eq!(stream(&mut at, &[8, 8]), Vec::<i64>::new());
        assert_eq!(stream(&mut at, &[8, 8, 9]), [9]);
        // Older revisions are never delivered again.
        assert_eq!(stream(&mut at, &[3, 9, 10]), [10]);
    }
}
