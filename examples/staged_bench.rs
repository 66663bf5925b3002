//! The staged-mode GPU benchmark of the `gpu_staged_bench` example (which
//! `scripts/gpu-check.sh` runs): plain one-shot copies (the `cudaMemcpy` reference), the
//! staged pipeline in each direction through the ring alone, and staged transfers end to
//! end over a transport engine, with the bytes verified on the far side. Its flags are
//! parsed here too ([`StagedBenchOptions::from_args`]): the library has no flags.

use std::time::{Duration, Instant};

use pagewire_gpudirect::testing::NullWire;
use pagewire_gpudirect::{
    CopyEngine, DeviceBuffer, Direction, GpuError, PinnedBuffer, Result, Segment, StagedPipeline,
    StagingConfig, Unavailable, Wire,
};

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
        gb_per_s(self.bytes, self.mean)
    }
    /// GB/s of the best iteration.
    pub fn best_gb_per_s(&self) -> f64 {
        gb_per_s(self.bytes, self.best)
    }
}

/// `bytes` moved in `d`, in GB/s (0 for a zero duration).
fn gb_per_s(bytes: u64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 }
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
    repeat(len as u64, iters, || {
        // SAFETY: both buffers are borrowed (alive) and big enough for `len`; we
        // synchronize on the ticket before the next iteration or returning.
        unsafe {
            match dir {
                Direction::D2H => copy.d2h_async(dev.ptr(), host.as_ptr(), len)?,
                Direction::H2D => copy.h2d_async(host.as_ptr(), dev.ptr(), len)?,
            }
        }
        let t = copy.record(dir)?;
        copy.synchronize(t, Instant::now() + timeout)
    })
}

/// Time `f` over `iters` iterations (at least one), `bytes` each, into a rate.
fn repeat<T>(bytes: u64, iters: u32, mut f: impl FnMut() -> Result<T>) -> Result<Rate> {
    let mut samples = Vec::with_capacity(iters as usize);
    for _ in 0..iters.max(1) {
        let t0 = Instant::now();
        f()?;
        samples.push(t0.elapsed());
    }
    Ok(Rate::from_samples(bytes, &samples))
}

/// One segment covering all of `dev`, at remote offset 0.
fn whole(dev: &DeviceBuffer) -> [Segment; 1] {
    [Segment {
        local_off: 0,
        remote_off: 0,
        len: dev.len() as u64,
    }]
}

/// Staged device-to-host through the ring only (wire writes complete at once).
pub fn staged_d2h<C: CopyEngine>(
    copy: C,
    dev: &DeviceBuffer,
    cfg: StagingConfig,
    iters: u32,
) -> Result<Rate> {
    let mut p = StagedPipeline::new(copy, NullWire::new(), cfg)?;
    let seg = whole(dev);
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
    let seg = whole(dev);
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
    let seg = whole(dev);
    let w = repeat(dev.len() as u64, iters, || p.write(dev.span(), &seg, None))?;
    let r = repeat(dev.len() as u64, iters, || p.read(dev.span(), &seg))?;
    Ok((w, r))
}

/// Options of [`run_staged_bench`] (what `pagewire bench pages --gpu`, the
/// `gpu_staged_bench` example and `scripts/gpu-check.sh` run).
#[derive(Debug, Clone)]
pub struct StagedBenchOptions {
    /// GPU ordinal.
    pub gpu: u32,
    /// Bytes per transfer.
    pub bytes: usize,
    /// Ring geometry.
    pub staging: StagingConfig,
    /// Iterations per figure.
    pub iters: u32,
    /// Transport for the end-to-end figures (`Loopback` or `Tcp`).
    pub backend: pagewire_transport::BackendKind,
    /// Fail instead of falling back to the host stand-in when CUDA is missing.
    pub require_gpu: bool,
}

impl Default for StagedBenchOptions {
    fn default() -> Self {
        Self {
            gpu: 0,
            bytes: 256 << 20,
            staging: StagingConfig::default(),
            iters: 5,
            backend: pagewire_transport::BackendKind::Loopback,
            require_gpu: false,
        }
    }
}

/// `256M`, `2M`, `64K`, `1G` or a plain byte count.
pub fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let (num, mul) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1usize << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("bad size {s:?} (e.g. 256M, 64K, 4096)"))
}

impl StagedBenchOptions {
    /// Parse `--gpu N --bytes SIZE --chunk SIZE --depth N --iters N
    /// --backend loopback|tcp --require-gpu` (every flag optional).
    pub fn from_args<I: IntoIterator<Item = String>>(args: I) -> std::result::Result<Self, String> {
        let mut o = Self::default();
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            if flag == "--require-gpu" {
                o.require_gpu = true;
                continue;
            }
            let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let num = |v: &str| {
                v.parse::<u32>()
                    .map_err(|_| format!("{flag}: bad number {v:?}"))
            };
            match flag.as_str() {
                "--gpu" => o.gpu = num(&v)?,
                "--bytes" => o.bytes = parse_size(&v)?,
                "--chunk" => o.staging.chunk_size = parse_size(&v)?,
                "--depth" => o.staging.depth = num(&v)? as usize,
                "--iters" => o.iters = num(&v)?,
                "--backend" => {
                    o.backend = match v.as_str() {
                        "loopback" => pagewire_transport::BackendKind::Loopback,
                        "tcp" => pagewire_transport::BackendKind::Tcp,
                        _ => return Err(format!("--backend {v:?}: loopback or tcp")),
                    }
                }
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        if o.bytes == 0 || o.iters == 0 {
            return Err("--bytes and --iters must be > 0".into());
        }
        Ok(o)
    }
}

/// Figures of [`run_staged_bench`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StagedBenchReport {
    /// Copy engine used ("cuda:0" or "host").
    pub engine: String,
    /// GPU name, or why the host stand-in was used.
    pub device: String,
    /// Options.
    pub options: StagedBenchOptions,
    /// One plain device-to-host copy of all bytes (the cudaMemcpy reference).
    pub plain_d2h: Rate,
    /// One plain host-to-device copy.
    pub plain_h2d: Rate,
    /// Staged device-to-host through the ring (wire writes free).
    pub staged_d2h: Rate,
    /// Staged host-to-device through the ring (wire reads free).
    pub staged_h2d: Rate,
    /// Host → remote host write over the same engines, one batch, no GPU: the
    /// wire's own ceiling, which the staged end-to-end write cannot beat.
    pub wire_write: Rate,
    /// Remote host → host read over the same engines, one batch, no GPU.
    pub wire_read: Rate,
    /// Staged write GPU → remote host memory over the transport.
    pub e2e_write: Rate,
    /// Staged read remote host memory → GPU over the transport.
    pub e2e_read: Rate,
    /// Bytes were verified at the far end after the write and after the read.
    pub verified: bool,
}

impl std::fmt::Display for StagedBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "staged GPU bench: engine {} ({}), {} MiB per transfer, ring {} x {} KiB, {} iteration(s), e2e over {}",
            self.engine,
            self.device,
            o.bytes >> 20,
            o.staging.depth,
            o.staging.chunk_size >> 10,
            o.iters,
            o.backend.as_str()
        )?;
        writeln!(
            f,
            "{:<34} {:>12} {:>12} {:>12}",
            "path", "GB/s mean", "GB/s best", "vs ref"
        )?;
        let row =
            |f: &mut std::fmt::Formatter<'_>, name: &str, r: &Rate, reference: Option<&Rate>| {
                let vs = reference.map_or(String::new(), |p| {
                    format!("{:.0}%", 100.0 * r.gb_per_s() / p.gb_per_s().max(1e-12))
                });
                writeln!(
                    f,
                    "{:<34} {:>12.2} {:>12.2} {:>12}",
                    name,
                    r.gb_per_s(),
                    r.best_gb_per_s(),
                    vs
                )
            };
        row(f, "memcpy D2H (one copy, reference)", &self.plain_d2h, None)?;
        row(
            f,
            "staged D2H (ring only)",
            &self.staged_d2h,
            Some(&self.plain_d2h),
        )?;
        row(f, "memcpy H2D (one copy, reference)", &self.plain_h2d, None)?;
        row(
            f,
            "staged H2D (ring only)",
            &self.staged_h2d,
            Some(&self.plain_h2d),
        )?;
        // The end-to-end rows are bounded by the slower of the copy and the wire;
        // over loopback and TCP that is the wire, so they are compared with it.
        let wire = o.backend.as_str();
        row(
            f,
            &format!("{wire} write host -> remote (ref)"),
            &self.wire_write,
            None,
        )?;
        row(
            f,
            "staged write GPU -> remote (e2e)",
            &self.e2e_write,
            Some(&self.wire_write),
        )?;
        row(
            f,
            &format!("{wire} read remote -> host (ref)"),
            &self.wire_read,
            None,
        )?;
        row(
            f,
            "staged read remote -> GPU (e2e)",
            &self.e2e_read,
            Some(&self.wire_read),
        )?;
        write!(
            f,
            "bytes verified at the far end: {}",
            if self.verified { "yes" } else { "NO" }
        )
    }
}

/// Pick the copy engine: CUDA on GPU `gpu` when available, else the host
/// stand-in (or an error when `require_gpu`).
pub fn pick_engine(
    gpu: u32,
    require_gpu: bool,
) -> Result<(std::sync::Arc<dyn CopyEngine>, String)> {
    let fallback = |why: Unavailable| -> Result<(std::sync::Arc<dyn CopyEngine>, String)> {
        if require_gpu {
            return Err(GpuError::Unavailable(why));
        }
        Ok((
            std::sync::Arc::new(pagewire_gpudirect::HostCopyEngine::default()),
            format!("host stand-in: CUDA unavailable: {why}"),
        ))
    };
    match pagewire_gpudirect::probe::cuda() {
        #[cfg(feature = "cuda")]
        Ok(info) => {
            let name = info
                .gpus
                .get(gpu as usize)
                .map(|g| g.name.clone())
                .ok_or(GpuError::NoSuchDevice(gpu))?;
            Ok((
                std::sync::Arc::new(pagewire_gpudirect::CudaCopyEngine::new(gpu)?),
                name,
            ))
        }
        // This package built without its `cuda` feature has no CUDA engine to offer,
        // even where another package turned the library's CUDA on.
        #[cfg(not(feature = "cuda"))]
        Ok(_) => {
            let _ = gpu; // only a CUDA engine has an ordinal
            fallback(Unavailable::FeatureDisabled)
        }
        Err(why) => fallback(why),
    }
}

/// The staged-mode benchmark: plain copies (reference), staged copies through
/// the ring, and staged transfers end to end over a transport engine, with the
/// bytes verified on the far side.
pub fn run_staged_bench(o: &StagedBenchOptions) -> Result<StagedBenchReport> {
    use pagewire_transport::{Access, Engine, EngineConfig, HostBuffer};
    let terr = |e: pagewire_transport::Error| GpuError::Transport(e.to_string());
    o.staging.validate()?;
    let (copy, device) = pick_engine(o.gpu, o.require_gpu)?;
    let timeout = o.staging.timeout;
    let dev = copy.alloc_device(o.bytes)?;
    let host = copy.alloc_pinned(o.bytes)?;
    let data: Vec<u8> = (0..o.bytes)
        .map(|i| (i as u8).wrapping_mul(167) ^ (i >> 16) as u8)
        .collect();
    copy.upload(&dev, 0, &data, timeout)?;

    // Warm-up: first touches of pinned memory and streams cost extra.
    plain_copy(&*copy, &dev, &host, Direction::D2H, 1, timeout)?;
    let plain_d2h = plain_copy(&*copy, &dev, &host, Direction::D2H, o.iters, timeout)?;
    let plain_h2d = plain_copy(&*copy, &dev, &host, Direction::H2D, o.iters, timeout)?;
    drop(host);
    let staged_d2h = staged_d2h(copy.clone(), &dev, o.staging, o.iters)?;
    let staged_h2d = staged_h2d(copy.clone(), &dev, o.staging, o.iters)?;
    // The H2D runs wrote ring garbage (NullWire reads nothing) into `dev`:
    // restore the pattern before the end-to-end runs.
    copy.upload(&dev, 0, &data, timeout)?;

    let mk = || {
        EngineConfig::builder()
            .backend(o.backend)
            .listen("127.0.0.1:0".parse().expect("literal address"))
            .build()
            .and_then(Engine::new)
            .map_err(terr)
    };
    let (local, remote) = (mk()?, mk()?);
    let pool = HostBuffer::new(o.bytes).map_err(terr)?;
    remote
        .register(
            &pool,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .map_err(terr)?;
    let peer = local.connect(remote.local_addr()).map_err(terr)?;

    // The wire alone: the same bytes host to host in one batch, same engines.
    let src = HostBuffer::new(o.bytes).map_err(terr)?;
    local.register(&src, Access::LOCAL_WRITE).map_err(terr)?;
    let one_batch = |write: bool| {
        let len = o.bytes as u64;
        let b = pagewire_transport::Batch::new().timeout(timeout);
        let b = if write {
            b.write(src.addr(), pool.addr(), len)
        } else {
            b.read(src.addr(), pool.addr(), len)
        };
        local
            .submit(peer, b)
            .and_then(|h| h.wait(std::time::Instant::now() + timeout))
            .map_err(terr)
    };
    one_batch(true)?; // warm-up: first touches of both buffers
    let wire_write = repeat(o.bytes as u64, o.iters, || one_batch(true))?;
    let wire_read = repeat(o.bytes as u64, o.iters, || one_batch(false))?;
    let seg = [Segment {
        local_off: 0,
        remote_off: 0,
        len: o.bytes as u64,
    }];
    let wire = pagewire_gpudirect::EngineWire::new(local.clone(), peer, pool.addr())
        .with_batch_timeout(timeout);
    let mut p = StagedPipeline::new(copy.clone(), wire, o.staging)?;
    p.write(dev.span(), &seg, None)?; // warm-up
    let e2e_write = repeat(o.bytes as u64, o.iters, || p.write(dev.span(), &seg, None))?;
    let mut verified = pool.to_vec() == data;
    let back = copy.alloc_device(o.bytes)?;
    let e2e_read = repeat(o.bytes as u64, o.iters, || p.read(back.span(), &seg))?;
    let mut out = vec![0u8; o.bytes];
    copy.download(&back, 0, &mut out, timeout)?;
    verified &= out == data;
    drop(p);
    local.shutdown();
    remote.shutdown();
    Ok(StagedBenchReport {
        engine: copy.name(),
        device,
        options: o.clone(),
        plain_d2h,
        plain_h2d,
        staged_d2h,
        staged_h2d,
        wire_write,
        wire_read,
        e2e_write,
        e2e_read,
        verified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_gpudirect::HostCopyEngine;
    use std::sync::Arc;

    #[test]
    fn args_parse() {
        assert_eq!(parse_size("2M"), Ok(2 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("x").is_err());
        let o = StagedBenchOptions::from_args(
            [
                "--bytes",
                "8M",
                "--chunk",
                "512K",
                "--depth",
                "3",
                "--backend",
                "tcp",
                "--require-gpu",
            ]
            .map(String::from),
        )
        .unwrap();
        assert_eq!(
            (o.bytes, o.staging.chunk_size, o.staging.depth),
            (8 << 20, 512 << 10, 3)
        );
        assert!(o.require_gpu);
        assert!(StagedBenchOptions::from_args(["--what".to_string(), "1".to_string()]).is_err());
    }

    #[test]
    fn staged_bench_runs_on_the_host_engine() {
        if pagewire_gpudirect::probe::cuda().is_ok() {
            return; // covered by the GPU check script on GPU machines
        }
        let o = StagedBenchOptions {
            bytes: 1 << 20,
            iters: 1,
            staging: StagingConfig {
                chunk_size: 256 << 10,
                depth: 2,
                timeout: Duration::from_secs(10),
            },
            ..Default::default()
        };
        let r = run_staged_bench(&o).unwrap();
        assert!(r.verified);
        assert_eq!(r.engine, "host");
        let text = r.to_string();
        assert!(text.contains("staged write GPU -> remote"), "{text}");
        // The wire's own rate is printed beside the end-to-end rows.
        assert!(
            text.contains("loopback write host -> remote (ref)"),
            "{text}"
        );
        assert!(r.wire_write.gb_per_s() > 0.0 && r.wire_read.gb_per_s() > 0.0);
        assert!(matches!(
            run_staged_bench(&StagedBenchOptions {
                require_gpu: true,
                ..o
            }),
            Err(GpuError::Unavailable(_))
        ));
    }

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
        let wire = pagewire_gpudirect::testing::MemWire::new(1 << 20);
        let (w, r) = staged_end_to_end(copy, wire, &dev, cfg, 1).unwrap();
        assert_eq!((w.bytes, r.bytes), (1 << 20, 1 << 20));
    }
}
