//! In-memory wires for tests, examples and CPU benchmarks.
//! Compiled only with the `testing` feature: a production build carries none of it.
//!
//! [`MemWire`] plays a remote region reached by one-sided writes and reads,
//! executed on a worker thread (like a NIC), with injectable failures, delays
//! and a gate that holds every operation (to observe back-pressure).
//! [`ring_link`] connects a [`StagedPipeline`](crate::StagedPipeline) sender to a
//! [`StagedReceiver`](crate::StagedReceiver) in the same process, with credits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

use crossbeam_channel::{Sender, unbounded};

use crate::error::{GpuError, Result};
use crate::memory::PinnedBuffer;
use crate::staging::{Incoming, Wire, WireOp, WireTicket};

/// A gate that holds wire operations while closed.
#[derive(Debug, Clone, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    /// A closed gate.
    pub fn closed() -> Self {
        Self::default()
    }
    /// Let operations through (now and later).
    pub fn open(&self) {
        *self.0.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0.1.notify_all();
    }
    fn pass(&self) {
        let mut open = self.0.0.lock().unwrap_or_else(|e| e.into_inner());
        while !*open {
            open = self.0.1.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Fault injection for [`MemWire`].
#[derive(Debug, Clone, Default)]
pub struct WireFaults {
    /// Fail the n-th (0-based) write batch.
    pub fail_write_at: Option<u64>,
    /// Fail the n-th (0-based) read batch.
    pub fail_read_at: Option<u64>,
    /// Sleep before each batch.
    pub delay: Duration,
    /// Hold every batch until the gate opens.
    pub gate: Option<Gate>,
}

#[derive(Debug, Default)]
struct RemoteInner {
    bytes: Vec<u8>,
    notifications: Vec<u32>,
    writes: u64,
    reads: u64,
}

/// The remote side of a [`MemWire`]: its memory and the notifications it got.
#[derive(Debug, Clone, Default)]
pub struct RemoteMem(Arc<Mutex<RemoteInner>>);

impl RemoteMem {
    fn lock(&self) -> std::sync::MutexGuard<'_, RemoteInner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// A copy of the remote memory.
    pub fn snapshot(&self) -> Vec<u8> {
        self.lock().bytes.clone()
    }
    /// Overwrite the remote memory from offset 0.
    pub fn fill(&self, data: &[u8]) {
        let mut g = self.lock();
        g.bytes[..data.len()].copy_from_slice(data);
    }
    /// Notifications received, in order.
    pub fn notifications(&self) -> Vec<u32> {
        self.lock().notifications.clone()
    }
    /// Write batches executed.
    pub fn writes(&self) -> u64 {
        self.lock().writes
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum St {
    Pending,
    Done,
    Failed(String),
}

#[derive(Debug, Default)]
struct Tickets {
    map: Mutex<HashMap<u64, St>>,
}

impl Tickets {
    fn set(&self, id: u64, st: St) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, st);
    }
    fn query(&self, id: u64) -> Result<bool> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(&id).cloned() {
            None => Err(GpuError::Wire(format!("unknown or retired ticket {id}"))),
            Some(St::Pending) => Ok(false),
            Some(St::Done) => {
                m.remove(&id);
                Ok(true)
            }
            Some(St::Failed(e)) => {
                m.remove(&id);
                Err(GpuError::Wire(e))
            }
        }
    }
}

struct Job {
    id: u64,
    write: bool,
    ops: Vec<WireOp>,
    ring: usize,
    ring_len: usize,
}

/// An in-memory one-sided wire; see the module docs.
#[derive(Debug)]
pub struct MemWire {
    remote: RemoteMem,
    ring: Option<(usize, usize)>,
    tx: Sender<Job>,
    tickets: Arc<Tickets>,
    next: AtomicU64,
}

impl MemWire {
    /// A wire to a zeroed remote region of `remote_len` bytes.
    pub fn new(remote_len: usize) -> Self {
        Self::with_faults(remote_len, WireFaults::default())
    }

    /// Same, with fault injection.
    pub fn with_faults(remote_len: usize, faults: WireFaults) -> Self {
        let remote = RemoteMem::default();
        remote.lock().bytes = vec![0; remote_len];
        let tickets = Arc::new(Tickets::default());
        let (tx, rx) = unbounded::<Job>();
        let (r2, t2) = (remote.clone(), tickets.clone());
        thread::Builder::new()
            .name("pw-memwire".into())
            .spawn(move || {
                let (mut nw, mut nr) = (0u64, 0u64);
                for job in rx {
                    if let Some(g) = &faults.gate {
                        g.pass();
                    }
                    if !faults.delay.is_zero() {
                        thread::sleep(faults.delay);
                    }
                    let n = if job.write { &mut nw } else { &mut nr };
                    let fail_at = if job.write {
                        faults.fail_write_at
                    } else {
                        faults.fail_read_at
                    };
                    let st = if fail_at == Some(*n) {
                        St::Failed(format!(
                            "injected failure of {} #{n}",
                            if job.write { "write" } else { "read" }
                        ))
                    } else {
                        execute(&r2, &job)
                    };
                    *n += 1;
                    t2.set(job.id, st);
                }
            })
            .expect("spawning the MemWire thread");
        Self {
            remote,
            ring: None,
            tx,
            tickets,
            next: AtomicU64::new(1),
        }
    }

    /// The remote side (memory and notifications).
    pub fn remote(&self) -> RemoteMem {
        self.remote.clone()
    }

    fn post(&mut self, ops: &[WireOp], write: bool) -> Result<WireTicket> {
        let (ring, ring_len) = self
            .ring
            .ok_or_else(|| GpuError::Wire("no ring attached".into()))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.tickets.set(id, St::Pending);
        self.tx
            .send(Job {
                id,
                write,
                ops: ops.to_vec(),
                ring,
                ring_len,
            })
            .map_err(|_| GpuError::Wire("wire thread is gone".into()))?;
        Ok(WireTicket(id))
    }
}

fn execute(remote: &RemoteMem, job: &Job) -> St {
    let mut g = remote.lock();
    let rlen = g.bytes.len() as u64;
    for op in &job.ops {
        let ring_ok = op
            .ring_off
            .checked_add(op.len)
            .is_some_and(|e| e <= job.ring_len);
        let remote_ok = op
            .remote_off
            .checked_add(op.len as u64)
            .is_some_and(|e| e <= rlen);
        if !ring_ok || !remote_ok {
            return St::Failed(format!(
                "op ring {}+{} remote {}+{} out of bounds (ring {}, remote {rlen})",
                op.ring_off, op.len, op.remote_off, op.len, job.ring_len
            ));
        }
    }
    for op in &job.ops {
        let r = &mut g.bytes[op.remote_off as usize..op.remote_off as usize + op.len];
        // Raw copies, as a NIC moves bytes: no slice is formed over the ring, which the
        // copy engine writes (other slots) meanwhile.
        // SAFETY: `attach_ring`'s contract keeps the ring allocated, and the pipeline
        // does not touch this slot range while the op is in flight; bounds were checked
        // above, and `r` is our own vector, distinct from the ring.
        unsafe {
            let slot = (job.ring as *mut u8).add(op.ring_off);
            if job.write {
                std::ptr::copy_nonoverlapping(slot, r.as_mut_ptr(), op.len);
            } else {
                std::ptr::copy_nonoverlapping(r.as_ptr(), slot, op.len);
            }
        }
    }
    if job.write {
        g.writes += 1;
    } else {
        g.reads += 1;
    }
    St::Done
}

impl Wire for MemWire {
    unsafe fn attach_ring(&mut self, ring: &PinnedBuffer) -> Result<()> {
        self.ring = Some((ring.as_ptr() as usize, ring.len()));
        Ok(())
    }
    fn write(&mut self, ops: &[WireOp]) -> Result<WireTicket> {
        self.post(ops, true)
    }
    fn read(&mut self, ops: &[WireOp]) -> Result<WireTicket> {
        self.post(ops, false)
    }
    fn query(&mut self, t: WireTicket) -> Result<bool> {
        self.tickets.query(t.0)
    }
    fn notify(&mut self, tag: u32) -> Result<()> {
        self.remote.lock().notifications.push(tag);
        Ok(())
    }
}

#[derive(Debug, Default)]
struct LinkState {
    /// Chunks whose bytes landed in the receiver's ring.
    arrived: Vec<bool>,
    /// Chunks whose slot the receiver released.
    released: Vec<bool>,
    notifications: Vec<u32>,
    /// Receiver ring (address, length), once published.
    rx_ring: Option<(usize, usize)>,
    /// Fail the n-th write.
    fail_write_at: Option<usize>,
}

/// Connects a sender pipeline to a receiver in one process: the sender's k-th
/// write lands in the receiver's ring at the same ring offsets (both sides use
/// the same [`StagingConfig`](crate::StagingConfig)) and its ticket completes only
/// when the receiver released that slot (a credit).
pub fn ring_link() -> (LinkWire, LinkIncoming) {
    let st = Arc::new((Mutex::new(LinkState::default()), Condvar::new()));
    (
        LinkWire {
            st: st.clone(),
            ring: None,
            writes: 0,
        },
        LinkIncoming { st },
    )
}

/// Sender half of [`ring_link`].
#[derive(Debug)]
pub struct LinkWire {
    st: Arc<(Mutex<LinkState>, Condvar)>,
    ring: Option<(usize, usize)>,
    writes: usize,
}

/// Receiver half of [`ring_link`].
#[derive(Debug)]
pub struct LinkIncoming {
    st: Arc<(Mutex<LinkState>, Condvar)>,
}

impl LinkWire {
    /// Make the n-th write fail.
    pub fn fail_write_at(&self, n: usize) {
        self.st
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fail_write_at = Some(n);
    }
}

impl LinkIncoming {
    /// Publish the receiver's ring.
    ///
    /// # Safety
    /// The ring must stay allocated while the link is used.
    pub unsafe fn publish_ring(&self, ring: &PinnedBuffer) {
        self.st.0.lock().unwrap_or_else(|e| e.into_inner()).rx_ring =
            Some((ring.as_ptr() as usize, ring.len()));
        self.st.1.notify_all();
    }
    /// Notifications the receiver sent back (none in this protocol) or got.
    pub fn notifications(&self) -> Vec<u32> {
        self.st
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .notifications
            .clone()
    }
}

fn grow(v: &mut Vec<bool>, i: usize) {
    if v.len() <= i {
        v.resize(i + 1, false);
    }
}

impl Wire for LinkWire {
    unsafe fn attach_ring(&mut self, ring: &PinnedBuffer) -> Result<()> {
        self.ring = Some((ring.as_ptr() as usize, ring.len()));
        Ok(())
    }

    fn write(&mut self, ops: &[WireOp]) -> Result<WireTicket> {
        let (src, src_len) = self
            .ring
            .ok_or_else(|| GpuError::Wire("no ring attached".into()))?;
        let k = self.writes;
        self.writes += 1;
        let mut g = self.st.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.fail_write_at == Some(k) {
            return Err(GpuError::Wire(format!(
                "injected failure of link write #{k}"
            )));
        }
        let (dst, dst_len) = g
            .rx_ring
            .ok_or_else(|| GpuError::Wire("receiver ring not published".into()))?;
        for op in ops {
            let end = op.ring_off.checked_add(op.len);
            if end.is_none_or(|e| e > src_len || e > dst_len) {
                return Err(GpuError::Wire(format!(
                    "op {}+{} outside the rings",
                    op.ring_off, op.len
                )));
            }
            // SAFETY: both rings are kept alive by their owners' contracts; the
            // receiver does not touch this slot until it sees the arrival below,
            // and the sender not until the credit comes back.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (src as *const u8).add(op.ring_off),
                    (dst as *mut u8).add(op.ring_off),
                    op.len,
                );
            }
        }
        grow(&mut g.arrived, k);
        g.arrived[k] = true;
        self.st.1.notify_all();
        Ok(WireTicket(k as u64))
    }

    fn read(&mut self, _ops: &[WireOp]) -> Result<WireTicket> {
        Err(GpuError::Wire("ring links only push".into()))
    }

    fn query(&mut self, t: WireTicket) -> Result<bool> {
        let g = self.st.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(g.released.get(t.0 as usize).copied().unwrap_or(false))
    }

    fn notify(&mut self, tag: u32) -> Result<()> {
        self.st
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .notifications
            .push(tag);
        Ok(())
    }
}

impl Incoming for LinkIncoming {
    fn arrived(&mut self, index: usize) -> Result<bool> {
        let g = self.st.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(g.arrived.get(index).copied().unwrap_or(false))
    }
    fn release(&mut self, index: usize) -> Result<()> {
        let mut g = self.st.0.lock().unwrap_or_else(|e| e.into_inner());
        grow(&mut g.released, index);
        g.released[index] = true;
        Ok(())
    }
}

/// A wire whose operations complete at once and move nothing: isolates the
/// copy-engine side of the pipeline (staged device-to-host / host-to-device rates).
#[derive(Debug, Default)]
pub struct NullWire {
    next: u64,
    notifications: Vec<u32>,
}

impl NullWire {
    /// A new null wire.
    pub fn new() -> Self {
        Self::default()
    }
    /// Notifications "sent".
    pub fn notifications(&self) -> &[u32] {
        &self.notifications
    }
}

impl Wire for NullWire {
    unsafe fn attach_ring(&mut self, _ring: &PinnedBuffer) -> Result<()> {
        Ok(())
    }
    fn write(&mut self, _ops: &[WireOp]) -> Result<WireTicket> {
        self.next += 1;
        Ok(WireTicket(self.next))
    }
    fn read(&mut self, _ops: &[WireOp]) -> Result<WireTicket> {
        self.next += 1;
        Ok(WireTicket(self.next))
    }
    fn query(&mut self, _t: WireTicket) -> Result<bool> {
        Ok(true)
    }
    fn notify(&mut self, tag: u32) -> Result<()> {
        self.notifications.push(tag);
        Ok(())
    }
}
