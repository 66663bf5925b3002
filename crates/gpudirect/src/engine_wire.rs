//! The staging pipeline's [`Wire`] over a real `pagewire_transport::Engine`
//! (verbs, TCP or loopback): ring slots are one registered host region, each
//! chunk is one batch of one-sided ops.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use pagewire_transport::{Access, Batch, BatchStatus, Engine, PeerId, RegionId};

use crate::error::{GpuError, Result};
use crate::memory::PinnedBuffer;
use crate::staging::{Wire, WireOp, WireTicket};

/// A [`Wire`] to one remote region of one peer, through a transport engine.
pub struct EngineWire {
    engine: Engine,
    peer: PeerId,
    remote_base: u64,
    ring: Option<(u64, RegionId)>,
    inflight: HashMap<u64, pagewire_transport::TransferHandle>,
    next: u64,
    timeout: Duration,
}

impl fmt::Debug for EngineWire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineWire")
            .field("peer", &self.peer)
            .field("remote_base", &format_args!("{:#x}", self.remote_base))
            .field("inflight", &self.inflight.len())
            .finish()
    }
}

impl EngineWire {
    /// Remote offsets of the pipeline are relative to `remote_base`, an address
    /// inside a region `peer` exposed.
    pub fn new(engine: Engine, peer: PeerId, remote_base: u64) -> Self {
        Self {
            engine,
            peer,
            remote_base,
            ring: None,
            inflight: HashMap::new(),
            next: 1,
            timeout: Duration::from_secs(30),
        }
    }

    /// Deadline of each batch (default 30 s).
    pub fn with_batch_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    fn batch(&self, ops: &[WireOp], write: bool) -> Result<Batch> {
        let (ring, _) = self
            .ring
            .ok_or_else(|| GpuError::Wire("no ring attached".into()))?;
        let mut b = Batch::with_capacity(ops.len());
        for op in ops {
            let local = ring + op.ring_off as u64;
            let remote =
                self.remote_base
                    .checked_add(op.remote_off)
                    .ok_or(GpuError::OutOfRange {
                        offset: op.remote_off,
                        len: op.len as u64,
                        size: u64::MAX - self.remote_base,
                    })?;
            b = if write {
                b.write(local, remote, op.len as u64)
            } else {
                b.read(local, remote, op.len as u64)
            };
        }
        Ok(b.timeout(self.timeout))
    }

    fn post(&mut self, b: Batch) -> Result<WireTicket> {
        let h = self
            .engine
            .submit(self.peer, b)
            .map_err(|e| GpuError::Transport(e.to_string()))?;
        let id = self.next;
        self.next += 1;
        self.inflight.insert(id, h);
        Ok(WireTicket(id))
    }
}

impl Wire for EngineWire {
    unsafe fn attach_ring(&mut self, ring: &PinnedBuffer) -> Result<()> {
        // SAFETY: forwarded from our own contract: the ring stays allocated while
        // attached and the pipeline only touches slots with no op in flight.
        let id = unsafe {
            self.engine
                .register_raw(ring.as_ptr(), ring.len(), Access::LOCAL_WRITE)
        }
        .map_err(|e| GpuError::Transport(e.to_string()))?;
        self.ring = Some((ring.as_ptr() as u64, id));
        Ok(())
    }

    fn write(&mut self, ops: &[WireOp]) -> Result<WireTicket> {
        let b = self.batch(ops, true)?;
        self.post(b)
    }

    fn read(&mut self, ops: &[WireOp]) -> Result<WireTicket> {
        let b = self.batch(ops, false)?;
        self.post(b)
    }

    fn query(&mut self, t: WireTicket) -> Result<bool> {
        let Some(h) = self.inflight.get(&t.0) else {
            return Err(GpuError::Wire(format!("unknown or retired ticket {}", t.0)));
        };
        let st = h.status();
        match st {
            BatchStatus::Pending => Ok(false),
            BatchStatus::Done => {
                self.inflight.remove(&t.0);
                Ok(true)
            }
            BatchStatus::Failed(e) => {
                self.inflight.remove(&t.0);
                Err(GpuError::Transport(e.to_string()))
            }
            other => {
                self.inflight.remove(&t.0);
                Err(GpuError::Transport(format!("batch ended as {other:?}")))
            }
        }
    }

    /// Every data write has completed when the pipeline calls this, so the tag, sent
    /// alone, reaches the peer after all the data.
    fn notify(&mut self, tag: u32) -> Result<()> {
        let b = Batch::new().timeout(self.timeout).notify(tag);
        let h = self
            .engine
            .submit(self.peer, b)
            .map_err(|e| GpuError::Transport(e.to_string()))?;
        h.wait(Instant::now() + self.timeout)
            .map_err(|e| GpuError::Transport(e.to_string()))?;
        Ok(())
    }
}

impl Drop for EngineWire {
    fn drop(&mut self) {
        // The pipeline waits for every op before it returns, so nothing should be
        // in flight; give stragglers a moment, then deregister the ring.
        let deadline = Instant::now() + Duration::from_secs(5);
        for h in self.inflight.values() {
            let _ = h.wait(deadline);
        }
        if let Some((_, id)) = self.ring.take()
            && let Err(e) = self.engine.deregister_wait(id, deadline)
        {
            tracing::warn!(error = %e, "could not deregister the staging ring");
        }
    }
}
