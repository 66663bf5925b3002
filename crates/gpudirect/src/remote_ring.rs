//! Staged GPU-to-GPU pushes between engines: the receiving side's landing ring.
//!
//! The receiver exposes its pinned ring plus one arrival byte per slot; the
//! sender exposes one credit byte per slot. Chunk `k` of a transfer uses slot
//! `s = k % depth`; both ends count the uses of each slot across transfers, and
//! the `n`-th use carries generation `g = n % 255 + 1` (never 0, so fresh zeroed
//! memory means "nothing", and a slot's byte changes on every use):
//!
//! 1. the sender writes the chunk's bytes into the receiver's slot `s`;
//! 2. once that batch completed, it writes `g` to the receiver's arrival byte `s`;
//! 3. the receiver sees the byte, copies the slot host-to-device, and once the
//!    copy completed writes `g` to the sender's credit byte `s`;
//! 4. the sender reuses slot `s` (for chunk `k + depth`) only after that credit.
//!
//! The receiver's completion callback, i.e. the notification to its
//! application, runs only after the last host-to-device copy completed. Both
//! ends must agree on the ring geometry and on the bytes of each transfer; after
//! a failed transfer, recreate both ends (their chunk counters may disagree).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use pagewire_transport::{
    Access, Batch, BatchStatus, Engine, HostBuffer, PeerId, RegionId, TransferHandle,
};

use crate::copy::CopyEngine;
use crate::error::{GpuError, Result};
use crate::memory::{DeviceSpan, PinnedBuffer};
use crate::staging::{
    Incoming, PipelineStats, Segment, StagedReceiver, StagingConfig, Wire, WireOp, WireTicket,
};

fn terr(e: pagewire_transport::Error) -> GpuError {
    GpuError::Transport(e.to_string())
}

/// Generation byte of a slot's `uses`-th use (0-based).
fn gen_of(uses: u64) -> u8 {
    (uses % 255 + 1) as u8
}

/// Load a byte that a peer writes through the transport.
fn load_byte(buf: &HostBuffer, i: usize) -> u8 {
    assert!(i < buf.len());
    // SAFETY: in bounds (checked); `HostBuffer` memory is valid for its lifetime
    // and a byte is always aligned. The transport writes it concurrently, hence
    // the atomic load.
    unsafe { (*(buf.as_mut_ptr().add(i) as *const AtomicU8)).load(Ordering::Acquire) }
}

/// Store a byte that the transport then reads for a one-sided write.
fn store_byte(buf: &HostBuffer, i: usize, v: u8) {
    assert!(i < buf.len());
    // SAFETY: as in `load_byte`; no transfer reads this byte while we store
    // (the protocol reuses a slot's byte only after its previous write completed).
    unsafe { (*(buf.as_mut_ptr().add(i) as *const AtomicU8)).store(v, Ordering::Release) }
}

/// Make sure `peer` exposes `[addr, addr+len)` in our view of its regions,
/// refreshing the view once (regions registered after connecting are not in it).
fn ensure_exposed(engine: &Engine, peer: PeerId, addr: u64, len: u64) -> Result<()> {
    let covered = |regions: &[pagewire_transport::RemoteRegion]| {
        regions
            .iter()
            .any(|r| r.addr <= addr && addr.saturating_add(len) <= r.end())
    };
    if covered(&engine.peer_regions(peer).map_err(terr)?) {
        return Ok(());
    }
    if covered(&engine.redescribe(peer).map_err(terr)?) {
        return Ok(());
    }
    Err(GpuError::Transport(format!(
        "peer does not expose {addr:#x}+{len} (staging ring or credit bytes not registered?)"
    )))
}

/// What the sender needs to know about a receiver's ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingDescriptor {
    /// Remote address of the landing ring.
    pub ring_addr: u64,
    /// Remote address of the arrival bytes (`depth` of them).
    pub arrivals_addr: u64,
    /// Ring geometry (must equal the sender's).
    pub chunk_size: usize,
    /// Ring slots.
    pub depth: usize,
}

/// The receiving end: a landing ring exposed through `engine`.
pub struct RingReceiver<C: CopyEngine> {
    engine: Engine,
    regions: Vec<RegionId>,
    arrivals: HostBuffer,
    credit_src: HostBuffer,
    /// Uses of each slot so far, across transfers.
    uses: Vec<u64>,
    // Last: the ring must outlive its registration (deregistered in Drop).
    inner: StagedReceiver<C>,
}

impl<C: CopyEngine> fmt::Debug for RingReceiver<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingReceiver")
            .field("inner", &self.inner)
            .field("uses", &self.uses)
            .finish()
    }
}

impl<C: CopyEngine> RingReceiver<C> {
    /// Allocate and expose the landing ring and the arrival bytes.
    pub fn new(engine: Engine, copy: C, cfg: StagingConfig) -> Result<Self> {
        let inner = StagedReceiver::new(copy, cfg)?;
        let arrivals = HostBuffer::new(cfg.depth).map_err(terr)?;
        let credit_src = HostBuffer::new(cfg.depth).map_err(terr)?;
        let ring = inner.ring().ok_or(GpuError::RingRetired)?;
        let mut regions = Vec::new();
        // SAFETY: the ring lives in `inner`, dropped after `Drop::drop`
        // deregistered it; peers write it only in slots the protocol hands them.
        let r = unsafe {
            engine.register_raw(
                ring.as_ptr(),
                ring.len(),
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
        };
        regions.push(r.map_err(terr)?);
        regions.push(
            engine
                .register(&arrivals, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .map_err(terr)?,
        );
        regions.push(engine.register(&credit_src, Access::NONE).map_err(terr)?);
        Ok(Self {
            engine,
            regions,
            arrivals,
            credit_src,
            uses: vec![0; cfg.depth],
            inner,
        })
    }

    /// What to give the sender (out of band, e.g. with the page plan).
    pub fn descriptor(&self) -> RingDescriptor {
        let cfg = self.inner.config();
        RingDescriptor {
            ring_addr: self.inner.ring().map_or(0, |r| r.as_ptr() as u64),
            arrivals_addr: self.arrivals.addr(),
            chunk_size: cfg.chunk_size,
            depth: cfg.depth,
        }
    }

    /// The copy engine.
    pub fn copy_engine(&self) -> &C {
        self.inner.copy_engine()
    }

    /// Receive one transfer from `peer` (whose credit bytes are at
    /// `credits_addr`) into `dst` per `segments`; `on_complete` runs only after
    /// the last host-to-device copy completed.
    pub fn receive(
        &mut self,
        peer: PeerId,
        credits_addr: u64,
        dst: DeviceSpan<'_>,
        segments: &[Segment],
        on_complete: impl FnOnce() -> Result<()>,
    ) -> Result<PipelineStats> {
        let cfg = *self.inner.config();
        ensure_exposed(&self.engine, peer, credits_addr, cfg.depth as u64)?;
        let mut inc = EngineIncoming {
            engine: &self.engine,
            peer,
            arrivals: &self.arrivals,
            src: &self.credit_src,
            credits_addr,
            depth: cfg.depth,
            uses: &self.uses,
            pending: Vec::new(),
            timeout: cfg.timeout,
        };
        let r = self.inner.receive(dst, segments, &mut inc, on_complete);
        // Credit writes still in flight must finish before their source bytes change.
        let deadline = Instant::now() + cfg.timeout;
        let mut credit_err = None;
        for h in inc.pending.drain(..) {
            if let Err(e) = h.wait(deadline) {
                credit_err.get_or_insert(terr(e));
            }
        }
        let stats = r?;
        for k in 0..stats.chunks {
            self.uses[k % cfg.depth] += 1;
        }
        match credit_err {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }
}

impl<C: CopyEngine> Drop for RingReceiver<C> {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for id in self.regions.drain(..) {
            if let Err(e) = self.engine.deregister_wait(id, deadline) {
                tracing::warn!(error = %e, "could not deregister a landing-ring region");
            }
        }
    }
}

struct EngineIncoming<'a> {
    engine: &'a Engine,
    peer: PeerId,
    arrivals: &'a HostBuffer,
    src: &'a HostBuffer,
    credits_addr: u64,
    depth: usize,
    uses: &'a [u64],
    pending: Vec<TransferHandle>,
    timeout: Duration,
}

impl Incoming for EngineIncoming<'_> {
    fn arrived(&mut self, index: usize) -> Result<bool> {
        let slot = index % self.depth;
        let g = gen_of(self.uses[slot] + (index / self.depth) as u64);
        Ok(load_byte(self.arrivals, slot) == g)
    }

    fn release(&mut self, index: usize) -> Result<()> {
        let slot = index % self.depth;
        let g = gen_of(self.uses[slot] + (index / self.depth) as u64);
        store_byte(self.src, slot, g);
        let b = Batch::new()
            .write(
                self.src.addr() + slot as u64,
                self.credits_addr + slot as u64,
                1,
            )
            .timeout(self.timeout);
        let h = self.engine.submit(self.peer, b).map_err(terr)?;
        self.pending.retain(|h| !h.status().is_finished());
        self.pending.push(h);
        Ok(())
    }
}

/// The sending end's credit bytes, exposed through its engine.
#[derive(Debug)]
pub struct CreditBoard {
    engine: Engine,
    buf: HostBuffer,
    region: Option<RegionId>,
}

impl CreditBoard {
    /// `depth` credit bytes, writable by peers.
    pub fn new(engine: Engine, depth: usize) -> Result<Self> {
        let buf = HostBuffer::new(depth).map_err(terr)?;
        let region = engine
            .register(&buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .map_err(terr)?;
        Ok(Self {
            engine,
            buf,
            region: Some(region),
        })
    }

    /// Address to give the receiver.
    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }
}

impl Drop for CreditBoard {
    fn drop(&mut self) {
        if let Some(id) = self.region.take() {
            let _ = self
                .engine
                .deregister_wait(id, Instant::now() + Duration::from_secs(5));
        }
    }
}

enum Push {
    Data(TransferHandle),
    Flag(TransferHandle),
    Credit,
}

struct PushTicket {
    slot: usize,
    generation: u8,
    state: Push,
}

/// The sender's [`Wire`] into a receiver's landing ring (push only).
pub struct RingPushWire<'c> {
    engine: Engine,
    peer: PeerId,
    desc: RingDescriptor,
    credits: &'c CreditBoard,
    flag_src: HostBuffer,
    flag_region: Option<RegionId>,
    ring: Option<(u64, RegionId)>,
    /// Uses of each slot so far, across transfers.
    uses: Vec<u64>,
    next: u64,
    tickets: HashMap<u64, PushTicket>,
    timeout: Duration,
}

impl fmt::Debug for RingPushWire<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingPushWire")
            .field("peer", &self.peer)
            .field("desc", &self.desc)
            .field("uses", &self.uses)
            .finish()
    }
}

impl<'c> RingPushWire<'c> {
    /// A wire into the ring `desc` of `peer`, with credits landing in `credits`.
    pub fn new(
        engine: Engine,
        peer: PeerId,
        desc: RingDescriptor,
        credits: &'c CreditBoard,
        timeout: Duration,
    ) -> Result<Self> {
        if credits.buf.len() < desc.depth {
            return Err(GpuError::Config(format!(
                "credit board has {} bytes for a ring of depth {}",
                credits.buf.len(),
                desc.depth
            )));
        }
        let ring_len = (desc.chunk_size * desc.depth) as u64;
        ensure_exposed(&engine, peer, desc.ring_addr, ring_len)?;
        ensure_exposed(&engine, peer, desc.arrivals_addr, desc.depth as u64)?;
        let flag_src = HostBuffer::new(desc.depth).map_err(terr)?;
        let flag_region = Some(engine.register(&flag_src, Access::NONE).map_err(terr)?);
        Ok(Self {
            engine,
            peer,
            desc,
            credits,
            flag_src,
            flag_region,
            ring: None,
            uses: vec![0; desc.depth],
            next: 0,
            tickets: HashMap::new(),
            timeout,
        })
    }
}

impl Wire for RingPushWire<'_> {
    unsafe fn attach_ring(&mut self, ring: &PinnedBuffer) -> Result<()> {
        if ring.len() != self.desc.chunk_size * self.desc.depth {
            return Err(GpuError::Config(format!(
                "local ring of {} bytes does not match the receiver's {} x {}",
                ring.len(),
                self.desc.depth,
                self.desc.chunk_size
            )));
        }
        // SAFETY: forwarded contract of `attach_ring`.
        let id = unsafe {
            self.engine
                .register_raw(ring.as_ptr(), ring.len(), Access::LOCAL_WRITE)
        }
        .map_err(terr)?;
        self.ring = Some((ring.as_ptr() as u64, id));
        Ok(())
    }

    fn write(&mut self, ops: &[WireOp]) -> Result<WireTicket> {
        let (ring, _) = self
            .ring
            .ok_or_else(|| GpuError::Wire("no ring attached".into()))?;
        let first = ops
            .first()
            .ok_or_else(|| GpuError::Wire("empty chunk".into()))?;
        let slot = first.ring_off / self.desc.chunk_size;
        if slot >= self.desc.depth {
            return Err(GpuError::Wire(format!(
                "ring offset {} past the ring",
                first.ring_off
            )));
        }
        let mut b = Batch::with_capacity(ops.len());
        for op in ops {
            // Same geometry on both ends: ring offsets map one to one.
            b = b.write(
                ring + op.ring_off as u64,
                self.desc.ring_addr + op.ring_off as u64,
                op.len as u64,
            );
        }
        let h = self
            .engine
            .submit(self.peer, b.timeout(self.timeout))
            .map_err(terr)?;
        let id = self.next;
        self.next += 1;
        let generation = gen_of(self.uses[slot]);
        self.uses[slot] += 1;
        self.tickets.insert(
            id,
            PushTicket {
                slot,
                generation,
                state: Push::Data(h),
            },
        );
        Ok(WireTicket(id))
    }

    fn read(&mut self, _ops: &[WireOp]) -> Result<WireTicket> {
        Err(GpuError::Wire("a landing ring is push-only".into()))
    }

    fn query(&mut self, t: WireTicket) -> Result<bool> {
        loop {
            let Some(tk) = self.tickets.get_mut(&t.0) else {
                return Err(GpuError::Wire(format!("unknown or retired ticket {}", t.0)));
            };
            let (slot, g) = (tk.slot, tk.generation);
            let failed = match &tk.state {
                Push::Data(h) | Push::Flag(h) => match h.status() {
                    BatchStatus::Pending => return Ok(false),
                    BatchStatus::Done => None,
                    BatchStatus::Failed(e) => Some(terr(e)),
                    other => Some(GpuError::Transport(format!("batch ended as {other:?}"))),
                },
                Push::Credit => {
                    if load_byte(&self.credits.buf, slot) == g {
                        self.tickets.remove(&t.0);
                        return Ok(true);
                    }
                    return Ok(false);
                }
            };
            if let Some(e) = failed {
                self.tickets.remove(&t.0);
                return Err(e);
            }
            // The data (or flag) batch completed: advance.
            tk.state = match tk.state {
                Push::Data(_) => {
                    // The data is in the peer's slot: tell it, with this use's generation.
                    store_byte(&self.flag_src, slot, g);
                    let b = Batch::new()
                        .write(
                            self.flag_src.addr() + slot as u64,
                            self.desc.arrivals_addr + slot as u64,
                            1,
                        )
                        .timeout(self.timeout);
                    Push::Flag(self.engine.submit(self.peer, b).map_err(terr)?)
                }
                _ => Push::Credit,
            };
        }
    }

    fn notify(&mut self, _tag: u32) -> Result<()> {
        Err(GpuError::Wire(
            "a push into a landing ring completes on the receiver (its on_complete); no tag".into(),
        ))
    }
}

impl Drop for RingPushWire<'_> {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for t in self.tickets.values() {
            if let Push::Data(h) | Push::Flag(h) = &t.state {
                let _ = h.wait(deadline);
            }
        }
        for id in [self.ring.take().map(|r| r.1), self.flag_region.take()]
            .into_iter()
            .flatten()
        {
            if let Err(e) = self.engine.deregister_wait(id, deadline) {
                tracing::warn!(error = %e, "could not deregister a push-wire region");
            }
        }
    }
}
