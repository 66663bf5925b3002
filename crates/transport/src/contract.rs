//! The contract between the engine core and the data paths (see docs/architecture.md).
//!
//! The core validates and resolves every op before a backend sees it: the local range
//! lies inside one registered chunk (`lkey`), the remote range inside one chunk the peer
//! exposed (`rkey`), and both have the access the op needs. A backend only moves bytes
//! and reports progress through [`BatchState`].
//!
//! This module says what a backend is (the traits below) and what it is handed; the
//! backends (`crate::backends`) implement it, the engine drives it. It imports only the
//! vocabulary, errors, config and the core.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::config::EngineConfig;
pub(crate) use crate::core::batch::{BatchState, Settle};
use crate::core::registry::{Registry, RemoteTable};
pub(crate) use crate::core::resolve::{ResolvedOp, ResolvedOps};
pub(crate) use crate::core::run::RunCell;
use crate::core::topology::MemoryLocation;
pub(crate) use crate::core::wait::Reaper;
#[allow(unused_imports)] // QpInfo: for the verbs backend
pub(crate) use crate::core::wire::{EndpointInfo, QpInfo};
use crate::error::{Error, Result};
use crate::types::{Access, BackendKind, MrHandle, Notification, PeerId, RailStats};

/// Which data path, and the figures a benchmark header prints.
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendInfo {
    /// Verbs, Tcp or Loopback (never Auto).
    pub kind: BackendKind,
    /// Device name (`rxe0`, `mlx5_0`), or `tcp`/`loopback`.
    pub device: String,
    /// Verbs port (0 otherwise).
    pub port: u8,
    /// Link layer / transport description (`Ethernet (RoCEv2)`, `InfiniBand`, `TCP`).
    pub link: String,
    /// Path MTU in bytes (0 when not applicable).
    pub mtu: u32,
    /// Local GID (verbs).
    pub gid: Option<[u8; 16]>,
    /// GID index in use (verbs).
    pub gid_index: Option<u32>,
    /// LID (verbs; 0 on RoCE).
    pub lid: u16,
    /// QPs (verbs) or streams (TCP) per peer (1 on loopback).
    pub qps_or_streams: u16,
    /// The old name of [`BackendInfo::qps_or_streams`] (same value).
    #[deprecated(since = "0.1.0", note = "renamed to `qps_or_streams`")]
    pub lanes_per_peer: u16,
    /// Send queue depth per QP (verbs) or in-flight chunks per stream (TCP).
    pub tx_depth: u32,
    /// Signal one WR in N (verbs; 1 otherwise).
    pub signal_every: u32,
    /// Largest WR / chunk.
    pub max_wr_bytes: u64,
    /// Largest single registration; bigger regions are split.
    pub max_mr_bytes: u64,
    /// RDMA READs one QP keeps outstanding (verbs: the device's limit, at most 16; `None`
    /// for backends without one-sided READs on the wire).
    pub max_outstanding_reads: Option<u32>,
    /// Why this backend was chosen (filled by the engine).
    pub selection: String,
    /// Verbs: every rail (device) the engine stripes over, `name:port` with its GID index
    /// and link speed; rail 0 is the one the fields above describe. Empty otherwise.
    pub rails: Vec<String>,
}

/// Delivers `(peer, tag)` notifications into the engine's queue.
#[derive(Clone)]
pub(crate) struct NotifySink {
    pub(crate) peer: PeerId,
    /// The engine's id (see [`NotifyWait`]).
    pub(crate) engine: u64,
    pub(crate) tx: Sender<Notification>,
    /// Most notifications the queue holds (`EngineConfig::notify_queue`).
    pub(crate) cap: usize,
    /// Notifications dropped because the queue was full (`Engine::notifications_dropped`).
    pub(crate) dropped: Arc<AtomicU64>,
}

impl NotifySink {
    /// Surfaces a notification from this connection's peer. Call only once every byte of
    /// the batch it ends is in local memory.
    ///
    /// `false`: the queue holds `cap` notifications the application has not taken, so
    /// this one is dropped (and counted); the caller breaks the peer's connection, which
    /// is how the peer learns that it outran the application.
    #[must_use]
    pub(crate) fn notify(&self, tag: u32) -> bool {
        let n = Notification {
            peer: self.peer,
            tag,
        };
        // A thread waiting in this engine's `poll_notification` that reaped the tag itself
        // takes it directly when the queue holds nothing older: the same order, without a
        // send and a receive on the queue.
        let queued = HANDOFF.with(|h| match &mut *h.borrow_mut() {
            Some(w) if w.engine == self.engine && w.slot.is_none() && self.tx.is_empty() => {
                w.slot = Some(n);
                false
            }
            _ => true,
        });
        if !queued {
            return true;
        }
        if self.tx.len() >= self.cap {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                peer = %self.peer,
                cap = self.cap,
                "notification queue full: notification dropped, breaking the peer's connection"
            );
            return false;
        }
        // The receiver lives as long as the engine; an error means it is shutting down.
        let _ = self.tx.send(n);
        true
    }
}

/// A thread's wait in `Engine::poll_notification`, and the notification handed to it.
struct Handoff {
    engine: u64,
    slot: Option<Notification>,
}

thread_local! {
    static HANDOFF: std::cell::RefCell<Option<Handoff>> = const { std::cell::RefCell::new(None) };
}

/// Marks this thread as waiting for engine `engine`'s notifications while it lives, so
/// that [`NotifySink::notify`] called on this thread (by its own reaping) hands a tag
/// over instead of queueing it. Anything still handed over when it ends goes to the queue.
pub(crate) struct NotifyWait<'a> {
    tx: &'a Sender<Notification>,
    prev: Option<Handoff>,
}

impl<'a> NotifyWait<'a> {
    pub(crate) fn enter(engine: u64, tx: &'a Sender<Notification>) -> Self {
        let prev = HANDOFF.with(|h| h.replace(Some(Handoff { engine, slot: None })));
        NotifyWait { tx, prev }
    }

    /// The notification handed over, if any.
    pub(crate) fn take(&self) -> Option<Notification> {
        HANDOFF.with(|h| h.borrow_mut().as_mut().and_then(|w| w.slot.take()))
    }
}

impl Drop for NotifyWait<'_> {
    fn drop(&mut self) {
        let mine = HANDOFF.with(|h| h.replace(self.prev.take()));
        if let Some(n) = mine.and_then(|w| w.slot) {
            let _ = self.tx.send(n);
        }
    }
}

impl fmt::Debug for NotifySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NotifySink({})", self.peer)
    }
}

/// What a connection gets from the engine when it completes.
#[derive(Debug, Clone)]
pub(crate) struct ConnCtx {
    /// The engine's id for the peer.
    pub peer: PeerId,
    /// The peer's IP as seen on the control connection (where its data listener is).
    #[allow(dead_code)]
    pub remote_ip: std::net::IpAddr,
    /// The handshake's deadline: the backend's own setup (TCP data streams) ends by it.
    #[allow(dead_code)]
    pub deadline: Instant,
    /// Where incoming notifications go.
    pub notify: NotifySink,
    /// The local registry (for backends that check incoming ops themselves).
    #[allow(dead_code)]
    pub registry: Arc<Registry>,
    /// The engine config.
    #[allow(dead_code)]
    pub config: Arc<EngineConfig>,
    /// The initiator's way to reconnect a rail (`None` on the acceptor, which answers).
    #[allow(dead_code)]
    pub rails: Option<Arc<dyn RailControl>>,
}

/// Engine-side state some backends need at open time.
#[derive(Debug, Clone)]
pub(crate) struct BackendInit {
    /// Random id of the engine (loopback: key of the process-global table).
    pub engine_id: u64,
    /// The local registry.
    pub registry: Arc<Registry>,
}

/// A data path.
pub(crate) trait Backend: Send + Sync + 'static {
    /// Verbs | Tcp | Loopback.
    fn kind(&self) -> BackendKind;
    /// Device, port, MTU, GID... for reports.
    fn info(&self) -> BackendInfo;
    /// Called once per MR chunk (the engine already split at `info().max_mr_bytes`);
    /// the returned keys are stored in the registry.
    fn register(&self, addr: usize, len: usize, access: Access) -> Result<MrHandle, Error>;
    /// Registers one chunk of a dma-buf (`ibv_reg_dmabuf_mr`); only verbs supports it.
    fn register_dmabuf(
        &self,
        _fd: std::os::fd::RawFd,
        _offset: u64,
        _len: usize,
        _iova: u64,
        _access: Access,
    ) -> Result<MrHandle, Error> {
        Err(Error::Unsupported {
            what: format!("dma-buf registration on the {} backend", self.kind()),
        })
    }
    /// Releases one registration.
    fn deregister(&self, mr: MrHandle);
    /// Builds the local half of a new connection and its part of the handshake.
    fn prepare_conn(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo), Error>;
    /// Stops background threads; called once when the engine shuts down.
    fn shutdown(&self) {}
    /// The handle through which a waiting thread reaps completions itself, for backends
    /// with a completion queue to poll (verbs).
    fn reaper(&self) -> Option<Arc<dyn Reaper>> {
        None
    }
    /// Says where the memory of the registrations with these (rail-0) lkeys is, for the
    /// rail choice of a multi-rail backend; others ignore it.
    fn place(&self, _lkeys: &[u32], _loc: &MemoryLocation) {}
    /// Per-rail counters (a multi-rail verbs backend; empty otherwise).
    fn rail_stats(&self) -> Vec<RailStats> {
        Vec::new()
    }
}

/// A connection waiting for the peer's half.
pub(crate) trait PendingConn: Send {
    /// Finishes with the peer's half (e.g. QPs to RTR/RTS).
    fn complete(
        self: Box<Self>,
        remote: &EndpointInfo,
        ctx: ConnCtx,
    ) -> Result<Arc<dyn Conn>, Error>;
}

/// An established connection.
pub(crate) trait Conn: Send + Sync {
    /// Posts one batch. `ops` are validated and resolved; the backend reports through
    /// `batch` (progress, success, first error) and never blocks past its deadline.
    /// With `notify`, the peer must surface the tag only after every byte landed.
    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<(), Error>;
    /// A fast lane for a prepared batch of these (validated) ops, if this backend has one
    /// for them; `None`: each run is re-submitted through [`Conn::post`].
    fn prepare_fast_path(&self, _req: FastPathRequest<'_>) -> Option<Box<dyn FastPath>> {
        None
    }
    /// The peer's exposed regions, each time they are (re)described: a backend that needs
    /// more of them than the resolved ops carry (multi-rail verbs: their rkeys on every
    /// rail) keeps it.
    fn set_remote_table(&self, _table: &Arc<RemoteTable>) {}
    /// Whether the connection failed (peer gone, QP in error).
    fn is_broken(&self) -> bool;
    /// Tears the connection down; pending batches fail with `PeerGone`.
    fn close(&self);
    /// Proves the data path once both ends are connected (verbs: a zero-length RDMA
    /// WRITE per QP), before the connection is published; never past `deadline`.
    fn probe(&self, _deadline: Instant) -> Result<(), Error> {
        Ok(())
    }
    /// The acceptor's side of reconnecting rail `rail` (multi-rail verbs): new QPs
    /// connected to the initiator's `theirs`; returns our endpoint for it, and what puts
    /// the new QPs in the rail's place (`true`: the initiator proved them and said `Ready`)
    /// or drops them (`false`).
    fn accept_rail(
        &self,
        _rail: usize,
        _theirs: &EndpointInfo,
    ) -> Result<(EndpointInfo, RailSwap), Error> {
        Err(Error::Unsupported {
            what: "reconnecting a rail of a connection without rails".into(),
        })
    }
}

/// Installs (`true`) or drops (`false`) a rail's new QPs on the acceptor.
pub(crate) type RailSwap = Box<dyn FnOnce(bool) + Send>;

/// How a connection's initiator side reconnects one of its rails through the engine's
/// control channel (given to backends in [`ConnCtx::rails`]).
pub(crate) trait RailControl: Send + Sync + fmt::Debug {
    /// Sends `ours` (the rail's new QPs) to the peer, hands its answer to `complete`
    /// (which connects and probes ours), and tells the peer `Ready` once that succeeded.
    fn reconnect(
        &self,
        rail: usize,
        ours: EndpointInfo,
        complete: &mut dyn FnMut(&EndpointInfo, Instant) -> Result<(), Error>,
    ) -> Result<(), Error>;
}

/// A backend's fast lane for one prepared batch (verbs: one chain on one QP).
pub(crate) trait FastPath: Send + Sync {
    /// Posts one run without waiting; `tag` is the notification's immediate, if the batch
    /// has one. The run reports into the [`RunCell`] the lane was built with. `Err`:
    /// nothing was posted, or the connection broke while posting.
    fn start(&self, tag: Option<u32>) -> Result<()>;
    /// One reaping round of a thread waiting for the run (verbs: its connection's send
    /// CQ, and now and then every connection of the engine).
    fn poll(&self) -> usize;
    /// The run passed its deadline: stop what the hardware was given for it (verbs: its
    /// connection breaks and the run's WRs flush), waiting a short bound at most. `true`
    /// when nothing of it can touch the local memory any more.
    fn abort(&self) -> bool;
}

/// What [`Engine::prepare`](crate::Engine::prepare) hands a backend to build a lane from.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // only verbs builds lanes
pub(crate) struct FastPathRequest<'a> {
    pub ops: &'a ResolvedOps,
    pub notify: Option<u32>,
    pub cell: &'a Arc<RunCell>,
}

/// Where a backend reports a batch's outcome: the core's [`BatchState`] (a plain recorder
/// in the verbs-layer tests, the connection's own probe and heartbeat WRs).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // TCP and loopback call BatchState
pub(crate) trait BatchSink: Send + Sync {
    /// `wrs` more WRs carrying `bytes` have completed locally.
    fn on_acked(&self, wrs: usize, bytes: u64);
    /// The batch failed; called at most once per batch.
    fn fail(&self, err: Error);
    /// Every WR (and the notification, if any) completed successfully; at most once.
    fn complete(&self);
    /// Whether posting the rest is pointless (cancelled, failed, past its deadline).
    fn should_stop(&self) -> bool {
        false
    }
    /// [`Self::should_stop`] without reading the clock (cancelled, failed or done); the
    /// engine core expires a batch whose deadline passed before submission itself.
    fn is_stopped(&self) -> bool {
        false
    }
    /// Whether cutting this batch short loses work someone asked for. The connection's
    /// own WRs (heartbeat, connect-time probe) do not: a close that flushes only those is
    /// a clean close.
    fn is_user_work(&self) -> bool {
        true
    }
    /// The connection carrying (part of) this batch offers `settle`, which stops its WRs
    /// on the NIC (see [`Settle`]); a sink that reports into the engine core's batch
    /// hands it on, so that a failure there stops the NIC before it is reported.
    fn settled_by(&self, _settle: Weak<dyn Settle>) {}
}

impl BatchSink for BatchState {
    fn on_acked(&self, wrs: usize, bytes: u64) {
        self.add_progress(wrs, bytes);
    }
    fn fail(&self, err: Error) {
        BatchState::fail(self, err);
    }
    fn complete(&self) {
        self.succeed(Instant::now());
    }
    fn should_stop(&self) -> bool {
        BatchState::should_stop(self, Instant::now())
    }
    fn is_stopped(&self) -> bool {
        BatchState::is_stopped(self)
    }
    fn settled_by(&self, settle: Weak<dyn Settle>) {
        BatchState::settled_by(self, settle);
    }
}

/// Where a backend delivers the tags of incoming notifications (the engine's
/// [`NotifySink`]).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))] // TCP and loopback call NotifySink
pub(crate) trait TagSink: Send + Sync {
    /// `bytes` is the length of the WRITE_WITH_IMM that carried the tag. `false`: the
    /// tag was dropped (the engine's queue is full) and the connection must break.
    fn notify(&self, tag: u32, bytes: u32) -> bool;
}

impl TagSink for NotifySink {
    fn notify(&self, tag: u32, _bytes: u32) -> bool {
        NotifySink::notify(self, tag)
    }
}
