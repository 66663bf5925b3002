//! A deterministic world of engines over the core, for the conformance suite
//! (`tests/conformance_sim.rs`): no thread, no socket, no clock read. Like quinn's test
//! `Pair`, it owns the clock and the network: time moves only when a caller waits (to the
//! next event, or by one nap of `core::wait`'s schedule), and every message crosses a link
//! with a latency drawn from a seeded generator, so one seed gives one trace.
//!
//! A [`SimEngine`] has the methods of `Engine` that the suite calls, and runs them on the
//! same core code the engine and the backends run: the registry and MR chunking,
//! `core::resolve`, `core::slice::pieces` at `max_wr_bytes`, a `core::window::InFlight`
//! of `tx_depth` per link direction, `BatchState` with its deadline, landing guard and
//! `NotifyGate`, `RunCell` for prepared runs, and the handshake: every control frame is
//! encoded and decoded by `core::wire` and judged by the `core::handshake` states (token,
//! backend match, `Describe`). The responder checks every piece against its live registry
//! and keys, as the TCP and loopback responders do. The data path keeps loopback's
//! contract: in order per connection, no fast path. Bytes move between the engines'
//! registered host memory with `memmove`, so the suite checks them as on any backend.
//!
//! Not a stable API (the `sim` feature exists for the crate's own tests).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
// A plain address value (the engines' names in the world); the sim opens no socket.
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::buffer::HostBuffer;
use crate::config::{EngineConfig, EngineConfigBuilder};
use crate::core::batch::{Batch, BatchShared, BatchState, BatchStats, BatchStatus, NotifyGate};
use crate::core::batch::{Deadline, Phase, Pins};
use crate::core::handshake::{self, AwaitRegions, AwaitRequest, AwaitWelcome, Refused, Request};
use crate::core::registry::{Chunk, InsertPlan, PeerPin, RegionInfo, Registry, RemoteTable};
use crate::core::resolve::{self, ResolvedOp, ResolvedOps};
use crate::core::run::RunCell;
use crate::core::slice::{piece_count, pieces};
use crate::core::wait::{NAP_FIRST, next_nap};
use crate::core::window::{Group, InFlight};
use crate::core::wire::{self, EndpointInfo, Frame, Hello, Welcome};
use crate::engine::{PlanEntry, plan_batch};
use crate::error::{Error, HandshakeError, PeerFault, Result};
use crate::types::{
    Access, BackendKind, MrHandle, Notification, Op, PeerId, RegionId, RemoteRegion,
};

/// One way of a link: 2 us plus up to 2 us of seeded jitter.
const LATENCY: Duration = Duration::from_micros(2);
const JITTER_NS: u64 = 2_000;
/// Link speed: 8 bytes a nanosecond (64 Gbit/s).
const BYTES_PER_NS: u64 = 8;

/// The simulated world: clock, network, engines and the trace. Cheap to clone.
#[derive(Clone)]
pub struct World(Rc<WorldInner>);

struct WorldInner {
    /// Simulated time zero (a value given by the caller; never read from the OS here).
    epoch: Instant,
    now: Cell<Duration>,
    rng: Cell<u64>,
    seq: Cell<u64>,
    events: RefCell<BTreeMap<(Duration, u64), Event>>,
    engines: RefCell<Vec<(SocketAddr, Weak<EngineInner>)>>,
    /// Work handed over by the test's `spawn`, run at the next step of the world.
    tasks: RefCell<VecDeque<Box<dyn FnOnce()>>>,
    in_task: Cell<bool>,
    trace: Cell<u64>,
    steps: Cell<u64>,
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World")
            .field("now", &self.0.now.get())
            .field("steps", &self.0.steps.get())
            .finish()
    }
}

impl World {
    /// A world whose time starts at `epoch`, with latencies drawn from `seed`.
    pub fn new(seed: u64, epoch: Instant) -> World {
        World(Rc::new(WorldInner {
            epoch,
            now: Cell::new(Duration::ZERO),
            rng: Cell::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            seq: Cell::new(0),
            events: RefCell::new(BTreeMap::new()),
            engines: RefCell::new(Vec::new()),
            tasks: RefCell::new(VecDeque::new()),
            in_task: Cell::new(false),
            trace: Cell::new(0xcbf2_9ce4_8422_2325),
            steps: Cell::new(0),
        }))
    }

    /// Simulated now.
    pub fn now(&self) -> Instant {
        self.0.epoch + self.0.now.get()
    }

    /// A hash of every event the world handled (kind, time, engine, batch, bytes): the
    /// same seed and the same calls give the same value.
    pub fn trace_hash(&self) -> u64 {
        self.0.trace.get()
    }

    /// Events handled so far.
    pub fn steps(&self) -> u64 {
        self.0.steps.get()
    }

    /// Moves time on by `d`, delivering what arrives meanwhile.
    pub fn advance(&self, d: Duration) {
        let until = self.now() + d;
        self.run_until(until, &mut || false);
    }

    /// Runs `f` at the world's next step (the suite's stand-in for a thread).
    pub fn defer(&self, f: Box<dyn FnOnce()>) {
        self.0.tasks.borrow_mut().push_back(f);
    }

    /// Steps the world until `done()` or `until`: deferred work first, then events in
    /// time order; with nothing due, time moves by the wait policy's next nap.
    pub fn run_until(&self, until: Instant, done: &mut dyn FnMut() -> bool) -> bool {
        let w = &self.0;
        let until = until.saturating_duration_since(w.epoch);
        let mut nap = NAP_FIRST;
        loop {
            self.run_tasks();
            if done() {
                return true;
            }
            let now = w.now.get();
            if now >= until {
                return false;
            }
            let to = (now + nap).min(until);
            let next = w.events.borrow().first_key_value().map(|(k, _)| k.0);
            match next {
                Some(t) if t <= to => {
                    w.now.set(t.max(now));
                    self.fire_due();
                    nap = NAP_FIRST;
                }
                _ => {
                    w.now.set(to);
                    nap = next_nap(nap);
                }
            }
        }
    }

    fn run_tasks(&self) {
        if self.0.in_task.get() {
            return;
        }
        loop {
            let Some(t) = self.0.tasks.borrow_mut().pop_front() else {
                return;
            };
            self.0.in_task.set(true);
            t();
            self.0.in_task.set(false);
        }
    }

    /// Handles every event due now.
    fn fire_due(&self) {
        let now = self.0.now.get();
        loop {
            let ev = {
                let mut evs = self.0.events.borrow_mut();
                match evs.first_key_value() {
                    Some((k, _)) if k.0 <= now => evs.pop_first().map(|(_, e)| e),
                    _ => None,
                }
            };
            let Some(ev) = ev else { return };
            self.0.steps.set(self.0.steps.get() + 1);
            self.handle(ev);
        }
    }

    fn record(&self, what: u8, engine: u64, batch: u64, bytes: u64) {
        let mut h = self.0.trace.get();
        let now = self.0.now.get().as_nanos() as u64;
        for v in [u64::from(what), now, engine, batch, bytes] {
            for b in v.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        self.0.trace.set(h);
    }

    fn random(&self) -> u64 {
        let mut x = self.0.rng.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0.rng.set(x);
        x
    }

    fn schedule(&self, at: Duration, ev: Event) {
        let s = self.0.seq.get();
        self.0.seq.set(s + 1);
        self.0.events.borrow_mut().insert((at, s), ev);
    }

    /// Sends `ev` one way over `link` after `bytes` of payload: in order behind what the
    /// link already carries that way.
    fn send(&self, link: &Link, dir: usize, bytes: u64, ev: Event) {
        let now = self.0.now.get();
        let start = now.max(link.busy[dir].get());
        let sent = start + Duration::from_nanos(bytes / BYTES_PER_NS);
        link.busy[dir].set(sent);
        let lat = LATENCY + Duration::from_nanos(self.random() % JITTER_NS);
        let at = (sent + lat).max(link.last[dir].get());
        link.last[dir].set(at);
        self.schedule(at, ev);
    }

    /// A new engine in this world (the backend named in `config` is its label in the
    /// handshake: loopback or TCP).
    pub fn engine(&self, config: EngineConfig) -> Result<SimEngine> {
        if !matches!(config.backend, BackendKind::Loopback | BackendKind::Tcp) {
            return Err(Error::Unsupported {
                what: format!(
                    "the simulated pair stands in for loopback or TCP, not {}",
                    config.backend
                ),
            });
        }
        let idx = self.0.engines.borrow().len() as u64;
        let addr = SocketAddr::from(([192, 0, 2, 1], 1000 + idx as u16));
        let inner = Rc::new(EngineInner {
            world: self.clone(),
            idx,
            id: self.random(),
            addr,
            config: Arc::new(config),
            registry: Registry::default(),
            next_key: Cell::new(1),
            next_peer: Cell::new(1),
            next_batch: Cell::new(1),
            next_conn: Cell::new(1),
            peers: RefCell::new(BTreeMap::new()),
            sessions: RefCell::new(BTreeMap::new()),
            notes: RefCell::new(VecDeque::new()),
            dropped: Cell::new(0),
            accepted: RefCell::new(VecDeque::new()),
            shut: Cell::new(false),
        });
        self.0
            .engines
            .borrow_mut()
            .push((addr, Rc::downgrade(&inner)));
        Ok(SimEngine {
            _owner: Rc::new(Owner(inner.clone())),
            inner,
        })
    }

    /// An engine from a builder (as `Engine::new(b.build()?)`).
    pub fn engine_with(&self, b: EngineConfigBuilder) -> Result<SimEngine> {
        self.engine(b.build()?)
    }

    fn find(&self, addr: SocketAddr) -> Option<Rc<EngineInner>> {
        self.0
            .engines
            .borrow()
            .iter()
            .find(|(a, _)| *a == addr)
            .and_then(|(_, e)| e.upgrade())
            .filter(|e| !e.shut.get())
    }

    fn handle(&self, ev: Event) {
        match ev {
            Event::Piece(p) => self.on_piece(p),
            Event::Reply(p, outcome) => self.on_reply(p, outcome),
            Event::Notify {
                link,
                dir,
                rec,
                tag,
            } => self.on_notify(&link, dir, rec, tag),
            Event::NotifyDone { rec, outcome } => {
                self.record(5, 0, rec.id, 0);
                match outcome {
                    Ok(()) => rec.state.succeed(self.now()),
                    Err(e) => rec.state.fail(e),
                }
            }
        }
    }

    /// A piece reaches the responder: checked against its live registry and keys, then
    /// a WRITE lands; a READ's bytes go back with the reply.
    fn on_piece(&self, p: Piece) {
        let resp = 1 - p.dir;
        let engine = p.link.ends[resp].engine.upgrade().filter(|e| !e.shut.get());
        self.record(
            1,
            engine.as_ref().map_or(u64::MAX, |e| e.idx),
            p.rec.id,
            p.len,
        );
        let outcome = if p.rec.state.should_stop(self.now()) || p.link.broken.get() {
            Outcome::Skipped
        } else {
            match engine {
                None => Outcome::Failed(Error::peer_gone(
                    p.link.ends[p.dir].peer,
                    PeerFault::Disconnected,
                    "peer engine shut down",
                )),
                Some(e) => match e.serve(&p) {
                    Ok(pin) => Outcome::Landed(pin),
                    Err(err) => Outcome::Failed(err),
                },
            }
        };
        let link = p.link.clone();
        // A READ's bytes travel back; a WRITE's acknowledgement is empty.
        let back = if matches!(outcome, Outcome::Landed(_)) && p.op.op == Op::Read {
            p.len
        } else {
            0
        };
        self.send(&link, resp, back, Event::Reply(p, outcome));
    }

    /// The responder's answer to one piece, at the requester: the window slot is retired,
    /// a READ lands under the batch's landing guard, and the last piece opens the gate.
    fn on_reply(&self, p: Piece, outcome: Outcome) {
        let req = p.dir;
        self.record(2, p.link.ends[req].engine_idx, p.rec.id, p.len);
        {
            let mut w = p.link.window[req].borrow_mut();
            let mut out = Vec::new();
            w.retire_through(p.seq, &mut out);
        }
        match outcome {
            Outcome::Skipped => {}
            Outcome::Failed(e) => p.rec.state.fail(e),
            Outcome::Landed(pin) => {
                if p.op.op == Op::Read {
                    let pin = pin.expect("a READ keeps its pin");
                    let Some(_landing) = p.rec.state.landing() else {
                        self.pump(&p.link, req);
                        return;
                    };
                    if pin.region().revoked() || p.link.broken.get() {
                        drop(_landing);
                        p.rec.state.fail(Error::peer_gone(
                            p.link.ends[req].peer,
                            PeerFault::Disconnected,
                            "peer engine shut down",
                        ));
                        self.pump(&p.link, req);
                        return;
                    }
                    copy(p.op.remote + p.off, p.op.local + p.off, p.len);
                }
                p.rec.state.add_progress(0, p.len);
                if p.rec.gate.landed(1) && !p.rec.state.should_stop(self.now()) {
                    self.finish(&p.link, req, &p.rec);
                }
            }
        }
        self.pump(&p.link, req);
    }

    /// Every data piece of `rec` landed: send its tag, or it is done.
    fn finish(&self, link: &Rc<Link>, dir: usize, rec: &Rc<Rec>) {
        match rec.tag {
            Some(tag) => self.send(
                link,
                dir,
                0,
                Event::Notify {
                    link: link.clone(),
                    dir,
                    rec: rec.clone(),
                    tag,
                },
            ),
            None => rec.state.succeed(self.now()),
        }
    }

    fn on_notify(&self, link: &Rc<Link>, dir: usize, rec: Rc<Rec>, tag: u32) {
        let resp = 1 - dir;
        let engine = link.ends[resp].engine.upgrade().filter(|e| !e.shut.get());
        self.record(
            3,
            engine.as_ref().map_or(u64::MAX, |e| e.idx),
            rec.id,
            u64::from(tag),
        );
        let outcome = if rec.state.should_stop(self.now()) {
            Err(Error::Cancelled)
        } else {
            match engine {
                Some(e) if !link.broken.get() => {
                    let mut q = e.notes.borrow_mut();
                    if q.len() < e.config.notify_queue {
                        q.push_back(Notification {
                            peer: link.ends[resp].peer,
                            tag,
                        });
                        Ok(())
                    } else {
                        drop(q);
                        e.dropped.set(e.dropped.get() + 1);
                        link.break_both();
                        Err(Error::Remote {
                            peer: link.ends[dir].peer,
                            reason: "the peer's notification queue is full (notification dropped)"
                                .into(),
                        })
                    }
                }
                _ => Err(Error::peer_gone(
                    link.ends[dir].peer,
                    PeerFault::Disconnected,
                    "peer connection closed before the notification",
                )),
            }
        };
        self.send(link, resp, 0, Event::NotifyDone { rec, outcome });
    }

    /// Puts waiting pieces of `link`'s direction `dir` on the wire while its window has room.
    fn pump(&self, link: &Rc<Link>, dir: usize) {
        loop {
            if link.window[dir].borrow().available() == 0 {
                return;
            }
            let Some(mut p) = link.waiting[dir].borrow_mut().pop_front() else {
                return;
            };
            if p.rec.state.is_stopped() {
                continue; // cancelled, failed or past its deadline: not posted
            }
            {
                let mut w = link.window[dir].borrow_mut();
                p.seq = w.reserve(1);
                w.push(Group {
                    last_seq: p.seq,
                    wrs: 1,
                    bytes: p.len,
                    owner: (),
                });
            }
            let bytes = if p.op.op == Op::Write { p.len } else { 0 };
            self.send(link, dir, bytes, Event::Piece(p));
        }
    }
}

/// Copies `len` bytes between registered memory of the world's engines.
fn copy(src: u64, dst: u64, len: u64) {
    // SAFETY: both ranges were validated against registrations that are pinned while the
    // copy runs: the requester's by its batch (`BatchState` pins, alive in `Rec`), the
    // responder's by the `PeerPin` just taken (or carried in the reply), and a registered
    // range stays allocated while registered (the HostBuffer keep-alive the registry
    // holds). One thread runs the world, so nothing else writes either range meanwhile;
    // `copy` (memmove) tolerates an engine connected to itself.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
}

enum Event {
    Piece(Piece),
    Reply(Piece, Outcome),
    Notify {
        link: Rc<Link>,
        dir: usize,
        rec: Rc<Rec>,
        tag: u32,
    },
    NotifyDone {
        rec: Rc<Rec>,
        outcome: Result<()>,
    },
}

enum Outcome {
    /// Landed (a READ carries the pin on the responder's region back for its copy).
    Landed(Option<PeerPin>),
    Failed(Error),
    /// The batch had stopped: nothing done.
    Skipped,
}

/// One piece of a batch, cut at `max_wr_bytes` by `core::slice::pieces`.
struct Piece {
    link: Rc<Link>,
    /// The requester's end.
    dir: usize,
    rec: Rc<Rec>,
    op: ResolvedOp,
    off: u64,
    len: u64,
    /// Its slot in the requester's window.
    seq: u64,
}

/// A posted batch, as the requester's side of the world keeps it.
struct Rec {
    id: u64,
    state: BatchState,
    gate: NotifyGate,
    tag: Option<u32>,
}

struct End {
    engine: Weak<EngineInner>,
    engine_idx: u64,
    /// Who the other end is to this end's engine.
    peer: PeerId,
}

/// A connection: two ends, one window and one ordered way each.
struct Link {
    ends: [End; 2],
    broken: Cell<bool>,
    busy: [Cell<Duration>; 2],
    last: [Cell<Duration>; 2],
    window: [RefCell<InFlight<()>>; 2],
    waiting: [RefCell<VecDeque<Piece>>; 2],
    /// Batches posted on it, failed if it breaks.
    live: RefCell<Vec<(usize, Weak<Rec>)>>,
}

impl Link {
    /// Breaks the connection for both ends (a close by `closer`, or a fault): their
    /// pending batches fail, and nothing more lands through it.
    fn break_by(&self, closer: Option<usize>) {
        if self.broken.replace(true) {
            return;
        }
        for w in &self.waiting {
            w.borrow_mut().clear();
        }
        for (dir, rec) in self.live.borrow_mut().drain(..) {
            if let Some(rec) = rec.upgrade() {
                let fault = if closer == Some(dir) {
                    PeerFault::ClosedLocally
                } else {
                    PeerFault::Disconnected
                };
                rec.state.fail(Error::peer_gone(
                    self.ends[dir].peer,
                    fault,
                    "connection closed",
                ));
            }
        }
    }

    fn break_both(&self) {
        self.break_by(None);
    }
}

struct SimPeer {
    link: Rc<Link>,
    /// Our end of the link.
    end: usize,
    remote_session: u64,
    local_session: u64,
    table: RefCell<Arc<RemoteTable>>,
}

struct EngineInner {
    world: World,
    /// Creation order in the world (traces name engines by it).
    idx: u64,
    id: u64,
    addr: SocketAddr,
    config: Arc<EngineConfig>,
    registry: Registry,
    next_key: Cell<u32>,
    next_peer: Cell<u64>,
    next_batch: Cell<u64>,
    next_conn: Cell<u64>,
    peers: RefCell<BTreeMap<PeerId, Rc<SimPeer>>>,
    sessions: RefCell<BTreeMap<u64, PeerId>>,
    notes: RefCell<VecDeque<Notification>>,
    dropped: Cell<u64>,
    accepted: RefCell<VecDeque<PeerId>>,
    shut: Cell<bool>,
}

impl EngineInner {
    fn check_open(&self) -> Result<()> {
        if self.shut.get() {
            return Err(Error::Shutdown);
        }
        Ok(())
    }

    fn token(&self) -> &[u8] {
        self.config.token.as_deref().map_or(&[], str::as_bytes)
    }

    fn peer(&self, peer: PeerId) -> Result<Rc<SimPeer>> {
        self.peers
            .borrow()
            .get(&peer)
            .cloned()
            .ok_or(Error::UnknownPeer { peer })
    }

    fn endpoint(&self, conn: u64, session: u64) -> EndpointInfo {
        match self.config.backend {
            BackendKind::Tcp => EndpointInfo::Tcp {
                data_port: self.addr.port(),
                streams: 1,
                session,
            },
            _ => EndpointInfo::Loopback {
                engine_id: self.id,
                conn,
            },
        }
    }

    /// The responder's checks for one piece (as the loopback and TCP responders): the
    /// range inside a live registration with the access the op needs and the key it
    /// names; a WRITE lands here.
    fn serve(&self, p: &Piece) -> Result<Option<PeerPin>> {
        let needed = match p.op.op {
            Op::Write => Access::REMOTE_WRITE,
            Op::Read => Access::REMOTE_READ,
        };
        let refused = |reason: String| Error::Remote {
            peer: p.link.ends[p.dir].peer,
            reason,
        };
        let (addr, end) = (p.op.remote + p.off, p.op.remote + p.off + p.len);
        let pin = self
            .registry
            .pin_for_peer(addr, p.len, needed)
            .map_err(|e| refused(e.to_string()))?;
        let key_ok = pin
            .region()
            .chunk_at(addr)
            .is_some_and(|c| c.rkey == p.op.rkey && end <= c.addr + c.len);
        if !key_ok {
            return Err(refused(format!("rkey {:#x} does not match", p.op.rkey)));
        }
        match p.op.op {
            Op::Write => {
                copy(p.op.local + p.off, addr, p.len);
                Ok(None)
            }
            Op::Read => Ok(Some(pin)),
        }
    }

    /// Cuts a validated batch into pieces and queues them on the link (as a backend's
    /// `Conn::post`).
    fn post(
        &self,
        p: &SimPeer,
        state: BatchState,
        ops: &[ResolvedOp],
        tag: Option<u32>,
    ) -> Result<()> {
        let link = &p.link;
        let peer = link.ends[p.end].peer;
        if link.broken.get() {
            return Err(Error::peer_gone(
                peer,
                PeerFault::Disconnected,
                "connection closed",
            ));
        }
        if state.is_stopped() {
            return Ok(()); // past its deadline at submission: nothing is posted
        }
        let slice = self.config.max_wr_bytes.max(1);
        let count: u64 = ops.iter().map(|o| piece_count(o.len, slice)).sum();
        let rec = Rc::new(Rec {
            id: state.shared().id,
            state,
            gate: NotifyGate::new(count),
            tag,
        });
        {
            let mut live = link.live.borrow_mut();
            live.retain(|(_, r)| r.strong_count() > 0);
            live.push((p.end, Rc::downgrade(&rec)));
        }
        self.world.record(0, self.idx, rec.id, count);
        {
            let mut q = link.waiting[p.end].borrow_mut();
            for op in ops {
                for (off, len) in pieces(op.len, slice) {
                    q.push_back(Piece {
                        link: link.clone(),
                        dir: p.end,
                        rec: rec.clone(),
                        op: *op,
                        off,
                        len,
                        seq: 0,
                    });
                }
            }
        }
        if count == 0 {
            self.world.finish(link, p.end, &rec);
        }
        self.world.pump(link, p.end);
        Ok(())
    }

    fn shutdown(&self) {
        if self.shut.replace(true) {
            return;
        }
        let peers = std::mem::take(&mut *self.peers.borrow_mut());
        self.sessions.borrow_mut().clear();
        for p in peers.values() {
            p.link.break_by(Some(p.end));
        }
        // No op of a peer is in progress between steps (one thread runs the world):
        // nothing touches the regions once they are revoked.
        let revoked = self.registry.revoke_all();
        drop(revoked.into_handles());
    }
}

/// A simulated engine: the methods of `Engine` that the conformance suite calls.
#[derive(Clone)]
pub struct SimEngine {
    inner: Rc<EngineInner>,
    _owner: Rc<Owner>,
}

/// Shuts the engine down with the application's last clone, as `Engine` does.
struct Owner(Rc<EngineInner>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

impl fmt::Debug for SimEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimEngine")
            .field("idx", &self.inner.idx)
            .field("addr", &self.inner.addr)
            .finish()
    }
}

impl SimEngine {
    /// The engine's name in the world (an address no socket has).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The world it lives in.
    pub fn world(&self) -> &World {
        &self.inner.world
    }

    /// As `Engine::register`: MR chunks of `max_mr_bytes`, keys from a counter.
    pub fn register(&self, buf: &HostBuffer, access: Access) -> Result<RegionId> {
        let e = &self.inner;
        e.check_open()?;
        let (addr, len) = (buf.addr(), buf.len() as u64);
        if let InsertPlan::Existing(id) = e.registry.begin_insert(addr, len, access)? {
            return Ok(id);
        }
        let max = e.config.max_mr_bytes.filter(|&m| m > 0).unwrap_or(u64::MAX);
        let mut chunks = Vec::new();
        let mut mrs = Vec::new();
        for (off, n) in pieces(len, max) {
            let k = e.next_key.get();
            e.next_key.set(k + 1);
            let mr = MrHandle::keyed(k);
            chunks.push(Chunk {
                addr: addr + off,
                len: n,
                lkey: mr.lkey,
                rkey: mr.rkey,
                lrails: mr.lrails,
                rrails: mr.rrails,
            });
            mrs.push(mr);
        }
        e.registry
            .finish_insert(addr, len, access, chunks, mrs, Some(buf.keepalive()))
            .map_err(|(err, _)| err)
    }

    /// As `Engine::deregister`.
    pub fn deregister(&self, id: RegionId) -> Result<()> {
        self.inner.registry.remove(id).map(drop)
    }

    /// As `Engine::deregister_wait`, stepping the world meanwhile.
    pub fn deregister_wait(&self, id: RegionId, deadline: Instant) -> Result<()> {
        let start = self.world().now();
        let mut last = None;
        self.world()
            .run_until(deadline, &mut || match self.deregister(id) {
                Err(Error::RegionBusy { .. }) => false,
                other => {
                    last = Some(other);
                    true
                }
            });
        last.unwrap_or_else(|| {
            Err(Error::Timeout {
                after: self.world().now() - start,
            })
        })
    }

    /// Local regions, sorted by address.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.inner.registry.list()
    }

    /// What peers see of our memory.
    pub fn exposed_regions(&self) -> Vec<RemoteRegion> {
        self.inner.registry.exposed()
    }

    /// The handshake with the engine named `addr`: each frame is encoded, crosses the
    /// world (one latency, other events go on meanwhile), is decoded and handed to the
    /// `core::handshake` state that expects it.
    pub fn connect(&self, addr: SocketAddr) -> Result<PeerId> {
        let a = &self.inner;
        let w = &a.world;
        a.check_open()?;
        let refused = || Error::Connect {
            addr: addr.to_string(),
            source: Arc::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        };
        let b = w.find(addr).ok_or_else(refused)?;
        let cross = |f: &Frame, max: u32| -> std::result::Result<Frame, HandshakeError> {
            w.advance(LATENCY);
            wire::decode_frame(&f.encode(), max)
        };
        let conn = a.next_conn.replace(a.next_conn.get() + 1);
        let local_session = w.random();
        let ep = a.endpoint(conn, local_session);
        let hello = Frame::Hello(Hello {
            token: a.token().to_vec(),
            engine_id: a.id,
            listen_port: a.addr.port(),
            session: local_session,
            endpoint: ep.clone(),
            regions: a.registry.exposed(),
        });
        // The acceptor: the first frame, the backend check, its Welcome (or a Reject).
        let first = cross(&hello, b.config.handshake_max_bytes)?;
        let request = AwaitRequest {
            token: b.token(),
            // The data port is a name in this world, not one a listener was given.
            tokenless_ports: None,
        }
        .handle(first);
        let answer = match request {
            Err(Refused { error, tell }) => match tell {
                Some(reason) => Err(Frame::Reject {
                    reason: reason.into(),
                }),
                None => return Err(error.into()),
            },
            // A first contact never re-opens a rail (no rail failed in this world).
            Ok(Request::Describe { .. } | Request::Rail { .. }) => return Err(refused()),
            Ok(Request::Hello(h)) => {
                let b_conn = b.next_conn.replace(b.next_conn.get() + 1);
                let b_session = w.random();
                let b_ep = b.endpoint(b_conn, b_session);
                match handshake::check_backend(&h.endpoint, &b_ep) {
                    Err(e) => Err(Frame::Reject {
                        reason: e.to_string(),
                    }),
                    Ok(()) => Ok((h, b_session, b_ep)),
                }
            }
        };
        let (h, b_session, reply) = match answer {
            Ok((h, b_session, b_ep)) => {
                let welcome = Frame::Welcome(Welcome {
                    engine_id: b.id,
                    session: b_session,
                    endpoint: b_ep,
                    regions: b.registry.exposed(),
                });
                (Some(h), b_session, welcome)
            }
            Err(reject) => (None, 0, reject),
        };
        let (welcome, await_ready) =
            AwaitWelcome { ours: &ep }.handle(cross(&reply, a.config.handshake_max_bytes)?)?;
        let h = h.expect("a Welcome answers a Hello");
        // Ready, then the acceptor publishes us and answers Ready.
        handshake::AwaitReady.handle(cross(&Frame::Ready, b.config.handshake_max_bytes)?)?;
        if b.shut.get() {
            return Err(refused());
        }
        let (a_id, b_id) = (
            PeerId(a.next_peer.replace(a.next_peer.get() + 1)),
            PeerId(b.next_peer.replace(b.next_peer.get() + 1)),
        );
        let window = || RefCell::new(InFlight::new(a.config.tx_depth.max(1)));
        let link = Rc::new(Link {
            ends: [
                End {
                    engine: Rc::downgrade(a),
                    engine_idx: a.idx,
                    peer: a_id,
                },
                End {
                    engine: Rc::downgrade(&b),
                    engine_idx: b.idx,
                    peer: b_id,
                },
            ],
            broken: Cell::new(false),
            busy: Default::default(),
            last: Default::default(),
            window: [window(), window()],
            waiting: Default::default(),
            live: RefCell::new(Vec::new()),
        });
        let publish =
            |e: &EngineInner, id: PeerId, end: usize, remote_session, local_session, regions| {
                e.sessions.borrow_mut().insert(local_session, id);
                e.peers.borrow_mut().insert(
                    id,
                    Rc::new(SimPeer {
                        link: link.clone(),
                        end,
                        remote_session,
                        local_session,
                        table: RefCell::new(Arc::new(RemoteTable::new(regions))),
                    }),
                );
            };
        publish(&b, b_id, 1, h.session, b_session, h.regions);
        b.accepted.borrow_mut().push_back(b_id);
        await_ready.handle(cross(&Frame::Ready, a.config.handshake_max_bytes)?)?;
        debug_assert_eq!(welcome.session, b_session);
        publish(a, a_id, 0, welcome.session, local_session, welcome.regions);
        w.record(6, a.idx, a_id.0, b.idx);
        Ok(a_id)
    }

    /// Waits until a peer connected to us (or `deadline`).
    pub fn accept(&self, deadline: Instant) -> Option<PeerId> {
        let mut got = None;
        self.world().run_until(deadline, &mut || {
            got = self.inner.accepted.borrow_mut().pop_front();
            got.is_some()
        });
        got
    }

    /// Connected peers.
    pub fn peers(&self) -> Vec<PeerId> {
        self.inner.peers.borrow().keys().copied().collect()
    }

    /// Whether the connection to a peer is still usable.
    pub fn peer_alive(&self, peer: PeerId) -> Result<bool> {
        Ok(!self.inner.peer(peer)?.link.broken.get())
    }

    /// The regions a peer exposes, as last described.
    pub fn peer_regions(&self, peer: PeerId) -> Result<Vec<RemoteRegion>> {
        Ok(self.inner.peer(peer)?.table.borrow().regions().to_vec())
    }

    /// `Describe` on the peer's session, judged by `AwaitRequest` there and
    /// `AwaitRegions` here.
    pub fn redescribe(&self, peer: PeerId) -> Result<Vec<RemoteRegion>> {
        let a = &self.inner;
        a.check_open()?;
        let p = a.peer(peer)?;
        let w = self.world();
        let other = p.link.ends[1 - p.end]
            .engine
            .upgrade()
            .filter(|e| !e.shut.get());
        let Some(b) = other else {
            return Err(Error::Connect {
                addr: "peer".into(),
                source: Arc::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
            });
        };
        let describe = Frame::Describe {
            token: a.token().to_vec(),
            session: p.remote_session,
        };
        w.advance(LATENCY);
        let f = wire::decode_frame(&describe.encode(), b.config.handshake_max_bytes)?;
        let answer = match (AwaitRequest {
            token: b.token(),
            tokenless_ports: None,
        })
        .handle(f)
        {
            Ok(Request::Describe { session }) if b.sessions.borrow().contains_key(&session) => {
                Frame::Regions(b.registry.exposed())
            }
            Ok(_) => Frame::Reject {
                reason: "unknown session".into(),
            },
            Err(Refused { error, tell }) => match tell {
                Some(t) => Frame::Reject { reason: t.into() },
                None => return Err(error.into()),
            },
        };
        w.advance(LATENCY);
        let regions = AwaitRegions.handle(wire::decode_frame(
            &answer.encode(),
            a.config.handshake_max_bytes,
        )?)?;
        let table = Arc::new(RemoteTable::new(regions));
        let out = table.regions().to_vec();
        *p.table.borrow_mut() = table;
        Ok(out)
    }

    /// Closes the connection to a peer; its pending batches fail.
    pub fn disconnect(&self, peer: PeerId) -> Result<()> {
        let p = self
            .inner
            .peers
            .borrow_mut()
            .remove(&peer)
            .ok_or(Error::UnknownPeer { peer })?;
        self.inner.sessions.borrow_mut().remove(&p.local_session);
        p.link.break_by(Some(p.end));
        Ok(())
    }

    /// As `Engine::submit`: validated by `core::resolve`, stamped with simulated time.
    pub fn submit(&self, peer: PeerId, batch: Batch) -> Result<SimHandle> {
        let e = &self.inner;
        let (p, pins, resolved, bytes) = self.resolve(peer, &batch)?;
        let now = self.world().now();
        let deadline = batch
            .deadline
            .map_or(now + e.config.batch_timeout, |d| d.resolve(now));
        let id = e.next_batch.replace(e.next_batch.get() + 1);
        let state = BatchState::new(
            id,
            peer,
            batch.ops.len(),
            resolved.len(),
            bytes,
            now,
            deadline,
            pins,
            None,
        );
        state.expire_if_due(now);
        let handle = SimHandle {
            shared: state.shared(),
            world: self.world().clone(),
        };
        e.post(&p, state, &resolved, batch.notify)?;
        Ok(handle)
    }

    /// As `Engine::submit_plan` (triples or a layout plan).
    pub fn submit_plan<I>(
        &self,
        peer: PeerId,
        op: Op,
        plan: I,
        notify: Option<u32>,
    ) -> Result<SimHandle>
    where
        I: IntoIterator,
        I::Item: PlanEntry,
    {
        self.submit(peer, plan_batch(op, plan, notify))
    }

    /// As `Engine::prepare`: resolved once, each run re-posted (no fast path here).
    pub fn prepare(&self, peer: PeerId, batch: Batch) -> Result<SimPrepared> {
        let e = &self.inner;
        let (_, pins, resolved, bytes) = self.resolve(peer, &batch)?;
        let timeout = match batch.deadline {
            Some(Deadline::After(d)) => d,
            Some(Deadline::At(_)) => {
                return Err(Error::Unsupported {
                    what: "an absolute deadline on a prepared batch (use Batch::timeout)".into(),
                });
            }
            None => e.config.batch_timeout,
        };
        Ok(SimPrepared {
            engine: self.clone(),
            peer,
            id: e.next_batch.replace(e.next_batch.get() + 1),
            ops: batch.ops.len(),
            bytes,
            notify: batch.notify,
            timeout,
            resolved,
            cell: Arc::new(RunCell::new(pins)),
            handle: None,
        })
    }

    fn resolve(
        &self,
        peer: PeerId,
        batch: &Batch,
    ) -> Result<(Rc<SimPeer>, Pins, ResolvedOps, u64)> {
        let e = &self.inner;
        e.check_open()?;
        if batch.ops.is_empty() && batch.notify.is_none() {
            return Err(Error::EmptyBatch);
        }
        let p = e.peer(peer)?;
        if p.link.broken.get() {
            return Err(Error::peer_gone(
                peer,
                PeerFault::Disconnected,
                "connection is broken",
            ));
        }
        let table = p.table.borrow().clone();
        let (pins, resolved, bytes) = resolve::resolve(&e.registry, &table, peer, &batch.ops)?;
        Ok((p, pins, resolved, bytes))
    }

    /// The next notification, stepping the world until `deadline`.
    pub fn poll_notification(&self, deadline: Instant) -> Option<Notification> {
        let mut got = None;
        self.world().run_until(deadline, &mut || {
            got = self.inner.notes.borrow_mut().pop_front();
            got.is_some()
        });
        got
    }

    /// The next notification if one is queued (after handling what is due now).
    pub fn try_notification(&self) -> Option<Notification> {
        let w = self.world();
        w.run_tasks();
        w.fire_due();
        self.inner.notes.borrow_mut().pop_front()
    }

    /// Notifications dropped at the queue's bound.
    pub fn notifications_dropped(&self) -> u64 {
        self.inner.dropped.get()
    }

    /// Closes every connection and revokes every registration.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

/// A submitted batch (as `TransferHandle`), waited for in simulated time.
#[derive(Debug, Clone)]
pub struct SimHandle {
    shared: Arc<BatchShared>,
    world: World,
}

impl SimHandle {
    /// Current status.
    pub fn status(&self) -> BatchStatus {
        self.shared.status(self.world.now())
    }

    /// Requests cancellation (`true` if it was still pending).
    pub fn cancel(&self) -> bool {
        self.shared.cancel()
    }

    /// Steps the world until the batch finished or `deadline` (as `TransferHandle::wait`).
    pub fn wait(&self, deadline: Instant) -> Result<BatchStats> {
        let s = &self.shared;
        let started = self.world.now();
        self.world.run_until(deadline.min(s.deadline), &mut || {
            s.finished.load(Ordering::Acquire)
        });
        let now = self.world.now();
        s.expire_if_due(now);
        match &*s.lock() {
            Phase::Done(elapsed) => Ok(BatchStats {
                ops: s.ops,
                slices: s.slices,
                bytes: s.done_bytes.load(Ordering::Acquire).max(s.bytes),
                elapsed: *elapsed,
            }),
            Phase::Failed(e) => Err(e.clone()),
            Phase::Cancelled => Err(Error::Cancelled),
            Phase::Pending => Err(Error::Timeout {
                after: now - started,
            }),
        }
    }
}

/// A prepared batch (as `PreparedBatch` on its re-submitting path).
pub struct SimPrepared {
    engine: SimEngine,
    peer: PeerId,
    id: u64,
    ops: usize,
    bytes: u64,
    notify: Option<u32>,
    timeout: Duration,
    resolved: ResolvedOps,
    /// Holds the pins for every run.
    cell: Arc<RunCell>,
    handle: Option<SimHandle>,
}

impl fmt::Debug for SimPrepared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimPrepared")
            .field("id", &self.id)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl SimPrepared {
    /// Bytes per run.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Always `false`: the sim has no one-chain fast path.
    pub fn is_fast_path(&self) -> bool {
        false
    }

    /// Starts a run with the prepared tag.
    pub fn start(&mut self) -> Result<()> {
        self.start_inner(self.notify)
    }

    /// Starts a run with `tag`.
    pub fn start_tagged(&mut self, tag: u32) -> Result<()> {
        if self.notify.is_none() {
            return Err(Error::Unsupported {
                what: "a tag for a batch prepared without a notification".into(),
            });
        }
        self.start_inner(Some(tag))
    }

    fn start_inner(&mut self, tag: Option<u32>) -> Result<()> {
        if self.handle.is_some() {
            return Err(Error::Unsupported {
                what: "starting a prepared batch whose previous run was not waited for".into(),
            });
        }
        let e = &self.engine;
        let p = e.inner.peer(self.peer)?;
        let now = e.world().now();
        let state = BatchState::new(
            self.id,
            self.peer,
            self.ops,
            self.resolved.len(),
            self.bytes,
            now,
            now + self.timeout,
            Pins::new(),
            None,
        )
        .keeping(Arc::clone(&self.cell));
        state.expire_if_due(now);
        let h = SimHandle {
            shared: state.shared(),
            world: e.world().clone(),
        };
        e.inner.post(&p, state, &self.resolved, tag)?;
        self.handle = Some(h);
        Ok(())
    }

    /// Waits for the current run (`Ok` at once if none is in flight).
    pub fn wait(&mut self, deadline: Instant) -> Result<()> {
        let Some(h) = &self.handle else {
            return Ok(());
        };
        let r = h.wait(deadline).map(drop);
        if !matches!(r, Err(Error::Timeout { .. })) {
            self.handle = None;
        }
        r
    }

    /// The current run's outcome without waiting: `None` while in flight.
    pub fn try_wait(&mut self) -> Option<Result<()>> {
        let w = self.engine.world().clone();
        w.run_tasks();
        w.fire_due();
        let r = match self.handle.as_ref().map(SimHandle::status) {
            Some(BatchStatus::Pending) => None,
            Some(BatchStatus::Failed(e)) => Some(Err(e)),
            Some(BatchStatus::Cancelled) => Some(Err(Error::Cancelled)),
            Some(BatchStatus::Done) | None => Some(Ok(())),
        };
        if r.is_some() {
            self.handle = None;
        }
        r
    }
}
