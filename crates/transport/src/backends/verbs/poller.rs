//! The per-engine verbs state: device, PD, registrations, the completion thread, and
//! connection setup (prepare -> exchange -> complete).

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::completion::BasicCompletionQueue;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::conn::{ConnCfg, VerbsConn, recv_wr_id};
use super::device::{OpenDevice, open, verbs_err};
use super::qp::{LocalPath, RcQp, RemoteQp};
use crate::contract::Reaper;
use crate::contract::TagSink;
use crate::core::health::{self, HEALTH_CLOCK_EVERY, HEALTH_EVERY};
use crate::core::wait::{CALLER_NAP, SPIN_ROUNDS, idle_nap, next_caller_nap};
use crate::core::window::MAX_QPS;
use crate::error::{Error, HandshakeError};
use crate::types::{PeerId, ProgressMode};

/// What the engine asks of the verbs backend.
#[derive(Clone, Debug)]
pub(crate) struct VerbsOptions {
    pub device: Option<String>,
    pub port: u8,
    pub gid_index: Option<u32>,
    pub mtu: Option<u32>,
    pub qps_per_peer: usize,
    pub tx_depth: u32,
    pub signal_every: u32,
    pub max_wr_bytes: u64,
    pub max_mr_bytes: Option<u64>,
    /// The completion thread's polling grace period after the last post or completion.
    pub poll_spin: Duration,
    /// Whether a completion thread runs at all.
    pub progress: ProgressMode,
}

/// One registered memory region (an `ibv_mr`); dropping it deregisters.
pub(crate) struct VerbsMr {
    pub mr: Arc<MemoryRegion>,
}

impl std::fmt::Debug for VerbsMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsMr")
            .field("addr", &format_args!("{:#x}", self.mr.get_ptr()))
            .field("len", &self.mr.region_len())
            .field("lkey", &format_args!("{:#x}", self.mr.lkey()))
            .field("rkey", &format_args!("{:#x}", self.mr.rkey()))
            .finish()
    }
}

impl VerbsMr {
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

/// The backend part of the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VerbsEndpoint {
    pub gid: [u8; 16],
    pub lid: u16,
    pub mtu: u32,
    pub qps: Vec<(u32, u32)>,
}

/// What the completion thread and callers that reap completions themselves share: the
/// engine's connections, and the engine-wide [`Reaper`] handle batches and the
/// notification queue use.
pub(crate) struct PollerShared {
    conns: Mutex<Vec<Weak<VerbsConn>>>,
    stop: AtomicBool,
    pub(crate) wake: Arc<PollWake>,
    spin: Duration,
    /// Manual progress: no completion thread; callers' engine-wide rounds run the health
    /// checks ([`PollerShared::health_if_due`]).
    manual: bool,
    /// Engine-wide caller rounds so far (manual progress: the clock is read every
    /// [`HEALTH_CLOCK_EVERY`]th).
    rounds: AtomicU32,
    /// When the health checks last ran, in nanoseconds after `born`.
    last_health: AtomicU64,
    born: Instant,
}

impl std::fmt::Debug for PollerShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PollerShared")
            .field("wake", &self.wake)
            .finish_non_exhaustive()
    }
}

impl Reaper for PollerShared {
    fn poll_once(&self) -> usize {
        self.wake.caller_polled();
        // Another caller (or the completion thread taking its snapshot) holds the list:
        // it is reaping, nothing to add.
        let Ok(list) = self.conns.try_lock() else {
            return 0;
        };
        let n = list
            .iter()
            .filter_map(Weak::upgrade)
            .map(|c| c.poll())
            .sum();
        // After the reap: a completion that sat in the CQ while nobody polled is progress,
        // not a stall.
        if self.manual {
            self.health_if_due(&list);
        }
        n
    }

    fn set_waiting(&self, on: bool) {
        if on {
            self.wake.waiters.fetch_add(1, Ordering::AcqRel);
        } else {
            self.wake.waiters.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn spin_budget(&self) -> Duration {
        self.spin
    }

    fn callers_only(&self) -> bool {
        self.manual
    }
}

impl PollerShared {
    /// Manual progress: the completion thread's periodic duty (QP states, the stall
    /// watchdog, heartbeats on idle connections), run from callers' engine-wide rounds at
    /// most every [`HEALTH_EVERY`]. `list` is the connection list, locked by the caller.
    fn health_if_due(&self, list: &[Weak<VerbsConn>]) {
        if !self
            .rounds
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(HEALTH_CLOCK_EVERY)
        {
            return;
        }
        let now = self.born.elapsed().as_nanos() as u64;
        let last = self.last_health.load(Ordering::Relaxed);
        if now.saturating_sub(last) < HEALTH_EVERY.as_nanos() as u64 {
            return;
        }
        self.last_health.store(now, Ordering::Relaxed);
        for c in list.iter().filter_map(Weak::upgrade) {
            c.health_check();
        }
    }
}

/// The completion thread is polling.
const THREAD_HOT: u8 = 0;
/// The completion thread naps because nothing is outstanding; a post wakes it.
const THREAD_IDLE: u8 = 1;
/// The completion thread naps because callers reap completions themselves.
const THREAD_YIELDING: u8 = 2;

/// Coordinates posters and reaping callers with the completion thread.
#[derive(Debug, Default)]
pub(crate) struct PollWake {
    /// Bumped by every post; a change counts as activity and restarts the grace period.
    posts: AtomicU64,
    /// Bumped by every caller-side reap ([`Reaper::poll_once`], a poster waiting for
    /// window room); a change makes the completion thread step aside for a nap.
    callers: AtomicU64,
    /// Callers busy-polling in a wait right now.
    waiters: AtomicUsize,
    /// THREAD_HOT, THREAD_IDLE or THREAD_YIELDING.
    state: AtomicU8,
    thread: OnceLock<std::thread::Thread>,
}

impl PollWake {
    /// Called by a poster before it posts: an idle completion thread goes back to polling.
    /// One that stepped aside for reaping callers is left alone (they reap this post's
    /// completions, and it checks again within [`CALLER_NAP`]).
    pub fn kick(&self) {
        self.posts.fetch_add(1, Ordering::Release);
        if self.state.load(Ordering::Acquire) == THREAD_IDLE
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
    }

    /// A caller reaped (or is about to reap) completions on its own thread.
    pub fn caller_polled(&self) {
        self.callers.fetch_add(1, Ordering::Relaxed);
    }
}

/// Engine-wide verbs state.
pub(crate) struct VerbsDevice {
    pub dev: OpenDevice,
    pub pd: Arc<ProtectionDomain>,
    pub opts: VerbsOptions,
    /// Effective path-MTU cap in bytes.
    pub mtu: u32,
    poller: Arc<PollerShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    conn_seq: AtomicU64,
}

impl std::fmt::Debug for VerbsDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDevice")
            .field("dev", &self.dev)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// RECVs kept posted per QP for incoming WRITE_WITH_IMM notifications.
const RECV_DEPTH: u32 = 64;
/// WRs per doorbell at most.
const CHAIN_MAX: u32 = 64;

impl VerbsDevice {
    /// Opens one device (a rail). `shared`: the completion machinery of the engine's first
    /// rail, which this one joins (one completion thread polls every rail's connections);
    /// `None` for the first rail, which starts it.
    pub fn open(
        opts: VerbsOptions,
        shared: Option<&Arc<PollerShared>>,
    ) -> Result<Arc<Self>, Error> {
        let dev = open(opts.device.as_deref(), opts.port, opts.gid_index)?;
        let pd = dev
            .ctx
            .alloc_pd()
            .map_err(|e| verbs_err("ibv_alloc_pd", e))?;
        let mtu = opts.mtu.map_or(dev.mtu, |m| m.min(dev.mtu));
        tracing::info!(
            device = %dev.name, port = dev.port, gid_index = dev.gid.index, gid = %dev.gid.addr,
            gid_kind = %dev.gid.kind, mtu, gbps = dev.gbps, max_mr_size = dev.caps.max_mr_size,
            max_qp_wr = dev.caps.max_qp_wr, max_sge = dev.caps.max_sge,
            "verbs device opened"
        );
        let manual = opts.progress == ProgressMode::Manual;
        let (poller, thread) = match shared {
            Some(p) => (Arc::clone(p), None),
            None => {
                let poller = Arc::new(PollerShared {
                    conns: Mutex::new(Vec::new()),
                    stop: AtomicBool::new(false),
                    wake: Arc::new(PollWake::default()),
                    spin: opts.poll_spin,
                    manual,
                    rounds: AtomicU32::new(0),
                    last_health: AtomicU64::new(0),
                    born: Instant::now(),
                });
                let thread = if manual {
                    None
                } else {
                    let p2 = Arc::clone(&poller);
                    let t = std::thread::Builder::new()
                        .name(format!("pagewire-cq-{}", dev.name))
                        .spawn(move || completion_loop(&p2))
                        .map_err(|e| Error::io("spawning the verbs completion thread", e))?;
                    Some(t)
                };
                (poller, thread)
            }
        };
        Ok(Arc::new(Self {
            dev,
            pd,
            opts,
            mtu,
            poller,
            thread: Mutex::new(thread),
            conn_seq: AtomicU64::new(0),
        }))
    }

    /// The handle callers reap this engine's completions through.
    pub fn progress(&self) -> Arc<PollerShared> {
        Arc::clone(&self.poller)
    }

    /// RDMA READs a QP keeps outstanding (initiator depth and responder resources): the
    /// device's limit, at most [`MAX_RD_ATOMIC`].
    pub fn max_rd_atomic(&self) -> u8 {
        self.dev.caps.max_rd_atomic.min(MAX_RD_ATOMIC)
    }

    /// Largest single MR: the config cap, else the device's `max_mr_size`.
    pub fn max_mr_bytes(&self) -> u64 {
        let dev = self.dev.caps.max_mr_size;
        self.opts.max_mr_bytes.map_or(dev, |m| m.min(dev))
    }

    /// Registers `[addr, addr+len)` as one MR (callers split at [`Self::max_mr_bytes`]).
    ///
    /// # Safety
    /// The range must stay mapped until the returned MR is dropped.
    pub unsafe fn register(
        &self,
        addr: u64,
        len: u64,
        remote_write: bool,
        remote_read: bool,
    ) -> Result<VerbsMr, Error> {
        let acc = mr_access(remote_write, remote_read);
        // SAFETY: the caller guarantees the range stays mapped while the MR exists (this
        // fn's contract); the MR pins the pages.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len as usize, acc) }
            .map_err(|e| registration_error(addr, len, "ibv_reg_mr".into(), e))?;
        Ok(VerbsMr { mr })
    }

    /// Registers a dma-buf (GPU memory exported by the CUDA driver) as one MR.
    ///
    /// # Safety
    /// `fd` must be a dma-buf whose `[offset, offset+len)` stays valid while the MR exists.
    pub unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        remote_write: bool,
        remote_read: bool,
    ) -> Result<VerbsMr, Error> {
        let acc = mr_access(remote_write, remote_read);
        // SAFETY: the caller guarantees the dma-buf range outlives the MR (this fn's contract).
        let mr = unsafe { self.pd.reg_dmabuf_mr(offset, len as usize, iova, fd, acc) }
            .map_err(|e| registration_error(iova, len, format!("ibv_reg_dmabuf_mr(fd {fd})"), e))?;
        Ok(VerbsMr { mr })
    }

    /// Creates the local half of a connection: CQs, QPs in INIT with RECVs posted.
    pub fn prepare(self: &Arc<Self>) -> Result<(PendingVerbs, VerbsEndpoint), Error> {
        let nqps = self.opts.qps_per_peer.clamp(1, MAX_QPS);
        let caps = self.dev.caps;
        let send_wr = self.opts.tx_depth.clamp(1, caps.max_qp_wr);
        let send_sge = caps.max_sge.min(16);
        let recv_wr = RECV_DEPTH.min(caps.max_qp_wr);
        let cqe = |n: u32| {
            n.saturating_mul(nqps as u32)
                .saturating_add(16)
                .min(caps.max_cqe)
        };
        let send_cq = self.build_cq(cqe(send_wr))?;
        let recv_cq = self.build_cq(cqe(recv_wr))?;
        let mut qps = Vec::with_capacity(nqps);
        for i in 0..nqps {
            let mut qp = RcQp::create(
                &self.pd,
                &send_cq,
                &recv_cq,
                send_wr,
                send_sge,
                recv_wr,
                self.dev.port,
            )?;
            let depth = recv_wr.min(qp.caps.max_recv_wr.max(1));
            qp.post_recvs((0..u64::from(depth)).map(|s| recv_wr_id(i, s)))?;
            qps.push(qp);
        }
        let ep = VerbsEndpoint {
            gid: self.dev.gid.addr.octets(),
            lid: self.dev.lid,
            mtu: self.mtu,
            qps: qps.iter().map(|q| (q.qpn, q.psn)).collect(),
        };
        Ok((
            PendingVerbs {
                engine: Arc::clone(self),
                qps,
                send_cq,
                recv_cq,
                recv_depth: recv_wr,
            },
            ep,
        ))
    }

    fn build_cq(&self, cqe: u32) -> Result<Arc<BasicCompletionQueue>, Error> {
        // Basic CQ on purpose: see hazard 1 (extended-CQ iterator on rdma-core 44).
        self.dev
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe.max(1))
            .build()
            .map_err(|e| verbs_err("ibv_create_cq", e))
    }

    fn adopt(&self, conn: &Arc<VerbsConn>) {
        let mut list = self.poller.conns.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(conn));
    }
}

impl VerbsDevice {
    /// Stops the completion thread (idempotent).
    pub fn stop(&self) {
        self.poller.stop.store(true, Ordering::Release);
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t
            && t.thread().id() != std::thread::current().id()
        {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for VerbsDevice {
    fn drop(&mut self) {
        self.stop();
    }
}

/// QPs created and in INIT, waiting for the peer's half.
pub(crate) struct PendingVerbs {
    engine: Arc<VerbsDevice>,
    qps: Vec<RcQp>,
    send_cq: Arc<BasicCompletionQueue>,
    recv_cq: Arc<BasicCompletionQueue>,
    recv_depth: u32,
}

impl std::fmt::Debug for PendingVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingVerbs")
            .field("qps", &self.qps)
            .finish_non_exhaustive()
    }
}

impl PendingVerbs {
    /// Connects QP `i` to the peer's QP `i` (both sides use the smaller count; surplus QPs
    /// are destroyed) and registers the connection with the completion thread.
    pub fn complete(
        mut self,
        remote: &VerbsEndpoint,
        notify: Option<Arc<dyn TagSink>>,
        peer: PeerId,
    ) -> Result<Arc<VerbsConn>, Error> {
        let n = self.qps.len().min(remote.qps.len());
        if n == 0 {
            return Err(HandshakeError::BadField {
                field: "qps",
                value: "0".into(),
            }
            .into());
        }
        self.qps.truncate(n);
        let e = &self.engine;
        let local = LocalPath {
            port: e.dev.port,
            gid_index: u8::try_from(e.dev.gid.index).map_err(|_| {
                Error::config("gid_index", e.dev.gid.index, "must be < 256 for the GRH")
            })?,
            mtu: e.mtu,
            max_rd_atomic: e.max_rd_atomic(),
        };
        for (qp, &(qpn, psn)) in self.qps.iter_mut().zip(&remote.qps) {
            qp.connect(
                &local,
                &RemoteQp {
                    qpn,
                    psn,
                    gid: remote.gid,
                    lid: remote.lid,
                    mtu: remote.mtu,
                },
            )?;
        }
        let cfg = ConnCfg {
            window: e.opts.tx_depth,
            chain_max: CHAIN_MAX,
            signal_every: e.opts.signal_every.max(1),
            max_wr_bytes: e.opts.max_wr_bytes,
            // One limit for WRITEs and READs: READ SGE lists are capped by `max_sge_rd`.
            max_sge: self
                .qps
                .iter()
                .map(|q| q.caps.max_send_sge as usize)
                .min()
                .unwrap_or(1)
                .min(e.dev.caps.max_sge_rd as usize)
                .max(1),
            recv_depth: self.recv_depth,
        };
        let seq = e.conn_seq.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new_cyclic(|me| {
            VerbsConn::new(
                self.qps,
                self.send_cq,
                self.recv_cq,
                cfg,
                notify,
                peer,
                format!("{}#{seq} {peer}", e.dev.name),
            )
            .with_poller(&e.poller)
            .with_self(me)
        });
        e.adopt(&conn);
        Ok(conn)
    }
}

/// Access of every MR. Local write is always on: READs land in local memory, and verbs
/// requires it with remote write. Relaxed ordering is an optional flag (providers without
/// it ignore it); on PCIe hosts with GPUs it is worth a large factor in bandwidth.
fn mr_access(remote_write: bool, remote_read: bool) -> AccessFlags {
    let mut acc = AccessFlags::LocalWrite | AccessFlags::RelaxedOrdering;
    if remote_write {
        acc |= AccessFlags::RemoteWrite;
    }
    if remote_read {
        acc |= AccessFlags::RemoteRead;
    }
    acc
}

/// A failed registration of `[addr, addr+len)`: the verbs call and the provider's reason.
fn registration_error(
    addr: u64,
    len: u64,
    call: String,
    e: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Registration {
        addr,
        len,
        reason: format!(
            "{call}: {}",
            e.source().map_or(e.to_string(), |s| s.to_string())
        ),
        source: Some(Arc::new(e)),
    }
}

/// Cap on outstanding RDMA READs per QP: ConnectX's usual limit. perftest takes the
/// device's maximum instead (rxe: 128); on rxe that made no measurable difference
/// (interleaved READ rounds at 16 and 128), and each one costs the responder a resource
/// entry.
const MAX_RD_ATOMIC: u8 = 16;

/// The completion thread. While a caller reaps completions itself (busy-polling in
/// `TransferHandle::wait` or `Engine::poll_notification`, or since the last round through
/// `try_notification` or a poster waiting for window room), it steps aside: it naps for
/// [`CALLER_NAP`], doubling to [`CALLER_NAP_MAX`] while callers keep reaping, and touches
/// the connections only for the health check (two
/// threads spinning per process cost perftest's latency on small hosts). Otherwise it
/// polls every live connection's CQs and stays hot (spinning a few rounds, then yielding
/// every round so rxe's kernel work and the posters get the CPU) while any WR is
/// outstanding and for `spin` after the last post or completion; only then does it back
/// off to sleeps of 50 µs doubling to 1 ms, which a post cuts short ([`PollWake::kick`]).
/// Every 50 ms it queries the real QP states, so a QP that went to ERR without a WC of
/// ours (the peer's error, an async event) still breaks its connection promptly.
fn completion_loop(shared: &PollerShared) {
    let wake = &shared.wake;
    let _ = wake.thread.set(std::thread::current());
    let mut idle: u32 = 0;
    let mut naps: u32 = 0;
    // The next nap while callers reap: doubles with every nap in a row.
    let mut caller_nap = CALLER_NAP;
    let mut seen_posts = wake.posts.load(Ordering::Acquire);
    let mut seen_callers = wake.callers.load(Ordering::Acquire);
    let mut last_active = Instant::now();
    let mut last_health = Instant::now();
    let mut conns: Vec<Arc<VerbsConn>> = Vec::new();
    let snapshot = |conns: &mut Vec<Arc<VerbsConn>>| {
        conns.clear();
        let mut list = shared.conns.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|w| match w.upgrade() {
            Some(c) => {
                conns.push(c);
                true
            }
            None => false,
        });
    };
    while !shared.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let health_due = health::due(now.duration_since(last_health));
        let callers = wake.callers.load(Ordering::Acquire);
        if wake.waiters.load(Ordering::Acquire) > 0 || callers != seen_callers {
            // Callers reap: touch nothing they use (the connection list, the CQs) except
            // for the periodic health check.
            seen_callers = callers;
            if health_due {
                snapshot(&mut conns);
                for c in &conns {
                    c.health_check();
                }
                conns.clear();
                last_health = now;
            }
            wake.state.store(THREAD_YIELDING, Ordering::Release);
            std::thread::park_timeout(caller_nap);
            caller_nap = next_caller_nap(caller_nap);
            wake.state.store(THREAD_HOT, Ordering::Release);
            // Callers may have stopped with work outstanding: the next rounds are hot.
            last_active = Instant::now();
            idle = 0;
            naps = 0;
            continue;
        }
        caller_nap = CALLER_NAP;
        snapshot(&mut conns);
        if health_due {
            for c in &conns {
                c.health_check();
            }
            last_health = now;
        }
        let mut work = 0;
        for c in &conns {
            work += c.poll();
        }
        let posts = wake.posts.load(Ordering::Acquire);
        if work > 0 || posts != seen_posts {
            seen_posts = posts;
            last_active = now;
            idle = 0;
            naps = 0;
            conns.clear();
            continue;
        }
        // Outstanding WRs (data or a held notification) keep it hot without touching
        // `last_active`: they only retire through completions, which restart the grace.
        let outstanding = conns.iter().any(|c| c.has_outstanding());
        conns.clear();
        idle = idle.saturating_add(1);
        if outstanding || now.duration_since(last_active) < shared.spin {
            if idle < SPIN_ROUNDS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            continue;
        }
        let nap = idle_nap(naps);
        naps = naps.saturating_add(1);
        wake.state.store(THREAD_IDLE, Ordering::Release);
        // A post between the last check and the store above would be missed until the
        // nap ends; re-check it now that kickers can see the idle state.
        if wake.posts.load(Ordering::Acquire) == seen_posts {
            std::thread::park_timeout(nap);
        }
        wake.state.store(THREAD_HOT, Ordering::Release);
    }
}
