//! In-process loopback backend: engines of the same process copy with `memmove`.
//!
//! Connecting still runs the full control-port handshake, so tests exercise the same
//! path as the network backends. The data path looks the peer engine up in a
//! process-global table (engine id -> its registry), re-validates every remote range
//! against the peer's *current* registrations (and their keys) and pins the peer region
//! for the copy, so a peer that deregisters or shuts down mid-batch makes the batch
//! fail instead of writing into freed memory. One worker thread per connection runs
//! batches in order, in slices of `max_wr_bytes`, checking cancel/deadline, our close and
//! the peer's shutdown between slices. Closing the connection joins its worker, and the
//! peer's shutdown waits for the pin on its memory to be dropped, so neither engine's
//! memory is touched after its shutdown returned.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::Sender;

use crate::config::EngineConfig;
use crate::contract::{
    Backend, BackendInfo, BackendInit, BatchState, Conn, ConnCtx, EndpointInfo, NotifySink,
    PendingConn, ResolvedOp, ResolvedOps,
};
use crate::core::batch::NotifyGate;
use crate::core::registry::{PeerPin, Registry};
use crate::core::slice::{piece_count, pieces};
use crate::error::{Error, HandshakeError, PeerFault, Result};
use crate::types::{Access, BackendKind, MrHandle, Op, PeerId};
use crate::util::lock;

type ConnKey = (u64, u64);

fn engines() -> &'static Mutex<HashMap<u64, Weak<Registry>>> {
    static T: OnceLock<Mutex<HashMap<u64, Weak<Registry>>>> = OnceLock::new();
    T.get_or_init(Default::default)
}

fn sinks() -> &'static Mutex<HashMap<ConnKey, NotifySink>> {
    static T: OnceLock<Mutex<HashMap<ConnKey, NotifySink>>> = OnceLock::new();
    T.get_or_init(Default::default)
}

/// Every live connection end, so that closing or breaking one end breaks the other: a
/// departed peer is noticed (and its worker released) without a `disconnect`, and a peer
/// we consider gone can no longer copy into our memory.
fn links() -> &'static Mutex<HashMap<ConnKey, Weak<Shared>>> {
    static T: OnceLock<Mutex<HashMap<ConnKey, Weak<Shared>>>> = OnceLock::new();
    T.get_or_init(Default::default)
}

pub(crate) fn open(config: &EngineConfig, init: &BackendInit) -> Result<Arc<dyn Backend>> {
    lock(engines()).insert(init.engine_id, Arc::downgrade(&init.registry));
    Ok(Arc::new(LoopbackBackend {
        engine_id: init.engine_id,
        next_key: AtomicU32::new(1),
        next_conn: AtomicU64::new(1),
        slice: config.max_wr_bytes.max(1),
    }))
}

struct LoopbackBackend {
    engine_id: u64,
    next_key: AtomicU32,
    next_conn: AtomicU64,
    slice: u64,
}

impl Backend for LoopbackBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Loopback
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            kind: BackendKind::Loopback,
            device: "loopback".into(),
            link: "in-process memcpy".into(),
            qps_or_streams: 1,
            tx_depth: 1,
            signal_every: 1,
            max_wr_bytes: self.slice,
            max_mr_bytes: 0,
            ..BackendInfo::default()
        }
    }

    fn register(&self, _addr: usize, _len: usize, _access: Access) -> Result<MrHandle> {
        let k = self.next_key.fetch_add(1, Ordering::Relaxed);
        Ok(MrHandle::keyed(k))
    }

    fn deregister(&self, _mr: MrHandle) {}

    fn prepare_conn(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo)> {
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let ep = EndpointInfo::Loopback {
            engine_id: self.engine_id,
            conn,
        };
        Ok((
            Box::new(Pending {
                key: (self.engine_id, conn),
                slice: self.slice,
            }),
            ep,
        ))
    }

    fn shutdown(&self) {
        lock(engines()).remove(&self.engine_id);
        lock(sinks()).retain(|k, _| k.0 != self.engine_id);
    }
}

struct Pending {
    key: ConnKey,
    slice: u64,
}

impl PendingConn for Pending {
    fn complete(self: Box<Self>, remote: &EndpointInfo, ctx: ConnCtx) -> Result<Arc<dyn Conn>> {
        let EndpointInfo::Loopback { engine_id, conn } = *remote else {
            return Err(HandshakeError::BackendMismatch {
                ours: "loopback".into(),
                theirs: remote.backend_name().into(),
            }
            .into());
        };
        if !lock(engines()).contains_key(&engine_id) {
            return Err(HandshakeError::BadField {
                field: "loopback engine id",
                value: format!("{engine_id:#x} is not an engine of this process"),
            }
            .into());
        }
        lock(sinks()).insert(self.key, ctx.notify.clone());
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let shared = Arc::new(Shared {
            peer: ctx.peer,
            local: self.key,
            remote: (engine_id, conn),
            broken: AtomicBool::new(false),
            slice: self.slice,
            tx: Mutex::new(Some(tx)),
        });
        lock(links()).insert(self.key, Arc::downgrade(&shared));
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pagewire-loop".into())
            .spawn(move || {
                for job in rx {
                    worker.run(job);
                }
            })
            .map_err(|e| Error::io("spawn loopback worker", e))?;
        Ok(Arc::new(LoopConn {
            shared,
            worker: Mutex::new(Some(thread)),
        }))
    }
}

struct Job {
    batch: Arc<BatchState>,
    ops: ResolvedOps,
    notify: Option<u32>,
}

struct Shared {
    peer: PeerId,
    local: ConnKey,
    remote: ConnKey,
    broken: AtomicBool,
    slice: u64,
    /// The worker's queue; taken when the connection breaks, so the worker drains what
    /// is queued (failing it) and exits.
    tx: Mutex<Option<Sender<Job>>>,
}

impl Shared {
    /// Breaks this end and the peer's.
    fn gone(&self, fault: PeerFault, why: &str) -> Error {
        self.break_both();
        Error::peer_gone(self.peer, fault, why)
    }

    /// Marks this end broken: no more batches, no more notifications into it, the worker
    /// exits once its queue is drained.
    fn break_local(&self) {
        self.broken.store(true, Ordering::Release);
        lock(&self.tx).take();
        lock(sinks()).remove(&self.local);
        lock(links()).remove(&self.local);
    }

    fn break_both(&self) {
        self.break_local();
        let peer = lock(links()).get(&self.remote).and_then(Weak::upgrade);
        if let Some(p) = peer {
            p.break_local();
        }
    }

    fn run(&self, job: Job) {
        let b = &job.batch;
        if self.broken.load(Ordering::Acquire) {
            b.fail(self.gone(PeerFault::Disconnected, "connection closed"));
            return;
        }
        // One pin is reused while consecutive ops stay in the same peer region.
        let mut pin: Option<PeerPin> = None;
        let slices = job.ops.iter().map(|o| piece_count(o.len, self.slice)).sum();
        let gate = NotifyGate::new(slices);
        let mut last = slices == 0;
        for op in &job.ops {
            if b.should_stop(Instant::now()) {
                return;
            }
            match self.copy(b, &mut pin, op, &gate) {
                Ok(l) => last |= l,
                Err(e) => {
                    b.fail(e);
                    return;
                }
            }
        }
        drop(pin);
        if !last {
            return; // stopped (cancelled, failed or past its deadline) before the last slice
        }
        if let Some(tag) = job.notify {
            let sink = lock(sinks()).get(&self.remote).cloned();
            match sink {
                Some(s) => {
                    if !s.notify(tag) {
                        // Broken before the batch reports, so its waiter sees both.
                        self.break_both();
                        b.fail(self.refused(
                            "the peer's notification queue is full (notification dropped)".into(),
                        ));
                        return;
                    }
                }
                None => {
                    b.fail(self.gone(
                        PeerFault::Disconnected,
                        "peer connection closed before the notification",
                    ));
                    return;
                }
            }
        }
        b.succeed(Instant::now());
    }

    /// One resolved op: validate against the peer's live registry, pin, copy.
    /// `Ok(true)`: its last slice was the batch's last (the notify gate opened).
    fn copy(
        &self,
        b: &BatchState,
        pin: &mut Option<PeerPin>,
        op: &ResolvedOp,
        gate: &NotifyGate,
    ) -> Result<bool> {
        let needed = match op.op {
            Op::Write => Access::REMOTE_WRITE,
            Op::Read => Access::REMOTE_READ,
        };
        let end = op.remote + op.len;
        let reuse = pin.as_ref().is_some_and(|p| {
            let r = p.region();
            r.access.contains(needed) && op.remote >= r.addr && end <= r.end()
        });
        if !reuse {
            *pin = None;
            let registry = lock(engines())
                .get(&self.remote.0)
                .and_then(Weak::upgrade)
                .ok_or_else(|| self.gone(PeerFault::Disconnected, "peer engine shut down"))?;
            let p = registry
                .pin_for_peer(op.remote, op.len, needed)
                .map_err(|e| self.refused(e.to_string()))?;
            *pin = Some(p);
        }
        let region = pin.as_ref().expect("set above").region();
        let rkey_ok = region
            .chunk_at(op.remote)
            .is_some_and(|c| c.rkey == op.rkey && end <= c.addr + c.len);
        if !rkey_ok {
            return Err(self.refused(format!("rkey {:#x} does not match", op.rkey)));
        }
        let mut opened = false;
        for (off, n) in pieces(op.len, self.slice) {
            if b.should_stop(Instant::now()) {
                return Ok(false);
            }
            // Our close waits for this worker, the peer's shutdown for `pin`: stop at once.
            if self.broken.load(Ordering::Acquire) {
                return Err(self.gone(PeerFault::Disconnected, "connection closed"));
            }
            if region.revoked() {
                return Err(self.gone(PeerFault::Disconnected, "peer engine shut down"));
            }
            let (src, dst) = match op.op {
                Op::Write => (op.local + off, op.remote + off),
                Op::Read => (op.remote + off, op.local + off),
            };
            // Held for the slice: a failure or cancellation reported from now on waits for
            // it, and none is given after one, so nothing lands after it is reported.
            let Some(_landing) = b.landing() else {
                return Ok(false);
            };
            // SAFETY: the local range was validated by the engine against a registered
            // region that the batch pins while it is pending (it loses its pins only once
            // it failed or was cancelled, under the landing guard we hold: see `post`); the
            // remote range was validated against the peer's registry and is pinned by
            // `pin`. Both regions' memory stays allocated while registered (caller
            // contract of `register_raw`, or the HostBuffer keep-alive). `copy` (memmove)
            // tolerates overlap when an engine is connected to itself.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
            b.add_progress(0, n);
            if gate.landed(1) {
                opened = true;
            }
        }
        b.add_progress(1, 0);
        Ok(opened)
    }

    fn refused(&self, reason: String) -> Error {
        Error::Remote {
            peer: self.peer,
            reason,
        }
    }
}

struct LoopConn {
    shared: Arc<Shared>,
    /// Joined on close: after that, nothing of this connection touches memory.
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Conn for LoopConn {
    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<()> {
        // Every copy, either way, is under the batch's landing guard.
        batch.guarded_by_landing();
        let batch = Arc::new(batch);
        let tx = lock(&self.shared.tx);
        let Some(tx) = tx.as_ref().filter(|_| !self.is_broken()) else {
            return Err(Error::peer_gone(
                self.shared.peer,
                PeerFault::Disconnected,
                "connection closed",
            ));
        };
        tx.send(Job { batch, ops, notify }).map_err(|_| {
            Error::peer_gone(
                self.shared.peer,
                PeerFault::Disconnected,
                "loopback worker stopped",
            )
        })
    }

    fn is_broken(&self) -> bool {
        self.shared.broken.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.shared.break_both();
        // The worker fails what is queued and stops within one slice.
        let t = lock(&self.worker).take();
        if let Some(t) = t
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

impl Drop for LoopConn {
    fn drop(&mut self) {
        self.close();
    }
}
