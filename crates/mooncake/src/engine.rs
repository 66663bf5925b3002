//! The engine: one pagewire [`Engine`] with Mooncake's model on top (registered
//! buffers addressed by their start, segments, batch ids, named notifications), and
//! the thread that receives notifications.

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, select};
use pagewire_transport::{
    Access, BackendInfo, BackendKind, Engine, EngineConfig, PeerId, ProgressMode, RegionId,
};

use crate::code::{Code, Error, fail};
use crate::directory::{MetadataDirectory, SegmentDescriptor, check_name};
use crate::mailbox::{Mailbox, PeerBoxes, Tag, decode};
use crate::managed::{Block, MANAGED_CHUNK_BYTES, Managed, class_of};
use crate::segments::Segments;
use crate::transfer::Batches;
use crate::{env, lock, memcheck, random_u64, sid};

/// The handshake deadline of [`Options::default`], which also bounds
/// [`TransferEngine::send_probe`] (Mooncake's probe can block about a minute on a
/// stopped peer).
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(4);
/// Ports tried in the RPC range before giving up.
const PORT_ATTEMPTS: u64 = 64;
/// How often the worker reclaims slots and forgets broken connections.
const SWEEP: Duration = Duration::from_millis(500);
/// Longest [`TransferEngine::close`] waits for the metadata directory to withdraw the
/// segment name (a directory that does not answer lets the name expire by itself).
const WITHDRAW_WAIT: Duration = Duration::from_secs(2);
/// How long [`TransferEngine::close`] waits for the worker (it may be inside a READ of
/// a slow peer; it finishes on its own once the engine is shut down).
const WORKER_STOP_WAIT: Duration = Duration::from_millis(200);

/// How an engine is set up, beyond Mooncake's `(metadata, local_hostname)`.
#[derive(Debug, Clone)]
pub struct Options {
    /// The Python binding's `protocol`: `"rdma"` asks for verbs (TCP if no device
    /// opens), anything else TCP. `None` (the C API's auto-discovery): verbs when a
    /// device is usable, TCP otherwise. `PAGEWIRE_TRANSPORT` and `MC_FORCE_TCP` win.
    pub protocol: Option<String>,
    /// The RDMA device (the first of a comma-separated list; empty: the first usable).
    pub device: Option<String>,
    /// Pins the handshake listener; `None`: a random free port in Mooncake's RPC range
    /// ([`env::rpc_port_range`]) on the host's address when it is local, else on all
    /// interfaces.
    pub listen: Option<SocketAddr>,
    /// Connect + handshake deadline (also `send_probe`'s and name resolution's);
    /// `None`: the transport's (`PAGEWIRE_HANDSHAKE_TIMEOUT_MS`, 5 s).
    pub handshake_timeout: Option<Duration>,
    /// `MC_TRANSFER_TIMEOUT`: the deadline of the Python binding's transfers, before
    /// 1 ns per byte is added ([`env::transfer_timeout`]).
    pub transfer_timeout: Duration,
    /// How long an unregistration (and [`TransferEngine::close`], in all) waits for
    /// transfers that still use a buffer.
    pub unregister_wait: Duration,
    /// Check every registration against `/proc/self/maps`, whatever the backend. It is
    /// always checked on TCP and loopback, whose threads touch the memory; on verbs the
    /// NIC's registration refuses bad memory itself (and accepts device memory).
    pub host_memory_only: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            protocol: None,
            device: None,
            listen: None,
            handshake_timeout: Some(DEFAULT_HANDSHAKE_TIMEOUT),
            transfer_timeout: Duration::from_secs(30),
            unregister_wait: Duration::from_secs(1),
            host_memory_only: false,
        }
    }
}

/// A line about how the engine was set up (which backend and why, where it listens),
/// for the caller's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// `true` for a warning (a fallback), `false` for information.
    pub warning: bool,
    /// The text.
    pub text: String,
}

/// A buffer registered through [`TransferEngine::register`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalRegion {
    pub(crate) len: u64,
    /// `None` while the backend registers it (the range is reserved, not yet usable).
    pub(crate) id: Option<RegionId>,
}

/// Registered buffers by start address.
pub(crate) type Regions = BTreeMap<u64, LocalRegion>;

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) engine: Engine,
    pub(crate) name: String,
    /// `host:port` of the handshake listener (the name too without a directory).
    pub(crate) rpc_name: String,
    /// Where segment names are published and looked up; `None`: P2P handshake names.
    pub(crate) directory: Option<Arc<dyn MetadataDirectory>>,
    pub(crate) notes: Vec<Note>,
    pub(crate) transfer_timeout: Duration,
    pub(crate) unregister_wait: Duration,
    /// Registrations are checked against `/proc/self/maps`.
    pub(crate) check_memory: bool,
    pub(crate) mailbox: Mailbox,
    pub(crate) regions: Mutex<Regions>,
    pub(crate) segments: Mutex<Segments>,
    pub(crate) batches: Mutex<Batches>,
    pub(crate) closed: AtomicBool,
}

/// A Mooncake Transfer Engine on pagewire. See the crate documentation.
///
/// Every method takes `&self` and may be called from any thread. Dropping the engine
/// closes it.
#[derive(Debug)]
pub struct TransferEngine {
    pub(crate) inner: Arc<Inner>,
    worker: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
    /// Managed buffers' memory: a field of this struct, not of `inner`, so that it is
    /// freed after `drop` closed the engine (nothing touches it any more then).
    managed: Mutex<Managed>,
}

impl TransferEngine {
    /// Mooncake's `TransferEngine::init` (`createTransferEngine`, Python's
    /// `initialize`) in P2P handshake mode. `metadata` must be `"P2PHANDSHAKE"`: the
    /// segment name is `host:port` of this engine's handshake listener, `host` from
    /// `local_hostname` (any `:port` in it is ignored, as Mooncake does in P2P mode).
    /// A metadata server (`etcd://...`) goes through [`Self::with_directory`]
    /// (`pagewire_ha::mooncake::new_engine` picks by the address).
    pub fn new(
        metadata: &str,
        local_hostname: &str,
        opts: Options,
    ) -> Result<TransferEngine, Error> {
        if metadata != "P2PHANDSHAKE" {
            return fail(
                Code::InvalidArgument,
                format!(
                    "metadata server {metadata:?} is not supported (pagewire supports \"P2PHANDSHAKE\" and etcd://host:port)"
                ),
            );
        }
        Self::start(local_hostname, opts, None)
    }

    /// Mooncake's `TransferEngine::init` with a metadata server: the segment name is
    /// `local_hostname` itself (trimmed; Mooncake's `local_server_name`), published in
    /// `directory` with this engine's handshake address until [`Self::close`], and
    /// [`Self::open_segment`] looks peers' names up there. The listener's host is
    /// `local_hostname`'s host part, as in P2P mode. Fails when the directory does not
    /// answer within the handshake timeout or another live engine holds the name.
    pub fn with_directory(
        local_hostname: &str,
        opts: Options,
        directory: Arc<dyn MetadataDirectory>,
    ) -> Result<TransferEngine, Error> {
        Self::start(local_hostname, opts, Some(directory))
    }

    fn start(
        local_hostname: &str,
        opts: Options,
        directory: Option<Arc<dyn MetadataDirectory>>,
    ) -> Result<TransferEngine, Error> {
        if opts.protocol.as_deref() == Some("xgmi") {
            return fail(Code::InvalidArgument, "protocol \"xgmi\" is not supported");
        }
        let host = sid::host_part(local_hostname);
        if host.is_empty() {
            return fail(Code::InvalidArgument, "local hostname is empty");
        }
        if directory.is_some()
            && let Err(why) = check_name(local_hostname.trim())
        {
            return fail(Code::InvalidArgument, why);
        }
        // With a directory the name is not an address: the address peers reach is
        // published next to it, and must be one they can resolve.
        let advertised = match directory {
            Some(_) => advertised_host(
                host,
                opts.handshake_timeout.unwrap_or(DEFAULT_HANDSHAKE_TIMEOUT),
            )?,
            None => host.to_owned(),
        };
        let host = advertised.as_str();
        let (engine, notes) = open_engine(host, &opts)?;
        let mailbox = match Mailbox::new(&engine) {
            Ok(m) => m,
            Err(e) => {
                engine.shutdown();
                return Err(Error::transport("notification mailbox", e));
            }
        };
        let rpc_name = sid::join(host, engine.local_addr().port());
        let name = match directory {
            Some(_) => local_hostname.trim().to_owned(),
            None => rpc_name.clone(),
        };
        let cpu = engine.backend_kind() != BackendKind::Verbs;
        let inner = Arc::new(Inner {
            segments: Mutex::new(Segments::new(&name)),
            name,
            rpc_name,
            directory,
            notes,
            transfer_timeout: opts.transfer_timeout,
            unregister_wait: opts.unregister_wait,
            check_memory: cpu || opts.host_memory_only,
            mailbox,
            regions: Mutex::new(BTreeMap::new()),
            // A per-engine tag: another engine's batch ids are refused.
            batches: Mutex::new(Batches::new(random_u64(0) as u16)),
            closed: AtomicBool::new(false),
            engine,
        });
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        let w = inner.clone();
        let thread = std::thread::Builder::new()
            .name("pagewire-mooncake".into())
            .spawn(move || worker(&w, &stop_rx));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                inner.engine.shutdown();
                return fail(
                    Code::Context,
                    format!("spawning the notification thread: {e}"),
                );
            }
        };
        let te = TransferEngine {
            inner,
            worker: Mutex::new(Some((stop_tx, thread))),
            managed: Mutex::new(Managed::default()),
        };
        // Published last: a peer that finds the name finds a working engine.
        if let Some(d) = &te.inner.directory {
            let desc = SegmentDescriptor {
                name: te.inner.name.clone(),
                rpc: te.inner.rpc_name.clone(),
                engine_id: te.transport().id(),
                backend: te.backend_kind().to_string(),
            };
            let by = Instant::now() + te.handshake_timeout();
            if let Err(e) = d.publish(&desc, by) {
                // Not published: nothing to withdraw (dropping `te` finds it closed).
                te.close_without_directory();
                return Err(Error::directory(
                    &format!("publishing segment {:?}", desc.name),
                    e,
                ));
            }
            tracing::info!(segment = %desc.name, rpc = %desc.rpc, "published in {}", d.describe());
        }
        Ok(te)
    }

    /// Stops the engine: the notification thread, every registration (waiting up to
    /// [`Options::unregister_wait`] in all for transfers that use one), every
    /// connection; pending batches fail and every method fails from now on. When it
    /// returns, nothing of this engine touches registered memory again. Idempotent.
    pub fn close(&self) {
        if self.inner.closed.load(Ordering::Acquire) {
            return;
        }
        // Withdrawn first, so that peers stop finding an engine that is going away.
        if let Some(d) = &self.inner.directory
            && let Err(e) = d.remove(&self.inner.name, Instant::now() + WITHDRAW_WAIT)
        {
            tracing::warn!(segment = %self.inner.name, error = %e,
                "withdrawing the segment name failed; it expires with its lease");
        }
        self.close_without_directory();
    }

    /// [`Self::close`] without touching the directory.
    fn close_without_directory(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some((stop, thread)) = lock(&self.worker).take() {
            drop(stop);
            let until = Instant::now() + WORKER_STOP_WAIT;
            while !thread.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
        let deadline = Instant::now() + self.inner.unregister_wait;
        let regions = std::mem::take(&mut *lock(&self.inner.regions));
        for id in regions.values().filter_map(|r| r.id) {
            let _ = self.transport().deregister_wait(id, deadline);
        }
        lock(&self.inner.batches).clear();
        self.transport().shutdown();
    }

    /// This engine's segment name, what peers open: `host:port` (`[v6]:port`) in P2P
    /// mode, the `local_hostname` given with a metadata directory.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// `host:port` (`[v6]:port`) of the handshake listener (Mooncake's
    /// `getLocalIpAndPort`); the same as [`Self::name`] in P2P mode.
    pub fn rpc_name(&self) -> &str {
        &self.inner.rpc_name
    }

    /// Mooncake's `removeLocalSegment`: with a directory, withdraws this engine's own
    /// name (peers can no longer open it; open connections stay); any other name, and
    /// P2P mode, do nothing.
    pub fn remove_local_segment(&self, name: &str) -> Result<(), Error> {
        self.check_open()?;
        match &self.inner.directory {
            Some(d) if name == self.inner.name => d
                .remove(name, Instant::now() + self.handshake_timeout())
                .map_err(|e| Error::directory(&format!("withdrawing segment {name:?}"), e)),
            _ => Ok(()),
        }
    }

    /// The metadata directory the engine publishes in, if any.
    pub fn directory(&self) -> Option<&Arc<dyn MetadataDirectory>> {
        self.inner.directory.as_ref()
    }

    /// The handshake (RPC) port.
    pub fn rpc_port(&self) -> u16 {
        self.inner.engine.local_addr().port()
    }

    /// How the engine was set up (backend and why, fallbacks), for the caller's log.
    pub fn notes(&self) -> &[Note] {
        &self.inner.notes
    }

    /// The backend in use (never `Auto`).
    pub fn backend_kind(&self) -> BackendKind {
        self.inner.engine.backend_kind()
    }

    /// Device, MTU... of the backend in use.
    pub fn backend_info(&self) -> BackendInfo {
        self.inner.engine.backend_info()
    }

    /// The pagewire engine underneath.
    pub fn transport(&self) -> &Engine {
        &self.inner.engine
    }

    pub(crate) fn handshake_timeout(&self) -> Duration {
        self.inner.engine.config().handshake_timeout
    }

    // ------------------------------------------------------------------ memory

    /// `registerLocalMemory` / `register_memory`: registers `[addr, addr+len)`;
    /// `remote` exposes it to peers for READ and WRITE, otherwise it stays local.
    /// Mooncake's rules: zero length (or a null address) is [`Code::InvalidArgument`],
    /// any overlap with a registered buffer (the same one twice too)
    /// [`Code::AddressOverlapped`]; memory that is not readable and writable memory of
    /// this process is [`Code::InvalidArgument`] where it is checked
    /// ([`Options::host_memory_only`]).
    ///
    /// # Safety
    /// The memory stays allocated until it is unregistered or the engine closed; while
    /// registered, peers and the engine may read and write it at any time.
    pub unsafe fn register(&self, addr: u64, len: u64, remote: bool) -> Result<(), Error> {
        if addr == 0 || len == 0 {
            return fail(
                Code::InvalidArgument,
                format!("registering addr={addr:#x} len={len}: null address or zero length"),
            );
        }
        let Some(end) = addr.checked_add(len) else {
            return fail(
                Code::InvalidArgument,
                format!("addr={addr:#x} len={len} overflows"),
            );
        };
        let Ok(size) = usize::try_from(len) else {
            return fail(Code::InvalidArgument, "length does not fit this platform");
        };
        // Reserve the range, then check and register without the lock: reading the
        // maps and pinning a large buffer take long, and submits look the map up.
        {
            let mut regions = lock(&self.inner.regions);
            if let Some((&a, r)) = regions.range(..end).next_back()
                && a + r.len > addr
            {
                return fail(
                    Code::AddressOverlapped,
                    format!(
                        "[{addr:#x}, {end:#x}) overlaps the buffer registered at {a:#x} (len {})",
                        r.len
                    ),
                );
            }
            regions.insert(addr, LocalRegion { len, id: None });
        }
        let access = if remote {
            Access::ALL
        } else {
            Access::LOCAL_WRITE
        };
        let registered = if self.inner.check_memory
            && let Err(m) = memcheck::check_host_rw(addr, len)
        {
            Err(Error::new(
                Code::InvalidArgument,
                format!("registering [{addr:#x}, {end:#x}): {m}"),
            ))
        } else {
            // SAFETY: the caller keeps the memory allocated while it is registered (this
            // function's contract); where the backend's threads touch it, it was just
            // checked to be mapped read-write memory of this process.
            unsafe { self.transport().register_raw(addr as *mut u8, size, access) }
                .map_err(|e| Error::transport(&format!("registering [{addr:#x}, {end:#x})"), e))
        };
        let mut regions = lock(&self.inner.regions);
        match registered {
            Ok(id) => {
                regions.insert(addr, LocalRegion { len, id: Some(id) });
                Ok(())
            }
            Err(e) => {
                regions.remove(&addr);
                Err(e)
            }
        }
    }

    /// `registerLocalMemoryBatch` / `batch_register_memory`: Mooncake's checks over the
    /// whole list first (zero length, then overlaps inside the list), then each buffer
    /// as [`Self::register`]; all or nothing (on a failure the buffers registered by
    /// this call are unregistered again).
    ///
    /// # Safety
    /// As [`Self::register`], for every buffer.
    pub unsafe fn register_batch(&self, buffers: &[(u64, u64)], remote: bool) -> Result<(), Error> {
        let mut sorted = buffers.to_vec();
        sorted.sort_unstable();
        for (i, &(p, l)) in sorted.iter().enumerate() {
            if l == 0 {
                return fail(
                    Code::InvalidArgument,
                    format!("registering {p:#x}: zero length"),
                );
            }
            if i > 0 && sorted[i - 1].0.saturating_add(sorted[i - 1].1) > p {
                return fail(
                    Code::AddressOverlapped,
                    format!("{p:#x} overlaps another entry of the batch"),
                );
            }
        }
        for (i, &(p, l)) in buffers.iter().enumerate() {
            // SAFETY: per this function's contract.
            if let Err(e) = unsafe { self.register(p, l, remote) } {
                for &(done, _) in &buffers[..i] {
                    let _ = self.unregister(done);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// `unregisterLocalMemory` / `unregister_memory`: by the buffer's start address.
    /// Waits up to [`Options::unregister_wait`] for transfers that use it
    /// ([`Code::BatchBusy`] after that); [`Code::AddressNotRegistered`] if no buffer
    /// starts at `addr`.
    pub fn unregister(&self, addr: u64) -> Result<(), Error> {
        let id = lock(&self.inner.regions).get(&addr).and_then(|r| r.id);
        let Some(id) = id else {
            return fail(
                Code::AddressNotRegistered,
                format!("no registered buffer starts at {addr:#x}"),
            );
        };
        // Not under the lock: the wait can be long, and submits look the map up. A batch
        // submitted meanwhile pins the region, and the wait covers it.
        let until = Instant::now() + self.inner.unregister_wait;
        match self.transport().deregister_wait(id, until) {
            Ok(()) => {
                let mut regions = lock(&self.inner.regions);
                if regions.get(&addr).is_some_and(|r| r.id == Some(id)) {
                    regions.remove(&addr);
                }
                Ok(())
            }
            Err(pagewire_transport::Error::Timeout { .. }) => fail(
                Code::BatchBusy,
                format!("the buffer at {addr:#x} is still used by transfers"),
            ),
            Err(pagewire_transport::Error::UnknownRegion { .. }) => fail(
                Code::AddressNotRegistered,
                format!("the buffer at {addr:#x} was unregistered meanwhile"),
            ),
            Err(e) => Err(Error::transport(&format!("unregistering {addr:#x}"), e)),
        }
    }

    /// `unregisterLocalMemoryBatch` / `batch_unregister_memory`: every address is
    /// tried; the first failure is returned.
    pub fn unregister_batch(&self, addrs: &[u64]) -> Result<(), Error> {
        let mut first = Ok(());
        for &a in addrs {
            if let Err(e) = self.unregister(a) {
                first = first.and(Err(e));
            }
        }
        first
    }
}

impl TransferEngine {
    // ------------------------------------------------------------------ managed memory

    /// `allocate_managed_buffer`: the address of `len` bytes of zeroed memory this engine
    /// allocated and registered for remote access (Mooncake's buddy allocator, see
    /// `managed.rs`: 8 KiB .. 256 MiB blocks of 2 GiB chunks, larger requests alone).
    /// The memory stays valid until [`Self::free_managed`] (large buffers) or the
    /// engine is dropped.
    pub fn allocate_managed(&self, len: u64) -> Result<u64, Error> {
        self.check_open()?;
        let mut m = lock(&self.managed);
        let Some(class) = class_of(len) else {
            let b = self.registered_block(len)?;
            let a = b.addr();
            m.large.insert(a, b);
            return Ok(a);
        };
        m.take(class, &mut || self.registered_block(MANAGED_CHUNK_BYTES))
    }

    /// `free_managed_buffer(addr, len)`: `len` must be the length it was allocated with
    /// (it names the size class). A block returns to its free list (still registered);
    /// a large buffer is unregistered and freed. [`Code::InvalidArgument`] for an
    /// address that is not an allocated managed buffer of that size.
    pub fn free_managed(&self, addr: u64, len: u64) -> Result<(), Error> {
        let mut m = lock(&self.managed);
        match class_of(len) {
            Some(class) => m.give_back(addr, class),
            None => {
                if m.large.get(&addr).is_none_or(|b| b.len() != len) {
                    return fail(
                        Code::InvalidArgument,
                        format!(
                            "free_managed_buffer({addr:#x}, {len}): not a managed buffer of that length"
                        ),
                    );
                }
                // Freed only once nothing can touch it (a closed engine touches nothing).
                if !self.inner.closed.load(Ordering::Acquire) {
                    self.unregister(addr)?;
                }
                m.large.remove(&addr);
                Ok(())
            }
        }
    }

    /// A new block of `len` bytes, registered for remote access.
    fn registered_block(&self, len: u64) -> Result<Block, Error> {
        let b = Block::new(len).ok_or_else(|| {
            Error::new(
                Code::Memory,
                format!("managed buffer: allocating {len} bytes failed"),
            )
        })?;
        // SAFETY: the block is freed only after it is unregistered or the engine closed
        // (`free_managed`, and the field order of `TransferEngine`).
        unsafe { self.register(b.addr(), b.len(), true) }?;
        Ok(b)
    }

    /// `write_bytes_to_buffer`: copies `data` to `addr`, which with `data.len()` must lie
    /// inside one buffer registered with this engine ([`Code::AddressNotRegistered`]
    /// otherwise; Mooncake writes to any address).
    pub fn write_local(&self, addr: u64, data: &[u8]) -> Result<(), Error> {
        self.with_local(addr, data.len() as u64, |p| {
            // SAFETY: `p` starts `data.len()` bytes inside a registered buffer, which the
            // registration contract keeps allocated while the regions lock is held (an
            // unregistration takes it before the caller may free the memory).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) }
        })
    }

    /// `read_bytes_from_buffer`: `len` bytes at `addr`, inside one registered buffer as
    /// [`Self::write_local`].
    pub fn read_local(&self, addr: u64, len: u64) -> Result<Vec<u8>, Error> {
        let n = usize::try_from(len)
            .map_err(|_| Error::new(Code::InvalidArgument, "length does not fit"))?;
        let mut out = Vec::new();
        self.with_local(addr, len, |p| {
            // SAFETY: as in `write_local`: `n` bytes at `p` lie in registered memory.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(p, n) })
        })?;
        Ok(out)
    }

    /// Runs `f` on `addr` when `[addr, addr+len)` lies in one registered buffer, with
    /// the regions locked (so that it cannot be unregistered meanwhile).
    fn with_local(&self, addr: u64, len: u64, f: impl FnOnce(*mut u8)) -> Result<(), Error> {
        self.check_open()?;
        let regions = lock(&self.inner.regions);
        let inside = addr.checked_add(len).is_some_and(|end| {
            regions
                .range(..=addr)
                .next_back()
                .is_some_and(|(&a, r)| r.id.is_some() && end <= a + r.len)
        });
        if !inside {
            return fail(
                Code::AddressNotRegistered,
                format!("[{addr:#x}, +{len}) is not inside a buffer registered with this engine"),
            );
        }
        if len > 0 {
            f(addr as *mut u8);
        }
        Ok(())
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.inner.closed.load(Ordering::Acquire) {
            return fail(Code::Context, "the engine is closed");
        }
        Ok(())
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.close();
    }
}

/// Opens the transport: the backend per [`env::backend`], the listener pinned or on a
/// random free port of the RPC range.
fn open_engine(host: &str, opts: &Options) -> Result<(Engine, Vec<Note>), Error> {
    let mut notes = Vec::new();
    let (mut kind, why) = env::backend(opts.protocol.as_deref());
    let config_err = |e| Error::transport("engine configuration", e);
    // Mooncake's API polls batch status and never waits on it: a completion thread must
    // reap, whatever PAGEWIRE_PROGRESS says.
    let mut base = EngineConfig::builder()
        .with_env()
        .map_err(config_err)?
        .progress(ProgressMode::Auto);
    if let Some(t) = opts.handshake_timeout {
        base = base.handshake_timeout(t);
    }
    let within = base.clone().build().map_err(config_err)?.handshake_timeout;
    let (ip, note) = match opts.listen {
        Some(a) => (a.ip(), None),
        None => bind_ip(host, within),
    };
    if let Some(text) = note {
        notes.push(Note {
            warning: true,
            text,
        });
    }
    let (lo, hi) = env::rpc_port_range();
    let span = u64::from(hi - lo) + 1;
    let attempts = if opts.listen.is_some() {
        1
    } else {
        PORT_ATTEMPTS
    };
    let mut last_err = String::new();
    for attempt in 0..attempts {
        let addr = match opts.listen {
            Some(a) => a,
            None => {
                let a = SocketAddr::new(ip, lo + (random_u64(attempt) % span) as u16);
                // Cheap pre-check so that a taken port does not cost a device open.
                if TcpListener::bind(a).is_err() {
                    continue;
                }
                a
            }
        };
        let mut b = base.clone().backend(kind).listen(addr);
        if kind == BackendKind::Verbs
            && let Some(d) = opts
                .device
                .as_deref()
                .and_then(|d| d.split(',').map(str::trim).find(|d| !d.is_empty()))
        {
            b = b.rdma_device(d);
        }
        match Engine::new(b.build().map_err(config_err)?) {
            Ok(e) => {
                let info = e.backend_info();
                let line = match info.kind {
                    BackendKind::Verbs => format!("verbs on {} ({why})", info.device),
                    k => format!("{k} ({why})"),
                };
                notes.push(Note {
                    warning: false,
                    text: format!("transport: {line}"),
                });
                for n in &notes {
                    tracing::info!(warning = n.warning, "{}", n.text);
                }
                return Ok((e, notes));
            }
            Err(pagewire_transport::Error::Io { .. }) if opts.listen.is_none() => {
                last_err = format!("port {} taken", addr.port());
            }
            Err(e) if kind == BackendKind::Verbs => {
                notes.push(Note {
                    warning: true,
                    text: format!(
                        "protocol \"rdma\" asked for verbs, but no RDMA device opened ({e}); using TCP"
                    ),
                });
                kind = BackendKind::Tcp;
            }
            Err(e) => return Err(Error::transport("opening the engine", e)),
        }
    }
    fail(
        Code::Socket,
        format!("no free port in [{lo}, {hi}] ({last_err})"),
    )
}

/// The host a directory entry advertises: `MC_TCP_BIND_ADDRESS` when set (Mooncake's
/// setting), else the host part of `local_hostname` when it resolves, else this
/// machine's host name (`/proc/sys/kernel/hostname`) when that resolves.
fn advertised_host(host: &str, within: Duration) -> Result<String, Error> {
    if let Some(a) = env::tcp_bind_address() {
        return Ok(a);
    }
    if sid::resolve(host, 0, within).is_ok() {
        return Ok(host.to_owned());
    }
    let own = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let own = own.trim();
    if !own.is_empty() && sid::resolve(own, 0, within).is_ok() {
        return Ok(own.to_owned());
    }
    fail(
        Code::InvalidArgument,
        format!(
            "{host:?} (from the local hostname) does not resolve, nor does this machine's \
             host name: set MC_TCP_BIND_ADDRESS to the address peers reach this engine at, \
             or give it as the host part (\"10.0.0.1:prefill-0\")"
        ),
    )
}

/// The address to listen on: `host`'s (IPv4 first) when it is local, else all
/// interfaces (with a note saying so).
fn bind_ip(host: &str, within: Duration) -> (IpAddr, Option<String>) {
    let ip = match sid::resolve(host, 0, within) {
        Ok(addrs) => addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or(addrs.first())
            .map(SocketAddr::ip),
        Err(_) => None,
    };
    match ip {
        Some(ip) if TcpListener::bind((ip, 0)).is_ok() => (ip, None),
        Some(ip) => (
            Ipv4Addr::UNSPECIFIED.into(),
            Some(format!(
                "{host} ({ip}) is not a local address; listening on all interfaces"
            )),
        ),
        None => (
            Ipv4Addr::UNSPECIFIED.into(),
            Some(format!(
                "cannot resolve {host:?}; listening on all interfaces"
            )),
        ),
    }
}

/// The notification thread: reads notified slots (held back while the application's
/// queue is full, so that a receiver that never drains makes its senders run out of
/// slots instead of growing), frees slots on ACKs, reclaims stale slots, and forgets
/// broken connections that belong to no segment (accepted or replaced ones, which the
/// transport keeps listed until disconnected). Returns when `stop` fires or the engine
/// goes.
fn worker(inner: &Inner, stop: &Receiver<()>) {
    let engine = &inner.engine;
    let mailbox = &inner.mailbox;
    let notes = engine.notifications();
    let mut pending: VecDeque<(PeerId, usize, u32)> = VecDeque::new();
    let mut boxes = PeerBoxes::default();
    let mut last_sweep = Instant::now();
    loop {
        while mailbox.has_room() {
            let Some((peer, slot, generation)) = pending.pop_front() else {
                break;
            };
            if !matches!(stop.try_recv(), Err(TryRecvError::Empty)) {
                return;
            }
            if let Err(e) = mailbox.receive(engine, &mut boxes, peer, slot, generation) {
                tracing::warn!(%peer, error = %e, "notification dropped");
            }
        }
        select! {
            recv(stop) -> _ => return,
            recv(notes) -> n => match n {
                Ok(n) => match decode(n.tag) {
                    Tag::Ack { slot, generation } => mailbox.acked(n.peer, slot, generation),
                    Tag::Msg { slot, generation } => pending.push_back((n.peer, slot, generation)),
                    Tag::Other(t) => tracing::debug!(tag = t, peer = %n.peer, "foreign tag ignored"),
                },
                Err(_) => return,
            },
            recv(mailbox.woken()) -> _ => {}
            default(SWEEP) => {}
        }
        if last_sweep.elapsed() >= SWEEP {
            last_sweep = Instant::now();
            mailbox.sweep(engine);
            boxes.prune(engine);
            let current = lock(&inner.segments).peers();
            for p in engine.peers() {
                if !current.contains(&p) && !engine.peer_alive(p).unwrap_or(true) {
                    let _ = engine.disconnect(p);
                }
            }
        }
    }
}
