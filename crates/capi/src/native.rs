//! The model behind `pagewire.h`: handle tables for engines, regions, peers and batches,
//! the error enum, and the layout calls. Safe Rust on values the FFI layer has read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_layout::{Checks, Layout, LayoutError, Pool, PoolGeometry, PoolKind};
use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Engine, EngineConfig, Error, HandshakeError, Op,
    PeerId, RegionId, TransferHandle, TransferOp,
};

use crate::ffi::pagewire::pw_pool_desc;
use crate::handles::HandleTable;

/// `pw_status`: the result of every `pagewire.h` function. `PW_OK` (0) is success,
/// `PW_PENDING` (1) a batch still running; every other value is an error.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PwStatus {
    /// `PW_OK`.
    Ok = 0,
    /// `PW_PENDING`: the batch has work outstanding (not an error).
    Pending = 1,
    /// `PW_ERR_INVALID_ARGUMENT`: a null pointer, an unknown enum value, a malformed string.
    InvalidArgument = 2,
    /// `PW_ERR_BAD_HANDLE`: a handle that was never issued, was freed, or is of another kind.
    BadHandle = 3,
    /// `PW_ERR_BUFFER_TOO_SMALL`: the output did not fit (the needed size is reported).
    BufferTooSmall = 4,
    /// `PW_ERR_CONFIG`: a `PAGEWIRE_*` setting or option is out of range.
    Config = 5,
    /// `PW_ERR_BACKEND_UNAVAILABLE`: the requested backend cannot run here.
    BackendUnavailable = 6,
    /// `PW_ERR_UNSUPPORTED`: not available on this backend or build.
    Unsupported = 7,
    /// `PW_ERR_INVALID_RANGE`: zero length, or address + length overflows.
    InvalidRange = 8,
    /// `PW_ERR_UNREGISTERED`: a local range outside registered memory.
    Unregistered = 9,
    /// `PW_ERR_PERMISSION`: registered without the access the operation needs.
    Permission = 10,
    /// `PW_ERR_REGION_OVERLAP`: overlaps a registered region.
    RegionOverlap = 11,
    /// `PW_ERR_REGISTRATION`: the backend refused the registration.
    Registration = 12,
    /// `PW_ERR_REGION_BUSY`: transfers still use the region.
    RegionBusy = 13,
    /// `PW_ERR_REMOTE_OUT_OF_BOUNDS`: a remote range outside what the peer exposes.
    RemoteOutOfBounds = 14,
    /// `PW_ERR_REMOTE_PERMISSION`: the peer exposes the range without the needed access.
    RemotePermission = 15,
    /// `PW_ERR_EMPTY_BATCH`: no operation and no notification.
    EmptyBatch = 16,
    /// `PW_ERR_HANDSHAKE`: the handshake failed (refused, wrong token, garbage).
    Handshake = 17,
    /// `PW_ERR_CONNECT`: the peer could not be reached.
    Connect = 18,
    /// `PW_ERR_PEER_GONE`: the connection broke.
    PeerGone = 19,
    /// `PW_ERR_REMOTE_REFUSED`: the peer refused an operation.
    RemoteRefused = 20,
    /// `PW_ERR_TIMEOUT`: a deadline passed.
    Timeout = 21,
    /// `PW_ERR_CANCELLED`: the batch was cancelled.
    Cancelled = 22,
    /// `PW_ERR_DEVICE`: the RDMA device failed (a work completion error, a verbs call).
    Device = 23,
    /// `PW_ERR_IO`: an operating-system I/O error.
    Io = 24,
    /// `PW_ERR_SHUTDOWN`: the engine was freed.
    Shutdown = 25,
    /// `PW_ERR_LAYOUT`: a pool description or page list was refused.
    Layout = 26,
    /// `PW_ERR_INTERNAL`: a bug (a caught panic).
    Internal = 27,
    /// `PW_ERR_TOO_MANY_PEERS`: the engine holds its maximum of peers (`max_peers`);
    /// disconnect one first.
    TooManyPeers = 28,
}

impl PwStatus {
    /// Every status, in numeric order (its index is its value).
    pub const ALL: [PwStatus; 29] = [
        PwStatus::Ok,
        PwStatus::Pending,
        PwStatus::InvalidArgument,
        PwStatus::BadHandle,
        PwStatus::BufferTooSmall,
        PwStatus::Config,
        PwStatus::BackendUnavailable,
        PwStatus::Unsupported,
        PwStatus::InvalidRange,
        PwStatus::Unregistered,
        PwStatus::Permission,
        PwStatus::RegionOverlap,
        PwStatus::Registration,
        PwStatus::RegionBusy,
        PwStatus::RemoteOutOfBounds,
        PwStatus::RemotePermission,
        PwStatus::EmptyBatch,
        PwStatus::Handshake,
        PwStatus::Connect,
        PwStatus::PeerGone,
        PwStatus::RemoteRefused,
        PwStatus::Timeout,
        PwStatus::Cancelled,
        PwStatus::Device,
        PwStatus::Io,
        PwStatus::Shutdown,
        PwStatus::Layout,
        PwStatus::Internal,
        PwStatus::TooManyPeers,
    ];

    /// The status with this value, if any.
    pub fn from_raw(v: i32) -> Option<PwStatus> {
        usize::try_from(v)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
    }

    /// The C name's description (`pw_status_str`), NUL-terminated.
    pub fn describe(self) -> &'static std::ffi::CStr {
        match self {
            PwStatus::Ok => c"ok",
            PwStatus::Pending => c"pending",
            PwStatus::InvalidArgument => c"invalid argument",
            PwStatus::BadHandle => c"bad handle (never issued, freed, or of another kind)",
            PwStatus::BufferTooSmall => c"output buffer too small",
            PwStatus::Config => c"invalid configuration",
            PwStatus::BackendUnavailable => c"backend unavailable",
            PwStatus::Unsupported => c"unsupported",
            PwStatus::InvalidRange => c"invalid range",
            PwStatus::Unregistered => c"local range not registered",
            PwStatus::Permission => c"local region lacks the needed access",
            PwStatus::RegionOverlap => c"region overlaps a registered region",
            PwStatus::Registration => c"registration failed",
            PwStatus::RegionBusy => c"region busy",
            PwStatus::RemoteOutOfBounds => c"remote range outside the peer's exposed memory",
            PwStatus::RemotePermission => c"remote range lacks the needed access",
            PwStatus::EmptyBatch => c"empty batch",
            PwStatus::Handshake => c"handshake failed",
            PwStatus::Connect => c"connect failed",
            PwStatus::PeerGone => c"peer gone",
            PwStatus::RemoteRefused => c"peer refused the operation",
            PwStatus::Timeout => c"timed out",
            PwStatus::Cancelled => c"cancelled",
            PwStatus::Device => c"device error",
            PwStatus::Io => c"i/o error",
            PwStatus::Shutdown => c"engine shut down",
            PwStatus::Layout => c"layout error",
            PwStatus::Internal => c"internal error",
            PwStatus::TooManyPeers => c"too many peers",
        }
    }

    /// The status for a transport error (recording its text as the last error).
    pub(crate) fn from_err(e: &Error) -> PwStatus {
        crate::set_last_error(e);
        match e {
            Error::Config { .. } => PwStatus::Config,
            Error::BackendUnavailable { .. } => PwStatus::BackendUnavailable,
            Error::Unsupported { .. } => PwStatus::Unsupported,
            Error::InvalidRange { .. } => PwStatus::InvalidRange,
            Error::Unregistered { .. } => PwStatus::Unregistered,
            Error::PermissionDenied { .. } => PwStatus::Permission,
            Error::RegionOverlap { .. } => PwStatus::RegionOverlap,
            Error::Registration { .. } => PwStatus::Registration,
            Error::UnknownRegion { .. } | Error::UnknownPeer { .. } => PwStatus::BadHandle,
            Error::RegionBusy { .. } => PwStatus::RegionBusy,
            Error::RemoteOutOfBounds { .. } => PwStatus::RemoteOutOfBounds,
            Error::RemotePermission { .. } => PwStatus::RemotePermission,
            Error::EmptyBatch => PwStatus::EmptyBatch,
            Error::Handshake(HandshakeError::Io { .. }) => PwStatus::Connect,
            Error::Handshake(_) => PwStatus::Handshake,
            Error::Connect { .. } => PwStatus::Connect,
            Error::PeerGone { .. } => PwStatus::PeerGone,
            Error::Remote { .. } => PwStatus::RemoteRefused,
            Error::Timeout { .. } => PwStatus::Timeout,
            Error::Cancelled => PwStatus::Cancelled,
            Error::Completion { .. } | Error::Verbs { .. } => PwStatus::Device,
            Error::Io { .. } => PwStatus::Io,
            Error::Shutdown => PwStatus::Shutdown,
            Error::TooManyPeers { .. } => PwStatus::TooManyPeers,
            _ => PwStatus::Internal,
        }
    }

    /// `Err(status)` with `msg` as the last error.
    pub(crate) fn fail<T>(self, msg: impl std::fmt::Display) -> Result<T, PwStatus> {
        crate::set_last_error(msg);
        Err(self)
    }
}

/// Result of the model's functions.
pub(crate) type PwResult<T> = Result<T, PwStatus>;

/// An engine of the native API.
#[derive(Debug)]
pub(crate) struct NEngine {
    pub engine: Engine,
    open: AtomicBool,
    cpu_backend: bool,
}

impl NEngine {
    fn check_open(&self) -> PwResult<()> {
        if self.open.load(Ordering::Acquire) {
            Ok(())
        } else {
            PwStatus::Shutdown.fail("the engine was freed")
        }
    }
}

#[derive(Debug)]
pub(crate) struct NRegion {
    engine: Arc<NEngine>,
    id: RegionId,
}

#[derive(Debug)]
pub(crate) struct NPeer {
    engine: Arc<NEngine>,
    pub peer: PeerId,
}

/// A batch: ops being built, then the submitted transfer.
#[derive(Debug, Default)]
pub(crate) struct NBatch {
    ops: Vec<TransferOp>,
    notify: Option<u32>,
    timeout: Option<Duration>,
    running: Option<TransferHandle>,
}

static ENGINES: Mutex<HandleTable<Arc<NEngine>>> = Mutex::new(HandleTable::new(0x7065));
static REGIONS: Mutex<HandleTable<NRegion>> = Mutex::new(HandleTable::new(0x7072));
static PEERS: Mutex<HandleTable<NPeer>> = Mutex::new(HandleTable::new(0x7070));
static BATCHES: Mutex<HandleTable<Arc<Mutex<NBatch>>>> = Mutex::new(HandleTable::new(0x7062));

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn bad_handle<T>(what: &str) -> PwResult<T> {
    PwStatus::BadHandle.fail(format_args!("unknown or freed {what} handle"))
}

fn insert<T>(table: &Mutex<HandleTable<T>>, v: T) -> PwResult<u64> {
    match lock(table).insert(v) {
        Some(t) => Ok(t),
        None => PwStatus::Internal.fail("too many live handles"),
    }
}

fn deadline_after(ms: u32) -> Instant {
    Instant::now() + Duration::from_millis(u64::from(ms))
}

// ------------------------------------------------------------------------- engines

/// `pw_engine_new`.
pub(crate) fn engine_new(backend: Option<&str>, listen: Option<&str>) -> PwResult<u64> {
    let mut b = EngineConfig::builder()
        .with_env()
        .map_err(|e| PwStatus::from_err(&e))?;
    if let Some(s) = backend {
        b = b.backend(s.parse().map_err(|e: Error| PwStatus::from_err(&e))?);
    }
    if let Some(s) = listen {
        match s.parse() {
            Ok(a) => b = b.listen(a),
            Err(_) => {
                return PwStatus::InvalidArgument.fail(format_args!("listen {s:?} is not ip:port"));
            }
        }
    }
    let cfg = b.build().map_err(|e| PwStatus::from_err(&e))?;
    let engine = Engine::new(cfg).map_err(|e| PwStatus::from_err(&e))?;
    let cpu_backend = engine.backend_kind() != BackendKind::Verbs;
    let ne = Arc::new(NEngine {
        engine,
        open: AtomicBool::new(true),
        cpu_backend,
    });
    insert(&ENGINES, ne.clone()).inspect_err(|_| ne.engine.shutdown())
}

pub(crate) fn engine(token: u64) -> PwResult<Arc<NEngine>> {
    match lock(&ENGINES).get(token) {
        Some(e) => Ok(e.clone()),
        None => bad_handle("engine"),
    }
}

/// `pw_engine_free`: shuts the engine down; its regions, peers and batches stay valid
/// handles that report `PW_ERR_SHUTDOWN` until freed.
pub(crate) fn engine_free(token: u64) -> PwResult<()> {
    let Some(e) = lock(&ENGINES).remove(token) else {
        return bad_handle("engine");
    };
    e.open.store(false, Ordering::Release);
    e.engine.shutdown();
    Ok(())
}

// ------------------------------------------------------------------------- regions

/// `pw_region_register`.
pub(crate) fn region_register(engine_t: u64, addr: u64, len: u64, access: u32) -> PwResult<u64> {
    let e = engine(engine_t)?;
    e.check_open()?;
    let Some(access) = u8::try_from(access).ok().and_then(Access::from_bits) else {
        return PwStatus::InvalidArgument.fail(format_args!("unknown access bits {access:#x}"));
    };
    if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
        return PwStatus::InvalidRange.fail(format_args!("invalid range addr={addr:#x} len={len}"));
    }
    if e.cpu_backend
        && let Err(why) = pagewire_mooncake::memcheck::check_host_rw(addr, len)
    {
        return PwStatus::InvalidRange.fail(format_args!(
            "addr={addr:#x} len={len} is not readable and writable memory of this process: {why}"
        ));
    }
    let Ok(n) = usize::try_from(len) else {
        return PwStatus::InvalidRange.fail("length does not fit this platform");
    };
    // SAFETY: the C caller promises (pagewire.h) that the range stays allocated until the
    // region is deregistered or the engine freed; on the CPU backends it was just checked
    // to be mapped read-write memory.
    let id = unsafe { e.engine.register_raw(addr as *mut u8, n, access) }
        .map_err(|err| PwStatus::from_err(&err))?;
    insert(
        &REGIONS,
        NRegion {
            engine: e.clone(),
            id,
        },
    )
    .inspect_err(|_| {
        let _ = e.engine.deregister(id);
    })
}

/// `pw_region_deregister`: waits up to `timeout_ms` for batches that use it.
pub(crate) fn region_deregister(token: u64, timeout_ms: u32) -> PwResult<()> {
    let (engine, id) = match lock(&REGIONS).get(token) {
        Some(r) => (r.engine.clone(), r.id),
        None => return bad_handle("region"),
    };
    if engine.open.load(Ordering::Acquire) {
        engine
            .engine
            .deregister_wait(id, deadline_after(timeout_ms))
            .map_err(|e| PwStatus::from_err(&e))?;
    }
    lock(&REGIONS).remove(token);
    Ok(())
}

// ------------------------------------------------------------------------- peers

/// `pw_peer_connect`.
pub(crate) fn peer_connect(engine_t: u64, addr: &str) -> PwResult<u64> {
    let e = engine(engine_t)?;
    e.check_open()?;
    let (host, port) = match pagewire_mooncake::sid::parse(addr) {
        Ok(hp) => hp,
        Err(why) => {
            return PwStatus::InvalidArgument
                .fail(format_args!("{addr:?} is not host:port: {why}"));
        }
    };
    let peer = e
        .engine
        .connect((host, port))
        .map_err(|err| PwStatus::from_err(&err))?;
    insert(
        &PEERS,
        NPeer {
            engine: e.clone(),
            peer,
        },
    )
    .inspect_err(|_| {
        let _ = e.engine.disconnect(peer);
    })
}

/// `pw_peer_accept`.
pub(crate) fn peer_accept(engine_t: u64, timeout_ms: u32) -> PwResult<u64> {
    let e = engine(engine_t)?;
    e.check_open()?;
    match e.engine.accept(deadline_after(timeout_ms)) {
        Some(peer) => insert(&PEERS, NPeer { engine: e, peer }),
        None => PwStatus::Timeout.fail("no peer connected in time"),
    }
}

fn peer(token: u64) -> PwResult<(Arc<NEngine>, PeerId)> {
    match lock(&PEERS).get(token) {
        Some(p) => Ok((p.engine.clone(), p.peer)),
        None => bad_handle("peer"),
    }
}

/// `pw_peer_id`: the peer's number (as in notifications).
pub(crate) fn peer_id(token: u64) -> PwResult<u64> {
    Ok(peer(token)?.1.get())
}

/// `pw_peer_refresh`: fetches the peer's exposed regions again.
pub(crate) fn peer_refresh(token: u64) -> PwResult<()> {
    let (e, p) = peer(token)?;
    e.check_open()?;
    e.engine
        .redescribe(p)
        .map(drop)
        .map_err(|err| PwStatus::from_err(&err))
}

/// `pw_peer_close`: disconnects (pending batches fail) and frees the handle.
pub(crate) fn peer_close(token: u64) -> PwResult<()> {
    let Some(p) = lock(&PEERS).remove(token) else {
        return bad_handle("peer");
    };
    if p.engine.open.load(Ordering::Acquire) {
        let _ = p.engine.engine.disconnect(p.peer);
    }
    Ok(())
}

// ------------------------------------------------------------------------- notifications

/// `pw_engine_poll_notification`: `(peer number, tag)`.
pub(crate) fn poll_notification(engine_t: u64, timeout_ms: u32) -> PwResult<(u64, u32)> {
    let e = engine(engine_t)?;
    e.check_open()?;
    match e.engine.poll_notification(deadline_after(timeout_ms)) {
        Some(n) => Ok((n.peer.get(), n.tag)),
        None => PwStatus::Timeout.fail("no notification in time"),
    }
}

/// `pw_engine_progress`.
pub(crate) fn progress(engine_t: u64) -> PwResult<usize> {
    let e = engine(engine_t)?;
    e.check_open()?;
    Ok(e.engine.reap())
}

// ------------------------------------------------------------------------- batches

/// `pw_batch_new`.
pub(crate) fn batch_new() -> PwResult<u64> {
    insert(&BATCHES, Arc::new(Mutex::new(NBatch::default())))
}

fn batch(token: u64) -> PwResult<Arc<Mutex<NBatch>>> {
    match lock(&BATCHES).get(token) {
        Some(b) => Ok(b.clone()),
        None => bad_handle("batch"),
    }
}

/// Runs `f` on a batch that is not running (building it).
fn with_idle<R>(token: u64, f: impl FnOnce(&mut NBatch) -> PwResult<R>) -> PwResult<R> {
    let b = batch(token)?;
    let mut b = lock(&b);
    if b.running
        .as_ref()
        .is_some_and(|h| matches!(h.status(), BatchStatus::Pending))
    {
        return PwStatus::Pending.fail("the batch is running");
    }
    f(&mut b)
}

/// Largest number of ops in one native batch.
const MAX_OPS: usize = 1 << 22;

/// `pw_batch_add`.
pub(crate) fn batch_add(token: u64, op: u32, local: u64, remote: u64, len: u64) -> PwResult<()> {
    let op = match op {
        0 => Op::Read,
        1 => Op::Write,
        _ => return PwStatus::InvalidArgument.fail(format_args!("unknown op {op}")),
    };
    with_idle(token, |b| {
        if b.ops.len() >= MAX_OPS {
            return PwStatus::InvalidArgument.fail("too many ops in one batch");
        }
        b.ops.push(TransferOp {
            op,
            local,
            remote,
            len,
        });
        Ok(())
    })
}

/// `pw_batch_set_notify`.
pub(crate) fn batch_set_notify(token: u64, tag: u32) -> PwResult<()> {
    with_idle(token, |b| {
        b.notify = Some(tag);
        Ok(())
    })
}

/// `pw_batch_set_timeout` (0 = the engine's default).
pub(crate) fn batch_set_timeout(token: u64, ms: u32) -> PwResult<()> {
    with_idle(token, |b| {
        b.timeout = (ms > 0).then(|| Duration::from_millis(u64::from(ms)));
        Ok(())
    })
}

/// `pw_batch_reset`: empties a batch that is not running.
pub(crate) fn batch_reset(token: u64) -> PwResult<()> {
    with_idle(token, |b| {
        *b = NBatch::default();
        Ok(())
    })
}

/// `pw_batch_submit`: validates every op, then posts (nothing moves on error).
pub(crate) fn batch_submit(token: u64, peer_t: u64) -> PwResult<()> {
    let (e, p) = peer(peer_t)?;
    e.check_open()?;
    with_idle(token, |b| {
        let mut batch: Batch = b.ops.iter().copied().collect();
        if let Some(t) = b.notify {
            batch = batch.notify(t);
        }
        if let Some(d) = b.timeout {
            batch = batch.timeout(d);
        }
        let h = e
            .engine
            .submit(p, batch)
            .map_err(|err| PwStatus::from_err(&err))?;
        b.running = Some(h);
        Ok(())
    })
}

fn outcome(h: &TransferHandle) -> PwResult<()> {
    match h.status() {
        BatchStatus::Pending => Err(PwStatus::Pending),
        BatchStatus::Done => Ok(()),
        BatchStatus::Failed(e) => Err(PwStatus::from_err(&e)),
        BatchStatus::Cancelled => PwStatus::Cancelled.fail("the batch was cancelled"),
        _ => PwStatus::Internal.fail("unknown batch status"),
    }
}

fn running(token: u64) -> PwResult<TransferHandle> {
    let b = batch(token)?;
    let b = lock(&b);
    match &b.running {
        Some(h) => Ok(h.clone()),
        None => PwStatus::InvalidArgument.fail("the batch was not submitted"),
    }
}

/// `pw_batch_status`: `PW_OK` done, `PW_PENDING`, or the failure. Never blocks.
pub(crate) fn batch_status(token: u64) -> PwResult<()> {
    outcome(&running(token)?)
}

/// `pw_batch_wait`: blocks up to `timeout_ms`; `PW_PENDING` if still running then.
pub(crate) fn batch_wait(token: u64, timeout_ms: u32) -> PwResult<()> {
    let h = running(token)?;
    match h.wait(deadline_after(timeout_ms)) {
        Ok(_) => Ok(()),
        Err(Error::Timeout { .. }) if matches!(h.status(), BatchStatus::Pending) => {
            Err(PwStatus::Pending)
        }
        Err(e) => Err(PwStatus::from_err(&e)),
    }
}

/// `pw_batch_cancel`.
pub(crate) fn batch_cancel(token: u64) -> PwResult<()> {
    running(token)?.cancel();
    Ok(())
}

/// `pw_batch_bytes_done`.
pub(crate) fn batch_bytes_done(token: u64) -> PwResult<u64> {
    Ok(running(token)?.bytes_done())
}

/// `pw_batch_free`: a running batch carries on (its memory stays pinned until it ends).
pub(crate) fn batch_free(token: u64) -> PwResult<()> {
    match lock(&BATCHES).remove(token) {
        Some(_) => Ok(()),
        None => bad_handle("batch"),
    }
}

// ------------------------------------------------------------------------- layout

fn layout_err(e: LayoutError) -> PwStatus {
    crate::set_last_error(e);
    PwStatus::Layout
}

impl pw_pool_desc {
    /// Builds the pool (a field of 0 is not given), or `PW_ERR_LAYOUT` /
    /// `PW_ERR_INVALID_ARGUMENT` with the reason.
    pub(crate) fn pool(&self) -> PwResult<Pool> {
        let kind = match self.kind {
            0 => PoolKind::Mha,
            1 => PoolKind::MhaSplit,
            2 => PoolKind::Mla,
            k => return PwStatus::InvalidArgument.fail(format_args!("unknown pool kind {k}")),
        };
        let layout = match self.layout {
            0 => Layout::LayerFirst,
            1 => Layout::PageFirst,
            2 => Layout::PageFirstDirect,
            3 => Layout::PageHead,
            l => return PwStatus::InvalidArgument.fail(format_args!("unknown layout {l}")),
        };
        let mut g = PoolGeometry::builder(kind)
            .layers(self.layers)
            .page_size(self.page_size)
            .dtype_bytes(self.dtype_bytes)
            .capacity(self.capacity);
        let opt = |v: u64| (v != 0).then_some(v);
        if let Some(v) = opt(self.heads) {
            g = g.heads(v);
        }
        if let Some(v) = opt(self.head_dim) {
            g = g.head_dim(v);
        }
        if let Some(v) = opt(self.v_head_dim) {
            g = g.v_head_dim(v);
        }
        if let Some(v) = opt(self.kv_dim) {
            g = g.kv_dim(v);
        }
        let g = g.build().map_err(layout_err)?;
        let v = (self.has_v_base != 0).then_some(self.v_base);
        let checks = if self.checks == 1 {
            Checks::Sglang
        } else {
            Checks::Strict
        };
        Ok(Pool::new(g, layout, self.base, v)
            .map_err(layout_err)?
            .with_checks(checks))
    }
}

/// `pw_page_meta` (token slot indices) or `pw_page_meta_for_pages` (page indices).
pub(crate) fn page_meta(
    desc: &pw_pool_desc,
    indices: &[u64],
    pages: bool,
) -> PwResult<(Vec<u64>, Vec<u64>)> {
    let pool = desc.pool()?;
    let segs = if pages {
        pool.page_meta_for_pages(indices)
    } else {
        pool.page_meta(indices)
    }
    .map_err(layout_err)?;
    Ok((segs.ptrs, segs.lens))
}

/// `pw_plan`: `(srcs, dsts, lens)` moving `src_pages` of `src` to `dst_pages` of `dst`.
pub(crate) fn plan(
    src: &pw_pool_desc,
    dst: &pw_pool_desc,
    src_pages: &[u64],
    dst_pages: &[u64],
) -> PwResult<(Vec<u64>, Vec<u64>, Vec<u64>)> {
    let (s, d) = (src.pool()?, dst.pool()?);
    let p = pagewire_layout::plan(&s, &d, src_pages, dst_pages).map_err(layout_err)?;
    Ok(p.into_parts())
}
