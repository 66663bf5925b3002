//! Local memory: access flags, region ids, the registry of registered regions, and
//! [`HostBuffer`], an owned page-aligned allocation that can be registered safely.
//!
//! The registry answers "which region contains `[addr, addr+len)`" in O(log n) with a
//! `BTreeMap` keyed by start address. Regions never overlap partially: registering a
//! range inside an existing region with no more access than it has returns the existing
//! id (registration is counted, so each `register` needs its `deregister`); any other
//! overlap is refused with [`Error::RegionOverlap`].
//!
//! Every batch pins the regions its local ranges lie in; [`Engine::deregister`]
//! refuses with [`Error::RegionBusy`] while a pin exists, so memory is never handed
//! back to the caller while a backend may still read or write it.
//!
//! A peer's op that the engine serves itself (TCP responder, a loopback peer's copy) holds
//! a [`PeerPin`]. Shutdown revokes every region and waits until no peer pin is left
//! ([`Registry::drain`]); a holder checks [`Region::revoked`] between slices, so that wait
//! is short, and once it is over no peer op touches the memory again.
//!
//! [`Engine::deregister`]: crate::Engine::deregister

use std::alloc::Layout;
use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::{BitOr, BitOrAssign, Bound, RangeBounds};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::backend::BackendMr;
use crate::error::{Error, Result};

/// Access rights of a registered region (a small bit set).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u8);

impl Access {
    /// No access (useful only as a starting value).
    pub const NONE: Access = Access(0);
    /// The local NIC/backend may write it (needed as the target of READs).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may write it (target of their WRITEs).
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may read it (source of their READs).
    pub const REMOTE_READ: Access = Access(4);
    /// Everything: what a KV pool shared both ways uses.
    pub const ALL: Access = Access(7);

    /// Raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
    /// From raw bits; `None` when unknown bits are set.
    pub const fn from_bits(bits: u8) -> Option<Access> {
        if bits & !7 == 0 {
            Some(Access(bits))
        } else {
            None
        }
    }
    /// Whether every bit of `other` is set in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// Whether peers may touch the region at all (only such regions are exposed).
    pub const fn is_remote(self) -> bool {
        self.0 & (Self::REMOTE_WRITE.0 | Self::REMOTE_READ.0) != 0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.contains(Access::LOCAL_WRITE) {
            parts.push("LOCAL_WRITE");
        }
        if self.contains(Access::REMOTE_WRITE) {
            parts.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            parts.push("REMOTE_READ");
        }
        if parts.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&parts.join("|"))
        }
    }
}

/// Id of a local registered region, unique within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub(crate) u64);

impl RegionId {
    /// The raw number (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region#{}", self.0)
    }
}

/// A local region as reported by [`Engine::regions`](crate::Engine::regions).
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Its id.
    pub id: RegionId,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Access rights.
    pub access: Access,
    /// Number of backend registrations (MRs) it was split into.
    pub mrs: usize,
}

/// One region a peer exposed to us: `[addr, addr+len)` with its remote key.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key (verbs rkey, or the TCP backend's region key).
    pub rkey: u32,
    /// What we may do with it (`REMOTE_WRITE` and/or `REMOTE_READ`).
    pub access: Access,
}

impl RemoteRegion {
    /// Builds one (for tests and tools).
    pub fn new(addr: u64, len: u64, rkey: u32, access: Access) -> Self {
        RemoteRegion {
            addr,
            len,
            rkey,
            access,
        }
    }
    /// One past the end.
    pub fn end(&self) -> u64 {
        self.addr.saturating_add(self.len)
    }
}

/// `addr + len` without overflow, and `len > 0`.
// A lazy error: an eager one is also dropped on success, a match over every variant of
// `Error`, on the submit path (twice per op).
#[allow(clippy::unnecessary_lazy_evaluations)]
pub(crate) fn checked_end(addr: u64, len: u64) -> Result<u64> {
    if len == 0 {
        return Err(Error::InvalidRange { addr, len });
    }
    addr.checked_add(len)
        .ok_or_else(|| Error::InvalidRange { addr, len })
}

// ---------------------------------------------------------------------------------
// HostBuffer

struct Alloc {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `Alloc` owns a plain heap allocation with no thread affinity.
unsafe impl Send for Alloc {}
// SAFETY: `Alloc` itself hands out no references; access goes through `HostBuffer`,
// which copies through raw pointers (`&self` reads, `&mut self` writes) or lends slices
// only from `unsafe fn`s whose callers vouch for exclusivity.
unsafe impl Sync for Alloc {}

impl Drop for Alloc {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed exactly once,
        // here, when the last `Arc<Alloc>` (caller's buffer or registry keep-alive) goes.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// An owned, zeroed, page-aligned (4 KiB) host allocation.
///
/// Registering it ([`Engine::register`]) keeps the allocation alive until it is
/// deregistered, even if the `HostBuffer` is dropped first, so a peer can never write
/// into freed memory.
///
/// Once registered, the buffer is shared with the engine, its peers and the NIC, which
/// write and read it while no borrow of yours says so. It therefore has no safe slice
/// view (no `Deref` to `[u8]`): a `&[u8]` or `&mut [u8]` that is alive while a transfer
/// writes the bytes is undefined behaviour in Rust. Move bytes in and out by copying, with
/// [`write_at`](Self::write_at), [`fill`](Self::fill), [`fill_range`](Self::fill_range),
/// [`read_at`](Self::read_at), [`read_vec`](Self::read_vec) and [`to_vec`](Self::to_vec),
/// which go through raw pointers. Read bytes that peers write after the batch that
/// brought them completed or its notification arrived; a copy taken while a transfer
/// writes the same bytes may hold old and new ones mixed, but is never undefined.
/// [`as_slice`](Self::as_slice) and [`as_mut_slice`](Self::as_mut_slice) lend a view
/// when you can vouch that no transfer touches the buffer meanwhile (it is not
/// registered, or nothing is in flight and no peer may write it).
///
/// ```
/// use pagewire_transport::HostBuffer;
/// # fn main() -> Result<(), pagewire_transport::Error> {
/// let mut buf = HostBuffer::new(8192)?;
/// buf.write_at(4096, b"page");
/// let mut four = [0u8; 4];
/// buf.read_at(4096, &mut four);
/// assert_eq!(&four, b"page");
/// assert_eq!(buf.read_vec(4095..4100), b"\0page");
/// buf.fill_range(..4096, 0xEE);
/// assert!(buf.to_vec()[..4096].iter().all(|&b| b == 0xEE));
/// # Ok(()) }
/// ```
///
/// A safe shared view would be unsound, so it does not compile:
///
/// ```compile_fail
/// let buf = pagewire_transport::HostBuffer::new(4096).unwrap();
/// let bytes: &[u8] = &buf;
/// ```
///
/// [`Engine::register`]: crate::Engine::register
pub struct HostBuffer {
    alloc: Arc<Alloc>,
    len: usize,
}

impl HostBuffer {
    /// Page alignment of every buffer.
    pub const ALIGN: usize = 4096;

    /// Allocates `len` zeroed bytes (`len > 0`).
    ///
    /// A length that is zero, or whose size rounded up to whole pages is not a valid
    /// allocation (it overflows `usize` or exceeds `isize::MAX`), is
    /// [`Error::InvalidRange`]; an allocation the system refuses is
    /// [`Error::Registration`].
    pub fn new(len: usize) -> Result<Self> {
        let invalid = || Error::InvalidRange {
            addr: 0,
            len: len as u64,
        };
        if len == 0 {
            return Err(invalid());
        }
        // Checked: a wrapped size would allocate less than `len` (the release profile has
        // no overflow checks).
        let size = len
            .checked_next_multiple_of(Self::ALIGN)
            .ok_or_else(invalid)?;
        let layout = Layout::from_size_align(size, Self::ALIGN).map_err(|_| invalid())?;
        // SAFETY: `layout` is valid and has a non-zero size (`size >= len > 0`).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| Error::Registration {
            addr: 0,
            len: len as u64,
            reason: "host allocation failed".into(),
        })?;
        Ok(HostBuffer {
            alloc: Arc::new(Alloc { ptr, layout }),
            len,
        })
    }

    /// Start address (what transfer ops name).
    pub fn addr(&self) -> u64 {
        self.alloc.ptr.as_ptr() as u64
    }

    /// Length in bytes, as asked for (the allocation is rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: a buffer holds at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.alloc.ptr.as_ptr()
    }

    /// Raw pointer to the first byte, for writes.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.alloc.ptr.as_ptr()
    }

    /// `[start, end)` of `range` within the buffer; panics when it is not inside.
    fn bounds(&self, range: impl RangeBounds<usize>) -> (usize, usize) {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.checked_add(1).expect("range start overflows"),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1).expect("range end overflows"),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len,
        };
        assert!(
            start <= end && end <= self.len,
            "range {start}..{end} out of bounds of a HostBuffer of {} bytes",
            self.len
        );
        (start, end)
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    ///
    /// # Panics
    /// When `offset + dst.len()` exceeds [`len`](Self::len).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        let end = offset.checked_add(dst.len()).expect("range end overflows");
        self.bounds(offset..end);
        // SAFETY: `[offset, end)` lies in the live allocation (checked above) and `dst` is
        // a distinct buffer of the caller's; a raw copy forms no reference to our bytes,
        // which the engine or a peer may be writing.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len())
        }
    }

    /// The bytes of `range`, copied into a new vector.
    ///
    /// # Panics
    /// When `range` is not inside the buffer.
    pub fn read_vec(&self, range: impl RangeBounds<usize>) -> Vec<u8> {
        let (start, end) = self.bounds(range);
        let mut v = vec![0u8; end - start];
        self.read_at(start, &mut v);
        v
    }

    /// Every byte, copied into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        self.read_vec(..)
    }

    /// Copies `src` into the buffer at `offset`.
    ///
    /// # Panics
    /// When `offset + src.len()` exceeds [`len`](Self::len).
    pub fn write_at(&mut self, offset: usize, src: &[u8]) {
        let end = offset.checked_add(src.len()).expect("range end overflows");
        self.bounds(offset..end);
        // SAFETY: as in `read_at`, with the copy going the other way; `&mut self` keeps
        // other writers of this `HostBuffer` out.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.as_mut_ptr().add(offset), src.len())
        }
    }

    /// Sets every byte of `range` to `byte`.
    ///
    /// # Panics
    /// When `range` is not inside the buffer.
    pub fn fill_range(&mut self, range: impl RangeBounds<usize>, byte: u8) {
        let (start, end) = self.bounds(range);
        // SAFETY: `[start, end)` lies in the live allocation (checked above); a raw write
        // forms no reference.
        unsafe { std::ptr::write_bytes(self.as_mut_ptr().add(start), byte, end - start) }
    }

    /// Sets every byte to `byte`.
    pub fn fill(&mut self, byte: u8) {
        self.fill_range(.., byte);
    }

    /// The bytes as a slice.
    ///
    /// # Safety
    /// While the slice lives, nothing may write the buffer: no batch of ours that READs
    /// into it is in flight, and no peer may write it (it is not registered with
    /// `REMOTE_WRITE`, or no peer is connected, or the application's protocol rules it
    /// out, e.g. between a notification and the next request).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the allocation holds `len` initialised (zeroed at first) bytes and lives
        // as long as `self`; the caller guarantees that nothing writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The bytes as a mutable slice.
    ///
    /// # Safety
    /// While the slice lives, nothing else may read or write the buffer: as for
    /// [`as_slice`](Self::as_slice), and also no batch of ours that WRITEs from it is in
    /// flight and no peer may READ it.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and the caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len) }
    }

    /// The keep-alive handle the registry holds.
    pub(crate) fn keepalive(&self) -> Arc<dyn Any + Send + Sync> {
        self.alloc.clone()
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .finish()
    }
}

// ---------------------------------------------------------------------------------
// Registry

/// One backend registration (MR) covering part of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
}

/// A registered local region.
pub(crate) struct Region {
    pub id: RegionId,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    /// Sorted, contiguous, covering `[addr, addr+len)`.
    pub chunks: Vec<Chunk>,
    /// The backend handles, handed back on deregistration.
    pub mrs: Mutex<Vec<BackendMr>>,
    /// Batches (and incoming TCP ops) currently using the region.
    busy: AtomicUsize,
    /// Of those, peer ops served by this process ([`PeerPin`]s).
    peer_busy: AtomicUsize,
    /// Set by [`Registry::drain`] (shutdown): peer ops must stop touching the memory.
    revoked: AtomicBool,
    /// How many `register` calls returned this id.
    registrations: AtomicUsize,
    /// Keeps caller memory alive (HostBuffer) while registered.
    _keepalive: Option<Arc<dyn Any + Send + Sync>>,
}

impl Region {
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// The chunk containing `addr`.
    pub fn chunk_at(&self, addr: u64) -> Option<&Chunk> {
        let i = self.chunks.partition_point(|c| c.addr + c.len <= addr);
        self.chunks.get(i).filter(|c| c.addr <= addr)
    }

    pub fn busy(&self) -> usize {
        self.busy.load(Ordering::Acquire)
    }

    /// Whether the engine shut down: a [`PeerPin`] holder must stop before its next slice.
    pub fn revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("access", &self.access)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

/// Holds a region busy while alive.
pub(crate) struct RegionPin(Arc<Region>);

impl RegionPin {
    pub fn region(&self) -> &Region {
        &self.0
    }
}

impl Drop for RegionPin {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

impl fmt::Debug for RegionPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegionPin({})", self.0.id)
    }
}

/// A pin taken for a peer's op that this process serves (TCP responder, loopback copy).
/// Shutdown waits until every one is dropped ([`Registry::drain`]); its holder checks
/// [`Region::revoked`] between slices and stops when it is set.
pub(crate) struct PeerPin(RegionPin);

impl PeerPin {
    pub fn region(&self) -> &Region {
        self.0.region()
    }
}

impl Drop for PeerPin {
    fn drop(&mut self) {
        // Release: whatever the holder wrote happens before `drain` sees the count drop.
        self.0.0.peer_busy.fetch_sub(1, Ordering::Release);
    }
}

impl fmt::Debug for PeerPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerPin({})", self.0.0.id)
    }
}

#[derive(Default)]
struct RegistryInner {
    by_start: BTreeMap<u64, Arc<Region>>,
    by_id: HashMap<RegionId, Arc<Region>>,
    next_id: u64,
}

/// Interval registry of local regions.
#[derive(Default)]
pub(crate) struct Registry {
    inner: RwLock<RegistryInner>,
}

/// What [`Registry::begin_insert`] decided.
pub(crate) enum InsertPlan {
    /// Already covered: the existing id was returned and counted.
    Existing(RegionId),
    /// New: register these pieces with the backend, then call `finish_insert`.
    New,
}

impl Registry {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, RegistryInner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, RegistryInner> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The region whose range contains `[addr, end)`, if any. O(log n).
    fn containing(inner: &RegistryInner, addr: u64, end: u64) -> Option<&Arc<Region>> {
        let (_, r) = inner.by_start.range(..=addr).next_back()?;
        (r.end() >= end).then_some(r)
    }

    /// Any region overlapping `[addr, end)`.
    fn overlapping(inner: &RegistryInner, addr: u64, end: u64) -> Option<&Arc<Region>> {
        if let Some((_, r)) = inner.by_start.range(..addr).next_back()
            && r.end() > addr
        {
            return Some(r);
        }
        inner.by_start.range(addr..end).next().map(|(_, r)| r)
    }

    /// Checks a new registration against existing regions.
    pub fn begin_insert(&self, addr: u64, len: u64, access: Access) -> Result<InsertPlan> {
        let end = checked_end(addr, len)?;
        let inner = self.read();
        if let Some(r) = Self::containing(&inner, addr, end)
            && r.access.contains(access)
        {
            r.registrations.fetch_add(1, Ordering::AcqRel);
            return Ok(InsertPlan::Existing(r.id));
        }
        if let Some(r) = Self::overlapping(&inner, addr, end) {
            return Err(Error::RegionOverlap {
                addr,
                len,
                existing: r.id,
            });
        }
        Ok(InsertPlan::New)
    }

    /// Inserts a region whose chunks the backend registered. Re-checks overlap (another
    /// thread may have raced us); on error the caller deregisters `mrs`.
    pub fn finish_insert(
        &self,
        addr: u64,
        len: u64,
        access: Access,
        chunks: Vec<Chunk>,
        mrs: Vec<BackendMr>,
        keepalive: Option<Arc<dyn Any + Send + Sync>>,
    ) -> std::result::Result<RegionId, (Error, Vec<BackendMr>)> {
        let end = addr + len;
        let mut inner = self.write();
        if let Some(r) = Self::overlapping(&inner, addr, end) {
            let e = Error::RegionOverlap {
                addr,
                len,
                existing: r.id,
            };
            return Err((e, mrs));
        }
        inner.next_id += 1;
        let id = RegionId(inner.next_id);
        let region = Arc::new(Region {
            id,
            addr,
            len,
            access,
            chunks,
            mrs: Mutex::new(mrs),
            busy: AtomicUsize::new(0),
            peer_busy: AtomicUsize::new(0),
            revoked: AtomicBool::new(false),
            registrations: AtomicUsize::new(1),
            _keepalive: keepalive,
        });
        inner.by_start.insert(addr, region.clone());
        inner.by_id.insert(id, region);
        Ok(id)
    }

    /// Drops one registration of `id`. Returns the backend handles to release when the
    /// last registration goes, `None` when others remain.
    pub fn remove(&self, id: RegionId) -> Result<Option<Vec<BackendMr>>> {
        let mut inner = self.write();
        let r = inner.by_id.get(&id).ok_or(Error::UnknownRegion { id })?;
        let busy = r.busy();
        if busy > 0 {
            return Err(Error::RegionBusy { id, inflight: busy });
        }
        if r.registrations.fetch_sub(1, Ordering::AcqRel) > 1 {
            return Ok(None);
        }
        let r = inner.by_id.remove(&id).expect("present: looked up above");
        inner.by_start.remove(&r.addr);
        let mrs = std::mem::take(&mut *r.mrs.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(Some(mrs))
    }

    /// Pins the region containing `[addr, addr+len)` after checking it has `needed`.
    /// The pin is taken under the lock, so a concurrent `remove` either sees it or
    /// removed the region before we looked.
    #[allow(clippy::unnecessary_lazy_evaluations)] // see `checked_end`
    pub fn pin(&self, addr: u64, len: u64, needed: Access) -> Result<RegionPin> {
        let end = checked_end(addr, len)?;
        let inner = self.read();
        let r =
            Self::containing(&inner, addr, end).ok_or_else(|| Error::Unregistered { addr, len })?;
        if !r.access.contains(needed) {
            return Err(Error::PermissionDenied { addr, len, needed });
        }
        r.busy.fetch_add(1, Ordering::AcqRel);
        Ok(RegionPin(r.clone()))
    }

    /// [`Self::pin`] for a peer's op served by this process (see [`PeerPin`]). Taken
    /// under the registry lock, so [`Self::drain`] either counts it or removed the region
    /// before we looked.
    pub fn pin_for_peer(&self, addr: u64, len: u64, needed: Access) -> Result<PeerPin> {
        let end = checked_end(addr, len)?;
        let inner = self.read();
        let r = Self::containing(&inner, addr, end).ok_or(Error::Unregistered { addr, len })?;
        if !r.access.contains(needed) {
            return Err(Error::PermissionDenied { addr, len, needed });
        }
        r.busy.fetch_add(1, Ordering::AcqRel);
        r.peer_busy.fetch_add(1, Ordering::AcqRel);
        Ok(PeerPin(RegionPin(r.clone())))
    }

    /// Every region, sorted by address.
    pub fn list(&self) -> Vec<RegionInfo> {
        self.read()
            .by_start
            .values()
            .map(|r| RegionInfo {
                id: r.id,
                addr: r.addr,
                len: r.len,
                access: r.access,
                mrs: r.chunks.len(),
            })
            .collect()
    }

    /// What we expose to peers: one entry per chunk of every remotely accessible region.
    pub fn exposed(&self) -> Vec<RemoteRegion> {
        let inner = self.read();
        let mut out = Vec::new();
        for r in inner.by_start.values().filter(|r| r.access.is_remote()) {
            let remote_bits =
                Access(r.access.bits() & (Access::REMOTE_READ.0 | Access::REMOTE_WRITE.0));
            for c in &r.chunks {
                out.push(RemoteRegion::new(c.addr, c.len, c.rkey, remote_bits));
            }
        }
        out
    }

    /// Drains every region (engine shutdown) and returns the backend handles, once no
    /// peer op touches any of them: every region is revoked, then this waits until the
    /// last [`PeerPin`] is dropped (its holder stops within one slice of the revocation).
    /// Batch pins are not waited for: the engine stops its own I/O before draining.
    pub fn drain(&self) -> Vec<BackendMr> {
        let regions: Vec<Arc<Region>> = {
            let mut inner = self.write();
            inner.by_start.clear();
            inner.by_id.drain().map(|(_, r)| r).collect()
        };
        for r in &regions {
            r.revoked.store(true, Ordering::Release);
        }
        let mut nap = std::time::Duration::from_micros(20);
        // Acquire: pairs with `PeerPin::drop`, so the holders' writes are done.
        while regions
            .iter()
            .any(|r| r.peer_busy.load(Ordering::Acquire) > 0)
        {
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(1));
        }
        let mut out = Vec::new();
        for r in regions {
            out.append(&mut r.mrs.lock().unwrap_or_else(|p| p.into_inner()));
        }
        out
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("regions", &self.read().by_id.len())
            .finish()
    }
}

/// A peer's exposed regions, sorted, for bounds checks in O(log n).
#[derive(Debug, Clone, Default)]
pub(crate) struct RemoteTable {
    regions: Vec<RemoteRegion>,
}

impl RemoteTable {
    /// Sorts; the decoder already refused overlaps.
    pub fn new(mut regions: Vec<RemoteRegion>) -> Self {
        regions.sort_by_key(|r| r.addr);
        RemoteTable { regions }
    }

    pub fn regions(&self) -> &[RemoteRegion] {
        &self.regions
    }

    /// The region containing `addr`.
    pub fn at(&self, addr: u64) -> Option<&RemoteRegion> {
        let i = self.regions.partition_point(|r| r.end() <= addr);
        self.regions.get(i).filter(|r| r.addr <= addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(addr: u64, len: u64) -> Vec<Chunk> {
        vec![Chunk {
            addr,
            len,
            lkey: 1,
            rkey: 2,
        }]
    }

    fn insert(reg: &Registry, addr: u64, len: u64, access: Access) -> Result<RegionId> {
        match reg.begin_insert(addr, len, access)? {
            InsertPlan::Existing(id) => Ok(id),
            InsertPlan::New => reg
                .finish_insert(addr, len, access, chunk(addr, len), Vec::new(), None)
                .map_err(|(e, _)| e),
        }
    }

    #[test]
    fn contains_overlap_and_reregistration() {
        let reg = Registry::default();
        let a = insert(&reg, 0x1000, 0x1000, Access::ALL).unwrap();
        let b = insert(&reg, 0x4000, 0x2000, Access::LOCAL_WRITE).unwrap();
        assert_ne!(a, b);
        // Same range again, or a sub-range, is free and returns the same id.
        assert_eq!(insert(&reg, 0x1000, 0x1000, Access::ALL).unwrap(), a);
        assert_eq!(insert(&reg, 0x1800, 0x10, Access::REMOTE_READ).unwrap(), a);
        // More access than registered on the same range: an overlap.
        assert!(matches!(
            insert(&reg, 0x4000, 0x100, Access::REMOTE_WRITE),
            Err(Error::RegionOverlap { .. })
        ));
        assert!(matches!(
            insert(&reg, 0x1800, 0x1000, Access::ALL),
            Err(Error::RegionOverlap { .. })
        ));
        assert!(matches!(
            insert(&reg, 0x3fff, 2, Access::ALL),
            Err(Error::RegionOverlap { .. })
        ));
        // Pins and busy.
        let p = reg.pin(0x4100, 0x100, Access::LOCAL_WRITE).unwrap();
        assert_eq!(p.region().id, b);
        assert!(matches!(
            reg.remove(b),
            Err(Error::RegionBusy { inflight: 1, .. })
        ));
        drop(p);
        assert!(reg.remove(b).unwrap().is_some());
        assert!(matches!(
            reg.pin(0x4100, 0x100, Access::NONE),
            Err(Error::Unregistered { .. })
        ));
        assert!(matches!(
            reg.pin(0x1000, 0x1001, Access::NONE),
            Err(Error::Unregistered { .. })
        ));
        assert!(matches!(
            reg.pin(u64::MAX, 2, Access::NONE),
            Err(Error::InvalidRange { .. })
        ));
        // `a` was registered three times.
        assert!(reg.remove(a).unwrap().is_none());
        assert!(reg.remove(a).unwrap().is_none());
        assert!(reg.remove(a).unwrap().is_some());
        assert!(matches!(reg.remove(a), Err(Error::UnknownRegion { .. })));
    }

    #[test]
    fn exposed_only_remote_regions() {
        let reg = Registry::default();
        insert(&reg, 0x1000, 0x1000, Access::LOCAL_WRITE).unwrap();
        insert(
            &reg,
            0x8000,
            0x1000,
            Access::LOCAL_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
        let e = reg.exposed();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].addr, 0x8000);
        assert_eq!(e[0].access, Access::REMOTE_READ);
    }

    #[test]
    fn host_buffer_is_zeroed_and_aligned() {
        let mut b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.addr() % HostBuffer::ALIGN as u64, 0);
        assert!(b.to_vec().iter().all(|&x| x == 0));
        b.write_at(9_999, &[7]);
        assert_eq!(b.read_vec(9_998..), [0, 7]);
        assert_eq!(b.len(), 10_000);
        assert!(!b.is_empty());
        b.fill_range(1..=2, 5);
        b.fill_range(..1, 4);
        assert_eq!(b.read_vec(..4), [4, 5, 5, 0]);
        b.fill(9);
        // SAFETY: not registered: nothing else touches `b`.
        assert!(unsafe { b.as_slice() }.iter().all(|&x| x == 9));
        // SAFETY: as above.
        let s = unsafe { b.as_mut_slice() };
        s[0] = 1;
        let mut one = [0u8; 1];
        b.read_at(0, &mut one);
        assert_eq!(one, [1]);
    }

    #[test]
    fn host_buffer_ranges_are_checked() {
        let b = std::sync::Mutex::new(HostBuffer::new(16).unwrap());
        let panics = |f: &dyn Fn(&mut HostBuffer)| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                f(&mut b.lock().unwrap_or_else(|p| p.into_inner()))
            }));
            assert!(r.is_err());
        };
        panics(&|b| b.write_at(15, &[0, 0]));
        panics(&|b| b.read_at(usize::MAX, &mut [0u8; 2]));
        let (start, end) = (3, 2);
        panics(&|b| drop(b.read_vec(start..end)));
        panics(&|b| b.fill_range(..=16, 0));
        let b = b.into_inner().unwrap_or_else(|p| p.into_inner());
        assert!(b.to_vec().iter().all(|&x| x == 0), "nothing written");
    }

    #[test]
    fn remote_table_lookup() {
        let t = RemoteTable::new(vec![
            RemoteRegion::new(0x5000, 0x1000, 9, Access::REMOTE_READ),
            RemoteRegion::new(0x1000, 0x1000, 8, Access::REMOTE_WRITE),
        ]);
        assert_eq!(t.at(0x1fff).unwrap().rkey, 8);
        assert!(t.at(0x2000).is_none());
        assert_eq!(t.at(0x5000).unwrap().rkey, 9);
        assert!(t.at(0xfff).is_none());
    }
}
