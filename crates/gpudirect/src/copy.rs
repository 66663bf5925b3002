//! Copy engines: device<->pinned-host copies that run asynchronously and are
//! ordered by recorded tickets (CUDA events on a GPU).
//!
//! [`HostCopyEngine`] runs the same contract with `memcpy` on worker threads, so
//! the staging pipeline's ordering, back-pressure and error paths are tested on
//! machines without a GPU. It can inject failures and delays.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, unbounded};

use crate::error::{GpuError, Result};
use crate::memory::{
    DeviceBuffer, DevicePtr, HostRegistry, PinnedBuffer, check_range, registry_contains,
};

/// Copy direction; each direction is its own in-order queue (a CUDA stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device to host.
    D2H,
    /// Host to device.
    H2D,
}

/// Completes when everything queued before it in its direction has completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyTicket(u64);

/// Asynchronous copies between device memory and pinned host memory.
///
/// Copies in one [`Direction`] execute in queue order; the two directions run
/// independently. [`CopyEngine::record`] returns a ticket that completes after
/// everything queued before it in that direction; a failed copy fails the next
/// ticket of its direction.
pub trait CopyEngine: Send + Sync + fmt::Debug {
    /// Short name for logs ("host", "cuda:0").
    fn name(&self) -> String;
    /// Pinned host memory for the staging ring.
    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer>;
    /// Device memory (a host stand-in for the host engine).
    fn alloc_device(&self, len: usize) -> Result<DeviceBuffer>;
    /// Queue a device-to-host copy.
    ///
    /// # Safety
    /// `src..src+len` must be device memory of this engine and `dst..dst+len`
    /// host memory; both must stay valid, and `dst` untouched, until a ticket
    /// recorded after this copy completed.
    unsafe fn d2h_async(&self, src: DevicePtr, dst: *mut u8, len: usize) -> Result<()>;
    /// Queue a host-to-device copy.
    ///
    /// # Safety
    /// As for [`CopyEngine::d2h_async`] with the directions swapped; `src` must
    /// not be written until the ticket completed.
    unsafe fn h2d_async(&self, src: *const u8, dst: DevicePtr, len: usize) -> Result<()>;
    /// A ticket after everything queued so far in `dir`.
    fn record(&self, dir: Direction) -> Result<CopyTicket>;
    /// `Ok(true)` once the ticket completed (the ticket is then retired),
    /// `Ok(false)` while pending, `Err` if a copy before it failed.
    fn query(&self, t: CopyTicket) -> Result<bool>;
    /// Wait for the ticket until `deadline`; retires it.
    fn synchronize(&self, t: CopyTicket, deadline: Instant) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            if self.query(t)? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(GpuError::Timeout {
                    timeout: Duration::ZERO,
                    what: "a copy-engine ticket",
                });
            }
            backoff.snooze();
        }
    }

    /// Copy `data` into `dst` at `offset` and wait (for tests and benchmarks).
    fn upload(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        data: &[u8],
        timeout: Duration,
    ) -> Result<()> {
        check_range(offset as u64, data.len() as u64, dst.len() as u64)?;
        // SAFETY: the range is inside `dst`, which the borrow keeps alive, and
        // `data` is borrowed until we synchronized below.
        unsafe { self.h2d_async(data.as_ptr(), dst.ptr().offset(offset as u64), data.len())? };
        let t = self.record(Direction::H2D)?;
        self.synchronize(t, Instant::now() + timeout)
    }

    /// Copy `out.len()` bytes from `src` at `offset` into `out` and wait.
    fn download(
        &self,
        src: &DeviceBuffer,
        offset: usize,
        out: &mut [u8],
        timeout: Duration,
    ) -> Result<()> {
        check_range(offset as u64, out.len() as u64, src.len() as u64)?;
        // SAFETY: as in `upload`; `out` is exclusively borrowed until synchronized.
        unsafe { self.d2h_async(src.ptr().offset(offset as u64), out.as_mut_ptr(), out.len())? };
        let t = self.record(Direction::D2H)?;
        self.synchronize(t, Instant::now() + timeout)
    }
}

/// `CopyEngine` for pointers to one: every method forwards to the pointee.
macro_rules! forward_copy_engine {
    ($($ptr:ty),+) => {$(
        impl<C: CopyEngine + ?Sized> CopyEngine for $ptr {
            fn name(&self) -> String {
                (**self).name()
            }
            fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
                (**self).alloc_pinned(len)
            }
            fn alloc_device(&self, len: usize) -> Result<DeviceBuffer> {
                (**self).alloc_device(len)
            }
            unsafe fn d2h_async(&self, src: DevicePtr, dst: *mut u8, len: usize) -> Result<()> {
                // SAFETY: forwarded contract.
                unsafe { (**self).d2h_async(src, dst, len) }
            }
            unsafe fn h2d_async(&self, src: *const u8, dst: DevicePtr, len: usize) -> Result<()> {
                // SAFETY: forwarded contract.
                unsafe { (**self).h2d_async(src, dst, len) }
            }
            fn record(&self, dir: Direction) -> Result<CopyTicket> {
                (**self).record(dir)
            }
            fn query(&self, t: CopyTicket) -> Result<bool> {
                (**self).query(t)
            }
            fn synchronize(&self, t: CopyTicket, deadline: Instant) -> Result<()> {
                (**self).synchronize(t, deadline)
            }
        }
    )+};
}

forward_copy_engine!(std::sync::Arc<C>, &C);

/// Spin, then yield, then sleep briefly: cheap for short waits, polite for long ones.
#[derive(Debug, Default)]
pub(crate) struct Backoff(u32);

impl Backoff {
    pub(crate) fn snooze(&mut self) {
        self.0 = self.0.saturating_add(1);
        if self.0 < 64 {
            std::hint::spin_loop();
        } else if self.0 < 128 {
            thread::yield_now();
        } else {
            thread::sleep(Duration::from_micros(50));
        }
    }
    pub(crate) fn reset(&mut self) {
        self.0 = 0;
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TicketState {
    Pending,
    Done,
    Failed(String),
}

#[derive(Debug, Default)]
struct Tickets {
    map: Mutex<HashMap<u64, TicketState>>,
    cv: Condvar,
}

enum Job {
    Copy { src: usize, dst: usize, len: usize },
    Record(u64),
}

/// Failure and delay injection for [`HostCopyEngine`].
#[derive(Debug, Clone, Default)]
pub struct HostFaults {
    /// Fail the n-th (0-based) device-to-host copy.
    pub fail_d2h_at: Option<u64>,
    /// Fail the n-th (0-based) host-to-device copy.
    pub fail_h2d_at: Option<u64>,
    /// Sleep this long before each copy (makes overlap visible).
    pub delay: Duration,
}

struct Queue {
    tx: Sender<Job>,
    copies: AtomicU64,
}

/// A [`CopyEngine`] whose "device" memory is host memory and whose streams are
/// worker threads doing `memcpy`. Same ordering and error contract as CUDA.
pub struct HostCopyEngine {
    d2h: Queue,
    h2d: Queue,
    tickets: Arc<Tickets>,
    next: AtomicU64,
    registry: HostRegistry,
    faults: HostFaults,
}

impl fmt::Debug for HostCopyEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostCopyEngine")
            .field("faults", &self.faults)
            .finish()
    }
}

impl Default for HostCopyEngine {
    fn default() -> Self {
        Self::new(HostFaults::default())
    }
}

impl HostCopyEngine {
    /// A host engine with the given fault injection.
    pub fn new(faults: HostFaults) -> Self {
        let tickets = Arc::new(Tickets::default());
        let mk = |dir: Direction| {
            let (tx, rx) = unbounded::<Job>();
            let tickets = tickets.clone();
            let faults = faults.clone();
            thread::Builder::new()
                .name(format!("pw-hostcopy-{dir:?}"))
                .spawn(move || {
                    let fail_at = match dir {
                        Direction::D2H => faults.fail_d2h_at,
                        Direction::H2D => faults.fail_h2d_at,
                    };
                    let mut n = 0u64;
                    let mut sticky: Option<String> = None;
                    for job in rx {
                        match job {
                            Job::Copy { src, dst, len } => {
                                if !faults.delay.is_zero() {
                                    thread::sleep(faults.delay);
                                }
                                if fail_at == Some(n) {
                                    sticky = Some(format!("injected failure of {dir:?} copy #{n}"));
                                } else if sticky.is_none() {
                                    // SAFETY: the submitter's contract (d2h_async/h2d_async)
                                    // keeps both ranges valid and unaliased until the next
                                    // ticket of this queue completes, which happens after
                                    // this copy.
                                    unsafe {
                                        std::ptr::copy_nonoverlapping(
                                            src as *const u8,
                                            dst as *mut u8,
                                            len,
                                        )
                                    };
                                }
                                n += 1;
                            }
                            Job::Record(id) => {
                                let state = match sticky.take() {
                                    Some(e) => TicketState::Failed(e),
                                    None => TicketState::Done,
                                };
                                let mut m = tickets.map.lock().unwrap_or_else(|e| e.into_inner());
                                m.insert(id, state);
                                tickets.cv.notify_all();
                            }
                        }
                    }
                })
                .expect("spawning a host copy thread");
            Queue {
                tx,
                copies: AtomicU64::new(0),
            }
        };
        Self {
            d2h: mk(Direction::D2H),
            h2d: mk(Direction::H2D),
            tickets: tickets.clone(),
            next: AtomicU64::new(1),
            registry: HostRegistry::default(),
            faults,
        }
    }

    /// Number of copies queued so far in `dir`.
    pub fn copies_queued(&self, dir: Direction) -> u64 {
        match dir {
            Direction::D2H => self.d2h.copies.load(Ordering::Relaxed),
            Direction::H2D => self.h2d.copies.load(Ordering::Relaxed),
        }
    }

    fn queue(&self, dir: Direction) -> &Queue {
        match dir {
            Direction::D2H => &self.d2h,
            Direction::H2D => &self.h2d,
        }
    }

    fn push(&self, dir: Direction, job: Job) -> Result<()> {
        self.queue(dir)
            .tx
            .send(job)
            .map_err(|_| GpuError::Copy(format!("{dir:?} worker is gone")))
    }
}

impl CopyEngine for HostCopyEngine {
    fn name(&self) -> String {
        "host".into()
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        PinnedBuffer::host(len)
    }

    fn alloc_device(&self, len: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::host(len, self.registry.clone())
    }

    unsafe fn d2h_async(&self, src: DevicePtr, dst: *mut u8, len: usize) -> Result<()> {
        if !registry_contains(&self.registry, src.0, len) {
            return Err(GpuError::Copy(format!(
                "d2h source {:#x}+{len} is not device memory of this engine",
                src.0
            )));
        }
        self.d2h.copies.fetch_add(1, Ordering::Relaxed);
        self.push(
            Direction::D2H,
            Job::Copy {
                src: src.0 as usize,
                dst: dst as usize,
                len,
            },
        )
    }

    unsafe fn h2d_async(&self, src: *const u8, dst: DevicePtr, len: usize) -> Result<()> {
        if !registry_contains(&self.registry, dst.0, len) {
            return Err(GpuError::Copy(format!(
                "h2d destination {:#x}+{len} is not device memory of this engine",
                dst.0
            )));
        }
        self.h2d.copies.fetch_add(1, Ordering::Relaxed);
        self.push(
            Direction::H2D,
            Job::Copy {
                src: src as usize,
                dst: dst.0 as usize,
                len,
            },
        )
    }

    fn record(&self, dir: Direction) -> Result<CopyTicket> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.tickets
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, TicketState::Pending);
        self.push(dir, Job::Record(id))?;
        Ok(CopyTicket(id))
    }

    fn query(&self, t: CopyTicket) -> Result<bool> {
        let mut m = self.tickets.map.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(&t.0) {
            None => Err(GpuError::Copy(format!("unknown or retired ticket {}", t.0))),
            Some(TicketState::Pending) => Ok(false),
            Some(TicketState::Done) => {
                m.remove(&t.0);
                Ok(true)
            }
            Some(TicketState::Failed(e)) => {
                let e = e.clone();
                m.remove(&t.0);
                Err(GpuError::Copy(e))
            }
        }
    }

    fn synchronize(&self, t: CopyTicket, deadline: Instant) -> Result<()> {
        let mut m = self.tickets.map.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match m.get(&t.0) {
                None => return Err(GpuError::Copy(format!("unknown or retired ticket {}", t.0))),
                Some(TicketState::Pending) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(GpuError::Timeout {
                            timeout: Duration::ZERO,
                            what: "a host copy ticket",
                        });
                    }
                    m = self
                        .tickets
                        .cv
                        .wait_timeout(m, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                Some(TicketState::Done) => {
                    m.remove(&t.0);
                    return Ok(());
                }
                Some(TicketState::Failed(e)) => {
                    let e = e.clone();
                    m.remove(&t.0);
                    return Err(GpuError::Copy(e));
                }
            }
        }
    }
}

/// The CUDA copy engine: one stream per direction on one GPU, events as tickets.
#[cfg(feature = "cuda")]
pub struct CudaCopyEngine {
    ordinal: u32,
    d2h: crate::ffi::Stream,
    h2d: crate::ffi::Stream,
    next: AtomicU64,
    tickets: Mutex<HashMap<u64, crate::ffi::Event>>,
    pool: Mutex<Vec<crate::ffi::Event>>,
}

#[cfg(feature = "cuda")]
impl fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

#[cfg(feature = "cuda")]
impl CudaCopyEngine {
    /// Streams on GPU `ordinal`. Fails with `Unavailable` on machines without CUDA.
    pub fn new(ordinal: u32) -> Result<Self> {
        let info = crate::probe::cuda().map_err(GpuError::Unavailable)?;
        if ordinal as usize >= info.gpus.len() {
            return Err(GpuError::NoSuchDevice(ordinal));
        }
        Ok(Self {
            ordinal,
            d2h: crate::ffi::Stream::new(ordinal)?,
            h2d: crate::ffi::Stream::new(ordinal)?,
            next: AtomicU64::new(1),
            tickets: Mutex::new(HashMap::new()),
            pool: Mutex::new(Vec::new()),
        })
    }

    /// The GPU ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn stream(&self, dir: Direction) -> &crate::ffi::Stream {
        match dir {
            Direction::D2H => &self.d2h,
            Direction::H2D => &self.h2d,
        }
    }

    /// Block until both streams are idle.
    pub fn synchronize_all(&self) -> Result<()> {
        self.d2h.synchronize()?;
        self.h2d.synchronize()
    }
}

#[cfg(feature = "cuda")]
impl CopyEngine for CudaCopyEngine {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        PinnedBuffer::cuda(self.ordinal, len)
    }

    fn alloc_device(&self, len: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::cuda(self.ordinal, len)
    }

    unsafe fn d2h_async(&self, src: DevicePtr, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.d2h.dtoh_async(dst, src.0, len) }
    }

    unsafe fn h2d_async(&self, src: *const u8, dst: DevicePtr, len: usize) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.h2d.htod_async(dst.0, src, len) }
    }

    fn record(&self, dir: Direction) -> Result<CopyTicket> {
        let ev = match self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            Some(ev) => ev,
            None => crate::ffi::Event::new(self.ordinal)?,
        };
        ev.record(self.stream(dir))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.tickets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, ev);
        Ok(CopyTicket(id))
    }

    fn query(&self, t: CopyTicket) -> Result<bool> {
        let mut m = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ev) = m.get(&t.0) else {
            return Err(GpuError::Copy(format!("unknown or retired ticket {}", t.0)));
        };
        match ev.query() {
            Ok(crate::ffi::EventState::Pending) => Ok(false),
            Ok(crate::ffi::EventState::Done) => {
                if let Some(ev) = m.remove(&t.0) {
                    self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(ev);
                }
                Ok(true)
            }
            Err(e) => {
                m.remove(&t.0);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn host_engine_round_trip() {
        let e = HostCopyEngine::default();
        let dev = e.alloc_device(1000).unwrap();
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        e.upload(&dev, 0, &data, T).unwrap();
        let mut out = vec![0u8; 300];
        e.download(&dev, 500, &mut out, T).unwrap();
        assert_eq!(out, data[500..800]);
    }

    #[test]
    fn host_engine_rejects_foreign_and_out_of_range() {
        let e = HostCopyEngine::default();
        let dev = e.alloc_device(64).unwrap();
        let mut out = vec![0u8; 65];
        assert!(matches!(
            e.download(&dev, 0, &mut out, T),
            Err(GpuError::OutOfRange { .. })
        ));
        let mut buf = [0u8; 8];
        // SAFETY: the engine refuses the foreign address before touching it.
        let r = unsafe { e.d2h_async(DevicePtr(buf.as_mut_ptr() as u64), buf.as_mut_ptr(), 8) };
        assert!(matches!(r, Err(GpuError::Copy(_))));
    }

    #[test]
    fn injected_failure_fails_next_ticket_only() {
        let e = HostCopyEngine::new(HostFaults {
            fail_h2d_at: Some(1),
            ..Default::default()
        });
        let dev = e.alloc_device(16).unwrap();
        e.upload(&dev, 0, &[1; 8], T).unwrap();
        assert!(matches!(
            e.upload(&dev, 8, &[2; 8], T),
            Err(GpuError::Copy(_))
        ));
        e.upload(&dev, 8, &[3; 8], T).unwrap();
        let mut out = [0u8; 16];
        e.download(&dev, 0, &mut out, T).unwrap();
        assert_eq!(out, [1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3]);
    }

    #[test]
    fn tickets_retire_once() {
        let e = HostCopyEngine::default();
        let t = e.record(Direction::D2H).unwrap();
        e.synchronize(t, Instant::now() + T).unwrap();
        assert!(e.query(t).is_err());
    }
}
