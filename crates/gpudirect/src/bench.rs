//! Measurements shared by `pagewire bench pages --gpu`, the GPU check script and
//! the criterion benches: plain one-shot copies (the `cudaMemcpy` reference) and
//! the staged pipeline in each direction.

use std::time::{Duration, Instant};

use crate::copy::{CopyEngine, Direction};
use crate::error::Result;
use crate::memory::{DeviceBuffer, PinnedBuffer};
use crate::staging::{PipelineStats, Segment, StagedPipeline, StagingConfig, Wire};
use crate::testing::NullWire;

/// One bandwidth figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Bytes per iteration.
    pub bytes: u64,
    /// Iterations.
    pub iters: u32,
    /// Best single iteration.
    pub best: Duration,
    /// Mean over iterations.
    pub mean: Duration,
}

impl Rate {
    fn from_samples(bytes: u64, samples: &[Duration]) -> Self {
        let best = samples.iter().copied().min().unwrap_or_default();
        let total: Duration = samples.iter().sum();
        let n = samples.len().max(1) as u32;
        Self {
            bytes,
            iters: samples.len() as u32,
            best,
            mean: total / n,
        }
    }
    /// GB/s (10^9 B/s) of the mean iteration.
    pub fn gb_per_s(&self) -> f64 {
        let s = self.mean.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
    /// GB/s of the best iteration.
    pub fn best_gb_per_s(&self) -> f64 {
        let s = self.best.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
}

/// One plain copy of `dev` ↔ `host` in `dir` per iteration: what `cudaMemcpyAsync`
/// into pinned memory achieves on this machine (the reference for staging).
pub fn plain_copy(
    copy: &dyn CopyEngine,
    dev: &DeviceBuffer,
    host: &PinnedBuffer,
    dir: Direction,
    iters: u32,
    timeout: Duration,
) -> Result<Rate> {
    let len = dev.len().min(host.len());
    let mut samples = Vec::with_capacity(iters as usize);
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        // SAFETY: both buffers are borrowed (alive) and big enough for `len`; we
        // synchronize on the ticket before the next iteration or returning.
        unsafe {
            match dir {
                Direction::D2H => copy.d2h_async(dev.ptr(), host.as_ptr(), len)?,
                Direction::H2D => copy.h2d_async(host.as_ptr(), dev.ptr(), len)?,
            }
        }
        let t = copy.record(dir)?;
        copy.synchronize(t, Instant::now() + timeout)?;
        samples.push(t0.elapsed());
    }
    Ok(Rate::from_samples(len as u64, &samples))
}

/// Run `f` `iters` times and turn the pipeline stats into a rate.
fn repeat(bytes: u64, iters: u32, mut f: impl FnMut() -> Result<PipelineStats>) -> Result<Rate> {
    let mut samples = Vec::with_capacity(iters as usize);
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        f()?;
        samples.push(t0.elapsed());
    }
    Ok(Rate::from_samples(bytes, &samples))
}

/// Staged device-to-host through the ring only (wire writes complete at once).
pub fn staged_d2h<C: CopyEngine>(
    copy: C,
    dev: &DeviceBuffer,
    cfg: StagingConfig,
    iters: u32,
) -> Result<Rate> {
    let mut p = StagedPipeline::new(copy, NullWire::new(), cfg)?;
    let seg = [Segment {
        local_off: 0,
        remote_off: 0,
        len: dev.len() as u64,
    }];
    repeat(dev.len() as u64, iters, || p.write(dev.span(), &seg, None))
}

/// Staged host-to-device through the ring only (wire reads complete at once).
pub fn staged_h2d<C: CopyEngine>(
    copy: C,
    dev: &DeviceBuffer,
    cfg: StagingConfig,
    iters: u32,
) -> Result<Rate> {
    let mut p = StagedPipeline::new(copy, NullWire::new(), cfg)?;
    let seg = [Segment {
        local_off: 0,
        remote_off: 0,
        len: dev.len() as u64,
    }];
    repeat(dev.len() as u64, iters, || p.read(dev.span(), &seg))
}

/// Staged write of all of `dev` through `wire` (e.g. a transport engine) to
/// remote offset 0, then staged read back; returns (write, read) rates.
pub fn staged_end_to_end<C: CopyEngine, W: Wire>(
    copy: C,
    wire: W,
    dev: &DeviceBuffer,
    cfg: StagingConfig,
    iters: u32,
) -> Result<(Rate, Rate)> {
    let mut p = StagedPipeline::new(copy, wire, cfg)?;
    let seg = [Segment {
        local_off: 0,
        remote_off: 0,
        len: dev.len() as u64,
    }];
    let w = repeat(dev.len() as u64, iters, || p.write(dev.span(), &seg, None))?;
    let r = repeat(dev.len() as u64, iters, || p.read(dev.span(), &seg))?;
    Ok((w, r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostCopyEngine;
    use std::sync::Arc;

    #[test]
    fn host_rates_are_positive() {
        let copy = Arc::new(HostCopyEngine::default());
        let dev = copy.alloc_device(1 << 20).unwrap();
        let host = copy.alloc_pinned(1 << 20).unwrap();
        let t = Duration::from_secs(5);
        let r = plain_copy(&*copy, &dev, &host, Direction::D2H, 2, t).unwrap();
        assert!(r.gb_per_s() > 0.0 && r.best <= r.mean);
        let cfg = StagingConfig {
            chunk_size: 128 << 10,
            depth: 3,
            timeout: t,
        };
        assert!(staged_d2h(copy.clone(), &dev, cfg, 2).unwrap().gb_per_s() > 0.0);
        assert!(staged_h2d(copy.clone(), &dev, cfg, 2).unwrap().gb_per_s() > 0.0);
        let wire = crate::testing::MemWire::new(1 << 20);
        let (w, r) = staged_end_to_end(copy, wire, &dev, cfg, 1).unwrap();
        assert_eq!((w.bytes, r.bytes), (1 << 20, 1 << 20));
    }
}
