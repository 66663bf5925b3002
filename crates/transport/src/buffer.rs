//! [`HostBuffer`], an owned page-aligned allocation that can be registered safely.

use std::alloc::{GlobalAlloc, Layout, System};
use std::any::Any;
use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};

struct Alloc {
    /// The page-aligned start handed out.
    ptr: NonNull<u8>,
    /// What the system allocator returned, and for what layout (freed with these).
    raw: NonNull<u8>,
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
        // SAFETY: `raw` came from `System.alloc_zeroed(self.layout)` and is freed exactly
        // once, here, when the last `Arc<Alloc>` (caller's buffer or registry keep-alive)
        // goes.
        unsafe { System.dealloc(self.raw.as_ptr(), self.layout) }
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
        // Zeroed without touching the pages: an allocator asked for page alignment
        // allocates, then writes every byte (Rust's `System` does, having no aligned
        // `calloc`), which made a 3.2 GB store segment cost seconds and its full size in
        // resident memory at set-up. `calloc` with the default alignment maps large sizes
        // fresh from the kernel, whose pages are zero until first touched; one page more
        // leaves room to align the start.
        let padded = size.checked_add(Self::ALIGN).ok_or_else(invalid)?;
        let layout = Layout::from_size_align(padded, 16).map_err(|_| invalid())?;
        // SAFETY: `layout` is valid and has a non-zero size.
        let raw = unsafe { System.alloc_zeroed(layout) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::Registration {
            addr: 0,
            len: len as u64,
            reason: "host allocation failed".into(),
            source: None,
        })?;
        let skip = raw.as_ptr().align_offset(Self::ALIGN);
        // SAFETY: `skip < ALIGN`, so `[raw + skip, raw + skip + size)` lies inside the
        // `size + ALIGN` bytes allocated.
        let ptr = unsafe { raw.add(skip) };
        Ok(HostBuffer {
            alloc: Arc::new(Alloc { ptr, raw, layout }),
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn every_size_is_zeroed_and_page_aligned() {
        // Around the allocator's switch from its heap to fresh mappings (128 KiB by
        // default), where calloc's zeroing changes from a memset to the kernel's.
        for len in [1, 4095, 4097, (128 << 10) - 1, 128 << 10, 8 << 20] {
            for _ in 0..3 {
                let mut b = HostBuffer::new(len).unwrap();
                assert_eq!(b.addr() % HostBuffer::ALIGN as u64, 0, "{len}");
                assert!(b.to_vec().iter().all(|&x| x == 0), "{len}");
                // Dirty it, so that a reused block that came back unzeroed would show.
                b.fill(0xA5);
            }
        }
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
}
