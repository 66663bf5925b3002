//! The library's own registered memory (the notification mailbox), accessed only through
//! raw copies: a peer or the NIC may read or write it at any time, so no Rust reference
//! to its bytes is ever formed.

use std::alloc::Layout;
use std::ptr::NonNull;

/// A zeroed, page-aligned allocation that lives until dropped. The owner deregisters it
/// from the engine (or shuts the engine down) before dropping it.
#[derive(Debug)]
pub(crate) struct RawBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a plain heap allocation with no thread affinity; every access is a raw copy
// whose callers synchronise through the transport (a batch completes before its bytes
// are read).
unsafe impl Send for RawBuf {}
// SAFETY: as above; `&RawBuf` only hands out the address and performs raw copies.
unsafe impl Sync for RawBuf {}

impl RawBuf {
    /// `len` zeroed bytes, 4 KiB aligned; `None` if `len` is 0 or allocation fails.
    pub(crate) fn new(len: usize) -> Option<RawBuf> {
        let layout = Layout::from_size_align(len.div_ceil(4096).max(1) * 4096, 4096).ok()?;
        if len == 0 {
            return None;
        }
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(RawBuf { ptr, layout })
    }

    /// Start address.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Start pointer (for registration).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes (whole pages).
    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }

    /// Copies `src` to offset `off`. Panics if it does not fit (a bug in the caller).
    pub(crate) fn write(&self, off: usize, src: &[u8]) {
        assert!(off.checked_add(src.len()).is_some_and(|e| e <= self.len()));
        // SAFETY: the range lies inside the allocation (checked above) and `src` is a
        // distinct Rust slice, so the two cannot overlap. Peers only read this memory.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        };
    }

    /// Copies `len` bytes at offset `off` out. Panics if out of range (a bug in the caller).
    pub(crate) fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off.checked_add(len).is_some_and(|e| e <= self.len()));
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside the allocation (checked above); `out` is a fresh
        // vector. The caller reads after the batch that filled the range completed.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), out.as_mut_ptr(), len) };
        out
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_alignment() {
        let b = RawBuf::new(5000).unwrap();
        assert_eq!(b.len(), 8192);
        assert_eq!(b.addr() % 4096, 0);
        b.write(4090, b"abcdefgh");
        assert_eq!(b.read(4090, 8), b"abcdefgh");
        assert_eq!(b.read(0, 4), [0, 0, 0, 0]);
        assert!(RawBuf::new(0).is_none());
    }
}
