//! Managed buffers: memory the engine allocates and registers for its caller
//! (`allocate_managed_buffer` / `free_managed_buffer` of Mooncake's Python binding),
//! and the byte helpers that copy into and out of registered memory.
//!
//! The allocator is Mooncake's buddy scheme, with its sizes and order, so that the same
//! calls give the same offsets: sixteen size classes of 8 KiB .. 256 MiB are carved out
//! of 2 GiB chunks, each chunk allocated and registered (remote access) once and kept
//! until the engine closes; a request of more than 256 MiB gets its own buffer,
//! registered, unregistered and freed by `free`. Each class keeps a LIFO stack of free
//! blocks, and a block split in two pushes its lower half then its upper half, so the
//! first 8 KiB block of a fresh chunk is its last 8 KiB.
//!
//! Where Mooncake trusts its caller this checks: `free` of an address that is not an
//! allocated block of that size class is an error (Mooncake pushes it on the free list,
//! and a later allocation hands out memory it does not own), and a chunk is zeroed
//! memory that is mapped lazily (the allocation touches no page).

use std::alloc::Layout;
use std::collections::HashMap;

use crate::code::{Code, Error, fail};

/// Size of the chunks the size classes are carved from (Mooncake's
/// `kDefaultBufferCapacity`).
pub const MANAGED_CHUNK_BYTES: u64 = 2 << 30;
/// The size classes, in KiB (Mooncake's `kSlabSizeKB`).
const CLASS_KIB: [u64; 16] = [
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2 << 10,
    4 << 10,
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
];
const MAX_CLASS: usize = CLASS_KIB.len() - 1;
/// Alignment of every allocation: malloc's, as Mooncake's. The standard allocator
/// zeroes memory of at most this alignment with `calloc`, which maps fresh pages
/// lazily; a larger alignment would make it write every byte of a 2 GiB chunk.
const ALIGN: usize = 16;

fn class_bytes(class: usize) -> u64 {
    CLASS_KIB[class] * 1024
}

/// Mooncake's `findClassId`: the smallest class that holds `len` (0 for 0), `None` above
/// the largest class.
pub fn class_of(len: u64) -> Option<usize> {
    if len > class_bytes(MAX_CLASS) {
        return None;
    }
    (0..MAX_CLASS)
        .rev()
        .find(|&c| len > class_bytes(c))
        .map_or(Some(0), |c| Some(c + 1))
}

/// Zeroed heap memory (mapped lazily when large), freed on drop.
#[derive(Debug)]
pub(crate) struct Block {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
}

// SAFETY: `Block` owns its allocation exclusively; the raw pointer is only an address
// handed to the engine, and the memory is plain bytes.
unsafe impl Send for Block {}

impl Block {
    /// `None` when the allocator refuses (or `len` is 0 or does not fit).
    pub(crate) fn new(len: u64) -> Option<Block> {
        let size = usize::try_from(len).ok().filter(|&s| s > 0)?;
        let layout = Layout::from_size_align(size, ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        std::ptr::NonNull::new(ptr).map(|ptr| Block { ptr, layout })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    pub(crate) fn len(&self) -> u64 {
        self.layout.size() as u64
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc_zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The allocator's state. Memory is registered by the engine (which holds this under a
/// mutex); the blocks are dropped only after the engine closed or unregistered them.
#[derive(Debug, Default)]
pub(crate) struct Managed {
    /// Free blocks per class, a LIFO stack each.
    free: [Vec<u64>; CLASS_KIB.len()],
    /// Allocated blocks of the classes: address -> class.
    used: HashMap<u64, usize>,
    /// The 2 GiB chunks, registered for the engine's life.
    pub(crate) chunks: Vec<Block>,
    /// Buffers above the largest class, by address.
    pub(crate) large: HashMap<u64, Block>,
}

impl Managed {
    /// A block of `class`; `chunk` is called to allocate and register a new chunk when
    /// every class above is empty.
    pub(crate) fn take(
        &mut self,
        class: usize,
        chunk: &mut dyn FnMut() -> Result<Block, Error>,
    ) -> Result<u64, Error> {
        if self.free[class].is_empty() {
            self.split_into(class, chunk)?;
        }
        let a = self.free[class]
            .pop()
            .ok_or_else(|| Error::new(Code::Context, "managed buffers: empty free list"))?;
        self.used.insert(a, class);
        Ok(a)
    }

    /// Mooncake's `doBuddyAllocate`: refills `class` by splitting a block of the class
    /// above (or, for the largest class, by cutting a new chunk).
    fn split_into(
        &mut self,
        class: usize,
        chunk: &mut dyn FnMut() -> Result<Block, Error>,
    ) -> Result<(), Error> {
        if class == MAX_CLASS {
            let c = chunk()?;
            let step = class_bytes(MAX_CLASS);
            let base = c.addr();
            self.chunks.push(c);
            self.free[MAX_CLASS].extend((0..MANAGED_CHUNK_BYTES / step).map(|i| base + i * step));
            return Ok(());
        }
        if self.free[class + 1].is_empty() {
            self.split_into(class + 1, chunk)?;
        }
        let b = self.free[class + 1]
            .pop()
            .ok_or_else(|| Error::new(Code::Context, "managed buffers: empty free list"))?;
        self.free[class].push(b);
        self.free[class].push(b + class_bytes(class));
        Ok(())
    }

    /// Returns a block of `class` to its free list; an address that is not an allocated
    /// block of that class is [`Code::InvalidArgument`].
    pub(crate) fn give_back(&mut self, addr: u64, class: usize) -> Result<(), Error> {
        match self.used.get(&addr) {
            Some(&c) if c == class => {
                self.used.remove(&addr);
                self.free[class].push(addr);
                Ok(())
            }
            Some(&c) => fail(
                Code::InvalidArgument,
                format!(
                    "free_managed_buffer({addr:#x}): allocated as {} KiB, freed as {} KiB",
                    CLASS_KIB[c], CLASS_KIB[class]
                ),
            ),
            None => fail(
                Code::InvalidArgument,
                format!("free_managed_buffer({addr:#x}): not an allocated managed buffer"),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_mooncakes() {
        assert_eq!(class_of(0), Some(0));
        assert_eq!(class_of(8192), Some(0));
        assert_eq!(class_of(8193), Some(1));
        assert_eq!(class_of(256 << 20), Some(MAX_CLASS));
        assert_eq!(class_of((256 << 20) + 1), None);
    }

    #[test]
    fn buddy_order_and_reuse() {
        let mut m = Managed::default();
        let base = 1u64 << 40;
        let calls = std::cell::Cell::new(0);
        let mut chunk = || -> Result<Block, Error> {
            calls.set(calls.get() + 1);
            Err(Error::new(Code::Memory, "no chunk in this test"))
        };
        assert!(m.take(0, &mut chunk).is_err());
        assert_eq!(calls.get(), 1);
        // Stand-in chunk addresses: nothing is dereferenced here.
        m.free[MAX_CLASS].extend((0..8).map(|i| base + i * class_bytes(MAX_CLASS)));
        let a = m.take(0, &mut chunk).unwrap();
        assert_eq!(a, base + MANAGED_CHUNK_BYTES - 8192);
        let b = m.take(0, &mut chunk).unwrap();
        assert_eq!(b, a - 8192);
        let c = m.take(1, &mut chunk).unwrap();
        assert_eq!(c, a - 3 * 8192);
        assert!(m.give_back(a, 1).is_err());
        assert!(m.give_back(a + 1, 0).is_err());
        m.give_back(a, 0).unwrap();
        m.give_back(b, 0).unwrap();
        assert!(m.give_back(b, 0).is_err()); // double free
        assert_eq!(m.take(0, &mut chunk).unwrap(), b);
    }
}
