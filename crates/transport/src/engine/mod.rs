//! The engine: registration, the control listener and handshake, the peer table,
//! batch validation and remote notifications. Backends only move bytes.
//!
//! Threads: one control-listener thread per engine, plus one short-lived thread per
//! incoming handshake (capped), so a slow or half-open client never blocks others.
//! Backends add their own (see docs/transport.md).

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::backends;
use crate::buffer::HostBuffer;
use crate::config::EngineConfig;
use crate::contract::{
    Backend, BackendInfo, BackendInit, Conn, ConnCtx, NotifySink, NotifyWait, RailControl, Reaper,
};
use crate::core::batch::{Batch, BatchState};
use crate::core::handshake;
use crate::core::registry::{Chunk, InsertPlan, RegionInfo, Registry, RemoteTable};
use crate::core::resolve::{self, ResolvedOps};
use crate::core::topology::MemoryLocation;
use crate::core::wait::Yield;
use crate::core::wire::{EndpointInfo, Frame, Hello, Welcome};
use crate::error::{Error, HandshakeError, PeerFault, Result};
use crate::net::admission::{Admission, MAX_CONCURRENT_HANDSHAKES, MAX_HANDSHAKES_PER_IP};
use crate::net::deadline::{self, Deadlined};
use crate::net::frame;
use crate::types::{
    Access, BackendKind, MrHandle, Notification, Op, PeerId, RailStats, RegionId, RemoteRegion,
    TransferOp,
};
use crate::util::random_u64;
use handle::TransferHandle;
use prepared::PreparedBatch;
use wait::{busy_poll, poll_with_naps};

pub(crate) mod handle;
pub mod prepared;
pub(crate) mod wait;

/// Map keyed by [`PeerId`]. Ids are this engine's own sequence numbers, never peer
/// input, so the hash needs no flooding resistance: one multiply instead of SipHash
/// (about 80 instructions of every submit, measured with callgrind).
type PeerMap<V> = HashMap<PeerId, V, std::hash::BuildHasherDefault<PeerIdHasher>>;

#[derive(Default)]
struct PeerIdHasher(u64);

impl std::hash::Hasher for PeerIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// One `(src, dst, len)` entry of a transfer plan.
pub trait PlanEntry {
    /// `(src, dst, len)` in data-flow order.
    fn triple(&self) -> (u64, u64, u64);
}

/// A plan's `(src, dst, len)` entries in data-flow order as a batch of `op` (for
/// `Op::Write` `src` is local, for `Op::Read` `dst` is), with its notification.
pub(crate) fn plan_batch<I>(op: Op, plan: I, notify: Option<u32>) -> Batch
where
    I: IntoIterator,
    I::Item: PlanEntry,
{
    let b: Batch = plan
        .into_iter()
        .map(|e| e.triple())
        .map(|(src, dst, len)| match op {
            Op::Write => TransferOp {
                op,
                local: src,
                remote: dst,
                len,
            },
            Op::Read => TransferOp {
                op,
                local: dst,
                remote: src,
                len,
            },
        })
        .collect();
    match notify {
        Some(t) => b.notify(t),
        None => b,
    }
}

impl PlanEntry for (u64, u64, u64) {
    fn triple(&self) -> (u64, u64, u64) {
        *self
    }
}

impl PlanEntry for pagewire_layout::Transfer {
    fn triple(&self) -> (u64, u64, u64) {
        (self.src, self.dst, self.len)
    }
}

/// What we know about a peer.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// Its id here.
    pub id: PeerId,
    /// Its control listener.
    pub control_addr: SocketAddr,
    /// Its engine's random id.
    pub engine_id: u64,
    /// Whether we initiated the connection.
    pub initiated: bool,
    /// Our half of the backend handshake (QPNs, PSNs, GID...).
    pub local_endpoint: EndpointInfo,
    /// Its half.
    pub remote_endpoint: EndpointInfo,
    /// The regions it exposes, as last described.
    pub regions: Vec<RemoteRegion>,
}

struct Peer {
    id: PeerId,
    control_addr: SocketAddr,
    engine_id: u64,
    initiated: bool,
    /// The session id the peer gave us (we present it in `Describe`).
    remote_session: u64,
    /// The session id we gave the peer.
    local_session: u64,
    conn: Arc<dyn Conn>,
    local_ep: EndpointInfo,
    remote_ep: EndpointInfo,
    regions: RwLock<Arc<RemoteTable>>,
}

impl Peer {
    fn table(&self) -> Arc<RemoteTable> {
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

struct Inner {
    /// Itself, for what outlives a call (a connection's rail reconnections).
    me: Weak<Inner>,
    id: u64,
    config: Arc<EngineConfig>,
    backend: Arc<dyn Backend>,
    /// Caller-side completion reaping (verbs), for batch waits and notifications.
    reaper: Option<Arc<dyn Reaper>>,
    info: BackendInfo,
    registry: Arc<Registry>,
    peers: RwLock<PeerMap<Arc<Peer>>>,
    /// Our session ids -> peer, for `Describe`.
    sessions: Mutex<HashMap<u64, PeerId>>,
    next_peer: AtomicU64,
    next_batch: AtomicU64,
    notify_tx: Sender<Notification>,
    notify_rx: Receiver<Notification>,
    /// Notifications dropped at the queue's bound.
    notify_dropped: Arc<AtomicU64>,
    /// Control connections refused for a token that differs from ours.
    token_refusals: AtomicU64,
    accept_tx: Sender<PeerId>,
    accept_rx: Receiver<PeerId>,
    local_addr: SocketAddr,
    shutdown: AtomicBool,
    /// Slots of the handshakes in progress.
    handshakes: Arc<Admission>,
    listener: Mutex<Option<JoinHandle<()>>>,
    /// Held for the whole of [`Inner::shutdown`] (`true` once done), so that a second,
    /// concurrent call returns only when the engine is quiet too.
    shut: Mutex<bool>,
}

/// A transfer engine. Cheap to clone (an `Arc`); the engine shuts down when the last
/// clone is dropped or [`Engine::shutdown`] is called.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
    /// Shared by the application's clones only (engine threads hold `Inner`): the drop
    /// of the last one shuts the engine down before it returns.
    _owner: Arc<Owner>,
}

/// Shuts the engine down when the application's last [`Engine`] goes.
struct Owner(Arc<Inner>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("id", &format_args!("{:#x}", self.inner.id))
            .field("backend", &self.inner.info.kind)
            .field("listen", &self.inner.local_addr)
            .finish()
    }
}

impl Engine {
    /// Opens the backend, binds the control listener and starts serving handshakes.
    pub fn new(config: EngineConfig) -> Result<Engine> {
        let config = Arc::new(config);
        let id = random_u64();
        let registry = Arc::new(Registry::default());
        let init = BackendInit {
            engine_id: id,
            registry: registry.clone(),
        };
        let (backend, reason) = backends::open(&config, &init)?;
        let mut info = backend.info();
        debug_assert_eq!(info.kind, backend.kind());
        info.selection = reason.clone();
        #[allow(deprecated)] // the old name keeps its value
        {
            info.lanes_per_peer = info.qps_or_streams;
        }
        tracing::info!(
            requested = %config.backend,
            backend = %info.kind,
            device = %info.device,
            reason = %reason,
            "pagewire transport backend selected"
        );
        let listener =
            TcpListener::bind(config.listen).map_err(|e| Error::io("bind control listener", e))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io("control listener address", e))?;
        if config.token.is_none() && !local_addr.ip().is_loopback() {
            tracing::warn!(
                listen = %local_addr,
                "no token set on an engine listening beyond loopback: any host that reaches \
                 this port can connect and read or write the memory it exposes \
                 (set PAGEWIRE_TOKEN; docs/transport.md, \"Threat model\")"
            );
        }
        let (notify_tx, notify_rx) = crossbeam_channel::unbounded();
        let (accept_tx, accept_rx) = crossbeam_channel::unbounded();
        let reaper = backend.reaper();
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            id,
            config,
            backend,
            reaper,
            info,
            registry,
            peers: RwLock::new(PeerMap::default()),
            sessions: Mutex::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
            next_batch: AtomicU64::new(1),
            notify_tx,
            notify_rx,
            notify_dropped: Arc::new(AtomicU64::new(0)),
            token_refusals: AtomicU64::new(0),
            accept_tx,
            accept_rx,
            local_addr,
            shutdown: AtomicBool::new(false),
            handshakes: Admission::new(MAX_CONCURRENT_HANDSHAKES, MAX_HANDSHAKES_PER_IP),
            listener: Mutex::new(None),
            shut: Mutex::new(false),
        });
        let weak = Arc::downgrade(&inner);
        let t = std::thread::Builder::new()
            .name("pagewire-ctrl".into())
            .spawn(move || listen_loop(listener, weak))
            .map_err(|e| Error::io("spawn control listener", e))?;
        *inner.listener.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        Ok(Engine {
            _owner: Arc::new(Owner(inner.clone())),
            inner,
        })
    }

    /// Engine with defaults plus environment overrides.
    pub fn from_env() -> Result<Engine> {
        Engine::new(EngineConfig::from_env()?)
    }

    /// The config in use.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The control listener's address (give it to peers).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// The data path in use (never `Auto`).
    pub fn backend_kind(&self) -> BackendKind {
        self.inner.info.kind
    }

    /// Device, MTU, QPs or streams per peer... and why the backend was chosen.
    pub fn backend_info(&self) -> BackendInfo {
        self.inner.info.clone()
    }

    /// What each RDMA device (rail) carried, for an engine on two rails or more: bytes,
    /// failures, slices carried again for a failed rail. Empty otherwise.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        self.inner.backend.rail_stats()
    }

    /// The engine's random id.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    // ---------------------------------------------------------------- registration

    /// Registers a [`HostBuffer`]; the engine keeps its memory alive until deregistered.
    pub fn register(&self, buf: &HostBuffer, access: Access) -> Result<RegionId> {
        self.inner
            .register(buf.addr(), buf.len() as u64, access, Some(buf.keepalive()))
    }

    /// Registers caller-owned memory.
    ///
    /// Registering a range inside an existing region with no more access is free and
    /// returns that region's id (each call still needs its own `deregister`).
    /// Regions larger than the backend's MR limit are split into several MRs.
    ///
    /// The memory is the caller's again once [`deregister`](Engine::deregister) (or
    /// [`deregister_wait`](Engine::deregister_wait)) succeeded, or once the engine shut
    /// down: when [`shutdown`](Engine::shutdown) returns, or the drop of the last
    /// `Engine` clone, no thread of this engine and no peer's operation touches it again,
    /// even if a peer keeps sending.
    ///
    /// While it is registered, the engine and its peers write and read it at any time
    /// (peers: with `REMOTE_WRITE` / `REMOTE_READ`). Access it only through raw pointers
    /// then, and read bytes after the batch that brought them completed or its
    /// notification arrived: a `&[u8]` or `&mut [u8]` over it would be undefined behaviour
    /// while a transfer writes it.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must be valid, initialised memory that stays allocated (and is
    /// not unmapped or remapped) until the region is deregistered or the engine has shut
    /// down, as above.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<RegionId> {
        self.inner.register(ptr as u64, len as u64, access, None)
    }

    /// Registers device memory exported as a dma-buf (GPUDirect RDMA through
    /// `ibv_reg_dmabuf_mr`); verbs backend only, others return [`Error::Unsupported`].
    ///
    /// The region is addressed by `iova` (normally the device virtual address of the
    /// range), `[iova, iova+len)` mapping to `[offset, offset+len)` of the dma-buf; ops
    /// name local addresses in that range. `fd` may be closed after the call (each MR keeps
    /// its own reference to the buffer). Split into several MRs like other regions.
    ///
    /// Like [`register_raw`](Engine::register_raw)'s memory, the range is the caller's
    /// again once it was deregistered or the engine shut down (`shutdown` returned, or
    /// the last clone was dropped): the NIC's registrations are gone then.
    ///
    /// # Safety
    /// `fd` must be a dma-buf whose `[offset, offset+len)` stays allocated until the region
    /// is deregistered or the engine has shut down.
    pub unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<RegionId> {
        use std::os::fd::AsRawFd;
        let raw = fd.as_raw_fd();
        let backend = &self.inner.backend;
        self.inner
            .register_with(iova, len as u64, access, None, &|off, n| {
                backend.register_dmabuf(raw, offset + off, n as usize, iova + off, access)
            })
    }

    /// Says where a region's memory is, so that an engine on several RDMA devices
    /// (rails) stripes its batches over the rails nearest it (see the `topology` module;
    /// `rail_priority` overrides the rule). Host memory is found on its own (the NUMA
    /// node of its first page); call this for GPU memory
    /// ([`MemoryLocation::gpu`](crate::topology::MemoryLocation::gpu) with the GPU's PCI
    /// address) or to correct it. [`MemoryLocation::Any`](crate::topology::MemoryLocation)
    /// lets every rail serve it. Without several rails this does nothing.
    pub fn set_memory_location(&self, id: RegionId, loc: &MemoryLocation) -> Result<()> {
        let lkeys = self.inner.registry.lkeys(id)?;
        self.inner.backend.place(&lkeys, loc);
        Ok(())
    }

    /// Deregisters a region; refuses with [`Error::RegionBusy`] while batches use it.
    pub fn deregister(&self, id: RegionId) -> Result<()> {
        if let Some(mrs) = self.inner.registry.remove(id)? {
            for mr in mrs {
                self.inner.backend.deregister(mr);
            }
        }
        Ok(())
    }

    /// Deregisters a region, waiting up to `deadline` for batches using it to finish (and
    /// reaping meanwhile, which manual progress needs for them to let go).
    pub fn deregister_wait(&self, id: RegionId, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        loop {
            match self.deregister(id) {
                Err(Error::RegionBusy { .. }) if Instant::now() < deadline => {
                    if self.reap() == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                Err(Error::RegionBusy { .. }) => {
                    return Err(Error::Timeout {
                        after: start.elapsed(),
                    });
                }
                other => return other,
            }
        }
    }

    /// Local regions, sorted by address.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.inner.registry.list()
    }

    /// What peers see of our memory (remotely accessible regions, one entry per MR).
    pub fn exposed_regions(&self) -> Vec<RemoteRegion> {
        self.inner.registry.exposed()
    }

    // ---------------------------------------------------------------- connections

    /// Connects to a peer's control listener and runs the handshake. Connections are
    /// meant to be set up once and reused for every batch. A peer that does not answer
    /// in time is [`Error::Timeout`].
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<PeerId> {
        let started = Instant::now();
        self.inner.check_open()?;
        let mut last = None;
        let addrs = addr.to_socket_addrs().map_err(|e| Error::Connect {
            addr: "?".into(),
            source: Arc::new(e),
        })?;
        for a in addrs {
            match self.inner.connect_one(a) {
                Ok(p) => return Ok(p),
                Err(e) => last = Some(e.deadline_as_timeout(started)),
            }
        }
        Err(last.unwrap_or_else(|| Error::Connect {
            addr: "?".into(),
            source: Arc::new(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "address resolved to nothing",
            )),
        }))
    }

    /// Waits until a peer connects to us (or `deadline`); returns its id.
    pub fn accept(&self, deadline: Instant) -> Option<PeerId> {
        self.inner.accept_rx.recv_deadline(deadline).ok()
    }

    /// Connected peers.
    pub fn peers(&self) -> Vec<PeerId> {
        let mut v: Vec<_> = self.inner.peers_read().keys().copied().collect();
        v.sort();
        v
    }

    /// What we know about a peer.
    pub fn peer_info(&self, peer: PeerId) -> Result<PeerInfo> {
        let p = self.inner.peer(peer)?;
        Ok(PeerInfo {
            id: p.id,
            control_addr: p.control_addr,
            engine_id: p.engine_id,
            initiated: p.initiated,
            local_endpoint: p.local_ep.clone(),
            remote_endpoint: p.remote_ep.clone(),
            regions: p.table().regions().to_vec(),
        })
    }

    /// Whether the connection to a peer is still usable (`false` once it broke: peer
    /// gone, stream reset, QP in error). A broken peer stays listed until `disconnect`;
    /// connect again for a new `PeerId`.
    pub fn peer_alive(&self, peer: PeerId) -> Result<bool> {
        Ok(!self.inner.peer(peer)?.conn.is_broken())
    }

    /// The regions a peer exposes, as last described.
    pub fn peer_regions(&self, peer: PeerId) -> Result<Vec<RemoteRegion>> {
        Ok(self.inner.peer(peer)?.table().regions().to_vec())
    }

    /// Fetches a peer's exposed regions again (after it registered more memory). A peer
    /// that does not answer in time is [`Error::Timeout`].
    pub fn redescribe(&self, peer: PeerId) -> Result<Vec<RemoteRegion>> {
        let started = Instant::now();
        self.inner
            .redescribe(peer)
            .map_err(|e| e.deadline_as_timeout(started))
    }

    /// Closes the connection to a peer; its pending batches fail.
    pub fn disconnect(&self, peer: PeerId) -> Result<()> {
        let p = self
            .inner
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&peer)
            .ok_or(Error::UnknownPeer { peer })?;
        self.inner
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&p.local_session);
        p.conn.close();
        Ok(())
    }

    // ---------------------------------------------------------------- transfers

    /// Validates a batch and posts it. Every local range must lie in registered memory
    /// (with `LOCAL_WRITE` for READ targets) and every remote range in the peer's
    /// exposed regions (with `REMOTE_WRITE` / `REMOTE_READ`); nothing is posted unless
    /// all ops pass.
    pub fn submit(&self, peer: PeerId, batch: Batch) -> Result<TransferHandle> {
        self.inner.submit(peer, batch)
    }

    /// Validates `batch` against the registry and the peer's table, pins its local
    /// regions and plans it once, for [`PreparedBatch::start`] to post any number of
    /// times, one run at a time (see [`crate::prepared`]). Errors as [`Engine::submit`];
    /// a batch deadline must be relative ([`Batch::timeout`]), since it applies per run.
    pub fn prepare(&self, peer: PeerId, batch: Batch) -> Result<PreparedBatch> {
        self.inner.prepare(peer, batch)
    }

    /// Submits a transfer plan: `(src, dst, len)` entries in data-flow order, such as a
    /// `&pagewire_layout::TransferPlan` (pass it directly) or plain triples. For
    /// `Op::Write`, `src` is local and `dst` remote; for `Op::Read`, `src` is remote and
    /// `dst` local.
    pub fn submit_plan<I>(
        &self,
        peer: PeerId,
        op: Op,
        plan: I,
        notify: Option<u32>,
    ) -> Result<TransferHandle>
    where
        I: IntoIterator,
        I::Item: PlanEntry,
    {
        self.submit(peer, plan_batch(op, plan, notify))
    }

    /// Waits for the next remote notification until `deadline`. On verbs the calling
    /// thread first busy-polls the completion queues itself (for up to the engine's
    /// `poll_spin` without any completion), then blocks (with manual progress: keeps
    /// reaping, with naps of up to 1 ms).
    pub fn poll_notification(&self, deadline: Instant) -> Option<Notification> {
        let rx = &self.inner.notify_rx;
        if let Some(p) = &self.inner.reaper {
            // This thread reaps: a tag it reaps itself comes straight to it (`NotifyWait`).
            let wait = NotifyWait::enter(self.inner.id, &self.inner.notify_tx);
            // `is_empty` first: most rounds of a wait find the queue empty, and it reads
            // two indices where `try_recv` takes the receive path.
            let mut ready = || {
                wait.take().or_else(|| {
                    if rx.is_empty() {
                        None
                    } else {
                        rx.try_recv().ok()
                    }
                })
            };
            if let Some(n) = busy_poll(&**p, deadline, Yield::Rarely, &mut ready) {
                return Some(n);
            }
            if p.callers_only() {
                // No completion thread feeds the queue: keep reaping until the deadline.
                return poll_with_naps(&**p, deadline, ready);
            }
            if let Some(n) = wait.take() {
                return Some(n);
            }
        }
        rx.recv_deadline(deadline).ok()
    }

    /// The next remote notification, if one is queued (on verbs, after reaping the
    /// completion queues once on this thread).
    pub fn try_notification(&self) -> Option<Notification> {
        let rx = &self.inner.notify_rx;
        if let Ok(n) = rx.try_recv() {
            return Some(n);
        }
        if let Some(p) = &self.inner.reaper {
            p.poll_once();
        }
        rx.try_recv().ok()
    }

    /// Reaps the verbs backend's completions once on this thread (every connection's
    /// CQs, and with [`crate::ProgressMode::Manual`] the connection health checks when
    /// due); returns how many completions were handled. Under manual progress an
    /// application that is not inside a wait calls this to move batches and notifications
    /// along; under auto progress it is optional. 0 on TCP and loopback, whose threads
    /// move their bytes themselves.
    pub fn reap(&self) -> usize {
        self.inner.reaper.as_ref().map_or(0, |p| p.poll_once())
    }

    /// The old name of [`Engine::reap`].
    #[deprecated(since = "0.1.0", note = "renamed to `Engine::reap`")]
    pub fn progress(&self) -> usize {
        self.reap()
    }

    /// The notification queue itself (for `select!` with other channels). Every clone
    /// drains the same queue. It holds at most `EngineConfig::notify_queue`
    /// notifications; see [`Engine::notifications_dropped`].
    pub fn notifications(&self) -> Receiver<Notification> {
        self.inner.notify_rx.clone()
    }

    /// How many notifications were dropped because the queue held
    /// `EngineConfig::notify_queue` of them that the application had not taken. Each drop
    /// also broke the connection of the peer that sent it (`peer_alive` false there; on
    /// TCP and loopback its batch failed with `Remote`), so no notification is lost
    /// silently: the peer knows, and so does the application through this count.
    pub fn notifications_dropped(&self) -> u64 {
        self.inner.notify_dropped.load(Ordering::Relaxed)
    }

    /// How many control connections (handshakes, `Describe`, rail reconnections) this
    /// engine refused because their token differed from its own (a missing one counts).
    /// Each was answered with a `Reject` the initiator reports as
    /// [`HandshakeError::TokenMismatch`]; the log shows the 1st, 2nd, 4th, 8th, ... only.
    pub fn token_refusals(&self) -> u64 {
        self.inner.token_refusals.load(Ordering::Relaxed)
    }

    /// Closes every connection, stops the listener and releases all registrations.
    /// Pending batches fail. Idempotent.
    ///
    /// When it returns (also from a second call that raced the first), no thread of this
    /// engine runs that could touch registered memory, and no peer's operation does: the
    /// TCP stream threads and loopback workers are joined, a loopback peer's copy into our
    /// memory has stopped, and the verbs memory registrations are gone. Memory registered
    /// with [`register_raw`](Engine::register_raw) may be freed then. Batches of ours that
    /// were in flight may have moved part of their bytes.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl Inner {
    fn check_open(&self) -> Result<()> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(Error::Shutdown);
        }
        Ok(())
    }

    fn peers_read(&self) -> std::sync::RwLockReadGuard<'_, PeerMap<Arc<Peer>>> {
        self.peers.read().unwrap_or_else(|p| p.into_inner())
    }

    // Lazy errors on the submit path: an eager `ok_or(Error)` is also dropped on success,
    // a match over every variant (140 instructions a round trip, callgrind).
    #[allow(clippy::unnecessary_lazy_evaluations)]
    fn peer(&self, peer: PeerId) -> Result<Arc<Peer>> {
        self.peers_read()
            .get(&peer)
            .cloned()
            .ok_or_else(|| Error::UnknownPeer { peer })
    }

    fn token(&self) -> &[u8] {
        self.config.token.as_deref().map_or(&[], str::as_bytes)
    }

    fn register(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        keepalive: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> Result<RegionId> {
        self.register_with(addr, len, access, keepalive, &|off, n| {
            self.backend
                .register((addr + off) as usize, n as usize, access)
        })
    }

    /// `register` with the per-chunk backend call (`reg(offset in region, chunk len)`)
    /// supplied: host memory or dma-buf.
    fn register_with(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        keepalive: Option<Arc<dyn std::any::Any + Send + Sync>>,
        reg: &dyn Fn(u64, u64) -> Result<MrHandle>,
    ) -> Result<RegionId> {
        self.check_open()?;
        if let InsertPlan::Existing(id) = self.registry.begin_insert(addr, len, access)? {
            return Ok(id);
        }
        let mut max = self.info.max_mr_bytes;
        if let Some(m) = self.config.max_mr_bytes {
            max = if max == 0 { m } else { max.min(m) };
        }
        if max == 0 {
            max = u64::MAX;
        }
        let mut chunks = Vec::new();
        let mut mrs: Vec<MrHandle> = Vec::new();
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(max);
            match reg(off, n) {
                Ok(mr) => {
                    chunks.push(Chunk {
                        addr: addr + off,
                        len: n,
                        lkey: mr.lkey,
                        rkey: mr.rkey,
                        lrails: mr.lrails,
                        rrails: mr.rrails,
                    });
                    mrs.push(mr);
                }
                Err(e) => {
                    for mr in mrs {
                        self.backend.deregister(mr);
                    }
                    return Err(e);
                }
            }
            off += n;
        }
        match self
            .registry
            .finish_insert(addr, len, access, chunks, mrs, keepalive)
        {
            Ok(id) => {
                tracing::debug!(%id, addr = format_args!("{addr:#x}"), len, ?access, "registered");
                Ok(id)
            }
            Err((e, mrs)) => {
                for mr in mrs {
                    self.backend.deregister(mr);
                }
                Err(e)
            }
        }
    }

    fn new_ctx(
        &self,
        peer: PeerId,
        remote_ip: std::net::IpAddr,
        deadline: Instant,
        initiator: bool,
    ) -> ConnCtx {
        ConnCtx {
            rails: initiator.then(|| {
                Arc::new(RailLink {
                    engine: self.me.clone(),
                    peer,
                }) as Arc<dyn RailControl>
            }),
            peer,
            remote_ip,
            deadline,
            notify: NotifySink {
                peer,
                engine: self.id,
                tx: self.notify_tx.clone(),
                cap: self.config.notify_queue,
                dropped: self.notify_dropped.clone(),
            },
            registry: self.registry.clone(),
            config: self.config.clone(),
        }
    }

    fn connect_one(&self, addr: SocketAddr) -> Result<PeerId> {
        // Refused before the peer does any work for us; `publish` checks again under the
        // table's lock (connects racing for the last slot).
        if self.peers_full() {
            return Err(Error::TooManyPeers {
                max: self.config.max_peers,
            });
        }
        // One deadline for the whole attempt: connect, frames, the backend's own setup
        // (TCP data streams, verbs probe), however the peer paces its bytes.
        let deadline = Instant::now() + self.config.handshake_timeout;
        let s = deadline::connect_by(&addr, deadline).map_err(|e| Error::Connect {
            addr: addr.to_string(),
            source: Arc::new(e),
        })?;
        let _ = s.set_nodelay(true);
        let mut s = Deadlined::new(&s, deadline);
        let (pending, ep) = self.backend.prepare_conn()?;
        let local_session = random_u64();
        let hello = Frame::Hello(Hello {
            token: self.token().to_vec(),
            engine_id: self.id,
            listen_port: self.local_addr.port(),
            session: local_session,
            endpoint: ep.clone(),
            regions: self.registry.exposed(),
        });
        frame::write_frame(&mut s, &hello)?;
        let (w, await_ready) = handshake::AwaitWelcome { ours: &ep }
            .handle(frame::read_frame(&mut s, self.config.handshake_max_bytes)?)?;
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let conn = pending.complete(&w.endpoint, self.new_ctx(id, addr.ip(), deadline, true))?;
        // The acceptor's QPs are ready (it completed before its Welcome): prove the path
        // before telling it we are.
        if let Err(e) = conn.probe(deadline) {
            conn.close();
            return Err(e);
        }
        if let Err(e) = frame::write_frame(&mut s, &Frame::Ready) {
            conn.close();
            return Err(e.into());
        }
        // The listener's own `Ready` says it has published us: from here on everything we
        // send it (a notification, a `Describe`) finds the peer it names.
        if let Err(e) = frame::read_frame(&mut s, self.config.handshake_max_bytes)
            .and_then(|f| await_ready.handle(f))
        {
            conn.close();
            return Err(e.into());
        }
        let peer = Arc::new(Peer {
            id,
            control_addr: addr,
            engine_id: w.engine_id,
            initiated: true,
            remote_session: w.session,
            local_session,
            conn,
            local_ep: ep,
            remote_ep: w.endpoint,
            regions: RwLock::new(Arc::new(RemoteTable::new(w.regions))),
        });
        peer.conn.set_remote_table(&peer.table());
        // The acceptor published us already; closing our end takes us out of its table.
        self.publish(peer)?;
        tracing::info!(peer = %id, %addr, "connected");
        Ok(id)
    }

    /// Whether the peer table is at `max_peers` (a hint: `publish` decides).
    fn peers_full(&self) -> bool {
        live(&self.peers_read()) >= self.config.max_peers
    }

    /// Puts an established peer in the table, or closes its connection: at `max_peers`
    /// that is [`Error::TooManyPeers`].
    fn publish(&self, peer: Arc<Peer>) -> Result<()> {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer.local_session, peer.id);
        let mut peers = self.peers.write().unwrap_or_else(|e| e.into_inner());
        // Checked under the lock that `shutdown` drains the table with (after setting the
        // flag): a handshake that finishes during shutdown closes its connection here
        // instead of leaving it behind.
        if self.shutdown.load(Ordering::Acquire) {
            drop(peers);
            peer.conn.close();
            return Ok(());
        }
        // The cap is decided here, under the table's lock, so handshakes that passed the
        // early check together still cannot exceed it.
        if live(&peers) >= self.config.max_peers {
            drop(peers);
            self.sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&peer.local_session);
            peer.conn.close();
            return Err(Error::TooManyPeers {
                max: self.config.max_peers,
            });
        }
        peers.insert(peer.id, peer);
        Ok(())
    }

    /// Takes a published peer back out and closes its connection.
    fn unpublish(&self, id: PeerId) {
        let p = self
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
        if let Some(p) = p {
            self.sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&p.local_session);
            p.conn.close();
        }
    }

    /// Serves one incoming control connection. Errors are logged by the caller.
    /// `deadline` (from the accept) bounds the whole exchange, however the client paces it.
    fn serve(&self, stream: TcpStream, deadline: Instant) -> Result<(), HandshakeError> {
        let from = stream.peer_addr()?;
        let _ = stream.set_nodelay(true);
        let mut s = Deadlined::new(&stream, deadline);
        let first = match frame::read_frame(&mut s, self.config.handshake_max_bytes) {
            // Another protocol version (an engine from before multi-rail): say so in a
            // Reject; that peer's decoder refuses our header in turn, naming both versions.
            Err(e @ HandshakeError::Version { ours, theirs }) => {
                let _ = reject(
                    &mut s,
                    &format!("protocol version {theirs} not supported (this engine speaks {ours})"),
                );
                return Err(e);
            }
            r => r?,
        };
        let request = handshake::AwaitRequest {
            token: self.token(),
            // Completing a TCP connection dials the data port the Hello names, on the
            // client's address: without a token, only a port its data listener could
            // have been given.
            tokenless_ports: self
                .config
                .token
                .is_none()
                .then_some(backends::tcp::ephemeral_ports as fn() -> _),
        }
        .handle(first);
        match request {
            Err(handshake::Refused { error, tell }) => {
                if error == HandshakeError::TokenMismatch {
                    // Before the Reject goes out, so the count includes this refusal once
                    // the initiator sees it. A stranger can repeat it as fast as it
                    // connects: every one is counted, only powers of two are logged.
                    let n = self.token_refusals.fetch_add(1, Ordering::Relaxed) + 1;
                    if n.is_power_of_two() {
                        tracing::warn!(%from, refused = n, "token mismatch: connection refused");
                    }
                }
                if let Some(tell) = tell {
                    let _ = reject(&mut s, tell);
                }
                Err(error)
            }
            Ok(handshake::Request::Hello(h)) => self.accept_hello(&mut s, from, h, deadline),
            Ok(handshake::Request::Rail {
                session,
                rail,
                endpoint,
            }) => self.accept_rail(&mut s, session, rail, &endpoint),
            Ok(handshake::Request::Describe { session }) => {
                let known = self
                    .sessions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains_key(&session);
                if !known {
                    let _ = reject(&mut s, "unknown session");
                    return Err(HandshakeError::BadField {
                        field: "session",
                        value: "unknown".into(),
                    });
                }
                frame::write_frame(&mut s, &Frame::Regions(self.registry.exposed()))
            }
        }
    }

    /// The acceptor's side of a rail's reconnection: new QPs for the rail, our endpoint
    /// back, and the rail in use again once the initiator proved it (`Ready`).
    fn accept_rail(
        &self,
        s: &mut Deadlined<'_>,
        session: u64,
        rail: u8,
        theirs: &EndpointInfo,
    ) -> Result<(), HandshakeError> {
        let id = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&session)
            .copied();
        let Some(p) = id.and_then(|id| self.peer(id).ok()) else {
            let _ = reject(s, "unknown session");
            return Err(HandshakeError::BadField {
                field: "session",
                value: "unknown".into(),
            });
        };
        let (ours, swap) = match p.conn.accept_rail(usize::from(rail), theirs) {
            Ok(x) => x,
            Err(e) => {
                let _ = reject(s, "rail setup failed");
                return Err(HandshakeError::Rejected {
                    reason: format!("rail {rail}: {e}"),
                });
            }
        };
        let ready = frame::write_frame(s, &Frame::RailAccepted(ours))
            .and_then(|()| frame::read_frame(s, self.config.handshake_max_bytes))
            .and_then(|f| handshake::AwaitReady.handle(f));
        swap(ready.is_ok());
        ready
    }

    fn accept_hello(
        &self,
        s: &mut Deadlined<'_>,
        from: SocketAddr,
        h: Hello,
        deadline: Instant,
    ) -> Result<(), HandshakeError> {
        // Reasons sent to the client are fixed texts: what failed inside stays in our log
        // (the error returned here), not in a stranger's hands.
        if self.peers_full() {
            return Err(self.refuse_full(s));
        }
        let (pending, ep) = match self.backend.prepare_conn() {
            Ok(x) => x,
            Err(e) => {
                let _ = reject(s, "connection setup failed");
                return Err(HandshakeError::Rejected {
                    reason: format!("cannot prepare connection: {e}"),
                });
            }
        };
        if let Err(e) = handshake::check_backend(&h.endpoint, &ep) {
            let _ = reject(s, &e.to_string());
            return Err(e);
        }
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let conn = match pending.complete(&h.endpoint, self.new_ctx(id, from.ip(), deadline, false))
        {
            Ok(c) => c,
            Err(e) => {
                let _ = reject(s, "connection setup failed");
                return Err(HandshakeError::Rejected {
                    reason: format!("cannot complete connection: {e}"),
                });
            }
        };
        let local_session = random_u64();
        let welcome = Frame::Welcome(Welcome {
            engine_id: self.id,
            session: local_session,
            endpoint: ep.clone(),
            regions: self.registry.exposed(),
        });
        let ready = frame::write_frame(s, &welcome)
            .and_then(|()| frame::read_frame(s, self.config.handshake_max_bytes))
            .and_then(|f| handshake::AwaitReady.handle(f));
        if let Err(e) = ready {
            conn.close();
            return Err(e);
        }
        if let Err(e) = conn.probe(deadline) {
            conn.close();
            return Err(HandshakeError::Probe {
                reason: e.to_string(),
            });
        }
        let peer = Arc::new(Peer {
            id,
            control_addr: SocketAddr::new(from.ip(), h.listen_port),
            engine_id: h.engine_id,
            initiated: false,
            remote_session: h.session,
            local_session,
            conn,
            local_ep: ep,
            remote_ep: h.endpoint,
            regions: RwLock::new(Arc::new(RemoteTable::new(h.regions))),
        });
        peer.conn.set_remote_table(&peer.table());
        if self.publish(peer).is_err() {
            return Err(self.refuse_full(s));
        }
        // Tell the initiator it is known here; its `connect` returns only then. If it
        // cannot hear that (gone, out of time), it closes its end, and the departure
        // takes this peer down too.
        if let Err(e) = frame::write_frame(s, &Frame::Ready) {
            self.unpublish(id);
            return Err(e);
        }
        tracing::info!(peer = %id, %from, "accepted");
        let _ = self.accept_tx.send(id);
        Ok(())
    }

    /// Tells an initiator we hold `max_peers` (it sees [`HandshakeError::TooManyPeers`])
    /// and closes; the error is for our log.
    fn refuse_full(&self, s: &mut Deadlined<'_>) -> HandshakeError {
        let _ = reject(s, handshake::TOO_MANY_PEERS);
        HandshakeError::Rejected {
            reason: format!(
                "{} (max_peers = {})",
                handshake::TOO_MANY_PEERS,
                self.config.max_peers
            ),
        }
    }

    fn redescribe(&self, peer: PeerId) -> Result<Vec<RemoteRegion>> {
        self.check_open()?;
        let p = self.peer(peer)?;
        let deadline = Instant::now() + self.config.handshake_timeout;
        let s = deadline::connect_by(&p.control_addr, deadline).map_err(|e| Error::Connect {
            addr: p.control_addr.to_string(),
            source: Arc::new(e),
        })?;
        let mut s = Deadlined::new(&s, deadline);
        frame::write_frame(
            &mut s,
            &Frame::Describe {
                token: self.token().to_vec(),
                session: p.remote_session,
            },
        )?;
        let regions = handshake::AwaitRegions
            .handle(frame::read_frame(&mut s, self.config.handshake_max_bytes)?)?;
        let table = Arc::new(RemoteTable::new(regions));
        let out = table.regions().to_vec();
        p.conn.set_remote_table(&table);
        *p.regions.write().unwrap_or_else(|e| e.into_inner()) = table;
        Ok(out)
    }

    fn submit(&self, peer: PeerId, batch: Batch) -> Result<TransferHandle> {
        let (p, pins, resolved, bytes) = self.resolve(peer, &batch)?;
        // The one clock read of a submission: its timestamp and a relative deadline.
        let now = Instant::now();
        let deadline = batch
            .deadline
            .map_or(now + self.config.batch_timeout, |d| d.resolve(now));
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let state = BatchState::new(
            id,
            peer,
            batch.ops.len(),
            resolved.len(),
            bytes,
            now,
            deadline,
            pins,
            self.reaper.clone(),
        );
        // A deadline that has already passed fails the batch before anything is posted
        // (backends check `is_stopped` before their first post, without a clock read).
        state.expire_if_due(now);
        let handle = TransferHandle::new(state.shared());
        p.conn.post(state, resolved, batch.notify)?;
        Ok(handle)
    }

    fn prepare(&self, peer: PeerId, batch: Batch) -> Result<PreparedBatch> {
        let (p, pins, resolved, bytes) = self.resolve(peer, &batch)?;
        // An absolute deadline cannot recur; each run gets the batch's relative one.
        let timeout = match batch.deadline {
            Some(crate::core::batch::Deadline::After(d)) => d,
            Some(crate::core::batch::Deadline::At(_)) => {
                return Err(Error::Unsupported {
                    what: "an absolute deadline on a prepared batch (use Batch::timeout)".into(),
                });
            }
            None => self.config.batch_timeout,
        };
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        Ok(PreparedBatch::new(
            peer,
            id,
            batch.ops.len(),
            bytes,
            batch.notify,
            timeout,
            resolved,
            pins,
            Arc::clone(&p.conn),
            self.reaper.clone(),
        ))
    }

    /// Checks a batch against the local registry and the peer's table: its pins, its ops
    /// resolved to keys (split at MR chunk boundaries) and its total bytes.
    #[allow(clippy::unnecessary_lazy_evaluations)] // see `peer`
    fn resolve(
        &self,
        peer: PeerId,
        batch: &Batch,
    ) -> Result<(Arc<Peer>, crate::core::batch::Pins, ResolvedOps, u64)> {
        self.check_open()?;
        // No ops is fine with a notification: the tag travels alone.
        if batch.ops.is_empty() && batch.notify.is_none() {
            return Err(Error::EmptyBatch);
        }
        let p = self.peer(peer)?;
        if p.conn.is_broken() {
            return Err(Error::peer_gone(
                peer,
                PeerFault::Disconnected,
                "connection is broken",
            ));
        }
        let table = p.table();
        let (pins, resolved, bytes) = resolve::resolve(&self.registry, &table, peer, &batch.ops)?;
        Ok((p, pins, resolved, bytes))
    }

    /// See [`Engine::shutdown`]. The order matters: first our connections are closed
    /// (their threads joined), then the backend's own threads stop (responders, the verbs
    /// completion thread), then every region is revoked and the peers' ops on it are
    /// waited for, and only then are the registrations released.
    fn shutdown(&self) {
        let mut done = self.shut.lock().unwrap_or_else(|e| e.into_inner());
        if *done {
            return;
        }
        self.shutdown.store(true, Ordering::Release);
        let peers: Vec<_> = self
            .peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in peers {
            p.conn.close();
        }
        self.backend.shutdown();
        // Wake the listener's blocking accept.
        let mut wake = self.local_addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        let t = self
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(t) = t
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
        let revoked = self.registry.revoke_all();
        // Peer ops served here stop within one slice of the revocation.
        let mut nap = Duration::from_micros(20);
        while !revoked.peers_done() {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
        for mr in revoked.into_handles() {
            self.backend.deregister(mr);
        }
        *done = true;
        tracing::debug!(engine = format_args!("{:#x}", self.id), "engine shut down");
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn listen_loop(listener: TcpListener, inner: Weak<Inner>) {
    for s in listener.incoming() {
        let Some(engine) = inner.upgrade() else {
            return;
        };
        if engine.shutdown.load(Ordering::Acquire) {
            return;
        }
        let s = match s {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "control listener accept failed");
                drop(engine);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(ticket) = engine.handshakes.admit(&s) else {
            tracing::warn!(from = ?s.peer_addr().ok(), "too many concurrent handshakes; dropping");
            let _ = s.shutdown(Shutdown::Both);
            continue;
        };
        // The handshake's one deadline starts at the accept.
        let deadline = Instant::now() + engine.config.handshake_timeout;
        let spawned = std::thread::Builder::new()
            .name("pagewire-hs".into())
            .spawn(move || {
                let _slot = ticket;
                let from = s.peer_addr().ok();
                match engine.serve(s, deadline) {
                    // Counted and logged (sparingly) where it was refused.
                    Err(HandshakeError::TokenMismatch) => {}
                    Err(e) if !engine.shutdown.load(Ordering::Acquire) => {
                        tracing::warn!(?from, error = %e, "control connection dropped");
                    }
                    _ => {}
                }
            });
        if let Err(e) = spawned {
            // The closure (and the ticket in it) was dropped: the slot is released.
            tracing::warn!(error = %e, "cannot spawn handshake thread");
        }
    }
}

/// A connection's way back to its peer's control listener, to reconnect a rail.
struct RailLink {
    engine: Weak<Inner>,
    peer: PeerId,
}

impl fmt::Debug for RailLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RailLink")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl RailControl for RailLink {
    fn reconnect(
        &self,
        rail: usize,
        ours: EndpointInfo,
        complete: &mut dyn FnMut(&EndpointInfo, Instant) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let engine = self.engine.upgrade().ok_or(Error::Shutdown)?;
        engine.check_open()?;
        let p = engine.peer(self.peer)?;
        let deadline = Instant::now() + engine.config.handshake_timeout;
        let s = deadline::connect_by(&p.control_addr, deadline).map_err(|e| Error::Connect {
            addr: p.control_addr.to_string(),
            source: Arc::new(e),
        })?;
        let _ = s.set_nodelay(true);
        let mut s = Deadlined::new(&s, deadline);
        frame::write_frame(
            &mut s,
            &Frame::Rail {
                token: engine.token().to_vec(),
                session: p.remote_session,
                rail: u8::try_from(rail).map_err(|_| Error::Unsupported {
                    what: format!("rail {rail}"),
                })?,
                endpoint: ours,
            },
        )?;
        let theirs = handshake::AwaitRailAccepted.handle(frame::read_frame(
            &mut s,
            engine.config.handshake_max_bytes,
        )?)?;
        complete(&theirs, deadline)?;
        frame::write_frame(&mut s, &Frame::Ready)?;
        Ok(())
    }
}

/// Peers whose connection still works: what `max_peers` caps. A broken one has released
/// its sockets and threads (it stays listed until `disconnect`), so a peer that left, even
/// without a goodbye, frees its slot.
fn live(peers: &PeerMap<Arc<Peer>>) -> usize {
    peers.values().filter(|p| !p.conn.is_broken()).count()
}

fn reject(s: &mut Deadlined<'_>, reason: &str) -> Result<(), HandshakeError> {
    frame::write_frame(
        s,
        &Frame::Reject {
            reason: reason.into(),
        },
    )?;
    let _ = s.stream().shutdown(Shutdown::Write);
    let _ = s.read(&mut [0u8; 64]);
    Ok(())
}
