//! Owned buffers: pinned host staging memory and device memory.
//!
//! Both come in two flavours: real CUDA allocations, and plain host allocations
//! that stand in for them when the pipeline runs with the host copy engine.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{GpuError, Result};

/// Alignment of host stand-in allocations: a host page, like cuMemHostAlloc.
pub(crate) const HOST_ALIGN: usize = 4096;

/// An address in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `off` bytes further.
    pub fn offset(self, off: u64) -> Self {
        Self(self.0 + off)
    }
}

/// Checks `offset + len <= size` without overflow.
pub(crate) fn check_range(offset: u64, len: u64, size: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(GpuError::OutOfRange { offset, len, size }),
    }
}

/// Host stand-in allocations, so the host copy engine can reject copies that
/// touch memory it did not hand out (the real driver rejects bad pointers too).
pub(crate) type HostRegistry = Arc<Mutex<BTreeMap<u64, usize>>>;

pub(crate) fn registry_contains(reg: &HostRegistry, ptr: u64, len: usize) -> bool {
    let map = reg.lock().unwrap_or_else(|e| e.into_inner());
    map.range(..=ptr)
        .next_back()
        .is_some_and(|(&start, &size)| {
            ptr.checked_add(len as u64)
                .is_some_and(|end| end <= start + size as u64)
        })
}

fn host_alloc_zeroed(len: usize) -> Result<(NonNull<u8>, Layout)> {
    let layout = Layout::from_size_align(len.max(1), HOST_ALIGN)
        .map_err(|e| GpuError::Config(format!("allocation of {len} bytes: {e}")))?;
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    NonNull::new(p)
        .map(|p| (p, layout))
        .ok_or_else(|| GpuError::Copy(format!("out of host memory allocating {len} bytes")))
}

#[derive(Debug)]
enum PinnedOwner {
    Host(Layout),
    #[cfg(feature = "cuda")]
    Cuda(u32),
}

/// Page-locked host memory (or its host stand-in): the staging ring lives here.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    owner: PinnedOwner,
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("owner", &self.owner)
            .finish()
    }
}

// SAFETY: the buffer is plain memory owned by this value; access goes through
// &/&mut self or through raw pointers whose users uphold the copy contracts.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out raw pointers or `&[u8]` views.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn host(len: usize) -> Result<Self> {
        let (ptr, layout) = host_alloc_zeroed(len)?;
        Ok(Self {
            ptr,
            len,
            owner: PinnedOwner::Host(layout),
        })
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(ordinal: u32, len: usize) -> Result<Self> {
        let p = crate::ffi::host_alloc(ordinal, len.max(1))?;
        let ptr =
            NonNull::new(p).ok_or_else(|| GpuError::Copy("cuMemHostAlloc returned null".into()))?;
        Ok(Self {
            ptr,
            len,
            owner: PinnedOwner::Cuda(ordinal),
        })
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        match self.owner {
            // SAFETY: allocated in `host` with exactly this layout, freed once.
            PinnedOwner::Host(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            #[cfg(feature = "cuda")]
            PinnedOwner::Cuda(ordinal) => {
                let _ = crate::ffi::host_free(ordinal, self.ptr.as_ptr());
            }
        }
    }
}

enum DevOwner {
    Host {
        layout: Layout,
        registry: HostRegistry,
    },
    #[cfg(feature = "cuda")]
    Cuda { ordinal: u32 },
}

/// An owned device allocation (or its host stand-in for the host copy engine).
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    owner: DevOwner,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.owner {
            DevOwner::Host { .. } => "host-standin",
            #[cfg(feature = "cuda")]
            DevOwner::Cuda { .. } => "cuda",
        };
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("kind", &kind)
            .finish()
    }
}

impl DeviceBuffer {
    pub(crate) fn host(len: usize, registry: HostRegistry) -> Result<Self> {
        let (ptr, layout) = host_alloc_zeroed(len)?;
        let addr = ptr.as_ptr() as u64;
        registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, len);
        Ok(Self {
            ptr: addr,
            len,
            owner: DevOwner::Host { layout, registry },
        })
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(ordinal: u32, len: usize) -> Result<Self> {
        let ptr = crate::ffi::mem_alloc(ordinal, len.max(1))?;
        Ok(Self {
            ptr,
            len,
            owner: DevOwner::Cuda { ordinal },
        })
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The CUDA ordinal of a real device allocation.
    pub fn cuda_ordinal(&self) -> Option<u32> {
        match self.owner {
            DevOwner::Host { .. } => None,
            #[cfg(feature = "cuda")]
            DevOwner::Cuda { ordinal } => Some(ordinal),
        }
    }

    /// Export the buffer as a dma-buf fd (for `ibv_reg_dmabuf_mr`). Needs a real
    /// CUDA allocation whose start and length are host-page aligned.
    pub fn export_dmabuf(&self) -> Result<std::os::fd::OwnedFd> {
        match self.owner {
            DevOwner::Host { .. } => Err(GpuError::ModeUnavailable {
                mode: "direct-dmabuf",
                reason: "host stand-in memory has no dma-buf".into(),
            }),
            #[cfg(feature = "cuda")]
            DevOwner::Cuda { ordinal } => {
                let page = HOST_ALIGN as u64;
                if !self.ptr.is_multiple_of(page) || !(self.len as u64).is_multiple_of(page) {
                    return Err(GpuError::ModeUnavailable {
                        mode: "direct-dmabuf",
                        reason: format!(
                            "range {:#x}+{} is not host-page aligned",
                            self.ptr, self.len
                        ),
                    });
                }
                crate::ffi::dmabuf_export(ordinal, self.ptr, self.len)
            }
        }
    }

    /// A span over the whole buffer, borrowed from it.
    pub fn span(&self) -> DeviceSpan<'_> {
        DeviceSpan {
            ptr: self.ptr,
            len: self.len,
            _owner: std::marker::PhantomData,
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        match &self.owner {
            DevOwner::Host { layout, registry } => {
                registry
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&self.ptr);
                // SAFETY: allocated in `host` with this layout, freed once.
                unsafe { std::alloc::dealloc(self.ptr as *mut u8, *layout) }
            }
            #[cfg(feature = "cuda")]
            DevOwner::Cuda { ordinal } => {
                let _ = crate::ffi::mem_free(*ordinal, self.ptr);
            }
        }
    }
}

/// A device range that stays valid for `'a`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceSpan<'a> {
    ptr: u64,
    len: usize,
    _owner: std::marker::PhantomData<&'a ()>,
}

impl DeviceSpan<'static> {
    /// A span over memory the caller owns (e.g. a framework's KV pool).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of the copy engine it is used with
    /// and stay allocated, and not be written by anyone else during transfers
    /// that read it, for as long as the span is used.
    pub unsafe fn from_raw(ptr: DevicePtr, len: usize) -> Self {
        Self {
            ptr: ptr.0,
            len,
            _owner: std::marker::PhantomData,
        }
    }
}

impl DeviceSpan<'_> {
    /// First byte.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the span is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
