//! The error taxonomy of the transport.
//!
//! One enum, [`Error`], for everything the engine returns, with variants that name the
//! bad value. It is `Clone` because a batch's failure is observed both by
//! [`TransferHandle::status`](crate::TransferHandle::status) and by
//! [`TransferHandle::wait`](crate::TransferHandle::wait). Handshake problems have their
//! own enum, [`HandshakeError`], because they come from untrusted bytes on the network.
//!
//! Each variant says *what* failed; [`Error::fault`] says *who is at fault*, as a
//! [`Fault`], so a caller decides what to do (fix the call, reconnect, give up on the
//! device, retry later) without matching every variant:
//!
//! | [`Fault`] | variants | caused by |
//! |---|---|---|
//! | `ApiMisuse` | `InvalidRange`, `Unregistered`, `PermissionDenied`, `RegionOverlap`, `UnknownRegion`, `RegionBusy`, `UnknownPeer`, `TooManyPeers`, `RemoteOutOfBounds`, `RemotePermission`, `EmptyBatch`, `Unsupported` | the caller's arguments or call order; never by bytes from a peer |
//! | `Peer` | `PeerGone` (with a typed [`PeerFault`]), `Remote`, `Handshake` (except its `Io`), `Completion` with a remote or retry status | a peer that went away, misbehaved or is incompatible |
//! | `Device` | `Verbs` (the verbs call, with its OS error as the source), `Completion` (other statuses), `Registration`, `BackendUnavailable` | the NIC, its driver or the host's limits |
//! | `Io` | `Io`, `Connect`, `Handshake(HandshakeError::Io)` | the OS's sockets |
//! | `Timeout` / `Cancelled` / `Shutdown` / `Config` | the variant of that name | a deadline, the caller's cancel, engine shutdown, a bad setting |
//!
//! The same peer fault gets the same variant and [`PeerFault`] on every backend: a peer
//! that goes away is `PeerGone { fault: PeerFault::Disconnected, .. }` whether TCP saw an
//! end of stream, verbs a QP in error state or loopback a stopped engine; a peer running
//! another backend is `Handshake(HandshakeError::BackendMismatch)` on all three.

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
        /// The backend's error, if any (verbs: its source chain holds the OS error).
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
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
    /// `connect` while this engine already holds `max_peers` established peers
    /// (`EngineConfig::max_peers`); disconnect one first.
    #[error("too many peers: this engine holds its maximum of {max}")]
    TooManyPeers {
        /// The configured cap.
        max: usize,
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
    /// The connection to the peer is unusable (it went away, stopped responding,
    /// broke the protocol, or this side closed it); `fault` says which.
    #[error("peer {peer} gone ({fault}): {reason}")]
    PeerGone {
        /// The peer.
        peer: PeerId,
        /// What kind of failure, the same on every backend.
        fault: PeerFault,
        /// What was observed, for logs.
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
        /// The verbs function.
        call: &'static str,
        /// The library's message.
        reason: String,
        /// The library's error, whose source chain holds the OS error (see
        /// [`Error::os_error`]).
        #[source]
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
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

/// `ibv_wc_status` values that mean the peer stopped acknowledging.
const RETRY_WC_STATUSES: [u32; 2] = [12, 13]; // RETRY_EXC_ERR, RNR_RETRY_EXC_ERR
/// `ibv_wc_status` values caused by the peer: it refused the op (REM_INV_REQ_ERR,
/// REM_ACCESS_ERR, REM_OP_ERR, REM_INV_RD_REQ_ERR, REM_ABORT_ERR) or stopped acknowledging.
const PEER_WC_STATUSES: [u32; 7] = [9, 10, 11, 12, 13, 15, 16];

/// Who is at fault for an [`Error`]; see the module docs for the variants of each.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The call itself is wrong (arguments, order, a feature this backend lacks). Never
    /// caused by what a peer sent: retrying the same call fails the same way.
    ApiMisuse,
    /// A peer went away, misbehaved or is incompatible.
    Peer,
    /// The RDMA device, its driver or the host's limits (memlock, device memory).
    Device,
    /// The operating system's sockets.
    Io,
    /// A deadline passed.
    Timeout,
    /// The caller cancelled.
    Cancelled,
    /// The engine is shutting down.
    Shutdown,
    /// A configuration value is wrong.
    Config,
}

/// Why a connection to a peer became unusable ([`Error::PeerGone`]). Each backend maps
/// what it observes to the same kind.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerFault {
    /// The connection ended under us: the peer closed it, its process or host went away,
    /// or the path failed (TCP: end of stream or reset; verbs: a QP in error state;
    /// loopback: the peer engine stopped). The backends cannot tell these apart.
    Disconnected,
    /// This side closed the connection (a disconnect, engine shutdown) while work was
    /// pending.
    ClosedLocally,
    /// The peer stopped responding: no progress or heartbeat within the stall limit, or
    /// it took no bytes within the I/O timeout.
    Unresponsive,
    /// The peer sent bytes outside the protocol (a malformed request, a response to no
    /// request, a bad token).
    Protocol,
    /// The peer sent notifications faster than this application takes them: the queue
    /// was full, a notification was dropped and the connection broken.
    Overran,
}

impl std::fmt::Display for PeerFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerFault::Disconnected => "disconnected",
            PeerFault::ClosedLocally => "closed locally",
            PeerFault::Unresponsive => "unresponsive",
            PeerFault::Protocol => "protocol violation",
            PeerFault::Overran => "notification queue overrun",
        })
    }
}

impl Error {
    /// Who is at fault (see the module docs).
    pub fn fault(&self) -> Fault {
        match self {
            Error::InvalidRange { .. }
            | Error::Unregistered { .. }
            | Error::PermissionDenied { .. }
            | Error::RegionOverlap { .. }
            | Error::UnknownRegion { .. }
            | Error::RegionBusy { .. }
            | Error::UnknownPeer { .. }
            | Error::TooManyPeers { .. }
            | Error::RemoteOutOfBounds { .. }
            | Error::RemotePermission { .. }
            | Error::EmptyBatch
            | Error::Unsupported { .. } => Fault::ApiMisuse,
            Error::Handshake(HandshakeError::Io { .. })
            | Error::Io { .. }
            | Error::Connect { .. } => Fault::Io,
            Error::PeerGone { .. } | Error::Remote { .. } | Error::Handshake(_) => Fault::Peer,
            // The peer refused the op (like TCP's `Remote`) or stopped acknowledging.
            Error::Completion { status, .. } if PEER_WC_STATUSES.contains(status) => Fault::Peer,
            Error::Verbs { .. }
            | Error::Completion { .. }
            | Error::Registration { .. }
            | Error::BackendUnavailable { .. } => Fault::Device,
            Error::Timeout { .. } => Fault::Timeout,
            Error::Cancelled => Fault::Cancelled,
            Error::Shutdown => Fault::Shutdown,
            Error::Config { .. } => Fault::Config,
        }
    }

    /// Whether the call itself is wrong ([`Fault::ApiMisuse`]): never caused by a peer.
    pub fn is_misuse(&self) -> bool {
        self.fault() == Fault::ApiMisuse
    }

    /// Why the connection to the peer is unusable: the fault of a [`Error::PeerGone`],
    /// and [`PeerFault::Disconnected`] for a verbs completion that says the peer stopped
    /// acknowledging (`RETRY_EXC_ERR`, `RNR_RETRY_EXC_ERR`), what TCP sees as an end of
    /// stream.
    pub fn peer_fault(&self) -> Option<PeerFault> {
        match self {
            Error::PeerGone { fault, .. } => Some(*fault),
            Error::Completion { status, .. } if RETRY_WC_STATUSES.contains(status) => {
                Some(PeerFault::Disconnected)
            }
            _ => None,
        }
    }

    /// The OS error number behind this error, if one is known: a socket error, or the
    /// errno a verbs call or registration failed with.
    pub fn os_error(&self) -> Option<i32> {
        let mut e: Option<&(dyn std::error::Error + 'static)> = match self {
            Error::Io { source, .. } | Error::Connect { source, .. } => {
                return source.raw_os_error();
            }
            Error::Verbs { source, .. } | Error::Registration { source, .. } => source
                .as_deref()
                .map(|s| s as &(dyn std::error::Error + 'static)),
            _ => None,
        };
        while let Some(cur) = e {
            if let Some(n) = cur
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::raw_os_error)
            {
                return Some(n);
            }
            e = cur.source();
        }
        None
    }

    /// A failed verbs call, keeping the library's error (and through it the errno).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
    pub(crate) fn verbs(
        call: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        // The reason carries the whole chain (the OS error is usually its last link),
        // so the message alone says what failed.
        let mut reason = source.to_string();
        let mut next = source.source();
        while let Some(s) = next {
            reason.push_str(": ");
            reason.push_str(&s.to_string());
            next = s.source();
        }
        Error::Verbs {
            call,
            reason,
            source: Some(Arc::new(source)),
        }
    }

    /// A peer connection that is unusable for `fault`.
    pub(crate) fn peer_gone(peer: PeerId, fault: PeerFault, reason: impl Into<String>) -> Self {
        Error::PeerGone {
            peer,
            fault,
            reason: reason.into(),
        }
    }

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
    /// The peer refused the handshake because it holds as many peers as it may
    /// (its `max_peers`).
    #[error("rejected by peer: too many peers")]
    TooManyPeers,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_one_fault() {
        let peer = PeerId(1);
        let io = || Arc::new(std::io::Error::from_raw_os_error(libc::ECONNRESET));
        let completion = |status| Error::Completion {
            status,
            status_str: String::new(),
            vendor_err: 0,
            wr_id: 0,
            qp_num: 0,
        };
        let cases = [
            (Error::EmptyBatch, Fault::ApiMisuse),
            (Error::TooManyPeers { max: 2 }, Fault::ApiMisuse),
            (Error::Handshake(HandshakeError::TooManyPeers), Fault::Peer),
            (Error::Unsupported { what: "x".into() }, Fault::ApiMisuse),
            (
                Error::peer_gone(peer, PeerFault::Protocol, "bad"),
                Fault::Peer,
            ),
            (Error::Handshake(HandshakeError::TokenMismatch), Fault::Peer),
            (
                Error::Handshake(HandshakeError::Io {
                    kind: std::io::ErrorKind::ConnectionReset,
                    msg: "reset".into(),
                }),
                Fault::Io,
            ),
            (
                Error::Io {
                    context: "x",
                    source: io(),
                },
                Fault::Io,
            ),
            (
                Error::verbs(
                    "ibv_create_cq",
                    std::io::Error::from_raw_os_error(libc::ENOMEM),
                ),
                Fault::Device,
            ),
            (
                Error::Timeout {
                    after: Duration::ZERO,
                },
                Fault::Timeout,
            ),
            (completion(10), Fault::Peer),
            (completion(4), Fault::Device),
            (Error::Cancelled, Fault::Cancelled),
            (Error::Shutdown, Fault::Shutdown),
            (Error::config("k", "v", "r"), Fault::Config),
        ];
        for (e, f) in cases {
            assert_eq!(e.fault(), f, "{e}");
            assert_eq!(e.is_misuse(), f == Fault::ApiMisuse);
        }
    }

    #[test]
    fn the_os_error_survives_the_wrapping() {
        // A library error whose source is the OS error, as sideway's are.
        #[derive(Debug, thiserror::Error)]
        #[error("create failed")]
        struct Lib(#[source] std::io::Error);
        let e = Error::verbs(
            "ibv_create_qp_ex",
            Lib(std::io::Error::from_raw_os_error(libc::ENOMEM)),
        );
        assert_eq!(e.os_error(), Some(libc::ENOMEM));
        assert!(e.to_string().contains("create failed: "), "{e}");
        let io = Error::io("send", std::io::Error::from_raw_os_error(libc::EPIPE));
        assert_eq!(io.os_error(), Some(libc::EPIPE));
        assert_eq!(Error::Cancelled.os_error(), None);
        let gone = Error::peer_gone(PeerId(3), PeerFault::Unresponsive, "no completion");
        assert_eq!(gone.peer_fault(), Some(PeerFault::Unresponsive));
        assert!(gone.to_string().contains("unresponsive"), "{gone}");
    }
}
