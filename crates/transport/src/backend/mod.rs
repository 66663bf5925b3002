//! The contract between the engine core and the data paths (see docs/architecture.md).
//!
//! The core validates and resolves every op before a backend sees it: the local range
//! lies inside one registered chunk (`lkey`), the remote range inside one chunk the peer
//! exposed (`rkey`), and both have the access the op needs. A backend only moves bytes
//! and reports progress through [`BatchState`].
//!
//! Each backend module provides an `open` function:
//! - `verbs::open(config: &EngineConfig) -> Result<Arc<dyn Backend>, Error>` (feature `verbs`)
//! - `tcp::open(config: &EngineConfig, init: &BackendInit) -> Result<Arc<dyn Backend>, Error>`
//! - `loopback::open(config: &EngineConfig, init: &BackendInit) -> Result<Arc<dyn Backend>, Error>`

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

pub(crate) use crate::batch::BatchState;
use crate::batch::Op;
use crate::config::{BackendKind, EngineConfig};
use crate::engine::{Notification, PeerId};
use crate::error::{Error, Result};
use crate::memory::{Access, Registry};
#[allow(unused_imports)] // QpInfo: for the verbs backend
pub(crate) use crate::wire::{EndpointInfo, QpInfo};

pub(crate) mod loopback;
mod sys;
pub(crate) mod tcp;
#[cfg(feature = "verbs")]
pub(crate) mod verbs;

/// Locks `m`, recovering the guard of a poisoned mutex: a panic on one thread must not
/// wedge every later caller.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which data path, and the figures a benchmark header prints.
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendInfo {
    /// Verbs, Tcp or Loopback (never Auto).
    pub kind: BackendKind,
    /// Device name (`rxe0`, `mlx5_0`), or `tcp`/`loopback`.
    pub device: String,
    /// Verbs port (0 otherwise).
    pub port: u8,
    /// Link layer / transport description (`Ethernet (RoCEv2)`, `InfiniBand`, `TCP`).
    pub link: String,
    /// Path MTU in bytes (0 when not applicable).
    pub mtu: u32,
    /// Local GID (verbs).
    pub gid: Option<[u8; 16]>,
    /// GID index in use (verbs).
    pub gid_index: Option<u32>,
    /// LID (verbs; 0 on RoCE).
    pub lid: u16,
    /// QPs (verbs) or streams (TCP) per peer.
    pub lanes_per_peer: u16,
    /// Send queue depth per QP (verbs) or in-flight chunks per stream (TCP).
    pub tx_depth: u32,
    /// Signal one WR in N (verbs; 1 otherwise).
    pub signal_every: u32,
    /// Largest WR / chunk.
    pub max_wr_bytes: u64,
    /// Largest single registration; bigger regions are split.
    pub max_mr_bytes: u64,
    /// RDMA READs one QP keeps outstanding (verbs: the device's limit, at most 16; `None`
    /// for backends without one-sided READs on the wire).
    pub max_outstanding_reads: Option<u32>,
    /// Why this backend was chosen (filled by the engine).
    pub selection: String,
}

/// What a backend returns for one registration.
pub(crate) struct BackendMr {
    /// Local key (verbs lkey; TCP/loopback: an opaque id).
    pub lkey: u32,
    /// Remote key peers present (verbs rkey; TCP/loopback: checked by the receiver).
    pub rkey: u32,
    /// Backend state kept alive while registered (e.g. the verbs MR object).
    #[allow(dead_code)] // read by the verbs backend only
    pub handle: Option<Box<dyn Any + Send + Sync>>,
}

impl BackendMr {
    /// A registration with no backend state, one key serving as lkey and rkey (TCP and
    /// loopback, where the key only names the region).
    pub(crate) fn keyed(key: u32) -> Self {
        Self {
            lkey: key,
            rkey: key,
            handle: None,
        }
    }
}

impl fmt::Debug for BackendMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendMr")
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish_non_exhaustive()
    }
}

/// A batch's resolved ops; up to two inline, so a small batch allocates no list.
pub(crate) type ResolvedOps = smallvec::SmallVec<[ResolvedOp; 2]>;

/// One validated, key-resolved piece of a batch. The local range is inside one local MR
/// chunk, the remote range inside one chunk the peer exposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResolvedOp {
    pub op: Op,
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u64,
}

/// Delivers `(peer, tag)` notifications into the engine's queue.
#[derive(Clone)]
pub(crate) struct NotifySink {
    pub(crate) peer: PeerId,
    /// The engine's id (see [`NotifyWait`]).
    pub(crate) engine: u64,
    pub(crate) tx: Sender<Notification>,
    /// Most notifications the queue holds (`EngineConfig::notify_queue`).
    pub(crate) cap: usize,
    /// Notifications dropped because the queue was full (`Engine::notifications_dropped`).
    pub(crate) dropped: Arc<AtomicU64>,
}

impl NotifySink {
    /// Surfaces a notification from this connection's peer. Call only once every byte of
    /// the batch it ends is in local memory.
    ///
    /// `false`: the queue holds `cap` notifications the application has not taken, so
    /// this one is dropped (and counted); the caller breaks the peer's connection, which
    /// is how the peer learns that it outran the application.
    #[must_use]
    pub(crate) fn notify(&self, tag: u32) -> bool {
        let n = Notification {
            peer: self.peer,
            tag,
        };
        // A thread waiting in this engine's `poll_notification` that reaped the tag itself
        // takes it directly when the queue holds nothing older: the same order, without a
        // send and a receive on the queue.
        let queued = HANDOFF.with(|h| match &mut *h.borrow_mut() {
            Some(w) if w.engine == self.engine && w.slot.is_none() && self.tx.is_empty() => {
                w.slot = Some(n);
                false
            }
            _ => true,
        });
        if !queued {
            return true;
        }
        if self.tx.len() >= self.cap {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                peer = %self.peer,
                cap = self.cap,
                "notification queue full: notification dropped, breaking the peer's connection"
            );
            return false;
        }
        // The receiver lives as long as the engine; an error means it is shutting down.
        let _ = self.tx.send(n);
        true
    }
}

/// A thread's wait in `Engine::poll_notification`, and the notification handed to it.
struct Handoff {
    engine: u64,
    slot: Option<Notification>,
}

thread_local! {
    static HANDOFF: std::cell::RefCell<Option<Handoff>> = const { std::cell::RefCell::new(None) };
}

/// Marks this thread as waiting for engine `engine`'s notifications while it lives, so
/// that [`NotifySink::notify`] called on this thread (by its own reaping) hands a tag
/// over instead of queueing it. Anything still handed over when it ends goes to the queue.
pub(crate) struct NotifyWait<'a> {
    tx: &'a Sender<Notification>,
    prev: Option<Handoff>,
}

impl<'a> NotifyWait<'a> {
    pub(crate) fn enter(engine: u64, tx: &'a Sender<Notification>) -> Self {
        let prev = HANDOFF.with(|h| h.replace(Some(Handoff { engine, slot: None })));
        NotifyWait { tx, prev }
    }

    /// The notification handed over, if any.
    pub(crate) fn take(&self) -> Option<Notification> {
        HANDOFF.with(|h| h.borrow_mut().as_mut().and_then(|w| w.slot.take()))
    }
}

impl Drop for NotifyWait<'_> {
    fn drop(&mut self) {
        let mine = HANDOFF.with(|h| h.replace(self.prev.take()));
        if let Some(n) = mine.and_then(|w| w.slot) {
            let _ = self.tx.send(n);
        }
    }
}

impl fmt::Debug for NotifySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NotifySink({})", self.peer)
    }
}

/// What a connection gets from the engine when it completes.
#[derive(Debug, Clone)]
pub(crate) struct ConnCtx {
    /// The engine's id for the peer.
    pub peer: PeerId,
    /// The peer's IP as seen on the control connection (where its data listener is).
    #[allow(dead_code)]
    pub remote_ip: std::net::IpAddr,
    /// The handshake's deadline: the backend's own setup (TCP data streams) ends by it.
    #[allow(dead_code)]
    pub deadline: Instant,
    /// Where incoming notifications go.
    pub notify: NotifySink,
    /// The local registry (for backends that check incoming ops themselves).
    #[allow(dead_code)]
    pub registry: Arc<Registry>,
    /// The engine config.
    #[allow(dead_code)]
    pub config: Arc<EngineConfig>,
}

/// Engine-side state some backends need at open time.
#[derive(Debug, Clone)]
pub(crate) struct BackendInit {
    /// Random id of the engine (loopback: key of the process-global table).
    pub engine_id: u64,
    /// The local registry.
    pub registry: Arc<Registry>,
}

/// A data path.
pub(crate) trait Backend: Send + Sync + 'static {
    /// Verbs | Tcp | Loopback.
    fn kind(&self) -> BackendKind;
    /// Device, port, MTU, GID... for reports.
    fn info(&self) -> BackendInfo;
    /// Called once per MR chunk (the engine already split at `info().max_mr_bytes`);
    /// the returned keys are stored in the registry.
    fn register(&self, addr: usize, len: usize, access: Access) -> Result<BackendMr, Error>;
    /// Registers one chunk of a dma-buf (`ibv_reg_dmabuf_mr`); only verbs supports it.
    fn register_dmabuf(
        &self,
        _fd: std::os::fd::RawFd,
        _offset: u64,
        _len: usize,
        _iova: u64,
        _access: Access,
    ) -> Result<BackendMr, Error> {
        Err(Error::Unsupported {
            what: format!("dma-buf registration on the {} backend", self.kind()),
        })
    }
    /// Releases one registration.
    fn deregister(&self, mr: BackendMr);
    /// Builds the local half of a new connection and its part of the handshake.
    fn prepare(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo), Error>;
    /// Stops background threads; called once when the engine shuts down.
    fn shutdown(&self) {}
    /// The handle through which a waiting thread reaps completions itself, for backends
    /// with a completion queue to poll (verbs).
    fn progress(&self) -> Option<Arc<dyn Progress>> {
        None
    }
}

/// Completions a waiting thread can reap itself. A caller that busy-polls through this
/// sees its completion or notification without a hand-off from the backend's completion
/// thread (a futex wake-up per batch), and that thread steps aside meanwhile, so one
/// core, not two, spins per waiter: what a perftest-style loop does.
pub(crate) trait Progress: Send + Sync + fmt::Debug {
    /// Reaps completions once on the calling thread; returns how many were handled (0 also
    /// when another thread is reaping at this moment).
    fn poll_once(&self) -> usize;
    /// A caller starts (`true`) or stops (`false`) busy-polling.
    fn set_waiting(&self, on: bool);
    /// How long a waiter busy-polls while nothing completes before it blocks instead.
    fn spin_budget(&self) -> Duration;
    /// No completion thread ([`crate::ProgressMode::Manual`]): a waiter past its spin
    /// budget must keep reaping (with naps) instead of blocking on what that thread
    /// would have signalled.
    fn callers_only(&self) -> bool {
        false
    }
}

/// How often an idle busy-poll gives the CPU away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Yield {
    /// Every idle round after the first few: for waits on our own WRs, whose completion
    /// is kernel work (soft-RoCE's tasklets and softirqs) that may need this very CPU; a
    /// spinner that yields rarely halves large-message bandwidth on small hosts.
    Often,
    /// Every [`BUSY_YIELD_RARELY`] idle rounds: for waits on the peer (a notification).
    /// Each `sched_yield` may switch tasks, which costs tens of microseconds on small
    /// virtual machines; a receiver spins like perftest's memory poll, and the kernel still
    /// preempts it when another task must run.
    Rarely,
}

/// Busy-polls `p` until `ready` yields a value, `deadline` passes, or nothing completed
/// for [`Progress::spin_budget`]; `None` in the last two cases (the caller then blocks).
pub(crate) fn busy_poll<T>(
    p: &dyn Progress,
    deadline: Instant,
    policy: Yield,
    ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    busy_poll_since(p, deadline, policy, ready).ok()
}

/// [`busy_poll`], telling on `Err` when it first read the clock (a few idle rounds after
/// it began; `None` if it never did), for callers that report how long they waited.
pub(crate) fn busy_poll_since<T>(
    p: &dyn Progress,
    deadline: Instant,
    policy: Yield,
    mut ready: impl FnMut() -> Option<T>,
) -> std::result::Result<T, Option<Instant>> {
    struct Waiting<'a>(&'a dyn Progress);
    impl Drop for Waiting<'_> {
        fn drop(&mut self) {
            self.0.set_waiting(false);
        }
    }
    if let Some(v) = ready() {
        return Ok(v);
    }
    // One round often settles it (a small WRITE's completion is in the CQ by the time its
    // poster waits: rxe runs it inside the post's system call), so the first goes
    // without the waiter count and the spin budget.
    p.poll_once();
    if let Some(v) = ready() {
        return Ok(v);
    }
    p.set_waiting(true);
    let _waiting = Waiting(p);
    let budget = p.spin_budget();
    // When the idle stretch began, read at its first clock check rather than at every
    // completion: a wait that ends within a few rounds reads no clock at all.
    let mut last: Option<Instant> = None;
    let mut first: Option<Instant> = None;
    let mut idle: u32 = 0;
    loop {
        let n = p.poll_once();
        if let Some(v) = ready() {
            return Ok(v);
        }
        if n > 0 {
            idle = 0;
            last = None;
            continue;
        }
        idle = idle.saturating_add(1);
        let give_away = idle >= BUSY_SPIN_ROUNDS
            && match policy {
                Yield::Often => true,
                Yield::Rarely => idle.is_multiple_of(BUSY_YIELD_RARELY),
            };
        if give_away {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        if idle.is_multiple_of(BUSY_CLOCK_EVERY) {
            let now = Instant::now();
            first.get_or_insert(now);
            let since = *last.get_or_insert(now);
            if now >= deadline || now.duration_since(since) >= budget {
                return Err(first);
            }
        }
    }
}

/// Reaps through `p` every 50 us, doubling to 1 ms, until `ready` yields a value or
/// `deadline` passes (`None`): the slow phase of a wait that must reap for itself.
pub(crate) fn poll_with_naps<T>(
    p: &dyn Progress,
    deadline: Instant,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let mut nap = Duration::from_micros(50);
    loop {
        p.poll_once();
        if let Some(v) = ready() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(nap.min(deadline - now));
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

/// Idle busy-poll rounds that only spin before yielding starts.
const BUSY_SPIN_ROUNDS: u32 = 16;
/// Idle rounds between two yields under [`Yield::Rarely`].
const BUSY_YIELD_RARELY: u32 = 128;
/// Idle rounds between two clock reads (deadline and spin budget checks).
const BUSY_CLOCK_EVERY: u32 = 8;

/// A connection waiting for the peer's half.
pub(crate) trait PendingConn: Send {
    /// Finishes with the peer's half (e.g. QPs to RTR/RTS).
    fn complete(
        self: Box<Self>,
        remote: &EndpointInfo,
        ctx: ConnCtx,
    ) -> Result<Arc<dyn Conn>, Error>;
}

/// An established connection.
pub(crate) trait Conn: Send + Sync {
    /// Posts one batch. `ops` are validated and resolved; the backend reports through
    /// `batch` (progress, success, first error) and never blocks past its deadline.
    /// With `notify`, the peer must surface the tag only after every byte landed.
    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<(), Error>;
    /// A fast lane for a prepared batch of these (validated) ops, if this backend has one
    /// for them; `None`: each run is re-submitted through [`Conn::post`].
    fn prepare_lane(
        &self,
        _req: crate::prepared::LaneRequest<'_>,
    ) -> Option<Box<dyn crate::prepared::PreparedLane>> {
        None
    }
    /// Whether the connection failed (peer gone, QP in error).
    fn is_broken(&self) -> bool;
    /// Tears the connection down; pending batches fail with `PeerGone`.
    fn close(&self);
    /// Proves the data path once both ends are connected (verbs: a zero-length RDMA
    /// WRITE per QP), before the connection is published; never past `deadline`.
    fn probe(&self, _deadline: Instant) -> Result<(), Error> {
        Ok(())
    }
}

/// Opens the configured backend; returns it with the reason for the choice.
pub(crate) fn open(
    config: &EngineConfig,
    init: &BackendInit,
) -> Result<(Arc<dyn Backend>, String)> {
    match config.backend {
        BackendKind::Tcp => Ok((tcp::open(config, init)?, "forced by config".into())),
        BackendKind::Loopback => Ok((loopback::open(config, init)?, "forced by config".into())),
        BackendKind::Verbs => open_verbs(config).map(|b| (b, "forced by config".into())),
        BackendKind::Auto => match open_verbs(config) {
            Ok(b) => {
                let dev = b.info().device;
                Ok((b, format!("auto: RDMA device {dev} is usable")))
            }
            Err(e) => Ok((
                tcp::open(config, init)?,
                format!("auto: no usable RDMA device ({e}), using TCP"),
            )),
        },
        #[allow(unreachable_patterns)]
        other => Err(Error::Unsupported {
            what: format!("backend {other}"),
        }),
    }
}

#[cfg(feature = "verbs")]
fn open_verbs(config: &EngineConfig) -> Result<Arc<dyn Backend>> {
    verbs::open(config)
}

#[cfg(not(feature = "verbs"))]
fn open_verbs(_config: &EngineConfig) -> Result<Arc<dyn Backend>> {
    Err(Error::BackendUnavailable {
        backend: BackendKind::Verbs,
        reason: "built without the `verbs` feature".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};

    /// Completes "work" after `after` polls; records the waiting balance.
    #[derive(Debug, Default)]
    struct Fake {
        polls: AtomicUsize,
        after: usize,
        waiting: AtomicIsize,
        max_waiting: AtomicIsize,
        budget_ms: u64,
    }

    impl Progress for Fake {
        fn poll_once(&self) -> usize {
            let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
            usize::from(n == self.after)
        }
        fn set_waiting(&self, on: bool) {
            let w = self
                .waiting
                .fetch_add(if on { 1 } else { -1 }, Ordering::SeqCst);
            if on {
                self.max_waiting.fetch_max(w + 1, Ordering::SeqCst);
            }
        }
        fn spin_budget(&self) -> Duration {
            Duration::from_millis(self.budget_ms)
        }
    }

    #[test]
    fn busy_poll_returns_once_ready_and_balances_waiting() {
        let f = Fake {
            after: 100,
            budget_ms: 1000,
            ..Fake::default()
        };
        let got = busy_poll(
            &f,
            Instant::now() + Duration::from_secs(5),
            Yield::Often,
            || (f.polls.load(Ordering::SeqCst) >= f.after).then_some(7),
        );
        assert_eq!(got, Some(7));
        assert_eq!(f.polls.load(Ordering::SeqCst), 100);
        assert_eq!(f.waiting.load(Ordering::SeqCst), 0);
        assert_eq!(f.max_waiting.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn busy_poll_ready_at_once_does_not_poll() {
        let f = Fake::default();
        assert_eq!(
            busy_poll(&f, Instant::now(), Yield::Rarely, || Some(1)),
            Some(1)
        );
        assert_eq!(f.polls.load(Ordering::SeqCst), 0);
        assert_eq!(f.max_waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn busy_poll_gives_up_at_the_deadline_or_after_the_idle_budget() {
        // Nothing ever completes. (deadline, idle budget, what ends it): the deadline, or,
        // with a far deadline, the idle budget (the caller then blocks instead).
        for (deadline_ms, budget_ms, ends_ms) in [(30, 60_000, 30), (60_000, 20, 20)] {
            let f = Fake {
                after: usize::MAX,
                budget_ms,
                ..Fake::default()
            };
            let t = Instant::now();
            let got: Option<()> = busy_poll(
                &f,
                t + Duration::from_millis(deadline_ms),
                Yield::Rarely,
                || None,
            );
            assert!(got.is_none());
            assert!(t.elapsed() >= Duration::from_millis(ends_ms));
            assert!(t.elapsed() < Duration::from_secs(10));
            assert_eq!(f.waiting.load(Ordering::SeqCst), 0);
        }
    }
}
