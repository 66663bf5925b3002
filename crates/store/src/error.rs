//! Errors of the store: per-key outcomes ([`Code`]) and call failures ([`StoreError`]).
//!
//! A batch call returns `Result<Vec<Result<T, Code>>, StoreError>`: the outer error when the
//! call as a whole failed (the master cannot be reached, the deadline passed, the caller
//! passed mismatched lists), a [`Code`] per key otherwise. Codes carry the numbers
//! Mooncake Store uses for the same outcome, so the Python compatibility layer returns
//! them unchanged.
//!
//! Who is at fault, for [`StoreError`]:
//! - caller: `InvalidArgument`, `Unregistered`, `Config`;
//! - master or peer: `MasterUnreachable`, `MasterGone`, `Protocol`, `Rejected`;
//! - transport / OS: `Transport`, `Io`;
//! - time and control: `Timeout`, `Shutdown`.

use std::sync::Arc;
use std::time::Duration;

use crate::proto::ProtoError;

/// Convenience alias.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A per-key outcome (and the code of a refused request). Values are Mooncake Store's
/// `ErrorCode` numbers where Mooncake has the same outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
#[repr(i32)]
pub enum Code {
    /// Success.
    #[error("ok")]
    Ok = 0,
    /// Something the master did not expect (a bug, or inconsistent state).
    #[error("internal error")]
    Internal = -1,
    /// The segment named does not exist (any more).
    #[error("segment not found")]
    SegmentNotFound = -101,
    /// No room for the object, even after eviction.
    #[error("no space")]
    NoSpace = -200,
    /// Key empty or too long.
    #[error("invalid key")]
    InvalidKey = -400,
    /// Arguments out of range (size 0, buffer too small or unregistered, lists of unequal
    /// length).
    #[error("invalid parameters")]
    InvalidParams = -600,
    /// The object is still being written.
    #[error("object not ready")]
    NotReady = -703,
    /// No complete object with this key.
    #[error("object not found")]
    NotFound = -704,
    /// The key exists (first write wins).
    #[error("object already exists")]
    AlreadyExists = -705,
    /// A read lease protects the object.
    #[error("object has a lease")]
    HasLease = -706,
    /// The read finished after the lease ended: the bytes may have been reused.
    #[error("lease expired during the read")]
    LeaseExpired = -707,
    /// Moving the bytes failed (a storage node died, a transfer timed out).
    #[error("transfer failed")]
    TransferFailed = -800,
    /// The master could not be reached or broke off.
    #[error("master unavailable")]
    MasterUnavailable = -900,
    /// The call's deadline passed.
    #[error("timeout")]
    Timeout = -901,
    /// The master does not know this client (it restarted, or dropped the client).
    #[error("unknown client")]
    UnknownClient = -1001,
    /// The master refused the client (token, version).
    #[error("unauthorized")]
    Unauthorized = -1002,
}

impl Code {
    /// Every code, for decoding and tests.
    pub const ALL: [Code; 16] = [
        Code::Ok,
        Code::Internal,
        Code::SegmentNotFound,
        Code::NoSpace,
        Code::InvalidKey,
        Code::InvalidParams,
        Code::NotReady,
        Code::NotFound,
        Code::AlreadyExists,
        Code::HasLease,
        Code::LeaseExpired,
        Code::TransferFailed,
        Code::MasterUnavailable,
        Code::Timeout,
        Code::UnknownClient,
        Code::Unauthorized,
    ];

    /// The wire (and Mooncake) number.
    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// The code with this number, if any.
    pub fn from_i32(v: i32) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_i32() == v)
    }
}

/// A call that failed as a whole.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller passed something out of range.
    #[error("invalid argument: {what}")]
    InvalidArgument {
        /// What and why.
        what: String,
    },
    /// A configuration value is out of range or unparsable.
    #[error("invalid config {key}={value:?}: {reason}")]
    Config {
        /// The knob.
        key: String,
        /// The value given.
        value: String,
        /// What is expected.
        reason: String,
    },
    /// A local range is not inside memory registered with the store client.
    #[error("local range addr={addr:#x} len={len} is not inside a registered buffer")]
    Unregistered {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// No connection to the master could be made.
    #[error("master {addr} unreachable: {source}")]
    MasterUnreachable {
        /// The master's address.
        addr: String,
        /// The socket error.
        source: Arc<std::io::Error>,
    },
    /// The connection to the master broke during a request.
    #[error("connection to master {addr} lost: {reason}")]
    MasterGone {
        /// The master's address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The other end sent bytes that are not a valid frame.
    #[error("protocol error from {from}: {source}")]
    Protocol {
        /// Who sent them.
        from: String,
        /// What is wrong with them.
        source: ProtoError,
    },
    /// The master refused the request as a whole.
    #[error("master refused: {code} ({message})")]
    Rejected {
        /// Why.
        code: Code,
        /// The master's detail.
        message: String,
    },
    /// The transport failed (engine set-up, registration, connection to a storage node).
    #[error(transparent)]
    Transport(#[from] pagewire_transport::Error),
    /// A socket or OS call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: Arc<std::io::Error>,
    },
    /// The deadline passed.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: Duration,
    },
    /// The client or master was shut down.
    #[error("shut down")]
    Shutdown,
}

impl StoreError {
    pub(crate) fn io(context: impl Into<String>, e: std::io::Error) -> Self {
        StoreError::Io {
            context: context.into(),
            source: Arc::new(e),
        }
    }

    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        StoreError::InvalidArgument { what: what.into() }
    }

    /// The per-key code a failed call stands for (what every key of the call gets).
    pub fn code(&self) -> Code {
        match self {
            StoreError::InvalidArgument { .. }
            | StoreError::Config { .. }
            | StoreError::Unregistered { .. } => Code::InvalidParams,
            StoreError::MasterUnreachable { .. }
            | StoreError::MasterGone { .. }
            | StoreError::Protocol { .. }
            | StoreError::Shutdown => Code::MasterUnavailable,
            StoreError::Rejected { code, .. } => *code,
            StoreError::Transport(_) | StoreError::Io { .. } => Code::TransferFailed,
            StoreError::Timeout { .. } => Code::Timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for c in Code::ALL {
            assert_eq!(Code::from_i32(c.as_i32()), Some(c));
            assert!(seen.insert(c.as_i32()));
        }
        assert_eq!(Code::from_i32(7), None);
        // The numbers callers of Mooncake branch on.
        assert_eq!(Code::NoSpace.as_i32(), -200);
        assert_eq!(Code::InvalidParams.as_i32(), -600);
        assert_eq!(Code::NotFound.as_i32(), -704);
        assert_eq!(Code::HasLease.as_i32(), -706);
    }
}
