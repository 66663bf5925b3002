//! One-time CUDA probe: is a driver there, which GPUs, which capabilities.
//!
//! The answer is computed once per process and cached; a machine without CUDA
//! gets a typed [`Unavailable`] answer, never a panic.

use std::sync::OnceLock;

use crate::error::Unavailable;

/// What the probe learned about one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: u32,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// PCI bus id, e.g. `0000:17:00.0` (empty if the driver would not say).
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub total_mem: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` (116).
    pub gpudirect_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (124).
    pub dma_buf: bool,
    /// Attribute queries that failed (reported, treated as "not supported").
    pub notes: Vec<String>,
}

/// What the probe learned about the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CudaInfo {
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8.
    pub driver_version: i32,
    /// Whether the driver exports `cuMemGetHandleForAddressRange` (dma-buf export).
    pub dmabuf_export_symbol: bool,
    /// The GPUs, in ordinal order.
    pub gpus: Vec<GpuInfo>,
}

impl CudaInfo {
    /// Driver version as `major.minor`.
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )
    }
}

/// The cached probe answer: the driver and its GPUs, or why CUDA is unusable.
pub fn cuda() -> Result<&'static CudaInfo, Unavailable> {
    static PROBE: OnceLock<Result<CudaInfo, Unavailable>> = OnceLock::new();
    PROBE
        .get_or_init(probe_uncached)
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether `PAGEWIRE_CUDA` asks us to leave CUDA alone.
fn disabled_by_env() -> bool {
    matches!(
        std::env::var("PAGEWIRE_CUDA").as_deref(),
        Ok("0" | "off" | "false" | "no")
    )
}

#[cfg(not(feature = "cuda"))]
fn probe_uncached() -> Result<CudaInfo, Unavailable> {
    if disabled_by_env() {
        return Err(Unavailable::DisabledByEnv);
    }
    Err(Unavailable::FeatureDisabled)
}

#[cfg(feature = "cuda")]
fn probe_uncached() -> Result<CudaInfo, Unavailable> {
    use crate::ffi::{self, Attr};

    if disabled_by_env() {
        return Err(Unavailable::DisabledByEnv);
    }
    let info = ffi::load()?;
    let n = ffi::device_count().map_err(|e| Unavailable::InitFailed {
        code: -1,
        name: e.to_string(),
    })?;
    if n == 0 {
        return Err(Unavailable::NoDevices);
    }
    let mut gpus = Vec::with_capacity(n);
    for ordinal in 0..n as u32 {
        let mut notes = Vec::new();
        let mut attr = |a: Attr| match ffi::attribute(ordinal, a) {
            Ok(v) => v,
            Err(e) => {
                notes.push(format!("{a:?}: {e}"));
                0
            }
        };
        let compute_capability = (attr(Attr::ComputeMajor), attr(Attr::ComputeMinor));
        let gpudirect_rdma = attr(Attr::GpuDirectRdma) != 0;
        let dma_buf = attr(Attr::DmaBuf) != 0;
        if attr(Attr::UnifiedAddressing) == 0 {
            notes.push("no unified addressing".into());
        }
        gpus.push(GpuInfo {
            ordinal,
            name: ffi::device_name(ordinal).unwrap_or_else(|e| format!("? ({e})")),
            pci_bus_id: ffi::pci_bus_id(ordinal).unwrap_or_default(),
            total_mem: ffi::total_mem(ordinal).unwrap_or(0),
            compute_capability,
            gpudirect_rdma,
            dma_buf,
            notes,
        });
    }
    Ok(CudaInfo {
        driver_version: info.driver_version,
        dmabuf_export_symbol: info.has_dmabuf_export,
        gpus,
    })
}

/// Whether a GPU test must fail instead of skipping (`PAGEWIRE_GPU_REQUIRED=1`).
pub fn gpu_required() -> bool {
    matches!(
        std::env::var("PAGEWIRE_GPU_REQUIRED").as_deref(),
        Ok("1" | "true" | "yes")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_is_cached() {
        let a = cuda();
        let b = cuda();
        match (a, b) {
            (Ok(x), Ok(y)) => assert!(std::ptr::eq(x, y)),
            (Err(x), Err(y)) => {
                assert_eq!(x, y);
                // Every reason renders as a readable sentence.
                assert!(!x.to_string().is_empty());
            }
            _ => panic!("probe answer changed between calls"),
        }
    }

    #[test]
    fn driver_version_formats() {
        let c = CudaInfo {
            driver_version: 12080,
            dmabuf_export_symbol: true,
            gpus: vec![],
        };
        assert_eq!(c.driver_version_string(), "12.8");
    }
}
