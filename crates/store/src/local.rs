//! Memory the client touches itself: the caller's registered buffers, its own segment, and
//! segments of other clients in the same process (a replica there is copied with
//! `memcpy` instead of going through the transport).
//!
//! This is the crate's only module with `unsafe`. Bytes are moved with raw-pointer copies
//! only: no Rust reference is ever formed to a segment (peers write it through the NIC or
//! the transport's threads) or to a caller's buffer (the caller's device or engine may
//! write it).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, Weak};

use pagewire_transport::{Access, Engine, HostBuffer, RegionId};

use crate::error::{Result, StoreError};

/// A byte range in this process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Span {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Span {
    /// `[addr, addr+len)`.
    pub const fn new(addr: u64, len: u64) -> Self {
        Span { addr, len }
    }

    fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }
}

/// The caller's buffers registered with a client: start -> (length, engine region).
#[derive(Debug, Default)]
pub(crate) struct Buffers {
    map: RwLock<BTreeMap<u64, (u64, RegionId)>>,
}

impl Buffers {
    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<u64, (u64, RegionId)>> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `[ptr, ptr+len)` with the engine (local write access: reads land there).
    ///
    /// # Safety
    /// As [`Engine::register_raw`]: the memory stays valid until [`Buffers::remove`]
    /// returned for it.
    pub unsafe fn insert(&self, engine: &Engine, ptr: u64, len: u64) -> Result<()> {
        if len == 0 || ptr == 0 || ptr.checked_add(len).is_none() {
            return Err(StoreError::invalid(format!(
                "buffer {ptr:#x}+{len} is empty, null or wraps"
            )));
        }
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        if map.contains_key(&ptr) {
            return Err(StoreError::invalid(format!(
                "buffer {ptr:#x} is registered already"
            )));
        }
        // SAFETY: the caller vouches for the range (this function's contract), and it is
        // deregistered in `remove` before the caller may free it.
        let region =
            unsafe { engine.register_raw(ptr as *mut u8, len as usize, Access::LOCAL_WRITE) }?;
        map.insert(ptr, (len, region));
        Ok(())
    }

    /// Deregisters the buffer that starts at `ptr`, waiting for transfers that use it.
    pub fn remove(&self, engine: &Engine, ptr: u64, deadline: std::time::Instant) -> Result<()> {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        let Some(&(_, region)) = map.get(&ptr) else {
            return Err(StoreError::invalid(format!(
                "buffer {ptr:#x} is not registered"
            )));
        };
        engine.deregister_wait(region, deadline)?;
        map.remove(&ptr);
        Ok(())
    }

    /// Whether every span lies inside one registered buffer.
    pub fn covers(&self, spans: &[Span]) -> bool {
        let map = self.read();
        spans.iter().all(|s| covered(&map, s))
    }

    /// Deregisters everything (the client closes).
    pub fn clear(&self, engine: &Engine) {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for (_, (_, region)) in std::mem::take(&mut *map) {
            let _ = engine.deregister_wait(region, deadline);
        }
    }
}

fn covered(map: &BTreeMap<u64, (u64, RegionId)>, s: &Span) -> bool {
    let Some(end) = s.end() else { return false };
    s.len > 0
        && map
            .range(..=s.addr)
            .next_back()
            .is_some_and(|(&start, &(len, _))| end <= start + len)
}

/// A client's segment: its memory (registered for remote read and write) and where the
/// master knows it.
#[derive(Debug)]
pub(crate) struct SegmentMem {
    buf: HostBuffer,
    /// The current registration. Copies in this process hold it read-locked while they
    /// run; [`SegmentMem::renew`] write-locks it, so no copy of an earlier session is
    /// under way once a new one starts.
    reg: RwLock<Registration>,
    endpoint: String,
}

#[derive(Debug, Clone, Copy)]
struct Registration {
    /// `None` after a renewal that deregistered but could not register again.
    region: Option<RegionId>,
    /// The remote key at the segment's base: what the master names the session by.
    rkey: u32,
}

fn segment_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE
}

/// The remote key `engine` exposes at `base`.
fn rkey_at(engine: &Engine, base: u64) -> Result<u32> {
    engine
        .exposed_regions()
        .iter()
        .find(|r| r.addr == base)
        .map(|r| r.rkey)
        .ok_or_else(|| StoreError::invalid(format!("segment {base:#x} is not exposed")))
}

impl SegmentMem {
    /// Allocates and registers `size` bytes, findable in this process under `endpoint`.
    pub fn new(engine: &Engine, size: u64, endpoint: &str) -> Result<Arc<Self>> {
        let len = usize::try_from(size)
            .map_err(|_| StoreError::invalid(format!("segment of {size} bytes")))?;
        let buf = HostBuffer::new(len)?;
        let region = engine.register(&buf, segment_access())?;
        let rkey = match rkey_at(engine, buf.addr()) {
            Ok(k) => k,
            Err(e) => {
                let _ = engine.deregister(region);
                return Err(e);
            }
        };
        let seg = Arc::new(SegmentMem {
            buf,
            reg: RwLock::new(Registration {
                region: Some(region),
                rkey,
            }),
            endpoint: endpoint.to_string(),
        });
        let mut v = LOCAL.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(&seg));
        Ok(seg)
    }

    pub fn base(&self) -> u64 {
        self.buf.addr()
    }

    pub fn size(&self) -> u64 {
        self.buf.len() as u64
    }

    fn reg(&self) -> RwLockReadGuard<'_, Registration> {
        self.reg.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The current registration's region (none after a failed renewal).
    pub fn region(&self) -> Option<RegionId> {
        self.reg().region
    }

    /// The remote key of the current registration.
    pub fn rkey(&self) -> u32 {
        self.reg().rkey
    }

    /// The current registration, held (a renewal waits for it), if its key is `rkey`: a
    /// copy of the session the master placed an object in runs under it, or not at all.
    fn in_session(&self, rkey: u32) -> Option<RwLockReadGuard<'_, Registration>> {
        Some(self.reg()).filter(|r| r.rkey == rkey)
    }

    /// Registers the memory anew (the contents stay), for a new session with the master:
    /// peers holding the old key are refused by the data path from now on (the NIC for
    /// verbs, the engine's key check for TCP and loopback), and copies in this process
    /// check the key too. Waits (up to `deadline`) for transfers still using the old
    /// registration. Returns the new key, never equal to the old one.
    pub fn renew(&self, engine: &Engine, deadline: std::time::Instant) -> Result<u32> {
        let mut reg = self.reg.write().unwrap_or_else(|p| p.into_inner());
        let old = *reg;
        if let Some(r) = old.region {
            engine.deregister_wait(r, deadline)?;
            reg.region = None;
        }
        // A backend may hand the same key out again (verbs key bits are few): register
        // until the key differs, releasing each attempt that does not.
        for _ in 0..8 {
            let region = engine.register(&self.buf, segment_access())?;
            match rkey_at(engine, self.base()) {
                Ok(k) if k != old.rkey => {
                    *reg = Registration {
                        region: Some(region),
                        rkey: k,
                    };
                    return Ok(k);
                }
                Ok(_) => engine.deregister(region)?,
                Err(e) => {
                    let _ = engine.deregister(region);
                    return Err(e);
                }
            }
        }
        Err(StoreError::invalid(
            "the backend gave the segment its old remote key eight times".to_string(),
        ))
    }

    fn holds(&self, addr: u64, len: u64) -> bool {
        addr >= self.base()
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.base() + self.size())
    }
}

/// Segments of every client in this process, by endpoint.
static LOCAL: Mutex<Vec<Weak<SegmentMem>>> = Mutex::new(Vec::new());

/// The live segment in this process served at `endpoint` that holds `[addr, addr+len)`.
pub(crate) fn find(endpoint: &str, addr: u64, len: u64) -> Option<Arc<SegmentMem>> {
    let v = LOCAL.lock().unwrap_or_else(|p| p.into_inner());
    v.iter()
        .filter_map(Weak::upgrade)
        .find(|s| s.endpoint == endpoint && s.holds(addr, len))
}

/// Copies the caller's `parts` (in order) into `seg` at `dst`, if the segment is still
/// registered under `rkey` (the session the master placed the object in). Returns `false`,
/// copying nothing, when it is not, when a part is not registered or the object would not
/// fit the segment.
pub(crate) fn copy_in(
    bufs: &Buffers,
    seg: &SegmentMem,
    rkey: u32,
    dst: u64,
    parts: &[Span],
) -> bool {
    // Held across the copy: a renewal waits for it.
    let Some(_reg) = seg.in_session(rkey) else {
        return false;
    };
    let map = bufs.read();
    let total: Option<u64> = parts.iter().try_fold(0u64, |a, s| a.checked_add(s.len));
    let Some(total) = total else { return false };
    if !parts.iter().all(|s| covered(&map, s)) || !seg.holds(dst, total) {
        return false;
    }
    let mut at = dst;
    for s in parts {
        // SAFETY: `s` lies inside a buffer the caller registered (checked above, and the
        // read lock keeps it from being deregistered meanwhile; `register_buffer`'s
        // contract keeps it valid while registered); `[at, at + s.len)` lies inside the
        // segment's live allocation (`holds` above; `seg` keeps it alive). The master
        // gave this range to this put alone, so nothing else writes it now. Raw copy:
        // no reference to either side is formed.
        unsafe {
            std::ptr::copy_nonoverlapping(s.addr as *const u8, at as *mut u8, s.len as usize);
        }
        at += s.len;
    }
    true
}

/// Copies `size` bytes from `seg` at `src` into the caller's `parts` (in order, the last
/// part may be larger than what remains), if `seg` is still registered under `rkey`.
/// Returns `false`, copying nothing, when it is not, when a part is not registered, the
/// parts are too small, or the range is not inside the segment.
pub(crate) fn copy_out(
    bufs: &Buffers,
    seg: &SegmentMem,
    rkey: u32,
    src: u64,
    size: u64,
    parts: &[Span],
) -> bool {
    let Some(_reg) = seg.in_session(rkey) else {
        return false;
    };
    let map = bufs.read();
    let room: Option<u64> = parts.iter().try_fold(0u64, |a, s| a.checked_add(s.len));
    if room.is_none_or(|r| r < size)
        || !parts.iter().all(|s| covered(&map, s))
        || !seg.holds(src, size)
    {
        return false;
    }
    let mut at = src;
    let mut left = size;
    for s in parts {
        if left == 0 {
            break;
        }
        let n = s.len.min(left);
        // SAFETY: as in `copy_in`, the other way round; the object's lease keeps its
        // range from being reused while it is read.
        unsafe {
            std::ptr::copy_nonoverlapping(at as *const u8, s.addr as *mut u8, n as usize);
        }
        at += n;
        left -= n;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_transport::{BackendKind, EngineConfig};

    fn engine() -> Engine {
        Engine::new(
            EngineConfig::builder()
                .backend(BackendKind::Loopback)
                .listen("127.0.0.1:0".parse().unwrap())
                .build()
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn copies_check_both_sides_and_move_the_bytes() {
        let e = engine();
        let seg = SegmentMem::new(&e, 1 << 16, "local-test:1").unwrap();
        let mut src = vec![0u8; 300];
        src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let mut dst = vec![0u8; 320];
        let bufs = Buffers::default();
        let (sp, dp) = (src.as_mut_ptr() as u64, dst.as_mut_ptr() as u64);
        // SAFETY: both vectors outlive the registrations (cleared below).
        unsafe {
            bufs.insert(&e, sp, 300).unwrap();
            bufs.insert(&e, dp, 320).unwrap();
            assert!(bufs.insert(&e, sp, 300).is_err(), "twice");
        }
        let at = seg.base() + 4096;
        let k = seg.rkey();
        let parts = [Span::new(sp, 100), Span::new(sp + 100, 200)];
        assert!(copy_in(&bufs, &seg, k, at, &parts));
        assert!(
            !copy_in(&bufs, &seg, k, seg.base() + seg.size() - 10, &parts),
            "past the segment"
        );
        assert!(
            !copy_in(&bufs, &seg, k, at, &[Span::new(sp, 301)]),
            "past the buffer"
        );
        let found = find("local-test:1", at, 300).expect("published");
        assert!(Arc::ptr_eq(&found, &seg));
        assert!(find("local-test:1", seg.base() + seg.size(), 1).is_none());
        assert!(find("elsewhere:1", at, 300).is_none());
        assert!(
            !copy_out(&bufs, &seg, k, at, 300, &[Span::new(dp, 299)]),
            "too small"
        );
        assert!(copy_out(
            &bufs,
            &seg,
            k,
            at,
            300,
            &[Span::new(dp, 7), Span::new(dp + 7, 313)]
        ));
        assert_eq!(&dst[..300], &src[..]);
        assert!(dst[300..].iter().all(|&b| b == 0));
        // A new registration: the old key copies nothing either way, the new one sees
        // the same bytes.
        let k2 = seg
            .renew(
                &e,
                std::time::Instant::now() + std::time::Duration::from_secs(5),
            )
            .unwrap();
        assert_ne!(k2, k);
        assert_eq!(rkey_at(&e, seg.base()).unwrap(), k2);
        assert!(!copy_in(&bufs, &seg, k, at, &parts), "old session");
        dst.fill(0);
        assert!(!copy_out(&bufs, &seg, k, at, 300, &[Span::new(dp, 320)]));
        assert!(dst.iter().all(|&b| b == 0));
        assert!(copy_out(&bufs, &seg, k2, at, 300, &[Span::new(dp, 320)]));
        assert_eq!(&dst[..300], &src[..]);
        bufs.clear(&e);
        assert!(!bufs.covers(&[Span::new(sp, 1)]));
        drop(found);
        drop(seg);
        assert!(
            find("local-test:1", at, 1).is_none(),
            "gone with its client"
        );
    }
}
