//! Every CUDA driver call of the crate, and all of its `unsafe`.
//!
//! cudarc resolves each driver symbol lazily and *panics* when the library or the
//! symbol is missing, so nothing here touches `cudarc::driver::sys` before
//! [`load`] succeeded: it checks that the library exists, that every symbol we use
//! is exported, and runs `cuInit`. Every other function starts with [`loaded`],
//! which turns "not loaded" into a typed error instead of a panic.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use crate::error::{GpuError, Result, Unavailable};

/// Every driver entry point this module calls. Checked once in [`load`], so a
/// driver older than the bindings gives `Unavailable::MissingSymbol`, not a panic.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetPCIBusId",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemsetD8_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
];

/// Optional: dma-buf export appeared in CUDA 11.7; its absence only disables
/// the dma-buf path.
const SYM_DMABUF: &str = "cuMemGetHandleForAddressRange";

static LOADED: OnceLock<std::result::Result<LoadInfo, Unavailable>> = OnceLock::new();

#[derive(Debug, Clone, Copy)]
pub(crate) struct LoadInfo {
    pub(crate) driver_version: i32,
    pub(crate) has_dmabuf_export: bool,
}

fn has_symbol(name: &str) -> bool {
    // SAFETY: only called from `load` after `is_culib_present()` returned true, so
    // `culib()` finds the library instead of panicking. Looking a symbol up does
    // not call it; the pointer type is irrelevant because it is dropped unused.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

/// Load the driver once: library present, symbols present, `cuInit(0)`.
pub(crate) fn load() -> std::result::Result<LoadInfo, Unavailable> {
    LOADED
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to dlopen candidate names; it
            // never panics. Called once thanks to the OnceLock.
            if !unsafe { sys::is_culib_present() } {
                return Err(Unavailable::DriverNotFound);
            }
            if let Some(missing) = SYMBOLS.iter().find(|s| !has_symbol(s)) {
                return Err(Unavailable::MissingSymbol(missing));
            }
            // SAFETY: library and symbol checked above.
            let r = unsafe { sys::cuInit(0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(Unavailable::InitFailed {
                    code: r as i32,
                    name: format!("{r:?}"),
                });
            }
            let mut v: c_int = 0;
            // SAFETY: symbol checked; `v` is a valid out-pointer.
            let r = unsafe { sys::cuDriverGetVersion(&mut v) };
            if r != sys::CUresult::CUDA_SUCCESS {
                v = 0;
            }
            Ok(LoadInfo {
                driver_version: v,
                has_dmabuf_export: has_symbol(SYM_DMABUF),
            })
        })
        .clone()
}

fn loaded() -> Result<LoadInfo> {
    match LOADED.get() {
        Some(Ok(info)) => Ok(*info),
        Some(Err(u)) => Err(GpuError::Unavailable(u.clone())),
        None => load().map_err(GpuError::Unavailable),
    }
}

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            call,
            code: r as i32,
            name: format!("{r:?}"),
        })
    }
}

pub(crate) fn device_count() -> Result<usize> {
    loaded()?;
    let mut n: c_int = 0;
    // SAFETY: driver loaded (checked by `loaded`); `n` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

fn device(ordinal: u32) -> Result<sys::CUdevice> {
    loaded()?;
    let ord = c_int::try_from(ordinal).map_err(|_| GpuError::NoSuchDevice(ordinal))?;
    let mut d: sys::CUdevice = 0;
    // SAFETY: driver loaded; `d` is a valid out-pointer.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ord) })
        .map_err(|_| GpuError::NoSuchDevice(ordinal))?;
    Ok(d)
}

fn c_buf_to_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

pub(crate) fn device_name(ordinal: u32) -> Result<String> {
    let d = device(ordinal)?;
    let mut buf = [0 as c_char; 256];
    // SAFETY: driver loaded; the driver writes at most `len` bytes, NUL included.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, d)
    })?;
    Ok(c_buf_to_string(&buf))
}

pub(crate) fn pci_bus_id(ordinal: u32) -> Result<String> {
    let d = device(ordinal)?;
    let mut buf = [0 as c_char; 64];
    // SAFETY: as for `device_name`.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, d)
    })?;
    Ok(c_buf_to_string(&buf))
}

pub(crate) fn total_mem(ordinal: u32) -> Result<u64> {
    let d = device(ordinal)?;
    let mut n: usize = 0;
    // SAFETY: driver loaded; `n` is a valid out-pointer.
    check("cuDeviceTotalMem_v2", unsafe {
        sys::cuDeviceTotalMem_v2(&mut n, d)
    })?;
    Ok(n as u64)
}

/// Device attributes we read.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Attr {
    ComputeMajor,
    ComputeMinor,
    GpuDirectRdma,
    DmaBuf,
    UnifiedAddressing,
}

pub(crate) fn attribute(ordinal: u32, attr: Attr) -> Result<i32> {
    use sys::CUdevice_attribute as A;
    let d = device(ordinal)?;
    let a = match attr {
        Attr::ComputeMajor => A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        Attr::ComputeMinor => A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        Attr::GpuDirectRdma => A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
        Attr::DmaBuf => A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
        Attr::UnifiedAddressing => A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
    };
    let mut v: c_int = 0;
    // SAFETY: driver loaded; `v` is a valid out-pointer; `a` is a valid enum value.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut v, a, d)
    })?;
    Ok(v)
}

/// Primary contexts, retained once per device for the life of the process
/// (releasing them would invalidate memory other handles still use).
fn contexts() -> &'static Mutex<HashMap<u32, usize>> {
    static CTX: OnceLock<Mutex<HashMap<u32, usize>>> = OnceLock::new();
    CTX.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Make `ordinal`'s primary context current on the calling thread.
pub(crate) fn set_current(ordinal: u32) -> Result<()> {
    let ctx = {
        let mut map = contexts().lock().unwrap_or_else(|e| e.into_inner());
        match map.get(&ordinal) {
            Some(&c) => c,
            None => {
                let d = device(ordinal)?;
                let mut c: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: driver loaded; `c` is a valid out-pointer.
                check("cuDevicePrimaryCtxRetain", unsafe {
                    sys::cuDevicePrimaryCtxRetain(&mut c, d)
                })?;
                map.insert(ordinal, c as usize);
                c as usize
            }
        }
    };
    // SAFETY: `ctx` is a retained primary context that is never released.
    check("cuCtxSetCurrent", unsafe {
        sys::cuCtxSetCurrent(ctx as sys::CUcontext)
    })
}

pub(crate) fn mem_alloc(ordinal: u32, len: usize) -> Result<u64> {
    set_current(ordinal)?;
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: driver loaded, context current; `p` is a valid out-pointer.
    check("cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut p, len) })?;
    Ok(p)
}

pub(crate) fn mem_free(ordinal: u32, ptr: u64) -> Result<()> {
    set_current(ordinal)?;
    // SAFETY: `ptr` came from `mem_alloc` and is freed once by its owner.
    check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
}

/// Pinned, portable (not write-combined: the CPU and the NIC read it) host memory.
pub(crate) fn host_alloc(ordinal: u32, len: usize) -> Result<*mut u8> {
    set_current(ordinal)?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: driver loaded, context current; `p` is a valid out-pointer.
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut p, len, sys::CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(p.cast())
}

pub(crate) fn host_free(ordinal: u32, ptr: *mut u8) -> Result<()> {
    set_current(ordinal)?;
    // SAFETY: `ptr` came from `host_alloc` and is freed once by its owner.
    check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(ptr.cast()) })
}

/// Export a dma-buf fd for `[ptr, ptr+len)` (both host-page aligned).
pub(crate) fn dmabuf_export(ordinal: u32, ptr: u64, len: usize) -> Result<OwnedFd> {
    let info = loaded()?;
    if !info.has_dmabuf_export {
        return Err(GpuError::Unavailable(Unavailable::MissingSymbol(
            SYM_DMABUF,
        )));
    }
    set_current(ordinal)?;
    let mut fd: c_int = -1;
    // SAFETY: symbol checked in `load`; the driver writes one int (the fd) through
    // the handle pointer for the DMA_BUF_FD handle type.
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut c_int).cast(),
            ptr,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(GpuError::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: 0,
            name: format!("returned fd {fd}"),
        });
    }
    // SAFETY: the driver handed us a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A CUDA stream (non-blocking w.r.t. the legacy default stream).
#[derive(Debug)]
pub(crate) struct Stream {
    raw: usize,
    ordinal: u32,
}

impl Stream {
    pub(crate) fn new(ordinal: u32) -> Result<Self> {
        set_current(ordinal)?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: driver loaded, context current; `s` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Self {
            raw: s as usize,
            ordinal,
        })
    }

    fn raw(&self) -> sys::CUstream {
        self.raw as sys::CUstream
    }

    /// Queue a device-to-host copy.
    ///
    /// # Safety
    /// `dst..dst+len` must be pinned host memory and `src..src+len` device memory,
    /// both staying valid and unaliased by writers until the copy completed.
    pub(crate) unsafe fn dtoh_async(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        set_current(self.ordinal)?;
        // SAFETY: the caller upholds the range contract; the stream is live.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw())
        })
    }

    /// Queue a host-to-device copy.
    ///
    /// # Safety
    /// As for [`Stream::dtoh_async`], with the directions swapped.
    pub(crate) unsafe fn htod_async(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        set_current(self.ordinal)?;
        // SAFETY: the caller upholds the range contract; the stream is live.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw())
        })
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        set_current(self.ordinal)?;
        // SAFETY: the stream is live.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw())
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if set_current(self.ordinal).is_ok() {
            // SAFETY: the stream is live and dropped once; pending work finishes first
            // (cuStreamDestroy defers the release until the stream is idle).
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw()) };
        }
    }
}

/// A CUDA event (timing disabled: cheaper, we only order and query).
#[derive(Debug)]
pub(crate) struct Event {
    raw: usize,
    ordinal: u32,
}

/// Result of querying an event.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum EventState {
    Done,
    Pending,
}

impl Event {
    pub(crate) fn new(ordinal: u32) -> Result<Self> {
        set_current(ordinal)?;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: driver loaded, context current; `e` is a valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Self {
            raw: e as usize,
            ordinal,
        })
    }

    fn raw(&self) -> sys::CUevent {
        self.raw as sys::CUevent
    }

    pub(crate) fn record(&self, stream: &Stream) -> Result<()> {
        set_current(self.ordinal)?;
        // SAFETY: event and stream are live.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw(), stream.raw())
        })
    }

    pub(crate) fn query(&self) -> Result<EventState> {
        set_current(self.ordinal)?;
        // SAFETY: the event is live.
        let r = unsafe { sys::cuEventQuery(self.raw()) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(EventState::Pending);
        }
        check("cuEventQuery", r).map(|()| EventState::Done)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if set_current(self.ordinal).is_ok() {
            // SAFETY: the event is live and destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw()) };
        }
    }
}
