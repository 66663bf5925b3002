//! [`GpuEngine`]: GPU regions behind the same transfer API as host memory.
//!
//! `register_gpu` decides per region between direct (the NIC reaches device
//! memory: dma-buf, then peermem) and staged (through the pinned ring), logs the
//! decision with its reason, and lets the caller force either. `submit_plan` takes
//! the same `(src, dst, len)` plans as `pagewire_transport::Engine::submit_plan`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pagewire_transport::{Access, BackendKind, Engine, Op, PeerId, RegionId, TransferHandle};

use crate::copy::CopyEngine;
use crate::engine_wire::EngineWire;
use crate::error::{GpuError, Result};
use crate::memory::{DeviceBuffer, DevicePtr, DeviceSpan};
use crate::path::{GpuMode, GpuPath, PathDecision, PathEvidence, Step, decide};
use crate::staging::{PipelineStats, Segment, StagedPipeline, StagingConfig};

/// Handle of a registered GPU region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuRegionId(u64);

impl GpuRegionId {
    /// The raw id.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// What `register_gpu` decided for a region.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuRegionInfo {
    /// The handle.
    pub id: GpuRegionId,
    /// First device address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Direct or staged, and why.
    pub decision: PathDecision,
    /// The transport registration of a direct region.
    pub transport_region: Option<RegionId>,
}

struct Region {
    info: GpuRegionInfo,
    // Keeps an owned buffer alive while registered.
    _keep: Option<Arc<DeviceBuffer>>,
}

type Pipeline = StagedPipeline<Arc<dyn CopyEngine>, EngineWire>;

/// A transfer submitted through a [`GpuEngine`].
#[derive(Debug)]
#[non_exhaustive]
pub enum GpuTransfer {
    /// Posted directly on the transport (device memory registered with the NIC).
    Direct(TransferHandle),
    /// Staged: ran to completion on the calling thread.
    Staged(PipelineStats),
}

impl GpuTransfer {
    /// Wait for completion; returns the bytes moved.
    pub fn wait(&self, deadline: Instant) -> Result<u64> {
        match self {
            Self::Direct(h) => h
                .wait(deadline)
                .map(|s| s.bytes)
                .map_err(|e| GpuError::Transport(e.to_string())),
            Self::Staged(s) => Ok(s.bytes),
        }
    }
}

/// GPU memory over a transport engine; see the module docs.
pub struct GpuEngine {
    engine: Engine,
    copy: Arc<dyn CopyEngine>,
    cfg: StagingConfig,
    regions: Mutex<HashMap<u64, Region>>,
    next: Mutex<u64>,
    pipelines: Mutex<HashMap<PeerId, Arc<Mutex<Pipeline>>>>,
}

impl fmt::Debug for GpuEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuEngine")
            .field("engine", &self.engine)
            .field("copy", &self.copy.name())
            .field("staging", &self.cfg)
            .finish()
    }
}

/// Where GPU `ordinal`'s memory is, for the transport's rail choice (its PCI address).
fn gpu_location(ordinal: u32) -> Option<pagewire_transport::topology::MemoryLocation> {
    let cuda = crate::probe::cuda().ok()?;
    let g = cuda.gpus.get(ordinal as usize)?;
    pagewire_transport::topology::MemoryLocation::gpu(&g.pci_bus_id)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GpuEngine {
    /// Wrap `engine`; staged regions copy with `copy` through rings shaped by `cfg`.
    pub fn new(engine: Engine, copy: Arc<dyn CopyEngine>, cfg: StagingConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            engine,
            copy,
            cfg,
            regions: Mutex::new(HashMap::new()),
            next: Mutex::new(1),
            pipelines: Mutex::new(HashMap::new()),
        })
    }

    /// The transport engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Register an owned device buffer (kept alive until deregistered).
    pub fn register_gpu(
        &self,
        buf: Arc<DeviceBuffer>,
        access: Access,
        mode: GpuMode,
    ) -> Result<GpuRegionInfo> {
        let (ptr, len, ord) = (buf.ptr(), buf.len(), buf.cuda_ordinal());
        // SAFETY: `buf` is kept alive in the region entry until deregistration.
        unsafe { self.register_inner(ptr, len, ord, access, mode, Some(buf)) }
    }

    /// Register device memory the caller owns (e.g. a framework's KV pool).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be device memory of GPU `ordinal` (or of this engine's
    /// copy engine), staying allocated until [`GpuEngine::deregister`].
    pub unsafe fn register_gpu_raw(
        &self,
        ptr: DevicePtr,
        len: usize,
        ordinal: Option<u32>,
        access: Access,
        mode: GpuMode,
    ) -> Result<GpuRegionInfo> {
        // SAFETY: forwarded contract.
        unsafe { self.register_inner(ptr, len, ordinal, access, mode, None) }
    }

    unsafe fn register_inner(
        &self,
        ptr: DevicePtr,
        len: usize,
        ordinal: Option<u32>,
        access: Access,
        mode: GpuMode,
        keep: Option<Arc<DeviceBuffer>>,
    ) -> Result<GpuRegionInfo> {
        let kind = self.engine.backend_kind();
        let dmabuf_attr = ordinal
            .and_then(|o| {
                crate::probe::cuda()
                    .ok()
                    .and_then(|c| c.gpus.get(o as usize))
            })
            .is_some_and(|g| g.dma_buf);
        let mut transport_region = None;
        let ev = if kind != BackendKind::Verbs || mode == GpuMode::Staged {
            PathEvidence::no_rdma(dmabuf_attr, &format!("{} backend", kind.as_str()))
        } else {
            let dev = self.engine.backend_info().device;
            let page = crate::memory::HOST_ALIGN as u64;
            let aligned = ptr.0.is_multiple_of(page) && (len as u64).is_multiple_of(page);
            #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
            let mut fd: Option<std::os::fd::OwnedFd> = None;
            let dmabuf_export = match (dmabuf_attr, ordinal) {
                (false, _) => Step::NotTried("attribute says unsupported".into()),
                (true, None) => Step::NotTried("not a CUDA allocation".into()),
                (true, Some(_)) if !aligned => {
                    Step::NotTried(format!("range {:#x}+{len} is not host-page aligned", ptr.0))
                }
                #[cfg(feature = "cuda")]
                (true, Some(o)) => match crate::ffi::dmabuf_export(o, ptr.0, len) {
                    Ok(f) => {
                        fd = Some(f);
                        Step::Ok
                    }
                    Err(e) => Step::Failed(e.to_string()),
                },
                #[cfg(not(feature = "cuda"))]
                (true, Some(_)) => Step::NotTried("built without CUDA".into()),
            };
            let reg_dmabuf_mr = match &fd {
                None => Step::NotTried("no dma-buf fd".into()),
                Some(f) => {
                    use std::os::fd::AsFd;
                    // SAFETY: the fd exports exactly [ptr, ptr+len), which the
                    // caller's contract keeps allocated until deregistration; the
                    // region is addressed by the device addresses (iova = ptr).
                    let r = unsafe {
                        self.engine
                            .register_dmabuf(f.as_fd(), 0, len, ptr.0, access)
                    };
                    match r {
                        Ok(id) => {
                            transport_region = Some(id);
                            Step::Ok
                        }
                        Err(e) => Step::Failed(e.to_string()),
                    }
                }
            };
            // Each MR holds its own reference to the dma-buf.
            drop(fd);
            let reg_mr_peermem = if transport_region.is_some() {
                Step::NotTried("dma-buf registration succeeded".into())
            } else {
                // SAFETY: the caller's contract keeps the range allocated until
                // deregistration, when we deregister it from the transport too.
                let reg = unsafe { self.engine.register_raw(ptr.0 as *mut u8, len, access) };
                match reg {
                    Ok(id) => {
                        transport_region = Some(id);
                        Step::Ok
                    }
                    Err(e) => Step::Failed(e.to_string()),
                }
            };
            PathEvidence {
                rdma_device: Some(dev),
                dmabuf_attr,
                dmabuf_export,
                reg_dmabuf_mr,
                reg_mr_peermem,
            }
        };
        let decision = match decide(&ev, mode) {
            Ok(d) => d,
            Err(reason) => {
                if let Some(id) = transport_region {
                    let _ = self.engine.deregister(id);
                }
                return Err(GpuError::ModeUnavailable {
                    mode: "direct",
                    reason,
                });
            }
        };
        if decision.path == GpuPath::Staged
            && let Some(id) = transport_region.take()
        {
            let _ = self.engine.deregister(id);
        }
        // Direct: the transport's rails nearest this GPU carry the region's batches.
        if let (Some(id), Some(loc)) = (transport_region, ordinal.and_then(gpu_location)) {
            let _ = self.engine.set_memory_location(id, &loc);
        }
        let id = {
            let mut n = lock(&self.next);
            *n += 1;
            GpuRegionId(*n - 1)
        };
        tracing::info!(
            region = id.0,
            addr = format_args!("{:#x}", ptr.0),
            len,
            path = %decision.path,
            reason = %decision.reason,
            "GPU region registered"
        );
        let info = GpuRegionInfo {
            id,
            addr: ptr.0,
            len: len as u64,
            decision,
            transport_region,
        };
        lock(&self.regions).insert(
            id.0,
            Region {
                info: info.clone(),
                _keep: keep,
            },
        );
        Ok(info)
    }

    /// Forget a region (and its transport registration, if direct).
    pub fn deregister(&self, id: GpuRegionId) -> Result<()> {
        let r = lock(&self.regions)
            .remove(&id.0)
            .ok_or(GpuError::UnknownRegion(id.0))?;
        if let Some(t) = r.info.transport_region {
            self.engine
                .deregister(t)
                .map_err(|e| GpuError::Transport(e.to_string()))?;
        }
        Ok(())
    }

    /// What was decided for a region.
    pub fn region(&self, id: GpuRegionId) -> Result<GpuRegionInfo> {
        lock(&self.regions)
            .get(&id.0)
            .map(|r| r.info.clone())
            .ok_or(GpuError::UnknownRegion(id.0))
    }

    fn pipeline(&self, peer: PeerId) -> Result<Arc<Mutex<Pipeline>>> {
        let mut m = lock(&self.pipelines);
        if let Some(p) = m.get(&peer) {
            return Ok(p.clone());
        }
        // Remote offsets are absolute remote addresses: base 0.
        let wire =
            EngineWire::new(self.engine.clone(), peer, 0).with_batch_timeout(self.cfg.timeout);
        let p = Arc::new(Mutex::new(StagedPipeline::new(
            self.copy.clone(),
            wire,
            self.cfg,
        )?));
        m.insert(peer, p.clone());
        Ok(p)
    }

    /// Submit a plan of `(src, dst, len)` in data-flow order, exactly as for
    /// `Engine::submit_plan`: for `Op::Write`, `src` is in GPU region `region`
    /// and `dst` remote; for `Op::Read`, `src` is remote and `dst` in the region.
    /// Direct regions go straight to the transport; staged ones run the pipeline
    /// on this thread (the returned transfer is then already complete).
    pub fn submit_plan(
        &self,
        peer: PeerId,
        region: GpuRegionId,
        op: Op,
        plan: &[(u64, u64, u64)],
        notify: Option<u32>,
    ) -> Result<GpuTransfer> {
        let info = self.region(region)?;
        if info.decision.path.is_direct() {
            let h = self
                .engine
                .submit_plan(peer, op, plan.iter().copied(), notify)
                .map_err(|e| GpuError::Transport(e.to_string()))?;
            return Ok(GpuTransfer::Direct(h));
        }
        let mut segs = Vec::with_capacity(plan.len());
        for &(src, dst, len) in plan {
            let (local, remote) = match op {
                Op::Write => (src, dst),
                Op::Read => (dst, src),
                #[allow(unreachable_patterns)]
                _ => {
                    return Err(GpuError::Transport(format!("unsupported op {op:?}")));
                }
            };
            let local_off = local.checked_sub(info.addr).ok_or(GpuError::OutOfRange {
                offset: local,
                len,
                size: info.len,
            })?;
            segs.push(Segment {
                local_off,
                remote_off: remote,
                len,
            });
        }
        // SAFETY: the region's registration contract keeps [addr, addr+len) alive
        // while registered; `run` bounds-checks every segment against it.
        let span = unsafe { DeviceSpan::from_raw(DevicePtr(info.addr), info.len as usize) };
        let p = self.pipeline(peer)?;
        let mut p = lock(&p);
        let stats = match op {
            Op::Read => {
                if notify.is_some() {
                    return Err(GpuError::Config(
                        "notify on a staged read is not supported".into(),
                    ));
                }
                p.read(span, &segs)?
            }
            _ => p.write(span, &segs, notify)?,
        };
        tracing::debug!(
            region = region.0,
            bytes = stats.bytes,
            chunks = stats.chunks,
            gbps = stats.gb_per_s(),
            "staged transfer done"
        );
        Ok(GpuTransfer::Staged(stats))
    }
}

/// The path GPU `ordinal` would take through `engine`, found by registering a
/// small device buffer for real (dma-buf export and registration, then peermem),
/// exactly as [`GpuEngine::register_gpu`] does in `Auto` mode. Never fails: a
/// missing driver or GPU is a `Staged` answer with the reason.
pub fn detect_path(engine: &Engine, ordinal: u32) -> PathDecision {
    let staged = |reason: String| PathDecision {
        path: GpuPath::Staged,
        reason,
    };
    if let Err(why) = crate::probe::cuda() {
        return staged(format!("CUDA unavailable: {why}"));
    }
    #[cfg(feature = "cuda")]
    {
        let copy = match crate::copy::CudaCopyEngine::new(ordinal) {
            Ok(c) => Arc::new(c) as Arc<dyn CopyEngine>,
            Err(e) => return staged(format!("GPU {ordinal}: {e}")),
        };
        // 2 MiB: host-page (and huge-page) aligned, as dma-buf export needs.
        let buf = match copy.alloc_device(2 << 20) {
            Ok(b) => Arc::new(b),
            Err(e) => return staged(format!("GPU {ordinal}: test allocation failed: {e}")),
        };
        let ge = match GpuEngine::new(engine.clone(), copy, StagingConfig::default()) {
            Ok(g) => g,
            Err(e) => return staged(e.to_string()),
        };
        match ge.register_gpu(buf, Access::ALL, GpuMode::Auto) {
            Ok(info) => {
                let _ = ge.deregister(info.id);
                info.decision
            }
            Err(e) => staged(e.to_string()),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (engine, ordinal);
        staged("built without CUDA".into())
    }
}
