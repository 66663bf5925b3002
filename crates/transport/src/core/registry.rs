//! The registry of local registered regions, and the table of a peer's exposed ones.
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
//! ([`Registry::revoke_all`]); a holder checks [`Region::revoked`] between slices, so that wait
//! is short, and once it is over no peer op touches the memory again.
//!
//! [`Engine::deregister`]: crate::Engine::deregister

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::error::{Error, Result};
use crate::types::{Access, MrHandle, RailKeys, RegionId, RemoteRegion};

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
// Registry

/// One backend registration (MR) covering part of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    /// Keys on rails 1.. (multi-rail verbs), see [`MrHandle`](crate::types::MrHandle).
    pub lrails: RailKeys,
    pub rrails: RailKeys,
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
    pub mrs: Mutex<Vec<MrHandle>>,
    /// Batches (and incoming TCP ops) currently using the region.
    busy: AtomicUsize,
    /// Of those, peer ops served by this process ([`PeerPin`]s).
    peer_busy: AtomicUsize,
    /// Set by [`Registry::revoke_all`] (shutdown): peer ops must stop touching the memory.
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

/// The regions a batch pins: nearly always one (a KV pool), kept inline.
pub(crate) type Pins = smallvec::SmallVec<[RegionPin; 1]>;

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
/// Shutdown waits until every one is dropped ([`Registry::revoke_all`]); its holder checks
/// [`Region::revoked`] between slices and stops when it is set.
pub(crate) struct PeerPin(RegionPin);

impl PeerPin {
    pub fn region(&self) -> &Region {
        self.0.region()
    }
}

impl Drop for PeerPin {
    fn drop(&mut self) {
        // Release: whatever the holder wrote happens before `Revoked::peers_done` sees the count drop.
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
        mrs: Vec<MrHandle>,
        keepalive: Option<Arc<dyn Any + Send + Sync>>,
    ) -> std::result::Result<RegionId, (Error, Vec<MrHandle>)> {
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

    /// The (rail-0) lkeys of `id`'s MR chunks.
    pub fn lkeys(&self, id: RegionId) -> Result<Vec<u32>> {
        let inner = self.read();
        let r = inner.by_id.get(&id).ok_or(Error::UnknownRegion { id })?;
        Ok(r.chunks.iter().map(|c| c.lkey).collect())
    }

    /// Drops one registration of `id`. Returns the backend handles to release when the
    /// last registration goes, `None` when others remain.
    pub fn remove(&self, id: RegionId) -> Result<Option<Vec<MrHandle>>> {
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
    /// under the registry lock, so [`Self::revoke_all`] either counts it or removed the region
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
                let mut e = RemoteRegion::new(c.addr, c.len, c.rkey, remote_bits);
                e.rails = c.rrails;
                out.push(e);
            }
        }
        out
    }

    /// Revokes every region (engine shutdown): they leave the registry, and a [`PeerPin`]
    /// holder stops within one slice. The caller waits until [`Revoked::peers_done`]
    /// (the registry does not wait or sleep), then releases [`Revoked::into_handles`].
    /// Batch pins are not waited for: the engine stops its own I/O before draining.
    pub fn revoke_all(&self) -> Revoked {
        let regions: Vec<Arc<Region>> = {
            let mut inner = self.write();
            inner.by_start.clear();
            inner.by_id.drain().map(|(_, r)| r).collect()
        };
        for r in &regions {
            r.revoked.store(true, Ordering::Release);
        }
        Revoked { regions }
    }
}

/// Regions taken out of the registry at shutdown, until no peer op touches them.
#[derive(Debug)]
pub(crate) struct Revoked {
    regions: Vec<Arc<Region>>,
}

impl Revoked {
    /// Whether the last [`PeerPin`] of these regions is gone.
    pub fn peers_done(&self) -> bool {
        // Acquire: pairs with `PeerPin::drop`, so the holders' writes are done.
        self.regions
            .iter()
            .all(|r| r.peer_busy.load(Ordering::Acquire) == 0)
    }

    /// The backend handles, to deregister once [`Self::peers_done`].
    pub fn into_handles(self) -> Vec<MrHandle> {
        let mut out = Vec::new();
        for r in self.regions {
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
            lrails: RailKeys::NONE,
            rrails: RailKeys::NONE,
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
