"""pagewire's exceptions. Every one derives from :class:`PagewireError`.

>>> from pagewire.errors import PagewireError
>>> issubclass(PagewireError, Exception)
True
"""

from pagewire._native import PagewireError

__all__ = ["PagewireError"]

# --- layout --------------------------------------------------------------------------
from pagewire._native import LayoutError  # noqa: E402  (PagewireError, ValueError)

__all__ += ["LayoutError"]
# --- end layout ----------------------------------------------------------------------

# --- transport errors (native API) -----------------------------------------------------
# One class per pagewire_transport::Error variant, grouped by who is at fault. Every
# raised instance has `.kind` (the Rust variant's name); range errors also `.addr` and
# `.length`.
#
# PagewireError
# ├── UsageError (ValueError): ConfigError, InvalidRange, EmptyBatch, UnknownPeer,
# │       OutOfRange (NotRegistered, RemoteOutOfRange), AccessDenied
# ├── RegistrationError: RegionOverlap, UnknownRegion, RegionBusy
# ├── PeerError: PeerUnreachable (ConnectionError), HandshakeError, PeerGone, RemoteError
# ├── DeviceError: BackendUnavailable, CompletionError, VerbsError, IoError
# ├── Unsupported
# ├── Timeout (TimeoutError)
# ├── Cancelled
# └── EngineClosed
from pagewire._native import (  # noqa: E402
    AccessDenied,
    BackendUnavailable,
    Cancelled,
    CompletionError,
    ConfigError,
    DeviceError,
    EmptyBatch,
    EngineClosed,
    HandshakeError,
    InvalidRange,
    IoError,
    NotRegistered,
    OutOfRange,
    PeerError,
    PeerGone,
    PeerUnreachable,
    RegionBusy,
    RegionOverlap,
    RegistrationError,
    RemoteError,
    RemoteOutOfRange,
    Timeout,
    UnknownPeer,
    UnknownRegion,
    Unsupported,
    UsageError,
    VerbsError,
)

__all__ += [
    "AccessDenied",
    "BackendUnavailable",
    "Cancelled",
    "CompletionError",
    "ConfigError",
    "DeviceError",
    "EmptyBatch",
    "EngineClosed",
    "HandshakeError",
    "InvalidRange",
    "IoError",
    "NotRegistered",
    "OutOfRange",
    "PeerError",
    "PeerGone",
    "PeerUnreachable",
    "RegionBusy",
    "RegionOverlap",
    "RegistrationError",
    "RemoteError",
    "RemoteOutOfRange",
    "Timeout",
    "UnknownPeer",
    "UnknownRegion",
    "Unsupported",
    "UsageError",
    "VerbsError",
]
# --- end transport errors ---------------------------------------------------------------

# --- store ---------------------------------------------------------------------------
from pagewire._native import StoreError  # noqa: E402  (PagewireError; `.code`: Mooncake's number)

__all__ += ["StoreError"]
# --- end store -----------------------------------------------------------------------
