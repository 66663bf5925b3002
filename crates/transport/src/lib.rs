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

pub mod config;
pub mod error;

mod admission;
mod backend;
mod batch;
mod deadline;
mod engine;
mod memory;
pub mod prepared;
mod wire;

pub use backend::BackendInfo;
pub use batch::{Batch, BatchStats, BatchStatus, Op, TransferHandle, TransferOp};
pub use config::{BackendKind, EngineConfig, EngineConfigBuilder, ProgressMode};
pub use engine::{Engine, Notification, PeerId, PeerInfo, PlanEntry};
pub use error::{Error, HandshakeError, Result};
pub use memory::{Access, HostBuffer, RegionId, RegionInfo, RemoteRegion};
pub use prepared::PreparedBatch;
pub use wire::{EndpointInfo, QpInfo};

/// RDMA device inspection (for `pagewire devices`), from the verbs backend.
#[cfg(feature = "verbs")]
pub mod verbs {
    pub use crate::backend::verbs::{
        GidInfo, GidKind, NoRdma, RdmaDeviceInfo, RdmaPortInfo, host_rdma_missing, list_devices,
    };
}

/// Internals exposed for the `cargo fuzz` targets and property tests; not a stable API.
#[doc(hidden)]
pub mod fuzzing {
    /// Decodes one handshake frame (header + body) with a 1 MiB cap; must never panic.
    pub fn decode_handshake(bytes: &[u8]) -> bool {
        crate::wire::decode_frame(bytes, 1 << 20).is_ok()
    }

    /// Decodes a body of each frame kind; must never panic.
    pub fn decode_bodies(bytes: &[u8]) {
        for kind in 1..=6u8 {
            let _ = crate::wire::decode_body(kind, bytes);
        }
    }
}
