//! Errors of coordination on etcd, grouped by who is at fault.

use std::sync::Arc;
use std::time::Duration;

/// Result of this crate.
pub type Result<T> = std::result::Result<T, HaError>;

/// What went wrong talking to etcd or taking part in an election.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum HaError {
    /// The caller's fault: a malformed `etcd://` address, a bad setting.
    #[error("{reason}")]
    Misuse {
        /// What is wrong.
        reason: String,
    },
    /// etcd refused who we are or what we asked: a wrong user or password, no user for
    /// an etcd with authentication on (or a user for one with it off), or a user whose
    /// roles do not cover the keys. Not retried on another member: they all share one
    /// user database.
    #[error("{what}: etcd refused access: {reason}")]
    Denied {
        /// The call.
        what: &'static str,
        /// etcd's words.
        reason: String,
    },
    /// The call's deadline passed before etcd answered.
    #[error("{what}: no answer from etcd within {after:?}")]
    Timeout {
        /// The call.
        what: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// etcd (or the path to it) failed the call: no member reachable, no raft leader, a
    /// refused request.
    #[error("{what}: etcd unavailable: {reason}")]
    Unavailable {
        /// The call.
        what: &'static str,
        /// Why, in words.
        reason: String,
        /// The client's error, when there is one.
        #[source]
        source: Option<Arc<etcd_client::Error>>,
    },
    /// The store master itself could not start (its listener, its settings).
    #[error("start the store master: {0}")]
    Master(#[source] pagewire_store::StoreError),
    /// What etcd holds under the op-log's keys is not a valid entry or snapshot (written
    /// by something else than a pagewire master, or by another version).
    #[error("op-log {what}: {reason}")]
    Log {
        /// The key or part read.
        what: String,
        /// Why it is refused.
        reason: String,
    },
    /// A local resource failed (a thread, the runtime).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
}

impl HaError {
    pub(crate) fn from_etcd(what: &'static str, e: etcd_client::Error) -> HaError {
        use etcd_client::Error as E;
        match e {
            E::InvalidArgs(reason) => HaError::Misuse {
                reason: format!("{what}: {reason}"),
            },
            E::InvalidUri(u) => HaError::Misuse {
                reason: format!("{what}: {u}"),
            },
            E::GRpcStatus(st) if denied(&st) => HaError::Denied {
                what,
                reason: st.message().to_string(),
            },
            e => HaError::Unavailable {
                what,
                reason: e.to_string(),
                source: Some(Arc::new(e)),
            },
        }
    }
}

/// Whether etcd refused the caller's identity or permissions (etcd's `rpctypes`: an
/// unknown user or wrong password and an empty user name come as `InvalidArgument`,
/// authentication not enabled as `FailedPrecondition`, a missing token as
/// `Unauthenticated`, a role without the key as `PermissionDenied`).
fn denied(st: &tonic::Status) -> bool {
    use tonic::Code;
    let m = st.message();
    match st.code() {
        Code::PermissionDenied | Code::Unauthenticated => true,
        Code::InvalidArgument => {
            m.contains("authentication failed") || m.contains("user name is empty")
        }
        Code::FailedPrecondition => m.contains("authentication is not enabled"),
        _ => false,
    }
}

impl From<HaError> for pagewire_store::StoreError {
    fn from(e: HaError) -> Self {
        use pagewire_store::StoreError;
        match e {
            HaError::Timeout { what, after } => StoreError::Timeout { what, after },
            HaError::Misuse { reason } => StoreError::InvalidArgument { what: reason },
            HaError::Denied { what, reason } => StoreError::Config {
                key: "etcd credentials".into(),
                value: String::new(),
                reason: format!("{what}: {reason}"),
            },
            e => StoreError::MasterGone {
                addr: "etcd".into(),
                reason: e.to_string(),
            },
        }
    }
}
