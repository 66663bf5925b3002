//! Mooncake's two return conventions, and how transport errors map onto them.
//!
//! `int` functions of `transfer_engine_c.h` return `0` or a negative `ERR_*` value
//! (Mooncake's `error.h`); `submitTransfer`, `submitTransferWithNotify`,
//! `getTransferStatus` and `freeBatchID` return a positive `Status::Code` (Mooncake's
//! `status.h`), `0` for success. The numbers are Mooncake's; which one a pagewire
//! failure gets is decided here, in one place.

use pagewire_transport::{Error, HandshakeError};

/// A Mooncake failure code (`Status::Code`, positive; `ERR_*` is its negation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Code {
    /// `kInvalidArgument`: a bad id, null pointer, bad opcode, malformed name.
    InvalidArgument = 1,
    /// `kTooManyRequests`: a batch's capacity or a table is exhausted.
    TooManyRequests = 2,
    /// `kAddressNotRegistered`: a local or remote range outside registered memory.
    AddressNotRegistered = 3,
    /// `kBatchBusy`: the batch (or region) is still in use.
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
    /// `kEndpoint`: the data path failed (a work completion error, a verbs call).
    Endpoint = 201,
    /// `kContext`: the engine is shut down or an internal failure (a caught panic).
    Context = 202,
    /// `kMemory`: the backend could not register memory.
    Memory = 302,
    /// `kNotImplemented`.
    NotImplemented = 999,
}

impl Code {
    /// A short description (the thread's last error message when nothing better is known).
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

    /// The code a transport error maps to, recording its text as the thread's last
    /// error message.
    pub fn from_err(e: &Error) -> Code {
        crate::set_last_error(e);
        Code::of(e)
    }

    /// The code a transport error maps to.
    pub fn of(e: &Error) -> Code {
        match e {
            Error::Config { .. }
            | Error::InvalidRange { .. }
            | Error::UnknownRegion { .. }
            | Error::UnknownPeer { .. }
            | Error::EmptyBatch
            | Error::Cancelled => Code::InvalidArgument,
            Error::Unregistered { .. }
            | Error::PermissionDenied { .. }
            | Error::RemoteOutOfBounds { .. }
            | Error::RemotePermission { .. }
            | Error::Remote { .. } => Code::AddressNotRegistered,
            Error::RegionOverlap { .. } => Code::AddressOverlapped,
            Error::RegionBusy { .. } => Code::BatchBusy,
            Error::BackendUnavailable { .. } => Code::DeviceNotFound,
            Error::Unsupported { .. } => Code::NotImplemented,
            Error::Registration { .. } => Code::Memory,
            Error::Handshake(HandshakeError::Io { .. }) => Code::Socket,
            Error::Handshake(_) => Code::RejectHandshake,
            // Names are resolved before connecting (a failure there is `Dns`), so a
            // connect error is refused, unreachable or timed out.
            Error::Connect { .. } => Code::Socket,
            Error::PeerGone { .. } | Error::Io { .. } | Error::Timeout { .. } => Code::Socket,
            Error::Completion { .. } | Error::Verbs { .. } => Code::Endpoint,
            Error::Shutdown => Code::Context,
            _ => Code::Context,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_numbers() {
        assert_eq!(Code::InvalidArgument.err(), -1);
        assert_eq!(Code::AddressNotRegistered.err(), -3);
        assert_eq!(Code::AddressOverlapped.err(), -7);
        assert_eq!(Code::Socket.err(), -102);
        assert_eq!(Code::NotImplemented.err(), -303);
        assert_eq!(Code::NotImplemented.status(), 999);
        assert_eq!(Code::BatchBusy.status(), 4);
        assert_eq!(
            Code::of(&Error::Unregistered { addr: 1, len: 1 }),
            Code::AddressNotRegistered
        );
        assert_eq!(Code::of(&Error::Shutdown), Code::Context);
    }
}
