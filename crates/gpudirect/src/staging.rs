//! The staging pipeline: GPU memory through a small ring of pinned host buffers.
//!
//! A transfer is cut into chunks of at most `chunk_size` bytes (small segments
//! are packed together, large ones split). Chunk `i` uses ring slot `i % depth`.
//! Each chunk goes through two asynchronous steps, *fill* (bytes into the slot)
//! and *drain* (bytes out of the slot):
//!
//! | transfer            | fill                      | drain                        |
//! |---------------------|---------------------------|------------------------------|
//! | write (GPU → peer)  | device-to-host copy       | wire write                   |
//! | read (peer → GPU)   | wire read                 | host-to-device copy          |
//! | receive (→ GPU)     | the peer's write landing  | host-to-device copy, credit  |
//!
//! Fills complete in order (one stream), so drains start in chunk order; while
//! chunk `i` drains, chunk `i+1` fills. When every slot is busy the pipeline
//! stops issuing fills (back-pressure) until the oldest slot drains. The final
//! notification is sent only after every drain completed; on any error no new
//! step is issued, every step in flight is waited for (so no DMA still targets
//! the ring), and the batch fails without a notification.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};

use crate::copy::{Backoff, CopyEngine, CopyTicket, Direction};
use crate::error::{GpuError, Result, StageKind};
use crate::memory::{DeviceSpan, PinnedBuffer, check_range};

/// Ring geometry and the deadline of one staged transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per ring slot (and so per chunk).
    pub chunk_size: usize,
    /// Number of ring slots.
    pub depth: usize,
    /// Deadline for one whole transfer.
    pub timeout: Duration,
}

impl Default for StagingConfig {
    /// 2 MiB x 4 slots: large enough to amortise per-copy and per-WR overheads,
    /// small enough that the pipeline fills quickly (UCX uses 4 MiB fragments for
    /// CUDA staging; Mooncake slices at 64 KiB for the wire).
    fn default() -> Self {
        Self {
            chunk_size: 2 << 20,
            depth: 4,
            timeout: Duration::from_secs(30),
        }
    }
}

impl StagingConfig {
    /// Reject nonsense: zero sizes, or a ring that overflows `usize`.
    pub fn validate(&self) -> Result<()> {
        if self.chunk_size == 0 || self.depth == 0 {
            return Err(GpuError::Config(format!(
                "chunk_size {} and depth {} must both be > 0",
                self.chunk_size, self.depth
            )));
        }
        if self.depth > 1024 {
            return Err(GpuError::Config(format!("depth {} > 1024", self.depth)));
        }
        self.chunk_size
            .checked_mul(self.depth)
            .ok_or_else(|| GpuError::Config("ring size overflows".into()))?;
        Ok(())
    }

    /// Bytes of the whole ring.
    pub fn ring_bytes(&self) -> usize {
        self.chunk_size * self.depth
    }
}

/// One contiguous copy of a transfer plan: `len` bytes at `local_off` in the GPU
/// span, from/to `remote_off` in the remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Offset in the local GPU span.
    pub local_off: u64,
    /// Offset in the remote region.
    pub remote_off: u64,
    /// Bytes.
    pub len: u64,
}

/// A part of a segment placed in a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the local GPU span.
    pub local_off: u64,
    /// Offset in the remote region.
    pub remote_off: u64,
    /// Offset inside the slot.
    pub slot_off: usize,
    /// Bytes.
    pub len: usize,
}

/// The pieces that share one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Chunk index; its slot is `index % depth`.
    pub index: usize,
    /// Pieces, packed from slot offset 0.
    pub pieces: Vec<Piece>,
}

impl Chunk {
    /// Bytes in this chunk.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }
}

/// Pack `segments` (in order) into chunks of at most `chunk_size` bytes; every
/// chunk but the last is full. Empty segments are skipped.
pub fn plan_chunks(segments: &[Segment], chunk_size: usize) -> Vec<Chunk> {
    assert!(chunk_size > 0, "chunk_size must be > 0");
    let mut chunks = Vec::new();
    let mut cur = Chunk {
        index: 0,
        pieces: Vec::new(),
    };
    let mut fill = 0usize;
    for s in segments {
        let mut done = 0u64;
        while done < s.len {
            let room = chunk_size - fill;
            let take = (s.len - done).min(room as u64) as usize;
            cur.pieces.push(Piece {
                local_off: s.local_off + done,
                remote_off: s.remote_off + done,
                slot_off: fill,
                len: take,
            });
            fill += take;
            done += take as u64;
            if fill == chunk_size {
                let index = cur.index + 1;
                chunks.push(std::mem::replace(
                    &mut cur,
                    Chunk {
                        index,
                        pieces: Vec::new(),
                    },
                ));
                fill = 0;
            }
        }
    }
    if !cur.pieces.is_empty() {
        chunks.push(cur);
    }
    chunks
}

/// What happened in a pipeline, for tests and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceEvent {
    /// Fill of chunk i issued.
    FillStart(usize),
    /// Fill of chunk i completed.
    FillDone(usize),
    /// Drain of chunk i issued.
    DrainStart(usize),
    /// Drain of chunk i completed (slot free).
    DrainDone(usize),
    /// Chunk i waited for its slot (ring full).
    RingFull(usize),
    /// The final notification was sent.
    Notified,
}

/// Counters of one staged transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Chunks moved.
    pub chunks: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Most slots busy at once.
    pub max_in_flight: usize,
    /// Times a ready chunk had to wait for its slot.
    pub ring_full_waits: usize,
    /// Wall time.
    pub elapsed: Duration,
    /// Event order (only when tracing was asked for).
    pub trace: Vec<TraceEvent>,
}

impl PipelineStats {
    /// Bandwidth in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
}

/// An identifier of an operation in flight on a [`Wire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireTicket(pub u64);

/// One wire operation between the attached ring and the remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireOp {
    /// Offset in the ring.
    pub ring_off: usize,
    /// Offset in the remote region.
    pub remote_off: u64,
    /// Bytes.
    pub len: usize,
}

/// The transport half of a staged transfer: moves bytes between the staging ring
/// and one remote region (a peer's registered memory).
pub trait Wire: Send {
    /// Attach the staging ring once, before any operation (e.g. register it as a
    /// local memory region).
    ///
    /// # Safety
    /// `ring` stays allocated until the wire is dropped or re-attached, and the
    /// caller touches a ring range only while no operation on it is in flight.
    unsafe fn attach_ring(&mut self, ring: &PinnedBuffer) -> Result<()>;
    /// Post writes ring → remote as one batch.
    fn write(&mut self, ops: &[WireOp]) -> Result<WireTicket>;
    /// Post reads remote → ring as one batch.
    fn read(&mut self, ops: &[WireOp]) -> Result<WireTicket>;
    /// `Ok(true)` once the batch completed (then retired), `Err` if it failed.
    fn query(&mut self, t: WireTicket) -> Result<bool>;
    /// Tell the peer the transfer is complete; must be ordered after every
    /// write that completed before this call.
    fn notify(&mut self, tag: u32) -> Result<()>;
}

/// Incoming chunks for the receiving side of a staged push: the sender writes
/// chunk `i` into this side's ring slot `i % depth` and signals it.
pub trait Incoming: Send {
    /// Whether chunk `index` has fully landed in its slot.
    fn arrived(&mut self, index: usize) -> Result<bool>;
    /// Chunk `index`'s slot is free again (its host-to-device copy completed).
    fn release(&mut self, index: usize) -> Result<()>;
}

// The two halves of a step, as the core loop sees them.
trait Step {
    type T: Copy;
    fn start(&mut self, chunk: &Chunk, slot_base: usize) -> Result<Self::T>;
    fn poll(&mut self, t: Self::T) -> Result<bool>;
    /// Called once the step of `chunk` completed.
    fn done(&mut self, _chunk: usize) -> Result<()> {
        Ok(())
    }
}

struct CopyStep<'a, C: ?Sized> {
    copy: &'a C,
    dir: Direction,
    span: DeviceSpan<'a>,
    ring: *mut u8,
}

impl<C: CopyEngine + ?Sized> Step for CopyStep<'_, C> {
    type T = CopyTicket;
    fn start(&mut self, chunk: &Chunk, slot_base: usize) -> Result<CopyTicket> {
        for p in &chunk.pieces {
            let dev = self.span.ptr().offset(p.local_off);
            // SAFETY: `run_staged` checked every piece against the span (alive for
            // 'a) and the slot layout against the ring; the slot is reserved for
            // this chunk until its drain completed, and the core waits for every
            // ticket before the ring can be dropped or reused.
            unsafe {
                let host = self.ring.add(slot_base + p.slot_off);
                match self.dir {
                    Direction::D2H => self.copy.d2h_async(dev, host, p.len)?,
                    Direction::H2D => self.copy.h2d_async(host, dev, p.len)?,
                }
            }
        }
        self.copy.record(self.dir)
    }
    fn poll(&mut self, t: CopyTicket) -> Result<bool> {
        self.copy.query(t)
    }
}

struct WireStep<'a, W: ?Sized> {
    wire: &'a mut W,
    write: bool,
}

impl<W: Wire + ?Sized> Step for WireStep<'_, W> {
    type T = WireTicket;
    fn start(&mut self, chunk: &Chunk, slot_base: usize) -> Result<WireTicket> {
        let ops: Vec<WireOp> = chunk
            .pieces
            .iter()
            .map(|p| WireOp {
                ring_off: slot_base + p.slot_off,
                remote_off: p.remote_off,
                len: p.len,
            })
            .collect();
        if self.write {
            self.wire.write(&ops)
        } else {
            self.wire.read(&ops)
        }
    }
    fn poll(&mut self, t: WireTicket) -> Result<bool> {
        self.wire.query(t)
    }
}

/// Receive-side fill: the "step" is the peer's write landing in the slot.
struct ArrivalFill<'c, 'i>(&'c RefCell<&'i mut dyn Incoming>);

impl Step for ArrivalFill<'_, '_> {
    type T = usize;
    fn start(&mut self, chunk: &Chunk, _slot_base: usize) -> Result<usize> {
        Ok(chunk.index)
    }
    fn poll(&mut self, index: usize) -> Result<bool> {
        self.0.borrow_mut().arrived(index)
    }
}

/// Receive-side drain: host-to-device, then the slot goes back to the sender.
struct CreditDrain<'c, 'i, 'a, C: ?Sized> {
    copy: CopyStep<'a, C>,
    incoming: &'c RefCell<&'i mut dyn Incoming>,
}

impl<C: CopyEngine + ?Sized> Step for CreditDrain<'_, '_, '_, C> {
    type T = CopyTicket;
    fn start(&mut self, chunk: &Chunk, slot_base: usize) -> Result<CopyTicket> {
        self.copy.start(chunk, slot_base)
    }
    fn poll(&mut self, t: CopyTicket) -> Result<bool> {
        self.copy.poll(t)
    }
    fn done(&mut self, chunk: usize) -> Result<()> {
        self.incoming.borrow_mut().release(chunk)
    }
}

enum State<F, D> {
    Filling(F),
    Draining(D),
    Done,
}

struct Slot<F, D> {
    chunk: usize,
    state: State<F, D>,
}

/// Outcome of the core loop when it failed.
struct Failure {
    err: GpuError,
    /// Every step in flight finished (the ring is reusable).
    quiesced: bool,
}

fn fail(chunk: usize, stage: StageKind, e: GpuError) -> GpuError {
    match e {
        e @ GpuError::ChunkFailed { .. } => e,
        e => GpuError::ChunkFailed {
            chunk,
            stage,
            source: Box::new(e),
        },
    }
}

/// The generic core: runs `chunks` through `fill` then `drain` on a ring of
/// `depth` slots of `slot_size` bytes.
fn run_core<F: Step, D: Step>(
    chunks: &[Chunk],
    cfg: &StagingConfig,
    fill: &mut F,
    drain: &mut D,
    trace: bool,
    stats: &mut PipelineStats,
) -> std::result::Result<(), Failure> {
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let mut inflight: VecDeque<Slot<F::T, D::T>> = VecDeque::new();
    let mut next = 0usize;
    let mut backoff = Backoff::default();
    let mut waiting_for_slot = usize::MAX;
    let ev = |stats: &mut PipelineStats, e: TraceEvent| {
        if trace {
            stats.trace.push(e);
        }
    };

    let result: Result<()> = (|| {
        loop {
            let mut progressed = false;
            // Fills complete in order: promote completed fills to drains, oldest first.
            for s in inflight.iter_mut() {
                if let State::Filling(t) = s.state {
                    if fill
                        .poll(t)
                        .map_err(|e| fail(s.chunk, StageKind::Fill, e))?
                    {
                        ev(stats, TraceEvent::FillDone(s.chunk));
                        // Mark before starting the drain so a failed start is not
                        // mistaken for a fill still in flight.
                        s.state = State::Done;
                        let c = &chunks[s.chunk];
                        let base = (s.chunk % cfg.depth) * cfg.chunk_size;
                        let d = drain
                            .start(c, base)
                            .map_err(|e| fail(s.chunk, StageKind::Drain, e))?;
                        ev(stats, TraceEvent::DrainStart(s.chunk));
                        s.state = State::Draining(d);
                        progressed = true;
                    } else {
                        break;
                    }
                }
            }
            // Drains may complete in any order (several QPs / streams).
            for s in inflight.iter_mut() {
                if let State::Draining(t) = s.state
                    && drain
                        .poll(t)
                        .map_err(|e| fail(s.chunk, StageKind::Drain, e))?
                {
                    s.state = State::Done;
                    ev(stats, TraceEvent::DrainDone(s.chunk));
                    drain
                        .done(s.chunk)
                        .map_err(|e| fail(s.chunk, StageKind::Drain, e))?;
                    stats.chunks += 1;
                    stats.bytes += chunks[s.chunk].bytes() as u64;
                    progressed = true;
                }
            }
            while inflight
                .front()
                .is_some_and(|s| matches!(s.state, State::Done))
            {
                inflight.pop_front();
            }
            // Issue fills while the next chunk's slot is free.
            while next < chunks.len() {
                let busy = inflight.iter().any(|s| {
                    s.chunk % cfg.depth == next % cfg.depth && !matches!(s.state, State::Done)
                });
                if busy {
                    if waiting_for_slot != next {
                        waiting_for_slot = next;
                        stats.ring_full_waits += 1;
                        ev(stats, TraceEvent::RingFull(next));
                    }
                    break;
                }
                let base = (next % cfg.depth) * cfg.chunk_size;
                let t = fill
                    .start(&chunks[next], base)
                    .map_err(|e| fail(next, StageKind::Fill, e))?;
                ev(stats, TraceEvent::FillStart(next));
                inflight.push_back(Slot {
                    chunk: next,
                    state: State::Filling(t),
                });
                next += 1;
                progressed = true;
                let live = inflight
                    .iter()
                    .filter(|s| !matches!(s.state, State::Done))
                    .count();
                stats.max_in_flight = stats.max_in_flight.max(live);
            }
            if next == chunks.len() && inflight.is_empty() {
                return Ok(());
            }
            if progressed {
                backoff.reset();
            } else {
                if Instant::now() >= deadline {
                    return Err(GpuError::Timeout {
                        timeout: cfg.timeout,
                        what: "a staged transfer",
                    });
                }
                backoff.snooze();
            }
        }
    })();
    stats.elapsed = start.elapsed();

    let Err(err) = result else {
        return Ok(());
    };
    // Quiesce: issue nothing new, wait for every step still in flight, so that no
    // DMA targets the ring once we return. Their own errors are secondary.
    let drain_deadline = Instant::now().max(deadline) + Duration::from_secs(1);
    let mut quiesced = true;
    for s in inflight.iter() {
        let mut b = Backoff::default();
        let done = loop {
            let r = match s.state {
                State::Filling(t) => fill.poll(t),
                State::Draining(t) => drain.poll(t),
                State::Done => Ok(true),
            };
            match r {
                Ok(true) | Err(_) => break true,
                Ok(false) if Instant::now() >= drain_deadline => break false,
                Ok(false) => b.snooze(),
            }
        };
        quiesced &= done;
    }
    Err(Failure { err, quiesced })
}

/// Map the core's outcome to the caller's; if in-flight DMA could not be waited
/// for, the ring is leaked rather than freed or reused.
fn retire_on_failure(
    ring: &mut Option<PinnedBuffer>,
    r: std::result::Result<(), Failure>,
) -> Result<()> {
    match r {
        Ok(()) => Ok(()),
        Err(Failure { err, quiesced }) => {
            if !quiesced && let Some(ring) = ring.take() {
                tracing::error!(
                    bytes = ring.len(),
                    "staging ring retired: in-flight DMA did not finish"
                );
                std::mem::forget(ring);
            }
            Err(err)
        }
    }
}

/// A staging ring bound to a copy engine and a wire: runs staged writes and
/// reads between a GPU span and the wire's remote region.
pub struct StagedPipeline<C: CopyEngine, W: Wire> {
    copy: C,
    wire: W,
    cfg: StagingConfig,
    // Declared after `wire` on purpose: fields drop in order, so the wire (which
    // may hold a registration of the ring) goes first.
    ring: Option<PinnedBuffer>,
    trace: bool,
}

impl<C: CopyEngine, W: Wire> fmt::Debug for StagedPipeline<C, W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagedPipeline")
            .field("copy", &self.copy.name())
            .field("cfg", &self.cfg)
            .field("ring_retired", &self.ring.is_none())
            .finish()
    }
}

impl<C: CopyEngine, W: Wire> StagedPipeline<C, W> {
    /// Allocate the ring (pinned, through `copy`) and attach it to `wire`.
    pub fn new(copy: C, mut wire: W, cfg: StagingConfig) -> Result<Self> {
        cfg.validate()?;
        let ring = copy.alloc_pinned(cfg.ring_bytes())?;
        // SAFETY: the ring is owned by the pipeline and outlives the wire (field
        // order), and the core only touches a slot while no step on it is in flight.
        unsafe { wire.attach_ring(&ring)? };
        Ok(Self {
            copy,
            wire,
            cfg,
            ring: Some(ring),
            trace: false,
        })
    }

    /// Record a [`TraceEvent`] list in the stats (tests, debugging).
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// The configuration.
    pub fn config(&self) -> &StagingConfig {
        &self.cfg
    }

    /// The copy engine.
    pub fn copy_engine(&self) -> &C {
        &self.copy
    }

    /// The wire.
    pub fn wire(&self) -> &W {
        &self.wire
    }

    fn checked_plan(&self, span: &DeviceSpan<'_>, segments: &[Segment]) -> Result<Vec<Chunk>> {
        for s in segments {
            check_range(s.local_off, s.len, span.len() as u64)?;
            s.remote_off
                .checked_add(s.len)
                .ok_or(GpuError::OutOfRange {
                    offset: s.remote_off,
                    len: s.len,
                    size: u64::MAX,
                })?;
        }
        Ok(plan_chunks(segments, self.cfg.chunk_size))
    }

    fn finish(&mut self, r: std::result::Result<(), Failure>) -> Result<()> {
        retire_on_failure(&mut self.ring, r)
    }

    /// GPU → remote: device-to-host into the ring, wire write out of it; then
    /// `notify` (if any) once every write completed.
    pub fn write(
        &mut self,
        src: DeviceSpan<'_>,
        segments: &[Segment],
        notify: Option<u32>,
    ) -> Result<PipelineStats> {
        let chunks = self.checked_plan(&src, segments)?;
        let ring = self.ring.as_ref().ok_or(GpuError::RingRetired)?.as_ptr();
        let mut stats = PipelineStats::default();
        let mut fill = CopyStep {
            copy: &self.copy,
            dir: Direction::D2H,
            span: src,
            ring,
        };
        let mut drain = WireStep {
            wire: &mut self.wire,
            write: true,
        };
        let r = run_core(
            &chunks, &self.cfg, &mut fill, &mut drain, self.trace, &mut stats,
        );
        self.finish(r)?;
        if let Some(tag) = notify {
            self.wire.notify(tag)?;
            if self.trace {
                stats.trace.push(TraceEvent::Notified);
            }
        }
        Ok(stats)
    }

    /// Remote → GPU: wire read into the ring, host-to-device out of it. Returns
    /// once the last host-to-device copy completed.
    pub fn read(&mut self, dst: DeviceSpan<'_>, segments: &[Segment]) -> Result<PipelineStats> {
        let chunks = self.checked_plan(&dst, segments)?;
        let ring = self.ring.as_ref().ok_or(GpuError::RingRetired)?.as_ptr();
        let mut stats = PipelineStats::default();
        let mut fill = WireStep {
            wire: &mut self.wire,
            write: false,
        };
        let mut drain = CopyStep {
            copy: &self.copy,
            dir: Direction::H2D,
            span: dst,
            ring,
        };
        let r = run_core(
            &chunks, &self.cfg, &mut fill, &mut drain, self.trace, &mut stats,
        );
        self.finish(r)?;
        Ok(stats)
    }
}

/// The receiving side of a staged push into GPU memory: the peer writes chunks
/// into this ring; each landed chunk is copied host-to-device, its slot handed
/// back, and `on_complete` runs only after the last copy completed.
pub struct StagedReceiver<C: CopyEngine> {
    copy: C,
    cfg: StagingConfig,
    ring: Option<PinnedBuffer>,
    trace: bool,
}

impl<C: CopyEngine> fmt::Debug for StagedReceiver<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagedReceiver")
            .field("copy", &self.copy.name())
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl<C: CopyEngine> StagedReceiver<C> {
    /// Allocate the landing ring.
    pub fn new(copy: C, cfg: StagingConfig) -> Result<Self> {
        cfg.validate()?;
        let ring = copy.alloc_pinned(cfg.ring_bytes())?;
        Ok(Self {
            copy,
            cfg,
            ring: Some(ring),
            trace: false,
        })
    }

    /// Record a trace in the stats.
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// The copy engine.
    pub fn copy_engine(&self) -> &C {
        &self.copy
    }

    /// The configuration.
    pub fn config(&self) -> &StagingConfig {
        &self.cfg
    }

    /// The landing ring, to be registered with the transport and exposed to the
    /// sender (`None` once retired after a failed drain).
    pub fn ring(&self) -> Option<&PinnedBuffer> {
        self.ring.as_ref()
    }

    /// Receive `segments` (remote offsets are ignored: the sender packs chunks
    /// with the same [`plan_chunks`]) into `dst`.
    pub fn receive(
        &mut self,
        dst: DeviceSpan<'_>,
        segments: &[Segment],
        incoming: &mut dyn Incoming,
        on_complete: impl FnOnce() -> Result<()>,
    ) -> Result<PipelineStats> {
        for s in segments {
            check_range(s.local_off, s.len, dst.len() as u64)?;
        }
        let chunks = plan_chunks(segments, self.cfg.chunk_size);
        let ring = self.ring.as_ref().ok_or(GpuError::RingRetired)?.as_ptr();
        let mut stats = PipelineStats::default();
        let cell = RefCell::new(incoming);
        let mut fill = ArrivalFill(&cell);
        let mut drain = CreditDrain {
            copy: CopyStep {
                copy: &self.copy,
                dir: Direction::H2D,
                span: dst,
                ring,
            },
            incoming: &cell,
        };
        let r = run_core(
            &chunks, &self.cfg, &mut fill, &mut drain, self.trace, &mut stats,
        );
        retire_on_failure(&mut self.ring, r)?;
        on_complete()?;
        if self.trace {
            stats.trace.push(TraceEvent::Notified);
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn chunks_cover_segments_exactly(
            lens in proptest::collection::vec(0u64..5000, 0..20),
            chunk_size in 1usize..3000,
        ) {
            let mut segs = Vec::new();
            let mut off = 0u64;
            for (i, &len) in lens.iter().enumerate() {
                segs.push(Segment { local_off: off, remote_off: 1_000_000 - off - len + i as u64, len });
                off += len + 3;
            }
            let chunks = plan_chunks(&segs, chunk_size);
            // Reference: every byte of every segment, in order, as (local, remote).
            let want: Vec<(u64, u64)> = segs.iter()
                .flat_map(|s| (0..s.len).map(move |k| (s.local_off + k, s.remote_off + k)))
                .collect();
            let got: Vec<(u64, u64)> = chunks.iter()
                .flat_map(|c| c.pieces.iter())
                .flat_map(|p| (0..p.len as u64).map(move |k| (p.local_off + k, p.remote_off + k)))
                .collect();
            prop_assert_eq!(got, want);
            for (i, c) in chunks.iter().enumerate() {
                prop_assert_eq!(c.index, i);
                prop_assert!(c.bytes() <= chunk_size);
                prop_assert!(c.bytes() > 0);
                if i + 1 < chunks.len() {
                    prop_assert_eq!(c.bytes(), chunk_size);
                }
                // Pieces are packed from slot offset 0 without gaps.
                let mut at = 0;
                for p in &c.pieces {
                    prop_assert_eq!(p.slot_off, at);
                    at += p.len;
                }
            }
        }
    }

    #[test]
    fn config_validation() {
        assert!(StagingConfig::default().validate().is_ok());
        for (c, d) in [(0, 4), (4096, 0), (usize::MAX, 2), (4096, 5000)] {
            let cfg = StagingConfig {
                chunk_size: c,
                depth: d,
                ..Default::default()
            };
            assert!(
                matches!(cfg.validate(), Err(GpuError::Config(_))),
                "{c} {d}"
            );
        }
    }

    #[test]
    fn exact_multiple_and_oversized_segment() {
        let segs = [Segment {
            local_off: 0,
            remote_off: 0,
            len: 4096 * 3,
        }];
        let c = plan_chunks(&segs, 4096);
        assert_eq!(c.len(), 3);
        assert!(c.iter().all(|c| c.pieces.len() == 1 && c.bytes() == 4096));
        let c = plan_chunks(&segs, 5000);
        assert_eq!(
            c.iter().map(Chunk::bytes).collect::<Vec<_>>(),
            vec![5000, 5000, 2288]
        );
    }
}
