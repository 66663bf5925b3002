//! Prepared batches: validated, pinned and planned once, then started any number of times.
//!
//! [`Engine::submit`](crate::Engine::submit) checks every op against the local registry and
//! the peer's table, pins the regions, plans work requests and allocates the batch's
//! state, every time. A batch that is sent over and over (a ping, a ring slot, a control
//! message) can pay that once: [`Engine::prepare`](crate::Engine::prepare) returns a
//! [`PreparedBatch`], and each [`PreparedBatch::start`] only posts. This is what perftest
//! does (it builds its work request once and re-posts it) and what MPI's persistent
//! requests (`MPI_Send_init`, `MPI_Start`) do.
//!
//! One run at a time: `start` refuses while the previous run is in flight. Each run has
//! the batch's timeout as its deadline. The local regions stay pinned (deregistering them
//! fails with `RegionBusy`) until the prepared batch is dropped and its last run has let
//! go of them; a run that failed or was cancelled lets go as an ordinary batch does, once
//! nothing of it can touch them any more (verbs: its work requests flushed).
//!
//! On verbs, a prepared batch whose work requests fit one chain on one QP (at most one
//! doorbell's worth, window space the QP can lend it for its lifetime, and no READ before
//! a notification) is posted as that chain, its notification riding on the last WRITE,
//! and its wait reaps this connection's completion queues directly. Other batches, and
//! the TCP and loopback backends, re-submit the validated ops through the ordinary batch
//! path.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use pagewire_transport::{Access, Batch, BackendKind, Engine, EngineConfig, HostBuffer};
//!
//! # fn main() -> Result<(), pagewire_transport::Error> {
//! let cfg = || {
//!     EngineConfig::builder()
//!         .backend(BackendKind::Loopback)
//!         .listen("127.0.0.1:0".parse().unwrap())
//!         .build()
//! };
//! let (a, b) = (Engine::new(cfg()?)?, Engine::new(cfg()?)?);
//! let mut slot = HostBuffer::new(4096)?;
//! let ring = HostBuffer::new(4096)?;
//! a.register(&slot, Access::LOCAL_WRITE)?;
//! b.register(&ring, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! let peer = a.connect(b.local_addr())?;
//!
//! let batch = Batch::new().write(slot.addr(), ring.addr(), 64).notify(0).timeout(Duration::from_secs(5));
//! let mut send = a.prepare(peer, batch)?;
//! for seq in 1..=3u32 {
//!     slot.write_at(0, &seq.to_le_bytes()); // each run sends what the slot holds now
//!     send.start_tagged(seq)?;
//!     send.wait(Instant::now() + Duration::from_secs(5))?;
//!     let note = b.poll_notification(Instant::now() + Duration::from_secs(5)).expect("notified");
//!     assert_eq!(note.tag, seq);
//!     assert_eq!(ring.read_vec(..4), seq.to_le_bytes());
//! }
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::contract::{Conn, FastPath, FastPathRequest, Reaper};
use crate::core::batch::{BatchState, BatchStatus, Pins};
use crate::core::resolve::ResolvedOps;
use crate::core::run::RunCell;
use crate::core::wait::Yield;
use crate::engine::handle::TransferHandle;
use crate::engine::wait::{busy_poll_since, poll_with_naps};
use crate::error::{Error, Result};
use crate::types::PeerId;

/// Reaps through a fast path while the engine's progress handle accounts for the waiter.
struct FastPathReaper<'a> {
    fast: &'a dyn FastPath,
    engine_reaper: &'a dyn Reaper,
}

impl std::fmt::Debug for FastPathReaper<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FastPathReaper")
    }
}

impl Reaper for FastPathReaper<'_> {
    fn poll_once(&self) -> usize {
        self.fast.poll()
    }
    fn set_waiting(&self, on: bool) {
        self.engine_reaper.set_waiting(on);
    }
    fn spin_budget(&self) -> Duration {
        self.engine_reaper.spin_budget()
    }
    fn callers_only(&self) -> bool {
        self.engine_reaper.callers_only()
    }
}

enum Path {
    /// The backend posts and reaps the prepared WRs itself.
    Fast {
        fast: Box<dyn FastPath>,
        cell: Arc<RunCell>,
        reaper: Arc<dyn Reaper>,
    },
    /// Each run is an ordinary batch of the already validated ops.
    Resubmit {
        conn: Arc<dyn Conn>,
        ops: ResolvedOps,
        cell: Arc<RunCell>,
        reaper: Option<Arc<dyn Reaper>>,
        handle: Option<TransferHandle>,
    },
}

/// A batch validated, pinned and planned once; see the module docs. Built by
/// [`Engine::prepare`](crate::Engine::prepare).
pub struct PreparedBatch {
    peer: PeerId,
    id: u64,
    ops: usize,
    bytes: u64,
    notify: Option<u32>,
    timeout: Duration,
    path: Path,
    running: bool,
    /// The current run's deadline (the fast path's: a re-submitted run is a batch with
    /// its own).
    run_until: Instant,
}

impl std::fmt::Debug for PreparedBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedBatch")
            .field("peer", &self.peer)
            .field("id", &self.id)
            .field("ops", &self.ops)
            .field("bytes", &self.bytes)
            .field("notify", &self.notify)
            .field("fast_path", &self.is_fast_path())
            .field("running", &self.running)
            .finish()
    }
}

impl PreparedBatch {
    #[allow(clippy::too_many_arguments)] // plain fields, one call site in the engine
    pub(crate) fn new(
        peer: PeerId,
        id: u64,
        ops: usize,
        bytes: u64,
        notify: Option<u32>,
        timeout: Duration,
        resolved: ResolvedOps,
        pins: Pins,
        conn: Arc<dyn Conn>,
        reaper: Option<Arc<dyn Reaper>>,
    ) -> Self {
        let cell = Arc::new(RunCell::new(pins));
        let fast = reaper.clone().and_then(|reaper| {
            conn.prepare_fast_path(FastPathRequest {
                ops: &resolved,
                notify,
                cell: &cell,
            })
            .map(|fast| (fast, reaper))
        });
        let path = match fast {
            Some((fast, reaper)) => Path::Fast { fast, cell, reaper },
            None => Path::Resubmit {
                conn,
                ops: resolved,
                cell,
                reaper,
                handle: None,
            },
        };
        PreparedBatch {
            peer,
            id,
            ops,
            bytes,
            notify,
            timeout,
            path,
            running: false,
            run_until: Instant::now(),
        }
    }

    /// The peer.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Engine-wide id, shared by every run (the ordinary path's handles report it too).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes per run.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the backend posts this batch itself as one chain (verbs' fast path) rather
    /// than re-submitting it through the ordinary batch path.
    pub fn is_fast_path(&self) -> bool {
        matches!(self.path, Path::Fast { .. })
    }

    /// The old name of [`PreparedBatch::is_fast_path`].
    #[deprecated(since = "0.1.0", note = "renamed to `is_fast_path`")]
    pub fn is_fast_lane(&self) -> bool {
        self.is_fast_path()
    }

    /// Starts a run, with the notification tag the batch was prepared with.
    ///
    /// Fails with [`Error::Unsupported`] if the previous run has not been waited for
    /// (one run at a time), and with the connection's error if it broke.
    pub fn start(&mut self) -> Result<()> {
        self.start_inner(self.notify)
    }

    /// Starts a run whose notification carries `tag` instead of the prepared one (a
    /// sequence number, say). The batch must have been prepared with a notification.
    pub fn start_tagged(&mut self, tag: u32) -> Result<()> {
        if self.notify.is_none() {
            return Err(Error::Unsupported {
                what: "a tag for a batch prepared without a notification".into(),
            });
        }
        self.start_inner(Some(tag))
    }

    fn start_inner(&mut self, tag: Option<u32>) -> Result<()> {
        if self.running {
            return Err(Error::Unsupported {
                what: "starting a prepared batch whose previous run was not waited for".into(),
            });
        }
        match &mut self.path {
            Path::Fast { fast, cell, .. } => {
                cell.begin();
                self.run_until = Instant::now() + self.timeout;
                if let Err(e) = fast.start(tag) {
                    cell.fail(e.clone());
                    return Err(e);
                }
            }
            Path::Resubmit {
                conn,
                ops,
                cell,
                reaper,
                handle,
            } => {
                let now = Instant::now();
                let state = BatchState::new(
                    self.id,
                    self.peer,
                    self.ops,
                    ops.len(),
                    self.bytes,
                    now,
                    now + self.timeout,
                    Pins::new(),
                    reaper.clone(),
                )
                .keeping(Arc::clone(cell));
                // As `submit`: a run whose deadline has already passed is not posted.
                state.expire_if_due(now);
                *handle = Some(TransferHandle::new(state.shared()));
                conn.post(state, ops.clone(), tag)?;
            }
        }
        self.running = true;
        Ok(())
    }

    /// Waits for the current run until `deadline`. `Ok` at once if no run is in flight.
    /// On `Err(Timeout)` before the run's own deadline (the batch's timeout after
    /// `start`) the run carries on and may be waited for again; at that deadline the run
    /// fails with `Timeout`, and any error ends the run. A run that fails lets go of what
    /// the hardware was given first (verbs: its connection breaks, its work requests
    /// flush), for a short bound at most, so that once the prepared batch is dropped its
    /// regions may be deregistered at once.
    ///
    /// On verbs the calling thread busy-polls the completion queues itself (for up to the
    /// engine's `poll_spin` without any completion), then polls them every 50 us to 1 ms.
    pub fn wait(&mut self, deadline: Instant) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        let r = match &self.path {
            Path::Fast { fast, cell, reaper } => {
                match wait_fast_path(&**fast, cell, &**reaper, deadline.min(self.run_until)) {
                    Err(e @ Error::Timeout { .. }) => {
                        self.expire_fast(Instant::now()).unwrap_or(Err(e))
                    }
                    r => r,
                }
            }
            Path::Resubmit { handle, .. } => match handle {
                Some(h) => h.wait(deadline).map(|_| ()),
                None => Ok(()),
            },
        };
        if self.run_ended() {
            self.running = false;
        }
        r
    }

    /// A fast-path run past its deadline (at `now`) fails with `Timeout`, once the backend
    /// stopped it (or gave up doing so); `None` while it may still run.
    fn expire_fast(&self, now: Instant) -> Option<Result<()>> {
        let Path::Fast { fast, cell, .. } = &self.path else {
            return None;
        };
        if let Some(r) = cell.outcome() {
            return Some(r);
        }
        if now < self.run_until {
            return None;
        }
        cell.fail(Error::Timeout {
            after: self.timeout,
        });
        // Reported (by returning) only once the hardware let go of the run.
        fast.abort();
        cell.outcome()
    }

    /// Whether the current run has an outcome.
    fn run_ended(&self) -> bool {
        match &self.path {
            Path::Fast { cell, .. } => cell.outcome().is_some(),
            Path::Resubmit { handle, .. } => {
                handle.as_ref().is_none_or(|h| h.status().is_finished())
            }
        }
    }

    /// The current run's outcome without blocking (reaping once on verbs): `None` while
    /// it is in flight.
    pub fn try_wait(&mut self) -> Option<Result<()>> {
        if !self.running {
            return Some(Ok(()));
        }
        let r = match &self.path {
            // Engine-wide: a caller spinning here makes the completion thread step
            // aside, so this round must also reap what nobody else waits for.
            Path::Fast { cell, reaper, .. } => cell.outcome().or_else(|| {
                reaper.poll_once();
                self.expire_fast(Instant::now())
            }),
            Path::Resubmit { handle, .. } => match handle.as_ref().map(TransferHandle::status) {
                Some(BatchStatus::Pending) => None,
                Some(BatchStatus::Failed(e)) => Some(Err(e)),
                Some(BatchStatus::Cancelled) => Some(Err(Error::Cancelled)),
                Some(BatchStatus::Done) | None => Some(Ok(())),
            },
        };
        if r.is_some() {
            self.running = false;
        }
        r
    }
}

fn wait_fast_path(
    fast: &dyn FastPath,
    cell: &RunCell,
    engine: &dyn Reaper,
    deadline: Instant,
) -> Result<()> {
    let p = FastPathReaper {
        fast,
        engine_reaper: engine,
    };
    let since = match busy_poll_since(&p, deadline, Yield::Often, || cell.outcome()) {
        Ok(r) => return r,
        Err(first_clock) => first_clock.unwrap_or_else(Instant::now),
    };
    // Past the spin budget: poll with growing naps. Engine-wide, as these polls keep the
    // completion thread stepping aside: other connections must not stall behind a long run.
    match poll_with_naps(engine, deadline, || cell.outcome()) {
        Some(r) => r,
        None => Err(Error::Timeout {
            after: since.elapsed(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn prepared_batches_move_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<PreparedBatch>();
    }

    /// A fast path whose run completes once the engine-wide rounds have reaped `after` times.
    #[derive(Debug)]
    struct FakeEngine {
        polls: AtomicU32,
        after: u32,
        cell: Arc<RunCell>,
    }

    impl Reaper for FakeEngine {
        fn poll_once(&self) -> usize {
            if self.polls.fetch_add(1, Ordering::SeqCst) + 1 == self.after {
                self.cell.succeed();
                return 1;
            }
            0
        }
        fn set_waiting(&self, _on: bool) {}
        fn spin_budget(&self) -> Duration {
            Duration::ZERO
        }
    }

    struct Fast;

    impl FastPath for Fast {
        fn start(&self, _tag: Option<u32>) -> Result<()> {
            Ok(())
        }
        fn poll(&self) -> usize {
            0
        }
        fn abort(&self) -> bool {
            true
        }
    }

    #[test]
    fn a_long_wait_keeps_reaping_the_whole_engine() {
        // Past the spin budget the waiter naps between polls; those polls make the
        // completion thread step aside, so they must reap every connection, not only the
        // lane's send queue (else other connections' batches stall behind this wait).
        let cell = Arc::new(RunCell::new(Pins::new()));
        cell.begin();
        let engine = FakeEngine {
            polls: AtomicU32::new(0),
            after: 3,
            cell: Arc::clone(&cell),
        };
        let r = wait_fast_path(
            &Fast,
            &cell,
            &engine,
            Instant::now() + Duration::from_secs(5),
        );
        assert!(r.is_ok(), "{r:?}");
        assert!(engine.polls.load(Ordering::SeqCst) >= 3);
    }
}
