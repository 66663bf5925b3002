//! Mooncake's return codes as a type, and the error every fallible call returns.
//!
//! Mooncake has two numeric conventions for one set of codes: `int` functions return
//! `0` or a negative `ERR_*` (`mooncake-transfer-engine/include/error.h`), `Status`
//! functions a positive `Status::Code` (`common/base/status.h`). [`Code`] is the code;
//! [`Code::err`] and [`Code::status`] are the two spellings. Which code a pagewire
//! failure gets is decided here ([`Code::of`]), in one place; the C ABI and the Python
//! layer only choose the spelling (or, in Python, Mooncake's per-method `-1`).

use pagewire_transport::HandshakeError;

use crate::directory::DirectoryError;

/// A Mooncake failure code.
///
/// Grouped by who is at fault: the caller (`InvalidArgument` .. `AddressOverlapped`,
/// `Metadata`), the peer or the network (`Dns`, `Socket`, `RejectHandshake`), the
/// device (`DeviceNotFound`, `Endpoint`, `Memory`), this engine (`Context`,
/// `NotImplemented`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    /// `kInvalidArgument`: a bad id, null pointer, bad opcode, malformed name.
    InvalidArgument = 1,
    /// `kTooManyRequests`: a batch's capacity or a table is exhausted.
    TooManyRequests = 2,
    /// `kAddressNotRegistered`: a local or remote range outside registered memory.
    AddressNotRegistered = 3,
    /// `kBatchBusy`: the batch (or buffer) is still in use.
    BatchBusy = 4,
    /// `kDeviceNotFound`: the requested backend is not available.
    DeviceNotFound = 6,
    /// `kAddressOverlapped`: a registration overlaps an existing one.
    AddressOverlapped = 7,
    /// `kDns`: a segment name did not resolve.
    Dns = 101,
    /// `kSocket`: the peer is unreachable, went away, or timed out.
    Socket = 102,
    /// `kRejectHandshake`: the peer refused the handshake or spoke garbage.
    RejectHandshake = 104,
    /// `kMetadata`: a session id that names no engine (`send_probe`), or the metadata
    /// directory failed (unreachable, timed out, a malformed entry).
    Metadata = 200,
    /// `kEndpoint`: the data path failed (a work completion error, a verbs call).
    Endpoint = 201,
    /// `kContext`: the engine is shut down, or an internal failure.
    Context = 202,
    /// `kMemory`: the backend could not register memory.
    Memory = 302,
    /// `kNotImplemented`.
    NotImplemented = 999,
}

impl Code {
    /// A short description.
    pub fn describe(self) -> &'static str {
        match self {
            Code::InvalidArgument => {
                "invalid argument (unknown id or handle, null pointer, bad value)"
            }
            Code::TooManyRequests => "too many requests (batch capacity or a table exhausted)",
            Code::AddressNotRegistered => "address not inside registered memory",
            Code::BatchBusy => "busy: transfers still use it",
            Code::DeviceNotFound => "transport backend not available",
            Code::AddressOverlapped => "range overlaps a registered buffer",
            Code::Dns => "name did not resolve",
            Code::Socket => "peer unreachable, gone or timed out",
            Code::RejectHandshake => "handshake refused or malformed",
            Code::Metadata => "unknown session id or metadata directory failure",
            Code::Endpoint => "data path failed",
            Code::Context => "engine shut down or internal error",
            Code::Memory => "memory registration failed",
            Code::NotImplemented => "not implemented",
        }
    }

    /// As a positive `Status::Code`.
    pub fn status(self) -> i32 {
        self as i32
    }

    /// As a negative `ERR_*` value (`ERR_NOT_IMPLEMENTED` is -303 in Mooncake, not -999).
    pub fn err(self) -> i32 {
        match self {
            Code::NotImplemented => -303,
            c => -(c as i32),
        }
    }

    /// The code a transport error maps to.
    pub fn of(e: &pagewire_transport::Error) -> Code {
        use pagewire_transport::Error as E;
        match e {
            E::Config { .. }
            | E::InvalidRange { .. }
            | E::UnknownRegion { .. }
            | E::UnknownPeer { .. }
            | E::EmptyBatch
            | E::Cancelled => Code::InvalidArgument,
            E::Unregistered { .. }
            | E::PermissionDenied { .. }
            | E::RemoteOutOfBounds { .. }
            | E::RemotePermission { .. }
            | E::Remote { .. } => Code::AddressNotRegistered,
            E::RegionOverlap { .. } => Code::AddressOverlapped,
            E::RegionBusy { .. } => Code::BatchBusy,
            E::TooManyPeers { .. } => Code::TooManyRequests,
            E::BackendUnavailable { .. } => Code::DeviceNotFound,
            E::Unsupported { .. } => Code::NotImplemented,
            E::Registration { .. } => Code::Memory,
            E::Handshake(HandshakeError::Io { .. }) => Code::Socket,
            E::Handshake(_) => Code::RejectHandshake,
            // Names are resolved before connecting (a failure there is `Dns`), so a
            // connect error is refused, unreachable or timed out.
            E::Connect { .. } | E::PeerGone { .. } | E::Io { .. } | E::Timeout { .. } => {
                Code::Socket
            }
            E::Completion { .. } | E::Verbs { .. } => Code::Endpoint,
            _ => Code::Context,
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.describe(), self.err())
    }
}

/// A failed call: Mooncake's [`Code`] and what went wrong, naming the value at fault.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    code: Code,
    message: String,
    #[source]
    source: Option<Cause>,
}

/// The error underneath an [`Error`].
#[derive(Debug, Clone, thiserror::Error)]
enum Cause {
    #[error(transparent)]
    Transport(pagewire_transport::Error),
    #[error(transparent)]
    Directory(DirectoryError),
}

impl Error {
    /// An error with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
            source: None,
        }
    }

    /// A transport error, with the code [`Code::of`] gives it; `context` (may be empty)
    /// goes before the transport's text.
    pub fn transport(context: &str, e: pagewire_transport::Error) -> Error {
        Error::with_code(Code::of(&e), context, e)
    }

    /// A transport error under an explicit code.
    pub fn with_code(code: Code, context: &str, e: pagewire_transport::Error) -> Error {
        let message = if context.is_empty() {
            e.to_string()
        } else {
            format!("{context}: {e}")
        };
        Error {
            code,
            message,
            source: Some(Cause::Transport(e)),
        }
    }

    /// A metadata directory's failure: the caller's mistakes are
    /// [`Code::InvalidArgument`], the directory's own [`Code::Metadata`]. `context` goes
    /// before the directory's text.
    pub fn directory(context: &str, e: DirectoryError) -> Error {
        let code = match e {
            DirectoryError::Misuse { .. } | DirectoryError::Taken { .. } => Code::InvalidArgument,
            _ => Code::Metadata,
        };
        Error {
            code,
            message: format!("{context}: {e}"),
            source: Some(Cause::Directory(e)),
        }
    }

    /// The same error under another code.
    pub(crate) fn recode(mut self, code: Code) -> Error {
        self.code = code;
        self
    }

    /// Mooncake's code for it.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The transport error behind it, if any.
    pub fn transport_error(&self) -> Option<&pagewire_transport::Error> {
        match &self.source {
            Some(Cause::Transport(e)) => Some(e),
            _ => None,
        }
    }

    /// The metadata directory's error behind it, if any.
    pub fn directory_error(&self) -> Option<&DirectoryError> {
        match &self.source {
            Some(Cause::Directory(e)) => Some(e),
            _ => None,
        }
    }
}

impl From<pagewire_transport::Error> for Error {
    fn from(e: pagewire_transport::Error) -> Error {
        Error::transport("", e)
    }
}

/// `Err(Error::new(code, message))`.
pub(crate) fn fail<T>(code: Code, message: impl Into<String>) -> Result<T, Error> {
    Err(Error::new(code, message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagewire_transport::Error as E;

    #[test]
    fn mooncake_numbers() {
        assert_eq!(Code::InvalidArgument.err(), -1);
        assert_eq!(Code::AddressNotRegistered.err(), -3);
        assert_eq!(Code::BatchBusy.err(), -4);
        assert_eq!(Code::AddressOverlapped.err(), -7);
        assert_eq!(Code::Dns.err(), -101);
        assert_eq!(Code::Socket.err(), -102);
        assert_eq!(Code::Metadata.err(), -200);
        assert_eq!(Code::NotImplemented.err(), -303);
        assert_eq!(Code::NotImplemented.status(), 999);
        assert_eq!(Code::BatchBusy.status(), 4);
    }

    #[test]
    fn transport_errors_map_by_who_is_at_fault() {
        assert_eq!(
            Code::of(&E::Unregistered { addr: 1, len: 1 }),
            Code::AddressNotRegistered
        );
        assert_eq!(Code::of(&E::Shutdown), Code::Context);
        assert_eq!(Code::of(&E::TooManyPeers { max: 2 }), Code::TooManyRequests);
        let e = Error::transport("opening x", E::Shutdown);
        assert_eq!(e.code(), Code::Context);
        assert!(e.to_string().starts_with("opening x: "), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }
}
