//! One verbs connection: `qps_per_peer` RC QPs, a send CQ and a recv CQ, the per-QP in-flight
//! windows, batch bookkeeping, the notification WRITE_WITH_IMM, and failure propagation.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError, Weak};
use std::time::{Duration, Instant};

use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::queue_pair::QueuePairState;

use super::poller::{PollWake, PollerShared};
use super::qp::{
    POLL_BATCH, RcQp, WC_RECV_RDMA_WITH_IMM, WC_SUCCESS, Wc, WrSpec, poll_cq, wc_status_name,
};
use crate::contract::{BatchSink, BatchState, Reaper, RunCell, TagSink};
use crate::core::batch::{NotifyGate, Settle, Stop};
use crate::core::health::{self, FirstCause, Verdict};
use crate::core::slice::{Dir, PlanOp, PlannedWr, WrQueue, Wrs, plan_wrs, stripe};
use crate::core::wait::ENGINE_REAP_EVERY;
use crate::core::window::{
    Group, InFlight, SEQ_MASK, WrKind, decode_wr_id, encode_wr_id, is_signaled,
};
use crate::error::{Error, PeerFault};
use crate::types::PeerId;
use crate::util::lock;

/// Between two reaps of a thread waiting for a batch's WRs to flush or drain (a failure
/// path): short, but leaving the CPU to the NIC's own work (rxe flushes in the kernel, on
/// the same CPUs).
const FLUSH_POLL: Duration = Duration::from_micros(100);

/// Marks the WRs of a lane's run before its last (in the wr_id's sequence field, above
/// any lane index): a run has ended only when its last WR completes.
const LANE_NOT_LAST: u64 = 1 << 53;

/// A prepared batch's lane: its WRs, planned once and posted as one chain on QP 0 per
/// run, in window space lent to it for its lifetime (see [`VerbsConn::prepare_lane`]).
/// Dropping it hands the space back once no run is in flight.
pub(crate) struct LaneChain {
    index: usize,
    lane: Arc<Lane>,
}

/// A lane as the connection's table holds it, so that whichever thread reaps a run's
/// completion can report it, and the regions stay pinned while a run may be in flight.
struct Lane {
    wrs: Wrs,
    cell: Arc<RunCell>,
    /// A run is on the send queue: set by the poster, cleared by the reaper of its
    /// completion (before it reports the outcome, so the next run sees it clear).
    posted: AtomicBool,
    /// The prepared batch is gone: the reaper of the last run frees the lane.
    dropped: AtomicBool,
}

/// The connection's lanes, by index (the `seq` field of their wr_ids).
#[derive(Default)]
struct Lanes {
    slots: Vec<Option<Arc<Lane>>>,
    free: Vec<usize>,
}

impl Lanes {
    fn insert(&mut self, lane: Arc<Lane>) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(lane);
                i
            }
            None => {
                self.slots.push(Some(lane));
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, i: usize) {
        if self.slots.get_mut(i).and_then(Option::take).is_some() {
            self.free.push(i);
        }
    }
}

/// Knobs of one connection (from the engine config, clamped to the device's limits).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnCfg {
    /// Max WRs in flight per QP (never above the QP's real `max_send_wr`).
    pub window: u32,
    /// Max WRs per doorbell.
    pub chain_max: u32,
    pub signal_every: u32,
    pub max_wr_bytes: u64,
    pub max_sge: usize,
    /// RECVs kept posted per QP for incoming WRITE_WITH_IMM.
    pub recv_depth: u32,
}

/// Where a batch reports. The engine core's [`BatchState`] is held by value, so a batch
/// costs one allocation here (its [`BatchCtl`]) rather than two.
pub(crate) enum CtlSink {
    Core(BatchState),
    Other(Arc<dyn BatchSink>),
}

impl std::ops::Deref for CtlSink {
    type Target = dyn BatchSink;
    fn deref(&self) -> &(dyn BatchSink + 'static) {
        match self {
            CtlSink::Core(b) => b,
            CtlSink::Other(s) => &**s,
        }
    }
}

impl From<BatchState> for CtlSink {
    fn from(b: BatchState) -> Self {
        CtlSink::Core(b)
    }
}

impl<T: BatchSink + 'static> From<Arc<T>> for CtlSink {
    fn from(s: Arc<T>) -> Self {
        CtlSink::Other(s)
    }
}

struct BatchCtl {
    sink: CtlSink,
    /// Data WRs not yet completed, plus one while the poster still holds the batch; when it
    /// reaches zero the held notification WR (if any) is posted, then the batch completes.
    pending: NotifyGate,
    /// The final WRITE_WITH_IMM, held back until every data WR on every QP has completed.
    held: Mutex<Option<PlannedWr>>,
    tag: Option<u32>,
    done: AtomicBool,
    /// WRs of the batch on a send queue: counted before they are posted, uncounted when a
    /// completion (successful or not) retires them.
    on_nic: AtomicU32,
    /// The batch is failing: nothing more of it is posted, and it never completes.
    stopping: AtomicBool,
    /// A failure that waits for the batch's WRs to leave the send queues (flushed, once
    /// the connection moved its QPs to ERR): reported when the last reference goes (see
    /// `Drop`), or by the health check after [`FLUSH_WAIT`](health::FLUSH_WAIT).
    doomed: Mutex<Option<Error>>,
    /// The connection, for [`Settle`].
    conn: Weak<VerbsConn>,
}

impl BatchCtl {
    fn new(
        sink: CtlSink,
        pieces: u64,
        held: Option<PlannedWr>,
        tag: Option<u32>,
        conn: Weak<VerbsConn>,
    ) -> Arc<Self> {
        Arc::new(BatchCtl {
            sink,
            pending: NotifyGate::new(pieces),
            held: Mutex::new(held),
            tag,
            done: AtomicBool::new(false),
            on_nic: AtomicU32::new(0),
            stopping: AtomicBool::new(false),
            doomed: Mutex::new(None),
            conn,
        })
    }

    /// Fails the batch with `err`: now if none of its WRs is on a send queue, else once
    /// they have all left (the connection broke, so they flush), so that the failure is
    /// reported when nothing of the batch can touch its memory any more.
    fn fail(&self, err: Error) {
        // SeqCst, against a poster's check of `stopping` then count of `on_nic`: one of
        // the two sees the other.
        self.stopping.store(true, Ordering::SeqCst);
        if self.on_nic.load(Ordering::SeqCst) > 0 {
            self.doom(err);
            return;
        }
        self.report(err);
    }

    /// Fails the batch with `err` (unless it has an outcome already) once the last
    /// reference goes: see `Drop`.
    fn doom(&self, err: Error) {
        self.stopping.store(true, Ordering::SeqCst);
        lock(&self.doomed).get_or_insert(err);
    }

    fn report(&self, err: Error) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.sink.fail(err);
        }
    }

    /// Reports a failure that waited for WRs that did not flush in time; the batch's
    /// pins stay with it (in the graveyard) until the QPs are destroyed.
    fn report_doomed(&self) {
        let doomed = lock(&self.doomed).take();
        if let Some(e) = doomed {
            self.report(e);
        }
    }

    /// `n` WRs of the batch left the send queue (a completion retired them).
    fn off_nic(&self, n: u32) {
        self.on_nic.fetch_sub(n, Ordering::AcqRel);
    }
}

impl Drop for BatchCtl {
    /// The last reference: no WR of the batch is on a send queue (each was retired by a
    /// completion, or its QP destroyed). A failure waiting for that is reported now,
    /// after the pins went, so the caller may deregister at once.
    fn drop(&mut self) {
        let doomed = self
            .doomed
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(e) = doomed {
            if let CtlSink::Core(b) = &self.sink {
                b.let_go();
            }
            self.report(e);
        }
    }
}

/// A batch that fails in the engine core (its deadline passed while WRs of it were on a
/// send queue) first stops the NIC: the connection breaks (its QPs go to ERR, so every WR
/// on them flushes) and the failure waits, for [`FLUSH_WAIT`](health::FLUSH_WAIT) at
/// most, until the batch's WRs have left the send queues. Without this, a READ's target
/// stayed pinned (and could still be written) until the connection's stall watchdog
/// broke it and the broken connection was dropped.
///
/// A cancelled batch first waits, as long again at most, for its WRs to complete on their
/// own: a connection that still moves data is not broken for it.
impl Settle for BatchCtl {
    fn settle(&self, why: Stop) -> bool {
        // The core reports this outcome, with its own cause.
        self.done.store(true, Ordering::Release);
        self.stopping.store(true, Ordering::SeqCst);
        match self.conn.upgrade() {
            Some(c) => c.settle(self, why),
            None => self.on_nic.load(Ordering::Acquire) == 0,
        }
    }
}

/// Held notification WRs waiting for room on QP 0, with their count readable without the
/// lock: every poll round checks it, and it is almost always zero.
#[derive(Default)]
struct Deferred {
    q: Mutex<VecDeque<(Arc<BatchCtl>, PlannedWr)>>,
    len: AtomicUsize,
}

impl Deferred {
    fn push_back(&self, e: (Arc<BatchCtl>, PlannedWr)) {
        let mut q = lock(&self.q);
        q.push_back(e);
        self.len.store(q.len(), Ordering::Release);
    }

    fn push_front(&self, e: (Arc<BatchCtl>, PlannedWr)) {
        let mut q = lock(&self.q);
        q.push_front(e);
        self.len.store(q.len(), Ordering::Release);
    }

    fn pop_front(&self) -> Option<(Arc<BatchCtl>, PlannedWr)> {
        let mut q = lock(&self.q);
        let e = q.pop_front();
        self.len.store(q.len(), Ordering::Release);
        e
    }

    fn take_all(&self) -> VecDeque<(Arc<BatchCtl>, PlannedWr)> {
        let mut q = lock(&self.q);
        self.len.store(0, Ordering::Release);
        std::mem::take(&mut *q)
    }

    /// A hint: an entry pushed meanwhile is posted by its pusher (`release` posts right
    /// after pushing) or by the next round.
    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }
}

/// A reaper's scratch space: the completions of one poll, and the groups they retired.
/// A wait polls once per spin, so its buffers are kept instead of cleared every round.
#[derive(Default)]
struct ReapScratch {
    wcs: [Wc; POLL_BATCH],
    retired: Vec<Group<Arc<BatchCtl>>>,
}

/// See [`VerbsConn::hold_reaping`].
#[cfg(test)]
pub(crate) struct ReapingHold<'a>(#[allow(dead_code)] std::sync::MutexGuard<'a, ReapScratch>);

struct QpSlot {
    /// Post lock: sequence numbers are reserved and posted under it, so send-queue order and
    /// in-flight order agree.
    qp: Mutex<RcQp>,
    track: Mutex<InFlight<Arc<BatchCtl>>>,
    qpn: u32,
    recv_seq: AtomicU64,
    /// RECVs consumed but not yet reposted (reposting waits if a poster holds the QP).
    recv_owed: AtomicU64,
    /// Bumped whenever this QP's send queue makes progress (a post returned, a CQE retired
    /// WRs): one atomic add on the data path instead of a clock read under a lock.
    activity: AtomicU64,
    /// WRs of lane runs in flight (QP 0 only): lanes post outside `track`.
    lane_wrs: AtomicU32,
    /// The health check's view of `progress`: the value it last saw, and when it saw it
    /// change.
    watch: Mutex<(u64, Instant)>,
    /// Moved to ERR (the connection broke or closed): it accepts nothing from the peer.
    errored: AtomicBool,
}

impl QpSlot {
    /// Moves the QP (whose post lock the caller holds as `qp`) to ERR, once.
    fn to_error(&self, qp: &mut RcQp) {
        if !self.errored.swap(true, Ordering::AcqRel) {
            qp.move_to_error();
        }
    }

    /// Waits until the post lock is free (no post under way), until `until`.
    fn wait_free(&self, until: Instant) -> bool {
        loop {
            match self.qp.try_lock() {
                Ok(_) | Err(TryLockError::Poisoned(_)) => return true,
                Err(TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::yield_now();
                }
                Err(TryLockError::WouldBlock) => return false,
            }
        }
    }

    fn record_activity(&self) {
        self.activity.fetch_add(1, Ordering::Release);
    }

    /// WRs posted and not yet completed: batches' and lanes'.
    fn outstanding(&self) -> u32 {
        lock(&self.track).outstanding() + self.lane_wrs.load(Ordering::Acquire)
    }

    /// How long `progress` has not moved, as far as the health check has seen.
    fn idle(&self) -> Duration {
        let seen = self.activity.load(Ordering::Acquire);
        let mut w = lock(&self.watch);
        if w.0 != seen {
            *w = (seen, Instant::now());
        }
        w.1.elapsed()
    }
}

pub(crate) struct VerbsConn {
    qps: Vec<QpSlot>,
    send_cq: Arc<BasicCompletionQueue>,
    recv_cq: Arc<BasicCompletionQueue>,
    cfg: ConnCfg,
    /// Set once, when the connection breaks: the cause every report of the break carries.
    broken: FirstCause<Error>,
    notify: Option<Arc<dyn TagSink>>,
    peer: PeerId,
    deferred: Deferred,
    /// When it broke.
    broken_at: OnceLock<Instant>,
    /// Batches failed by a broken connection whose WRs did not flush within
    /// [`FLUSH_WAIT`](health::FLUSH_WAIT): kept (with the regions they pin) until the QPs
    /// are destroyed with `self`.
    graveyard: Mutex<Vec<Arc<BatchCtl>>>,
    /// Itself, for the batches it carries (see [`Settle`]).
    me: Weak<VerbsConn>,
    /// Prepared lanes on QP 0. After `qps`, so a lane's regions outlive the QPs that may
    /// still hold one of its runs.
    lanes: Mutex<Lanes>,
    /// Held by whoever reaps this connection's CQs (the completion thread or a waiting
    /// caller); the others skip, so completions are handled in CQ order by one thread.
    /// Holds the reaper's buffers, reused so that a reaping round allocates and clears
    /// nothing.
    reaping: Mutex<ReapScratch>,
    /// The engine's completion thread: kicked on every post so it polls at once.
    poller: Arc<PollWake>,
    /// The engine's connections, reaped now and then by a thread that waits on this one
    /// (see [`Self::reap_waiting`]).
    engine_reaper: Weak<PollerShared>,
    label: String,
}

impl std::fmt::Debug for VerbsConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConn")
            .field("label", &self.label)
            .field("qps", &self.qps.iter().map(|q| q.qpn).collect::<Vec<_>>())
            .field("broken", &self.is_broken())
            .finish()
    }
}

impl VerbsConn {
    /// Wraps connected (RTS) QPs. RECVs must already be posted (`recv_depth` per QP, ids from
    /// [`recv_wr_id`]).
    pub fn new(
        qps: Vec<RcQp>,
        send_cq: Arc<BasicCompletionQueue>,
        recv_cq: Arc<BasicCompletionQueue>,
        cfg: ConnCfg,
        notify: Option<Arc<dyn TagSink>>,
        peer: PeerId,
        label: String,
    ) -> Self {
        let qps = qps
            .into_iter()
            .map(|q| {
                let window = cfg.window.min(q.caps.max_send_wr).max(1);
                QpSlot {
                    qpn: q.qpn,
                    track: Mutex::new(InFlight::new(window)),
                    qp: Mutex::new(q),
                    recv_seq: AtomicU64::new(u64::from(cfg.recv_depth)),
                    recv_owed: AtomicU64::new(0),
                    activity: AtomicU64::new(0),
                    lane_wrs: AtomicU32::new(0),
                    watch: Mutex::new((0, Instant::now())),
                    errored: AtomicBool::new(false),
                }
            })
            .collect();
        Self {
            qps,
            send_cq,
            recv_cq,
            cfg,
            broken: FirstCause::new(),
            broken_at: OnceLock::new(),
            me: Weak::new(),
            notify,
            peer,
            deferred: Deferred::default(),
            graveyard: Mutex::new(Vec::new()),
            lanes: Mutex::default(),
            reaping: Mutex::new(ReapScratch::default()),
            poller: Arc::default(),
            engine_reaper: Weak::new(),
            label,
        }
    }

    /// Knows itself as `me` (the `Arc` it is built into), so that its batches can reach
    /// it when they fail in the engine core.
    pub fn with_self(mut self, me: &Weak<VerbsConn>) -> Self {
        self.me = me.clone();
        self
    }

    /// Kicks `poller` (the engine's completion thread) on every post instead of a private
    /// one nobody waits on.
    pub fn with_poller(mut self, engine: &Arc<PollerShared>) -> Self {
        self.poller = Arc::clone(&engine.wake);
        self.engine_reaper = Arc::downgrade(engine);
        self
    }

    /// Round `round` (counted by the caller from 0) of a thread that waits on this
    /// connection: for a prepared run's send completion (`send_only`: a run ends with
    /// one), for window room, or for the previous run to let go. It reaps this
    /// connection's CQs, and every [`ENGINE_REAP_EVERY`]th round the whole engine's
    /// instead. These polls make the completion thread step aside, so batches and
    /// notifications on other connections that nobody waits for would otherwise stall for
    /// as long as this thread waits (a large transfer: seconds).
    pub fn reap_waiting(&self, round: u32, send_only: bool) -> usize {
        if round % ENGINE_REAP_EVERY == ENGINE_REAP_EVERY - 1
            && let Some(e) = self.engine_reaper.upgrade()
        {
            return e.poll_once();
        }
        self.poller.caller_polled();
        self.reap(!send_only)
    }

    pub fn is_broken(&self) -> bool {
        self.broken.get().is_some()
    }

    /// Why the connection broke (the first error seen).
    pub fn broken_reason(&self) -> Option<Error> {
        self.broken.get().cloned()
    }

    fn broken_err(&self) -> Error {
        self.broken_reason().unwrap_or(Error::Shutdown)
    }

    /// Posts one batch: plan, stripe, post WR chains per QP within each QP's window. Blocks
    /// only while windows are full, and never past `deadline`. Completion is reported to
    /// `sink` from the completion thread.
    pub fn post<I>(
        &self,
        sink: impl Into<CtlSink>,
        ops: I,
        notify: Option<u32>,
        deadline: Instant,
    ) -> Result<(), Error>
    where
        I: IntoIterator,
        I::Item: std::borrow::Borrow<PlanOp>,
    {
        if self.is_broken() {
            return Err(self.broken_err());
        }
        self.poller.kick();
        let mut wrs = plan_wrs(ops, self.cfg.max_wr_bytes, self.cfg.max_sge);
        let held = notify.map(|_| match wrs.last() {
            Some(w) if w.dir == Dir::Write => wrs.pop().expect("checked non-empty"),
            // Reads (or nothing) before the notification: a zero-length WRITE_WITH_IMM.
            _ => PlannedWr::zero_length_write(),
        });
        let ctl = BatchCtl::new(
            sink.into(),
            wrs.len() as u64 + 1,
            held,
            notify,
            self.me.clone(),
        );
        let settle: Weak<dyn Settle> = Arc::downgrade(&ctl) as Weak<BatchCtl>;
        ctl.sink.settled_by(settle);
        // A lone WRITE with a notification leaves nothing before the held WR. A single WR
        // goes to QP 0, as striping would put it, without building a queue per QP.
        let posted = match wrs.len() {
            // A tag alone: nothing to post before it, unless the batch already expired.
            0 => !ctl.sink.is_stopped(),
            1 => self.post_queues(&ctl, &mut [WrQueue::new(wrs)], deadline)?,
            _ => self.post_queues(&ctl, &mut stripe(wrs, self.qps.len()), deadline)?,
        };
        if !posted {
            return Ok(());
        }
        self.release(&ctl, 1);
        Ok(())
    }

    /// Plans a prepared batch as one chain on QP 0, if it fits: at most one doorbell's worth
    /// of WRs, window space that QP 0 can lend it for good (see [`InFlight::lend`]), and
    /// no READ before a notification (the notification rides on the chain's last WRITE,
    /// which RC orders after the WRITEs before it on the same QP, but not after READ
    /// responses). `None`: re-submit it as ordinary batches.
    pub fn prepare_fast_path<I>(
        &self,
        ops: I,
        notify: bool,
        cell: Arc<RunCell>,
    ) -> Option<LaneChain>
    where
        I: IntoIterator,
        I::Item: std::borrow::Borrow<PlanOp>,
    {
        let mut wrs = plan_wrs(ops, self.cfg.max_wr_bytes, self.cfg.max_sge);
        if notify {
            if wrs.iter().any(|w| w.dir == Dir::Read) {
                return None;
            }
            if wrs.is_empty() {
                wrs.push(PlannedWr::zero_length_write());
            }
        }
        let n = wrs.len();
        if n == 0 || n > self.cfg.chain_max as usize || self.is_broken() {
            return None;
        }
        if !lock(&self.qps[0].track).lend(n as u32) {
            return None;
        }
        let lane = Arc::new(Lane {
            wrs,
            cell,
            posted: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
        });
        let index = lock(&self.lanes).insert(Arc::clone(&lane));
        Some(LaneChain { index, lane })
    }

    /// Posts one run of a lane on QP 0: its last WR signalled (the one completion of the
    /// run) and carrying `imm` if given. Never waits: the lane's window space is its own.
    /// The previous run must have been waited for.
    pub fn post_lane(&self, c: &LaneChain, imm: Option<u32>) -> Result<(), Error> {
        if self.is_broken() {
            return Err(self.broken_err());
        }
        let l = &*c.lane;
        debug_assert!(
            !l.posted.load(Ordering::Acquire),
            "a lane run still in flight"
        );
        let slot = &self.qps[0];
        let n = l.wrs.len();
        self.poller.kick();
        l.posted.store(true, Ordering::Release);
        slot.lane_wrs.fetch_add(n as u32, Ordering::AcqRel);
        let (index, last) = (c.index as u64, n - 1);
        // Only the last WR's completion (success, or the flush that ends the run) counts.
        let specs = chain_specs(
            &l.wrs,
            move |k| {
                encode_wr_id(
                    WrKind::Lane,
                    0,
                    if k == last {
                        index
                    } else {
                        index | LANE_NOT_LAST
                    },
                )
            },
            imm,
        );
        let mut qp = lock(&slot.qp);
        // SAFETY: the SGEs come from ops the engine core validated against live
        // registrations when the batch was prepared; the lane's run cell holds those
        // regions' pins, and the connection's lane table holds the lane until this run's
        // completion has been reaped or the QP is destroyed.
        let posted = unsafe { qp.post_chain(specs) };
        drop(qp);
        if let Err(e) = posted {
            return Err(self.break_conn(e));
        }
        slot.record_activity();
        // A break that raced with this post (after the check above) may have missed the
        // run; the QP is in ERR, so fail it here rather than wait for a flush.
        if self.is_broken() {
            l.cell.fail(self.broken_err());
        }
        Ok(())
    }

    /// Lane `index`'s run has left the send queue: its last WR completed (`ok`), or
    /// completed in error (the connection broke, so every WR before it has left too). The
    /// run succeeds, unless the connection broke meanwhile (the break cut it, as it cuts
    /// ordinary batches); else it fails now, with nothing of it left on the NIC. A lane
    /// whose prepared batch is gone leaves the table instead, and reports nothing.
    fn lane_ended(&self, index: usize, ok: bool) {
        let mut lanes = lock(&self.lanes);
        let Some(Some(l)) = lanes.slots.get(index) else {
            return;
        };
        let l = Arc::clone(l);
        // Cleared before the outcome is reported, so the next run sees it clear.
        if !l.posted.swap(false, Ordering::AcqRel) {
            return;
        }
        let slot = &self.qps[0];
        let n = l.wrs.len() as u32;
        let dropped = l.dropped.load(Ordering::Acquire);
        // The space comes back before the run stops counting as outstanding, so whoever
        // sees nothing in flight also sees the space.
        if dropped {
            lanes.remove(index);
            drop(lanes);
            lock(&slot.track).give_back(n);
        } else {
            drop(lanes);
        }
        slot.lane_wrs.fetch_sub(n, Ordering::AcqRel);
        slot.record_activity();
        if dropped {
            return;
        }
        if ok && !self.is_broken() {
            l.cell.succeed();
        } else {
            l.cell.fail(self.broken_err());
        }
    }

    /// Lane `c`'s run passed its deadline: if it is on the send queue, the connection
    /// breaks (its QPs go to ERR) and this thread reaps until the run has flushed, for
    /// [`FLUSH_WAIT`](health::FLUSH_WAIT) at most. `true` when the run is off the NIC.
    pub fn abort_lane(&self, c: &LaneChain) -> bool {
        let l = &*c.lane;
        if !l.posted.load(Ordering::Acquire) {
            return true;
        }
        self.break_conn(Error::peer_gone(
            self.peer,
            PeerFault::Unresponsive,
            format!(
                "a prepared batch's run passed its deadline with {} work requests in flight: its QPs were moved to ERR to flush them",
                l.wrs.len()
            ),
        ));
        let until = Instant::now() + health::FLUSH_WAIT;
        if self.reap_until(until, true, || !l.posted.load(Ordering::Acquire)) {
            return true;
        }
        tracing::warn!(conn = %self.label, "a prepared batch's run did not flush in time: its memory stays pinned until it does");
        false
    }

    /// The prepared batch of lane `c` is gone. Its window space comes back now, or when its
    /// last run completes or flushes; until then the lane (and its pins) stays, and on a
    /// broken connection whose run never flushed, until the QPs are destroyed.
    pub fn drop_lane(&self, c: &LaneChain) {
        let mut lanes = lock(&self.lanes);
        match lanes.slots.get(c.index) {
            Some(Some(l)) if Arc::ptr_eq(l, &c.lane) => {}
            _ => return,
        }
        if c.lane.posted.load(Ordering::Acquire) {
            c.lane.dropped.store(true, Ordering::Release);
            return;
        }
        lanes.remove(c.index);
        drop(lanes);
        lock(&self.qps[0].track).give_back(c.lane.wrs.len() as u32);
    }

    /// Posts every per-QP queue of `ctl`'s WRs within the windows, reaping on this thread
    /// while they are full. `Ok(false)`: the sink asked to stop (cancelled or past its
    /// deadline; what was posted completes or flushes on its own). Errors fail `ctl`; a
    /// post error also breaks the connection; `Timeout` when `deadline` passes.
    fn post_queues(
        &self,
        ctl: &Arc<BatchCtl>,
        per_qp: &mut [WrQueue<PlannedWr>],
        deadline: Instant,
    ) -> Result<bool, Error> {
        // When the windows first stalled: a post that never waits reads no clock.
        let mut stalled: Option<Instant> = None;
        let mut round = 0u32;
        // The first round checks the batch without the clock: the core has just stamped
        // it and failed it already if its deadline had passed. Later rounds (window full
        // meanwhile) read the clock.
        let mut first = true;
        loop {
            if self.is_broken() {
                let e = self.broken_err();
                ctl.fail(e.clone());
                return Err(e);
            }
            let stop = if std::mem::take(&mut first) {
                ctl.sink.is_stopped()
            } else {
                ctl.sink.should_stop()
            };
            if stop {
                return Ok(false);
            }
            let mut progressed = false;
            let mut left = false;
            for (i, q) in per_qp.iter_mut().enumerate() {
                if q.is_empty() {
                    continue;
                }
                match self.post_some(i, q, ctl) {
                    Ok(n) => progressed |= n > 0,
                    Err(e) => {
                        let e = self.break_conn(e);
                        ctl.fail(e.clone());
                        return Err(e);
                    }
                }
                left |= !q.is_empty();
            }
            if !left {
                return Ok(true);
            }
            if !progressed {
                let now = Instant::now();
                let since = *stalled.get_or_insert(now);
                if now >= deadline {
                    let e = Error::Timeout { after: now - since };
                    ctl.fail(e.clone());
                    return Err(e);
                }
                // Every window is full: reap completions on this thread rather than
                // sleep until the completion thread does (it backs off while callers
                // poll), as perftest's posting loop does.
                round = round.wrapping_add(1);
                if self.reap_waiting(round, false) == 0 {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Proves the data path before the connection is handed out: one signalled
    /// zero-length RDMA WRITE per QP (no local SGE; a zero-length WRITE carries no
    /// memory access, so the responder checks no rkey), reaped on this thread, until
    /// `deadline`. A path that cannot carry traffic (a wrong GID or QP number, a peer
    /// that died during the handshake) fails here, at connect time, instead of in the
    /// first transfer.
    pub fn probe(&self, deadline: Instant) -> Result<(), Error> {
        let started = Instant::now();
        let done = Arc::new(ProbeSink::default());
        let n = self.qps.len();
        let ctl = BatchCtl::new(
            CtlSink::from(Arc::clone(&done)),
            n as u64 + 1,
            None,
            None,
            Weak::new(),
        );
        let mut per_qp: Vec<WrQueue<PlannedWr>> = (0..n)
            .map(|_| WrQueue::new(smallvec::smallvec![PlannedWr::zero_length_write()]))
            .collect();
        match self.post_queues(&ctl, &mut per_qp, deadline) {
            Ok(_) => {}
            Err(e @ Error::Timeout { .. }) => return Err(probe_timeout(e)),
            Err(e) => return Err(e),
        }
        self.release(&ctl, 1);
        loop {
            if let Some(r) = done.outcome() {
                return r;
            }
            if Instant::now() >= deadline {
                let e = Error::Timeout {
                    after: started.elapsed(),
                };
                ctl.fail(e.clone());
                return Err(probe_timeout(e));
            }
            self.poll_now();
            std::thread::yield_now();
        }
    }

    /// Reaps on this thread, telling the completion thread a caller is reaping.
    pub fn poll_now(&self) -> usize {
        self.poller.caller_polled();
        self.poll()
    }

    /// Posts as many WRs from `q` on QP `i` as its window allows, as one chain.
    fn post_some(
        &self,
        i: usize,
        q: &mut WrQueue<PlannedWr>,
        ctl: &Arc<BatchCtl>,
    ) -> Result<usize, Error> {
        let slot = &self.qps[i];
        let mut qp = lock(&slot.qp);
        // Checked under the post lock: see `settle`.
        if ctl.stopping.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let (first, n) = {
            let mut t = lock(&slot.track);
            let n = (t.available() as usize)
                .min(self.cfg.chain_max as usize)
                .min(q.len());
            if n == 0 {
                return Ok(0);
            }
            let first = t.reserve(n as u32);
            let (mut wrs, mut bytes) = (0u32, 0u64);
            for (k, w) in q.pending()[..n].iter().enumerate() {
                wrs += 1;
                bytes += w.len();
                if is_signaled(k, n, self.cfg.signal_every as usize) {
                    ctl.on_nic.fetch_add(wrs, Ordering::SeqCst);
                    t.push(Group {
                        last_seq: (first + k as u64) & SEQ_MASK,
                        wrs,
                        bytes,
                        owner: Arc::clone(ctl),
                    });
                    (wrs, bytes) = (0, 0);
                }
            }
            (first, n)
        };
        let specs = q.pending()[..n].iter().enumerate().map(|(k, w)| WrSpec {
            wr_id: encode_wr_id(WrKind::Data, i, (first + k as u64) & SEQ_MASK),
            signaled: is_signaled(k, n, self.cfg.signal_every as usize),
            dir: w.dir,
            remote: w.remote,
            rkey: w.rkey,
            sges: &w.sges,
            imm: None,
        });
        // SAFETY: every SGE comes from an op the engine core validated against a live
        // registration, and the core keeps that region registered (deregistration of a
        // region with in-flight batches is refused) until the batch is finished.
        unsafe { qp.post_chain(specs) }?;
        q.advance(n);
        slot.record_activity();
        Ok(n)
    }

    /// Drops `n` from the batch's pending count; at zero posts the notification or completes.
    fn release(&self, ctl: &Arc<BatchCtl>, n: u64) {
        if !ctl.pending.landed(n) {
            return;
        }
        // A failing batch never completes (nor sends its notification).
        if ctl.done.load(Ordering::Acquire) || ctl.stopping.load(Ordering::Acquire) {
            return;
        }
        // Only a batch with a tag ever holds a WR back: the others skip the lock.
        let held = if ctl.tag.is_some() {
            lock(&ctl.held).take()
        } else {
            None
        };
        match held {
            Some(w) => {
                ctl.pending.rearm(1);
                self.deferred.push_back((Arc::clone(ctl), w));
                self.post_deferred();
            }
            None => {
                if !ctl.done.swap(true, Ordering::AcqRel) {
                    ctl.sink.complete();
                }
            }
        }
    }

    /// Posts held notification WRs on QP 0 while its window has room (never blocks: the
    /// completion thread calls this too).
    fn post_deferred(&self) {
        loop {
            if self.is_broken() {
                let e = self.broken_err();
                for (ctl, _) in self.deferred.take_all() {
                    ctl.fail(e.clone());
                }
                return;
            }
            let slot = &self.qps[0];
            let Ok(mut qp) = slot.qp.try_lock() else {
                // A poster holds QP 0; it or the completion thread will retry.
                return;
            };
            let Some((ctl, w)) = self.deferred.pop_front() else {
                return;
            };
            // Failing (checked under the post lock: see `settle`): its failure is reported
            // without it.
            if ctl.stopping.load(Ordering::Acquire) {
                continue;
            }
            // sideway passes the immediate through as raw `__be32`; send network order so
            // C peers reading it with ntohl agree.
            let imm = ctl.tag.unwrap_or(0).to_be();
            let one = std::slice::from_ref(&w);
            // SAFETY: as in `post_some`: the SGEs are from validated ops whose regions stay
            // registered until the batch finishes; an empty list is a zero-length write.
            match unsafe { self.post_run_on_qp0(&mut qp, &ctl, one, WrKind::Notify, Some(imm)) } {
                Ok(true) => {}
                Ok(false) => {
                    self.deferred.push_front((ctl, w));
                    return;
                }
                Err(e) => {
                    drop(qp);
                    ctl.fail(self.break_conn(e));
                    return;
                }
            }
        }
    }

    /// Posts `wrs` on QP 0 (whose post lock the caller holds as `qp`) as one chain owned
    /// by `ctl`, all or nothing: one group whose last WR alone is signalled and carries
    /// `imm` if given (RC retires the WRs before it with its completion). `Ok(false)`: the
    /// window has no room for all of them, nothing posted.
    ///
    /// # Safety
    /// The SGEs of `wrs` point into memory registered under their lkeys that stays valid
    /// until the chain's completion has been polled or the QP is destroyed (none for a
    /// zero-length WRITE).
    unsafe fn post_run_on_qp0(
        &self,
        qp: &mut RcQp,
        ctl: &Arc<BatchCtl>,
        wrs: &[PlannedWr],
        kind: WrKind,
        imm: Option<u32>,
    ) -> Result<bool, Error> {
        let slot = &self.qps[0];
        let n = wrs.len();
        let first = {
            let mut t = lock(&slot.track);
            if n == 0 || (t.available() as usize) < n {
                return Ok(false);
            }
            let first = t.reserve(n as u32);
            ctl.on_nic.fetch_add(n as u32, Ordering::SeqCst);
            t.push(Group {
                last_seq: (first + n as u64 - 1) & SEQ_MASK,
                wrs: n as u32,
                bytes: wrs.iter().map(PlannedWr::len).sum(),
                owner: Arc::clone(ctl),
            });
            first
        };
        let specs = chain_specs(
            wrs,
            move |k| encode_wr_id(kind, 0, (first + k as u64) & SEQ_MASK),
            imm,
        );
        // SAFETY: forwarded from this fn's contract.
        unsafe { qp.post_chain(specs) }?;
        slot.record_activity();
        Ok(true)
    }

    /// Marks the connection broken (first reason wins) and fails every batch with WRs on it.
    /// Returns the reason that stands, for the caller to report instead of its own.
    pub fn break_conn(&self, err: Error) -> Error {
        self.stop(err, false)
    }

    /// `break_conn` for an error (`deliberate` false: logged as a warning) or for a close
    /// the engine asked for, which is logged as a warning only if it cut work short.
    fn stop(&self, err: Error, deliberate: bool) -> Error {
        // Whichever thread got here first named the cause; a later caller fails what it
        // finds with that cause, not with its own view (the health check's "QP in ERR"
        // reached a batch whose REM_ACCESS_ERR another thread had recorded).
        let (err, first) = self.broken.record(err);
        if first {
            let _ = self.broken_at.set(Instant::now());
        }
        // Stop the QPs first (no more DMA, the peer's QPs see errors): every WR on them
        // flushes, and each batch with WRs there reports its failure once they have (see
        // `BatchCtl::fail`). A QP busy posting is skipped: its poster sees `broken` next,
        // and the next health check (or `close`) moves it, so a broken connection accepts
        // no WRITE or notification for longer than one health-check period.
        self.stop_qps();
        let mut cut = 0u64;
        let mut owners = Vec::new();
        for slot in &self.qps {
            let t = lock(&slot.track);
            owners.extend(t.groups().map(|g| {
                if g.owner.sink.is_user_work() {
                    cut += u64::from(g.wrs);
                }
                Arc::clone(&g.owner)
            }));
        }
        // Outside the track locks: a failure may be reported (and its batch settled) here.
        for o in owners {
            o.fail(err.clone());
        }
        for (ctl, _) in self.deferred.take_all() {
            cut += 1;
            ctl.fail(err.clone());
        }
        // A lane's run fails when its last WR flushes (`lane_ended`), or when the
        // flushes are given up on; until then it pins its regions.
        for l in lock(&self.lanes).slots.iter().flatten() {
            if l.posted.load(Ordering::Acquire) {
                cut += l.wrs.len() as u64;
            }
        }
        if first {
            if !deliberate {
                tracing::warn!(conn = %self.label, error = %err, "verbs connection broken");
            } else if cut > 0 {
                tracing::warn!(conn = %self.label, error = %err, in_flight = cut, "verbs connection closed with work requests in flight");
            } else {
                tracing::debug!(conn = %self.label, reason = %err, "verbs connection closed");
            }
        }
        err
    }

    /// A broken connection whose WRs did not all flush within
    /// [`FLUSH_GIVE_UP`](health::FLUSH_GIVE_UP) of the break (a QP that could not be
    /// moved to ERR, a provider that does not flush): their batches' failures are
    /// reported now, and the batches (with the regions they pin) wait in the graveyard for
    /// the QPs to be destroyed.
    fn give_up_flushes(&self) {
        if self
            .broken_at
            .get()
            .is_none_or(|t| t.elapsed() < health::FLUSH_GIVE_UP)
        {
            return;
        }
        for slot in &self.qps {
            let groups = lock(&slot.track).drain_all();
            for g in groups {
                g.owner.report_doomed();
                lock(&self.graveyard).push(g.owner);
            }
        }
        // A lane's run that never flushed stays in the table until the QPs are gone.
        let err = self.broken_err();
        for l in lock(&self.lanes).slots.iter().flatten() {
            if l.posted.load(Ordering::Acquire) {
                l.cell.fail(err.clone());
            }
        }
    }

    /// [`Settle`] for `ctl`, one of this connection's batches, failing (or cancelled) in
    /// the engine core: once no post of it is under way, if WRs of it are on a send
    /// queue, breaks the connection (its QPs go to ERR) and reaps until they have
    /// flushed, for [`FLUSH_WAIT`](health::FLUSH_WAIT) at most. A cancelled batch first
    /// reaps, as long at most, for its WRs to complete on their own. `true` when none is
    /// left.
    fn settle(&self, ctl: &BatchCtl, why: Stop) -> bool {
        // Broken for longer than the flushes may take: what has not flushed never will
        // (the health check gives up on it), so waiting again is no use.
        if self
            .broken_at
            .get()
            .is_some_and(|t| t.elapsed() >= health::FLUSH_GIVE_UP)
        {
            return ctl.on_nic.load(Ordering::Acquire) == 0;
        }
        let until = Instant::now() + health::FLUSH_WAIT;
        // Posters check `stopping` under the post lock: once each QP's lock has been
        // free, nothing more of the batch goes out. Tried, not waited for: the thread
        // failing the batch might hold one.
        if !self.qps.iter().all(|s| s.wait_free(until)) {
            return false;
        }
        let off_nic = || ctl.on_nic.load(Ordering::Acquire) == 0;
        if off_nic() {
            return true;
        }
        let (until, what) = match why {
            Stop::Failed => (until, "failed"),
            // Done on their own: the connection carries on.
            _ if self.reap_until(until, false, off_nic) => return true,
            Stop::Cancelled => (Instant::now() + health::FLUSH_WAIT, "was cancelled"),
        };
        let n = ctl.on_nic.load(Ordering::Acquire);
        self.break_conn(Error::peer_gone(
            self.peer,
            PeerFault::Unresponsive,
            format!("a batch {what} with {n} work requests in flight: its QPs were moved to ERR to flush them"),
        ));
        if self.reap_until(until, true, off_nic) {
            return true;
        }
        tracing::warn!(conn = %self.label, left = ctl.on_nic.load(Ordering::Acquire), "a failed batch's work requests did not flush in time: its memory stays pinned until they do (or the connection is gone)");
        false
    }

    /// Reaps until `gone()` (what was waited for has left the send queues: `true`) or
    /// `until` passes; `flushing`: the connection broke, and every QP is moved to ERR
    /// meanwhile.
    fn reap_until(&self, until: Instant, flushing: bool, gone: impl Fn() -> bool) -> bool {
        let mut round = 0u32;
        loop {
            if gone() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            // `stop_qps` skips a QP busy posting; it must stop too.
            if flushing && !self.qps.iter().all(|s| s.errored.load(Ordering::Acquire)) {
                self.stop_qps();
            }
            round = round.wrapping_add(1);
            if self.reap_waiting(round, false) == 0 {
                std::thread::sleep(FLUSH_POLL);
            }
        }
    }

    /// Moves every QP not yet in ERR whose post lock is free to ERR.
    fn stop_qps(&self) {
        for slot in &self.qps {
            if slot.errored.load(Ordering::Acquire) {
                continue;
            }
            if let Ok(mut q) = slot.qp.try_lock() {
                slot.to_error(&mut q);
            }
        }
    }

    /// Moves every QP to ERR (so the peer notices) and fails what is in flight with `err`.
    pub fn close(&self, err: Error) {
        self.stop(err, true);
        for slot in &self.qps {
            slot.to_error(&mut lock(&slot.qp));
        }
    }

    /// Holds QP `i`'s post lock, as a poster in the middle of a post does.
    #[cfg(test)]
    pub fn hold_qp(&self, i: usize) -> std::sync::MutexGuard<'_, RcQp> {
        lock(&self.qps[i].qp)
    }

    /// Whether QP `i` is in ERR (its real state).
    #[cfg(test)]
    pub fn qp_in_error(&self, i: usize) -> bool {
        lock(&self.qps[i].qp).query_state() == Some(QueuePairState::Error)
    }

    /// Keeps every other thread (the completion thread included) from reaping this
    /// connection while the hold lives, so a test can look at a run still in flight.
    #[cfg(test)]
    pub fn hold_reaping(&self) -> ReapingHold<'_> {
        ReapingHold(lock(&self.reaping))
    }

    /// Polls both CQs once and handles what they held; returns how many completions that
    /// was. Returns 0 at once if another thread is reaping this connection right now.
    pub fn poll(&self) -> usize {
        self.reap(true)
    }

    fn reap(&self, recv: bool) -> usize {
        let Ok(mut guard) = self.reaping.try_lock() else {
            return 0;
        };
        let ReapScratch { wcs, retired } = &mut *guard;
        let mut handled = self.reap_send(wcs, retired).unwrap_or(0);
        if recv {
            match poll_cq(&self.recv_cq, wcs) {
                Ok(n) => {
                    handled += n;
                    if wcs[..n].iter().any(|w| w.status != WC_SUCCESS) {
                        handled += self.drain_send_cq(retired);
                    }
                    for wc in &wcs[..n] {
                        self.on_recv_wc(wc);
                    }
                }
                Err(e) => {
                    self.break_conn(e);
                }
            }
            if !self.is_broken() {
                self.replenish_recvs();
            }
        }
        // Room freed by retired WRs only matters to held notifications waiting for it.
        if !self.deferred.is_empty() {
            self.post_deferred();
        }
        handled
    }

    /// Handles everything in the send CQ, before a failed RECV is: a flushed RECV only says
    /// that its QP is in ERR, and rxe completes the WR that put it there (a remote access
    /// error, say) before it moves the QP to ERR and flushes the RECVs, so that completion
    /// is already in the send CQ and names the cause. The caller holds the reaping lock.
    #[cold]
    fn drain_send_cq(&self, retired: &mut Vec<Group<Arc<BatchCtl>>>) -> usize {
        let mut wcs = [Wc::default(); POLL_BATCH];
        let mut handled = 0;
        while let Some(n @ 1..) = self.reap_send(&mut wcs, retired) {
            handled += n;
        }
        handled
    }

    /// One poll of the send CQ into `wcs`, each completion handled; `None` if the poll
    /// itself failed, which breaks the connection.
    fn reap_send(
        &self,
        wcs: &mut [Wc; POLL_BATCH],
        retired: &mut Vec<Group<Arc<BatchCtl>>>,
    ) -> Option<usize> {
        match poll_cq(&self.send_cq, wcs) {
            Ok(n) => {
                for wc in &wcs[..n] {
                    self.on_send_wc(wc, retired);
                }
                Some(n)
            }
            Err(e) => {
                self.break_conn(e);
                None
            }
        }
    }

    /// The typed error for a failed completion on QP `qi`.
    fn completion_error(&self, wc: &Wc, qi: usize) -> Error {
        Error::Completion {
            status: wc.status,
            status_str: wc_status_name(wc.status).to_string(),
            vendor_err: wc.vendor_err,
            wr_id: wc.wr_id,
            qp_num: self.qps[qi].qpn,
        }
    }

    fn on_send_wc(&self, wc: &Wc, buf: &mut Vec<Group<Arc<BatchCtl>>>) {
        let (kind, qi, seq) = decode_wr_id(wc.wr_id);
        if kind == WrKind::Recv || qi >= self.qps.len() {
            return;
        }
        let ok = wc.status == WC_SUCCESS;
        if !ok && !self.is_broken() {
            // The first failed completion names the cause; the flushes after it do not.
            self.break_conn(self.completion_error(wc, qi));
        }
        if kind == WrKind::Lane {
            if seq & LANE_NOT_LAST != 0 {
                // An earlier WR of a run, flushed or failed: its last WR completes after it.
            } else {
                self.lane_ended(seq as usize, ok);
            }
            return;
        }
        let n = lock(&self.qps[qi].track).retire_through(seq, buf);
        if n > 0 {
            self.qps[qi].record_activity();
        }
        for g in buf.drain(..) {
            g.owner.off_nic(g.wrs);
            if !ok {
                // Flushed (or failed): the batch fails, once its last WR has left the
                // send queues and it let go of its memory (`BatchCtl`'s `Drop`).
                g.owner.doom(self.broken_err());
                continue;
            }
            if !g.owner.done.load(Ordering::Acquire) {
                g.owner.sink.on_acked(g.wrs as usize, g.bytes);
            }
            self.release(&g.owner, u64::from(g.wrs));
        }
    }

    fn on_recv_wc(&self, wc: &Wc) {
        let (WrKind::Recv, qi, _) = decode_wr_id(wc.wr_id) else {
            return;
        };
        if qi >= self.qps.len() {
            return;
        }
        if wc.status != WC_SUCCESS {
            // RECVs are only flushed when the QP went to ERR.
            self.break_conn(self.completion_error(wc, qi));
            return;
        }
        // A broken connection surfaces nothing more from its peer (its QPs are in ERR or
        // about to be; a RECV completed meanwhile is dropped).
        if wc.opcode == WC_RECV_RDMA_WITH_IMM
            && !self.is_broken()
            && let Some(n) = &self.notify
        {
            let tag = u32::from_be(wc.imm);
            tracing::trace!(conn = %self.label, tag, bytes = wc.byte_len, "notification");
            if !n.notify(tag, wc.byte_len) {
                // The WRITE_WITH_IMM was acknowledged already: the sender learns of the
                // drop only from the connection breaking.
                self.break_conn(Error::peer_gone(
                    self.peer,
                    PeerFault::Overran,
                    "our notification queue is full: the peer's notification was dropped",
                ));
            }
        }
        self.qps[qi].recv_owed.fetch_add(1, Ordering::AcqRel);
    }

    /// Reposts consumed RECVs (once a quarter of the ring is owed) on QPs whose post lock
    /// is free. A poster may hold a QP for the whole transfer (rxe posts synchronously),
    /// and the completion thread must not stall behind it; the owed RECVs go in on a later
    /// round.
    fn replenish_recvs(&self) {
        for (qi, slot) in self.qps.iter().enumerate() {
            // In batches of a quarter of the ring: a repost per notification would sit on
            // the receiver's critical path, and three quarters stay posted meanwhile.
            if slot.recv_owed.load(Ordering::Acquire) < u64::from(self.cfg.recv_depth.div_ceil(4)) {
                continue;
            }
            let Ok(mut qp) = slot.qp.try_lock() else {
                continue;
            };
            let n = slot.recv_owed.swap(0, Ordering::AcqRel);
            let first = slot.recv_seq.fetch_add(n, Ordering::Relaxed);
            if let Err(e) = qp.post_recvs((first..first + n).map(|s| recv_wr_id(qi, s))) {
                drop(qp);
                self.break_conn(e);
                return;
            }
        }
    }

    /// Queries each QP's real state (the cached one misses async errors); a QP in ERR breaks
    /// the connection, and so does a QP whose outstanding WRs made no progress for
    /// [`STALL_TIMEOUT`](health::STALL_TIMEOUT). QPs busy posting are skipped this round (a post in progress is
    /// progress: rxe moves the data inside the post call). A connection whose QP 0 has
    /// been idle for [`HEARTBEAT_IDLE`](health::HEARTBEAT_IDLE) gets a heartbeat there, so a side that only
    /// receives still learns that its peer died.
    pub fn health_check(&self) {
        if self.is_broken() {
            // Finish the break: a QP that a poster held when it broke is still RTS.
            self.stop_qps();
            self.give_up_flushes();
            return;
        }
        for (qi, slot) in self.qps.iter().enumerate() {
            let Ok(mut qp) = slot.qp.try_lock() else {
                continue;
            };
            if qp.query_state() == Some(QueuePairState::Error) {
                drop(qp);
                self.break_on_error_state(slot.qpn);
                return;
            }
            let outstanding = slot.outstanding();
            let idle = slot.idle();
            let verdict = health::verdict(outstanding, idle, qi == 0);
            if verdict == Verdict::Stalled {
                drop(qp);
                self.break_conn(Error::peer_gone(
                    self.peer,
                    PeerFault::Unresponsive,
                    format!(
                        "no completion on QP {:#x} for {idle:.1?} with {outstanding} WRs outstanding",
                        slot.qpn
                    ),
                ));
                return;
            }
            if verdict == Verdict::Heartbeat
                && self.deferred.is_empty()
                && let Err(e) = self.post_heartbeat(&mut qp)
            {
                drop(qp);
                self.break_conn(e);
                return;
            }
        }
    }

    /// QP `qpn` was found in ERR. Its failed completion, if it has one, is in the send CQ
    /// already and names the cause, which the state does not: the send CQ is drained first
    /// (hazard 9 again, seen from the health check), under the reaping lock so that no
    /// reaper handles a completion between the drain and the break. The lock is waited
    /// for, not tried: a reaper holds it for one round, and no caller of the health check
    /// holds it.
    #[cold]
    fn break_on_error_state(&self, qpn: u32) {
        let mut guard = lock(&self.reaping);
        let symptom = health::cause_of_error_state(
            &self.broken,
            || {
                self.drain_send_cq(&mut guard.retired);
            },
            || {
                Error::peer_gone(
                    self.peer,
                    PeerFault::Disconnected,
                    format!("QP {qpn:#x} is in ERR state"),
                )
            },
        );
        if let Some(e) = symptom {
            self.break_conn(e);
        }
    }

    /// Posts one signalled zero-length WRITE on QP 0 (whose post lock the caller holds as
    /// `qp`). It touches no memory on either side. A live peer acknowledges it; a dead one
    /// makes it fail (hardware: RETRY_EXC_ERR) or stall (rxe), and the watchdog then
    /// breaks the connection, as it would for data.
    fn post_heartbeat(&self, qp: &mut RcQp) -> Result<(), Error> {
        let ctl = BatchCtl::new(
            CtlSink::from(Arc::new(Heartbeat)),
            1,
            None,
            None,
            Weak::new(),
        );
        let w = PlannedWr::zero_length_write();
        // SAFETY: a zero-length WRITE has no SGE: no local memory is read, and the
        // responder checks no rkey and writes nothing. A full window skips this round.
        unsafe { self.post_run_on_qp0(qp, &ctl, std::slice::from_ref(&w), WrKind::Data, None) }
            .map(drop)
    }

    /// Whether any WR (data or notification) is in flight or a notification waits for
    /// window room: the completion thread keeps polling while this holds.
    pub fn has_outstanding(&self) -> bool {
        self.qps.iter().any(|s| s.outstanding() > 0) || !self.deferred.is_empty()
    }

    /// WRs in flight on all QPs.
    #[cfg(test)]
    pub fn outstanding(&self) -> u32 {
        self.qps.iter().map(QpSlot::outstanding).sum()
    }
}

/// The owner of a heartbeat WR: its outcome matters only through the connection (an
/// error completion or the watchdog breaks it), so it records nothing.
struct Heartbeat;

impl BatchSink for Heartbeat {
    fn on_acked(&self, _wrs: usize, _bytes: u64) {}
    fn fail(&self, _err: Error) {}
    fn complete(&self) {}
    fn is_user_work(&self) -> bool {
        false
    }
}

/// Records the outcome of a [`VerbsConn::probe`].
#[derive(Default)]
struct ProbeSink {
    outcome: Mutex<Option<Result<(), Error>>>,
}

impl ProbeSink {
    fn outcome(&self) -> Option<Result<(), Error>> {
        lock(&self.outcome).clone()
    }
}

impl BatchSink for ProbeSink {
    fn on_acked(&self, _wrs: usize, _bytes: u64) {}
    fn fail(&self, err: Error) {
        lock(&self.outcome).get_or_insert(Err(err));
    }
    fn complete(&self) {
        lock(&self.outcome).get_or_insert(Ok(()));
    }
    /// The connect-time probe is the engine's own; its failure reaches `connect`.
    fn is_user_work(&self) -> bool {
        false
    }
}

/// The data-path probe (a zero-length RDMA WRITE per QP) did not complete before the
/// handshake deadline: a timeout, whatever backend (logged with what it was).
fn probe_timeout(e: Error) -> Error {
    tracing::debug!("the data-path probe did not complete before the handshake deadline");
    e
}

/// `wrs` as one chain: WR `k` gets `wr_id(k)`, and only the last is signalled and carries
/// `imm` (RC retires the WRs before it with its completion).
fn chain_specs<'a>(
    wrs: &'a [PlannedWr],
    wr_id: impl Fn(usize) -> u64 + 'a,
    imm: Option<u32>,
) -> impl Iterator<Item = WrSpec<'a>> {
    let n = wrs.len();
    wrs.iter().enumerate().map(move |(k, w)| {
        let last = k + 1 == n;
        WrSpec {
            wr_id: wr_id(k),
            signaled: last,
            dir: w.dir,
            remote: w.remote,
            rkey: w.rkey,
            sges: &w.sges,
            imm: if last { imm } else { None },
        }
    })
}

/// wr_id of the `seq`-th RECV posted on QP `qp`.
pub(crate) fn recv_wr_id(qp: usize, seq: u64) -> u64 {
    encode_wr_id(WrKind::Recv, qp, seq)
}
