//! The master server: the decision core ([`crate::core`]) behind a TCP listener.
//!
//! Threads: one accepts, one ticks the core (held space, silent clients, unfinished puts,
//! eviction), one per client connection. Connections are capped in total. Before its
//! `Hello` a connection holds a pre-`Hello` slot (module `admission`), which makes room for every
//! newcomer by closing older silent connections, so a flood of idle sockets cannot lock
//! clients out; its first frame may be no longer than the largest valid `Hello`. Every
//! frame has a deadline once its first byte arrived, the bytes buffered for requests are
//! capped across all connections, and a connection quiet for longer than the client TTL
//! is closed. What remote peers can cause at will (refused, evicted or unauthorized
//! connections, bad frames) is logged as counts, at most one line per second. The master
//! never touches the data path: requests are metadata only. A leader with a [`Journal`]
//! (its op-log) writes a reply only once the changes it shows are committed there.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::admission::{Admission, Pending};
use crate::core::{CoreConfig, MasterCore, Millis};
use crate::error::{Code, Result, StoreError};
use crate::net::{self, ReadError};
use crate::oplog::{Journal, Record};
use crate::proto::{self, Header, Request, Response, Stats, Welcome};

/// Master settings.
#[derive(Debug, Clone)]
pub struct MasterConfig {
    /// Where to listen (`127.0.0.1:50051`; port 0 picks one).
    pub listen: SocketAddr,
    /// The decision rules' knobs.
    pub core: CoreConfig,
    /// Shared secret clients must present (none: any client is accepted).
    pub token: Option<Vec<u8>>,
    /// Cap on one request's body.
    pub max_frame: u32,
    /// Most client connections at once.
    pub max_connections: usize,
    /// Most connections that have not said `Hello` yet; a newcomer past it closes the
    /// oldest such connection of the address holding the most of them.
    pub max_unauthenticated: usize,
    /// Most connections from one source address that have not said `Hello` yet; a
    /// newcomer past it closes that address's oldest such connection.
    pub max_unauthenticated_per_addr: usize,
    /// Cap on request bytes buffered across all connections at once (at least
    /// `max_frame`). A frame that would pass it is answered `NoSpace` and its connection
    /// closed.
    pub max_buffered: usize,
    /// Deadline for a frame once its first byte arrived, and for writing a reply.
    pub frame_timeout: Duration,
    /// Period of the core's housekeeping.
    pub tick: Duration,
    /// The epoch announced in `Welcome` (none: a random one). A leader elected through
    /// a coordination service gives its term here, so that clients can tell it from a
    /// deposed one.
    pub epoch: Option<u64>,
    /// The right to answer, when it is granted from outside (a leader's lease): no reply
    /// is written and no connection accepted while it is not valid.
    pub authority: Option<Authority>,
}

/// A leader's right to answer, valid until an instant that its lease keeper moves
/// forward. Checked before every reply is written: a master whose lease may have expired
/// (its process was stopped, etcd is out of reach) falls silent by itself, without
/// waiting for the thread that renews the lease to notice.
#[derive(Debug, Clone)]
pub struct Authority {
    origin: Instant,
    /// Nanoseconds after `origin` until which replies may go out (0: none).
    until_ns: Arc<AtomicU64>,
}

impl Default for Authority {
    fn default() -> Self {
        Authority::new()
    }
}

impl Authority {
    /// No right to answer yet.
    pub fn new() -> Authority {
        Authority {
            origin: Instant::now(),
            until_ns: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Valid until `until`.
    pub fn grant_until(&self, until: Instant) {
        let ns = until.saturating_duration_since(self.origin).as_nanos();
        self.until_ns
            .store(u64::try_from(ns).unwrap_or(u64::MAX), Ordering::Release);
    }

    /// Not valid any more (until granted again).
    pub fn revoke(&self) {
        self.until_ns.store(0, Ordering::Release);
    }

    /// Whether replies may go out now.
    pub fn is_valid(&self) -> bool {
        let now = self.origin.elapsed().as_nanos();
        now < u128::from(self.until_ns.load(Ordering::Acquire))
    }
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            core: CoreConfig::default(),
            token: None,
            max_frame: proto::DEFAULT_MAX_FRAME,
            max_connections: 1024,
            max_unauthenticated: 64,
            max_unauthenticated_per_addr: 16,
            max_buffered: 256 << 20,
            frame_timeout: Duration::from_secs(5),
            tick: Duration::from_millis(100),
            epoch: None,
            authority: None,
        }
    }
}

struct Shared {
    cfg: MasterConfig,
    core: Mutex<MasterCore>,
    origin: Instant,
    shutdown: AtomicBool,
    /// A clone of every connection's socket, to close them all at shutdown.
    conns: Mutex<HashMap<u64, Arc<TcpStream>>>,
    next_conn: AtomicU64,
    open: AtomicUsize,
    admission: Arc<Admission>,
    budget: Budget,
    noise: Noise,
    /// Where a leader's changes go before it answers (none: not logging).
    journal: Mutex<Option<Arc<dyn Journal>>>,
    /// The journal's ticket of the last change that was not a publication (a removal,
    /// an eviction, a mount, a remount or an unmount): space it freed or a segment it
    /// changed must be in the log before a placement may hand it out. Updated and read
    /// under the core's lock.
    barrier: AtomicU64,
}

/// What a request's reply waits for in the journal.
struct Logged {
    journal: Arc<dyn Journal>,
    /// Everything appended so far: a reply that may show any change waits for this.
    all: u64,
    /// A request that changes nothing but reservations (a placement, a read; see
    /// [`changes_only_reservations`]) waits only for the last [`Shared::barrier`] (a
    /// placement's own evictions included): the space it hands out is free in the logged
    /// state too, so a new leader would neither hand it to anyone else nor hold an object
    /// in it. Reservations are not logged: a new leader forgets them, and the remount's
    /// new remote key fences their writers.
    placement: u64,
}

impl Shared {
    /// Whether this master may answer now (always, unless an [`Authority`] says no).
    fn may_answer(&self) -> bool {
        self.cfg.authority.as_ref().is_none_or(Authority::is_valid)
    }
    fn now(&self) -> Millis {
        self.origin.elapsed().as_millis() as Millis
    }
    fn core(&self) -> MutexGuard<'_, MasterCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn journal(&self) -> Option<Arc<dyn Journal>> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
    /// Hands the changes the core recorded to the journal, under the core's lock (so
    /// that the log's order is the changes' order); the tickets to wait for before
    /// answering.
    fn journal_append(&self, core: &mut MasterCore) -> Option<Logged> {
        let j = self.journal()?;
        let records = core.take_log();
        let frees = records.iter().any(|r| !matches!(r, Record::Publish { .. }));
        let ticket = j.append(records);
        if frees {
            self.barrier.store(ticket, Ordering::Release);
        }
        if j.snapshot_due() {
            j.append_snapshot(core.snapshot());
        }
        Some(Logged {
            all: ticket,
            placement: self.barrier.load(Ordering::Acquire),
            journal: j,
        })
    }
}

/// A running master. Dropping it does not stop it; call [`Master::shutdown`].
pub struct Master {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Master").field("addr", &self.addr).finish()
    }
}

/// A fresh random seed (client ids and the epoch must differ across restarts).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl Master {
    /// Binds the listener and starts serving.
    pub fn start(cfg: MasterConfig) -> Result<Master> {
        cfg.core.validate().map_err(|reason| StoreError::Config {
            key: "master".into(),
            value: String::new(),
            reason,
        })?;
        let bad = |key: &str, value: usize, reason: &str| StoreError::Config {
            key: key.into(),
            value: value.to_string(),
            reason: reason.into(),
        };
        if cfg.max_frame < 4096 {
            return Err(bad("max_frame", cfg.max_frame as usize, "at least 4096"));
        }
        if cfg.max_buffered < cfg.max_frame as usize {
            return Err(bad("max_buffered", cfg.max_buffered, "at least max_frame"));
        }
        for (key, v) in [
            ("max_connections", cfg.max_connections),
            ("max_unauthenticated", cfg.max_unauthenticated),
            (
                "max_unauthenticated_per_addr",
                cfg.max_unauthenticated_per_addr,
            ),
        ] {
            if v == 0 {
                return Err(bad(key, v, "at least 1"));
            }
        }
        let listener = TcpListener::bind(cfg.listen)
            .map_err(|e| StoreError::io(format!("bind master listener {}", cfg.listen), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| StoreError::io("master listener address", e))?;
        let mut core = MasterCore::new(cfg.core.clone(), random_seed());
        if let Some(e) = cfg.epoch {
            core.set_epoch(e);
        }
        let shared = Arc::new(Shared {
            core: Mutex::new(core),
            origin: Instant::now(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            open: AtomicUsize::new(0),
            admission: Admission::new(cfg.max_unauthenticated, cfg.max_unauthenticated_per_addr),
            budget: Budget::new(cfg.max_buffered),
            noise: Noise::new(NOISE_INTERVAL),
            journal: Mutex::new(None),
            barrier: AtomicU64::new(0),
            cfg,
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("pagewire-store-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| StoreError::io("spawn master accept thread", e))?;
        let s = shared.clone();
        let tick = std::thread::Builder::new()
            .name("pagewire-store-tick".into())
            .spawn(move || {
                while !s.shutdown.load(Ordering::Acquire) {
                    std::thread::sleep(s.cfg.tick);
                    if !s.may_answer() {
                        // A standby's metadata follows the leader's log: evicting or
                        // dropping anything on its own would make it differ.
                        s.noise.flush();
                        continue;
                    }
                    let now = s.now();
                    let mut core = s.core();
                    core.tick(now);
                    // Evictions and lapsed segments are logged like a request's changes
                    // (nobody waits for them).
                    s.journal_append(&mut core);
                    drop(core);
                    s.noise.flush();
                }
            })
            .map_err(|e| StoreError::io("spawn master tick thread", e))?;
        tracing::info!(%addr, "pagewire store master listening");
        Ok(Master {
            shared,
            addr,
            threads: Mutex::new(vec![accept, tick]),
        })
    }

    /// The listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This instance's epoch: [`MasterConfig::epoch`], or a random id (changes on restart).
    pub fn epoch(&self) -> u64 {
        self.shared.core().epoch()
    }

    /// Sets the epoch announced in later `Welcome`s: a leader's term, known once it won
    /// its election (the master may listen, without the right to answer, before that).
    pub fn set_epoch(&self, epoch: u64) {
        self.shared.core().set_epoch(epoch);
    }

    /// Current counts.
    pub fn stats(&self) -> Stats {
        self.shared.core().stats()
    }

    /// Sends this master's changes to `journal` from now on, each request's committed
    /// before its reply goes out (a leader's op-log); `None` stops logging.
    pub fn set_journal(&self, journal: Option<Arc<dyn Journal>>) {
        let mut core = self.shared.core();
        core.set_logging(journal.is_some());
        // Tickets count from the new journal's start; everything before it is logged.
        self.shared.barrier.store(0, Ordering::Release);
        *self
            .shared
            .journal
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = journal;
    }

    /// A standby applies records of the leader's op-log (see
    /// [`MasterCore::apply`](crate::core::MasterCore::apply)); how many did not fit.
    pub fn apply_log(&self, records: &[Record]) -> usize {
        let now = self.shared.now();
        self.shared.core().apply(now, records)
    }

    /// Forgets all metadata (a standby about to load a snapshot); the epoch stays.
    pub fn reset_metadata(&self) {
        let mut core = self.shared.core();
        let epoch = core.epoch();
        *core = MasterCore::new(self.shared.cfg.core.clone(), random_seed());
        core.set_epoch(epoch);
    }

    /// A standby that won the election, once it applied the whole log: segments await
    /// their owners for one client TTL, and changes are logged (see
    /// [`MasterCore::promote`](crate::core::MasterCore::promote)).
    pub fn promote(&self) {
        let now = self.shared.now();
        self.shared.core().promote(now);
    }

    /// Stops accepting, closes every connection and waits for the master's threads.
    /// Idempotent.
    pub fn shutdown(&self) {
        if self.shared.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for (_, s) in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = t.join();
        }
    }

    /// Blocks until [`Master::shutdown`] is called from another thread.
    pub fn wait(&self) {
        while !self.shared.shutdown.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Gives back a connection slot (and its pre-`Hello` slot while held) when dropped.
struct Slot {
    shared: Arc<Shared>,
    id: u64,
    pending: Option<Pending>,
}

impl Slot {
    fn authenticated(&mut self) {
        self.pending = None;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.authenticated();
        self.shared.open.fetch_sub(1, Ordering::AcqRel);
        self.shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(a) => a,
            Err(e) => {
                if shared.shutdown.load(Ordering::Acquire) {
                    return;
                }
                // Out of descriptors under a flood, typically: counted, not one line each.
                shared.noise.note(|t| {
                    t.accept_failed += 1;
                    t.last = format!("accept: {e}");
                });
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        if !shared.may_answer() {
            // Not (or no longer) the leader: the connection closes unanswered.
            continue;
        }
        if shared.open.load(Ordering::Acquire) >= shared.cfg.max_connections {
            shared.noise.note(|t| t.refused += 1);
            continue;
        }
        let Ok(clone) = stream.try_clone().map(Arc::new) else {
            shared.noise.note(|t| t.refused += 1);
            continue;
        };
        let (pending, evicted) = shared.admission.admit(peer.ip(), clone.clone());
        if evicted.is_some() {
            shared.noise.note(|t| t.evicted += 1);
        }
        shared.open.fetch_add(1, Ordering::AcqRel);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            shared: shared.clone(),
            id,
            pending: Some(pending),
        };
        shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, clone);
        let r = std::thread::Builder::new()
            .name("pagewire-store-conn".into())
            .spawn(move || serve(stream, slot));
        if let Err(e) = r {
            shared.noise.note(|t| {
                t.refused += 1;
                t.last = format!("spawn a connection thread: {e}");
            });
        }
    }
}

/// Interval of the counted warnings.
const NOISE_INTERVAL: Duration = Duration::from_secs(1);

/// Counts of what remote peers can cause at will, since the last line logged.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Tally {
    /// Connections closed at accept (`max_connections`, or out of resources).
    refused: u64,
    /// Silent pre-`Hello` connections closed to admit a newcomer.
    evicted: u64,
    /// First frames that were no valid `Hello`.
    bad_hello: u64,
    /// `Hello`s with the wrong token.
    unauthorized: u64,
    /// Bad frames or requests after `Hello`.
    bad_frame: u64,
    /// Frames refused because `max_buffered` was reached.
    over_budget: u64,
    /// Failed accepts.
    accept_failed: u64,
    /// The latest reason given, as an example.
    last: String,
}

impl Tally {
    fn is_empty(&self) -> bool {
        self.refused
            + self.evicted
            + self.bad_hello
            + self.unauthorized
            + self.bad_frame
            + self.over_budget
            + self.accept_failed
            == 0
    }
}

/// Logs [`Tally`]s: at most one line per interval, so a flood cannot fill the log; the
/// first event after a quiet interval is logged at once.
struct Noise {
    every: Duration,
    state: Mutex<(Tally, Option<Instant>)>,
}

impl Noise {
    fn new(every: Duration) -> Noise {
        Noise {
            every,
            state: Mutex::new((Tally::default(), None)),
        }
    }

    /// Counts an event and logs the tally when the interval allows.
    fn note(&self, event: impl FnOnce(&mut Tally)) {
        if let Some(t) = self.note_at(Instant::now(), event) {
            Self::log(&t);
        }
    }

    /// Logs what was counted, when the interval allows (the tick calls this, so counts
    /// after the last line are not held back until the next event).
    fn flush(&self) {
        if let Some(t) = self.note_at(Instant::now(), |_| {}) {
            Self::log(&t);
        }
    }

    /// Counts an event at `now`; the tally to log, if it is due.
    fn note_at(&self, now: Instant, event: impl FnOnce(&mut Tally)) -> Option<Tally> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        event(&mut st.0);
        let due =
            st.1.is_none_or(|last| now.duration_since(last) >= self.every);
        if !due || st.0.is_empty() {
            return None;
        }
        st.1 = Some(now);
        Some(std::mem::take(&mut st.0))
    }

    fn log(t: &Tally) {
        tracing::warn!(
            refused = t.refused,
            evicted = t.evicted,
            bad_hello = t.bad_hello,
            unauthorized = t.unauthorized,
            bad_frame = t.bad_frame,
            over_budget = t.over_budget,
            accept_failed = t.accept_failed,
            last = %t.last,
            "store master: connections refused or closed since the last such line"
        );
    }
}

/// Request bytes buffered across all connections, against `max_buffered`.
struct Budget {
    cap: usize,
    used: AtomicUsize,
}

impl Budget {
    fn new(cap: usize) -> Budget {
        Budget {
            cap,
            used: AtomicUsize::new(0),
        }
    }

    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&v| v <= self.cap)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// What one connection holds of the [`Budget`]; given back on drop.
struct Charge<'a> {
    budget: &'a Budget,
    held: usize,
}

impl Charge<'_> {
    fn take(&mut self, n: usize) -> bool {
        let ok = self.budget.take(n);
        if ok {
            self.held += n;
        }
        ok
    }

    fn release(&mut self) {
        self.budget.give(std::mem::take(&mut self.held));
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// A body buffer larger than this is not kept between requests (the budget counts the
/// bytes of the frame being read, not what an idle connection keeps).
const KEEP_BODY: usize = 64 << 10;

/// Why a request was not read.
enum Unread {
    Read(ReadError),
    /// The buffered-bytes budget ran out inside this frame: its header, the body bytes
    /// not read yet and the frame's deadline.
    OverBudget(Header, usize, Instant),
}

/// Reads one frame of at most `max` body bytes; `grant` is asked for its buffer's bytes.
fn read_request(
    s: &mut TcpStream,
    shared: &Shared,
    max: u32,
    idle: Instant,
    hard: Instant,
    body: &mut Vec<u8>,
    grant: &mut dyn FnMut(usize) -> bool,
) -> std::result::Result<Header, Unread> {
    let (h, deadline) =
        net::read_header(s, max, idle, shared.cfg.frame_timeout, hard).map_err(Unread::Read)?;
    match net::read_body(s, h.len, deadline, body, grant) {
        Ok(true) => Ok(h),
        Ok(false) => Err(Unread::OverBudget(h, h.len as usize - body.len(), deadline)),
        Err(e) => Err(Unread::Read(e)),
    }
}

/// Answers a frame the budget had no room for; the caller then closes. The rest of the
/// frame is read and dropped first (within its deadline), so that the sender is not cut
/// off mid-write and reads the answer instead of a reset.
fn over_budget(s: &mut TcpStream, shared: &Shared, req_id: u32, left: usize, by: Instant) {
    shared.noise.note(|t| t.over_budget += 1);
    if net::discard(s, left, by).is_err() {
        return;
    }
    let _ = send(
        s,
        shared,
        req_id,
        &Response::Error {
            code: Code::NoSpace,
            message: "the master's request buffers are full".into(),
        },
    );
}

fn send(s: &mut TcpStream, shared: &Shared, req_id: u32, resp: &Response) -> bool {
    let mut buf = Vec::new();
    resp.encode(req_id, &mut buf);
    // Checked last, right before the bytes go out: a deposed leader writes nothing.
    if !shared.may_answer() {
        return false;
    }
    net::write_all_by(s, &buf, Instant::now() + shared.cfg.frame_timeout).is_ok()
}

/// Tells the client its frame was refused (`InvalidParams` and why); the caller then closes.
fn refuse(s: &mut TcpStream, shared: &Shared, req_id: u32, message: String) {
    let _ = send(
        s,
        shared,
        req_id,
        &Response::Error {
            code: Code::InvalidParams,
            message,
        },
    );
}

fn serve(mut s: TcpStream, mut slot: Slot) {
    let shared = slot.shared.clone();
    let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    let _ = s.set_nodelay(true);
    let cfg = &shared.cfg;
    let mut body = Vec::new();
    let mut charge = Charge {
        budget: &shared.budget,
        held: 0,
    };
    let far = || Instant::now() + Duration::from_secs(3600);
    // What the peer says before `Hello` is counted, not logged line by line: anyone can
    // connect and send it.
    let bad_hello = |reason: String| {
        shared.noise.note(|t| {
            t.bad_hello += 1;
            t.last = format!("{peer}: {reason}");
        })
    };

    // Hello first, within one frame timeout, and no longer than the largest valid one.
    // It is not charged to the budget: pre-Hello slots bound it already, and clients
    // must get in even while the budget is spent.
    let hello_by = Instant::now() + cfg.frame_timeout;
    let h = match read_request(
        &mut s,
        &shared,
        proto::MAX_HELLO_FRAME,
        hello_by,
        hello_by,
        &mut body,
        &mut |_| true,
    ) {
        Ok(h) => h,
        Err(Unread::OverBudget(h, left, by)) => {
            return over_budget(&mut s, &shared, h.req_id, left, by);
        }
        Err(Unread::Read(ReadError::Proto(e))) => return bad_hello(e.to_string()),
        Err(Unread::Read(_)) => return,
    };
    let hello = match proto::decode_request(h.kind, &body) {
        Ok(Request::Hello(hello)) => hello,
        Ok(_) => {
            bad_hello("the first frame is not Hello".into());
            return refuse(
                &mut s,
                &shared,
                h.req_id,
                "the first frame must be Hello".into(),
            );
        }
        Err(e) => {
            bad_hello(e.to_string());
            return refuse(&mut s, &shared, h.req_id, e.to_string());
        }
    };
    let token_ok = match &cfg.token {
        Some(t) => net::ct_eq(t, &hello.token),
        None => true,
    };
    if !token_ok {
        shared.noise.note(|t| {
            t.unauthorized += 1;
            t.last = format!("{peer}: token mismatch");
        });
        let _ = send(
            &mut s,
            &shared,
            h.req_id,
            &Response::Error {
                code: Code::Unauthorized,
                message: "token mismatch".into(),
            },
        );
        return;
    }
    // Authenticated: the pre-Hello slot goes back at once, before the core is asked, so
    // the window in which a flood can evict this connection ends here.
    slot.authenticated();
    let now = shared.now();
    // Reports confirm one another only from distinct addresses (core::MasterCore::hello_from).
    let origin = s.peer_addr().ok().map(|a| match a.ip() {
        std::net::IpAddr::V4(a) => u128::from(a.to_ipv6_mapped()),
        std::net::IpAddr::V6(a) => u128::from(a),
    });
    let r = shared
        .core()
        .hello_from(now, hello.client_id, &hello.endpoint, origin);
    let client = match r {
        Ok((id, resumed)) => {
            let c = &cfg.core;
            let w = Welcome {
                client_id: id,
                epoch: shared.core().epoch(),
                resumed,
                lease_ttl_ms: c.lease_ttl_ms as u32,
                heartbeat_ms: c.heartbeat_ms as u32,
                client_ttl_ms: c.client_ttl_ms as u32,
                max_frame: cfg.max_frame,
                put_discard_ms: c.put_discard_ms as u32,
            };
            if !send(&mut s, &shared, h.req_id, &Response::Welcome(w)) {
                return;
            }
            tracing::debug!(%peer, endpoint = %hello.endpoint, client = format_args!("{id:#x}"), resumed, "store client connected");
            id
        }
        Err(code) => {
            let _ = send(
                &mut s,
                &shared,
                h.req_id,
                &Response::Error {
                    code,
                    message: "too many clients".into(),
                },
            );
            return;
        }
    };

    // Requests until the client leaves, goes quiet for longer than its TTL, or misbehaves.
    let quiet = Duration::from_millis(cfg.core.client_ttl_ms) * 2;
    let bad_frame = |reason: String| {
        shared.noise.note(|t| {
            t.bad_frame += 1;
            t.last = format!("{peer}: {reason}");
        })
    };
    loop {
        let idle = Instant::now() + quiet;
        let h = match read_request(
            &mut s,
            &shared,
            cfg.max_frame,
            idle,
            far(),
            &mut body,
            &mut |n| charge.take(n),
        ) {
            Ok(h) => h,
            Err(Unread::OverBudget(h, left, by)) => {
                over_budget(&mut s, &shared, h.req_id, left, by);
                break;
            }
            Err(Unread::Read(ReadError::Proto(e))) => {
                bad_frame(format!("bad frame: {e}"));
                refuse(&mut s, &shared, 0, e.to_string());
                break;
            }
            Err(Unread::Read(ReadError::Closed)) => break,
            Err(Unread::Read(e)) => {
                tracing::debug!(%peer, "store master: connection ends: {e:?}");
                break;
            }
        };
        let req = match proto::decode_request(h.kind, &body) {
            Ok(r) => r,
            Err(e) => {
                bad_frame(format!("bad request: {e}"));
                refuse(&mut s, &shared, h.req_id, e.to_string());
                break;
            }
        };
        let bye = matches!(req, Request::Bye);
        // A heartbeat's answer shows nothing of the metadata: it need not wait for the
        // log (and must not, or a slow etcd would make nodes time out).
        let shows_state = !matches!(req, Request::Heartbeat);
        let reserves = changes_only_reservations(&req);
        let (mut resp, ticket) = {
            let mut core = shared.core();
            let resp = handle(&shared, &mut core, client, req);
            let logged = shared.journal_append(&mut core);
            let ticket = logged.filter(|_| shows_state).map(|l| {
                let t = if reserves { l.placement } else { l.all };
                (l.journal, t)
            });
            (resp, ticket)
        };
        if let Some((journal, ticket)) = ticket
            && let Err(e) = journal.wait(ticket, Instant::now() + cfg.frame_timeout)
        {
            // The change is not known to be in the log: a success must not go out.
            resp = Response::Error {
                code: Code::MasterUnavailable,
                message: e.to_string(),
            };
        }
        let sent = send(&mut s, &shared, h.req_id, &resp);
        // The frame is done: its bytes go back to the budget, and a large buffer is not
        // kept while the connection idles.
        charge.release();
        if body.capacity() > KEEP_BODY {
            body = Vec::new();
        }
        if !sent || bye {
            if bye {
                return;
            }
            break;
        }
    }
    shared.core().disconnected(client);
}

/// Requests whose replies wait only for [`Logged::placement`]: they change nothing but
/// reservations. What they show of publications (an object found, a key refused as
/// existing) may not be logged yet, and a failover may undo that it is visible, as an
/// eviction would; its bytes are complete on its nodes all the same (its writer's
/// `PutFinish` came after them), and the writer's `PutFinish` is not answered before
/// the publication is logged.
fn changes_only_reservations(req: &Request) -> bool {
    matches!(
        req,
        Request::PutStart(_) | Request::Get { .. } | Request::Exist { .. } | Request::Stats
    )
}

/// Compiles a client's pattern with bounded memory (the regex crate matches in linear
/// time, so neither the compile nor the scan can stall the master).
fn pattern_of(pattern: &str) -> Result<regex::bytes::Regex, String> {
    regex::bytes::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .dfa_size_limit(1 << 20)
        .build()
        .map_err(|e| format!("pattern: {e}"))
}

fn err(code: Code) -> Response {
    Response::Error {
        code,
        message: code.to_string(),
    }
}

/// One request, under the core's lock.
fn handle(shared: &Shared, core: &mut MasterCore, client: u64, req: Request) -> Response {
    let now = shared.now();
    if let Err(c) = core.touch(now, client) {
        return err(c);
    }
    match req {
        Request::Hello(_) => Response::Error {
            code: Code::InvalidParams,
            message: "Hello twice on one connection".into(),
        },
        Request::Heartbeat => Response::Ack,
        Request::Mount { base, size, rkey } => match core.mount(now, client, base, size, rkey) {
            Ok(segment) => Response::Mounted { segment },
            Err(c) => err(c),
        },
        Request::Unmount { segment } => match core.unmount(now, client, segment) {
            Ok(()) => Response::Ack,
            Err(c) => err(c),
        },
        Request::PutStart(p) => match core.put_start(now, client, &p) {
            Ok(pl) => Response::Placed(pl),
            Err(c) => err(c),
        },
        Request::PutFinish(f) => match core.put_finish(now, client, &f) {
            Ok(codes) => Response::Codes(codes),
            Err(c) => err(c),
        },
        Request::Get { lease, keys } => Response::Found(core.get(now, client, &keys, lease)),
        Request::Exist { keys } => Response::Codes(core.exist(now, &keys)),
        Request::Remove { force, keys } => Response::Codes(core.remove(now, &keys, force)),
        Request::RemoveAll { force } => Response::Count(core.remove_all(now, force)),
        Request::RemoveMatching { force, pattern } => match pattern_of(&pattern) {
            Ok(re) => Response::Count(core.remove_matching(now, force, |k| re.is_match(k))),
            Err(message) => Response::Error {
                code: Code::InvalidParams,
                message,
            },
        },
        Request::Stats => Response::Stats(core.stats()),
        Request::Report { suspects } => match core.report(now, client, &suspects) {
            Ok(()) => Response::Ack,
            Err(c) => err(c),
        },
        Request::Bye => {
            core.bye(now, client);
            Response::Ack
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An authority is valid until its instant, not after, and not once revoked.
    #[test]
    fn authority_lapses_by_itself_and_on_revoke() {
        let a = Authority::new();
        assert!(!a.is_valid());
        a.grant_until(Instant::now() + Duration::from_secs(60));
        assert!(a.is_valid() && a.clone().is_valid());
        a.revoke();
        assert!(!a.is_valid());
        a.grant_until(Instant::now() + Duration::from_millis(30));
        assert!(a.is_valid());
        std::thread::sleep(Duration::from_millis(40));
        assert!(!a.is_valid());
        a.grant_until(Instant::now() - Duration::from_millis(1));
        assert!(!a.is_valid());
    }

    /// A flood of events gives one line per interval, the first at once; the counts add
    /// up, and nothing is logged for an interval without events.
    #[test]
    fn counted_warnings_come_at_most_once_per_interval() {
        let noise = Noise::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let first = noise
            .note_at(at(0), |t| t.refused += 1)
            .expect("first at once");
        assert_eq!((first.refused, first.evicted), (1, 0));
        // One event every 3 ms for 3 s: a line at 1002 ms and one at 2004 ms, 334 each.
        let mut lines = Vec::new();
        for i in 1..=1000u64 {
            if let Some(t) = noise.note_at(at(i * 3), |t| {
                t.evicted += 1;
                t.last = format!("e{i}");
            }) {
                lines.push((i, t.refused, t.evicted, t.last));
            }
        }
        assert_eq!(
            lines,
            [(334, 0, 334, "e334".into()), (668, 0, 334, "e668".into())]
        );
        // The rest waits for its interval, then the tick's flush logs it.
        assert!(noise.note_at(at(3003), |_| {}).is_none());
        assert_eq!(
            noise.note_at(at(3004), |_| {}).map(|t| t.evicted),
            Some(332)
        );
        assert!(noise.note_at(at(5000), |_| {}).is_none(), "nothing counted");
    }

    #[test]
    fn the_budget_refuses_past_its_cap_and_takes_back_what_a_charge_held() {
        let b = Budget::new(100);
        let mut c1 = Charge {
            budget: &b,
            held: 0,
        };
        let mut c2 = Charge {
            budget: &b,
            held: 0,
        };
        assert!(c1.take(60) && c2.take(40) && !c2.take(1));
        c1.release();
        assert!(c2.take(60) && !c1.take(1));
        drop(c2);
        assert!(c1.take(100));
    }
}
