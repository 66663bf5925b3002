//! Zero-copy one-sided page transfers: RDMA verbs (RC QPs), TCP, or in-process memcpy
//! behind one API.
//!
//! An [`Engine`] registers caller memory once, connects to peers through a versioned
//! handshake on a TCP control port, and runs batches of one-sided WRITE/READ ops whose
//! ranges are checked against registered (local) and exposed (remote) memory before
//! anything is posted. A batch can carry a tag that the receiving engine surfaces as a
//! [`Notification`] once every byte is in its memory. A batch sent over and over can be
//! checked and planned once, then started any number of times ([`PreparedBatch`]).
//!
//! ```
//! use std::time::{Duration, Instant};
//! use pagewire_transport::{Access, Batch, BackendKind, Engine, EngineConfig, HostBuffer};
//!
//! # fn main() -> Result<(), pagewire_transport::Error> {
//! let cfg = || {
//!     EngineConfig::builder()
//!         .backend(BackendKind::Loopback)
//!         .listen("127.0.0.1:0".parse().unwrap())
//!         .build()
//! };
//! let (prefill, decode) = (Engine::new(cfg()?)?, Engine::new(cfg()?)?);
//! let mut src = HostBuffer::new(1 << 20)?;
//! let dst = HostBuffer::new(1 << 20)?;
//! src.write_at(0, b"pages"); // registered memory is copied in and out, never borrowed
//! prefill.register(&src, Access::LOCAL_WRITE)?;
//! decode.register(&dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//!
//! let peer = prefill.connect(decode.local_addr())?;
//! let deadline = Instant::now() + Duration::from_secs(5);
//! let handle = prefill.submit(peer, Batch::new().write(src.addr(), dst.addr(), 4096).notify(7))?;
//! handle.wait(deadline)?;
//!
//! let note = decode.poll_notification(deadline).expect("notified");
//! assert_eq!(note.tag, 7);
//! assert_eq!(dst.read_vec(..5), b"pages");
//! # Ok(()) }
//! ```
//!
//! See `docs/transport.md` for the design, the config knobs and the error taxonomy.

// Modules in dependency order: each imports only modules above it (tests/layering.rs).
mod backends;
mod buffer;
pub mod config;
mod contract;
mod core;
mod engine;
pub mod error;
mod host;
mod net;
/// A deterministic world of engines over the core (simulated clock, no threads, no
/// sockets) for the conformance suite; not a stable API.
#[cfg(feature = "sim")]
#[doc(hidden)]
pub mod sim;
mod types;
mod util;

pub use crate::core::batch::{Batch, BatchStats, BatchStatus};
pub use crate::core::registry::RegionInfo;
pub use crate::core::wire::{EndpointInfo, QpInfo, RailEndpoint};
pub use buffer::HostBuffer;
pub use config::{EngineConfig, EngineConfigBuilder};
pub use contract::BackendInfo;
pub use engine::handle::TransferHandle;
pub use engine::prepared;
pub use engine::prepared::PreparedBatch;
pub use engine::{Engine, PeerInfo, PlanEntry};
pub use error::{Error, Fault, HandshakeError, PeerFault, Result};
pub use types::{
    Access, BackendKind, MAX_RAILS, Notification, Op, PeerId, ProgressMode, RailStats, RegionId,
    RemoteRegion, TransferOp,
};

/// Which rails (RDMA devices) are nearest to which memory: the host's PCIe and NUMA
/// topology read from sysfs, the rule that ranks rails per memory, and the priority list
/// that overrides it (`rail_priority`). `pagewire devices` prints it.
pub mod topology {
    pub use crate::config::{MemoryKey, RailPriority};
    pub use crate::core::topology::{
        Choice, Gpu, MemoryLocation, Nearness, Nic, NicPort, Placement, RailRef, Source, Topology,
    };
    pub use crate::host::{DEFAULT_SYSFS_ROOT, read_sysfs};
}

/// RDMA device inspection (for `pagewire devices`), from the verbs backend.
#[cfg(feature = "verbs")]
pub mod verbs {
    pub use crate::backends::verbs::{
        GidInfo, GidKind, NoRdma, RdmaDeviceInfo, RdmaPortInfo, host_rdma_missing, list_devices,
    };
}

/// Internals exposed for the `cargo fuzz` targets and property tests; not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    /// Decodes one handshake frame (header + body) with a 1 MiB cap; must never panic.
    pub fn decode_handshake(bytes: &[u8]) -> bool {
        crate::core::wire::decode_frame(bytes, 1 << 20).is_ok()
    }

    /// Decodes a body of each frame kind; must never panic.
    pub fn decode_bodies(bytes: &[u8]) {
        for kind in FRAME_KINDS {
            let _ = crate::core::wire::decode_body(kind, bytes);
        }
    }

    /// The handshake's frame kinds (Hello, Welcome, Ready, Reject, Describe, Regions, Rail,
    /// RailAccepted).
    pub const FRAME_KINDS: [u8; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

    /// The kind of a whole frame of the current version that decodes, if it does: whether
    /// an input reaches a body decoder past the header checks.
    pub fn frame_kind(bytes: &[u8]) -> Option<u8> {
        crate::core::wire::decode_frame(bytes, 1 << 20)
            .ok()
            .map(|f| f.kind())
    }

    /// One valid encoded frame of every kind of the current version, with every endpoint
    /// variant (the seeds a fuzzing session starts from).
    pub fn sample_frames() -> Vec<Vec<u8>> {
        crate::core::wire::sample_frames()
            .iter()
            .map(|f| f.encode())
            .collect()
    }

    /// One line of a corpus file (`scripts/fuzz.sh`'s format: hex, `-` for the empty
    /// input) as bytes; `None` if it is not hex. Shared by the corpus replays of every
    /// crate's decoders.
    pub fn unhex(s: &str) -> Option<Vec<u8>> {
        if s == "-" {
            return Some(Vec::new()); // the empty input
        }
        if !s.len().is_multiple_of(2) {
            return None;
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
            .collect()
    }
}
