//! Batches of one-sided operations and their handles.
//!
//! A [`Batch`] is a list of [`TransferOp`]s to one peer, with an optional notification
//! tag and deadline. [`Engine::submit`](crate::Engine::submit) validates it, pins the local
//! regions and hands it to the backend, returning a `TransferHandle`.
//!
//! Deadlines: every batch has one (its own, or `batch_timeout` from the config). When it
//! passes with work outstanding the batch fails with [`Error::Timeout`]; the check is made
//! by the backend, by `TransferHandle::status` and by `TransferHandle::wait`, so it
//! holds even if the backend is stuck. `wait(deadline)` only bounds the wait: when its
//! own deadline passes first it returns `Timeout` and the batch carries on.
//!
//! Cancellation is best effort: slices not yet handed to the wire are skipped, slices in
//! flight may still land in the peer. The local regions stay pinned until nothing of the
//! batch can touch them any more, so deregistration can never race a transfer: when the
//! backend lets go of the batch, or, as for a failure, when the cancellation is reported
//! (see below).
//!
//! A backend whose own threads write a batch's local memory (a TCP READ, loopback) does
//! so under [`BatchState::landing`]: failing or cancelling the batch waits for that guard,
//! and no guard is given once the batch finished, so once a failure or cancellation is
//! reported, nothing more of the batch lands there. (Verbs: what the NIC was given lands
//! or flushes on its own; see docs/transport.md.) A backend whose every access to a
//! batch's local memory is under that guard says so ([`BatchState::guarded_by_landing`]):
//! the batch's pins then go when it fails or is cancelled, before that is reported, not
//! when the backend lets go of it, so the caller may deregister at once (a TCP READ whose
//! peer stalled would otherwise hold its target until the connection's `io_timeout`).
//! A backend whose hardware touches the memory on its own (verbs) gives the batch a
//! [`Settle`] instead: a failure or cancellation first has it stop that hardware (its
//! WRs completed, or QPs to ERR and their WRs flushed), within a short bound, and when it
//! did, the pins go before the outcome is reported, as for a guarded batch. A prepared
//! batch's run keeps the prepared batch's pins (its run cell) the same way.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

pub(crate) use crate::core::registry::Pins;
use crate::core::run::RunCell;
use crate::core::wait::Reaper;
use crate::error::Error;
use crate::types::{Op, PeerId, TransferOp};

/// A list of operations to one peer, submitted together.
#[derive(Debug, Clone, Default)]
#[must_use = "a batch does nothing until submitted with Engine::submit"]
pub struct Batch {
    /// One op inline: a single-op batch (a ping, a notification) allocates nothing.
    pub(crate) ops: SmallVec<[TransferOp; 1]>,
    pub(crate) notify: Option<u32>,
    pub(crate) deadline: Option<Deadline>,
}

/// A batch's own deadline: absolute, or relative to its submission (resolved with the
/// clock read that stamps the submission, so a relative one costs no extra read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deadline {
    At(Instant),
    After(Duration),
}

impl Deadline {
    /// The absolute deadline of a batch submitted at `now`.
    pub(crate) fn resolve(self, now: Instant) -> Instant {
        match self {
            Deadline::At(t) => t,
            Deadline::After(d) => now + d,
        }
    }
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty batch with room for `n` ops.
    pub fn with_capacity(n: usize) -> Self {
        Batch {
            ops: SmallVec::with_capacity(n),
            ..Self::default()
        }
    }

    /// Appends an op.
    pub fn push(&mut self, op: TransferOp) -> &mut Self {
        self.ops.push(op);
        self
    }

    /// Appends a WRITE of `len` bytes from `local` to `remote`.
    pub fn write(mut self, local: u64, remote: u64, len: u64) -> Self {
        self.ops.push(TransferOp {
            op: Op::Write,
            local,
            remote,
            len,
        });
        self
    }

    /// Appends a READ of `len` bytes from `remote` into `local`.
    pub fn read(mut self, local: u64, remote: u64, len: u64) -> Self {
        self.ops.push(TransferOp {
            op: Op::Read,
            local,
            remote,
            len,
        });
        self
    }

    /// Asks for a remote notification: once every byte of this batch is in the peer's
    /// memory, the peer's engine surfaces `(our PeerId there, tag)`. Only meaningful
    /// for batches of WRITEs (a READ-only batch is notified after its last read).
    ///
    /// A batch with no ops and a notification sends the tag alone (a control message:
    /// "request done", "abort"). It is ordered only against itself: to tell the peer
    /// that earlier batches landed, submit it once they have completed.
    pub fn notify(mut self, tag: u32) -> Self {
        self.notify = Some(tag);
        self
    }

    /// Absolute deadline for the whole batch.
    pub fn deadline(mut self, at: Instant) -> Self {
        self.deadline = Some(Deadline::At(at));
        self
    }

    /// Deadline relative to the moment the batch is submitted.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.deadline = Some(Deadline::After(d));
        self
    }

    /// The ops.
    pub fn ops(&self) -> &[TransferOp] {
        &self.ops
    }

    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there are no ops.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Sum of op lengths (saturating).
    pub fn bytes(&self) -> u64 {
        self.ops.iter().fold(0u64, |a, o| a.saturating_add(o.len))
    }
}

impl Extend<TransferOp> for Batch {
    fn extend<I: IntoIterator<Item = TransferOp>>(&mut self, iter: I) {
        self.ops.extend(iter);
    }
}

impl FromIterator<TransferOp> for Batch {
    fn from_iter<I: IntoIterator<Item = TransferOp>>(iter: I) -> Self {
        Batch {
            ops: iter.into_iter().collect(),
            ..Self::default()
        }
    }
}

/// Where a batch stands.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub enum BatchStatus {
    /// Work outstanding.
    Pending,
    /// Every op completed (and the notification, if any, was delivered to the peer).
    Done,
    /// Failed with the first error seen (including `Timeout` at the batch deadline).
    Failed(Error),
    /// Cancelled by the caller.
    Cancelled,
}

impl BatchStatus {
    /// Whether the batch has finished one way or another.
    pub fn is_finished(&self) -> bool {
        !matches!(self, BatchStatus::Pending)
    }
}

/// Figures about a finished batch.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchStats {
    /// Ops as submitted.
    pub ops: usize,
    /// Pieces after splitting at MR boundaries (backends may slice further).
    pub slices: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Submit to completion.
    pub elapsed: Duration,
}

#[derive(Debug, Clone)]
pub(crate) enum Phase {
    Pending,
    Done(Duration),
    Failed(Error),
    Cancelled,
}

/// The part of a batch that the caller's handle sees.
#[derive(Debug)]
pub(crate) struct BatchShared {
    pub(crate) id: u64,
    pub(crate) peer: PeerId,
    pub(crate) ops: usize,
    pub(crate) slices: usize,
    pub(crate) bytes: u64,
    pub(crate) submitted: Instant,
    pub(crate) deadline: Instant,
    pub(crate) done_bytes: AtomicU64,
    pub(crate) done_slices: AtomicUsize,
    pub(crate) cancel: AtomicBool,
    /// Set once the phase leaves Pending, so the hot path checks an atomic, not the lock.
    pub(crate) finished: AtomicBool,
    pub(crate) phase: Mutex<Phase>,
    /// Held while a backend thread lands bytes in local memory; taken by every transition
    /// but success before it is published (see [`BatchState::landing`]).
    pub(crate) landing: Mutex<()>,
    pub(crate) cv: Condvar,
    /// Threads blocked on `cv` (changed under `phase`'s lock). std's condvar makes a
    /// futex syscall on every notify; most batches finish with nobody blocked (the waiter
    /// busy-polls on verbs, or has not called `wait` yet), so `finish` skips it then.
    pub(crate) sleepers: AtomicUsize,
    /// Lets `wait` reap completions on the caller's thread (verbs).
    pub(crate) driver: Option<Arc<dyn Reaper>>,
    /// Lets `wait` read this batch's completion on the caller's thread, blocking (TCP,
    /// a batch sent directly on one stream); weak, so a batch never keeps its
    /// connection's state alive.
    pub(crate) reader: OnceLock<Weak<dyn Reader>>,
    /// The pins of the local regions (a prepared batch's run: its run cell, which holds
    /// them); taken when the backend lets go of the batch, or on failure or cancellation
    /// when `guarded` (see the module doc).
    pins: Mutex<Held>,
    /// Every access of the backend to the local memory is under `landing` (or, once
    /// `settle` said so, there is none any more).
    guarded: AtomicBool,
    /// What stops the backend's hardware touching the local memory when the batch fails
    /// (see [`Settle`]); taken by the first failure, held while it runs.
    settle: Mutex<Option<Weak<dyn Settle>>>,
}

/// What keeps a batch's local regions registered (held for its `Drop`).
#[derive(Debug, Default)]
struct Held {
    _pins: Option<Pins>,
    /// A prepared batch's pins, shared by its runs.
    _run: Option<Arc<RunCell>>,
}

/// Why a batch ends early, for [`Settle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// It failed: what it has in flight is of no use.
    Failed,
    /// The caller cancelled it: what it has in flight may still complete normally, which
    /// spares the connection that carries it.
    Cancelled,
}

/// A backend whose hardware reads and writes a batch's local memory on its own (verbs:
/// what was posted lands or flushes whatever the engine does) and can stop it.
pub(crate) trait Settle: Send + Sync {
    /// The batch fails or is cancelled (`why`): make sure that nothing the hardware was
    /// given for it can touch its local memory any more (verbs: its WRs completed, or
    /// the QPs carrying them moved to ERR and those WRs flushed), waiting a short bound
    /// at most. `true` when that holds; the batch's pins then go before the outcome is
    /// reported. Runs on the thread that ends the batch, before the outcome is
    /// published, at most once per batch.
    fn settle(&self, why: Stop) -> bool;
}

/// Where a waiting caller can read a batch's completion itself, blocking in the kernel
/// instead of on the batch's condition variable: the thread that would otherwise read
/// it and then wake the caller is not involved (TCP: one hand-off fewer per batch).
pub(crate) trait Reader: Send + Sync {
    /// Reads until `done()` holds or `until` passes. Returns at once, having read
    /// nothing, when another thread is reading; the caller then blocks as usual.
    fn read_until(&self, done: &dyn Fn() -> bool, until: Instant);
}

impl BatchShared {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves Pending to `next`; later transitions are ignored (first outcome wins).
    pub(crate) fn finish(&self, next: Phase) -> bool {
        let why = match next {
            Phase::Failed(_) => Some(Stop::Failed),
            Phase::Cancelled => Some(Stop::Cancelled),
            _ => None,
        };
        if let Some(why) = why
            && !self.finished.load(Ordering::Acquire)
        {
            self.settle_hardware(why);
        }
        // A failure or cancellation waits for bytes being landed, so none land after it
        // is reported. Success needs no wait: every byte is in.
        let landing = (!matches!(next, Phase::Done(_)))
            .then(|| self.landing.lock().unwrap_or_else(|p| p.into_inner()));
        let mut p = self.lock();
        if !matches!(*p, Phase::Pending) {
            return false;
        }
        // Nothing lands now (`landing` is held) nor after (no guard is given once the
        // phase changes below): a guarded batch's memory is the caller's again before
        // the outcome is published.
        let freed = match landing {
            Some(_) if self.guarded.load(Ordering::Acquire) => self.take_pins(),
            _ => Held::default(),
        };
        *p = next;
        self.finished.store(true, Ordering::Release);
        // A waiter registers under the lock before it sleeps, and one that took the lock
        // after us saw the outcome: reading the count after unlocking misses no one.
        drop(p);
        drop(landing);
        drop(freed);
        if self.sleepers.load(Ordering::Acquire) > 0 {
            self.cv.notify_all();
        }
        true
    }

    /// Runs the backend's [`Settle`], if it gave one; a concurrent failure or
    /// cancellation waits for it, so none is published while the hardware may still touch
    /// the memory.
    fn settle_hardware(&self, why: Stop) {
        let mut slot = self.settle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = slot.take().and_then(|w| w.upgrade())
            && s.settle(why)
        {
            self.guarded.store(true, Ordering::Release);
        }
    }

    fn take_pins(&self) -> Held {
        std::mem::take(&mut *self.pins.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn expire_if_due(&self, now: Instant) {
        if now >= self.deadline && !self.finished.load(Ordering::Acquire) {
            self.finish(Phase::Failed(Error::Timeout {
                after: self.deadline - self.submitted,
            }));
        }
    }

    /// Requests cancellation: `true` if the batch was still pending (it is now
    /// `Cancelled`), `false` if it had already finished.
    pub(crate) fn cancel(&self) -> bool {
        self.cancel.store(true, Ordering::Release);
        self.finish(Phase::Cancelled)
    }

    /// Where the batch stands at `now` (a pending batch past its deadline fails here).
    pub(crate) fn status(&self, now: Instant) -> BatchStatus {
        self.expire_if_due(now);
        match &*self.lock() {
            Phase::Pending => BatchStatus::Pending,
            Phase::Done(_) => BatchStatus::Done,
            Phase::Failed(e) => BatchStatus::Failed(e.clone()),
            Phase::Cancelled => BatchStatus::Cancelled,
        }
    }
}

/// The notify gate, one rule for every backend: a batch's notification goes to the peer
/// only after every data piece of the batch landed there (was acknowledged), and a batch
/// without one is done at that moment. A backend arms it with its piece count (verbs: data
/// WRs, plus one the poster holds until it has posted them all; TCP: chunks; loopback:
/// slices), reports pieces as they land, and acts when [`NotifyGate::landed`] says the last
/// one did.
#[derive(Debug)]
pub(crate) struct NotifyGate {
    remaining: AtomicU64,
}

impl NotifyGate {
    /// A gate waiting for `pieces` pieces.
    pub(crate) const fn new(pieces: u64) -> Self {
        NotifyGate {
            remaining: AtomicU64::new(pieces),
        }
    }

    /// `n` more pieces landed. `true` exactly once, for the call that lands the last one:
    /// the caller then sends the notification, or completes a batch without one.
    pub(crate) fn landed(&self, n: u64) -> bool {
        self.remaining.fetch_sub(n, Ordering::AcqRel) == n
    }

    /// Waits for `n` more pieces after the gate opened (verbs: the notification WR itself,
    /// whose completion ends the batch).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
    pub(crate) fn rearm(&self, n: u64) {
        self.remaining.store(n, Ordering::Release);
    }
}

/// The backend's view of a batch. Holding it keeps the local regions pinned, so a
/// backend must keep its `Arc<BatchState>` until nothing it posted can still touch
/// local memory (e.g. until the last CQE of the batch, or the QP is flushed), unless it
/// declared that its every access is under [`BatchState::landing`]
/// ([`BatchState::guarded_by_landing`]).
#[derive(Debug)]
pub(crate) struct BatchState {
    shared: Arc<BatchShared>,
}

impl Drop for BatchState {
    fn drop(&mut self) {
        drop(self.shared.take_pins());
    }
}

impl BatchState {
    #[allow(clippy::too_many_arguments)] // plain fields, one call site in the core
    pub(crate) fn new(
        id: u64,
        peer: PeerId,
        ops: usize,
        slices: usize,
        bytes: u64,
        submitted: Instant,
        deadline: Instant,
        pins: Pins,
        driver: Option<Arc<dyn Reaper>>,
    ) -> Self {
        BatchState {
            shared: Arc::new(BatchShared {
                id,
                peer,
                ops,
                slices,
                bytes,
                submitted,
                deadline,
                done_bytes: AtomicU64::new(0),
                done_slices: AtomicUsize::new(0),
                cancel: AtomicBool::new(false),
                finished: AtomicBool::new(false),
                phase: Mutex::new(Phase::Pending),
                landing: Mutex::new(()),
                cv: Condvar::new(),
                sleepers: AtomicUsize::new(0),
                driver,
                reader: OnceLock::new(),
                pins: Mutex::new(Held {
                    _pins: Some(pins),
                    _run: None,
                }),
                guarded: AtomicBool::new(false),
                settle: Mutex::new(None),
            }),
        }
    }

    /// The backend touches this batch's local memory only under [`Self::landing`]: its
    /// pins may go as soon as it fails or is cancelled (see the module doc). A batch
    /// that failed already loses them now.
    pub(crate) fn guarded_by_landing(&self) {
        self.shared.guarded.store(true, Ordering::Release);
        let s = &self.shared;
        if s.cancel.load(Ordering::Acquire) || s.finished.load(Ordering::Acquire) {
            // Under the guard, so that no landing is under way while they go.
            let _landing = s.landing.lock().unwrap_or_else(|p| p.into_inner());
            if !matches!(*s.lock(), Phase::Done(_) | Phase::Pending) {
                drop(s.take_pins());
            }
        }
    }

    /// On failure, `settle` stops the backend's hardware first (see [`Settle`]).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
    pub(crate) fn settled_by(&self, settle: Weak<dyn Settle>) {
        *self.shared.settle.lock().unwrap_or_else(|p| p.into_inner()) = Some(settle);
    }

    /// Nothing the backend was given can touch the local memory any more (verbs: the
    /// batch's WRs were flushed or their QPs destroyed): the pins go now, before the
    /// backend reports the batch's failure.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
    pub(crate) fn let_go(&self) {
        drop(self.shared.take_pins());
    }

    /// Also keeps `cell` (a prepared batch's pins) alive until the backend lets go, or
    /// (like the batch's own pins) until it failed or was cancelled once nothing of it
    /// can touch the memory any more.
    pub(crate) fn keeping(self, cell: Arc<RunCell>) -> Self {
        self.shared
            .pins
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            ._run = Some(cell);
        self
    }

    /// What the caller's handle holds.
    pub(crate) fn shared(&self) -> Arc<BatchShared> {
        self.shared.clone()
    }

    /// Engine-wide batch id (use as a wr_id prefix, for logs).
    #[allow(dead_code)]
    pub(crate) fn id(&self) -> u64 {
        self.shared.id
    }

    /// The peer it goes to.
    #[allow(dead_code)]
    pub(crate) fn peer(&self) -> PeerId {
        self.shared.peer
    }

    /// The batch deadline; a backend must not block past it.
    #[allow(dead_code)]
    pub(crate) fn deadline(&self) -> Instant {
        self.shared.deadline
    }

    /// Total bytes of the batch.
    #[allow(dead_code)]
    pub(crate) fn total_bytes(&self) -> u64 {
        self.shared.bytes
    }

    /// Whether the backend should stop posting more of this batch: cancelled, failed,
    /// timed out (its deadline is at or before `now`) or already done.
    pub(crate) fn should_stop(&self, now: Instant) -> bool {
        if self.shared.cancel.load(Ordering::Acquire) {
            return true;
        }
        self.shared.expire_if_due(now);
        self.shared.finished.load(Ordering::Acquire)
    }

    /// Permission to land bytes of this batch in its local memory, held for the copy
    /// (one non-blocking read, one slice): `None` once the batch failed, was cancelled or
    /// is done. Failing or cancelling the batch waits for the guard to drop, so after
    /// either is reported nothing of it lands. Never fail the batch while holding it.
    pub(crate) fn landing(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        let g = self
            .shared
            .landing
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let stopped = self.shared.cancel.load(Ordering::Acquire)
            || self.shared.finished.load(Ordering::Acquire);
        (!stopped).then_some(g)
    }

    /// Whether the outcome is decided.
    #[allow(dead_code)]
    pub(crate) fn is_finished(&self) -> bool {
        self.shared.finished.load(Ordering::Acquire)
    }

    /// [`Self::should_stop`] without the clock: cancelled, failed or done.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only the verbs poster asks
    pub(crate) fn is_stopped(&self) -> bool {
        self.shared.cancel.load(Ordering::Acquire) || self.shared.finished.load(Ordering::Acquire)
    }

    /// Fails the batch with `Timeout` if its deadline is at or before `now`.
    pub(crate) fn expire_if_due(&self, now: Instant) {
        self.shared.expire_if_due(now);
    }

    /// Records progress (slices completed and their bytes).
    pub(crate) fn add_progress(&self, slices: usize, bytes: u64) {
        self.shared.done_slices.fetch_add(slices, Ordering::AcqRel);
        self.shared.done_bytes.fetch_add(bytes, Ordering::AcqRel);
    }

    /// Lets a caller waiting for this batch read its completion through `reader` (at
    /// most once; later calls are ignored).
    pub(crate) fn set_reader(&self, reader: Weak<dyn Reader>) {
        let _ = self.shared.reader.set(reader);
    }

    /// Marks the batch done at `now` (no effect if it already finished).
    pub(crate) fn succeed(&self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.shared.submitted);
        self.shared.finish(Phase::Done(elapsed));
    }

    /// Marks the batch failed with `err` (the first error wins).
    pub(crate) fn fail(&self, err: Error) {
        if self.shared.finish(Phase::Failed(err.clone())) {
            tracing::debug!(batch = self.shared.id, peer = %self.shared.peer, error = %err, "batch failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_opens_once_at_the_last_piece() {
        let g = NotifyGate::new(3);
        assert!(!g.landed(1));
        assert!(!g.landed(1));
        assert!(g.landed(1), "the last piece opens it");
        g.rearm(1);
        assert!(g.landed(1), "re-armed for the notification itself");
        let g = NotifyGate::new(4);
        assert!(!g.landed(3));
        assert!(g.landed(1), "pieces may land in groups");
    }

    /// A backend's [`Settle`] that records why it ran and whether the outcome was already
    /// published then, and answers `stopped`.
    struct Stopper {
        batch: Arc<BatchShared>,
        stopped: bool,
        ran: Mutex<Vec<(Stop, bool)>>,
    }

    impl Settle for Stopper {
        fn settle(&self, why: Stop) -> bool {
            let published = self.batch.finished.load(Ordering::Acquire);
            self.ran.lock().unwrap().push((why, published));
            self.stopped
        }
    }

    fn stopper(b: &BatchState, stopped: bool) -> Arc<Stopper> {
        let s = Arc::new(Stopper {
            batch: b.shared(),
            stopped,
            ran: Mutex::new(Vec::new()),
        });
        let w: Weak<dyn Settle> = Arc::downgrade(&s) as Weak<Stopper>;
        b.settled_by(w);
        s
    }

    /// One region of 4 KiB in a fresh registry, and a batch (one hour to its deadline)
    /// that pins it.
    fn pinned_batch() -> (
        crate::core::registry::Registry,
        crate::types::RegionId,
        BatchState,
    ) {
        use crate::core::registry::{Chunk, InsertPlan, Registry};
        use crate::types::{Access, RailKeys};
        let reg = Registry::default();
        let (addr, len) = (0x10_000, 0x1000);
        assert!(matches!(
            reg.begin_insert(addr, len, Access::LOCAL_WRITE),
            Ok(InsertPlan::New)
        ));
        let chunk = Chunk {
            addr,
            len,
            lkey: 1,
            rkey: 2,
            lrails: RailKeys::NONE,
            rrails: RailKeys::NONE,
        };
        let id = reg
            .finish_insert(
                addr,
                len,
                Access::LOCAL_WRITE,
                vec![chunk],
                Vec::new(),
                None,
            )
            .map_err(|(e, _)| e)
            .unwrap();
        let pin = reg.pin(addr, len, Access::LOCAL_WRITE).unwrap();
        let now = Instant::now();
        let b = BatchState::new(
            7,
            PeerId(1),
            1,
            1,
            len,
            now,
            now + Duration::from_secs(3600),
            smallvec::smallvec![pin],
            None,
        );
        (reg, id, b)
    }

    #[test]
    fn a_failure_settles_the_hardware_first_and_lets_go_once_it_stopped() {
        for stopped in [true, false] {
            let (reg, id, b) = pinned_batch();
            let s = stopper(&b, stopped);
            b.fail(Error::Timeout {
                after: Duration::ZERO,
            });
            b.fail(Error::Shutdown);
            assert_eq!(
                *s.ran.lock().unwrap(),
                [(Stop::Failed, false)],
                "settled once, before the failure was published"
            );
            assert!(matches!(
                b.shared().status(Instant::now()),
                BatchStatus::Failed(Error::Timeout { .. })
            ));
            // Stopped: the region is the caller's again while the backend still holds
            // the batch. Not stopped: it stays pinned until the backend lets go.
            assert_eq!(reg.remove(id).is_ok(), stopped, "stopped: {stopped}");
            drop(b);
            if !stopped {
                assert!(reg.remove(id).is_ok(), "pinned after the backend let go");
            }
        }
    }

    #[test]
    fn a_cancellation_settles_and_lets_go_but_success_does_not_settle() {
        let (reg, id, b) = pinned_batch();
        let s = stopper(&b, true);
        assert!(b.shared().cancel());
        b.fail(Error::Shutdown);
        assert_eq!(*s.ran.lock().unwrap(), [(Stop::Cancelled, false)]);
        assert!(
            reg.remove(id).is_ok(),
            "the cancelled batch's region is free"
        );
        drop(b);
        let (_reg, _id, b) = pinned_batch();
        let s = stopper(&b, true);
        b.succeed(Instant::now());
        assert!(!b.shared().cancel());
        assert!(s.ran.lock().unwrap().is_empty());
    }

    /// A prepared batch's run holds its run cell (with the pins) like its own pins: gone
    /// at a failure once the backend stopped, not when it lets go.
    #[test]
    fn a_settled_run_lets_go_of_its_run_cell() {
        let (reg, id, b) = pinned_batch();
        let pins = b.shared().take_pins()._pins.expect("pinned");
        let b = b.keeping(Arc::new(RunCell::new(pins)));
        let _s = stopper(&b, true);
        assert!(reg.remove(id).is_err(), "the run cell pins the region");
        b.fail(Error::Shutdown);
        assert!(reg.remove(id).is_ok(), "the failed run's cell let go");
    }
}
