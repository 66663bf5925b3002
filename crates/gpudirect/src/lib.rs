//! GPU KV pages over pagewire transports: GPUDirect RDMA (dma-buf or peermem)
//! where the NIC can reach device memory, and a pipelined copy through a ring of
//! pinned host buffers everywhere else.
//!
//! CUDA is loaded dynamically: on a machine without a driver every entry point
//! answers [`Unavailable`] instead of panicking, and the staging pipeline runs
//! with [`HostCopyEngine`] (host memory standing in for device memory).
//!
//! The example below stages into `testing::MemWire`, an in-memory remote region; the
//! `testing` module (in-memory wires for tests, examples and CPU benchmarks) is
//! compiled only with the `testing` feature.
//!
//! ```
//! use pagewire_gpudirect::{probe, testing::MemWire, CopyEngine, HostCopyEngine, Segment,
//!                          StagedPipeline, StagingConfig};
//! use std::time::Duration;
//!
//! // Whatever the machine, the probe answers without panicking.
//! match probe::cuda() {
//!     Ok(info) => println!("{} GPU(s)", info.gpus.len()),
//!     Err(why) => println!("CUDA unavailable: {why}"),
//! }
//!
//! // Stage 1 MiB of "device" memory through a 4 x 64 KiB ring into a remote region.
//! let copy = HostCopyEngine::default();
//! let src = copy.alloc_device(1 << 20)?;
//! let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
//! copy.upload(&src, 0, &data, Duration::from_secs(5))?;
//! let wire = MemWire::new(1 << 20);
//! let remote = wire.remote();
//! let cfg = StagingConfig { chunk_size: 64 << 10, depth: 4, ..Default::default() };
//! let mut pipe = StagedPipeline::new(copy, wire, cfg)?;
//! let seg = Segment { local_off: 0, remote_off: 0, len: 1 << 20 };
//! let stats = pipe.write(src.span(), &[seg], Some(7))?;
//! assert_eq!(stats.chunks, 16);
//! assert_eq!(remote.snapshot(), data);
//! assert_eq!(remote.notifications(), vec![7]);
//! # Ok::<(), pagewire_gpudirect::GpuError>(())
//! ```

pub mod copy;
pub mod engine_wire;
mod error;
#[cfg(feature = "cuda")]
mod ffi;
pub mod memory;
pub mod path;
pub mod probe;
pub mod region;
pub mod remote_ring;
pub mod staging;
#[cfg(feature = "testing")]
pub mod testing;

#[cfg(feature = "cuda")]
pub use copy::CudaCopyEngine;
pub use copy::{CopyEngine, CopyTicket, Direction, HostCopyEngine, HostFaults};
pub use engine_wire::EngineWire;
pub use error::{GpuError, Result, StageKind, Unavailable};
pub use memory::{DeviceBuffer, DevicePtr, DeviceSpan, PinnedBuffer};
pub use path::{GpuMode, GpuPath, PathDecision, PathEvidence};
pub use region::{GpuEngine, GpuRegionId, GpuRegionInfo, GpuTransfer, detect_path};
pub use remote_ring::{CreditBoard, RingDescriptor, RingPushWire, RingReceiver};
pub use staging::{
    Incoming, PipelineStats, Segment, StagedPipeline, StagedReceiver, StagingConfig, TraceEvent,
    Wire, WireOp, WireTicket,
};
