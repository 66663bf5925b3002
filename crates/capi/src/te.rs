//! The engine behind `transfer_engine_c.h`: Mooncake's model (segments, registered
//! buffers addressed by their start, batch ids with per-task status, named
//! notifications) on top of one pagewire [`Engine`].
//!
//! Everything here is safe Rust on values the FFI layer has already read and checked;
//! it returns Mooncake's codes ([`Code`]).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Engine, EngineConfig, Op, PeerId, ProgressMode,
    RegionId, RemoteRegion, TransferHandle, TransferOp,
};

use crate::codes::Code;
use crate::ffi::mooncake::{STATUS_CANCELED, STATUS_COMPLETED, STATUS_FAILED, STATUS_WAITING};
use crate::handles::HandleTable;
use crate::mailbox::Mailbox;

/// `LOCAL_SEGMENT`: this engine itself.
pub(crate) const LOCAL_SEGMENT: i32 = 0;
/// Largest batch capacity `allocateBatchID` accepts.
pub(crate) const MAX_BATCH_SIZE: usize = 1 << 20;
/// Most segments open at once on one engine.
const MAX_SEGMENTS: usize = 1 << 16;
/// How long `unregisterLocalMemory` waits for batches that still use the buffer.
const UNREGISTER_WAIT: Duration = Duration::from_secs(1);
/// How long a sender waits for a free notification slot.
const SLOT_WAIT: Duration = Duration::from_secs(1);
/// Shortest time between two re-describes of one segment triggered by submits.
const REFRESH_GAP: Duration = Duration::from_millis(100);
/// Name resolutions running at once (each on its own thread, so a slow resolver cannot
/// hold a caller past its deadline).
const MAX_RESOLVERS: usize = 8;
static RESOLVERS: AtomicUsize = AtomicUsize::new(0);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `Err(code)`, with `msg` as the thread's last error.
fn fail<T>(code: Code, msg: impl std::fmt::Display) -> Result<T, Code> {
    crate::set_last_error(msg);
    Err(code)
}

/// One entry of a `submitTransfer` call, as read from `struct transfer_request`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    pub opcode: i32,
    pub source: u64,
    pub target_id: i32,
    pub target_offset: u64,
    pub length: u64,
}

#[derive(Debug, Clone, Copy)]
struct LocalRegion {
    len: u64,
    /// `None` while the backend registers it (the range is reserved, not yet usable).
    id: Option<RegionId>,
}

#[derive(Debug, Clone)]
struct Segment {
    name: String,
    peer: Option<PeerId>,
    /// The peer's exposed regions, sorted, as last described.
    regions: Arc<Vec<RemoteRegion>>,
    /// When a submit last asked the peer again (at most one such re-describe per
    /// `REFRESH_GAP`, so out-of-range submits cannot flood the peer's control port).
    refreshed: Option<Instant>,
}

#[derive(Debug)]
struct Segments {
    by_name: HashMap<String, i32>,
    by_id: HashMap<i32, Segment>,
    next_id: i32,
}

/// Index of the task's transport batch in [`TeBatch::subs`]; `NONE` for a zero-length
/// task, which is complete from the start.
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Task {
    sub: u32,
    len: u64,
}

#[derive(Debug)]
struct TeBatch {
    capacity: usize,
    tasks: Vec<Task>,
    subs: Vec<TransferHandle>,
}

/// A `transfer_engine_t`.
#[derive(Debug)]
pub(crate) struct TeEngine {
    engine: Engine,
    name: String,
    mailbox: Arc<Mailbox>,
    mailbox_thread: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
    regions: Mutex<BTreeMap<u64, LocalRegion>>,
    segments: Mutex<Segments>,
    batches: Mutex<HandleTable<Arc<Mutex<TeBatch>>>>,
    /// The backend moves bytes with the CPU (TCP, loopback): registrations are checked
    /// to be host memory.
    cpu_backend: bool,
}

/// Splits `host:port` / `[v6]:port`; the port is optional when `need_port` is false.
pub(crate) fn split_host_port(s: &str, need_port: bool) -> Option<(String, Option<u16>)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']')?;
        let port = match tail {
            "" => None,
            t => Some(t.strip_prefix(':')?.parse().ok()?),
        };
        if host.is_empty() || (need_port && port.is_none()) {
            return None;
        }
        return Some((host.to_owned(), port));
    }
    match s.rsplit_once(':') {
        // Bare IPv6 (more than one colon) has no port.
        Some((h, _)) if h.contains(':') => {
            (!need_port && s.parse::<IpAddr>().is_ok()).then(|| (s.to_owned(), None))
        }
        Some((h, p)) => {
            let port: u16 = p.parse().ok()?;
            (!h.is_empty()).then(|| (h.to_owned(), Some(port)))
        }
        None => (!need_port && !s.is_empty()).then(|| (s.to_owned(), None)),
    }
}

/// Resolves `host` with a deadline: IP literals at once, names on a helper thread.
fn resolve(host: &str, port: u16, within: Duration) -> Result<Vec<SocketAddr>, Code> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    if RESOLVERS.fetch_add(1, Ordering::AcqRel) >= MAX_RESOLVERS {
        RESOLVERS.fetch_sub(1, Ordering::AcqRel);
        return Err(Code::Dns);
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    let h = host.to_owned();
    let spawned = std::thread::Builder::new()
        .name("pagewire-resolve".into())
        .spawn(move || {
            let r = (h.as_str(), port)
                .to_socket_addrs()
                .map(|a| a.collect::<Vec<_>>());
            RESOLVERS.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send(r);
        });
    if spawned.is_err() {
        RESOLVERS.fetch_sub(1, Ordering::AcqRel);
        return Err(Code::Dns);
    }
    match rx.recv_timeout(within) {
        Ok(Ok(v)) if !v.is_empty() => Ok(v),
        _ => Err(Code::Dns),
    }
}

/// Whether `[addr, addr+len)` is covered by `regions` (sorted) with `need`, across
/// adjacent regions.
fn remote_covered(regions: &[RemoteRegion], addr: u64, len: u64, need: Access) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let mut at = addr;
    let mut i = regions.partition_point(|r| r.end() <= at);
    while at < end {
        let Some(r) = regions.get(i) else {
            return false;
        };
        if r.addr > at || !r.access.contains(need) {
            return false;
        }
        at = r.end();
        i += 1;
    }
    true
}

fn sorted(mut v: Vec<RemoteRegion>) -> Arc<Vec<RemoteRegion>> {
    v.sort_by_key(|r| r.addr);
    Arc::new(v)
}

impl TeEngine {
    /// `createTransferEngine`. Only the P2P handshake metadata mode exists: the segment
    /// name is `host:port` of this engine's control listener.
    pub(crate) fn create(metadata: &str, local_server_name: &str) -> Result<Arc<TeEngine>, Code> {
        if metadata != "P2PHANDSHAKE" {
            return Err(Code::InvalidArgument);
        }
        let (host, _port) =
            split_host_port(local_server_name, false).ok_or(Code::InvalidArgument)?;
        let mut b = EngineConfig::builder();
        if std::env::var("MC_FORCE_TCP").is_ok_and(|v| !v.is_empty() && v != "0") {
            b = b.backend(BackendKind::Tcp);
        }
        let b = b.with_env().map_err(|_| Code::InvalidArgument)?;
        let probe = b.clone().build().map_err(|_| Code::InvalidArgument)?;
        // Mooncake picks a free port in P2P mode whatever the name says; PAGEWIRE_LISTEN
        // pins the listener when it is set.
        let listen = if std::env::var_os("PAGEWIRE_LISTEN").is_some() {
            probe.listen
        } else {
            let ip = resolve(&host, 0, probe.handshake_timeout)?
                .first()
                .ok_or(Code::Dns)?
                .ip();
            SocketAddr::new(ip, 0)
        };
        // Batch status is polled, never waited on: a completion thread must reap.
        let config = b
            .listen(listen)
            .progress(ProgressMode::Auto)
            .build()
            .map_err(|_| Code::InvalidArgument)?;
        let engine = Engine::new(config).map_err(|e| Code::from_err(&e))?;
        let port = engine.local_addr().port();
        let name = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let mailbox = match Mailbox::new(&engine) {
            Ok(m) => m,
            Err(e) => {
                engine.shutdown();
                return Err(Code::from_err(&e));
            }
        };
        let cpu_backend = engine.backend_kind() != BackendKind::Verbs;
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(1);
        let m = mailbox.clone();
        let thread = std::thread::Builder::new()
            .name("pagewire-mailbox".into())
            .spawn(move || m.run(stop_rx));
        let thread = match thread {
            Ok(t) => t,
            Err(_) => {
                engine.shutdown();
                return Err(Code::Context);
            }
        };
        let mut by_name = HashMap::new();
        by_name.insert(name.clone(), LOCAL_SEGMENT);
        let mut by_id = HashMap::new();
        by_id.insert(
            LOCAL_SEGMENT,
            Segment {
                name: name.clone(),
                peer: None,
                regions: Arc::new(Vec::new()),
                refreshed: None,
            },
        );
        Ok(Arc::new(TeEngine {
            engine,
            name,
            mailbox,
            mailbox_thread: Mutex::new(Some((stop_tx, thread))),
            regions: Mutex::new(BTreeMap::new()),
            segments: Mutex::new(Segments {
                by_name,
                by_id,
                next_id: 1,
            }),
            // A per-engine magic: another engine's batch ids are refused.
            batches: Mutex::new(HandleTable::new(crate::random_u16())),
            cpu_backend,
        }))
    }

    /// `destroyTransferEngine`: stops the mailbox thread, lets go of every buffer
    /// (waiting up to a second for batches that still use one), then shuts the engine
    /// down; pending batches fail.
    pub(crate) fn destroy(&self) {
        if let Some((stop, thread)) = lock(&self.mailbox_thread).take() {
            let _ = stop.send(());
            // The thread may be inside a READ or a re-describe of a slow peer: wait a
            // little, then leave it. It holds its own reference to the mailbox, so the
            // memory outlives it, and after the shutdown below its calls fail at once.
            let until = Instant::now() + Duration::from_millis(200);
            while !thread.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
        let deadline = Instant::now() + UNREGISTER_WAIT;
        let regions = std::mem::take(&mut *lock(&self.regions));
        for id in regions.values().filter_map(|r| r.id) {
            let _ = self.engine.deregister_wait(id, deadline);
        }
        let mailbox_free = self.mailbox.close(deadline);
        lock(&self.batches).drain();
        self.engine.shutdown();
        if !mailbox_free {
            // Something may still touch the mailbox memory: never free it.
            std::mem::forget(self.mailbox.clone());
        }
    }

    /// This engine's segment name (`host:port`).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The pagewire engine.
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    // ------------------------------------------------------------------ memory

    /// `registerLocalMemory`: remote-accessible buffers are exposed for READ and WRITE.
    pub(crate) fn register(&self, addr: u64, len: u64, remote: bool) -> Result<(), Code> {
        if addr == 0 || len == 0 {
            return fail(
                Code::InvalidArgument,
                format_args!("registering addr={addr:#x} len={len}: null address or zero length"),
            );
        }
        let Some(end) = addr.checked_add(len) else {
            return fail(
                Code::InvalidArgument,
                format_args!("addr={addr:#x} len={len} overflows"),
            );
        };
        if self.cpu_backend && !crate::memcheck::is_host_rw(addr, len) {
            return fail(
                Code::InvalidArgument,
                format_args!(
                    "addr={addr:#x} len={len} is not readable and writable memory of this process"
                ),
            );
        }
        let Ok(len_usize) = usize::try_from(len) else {
            return fail(Code::InvalidArgument, "length does not fit this platform");
        };
        let access = if remote {
            Access::ALL
        } else {
            Access::LOCAL_WRITE
        };
        // Reserve the range, then register without the lock: pinning a large buffer can
        // take long, and submits look the map up.
        let mut regions = lock(&self.regions);
        if let Some((&a, r)) = regions.range(..end).next_back()
            && a + r.len > addr
        {
            return fail(
                Code::AddressOverlapped,
                format_args!(
                    "addr={addr:#x} len={len} overlaps the buffer registered at {a:#x} (len {})",
                    r.len
                ),
            );
        }
        regions.insert(addr, LocalRegion { len, id: None });
        drop(regions);
        // SAFETY: the C caller promises (transfer_engine_c.h, docs/c-api.md) that the
        // buffer stays allocated until it is unregistered or the engine destroyed; on the
        // CPU backends the range was just checked to be mapped read-write memory.
        let registered = unsafe { self.engine.register_raw(addr as *mut u8, len_usize, access) };
        let mut regions = lock(&self.regions);
        match registered {
            Ok(id) => {
                regions.insert(addr, LocalRegion { len, id: Some(id) });
                Ok(())
            }
            Err(e) => {
                regions.remove(&addr);
                Err(Code::from_err(&e))
            }
        }
    }

    /// `unregisterLocalMemory`: by the buffer's start address.
    pub(crate) fn unregister(&self, addr: u64) -> Result<(), Code> {
        let id = lock(&self.regions).get(&addr).and_then(|r| r.id);
        let Some(id) = id else {
            return fail(
                Code::AddressNotRegistered,
                format_args!("no registered buffer starts at {addr:#x}"),
            );
        };
        // Not under the lock: the wait can be long, and submits look the map up. A batch
        // submitted meanwhile pins the region, and the wait covers it.
        match self
            .engine
            .deregister_wait(id, Instant::now() + UNREGISTER_WAIT)
        {
            Ok(()) => {
                let mut regions = lock(&self.regions);
                if regions.get(&addr).is_some_and(|r| r.id == Some(id)) {
                    regions.remove(&addr);
                }
                Ok(())
            }
            Err(pagewire_transport::Error::Timeout { .. }) => fail(
                Code::BatchBusy,
                format_args!("the buffer at {addr:#x} is still used by transfers"),
            ),
            Err(pagewire_transport::Error::UnknownRegion { .. }) => fail(
                Code::AddressNotRegistered,
                format_args!("the buffer at {addr:#x} was unregistered meanwhile"),
            ),
            Err(e) => Err(Code::from_err(&e)),
        }
    }

    fn local_registered(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        lock(&self.regions)
            .range(..=addr)
            .next_back()
            .is_some_and(|(&a, r)| r.id.is_some() && a + r.len >= end)
    }

    // ------------------------------------------------------------------ segments

    /// `openSegment`: connects to the engine named `host:port` (or returns the open
    /// connection to it). Blocks for at most the handshake timeout (plus as much for the
    /// name lookup).
    pub(crate) fn open_segment(&self, name: &str, refresh: bool) -> Result<i32, Code> {
        let Some((host, Some(port))) = split_host_port(name, true) else {
            return fail(
                Code::InvalidArgument,
                format_args!("segment name {name:?} is not host:port"),
            );
        };
        let existing = {
            let segs = lock(&self.segments);
            segs.by_name
                .get(name)
                .map(|id| (*id, segs.by_id.get(id).and_then(|s| s.peer)))
        };
        if let Some((id, peer)) = existing {
            if id == LOCAL_SEGMENT && peer.is_none() {
                self.segment(LOCAL_SEGMENT)?;
                return Ok(id);
            }
            if let Some(p) = peer
                && self.engine.peer_alive(p).unwrap_or(false)
            {
                if refresh {
                    self.refresh(id, p)?;
                }
                return Ok(id);
            }
        }
        let timeout = self.engine.config().handshake_timeout;
        let addrs = resolve(&host, port, timeout)?;
        let peer = self
            .engine
            .connect(&addrs[..])
            .map_err(|e| Code::from_err(&e))?;
        let regions = sorted(self.engine.peer_regions(peer).unwrap_or_default());
        let mut segs = lock(&self.segments);
        if let Some(&id) = segs.by_name.get(name) {
            let seg = segs.by_id.get_mut(&id).expect("by_name and by_id agree");
            if let Some(old) = seg.peer.replace(peer) {
                let _ = self.engine.disconnect(old);
            }
            seg.regions = regions;
            return Ok(id);
        }
        if segs.by_id.len() >= MAX_SEGMENTS || segs.next_id == i32::MAX {
            drop(segs);
            let _ = self.engine.disconnect(peer);
            return Err(Code::TooManyRequests);
        }
        let id = segs.next_id;
        segs.next_id += 1;
        segs.by_name.insert(name.to_owned(), id);
        segs.by_id.insert(
            id,
            Segment {
                name: name.to_owned(),
                peer: Some(peer),
                regions,
                refreshed: None,
            },
        );
        Ok(id)
    }

    /// The peer and regions of an open segment; segment 0 (this engine) connects to
    /// itself on first use.
    fn segment(&self, id: i32) -> Result<(PeerId, Arc<Vec<RemoteRegion>>), Code> {
        {
            let segs = lock(&self.segments);
            let Some(seg) = segs.by_id.get(&id) else {
                return fail(
                    Code::InvalidArgument,
                    format_args!("unknown segment id {id}"),
                );
            };
            if let Some(p) = seg.peer {
                return Ok((p, seg.regions.clone()));
            }
            if id != LOCAL_SEGMENT {
                return fail(
                    Code::InvalidArgument,
                    format_args!("segment {id} is closed"),
                );
            }
        }
        let mut addr = self.engine.local_addr();
        if addr.ip().is_unspecified() {
            addr.set_ip(IpAddr::from([127, 0, 0, 1]));
        }
        let peer = self.engine.connect(addr).map_err(|e| Code::from_err(&e))?;
        let regions = sorted(self.engine.peer_regions(peer).unwrap_or_default());
        let mut segs = lock(&self.segments);
        let seg = segs
            .by_id
            .get_mut(&LOCAL_SEGMENT)
            .expect("segment 0 always exists");
        if let Some(p) = seg.peer {
            // Another thread connected first.
            let regions = seg.regions.clone();
            drop(segs);
            let _ = self.engine.disconnect(peer);
            return Ok((p, regions));
        }
        seg.peer = Some(peer);
        seg.regions = regions.clone();
        Ok((peer, regions))
    }

    /// Fetches a segment's regions again.
    fn refresh(&self, id: i32, peer: PeerId) -> Result<Arc<Vec<RemoteRegion>>, Code> {
        let described = self.engine.redescribe(peer);
        let regions = sorted(described.map_err(|e| Code::from_err(&e))?);
        if let Some(seg) = lock(&self.segments).by_id.get_mut(&id)
            && seg.peer == Some(peer)
        {
            seg.regions = regions.clone();
        }
        Ok(regions)
    }

    /// A submit found a remote range outside `regions`: asks the peer again, unless that
    /// was done for this segment within `REFRESH_GAP` (then `regions` stand).
    fn refresh_for_submit(
        &self,
        id: i32,
        peer: PeerId,
        regions: Arc<Vec<RemoteRegion>>,
    ) -> Result<Arc<Vec<RemoteRegion>>, Code> {
        {
            let mut segs = lock(&self.segments);
            let Some(seg) = segs.by_id.get_mut(&id) else {
                return Ok(regions);
            };
            let now = Instant::now();
            if seg
                .refreshed
                .is_some_and(|t| now.duration_since(t) < REFRESH_GAP)
            {
                return Ok(regions);
            }
            seg.refreshed = Some(now);
        }
        self.refresh(id, peer)
    }

    /// `closeSegment`: disconnects; the segment's pending batches fail.
    pub(crate) fn close_segment(&self, id: i32) -> Result<(), Code> {
        let mut segs = lock(&self.segments);
        if id == LOCAL_SEGMENT {
            let seg = segs.by_id.get_mut(&id).expect("segment 0 always exists");
            if let Some(p) = seg.peer.take() {
                let _ = self.engine.disconnect(p);
            }
            return Ok(());
        }
        let Some(seg) = segs.by_id.remove(&id) else {
            return fail(
                Code::InvalidArgument,
                format_args!("unknown segment id {id}"),
            );
        };
        segs.by_name.remove(&seg.name);
        drop(segs);
        if let Some(p) = seg.peer {
            let _ = self.engine.disconnect(p);
        }
        Ok(())
    }

    /// `syncSegmentCache`: fetches every open segment's regions again. Returns the first
    /// failure's code after trying all.
    pub(crate) fn sync_segments(&self) -> Result<(), Code> {
        let open: Vec<(i32, PeerId)> = lock(&self.segments)
            .by_id
            .iter()
            .filter_map(|(&id, s)| s.peer.map(|p| (id, p)))
            .collect();
        let mut first = Ok(());
        for (id, p) in open {
            if let Err(c) = self.refresh(id, p) {
                first = first.and(Err(c));
            }
        }
        first
    }

    /// Open segments: `(id, name, peer)`.
    pub(crate) fn segment_list(&self) -> Vec<(i32, String, Option<PeerId>)> {
        let segs = lock(&self.segments);
        let mut v: Vec<_> = segs
            .by_id
            .iter()
            .map(|(&id, s)| (id, s.name.clone(), s.peer))
            .collect();
        v.sort_by_key(|e| e.0);
        v
    }

    // ------------------------------------------------------------------ batches

    /// `allocateBatchID`.
    pub(crate) fn allocate_batch(&self, capacity: usize) -> Option<u64> {
        if capacity == 0 || capacity > MAX_BATCH_SIZE {
            return None;
        }
        lock(&self.batches).insert(Arc::new(Mutex::new(TeBatch {
            capacity,
            tasks: Vec::new(),
            subs: Vec::new(),
        })))
    }

    fn batch(&self, id: u64) -> Result<Arc<Mutex<TeBatch>>, Code> {
        match lock(&self.batches).get(id) {
            Some(b) => Ok(b.clone()),
            None => fail(
                Code::InvalidArgument,
                format_args!("unknown or freed batch id {id:#x}"),
            ),
        }
    }

    /// `freeBatchID`: refused with `kBatchBusy` while a task is pending.
    pub(crate) fn free_batch(&self, id: u64) -> Result<(), Code> {
        let b = self.batch(id)?;
        let busy = lock(&b)
            .subs
            .iter()
            .any(|h| matches!(h.status(), BatchStatus::Pending));
        if busy {
            return fail(Code::BatchBusy, "the batch has pending tasks");
        }
        lock(&self.batches).remove(id);
        Ok(())
    }

    /// `getTransferStatus`: `(STATUS_*, transferred_bytes)` of one task. Never blocks.
    pub(crate) fn task_status(&self, id: u64, task_id: usize) -> Result<(i32, u64), Code> {
        let b = self.batch(id)?;
        let b = lock(&b);
        let Some(&t) = b.tasks.get(task_id) else {
            return fail(
                Code::InvalidArgument,
                format_args!("task {task_id} not in the batch ({} tasks)", b.tasks.len()),
            );
        };
        if t.sub == NONE {
            return Ok((STATUS_COMPLETED, 0));
        }
        Ok(match b.subs[t.sub as usize].status() {
            BatchStatus::Pending => (STATUS_WAITING, 0),
            BatchStatus::Done => (STATUS_COMPLETED, t.len),
            BatchStatus::Cancelled => (STATUS_CANCELED, 0),
            // A timeout is a failure too: NIXL's Mooncake backend takes any status other
            // than WAITING, PENDING and FAILED for success.
            _ => (STATUS_FAILED, 0),
        })
    }

    /// `submitTransfer` / `submitTransferWithNotify`. Every entry is checked before
    /// anything is posted: on error nothing moves and the batch is unchanged.
    pub(crate) fn submit(
        &self,
        batch_id: u64,
        entries: &[Request],
        notify: Option<(&[u8], &[u8])>,
    ) -> Result<(), Code> {
        let b = self.batch(batch_id)?;
        let mut b = lock(&b);
        if b.tasks.len().saturating_add(entries.len()) > b.capacity {
            return fail(
                Code::TooManyRequests,
                format_args!(
                    "{} requests over the batch's capacity ({} of {} used)",
                    entries.len(),
                    b.tasks.len(),
                    b.capacity
                ),
            );
        }
        if entries.is_empty() {
            // Mooncake refuses a notification with nothing to carry it.
            return if notify.is_some() {
                fail(
                    Code::InvalidArgument,
                    "a notification needs at least one request",
                )
            } else {
                Ok(())
            };
        }
        // Group by target, in order of first appearance.
        let mut groups: Vec<(i32, Vec<usize>)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if e.opcode != 0 && e.opcode != 1 {
                return fail(
                    Code::InvalidArgument,
                    format_args!(
                        "request {i}: opcode {} is neither READ (0) nor WRITE (1)",
                        e.opcode
                    ),
                );
            }
            if e.length == 0 {
                continue;
            }
            if e.source == 0 {
                return fail(
                    Code::InvalidArgument,
                    format_args!("request {i}: null source"),
                );
            }
            if e.source.checked_add(e.length).is_none()
                || e.target_offset.checked_add(e.length).is_none()
            {
                return fail(
                    Code::InvalidArgument,
                    format_args!("request {i}: address + length {} overflows", e.length),
                );
            }
            match groups.iter_mut().find(|g| g.0 == e.target_id) {
                Some(g) => g.1.push(i),
                None => groups.push((e.target_id, vec![i])),
            }
        }
        // A notification follows the data of one peer only (Mooncake sends it to the
        // first entry's target); pagewire refuses the ambiguous case.
        let notify_target = entries[0].target_id;
        if notify.is_some()
            && (groups.len() > 1 || groups.first().is_some_and(|g| g.0 != notify_target))
        {
            return fail(
                Code::InvalidArgument,
                "a notification follows the data of one segment: every request must target it",
            );
        }
        let mut resolved = Vec::with_capacity(groups.len());
        for (target, idx) in &groups {
            let (peer, mut regions) = self.segment(*target)?;
            for &i in idx {
                let e = &entries[i];
                if !self.local_registered(e.source, e.length) {
                    return fail(
                        Code::AddressNotRegistered,
                        format_args!(
                            "request {i}: local range {:#x}+{} is not inside one registered buffer",
                            e.source, e.length
                        ),
                    );
                }
            }
            let need = |e: &Request| {
                if e.opcode == 1 {
                    Access::REMOTE_WRITE
                } else {
                    Access::REMOTE_READ
                }
            };
            let misfit = |regions: &[RemoteRegion]| {
                idx.iter().copied().find(|&i| {
                    let e = &entries[i];
                    !remote_covered(regions, e.target_offset, e.length, need(e))
                })
            };
            if misfit(&regions).is_some() {
                // The peer may have registered memory since we last asked.
                regions = self.refresh_for_submit(*target, peer, regions)?;
                if let Some(i) = misfit(&regions) {
                    let e = &entries[i];
                    return fail(
                        Code::AddressNotRegistered,
                        format_args!(
                            "request {i}: remote range {:#x}+{} is outside the buffers segment {target} registered for remote {}",
                            e.target_offset,
                            e.length,
                            if e.opcode == 1 { "writes" } else { "reads" }
                        ),
                    );
                }
            }
            resolved.push(peer);
        }
        if groups.is_empty() {
            // Only zero-length entries: a notification goes alone.
            if let Some((name, msg)) = notify {
                let (peer, _) = self.segment(notify_target)?;
                let deadline = Instant::now() + self.engine.config().batch_timeout;
                self.mailbox.send(peer, name, msg, deadline)?;
            }
            b.tasks
                .extend(entries.iter().map(|_| Task { sub: NONE, len: 0 }));
            return Ok(());
        }
        let mut staged = None;
        if let Some((name, msg)) = notify {
            staged =
                Some(
                    self.mailbox
                        .stage(resolved[0], name, msg, Instant::now() + SLOT_WAIT)?,
                );
        }
        let first_sub = b.subs.len();
        let mut posted: Vec<TransferHandle> = Vec::with_capacity(groups.len());
        let mut sub_of = vec![NONE; entries.len()];
        for (g, ((_, idx), peer)) in groups.iter().zip(&resolved).enumerate() {
            let mut batch = Batch::with_capacity(idx.len());
            for &i in idx {
                let e = &entries[i];
                batch.push(TransferOp {
                    op: if e.opcode == 1 { Op::Write } else { Op::Read },
                    local: e.source,
                    remote: e.target_offset,
                    len: e.length,
                });
                sub_of[i] = (first_sub + g) as u32;
            }
            if let Some(s) = staged {
                batch = batch.notify(s.tag());
            }
            match self.engine.submit(*peer, batch) {
                Ok(h) => {
                    if let Some(s) = staged {
                        self.mailbox.attach(s, h.clone());
                    }
                    posted.push(h);
                }
                Err(e) => {
                    // Only reachable when the state changed since the checks above (a
                    // peer went away): take back what was posted.
                    for h in &posted {
                        h.cancel();
                    }
                    if let Some(s) = staged {
                        self.mailbox.release(s);
                    }
                    return Err(Code::from_err(&e));
                }
            }
        }
        b.subs.extend(posted);
        b.tasks.extend(
            entries
                .iter()
                .zip(&sub_of)
                .map(|(e, &sub)| Task { sub, len: e.length }),
        );
        Ok(())
    }

    // ------------------------------------------------------------------ notifications

    /// `genNotifyInEngine`: a notification alone, waited for until delivered.
    pub(crate) fn notify(&self, target: i32, name: &[u8], msg: &[u8]) -> Result<(), Code> {
        let (peer, _) = self.segment(target)?;
        let deadline = Instant::now()
            + self
                .engine
                .config()
                .batch_timeout
                .min(Duration::from_secs(5));
        self.mailbox.send(peer, name, msg, deadline)
    }

    /// `getNotifsFromEngine`: every notification received so far.
    pub(crate) fn take_notifications(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.mailbox.drain()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_forms() {
        let s = |x: &str, p| split_host_port(x, p);
        assert_eq!(
            s("10.0.0.1:15000", true),
            Some(("10.0.0.1".into(), Some(15000)))
        );
        assert_eq!(s("[::1]:7", true), Some(("::1".into(), Some(7))));
        assert_eq!(
            s("host.example:80", true),
            Some(("host.example".into(), Some(80)))
        );
        assert_eq!(s("10.0.0.1", false), Some(("10.0.0.1".into(), None)));
        assert_eq!(s("::1", false), Some(("::1".into(), None)));
        assert_eq!(s("[fe80::1]", false), Some(("fe80::1".into(), None)));
        for bad in [
            "10.0.0.1", "::1", ":80", "h:", "h:99999", "[::1]", "[::1]x", "", "h:-1",
        ] {
            assert_eq!(s(bad, true), None, "{bad}");
        }
    }

    #[test]
    fn remote_coverage_spans_adjacent_regions() {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let regions = [
            RemoteRegion::new(100, 100, 1, rw),
            RemoteRegion::new(200, 100, 2, rw),
            RemoteRegion::new(400, 100, 3, Access::REMOTE_READ),
        ];
        assert!(remote_covered(&regions, 150, 100, Access::REMOTE_WRITE));
        assert!(remote_covered(&regions, 100, 200, Access::REMOTE_WRITE));
        assert!(
            !remote_covered(&regions, 250, 100, Access::REMOTE_WRITE),
            "gap"
        );
        assert!(!remote_covered(&regions, 99, 2, Access::REMOTE_WRITE));
        assert!(remote_covered(&regions, 400, 100, Access::REMOTE_READ));
        assert!(
            !remote_covered(&regions, 400, 100, Access::REMOTE_WRITE),
            "access"
        );
        assert!(!remote_covered(&regions, u64::MAX, 2, Access::REMOTE_READ));
    }
}
