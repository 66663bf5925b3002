//! The error taxonomy of the transport.
//!
//! One enum, [`Error`], for everything the engine returns, with variants that name the
//! bad value. It is `Clone` because a batch's failure is observed both by
//! [`TransferHandle::status`](crate::TransferHandle::status) and by
//! [`TransferHandle::wait`](crate::TransferHandle::wait). Handshake problems have their
//! own enum, [`HandshakeError`], because they come from untrusted bytes on the network.
//!
//! Who is at fault, roughly:
//! - caller: `Config`, `InvalidRange`, `Unregistered`, `PermissionDenied`, `RegionOverlap`,
//!   `UnknownRegion`, `UnknownPeer`, `RemoteOutOfBounds`, `RemotePermission`, `EmptyBatch`,
//!   `RegionBusy`;
//! - peer or network: `Handshake`, `PeerGone`, `Remote`, `Connect`;
//! - hardware / OS: `Completion`, `Verbs`, `Registration`, `Io`, `BackendUnavailable`;
//! - time and control: `Timeout`, `Cancelled`, `Shutdown`.

use std::sync::Arc;
use std::time::Duration;

use crate::types::{Access, BackendKind, RegionId};

/// Convenience alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Peer id inside one engine (re-exported as [`crate::PeerId`]).
pub use crate::types::PeerId;

/// Everything the transport can fail with.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range or unparsable (builder or environment).
    #[error("invalid config {key}={value:?}: {reason}")]
    Config {
        /// The knob (builder method or environment variable).
        key: String,
        /// The offending value as given.
        value: String,
        /// What is expected instead.
        reason: String,
    },
    /// The selected backend cannot be used on this host (no device, library missing...).
    #[error("backend {backend} unavailable: {reason}")]
    BackendUnavailable {
        /// The backend that was asked for.
        backend: BackendKind,
        /// Why it cannot be used.
        reason: String,
    },
    /// The operation exists in the API but this backend or build does not support it.
    #[error("unsupported: {what}")]
    Unsupported {
        /// What was asked.
        what: String,
    },
    /// A range has zero length or `addr + len` overflows.
    #[error("invalid range addr={addr:#x} len={len}")]
    InvalidRange {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A local range is not inside one registered region.
    #[error("local range addr={addr:#x} len={len} is not inside registered memory")]
    Unregistered {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A local range is registered but without the access the operation needs.
    #[error("local range addr={addr:#x} len={len} lacks access {needed:?}")]
    PermissionDenied {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// The access that is missing.
        needed: Access,
    },
    /// A registration partially overlaps an existing region.
    #[error("range addr={addr:#x} len={len} overlaps region {existing}")]
    RegionOverlap {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// The region it collides with.
        existing: RegionId,
    },
    /// The backend refused a registration (e.g. `ibv_reg_mr` failed, memlock limit).
    #[error("registering addr={addr:#x} len={len} failed: {reason}")]
    Registration {
        /// Start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// Backend-specific reason.
        reason: String,
    },
    /// No region with this id (never registered, or already deregistered).
    #[error("unknown region {id}")]
    UnknownRegion {
        /// The id.
        id: RegionId,
    },
    /// The region is used by in-flight transfers and cannot be deregistered now.
    #[error("region {id} is busy ({inflight} in-flight batches)")]
    RegionBusy {
        /// The region.
        id: RegionId,
        /// How many batches still reference it.
        inflight: usize,
    },
    /// No peer with this id on this engine.
    #[error("unknown peer {peer}")]
    UnknownPeer {
        /// The id.
        peer: PeerId,
    },
    /// A remote range is not inside the memory the peer exposed.
    #[error("remote range addr={addr:#x} len={len} is outside the memory exposed by {peer}")]
    RemoteOutOfBounds {
        /// The peer.
        peer: PeerId,
        /// Remote start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// The peer exposes the remote range, but not with the access the operation needs.
    #[error("remote range addr={addr:#x} len={len} on {peer} lacks access {needed:?}")]
    RemotePermission {
        /// The peer.
        peer: PeerId,
        /// Remote start address.
        addr: u64,
        /// Length in bytes.
        len: u64,
        /// The access that is missing.
        needed: Access,
    },
    /// A batch with no operations and no notification was submitted.
    #[error("empty batch (no operations and no notification)")]
    EmptyBatch,
    /// The control-plane handshake failed (ours or the peer's bytes).
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// The control connection could not be established.
    #[error("connect to {addr}: {source}")]
    Connect {
        /// Address as given.
        addr: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The peer vanished (connection reset, process died, QP in error state).
    #[error("peer {peer} gone: {reason}")]
    PeerGone {
        /// The peer.
        peer: PeerId,
        /// What was observed.
        reason: String,
    },
    /// The peer refused an operation (TCP backend: its own bounds/permission check).
    #[error("peer {peer} refused the operation: {reason}")]
    Remote {
        /// The peer.
        peer: PeerId,
        /// Reason code rendered as text.
        reason: String,
    },
    /// A deadline passed before the operation finished.
    #[error("timed out after {after:?}")]
    Timeout {
        /// How long was waited.
        after: Duration,
    },
    /// The batch was cancelled by the caller.
    #[error("cancelled")]
    Cancelled,
    /// A verbs work completion with an error status.
    #[error(
        "work completion failed: status {status} ({status_str}), vendor_err {vendor_err:#x}, wr_id {wr_id:#x}, qp {qp_num}"
    )]
    Completion {
        /// `ibv_wc_status` value.
        status: u32,
        /// `ibv_wc_status_str` of it.
        status_str: String,
        /// Vendor syndrome.
        vendor_err: u32,
        /// The failing WR.
        wr_id: u64,
        /// The QP it was posted on.
        qp_num: u32,
    },
    /// A verbs call failed (create QP, modify QP, post...).
    #[error("verbs {call} failed: {reason}")]
    Verbs {
        /// The verbs function or step.
        call: &'static str,
        /// errno or library message.
        reason: String,
    },
    /// An I/O error outside the handshake (TCP data streams, listener).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The engine is shutting down.
    #[error("engine shut down")]
    Shutdown,
}

impl Error {
    /// Wraps an I/O error with a short context.
    pub(crate) fn io(context: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            context,
            source: Arc::new(source),
        }
    }

    /// A deadline that ran out inside the socket layer (a read or write timeout, a connect
    /// timeout) as [`Error::Timeout`] with the time since `started`; other errors as they
    /// are. Public calls that wait on sockets return this, so that a deadline never
    /// surfaces as an I/O error of kind `WouldBlock` or `TimedOut`.
    pub(crate) fn deadline_as_timeout(self, started: std::time::Instant) -> Self {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        let timed_out = match &self {
            Error::Handshake(HandshakeError::Io { kind, .. }) => {
                matches!(kind, WouldBlock | TimedOut)
            }
            Error::Io { source, .. } | Error::Connect { source, .. } => {
                matches!(source.kind(), WouldBlock | TimedOut)
            }
            _ => false,
        };
        if timed_out {
            tracing::debug!(error = %self, "deadline passed");
            Error::Timeout {
                after: started.elapsed(),
            }
        } else {
            self
        }
    }

    /// Builds a config error.
    pub(crate) fn config(key: &str, value: impl ToString, reason: impl ToString) -> Self {
        Error::Config {
            key: key.to_string(),
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Why a handshake failed. Produced by the decoder for hostile or foreign bytes, and by
/// the engine for protocol-level refusals.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The first bytes are not pagewire's magic (an HTTP probe, TLS, another protocol).
    #[error("bad magic {found:#010x}")]
    BadMagic {
        /// What was read.
        found: u32,
    },
    /// Protocol version the other side speaks that we do not.
    #[error("unsupported protocol version {theirs} (ours {ours})")]
    Version {
        /// Our version.
        ours: u16,
        /// Theirs.
        theirs: u16,
    },
    /// The announced frame length exceeds the cap.
    #[error("frame of {len} bytes exceeds the cap of {max}")]
    Oversized {
        /// Announced length.
        len: u64,
        /// The configured cap.
        max: u64,
    },
    /// The frame ended before a field was complete.
    #[error("truncated while reading {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// Bytes left over after the last field.
    #[error("{extra} trailing bytes")]
    Trailing {
        /// How many.
        extra: usize,
    },
    /// A field holds a value outside its valid range.
    #[error("invalid {field}: {value}")]
    BadField {
        /// Field name.
        field: &'static str,
        /// The value (numbers as decimal/hex text).
        value: String,
    },
    /// A frame of a kind that is not expected at this point.
    #[error("unexpected frame kind {found} (expected {expected})")]
    UnexpectedFrame {
        /// Expected kind.
        expected: &'static str,
        /// Kind byte received.
        found: u8,
    },
    /// The shared token does not match.
    #[error("token mismatch")]
    TokenMismatch,
    /// The two engines run different backends.
    #[error("backend mismatch: ours {ours}, theirs {theirs}")]
    BackendMismatch {
        /// Ours.
        ours: String,
        /// Theirs.
        theirs: String,
    },
    /// The peer refused the handshake and said why.
    #[error("rejected by peer: {reason}")]
    Rejected {
        /// The peer's reason.
        reason: String,
    },
    /// Both ends were connected, but the data path did not carry the probe (verbs: a
    /// zero-length RDMA WRITE per QP); the connection was closed.
    #[error("data-path probe failed: {reason}")]
    Probe {
        /// What the backend reported.
        reason: String,
    },
    /// The socket failed or timed out mid-handshake (includes half-open peers).
    #[error("i/o during handshake: {kind:?}: {msg}")]
    Io {
        /// `std::io::ErrorKind` of the failure.
        kind: std::io::ErrorKind,
        /// Its message.
        msg: String,
    },
}

impl From<std::io::Error> for HandshakeError {
    fn from(e: std::io::Error) -> Self {
        HandshakeError::Io {
            kind: e.kind(),
            msg: e.to_string(),
        }
    }
}
