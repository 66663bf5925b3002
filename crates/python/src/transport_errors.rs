//! The transport's exceptions: one Python class per `pagewire_transport::Error` variant,
//! grouped by who is at fault, all under `PagewireError`.
//!
//! ```text
//! PagewireError
//! ├── UsageError (ValueError)          the caller's arguments
//! │   ├── ConfigError                  Error::Config
//! │   ├── InvalidRange                 Error::InvalidRange
//! │   ├── EmptyBatch                   Error::EmptyBatch
//! │   ├── UnknownPeer                  Error::UnknownPeer
//! │   ├── OutOfRange
//! │   │   ├── NotRegistered            Error::Unregistered (local range)
//! │   │   └── RemoteOutOfRange         Error::RemoteOutOfBounds
//! │   └── AccessDenied                 Error::PermissionDenied, Error::RemotePermission
//! ├── RegistrationError                Error::Registration (the backend refused)
//! │   ├── RegionOverlap                Error::RegionOverlap
//! │   ├── UnknownRegion                Error::UnknownRegion
//! │   └── RegionBusy                   Error::RegionBusy
//! ├── PeerError                        the peer or the network
//! │   ├── PeerUnreachable (ConnectionError)  Error::Connect
//! │   ├── HandshakeError               Error::Handshake (kind TokenMismatch: a token refused)
//! │   ├── PeerGone                     Error::PeerGone
//! │   └── RemoteError                  Error::Remote (the peer refused an op)
//! ├── DeviceError                      hardware and OS
//! │   ├── BackendUnavailable           Error::BackendUnavailable
//! │   ├── CompletionError              Error::Completion
//! │   ├── VerbsError                   Error::Verbs
//! │   └── IoError                      Error::Io
//! ├── Unsupported                      Error::Unsupported
//! ├── Timeout (TimeoutError)           Error::Timeout
//! ├── Cancelled                        Error::Cancelled
//! └── EngineClosed                     Error::Shutdown
//! ```
//!
//! The classes are built once at import (Python's `type()`, so that a class can also
//! derive from a builtin such as `TimeoutError`) and live in `pagewire._native`;
//! `pagewire.errors` re-exports them. Every raised instance carries `kind` (the Rust
//! variant's name) and, for range errors, `addr` and `length`.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use pagewire_transport::{Error, HandshakeError};

use crate::errors::PagewireError;

/// (name, parent name or a builtin marker, docstring). Parents come before children.
const CLASSES: &[(&str, &[&str], &str)] = &[
    (
        "UsageError",
        &["PagewireError", "!ValueError"],
        "The arguments of a call are invalid; nothing was done.",
    ),
    (
        "ConfigError",
        &["UsageError"],
        "An engine setting is out of range or unparsable.",
    ),
    (
        "InvalidRange",
        &["UsageError"],
        "A range has zero length or its end overflows.",
    ),
    (
        "EmptyBatch",
        &["UsageError"],
        "A batch with no operations and no notification.",
    ),
    (
        "UnknownPeer",
        &["UsageError"],
        "No such peer on this engine (disconnected, or another engine's).",
    ),
    (
        "OutOfRange",
        &["UsageError"],
        "A range lies outside the memory it must be in; nothing was posted.",
    ),
    (
        "NotRegistered",
        &["OutOfRange"],
        "A local range is not inside one registered region.",
    ),
    (
        "RemoteOutOfRange",
        &["OutOfRange"],
        "A remote range is outside the memory the peer exposes.",
    ),
    (
        "AccessDenied",
        &["UsageError"],
        "A range is registered or exposed without the access the operation needs.",
    ),
    (
        "RegistrationError",
        &["PagewireError"],
        "A registration failed (the backend refused it, or it conflicts).",
    ),
    (
        "RegionOverlap",
        &["RegistrationError"],
        "The range overlaps a registered region.",
    ),
    (
        "UnknownRegion",
        &["RegistrationError"],
        "No such region (never registered, or deregistered).",
    ),
    (
        "RegionBusy",
        &["RegistrationError"],
        "The region is in use by in-flight transfers.",
    ),
    (
        "PeerError",
        &["PagewireError"],
        "The peer or the network failed.",
    ),
    (
        "PeerUnreachable",
        &["PeerError", "!ConnectionError"],
        "The peer's control port could not be reached.",
    ),
    (
        "HandshakeError",
        &["PeerError"],
        "The handshake with the peer failed or was refused.",
    ),
    (
        "PeerGone",
        &["PeerError"],
        "The peer went away (reset, process died, QP in error).",
    ),
    (
        "RemoteError",
        &["PeerError"],
        "The peer refused the operation.",
    ),
    (
        "DeviceError",
        &["PagewireError"],
        "The device, the driver or the OS failed.",
    ),
    (
        "BackendUnavailable",
        &["DeviceError"],
        "The requested backend cannot be used on this host.",
    ),
    (
        "CompletionError",
        &["DeviceError"],
        "A verbs work completion reported an error.",
    ),
    ("VerbsError", &["DeviceError"], "A verbs call failed."),
    (
        "IoError",
        &["DeviceError"],
        "A socket or file operation failed.",
    ),
    (
        "Unsupported",
        &["PagewireError"],
        "The operation is not supported by this backend or build.",
    ),
    (
        "Timeout",
        &["PagewireError", "!TimeoutError"],
        "A deadline passed before the operation finished.",
    ),
    ("Cancelled", &["PagewireError"], "The batch was cancelled."),
    ("EngineClosed", &["PagewireError"], "The engine was closed."),
];

static TYPES: PyOnceLock<Vec<(&'static str, Py<PyType>)>> = PyOnceLock::new();

fn build(py: Python<'_>) -> PyResult<Vec<(&'static str, Py<PyType>)>> {
    let builtins = py.import("builtins")?;
    let type_ = builtins.getattr("type")?;
    let mut out: Vec<(&'static str, Py<PyType>)> = Vec::with_capacity(CLASSES.len());
    for &(name, parents, doc) in CLASSES {
        let mut bases = Vec::new();
        for p in parents {
            let base = if let Some(b) = p.strip_prefix('!') {
                builtins.getattr(b)?
            } else if *p == "PagewireError" {
                py.get_type::<PagewireError>().into_any()
            } else {
                let (_, t) = out
                    .iter()
                    .find(|(n, _)| n == p)
                    .expect("parents are listed before their children");
                t.bind(py).clone().into_any()
            };
            bases.push(base);
        }
        let dict = PyDict::new(py);
        dict.set_item("__doc__", doc)?;
        dict.set_item("__module__", "pagewire.errors")?;
        let t = type_.call1((name, PyTuple::new(py, bases)?, dict))?;
        out.push((name, t.cast_into::<PyType>()?.unbind()));
    }
    Ok(out)
}

fn types(py: Python<'_>) -> &Vec<(&'static str, Py<PyType>)> {
    TYPES
        .get_or_try_init(py, || build(py))
        .expect("the exception classes are built when the module is imported")
}

/// The class called `name` (one of [`CLASSES`]).
pub(crate) fn class<'py>(py: Python<'py>, name: &str) -> Bound<'py, PyType> {
    types(py)
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| t.bind(py).clone())
        .unwrap_or_else(|| py.get_type::<PagewireError>())
}

/// A `name` exception with `msg`, `kind` and optional extra attributes.
pub(crate) fn new_err(py: Python<'_>, name: &str, kind: &str, msg: String) -> PyErr {
    new_err_with(py, name, kind, msg, &[])
}

fn new_err_with(
    py: Python<'_>,
    name: &str,
    kind: &str,
    msg: String,
    attrs: &[(&str, u64)],
) -> PyErr {
    let ty = class(py, name);
    match ty.call1((msg.clone(),)) {
        Ok(v) => {
            let _ = v.setattr("kind", kind);
            for (k, x) in attrs {
                let _ = v.setattr(*k, *x);
            }
            PyErr::from_value(v)
        }
        Err(_) => PagewireError::new_err(msg),
    }
}

/// The Python exception for a transport error.
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let msg = e.to_string();
    let (name, kind, attrs): (&str, &str, Vec<(&str, u64)>) = match e {
        Error::Config { .. } => ("ConfigError", "Config", vec![]),
        Error::BackendUnavailable { .. } => ("BackendUnavailable", "BackendUnavailable", vec![]),
        Error::Unsupported { .. } => ("Unsupported", "Unsupported", vec![]),
        Error::InvalidRange { addr, len } => (
            "InvalidRange",
            "InvalidRange",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::Unregistered { addr, len } => (
            "NotRegistered",
            "Unregistered",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::PermissionDenied { addr, len, .. } => (
            "AccessDenied",
            "PermissionDenied",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::RegionOverlap { addr, len, .. } => (
            "RegionOverlap",
            "RegionOverlap",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::Registration { addr, len, .. } => (
            "RegistrationError",
            "Registration",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::UnknownRegion { .. } => ("UnknownRegion", "UnknownRegion", vec![]),
        Error::RegionBusy { .. } => ("RegionBusy", "RegionBusy", vec![]),
        Error::UnknownPeer { .. } => ("UnknownPeer", "UnknownPeer", vec![]),
        Error::RemoteOutOfBounds { addr, len, .. } => (
            "RemoteOutOfRange",
            "RemoteOutOfBounds",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::RemotePermission { addr, len, .. } => (
            "AccessDenied",
            "RemotePermission",
            vec![("addr", *addr), ("length", *len)],
        ),
        Error::EmptyBatch => ("EmptyBatch", "EmptyBatch", vec![]),
        // A refused token is worth telling apart from other refusals (a config mistake).
        Error::Handshake(HandshakeError::TokenMismatch) => {
            ("HandshakeError", "TokenMismatch", vec![])
        }
        Error::Handshake(_) => ("HandshakeError", "Handshake", vec![]),
        Error::Connect { .. } => ("PeerUnreachable", "Connect", vec![]),
        Error::PeerGone { .. } => ("PeerGone", "PeerGone", vec![]),
        Error::Remote { .. } => ("RemoteError", "Remote", vec![]),
        Error::Timeout { .. } => ("Timeout", "Timeout", vec![]),
        Error::Cancelled => ("Cancelled", "Cancelled", vec![]),
        Error::Completion { .. } => ("CompletionError", "Completion", vec![]),
        Error::Verbs { .. } => ("VerbsError", "Verbs", vec![]),
        Error::Io { .. } => ("IoError", "Io", vec![]),
        Error::Shutdown => ("EngineClosed", "Shutdown", vec![]),
        Error::TooManyPeers { .. } => ("UsageError", "TooManyPeers", vec![]),
        _ => ("PagewireError", "Other", vec![]),
    };
    new_err_with(py, name, kind, msg, &attrs)
}

/// Adds every class to the module (for `pagewire.errors` to re-export).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let built = TYPES.get_or_try_init(py, || build(py))?;
    for (name, t) in built {
        m.add(*name, t.bind(py))?;
    }
    Ok(())
}
