//! Error types of the crate.

use std::fmt;
use std::time::Duration;

/// Why CUDA cannot be used on this machine. Never a panic: every probe failure
/// ends up as one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unavailable {
    /// The crate was built without the `cuda` feature.
    FeatureDisabled,
    /// `PAGEWIRE_CUDA=0` (or `off`) asked us not to touch CUDA.
    DisabledByEnv,
    /// No `libcuda.so` / `libcuda.so.1` could be loaded.
    DriverNotFound,
    /// The driver library lacks a symbol we need (driver older than the bindings).
    MissingSymbol(&'static str),
    /// `cuInit` (or the device count query) returned an error.
    InitFailed {
        /// The `CUresult` code.
        code: i32,
        /// Its name, e.g. `CUDA_ERROR_NO_DEVICE`.
        name: String,
    },
    /// The driver loaded but reports zero devices.
    NoDevices,
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::FeatureDisabled => f.write_str("built without the `cuda` feature"),
            Self::DisabledByEnv => f.write_str("disabled by PAGEWIRE_CUDA=0"),
            Self::DriverNotFound => {
                f.write_str("no CUDA driver library (libcuda.so.1) could be loaded")
            }
            Self::MissingSymbol(s) => write!(f, "CUDA driver lacks symbol {s} (driver too old)"),
            Self::InitFailed { code, name } => write!(f, "cuInit failed: {name} ({code})"),
            Self::NoDevices => f.write_str("CUDA driver reports no devices"),
        }
    }
}

/// Which half of a pipeline step failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageKind {
    /// Filling a staging slot (device-to-host copy, or the wire bringing bytes in).
    Fill,
    /// Draining a staging slot (wire write out, or host-to-device copy).
    Drain,
}

impl fmt::Display for StageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fill => "fill",
            Self::Drain => "drain",
        })
    }
}

/// Errors of `pagewire-gpudirect`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// CUDA is not usable here.
    #[error("CUDA unavailable: {0}")]
    Unavailable(Unavailable),
    /// A CUDA driver call returned an error.
    #[error("CUDA call {call} failed: {name} ({code})")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The `CUresult` code.
        code: i32,
        /// Its name.
        name: String,
    },
    /// No GPU with this ordinal.
    #[error("no GPU with ordinal {0}")]
    NoSuchDevice(u32),
    /// A range does not fit in its buffer or region.
    #[error("range offset {offset} len {len} outside a buffer of {size} bytes")]
    OutOfRange {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the buffer or region.
        size: u64,
    },
    /// Bad staging configuration.
    #[error("invalid staging config: {0}")]
    Config(String),
    /// A copy-engine operation failed.
    #[error("copy engine: {0}")]
    Copy(String),
    /// A wire (transport) operation failed.
    #[error("wire: {0}")]
    Wire(String),
    /// A wait ran past its deadline.
    #[error("deadline of {timeout:?} exceeded while waiting for {what}")]
    Timeout {
        /// The deadline that was exceeded.
        timeout: Duration,
        /// What we were waiting for.
        what: &'static str,
    },
    /// A pipeline step failed; the batch is aborted and no notification was sent.
    #[error("staged transfer aborted at chunk {chunk} ({stage}): {source}")]
    ChunkFailed {
        /// Index of the chunk whose step failed.
        chunk: usize,
        /// Which half of the step.
        stage: StageKind,
        /// The underlying failure.
        #[source]
        source: Box<GpuError>,
    },
    /// A previous pipeline could not drain its in-flight DMA before its deadline, so
    /// its staging ring was retired (leaked) rather than reused.
    #[error("staging ring retired: in-flight DMA did not finish before the deadline")]
    RingRetired,
    /// The transport refused an operation.
    #[error("transport: {0}")]
    Transport(String),
    /// A GPU region handle that this engine does not know.
    #[error("unknown GPU region {0}")]
    UnknownRegion(u64),
    /// The requested mode cannot be used for this region.
    #[error("mode {mode} not possible: {reason}")]
    ModeUnavailable {
        /// The requested mode.
        mode: &'static str,
        /// Why not.
        reason: String,
    },
}

/// Result alias.
pub type Result<T, E = GpuError> = std::result::Result<T, E>;
