//! The vocabulary every other module speaks: ids, access flags, ops, notifications, the
//! backend kinds, and the opaque handle of a registration. Plain data; imports only std,
//! so the engine, the core and every backend can share it without importing each other.

use std::any::Any;
use std::fmt;
use std::ops::{BitOr, BitOrAssign};

/// Id of a connected peer, unique within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub(crate) u64);

impl PeerId {
    /// The raw number (for logs and wire tags).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

/// A remote notification: `peer` finished a batch tagged `tag` into our memory, and
/// every byte of it is in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Notification {
    /// Who wrote.
    pub peer: PeerId,
    /// The batch's tag.
    pub tag: u32,
}

/// Access rights of a registered region (a small bit set).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub(crate) u8);

impl Access {
    /// No access (useful only as a starting value).
    pub const NONE: Access = Access(0);
    /// The local NIC/backend may write it (needed as the target of READs).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may write it (target of their WRITEs).
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may read it (source of their READs).
    pub const REMOTE_READ: Access = Access(4);
    /// Everything: what a KV pool shared both ways uses.
    pub const ALL: Access = Access(7);

    /// Raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
    /// From raw bits; `None` when unknown bits are set.
    pub const fn from_bits(bits: u8) -> Option<Access> {
        if bits & !7 == 0 {
            Some(Access(bits))
        } else {
            None
        }
    }
    /// Whether every bit of `other` is set in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// Whether peers may touch the region at all (only such regions are exposed).
    pub const fn is_remote(self) -> bool {
        self.0 & (Self::REMOTE_WRITE.0 | Self::REMOTE_READ.0) != 0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.contains(Access::LOCAL_WRITE) {
            parts.push("LOCAL_WRITE");
        }
        if self.contains(Access::REMOTE_WRITE) {
            parts.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_READ) {
            parts.push("REMOTE_READ");
        }
        if parts.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&parts.join("|"))
        }
    }
}

/// Id of a local registered region, unique within one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub(crate) u64);

impl RegionId {
    /// The raw number (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region#{}", self.0)
    }
}

/// One region a peer exposed to us: `[addr, addr+len)` with its remote key.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key (verbs rkey, or the TCP backend's region key).
    pub rkey: u32,
    /// What we may do with it (`REMOTE_WRITE` and/or `REMOTE_READ`).
    pub access: Access,
    /// Its rkeys on the peer's rails 1.. (multi-rail verbs; empty otherwise).
    pub(crate) rails: RailKeys,
}

impl RemoteRegion {
    /// Builds one (for tests and tools).
    pub fn new(addr: u64, len: u64, rkey: u32, access: Access) -> Self {
        RemoteRegion {
            addr,
            len,
            rkey,
            access,
            rails: RailKeys::NONE,
        }
    }
    /// One past the end.
    pub fn end(&self) -> u64 {
        self.addr.saturating_add(self.len)
    }
}

/// Direction of a one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Local memory to the peer's memory.
    Write,
    /// The peer's memory to local memory.
    Read,
}

/// One operation: `len` bytes between local address `local` and remote address `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferOp {
    /// Direction.
    pub op: Op,
    /// Local address (inside a region registered on this engine).
    pub local: u64,
    /// Remote address (inside a region the peer exposed).
    pub remote: u64,
    /// Bytes.
    pub len: u64,
}

/// Which data path moves the bytes.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BackendKind {
    /// Verbs when a usable RDMA device exists, TCP otherwise.
    #[default]
    Auto,
    /// RDMA verbs (RC QPs through sideway). Needs the `verbs` feature and a device.
    Verbs,
    /// TCP streams; works everywhere.
    Tcp,
    /// In-process memcpy between engines of the same process.
    Loopback,
}

impl BackendKind {
    /// Lowercase name as accepted by `PAGEWIRE_TRANSPORT`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Verbs => "verbs",
            BackendKind::Tcp => "tcp",
            BackendKind::Loopback => "loopback",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who reaps the verbs backend's completions (libfabric's `FI_PROGRESS_AUTO` and
/// `FI_PROGRESS_MANUAL`). TCP and loopback move bytes on their own threads either way.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ProgressMode {
    /// A completion thread reaps what no caller is waiting for, and steps aside while
    /// callers reap (so a waiter spins on one core, not two).
    #[default]
    Auto,
    /// No completion thread: completions, notifications and the connection health checks
    /// move only while the application is inside the engine (a `wait`, `try_wait`,
    /// `poll_notification`, `try_notification`, or [`crate::Engine::reap`]). For
    /// loops that poll anyway, like perftest's: no second thread competes for the cores
    /// or wakes up under the caller. A [`crate::TransferHandle::status`] or a blocking
    /// receive on [`crate::Engine::notifications`] alone does not reap. Both ends need
    /// calls: a batch's notification that must follow data striped over several QPs is
    /// posted when that data's completions are reaped on the sending engine.
    Manual,
}

impl ProgressMode {
    /// Lowercase name as accepted by `PAGEWIRE_PROGRESS`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProgressMode::Auto => "auto",
            ProgressMode::Manual => "manual",
        }
    }
}

impl fmt::Display for ProgressMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One registration as a backend returned it: its keys, and backend state (the verbs MR
/// object) that the registry keeps, without knowing its type, until it hands the handle
/// back for deregistration.
pub(crate) struct MrHandle {
    /// Local key (verbs lkey; TCP/loopback: an opaque id).
    pub lkey: u32,
    /// Remote key peers present (verbs rkey; TCP/loopback: checked by the receiver).
    pub rkey: u32,
    /// Backend state kept alive while registered (e.g. the verbs MR object).
    #[allow(dead_code)] // read by the verbs backend only
    pub handle: Option<Box<dyn Any + Send + Sync>>,
    /// Keys on rails 1.. (a multi-rail verbs backend registers on every device): lkeys
    /// and rkeys, in rail order. Empty for one rail.
    pub lrails: RailKeys,
    pub rrails: RailKeys,
}

/// One RDMA device (rail) of a multi-rail verbs engine and what it carried, as
/// [`Engine::rail_stats`](crate::Engine::rail_stats) reports it. Counted only when the
/// engine drives two rails or more (one rail keeps today's hot path, without counters).
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RailStats {
    /// Device name (`mlx5_0`, `rxe1`).
    pub device: String,
    /// Port number.
    pub port: u8,
    /// Link speed in Gb/s (width x lane rate) the stripe is weighted by.
    pub gbps: u32,
    /// Bytes this rail completed (data WRs acknowledged), over all peers.
    pub bytes: u64,
    /// Failures: a connection's rail taken out of the stripe (QP in error, port down).
    pub errors: u64,
    /// Slices another rail failed and this one carried again.
    pub retries: u64,
}

/// Most RDMA devices (rails) one engine drives.
pub const MAX_RAILS: usize = 8;

/// A registration's keys on rails 1.. (rail 0's are the plain `lkey`/`rkey`), inline:
/// `Copy`, no allocation, empty for a one-rail engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) struct RailKeys {
    n: u8,
    keys: [u32; MAX_RAILS - 1],
}

impl RailKeys {
    /// No extra rail.
    pub(crate) const NONE: RailKeys = RailKeys {
        n: 0,
        keys: [0; MAX_RAILS - 1],
    };

    /// From the keys of rails 1..; `None` if there are more than `MAX_RAILS - 1`.
    pub(crate) fn from_slice(keys: &[u32]) -> Option<Self> {
        if keys.len() >= MAX_RAILS {
            return None;
        }
        let mut k = RailKeys::NONE;
        k.keys[..keys.len()].copy_from_slice(keys);
        k.n = keys.len() as u8;
        Some(k)
    }

    /// Keys of rails 1.., in order.
    pub(crate) fn as_slice(&self) -> &[u32] {
        &self.keys[..usize::from(self.n)]
    }

    /// The key on `rail`, rail 0's being `base`; `None` past the last rail.
    #[allow(dead_code)] // multi-rail verbs only
    pub(crate) fn key(&self, base: u32, rail: usize) -> Option<u32> {
        match rail {
            0 => Some(base),
            r => self.as_slice().get(r - 1).copied(),
        }
    }
}

impl MrHandle {
    /// A registration with no backend state, one key serving as lkey and rkey (TCP and
    /// loopback, where the key only names the region).
    pub(crate) fn keyed(key: u32) -> Self {
        Self {
            lkey: key,
            rkey: key,
            handle: None,
            lrails: RailKeys::NONE,
            rrails: RailKeys::NONE,
        }
    }
}

impl fmt::Debug for MrHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrHandle")
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish_non_exhaustive()
    }
}
