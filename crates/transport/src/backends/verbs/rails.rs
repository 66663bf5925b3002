//! Several RDMA devices (rails) per engine.
//!
//! Every registration is registered on every rail (rail 0's keys are the registry's
//! `lkey`/`rkey`, the others ride along as [`RailKeys`]); a connection to a peer is one
//! [`VerbsConn`] per rail, rail `i` to the peer's rail `i`; a batch is cut by the core's
//! slicer and striped over the rails by bytes, weighted by link speed
//! ([`stripe_rails`]); each rail posts its part within its own windows. The notification
//! waits, in one [`NotifyGate`], for every part on every rail, and then goes out on one
//! rail as two zero-length WRITE_WITH_IMMs on QP 0: the connection's notification
//! sequence number, then the tag. A rail whose part fails (QP in error, port down) is
//! taken out of the connection's stripe and the part is posted again on another rail
//! (by one retry thread per connection at a time), within the batch deadline; the batch
//! fails only when no rail is left. A failed notification is sent again on another rail
//! with the same sequence number, and the receiver drops a sequence number it has
//! delivered already ([`SeqWindow`]), so the tag surfaces exactly once even when the
//! first copy arrived and only its acknowledgement was lost.
//!
//! A striped batch that fails or is cancelled in the engine core stops every rail that
//! carries a part of it (each part's connection batch settles: see [`Settle`]) and posts
//! nothing more, before the outcome is reported: its pins go then, as on one rail.
//!
//! A rail taken out comes back on the side that initiated the connection: a prober thread
//! (one per connection, while a rail is out) waits for the rail's port to be ACTIVE, then
//! exchanges new QPs for it with the peer through the engine's control channel
//! ([`RailControl`]; the peer answers in `accept_rail`), probes them, and swaps them in.
//!
//! An engine with one rail never reaches this module: it keeps the one-connection path.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::conn::VerbsConn;
use super::poller::VerbsDevice;
use super::prefer::RailPrefs;
use crate::contract::{
    BatchSink, BatchState, Conn, EndpointInfo, RailControl, RailSwap, ResolvedOp, ResolvedOps,
    TagSink,
};
use crate::core::batch::{NotifyGate, Settle, Stop};
use crate::core::registry::RemoteTable;
use crate::core::slice::{Dir, PlanOp, stripe_rails};
use crate::error::{Error, PeerFault};
use crate::types::{MAX_RAILS, Op, PeerId, RailKeys, RailStats};
use crate::util::lock;

/// One rail as the configuration names it: `name[:port[:gid_index]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RailSpec {
    pub name: Option<String>,
    pub port: u8,
    pub gid_index: Option<u32>,
}

/// What `rdma_device` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RailsWanted {
    /// These devices, in order (one entry with no name: the first usable device).
    List(Vec<RailSpec>),
    /// Every device with the configured port ACTIVE.
    All,
}

/// Parses `rdma_device`: unset (the first usable device), `all`, or a comma-separated
/// list of `name[:port[:gid_index]]` (port and GID default to `ib_port` and `gid_index`).
pub(crate) fn parse_rails(
    spec: Option<&str>,
    port: u8,
    gid_index: Option<u32>,
) -> Result<RailsWanted, Error> {
    let Some(spec) = spec.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(RailsWanted::List(vec![RailSpec {
            name: None,
            port,
            gid_index,
        }]));
    };
    if spec.eq_ignore_ascii_case("all") {
        return Ok(RailsWanted::All);
    }
    let bad = |why: String| Error::config("rdma_device", spec, why);
    let mut out: Vec<RailSpec> = Vec::new();
    for item in spec.split(',').map(str::trim) {
        let mut f = item.split(':');
        let name = f.next().unwrap_or("").trim();
        if name.is_empty() {
            return Err(bad(format!("empty device name in {item:?}")));
        }
        let p = match f.next() {
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&p| p >= 1)
                .ok_or_else(|| bad(format!("port {p:?} of {name} is not 1..255")))?,
            None => port,
        };
        let g = match f.next() {
            Some(g) => Some(
                g.trim()
                    .parse::<u32>()
                    .map_err(|_| bad(format!("GID index {g:?} of {name} is not a number")))?,
            ),
            None => gid_index,
        };
        if f.next().is_some() {
            return Err(bad(format!("{item:?}: expected name[:port[:gid_index]]")));
        }
        if out
            .iter()
            .any(|r| r.name.as_deref() == Some(name) && r.port == p)
        {
            return Err(bad(format!("{name} port {p} listed twice")));
        }
        out.push(RailSpec {
            name: Some(name.to_string()),
            port: p,
            gid_index: g,
        });
    }
    if out.len() > MAX_RAILS {
        return Err(bad(format!("{} rails; at most {MAX_RAILS}", out.len())));
    }
    Ok(RailsWanted::List(out))
}

/// Counters of one rail.
#[derive(Debug, Default)]
pub(crate) struct RailCounters {
    bytes: AtomicU64,
    errors: AtomicU64,
    retries: AtomicU64,
}

/// Engine-wide multi-rail state: the devices, their weights and counters, and every
/// registration's lkeys on rails 1.. by its rail-0 lkey.
#[derive(Debug)]
pub(crate) struct RailSet {
    pub devices: Vec<Arc<VerbsDevice>>,
    weights: Vec<u64>,
    counters: Vec<RailCounters>,
    lkeys: RwLock<HashMap<u32, RailKeys>>,
    /// Each registration's preferred rails (by topology), by its rail-0 lkey.
    pub prefs: RailPrefs,
    /// Striping unit: the WR size cap (a rail gets whole WRs).
    unit: u64,
}

impl RailSet {
    pub fn new(devices: Vec<Arc<VerbsDevice>>, unit: u64) -> Self {
        // Link speed when every rail reports one; equal weights otherwise.
        let known = devices.iter().all(|d| d.dev.gbps > 0);
        let weights = devices
            .iter()
            .map(|d| if known { u64::from(d.dev.gbps) } else { 1 })
            .collect();
        let counters = devices.iter().map(|_| RailCounters::default()).collect();
        RailSet {
            devices,
            weights,
            counters,
            lkeys: RwLock::new(HashMap::new()),
            prefs: RailPrefs::default(),
            unit: unit.max(1),
        }
    }

    pub fn remember(&self, lkey: u32, rails: RailKeys) {
        self.lkeys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(lkey, rails);
    }

    pub fn forget(&self, lkey: u32) {
        self.lkeys
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&lkey);
    }

    pub fn stats(&self) -> Vec<RailStats> {
        self.devices
            .iter()
            .zip(&self.counters)
            .map(|(d, c)| RailStats {
                device: d.dev.name.clone(),
                port: d.dev.port,
                gbps: d.dev.gbps,
                bytes: c.bytes.load(Ordering::Relaxed),
                errors: c.errors.load(Ordering::Relaxed),
                retries: c.retries.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// A connection over several rails.
pub(crate) struct MultiConn {
    me: Weak<MultiConn>,
    set: Arc<RailSet>,
    /// One per paired rail (rail `i` to the peer's rail `i`), replaced when the rail is
    /// reconnected.
    conns: Vec<RwLock<Arc<VerbsConn>>>,
    /// How many times each rail was reconnected: a failure of an older connection does
    /// not take the new one out.
    epochs: Vec<AtomicU64>,
    /// Rails taken out of this connection's stripe.
    out: Vec<AtomicBool>,
    /// Where incoming notifications go, and the sequence window every rail shares.
    tags: (Arc<dyn TagSink>, Arc<Mutex<SeqWindow>>),
    /// The initiator's way to reconnect a rail (the acceptor answers, in `accept_rail`).
    control: Option<Arc<dyn RailControl>>,
    /// Whether the thread that probes rails back is running (at most one).
    prober: Mutex<bool>,
    closed: AtomicBool,
    /// The peer's regions, with their rkeys on every rail.
    table: RwLock<Arc<RemoteTable>>,
    /// Rotates the tie-break of small batches over the rails.
    next: AtomicUsize,
    /// The next notification's sequence number.
    seq: AtomicU32,
    /// Parts waiting to be posted again on another rail.
    retry: Mutex<RetryQueue>,
    peer: PeerId,
}

/// Parts to post again, and whether a thread is draining them: at most one retry thread
/// per connection at a time, however many parts fail.
#[derive(Default)]
struct RetryQueue {
    parts: VecDeque<Arc<Part>>,
    running: bool,
}

impl std::fmt::Debug for MultiConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiConn")
            .field("peer", &self.peer)
            .field("rails", &self.conns.len())
            .finish_non_exhaustive()
    }
}

/// A piece of a batch in rail-0 terms (keys translated per rail when posted).
type Pieces = SmallVec<[ResolvedOp; 2]>;

impl MultiConn {
    pub fn new(
        set: Arc<RailSet>,
        conns: Vec<Arc<VerbsConn>>,
        peer: PeerId,
        tags: (Arc<dyn TagSink>, Arc<Mutex<SeqWindow>>),
        control: Option<Arc<dyn RailControl>>,
    ) -> Arc<Self> {
        let out = conns.iter().map(|_| AtomicBool::new(false)).collect();
        let epochs = conns.iter().map(|_| AtomicU64::new(0)).collect();
        Arc::new_cyclic(|me| MultiConn {
            me: me.clone(),
            set,
            conns: conns.into_iter().map(RwLock::new).collect(),
            epochs,
            out,
            tags,
            control,
            prober: Mutex::new(false),
            closed: AtomicBool::new(false),
            table: RwLock::new(Arc::new(RemoteTable::new(Vec::new()))),
            next: AtomicUsize::new(0),
            seq: AtomicU32::new(0),
            retry: Mutex::new(RetryQueue::default()),
            peer,
        })
    }

    /// Queues `part` to be posted again (it may wait for window room, which the caller,
    /// a completion thread or a poster holding another rail's windows, must not): starts
    /// the connection's retry thread unless it is running.
    fn repost(&self, part: Arc<Part>) {
        let mut q = self.retry.lock().unwrap_or_else(|p| p.into_inner());
        q.parts.push_back(part);
        if q.running {
            return;
        }
        let Some(me) = self.me.upgrade() else {
            return;
        };
        q.running = true;
        drop(q);
        let spawned = std::thread::Builder::new()
            .name("pagewire-rail-retry".into())
            .spawn(move || me.drain_retries());
        if let Err(e) = spawned {
            let mut q = self.retry.lock().unwrap_or_else(|p| p.into_inner());
            q.running = false;
            let err = Error::io("spawning a rail retry thread", e);
            for p in q.parts.drain(..) {
                p.stripe.batch.fail(err.clone());
            }
        }
    }

    /// The retry thread: posts queued parts until none is left.
    fn drain_retries(&self) {
        loop {
            let next = {
                let mut q = self.retry.lock().unwrap_or_else(|p| p.into_inner());
                let p = q.parts.pop_front();
                if p.is_none() {
                    q.running = false;
                }
                p
            };
            match next {
                Some(p) => self.post_part(p),
                None => return,
            }
        }
    }

    /// Rail `r`'s connection now, and its generation.
    fn current(&self, r: usize) -> (Arc<VerbsConn>, u64) {
        let c = self.conns[r].read().unwrap_or_else(|p| p.into_inner());
        (Arc::clone(&c), self.epochs[r].load(Ordering::Acquire))
    }

    fn usable(&self, r: usize) -> bool {
        !self.out[r].load(Ordering::Acquire)
            && !self.conns[r]
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .is_broken()
    }

    /// The stripe's weights now: 0 for a rail taken out. A rail whose connection broke
    /// without a part of ours failing on it (a heartbeat did) is taken out here.
    fn weights(&self) -> SmallVec<[u64; MAX_RAILS]> {
        (0..self.conns.len())
            .map(|r| {
                if self.out[r].load(Ordering::Acquire) {
                    return 0;
                }
                let (c, epoch) = self.current(r);
                if c.is_broken() {
                    let e = c.broken_reason().unwrap_or(Error::Shutdown);
                    self.take_out(r, epoch, &e);
                    return 0;
                }
                self.set.weights[r]
            })
            .collect()
    }

    /// The usable rail with the highest weight, preferring rail 0 on ties.
    fn pick(&self) -> Option<usize> {
        let w = self.weights();
        (0..w.len())
            .filter(|&r| w[r] > 0)
            .max_by_key(|&r| (w[r], std::cmp::Reverse(r)))
    }

    /// Takes rail `r` out of this connection's stripe (counted once) for a failure of its
    /// connection of generation `epoch` (an older one's failure is not the rail's now), and
    /// starts probing it back.
    fn take_out(&self, r: usize, epoch: u64, why: &Error) {
        if epoch != self.epochs[r].load(Ordering::Acquire) {
            return;
        }
        if !self.out[r].swap(true, Ordering::AcqRel) {
            self.set.counters[r].errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                peer = %self.peer, rail = r, device = %self.set.devices[r].dev.name, error = %why,
                "rail taken out of the stripe"
            );
            self.start_prober();
        }
    }

    /// Starts the thread that brings rails back, unless it runs or this side does not
    /// reconnect (the acceptor: its peer does).
    fn start_prober(&self) {
        if self.control.is_none() || self.closed.load(Ordering::Acquire) {
            return;
        }
        let mut running = self.prober.lock().unwrap_or_else(|p| p.into_inner());
        if *running {
            return;
        }
        let me = self.me.clone();
        let spawned = std::thread::Builder::new()
            .name("pagewire-rail-probe".into())
            .spawn(move || probe_rails(&me));
        match spawned {
            Ok(_) => *running = true,
            Err(e) => tracing::warn!(peer = %self.peer, error = %e, "cannot start the rail prober"),
        }
    }

    /// Rails out of the stripe now; stops the prober (under its lock, so a rail taken
    /// out meanwhile starts a new one) when there is none or the connection closed.
    fn rails_out(&self) -> SmallVec<[usize; MAX_RAILS]> {
        let mut running = self.prober.lock().unwrap_or_else(|p| p.into_inner());
        let out: SmallVec<[usize; MAX_RAILS]> = (0..self.out.len())
            .filter(|&r| self.out[r].load(Ordering::Acquire))
            .collect();
        if out.is_empty() || self.closed.load(Ordering::Acquire) {
            *running = false;
            return SmallVec::new();
        }
        out
    }

    /// A new incoming-notification sink for one rail's connection.
    fn rail_tags(&self) -> Arc<dyn TagSink> {
        RailTags::sink(Arc::clone(&self.tags.0), Arc::clone(&self.tags.1))
    }

    /// Reconnects rail `r` (initiator): new QPs on its device, exchanged with the peer
    /// through the control channel, proven by a probe, then in the rail's place.
    fn restore(&self, r: usize, control: &dyn RailControl) -> Result<(), Error> {
        let (pending, ep) = self.set.devices[r].prepare()?;
        let mut pending = Some(pending);
        let mut fresh: Option<Arc<VerbsConn>> = None;
        let done = control.reconnect(r, super::endpoint_info(&ep), &mut |theirs, deadline| {
            let remote = super::verbs_endpoint(theirs)?;
            let p = pending.take().ok_or(Error::Shutdown)?;
            let c = p.complete(&remote, Some(self.rail_tags()), self.peer)?;
            fresh = Some(Arc::clone(&c));
            c.probe(deadline)
        });
        match (done, fresh) {
            (Ok(()), Some(c)) => {
                self.install(r, c);
                Ok(())
            }
            (Err(e), Some(c)) => {
                c.close(Error::peer_gone(
                    self.peer,
                    PeerFault::ClosedLocally,
                    "rail reconnection failed",
                ));
                Err(e)
            }
            (Err(e), None) => Err(e),
            (Ok(()), None) => Err(Error::Shutdown),
        }
    }

    /// Puts `c` in rail `r`'s place and the rail back in the stripe. What was still in
    /// flight on the old connection fails over as after any rail failure.
    fn install(&self, r: usize, c: Arc<VerbsConn>) {
        let old = {
            let mut slot = self.conns[r].write().unwrap_or_else(|p| p.into_inner());
            // Checked under the slot's lock: `close` marks the connection closed before it
            // reads the slots, so it either sees `c` here or `c` sees the mark.
            if self.closed.load(Ordering::Acquire) {
                drop(slot);
                c.close(Error::peer_gone(
                    self.peer,
                    PeerFault::ClosedLocally,
                    "connection closed",
                ));
                return;
            }
            self.epochs[r].fetch_add(1, Ordering::AcqRel);
            std::mem::replace(&mut *slot, c)
        };
        self.out[r].store(false, Ordering::Release);
        tracing::info!(peer = %self.peer, rail = r, device = %self.set.devices[r].dev.name, "rail back in the stripe");
        old.close(Error::peer_gone(
            self.peer,
            PeerFault::Disconnected,
            "rail reconnected",
        ));
    }

    fn gone(&self) -> Error {
        Error::peer_gone(
            self.peer,
            PeerFault::Disconnected,
            "no rail left to the peer",
        )
    }

    /// `pieces` with rail `r`'s keys.
    fn plan_for(&self, pieces: &[ResolvedOp], r: usize) -> Result<SmallVec<[PlanOp; 2]>, Error> {
        let table = (r > 0).then(|| self.table.read().unwrap_or_else(|p| p.into_inner()).clone());
        let lkeys = (r > 0).then(|| self.set.lkeys.read().unwrap_or_else(|p| p.into_inner()));
        let missing = |side: &str, key: u32| Error::Unsupported {
            what: format!("rail {r}: no {side} key for the registration of key {key:#x}"),
        };
        pieces
            .iter()
            .map(|o| {
                let (lkey, rkey) = match (&table, &lkeys) {
                    (Some(t), Some(l)) => {
                        let lkey = l
                            .get(&o.lkey)
                            .and_then(|k| k.key(o.lkey, r))
                            .ok_or_else(|| missing("local", o.lkey))?;
                        let rkey = t
                            .at(o.remote)
                            .filter(|reg| reg.rkey == o.rkey)
                            .and_then(|reg| reg.rails.key(o.rkey, r))
                            .ok_or_else(|| missing("remote", o.rkey))?;
                        (lkey, rkey)
                    }
                    _ => (o.lkey, o.rkey),
                };
                Ok(PlanOp {
                    dir: match o.op {
                        Op::Write => Dir::Write,
                        Op::Read => Dir::Read,
                    },
                    local: o.local,
                    lkey,
                    remote: o.remote,
                    rkey,
                    len: o.len,
                })
            })
            .collect()
    }

    /// Posts `part` on its rail. Errors reach the part (and from there its batch).
    fn post_part(&self, part: Arc<Part>) {
        // The batch failed while the part waited for a repost: nothing of it goes out.
        if part.stripe.is_closing() {
            return;
        }
        let plan = match self.plan_for(&part.pieces, part.rail) {
            Ok(p) => p,
            Err(e) => {
                part.fail(e);
                return;
            }
        };
        let deadline = part.stripe.batch.deadline();
        let (conn, epoch) = self.current(part.rail);
        part.epoch.store(epoch, Ordering::Release);
        if let Err(e) = conn.post(Arc::clone(&part), plan.iter(), None, deadline) {
            // Refused before the part was handed over (the rail broke): fail it here; a
            // failure the connection reported already reached it, and this is a no-op.
            part.fail(e);
        }
    }

    /// Every part landed: sends the notification on one rail, or finishes the batch.
    fn finish(&self, stripe: Arc<Stripe>) {
        let Some(tag) = stripe.tag else {
            stripe.batch.succeed(Instant::now());
            return;
        };
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.notify_on_any(stripe, tag, seq, false);
    }

    /// Posts the notification (its sequence number, then its tag) on the best usable
    /// rail; `again`: a retry, counted on that rail. Never waits: a WR-less post only
    /// queues the WRITE_WITH_IMMs behind QP 0's window.
    fn notify_on_any(&self, stripe: Arc<Stripe>, tag: u32, seq: u32, again: bool) {
        let Some(r) = self.pick() else {
            stripe.batch.fail(self.gone());
            return;
        };
        if again {
            self.set.counters[r].retries.fetch_add(1, Ordering::Relaxed);
        }
        let deadline = stripe.batch.deadline();
        let (conn, epoch) = self.current(r);
        let sink = Arc::new(NotifyPart {
            stripe,
            rail: r,
            epoch,
            tag,
            seq,
            done: AtomicBool::new(false),
        });
        // Both or neither go out (neither sink ever asks to stop), so the receiver always
        // sees a sequence number followed by its tag on this QP.
        let posted = conn
            .post(
                Arc::new(SeqSink),
                std::iter::empty::<PlanOp>(),
                Some(seq),
                deadline,
            )
            .and_then(|()| {
                conn.post(
                    Arc::clone(&sink),
                    std::iter::empty::<PlanOp>(),
                    Some(tag),
                    deadline,
                )
            });
        if let Err(e) = posted {
            sink.fail(e);
        }
    }
}

/// How often the prober looks at the rails taken out.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// The prober thread of one connection: every [`PROBE_EVERY`], each rail taken out whose
/// port is ACTIVE is reconnected; it ends when no rail is out or the connection is gone.
fn probe_rails(conn: &Weak<MultiConn>) {
    loop {
        std::thread::sleep(PROBE_EVERY);
        let Some(c) = conn.upgrade() else {
            return;
        };
        let Some(control) = c.control.clone() else {
            return;
        };
        let out = c.rails_out();
        if out.is_empty() {
            return;
        }
        for r in out {
            if !port_active(&c.set.devices[r]) {
                continue;
            }
            if let Err(e) = c.restore(r, &*control) {
                tracing::debug!(peer = %c.peer, rail = r, error = %e, "rail not back yet");
            }
        }
    }
}

/// Whether the rail's port is ACTIVE (sysfs; a port whose state cannot be read is tried).
fn port_active(d: &VerbsDevice) -> bool {
    let path = format!(
        "/sys/class/infiniband/{}/ports/{}/state",
        d.dev.name, d.dev.port
    );
    std::fs::read_to_string(path).map_or(true, |s| s.contains("ACTIVE"))
}

/// Whether `e` says a rail cannot carry traffic (rather than the batch being at fault or
/// the connection closed on purpose).
fn rail_fault(e: &Error) -> bool {
    match e {
        Error::PeerGone { .. } => e.peer_fault() != Some(PeerFault::ClosedLocally),
        Error::Completion { .. } | Error::Verbs { .. } => true,
        _ => false,
    }
}

/// One striped batch: the core's batch, and the gate every rail's part passes.
struct Stripe {
    batch: BatchState,
    /// Parts not yet landed, plus one while the poster still holds the batch.
    gate: NotifyGate,
    tag: Option<u32>,
    conn: Arc<MultiConn>,
    /// The batch is failing (its [`Settle`] runs): no part fails over or posts any more.
    closing: AtomicBool,
    /// Every part's batch on its rail's connection, for [`Settle`].
    nic: Mutex<NicParts>,
}

/// The rails' batches of one striped batch, as their connections offered to stop them.
#[derive(Default)]
struct NicParts {
    /// Settled: a part handed to a connection from now on is stopped before it posts.
    closed: bool,
    ctls: SmallVec<[Weak<dyn Settle>; MAX_RAILS]>,
}

impl Stripe {
    fn land(self: &Arc<Self>) {
        if self.gate.landed(1) {
            self.conn.finish(Arc::clone(self));
        }
    }

    fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// A rail's connection took a part and offers `s` to stop its WRs.
    fn enlist(&self, s: Weak<dyn Settle>) {
        let mut nic = lock(&self.nic);
        if !nic.closed {
            // Parts that finished let go of their connection's batch: no need to keep them.
            nic.ctls.retain(|c| c.strong_count() > 0);
            nic.ctls.push(s);
            return;
        }
        drop(nic);
        // A repost after the batch failed: stopped before anything of it is posted.
        if let Some(s) = s.upgrade() {
            s.settle(Stop::Failed);
        }
    }
}

/// A striped batch failing in the engine core stops every rail that carries a part of it
/// ([`Settle`] of each part's connection batch: a rail with WRs of it on a send queue is
/// broken and flushed, for a short bound), and posts nothing more: a part failing over
/// meanwhile, or queued for a repost, is dropped. Its pins go before the failure is
/// reported when every rail stopped in time.
impl Settle for Stripe {
    fn settle(&self, why: Stop) -> bool {
        self.closing.store(true, Ordering::SeqCst);
        let ctls = {
            let mut nic = lock(&self.nic);
            nic.closed = true;
            std::mem::take(&mut nic.ctls)
        };
        let ctls: SmallVec<[Arc<dyn Settle>; MAX_RAILS]> =
            ctls.iter().filter_map(Weak::upgrade).collect();
        let Some((first, others)) = ctls.split_first() else {
            return true;
        };
        // Every rail at once, each waiting its own bound: the rails flush (or drain) in
        // parallel, so the failure waits for the slowest rail, not for their sum. A rail
        // whose thread cannot be started is settled on this one.
        std::thread::scope(|sc| {
            let helpers: SmallVec<[_; MAX_RAILS]> = others
                .iter()
                .map(|c| {
                    std::thread::Builder::new()
                        .name("pagewire-settle".into())
                        .spawn_scoped(sc, move || c.settle(why))
                        .map_err(|_| c)
                })
                .collect();
            let mut stopped = first.settle(why);
            for h in helpers {
                stopped &= match h {
                    Ok(h) => h.join().unwrap_or(false),
                    Err(c) => c.settle(why),
                };
            }
            stopped
        })
    }
}

/// One rail's part of a striped batch: what the rail's connection reports into.
struct Part {
    stripe: Arc<Stripe>,
    rail: usize,
    /// The generation of the rail's connection it was posted on.
    epoch: AtomicU64,
    pieces: Pieces,
    bytes: u64,
    wrs: AtomicUsize,
    done: AtomicBool,
}

impl BatchSink for Part {
    fn on_acked(&self, wrs: usize, bytes: u64) {
        self.wrs.fetch_add(wrs, Ordering::Relaxed);
        self.stripe.conn.set.counters[self.rail]
            .bytes
            .fetch_add(bytes, Ordering::Relaxed);
    }

    fn fail(&self, err: Error) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let s = &self.stripe;
        if s.batch.is_stopped() || s.is_closing() {
            return;
        }
        let conn = &s.conn;
        if !rail_fault(&err) {
            s.batch.fail(err);
            return;
        }
        conn.take_out(self.rail, self.epoch.load(Ordering::Acquire), &err);
        let Some(r) = conn.pick() else {
            s.batch.fail(err);
            return;
        };
        conn.set.counters[r].retries.fetch_add(1, Ordering::Relaxed);
        conn.repost(Arc::new(Part {
            stripe: Arc::clone(s),
            rail: r,
            epoch: AtomicU64::new(0),
            pieces: self.pieces.clone(),
            bytes: self.bytes,
            wrs: AtomicUsize::new(0),
            done: AtomicBool::new(false),
        }));
    }

    fn complete(&self) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stripe
            .batch
            .add_progress(self.wrs.load(Ordering::Relaxed), self.bytes);
        self.stripe.land();
    }

    fn should_stop(&self) -> bool {
        self.stripe.is_closing() || self.stripe.batch.should_stop(Instant::now())
    }

    fn is_stopped(&self) -> bool {
        self.stripe.is_closing() || self.stripe.batch.is_stopped()
    }

    fn settled_by(&self, settle: Weak<dyn Settle>) {
        self.stripe.enlist(settle);
    }
}

/// The notification of a striped batch, posted once every part landed.
struct NotifyPart {
    stripe: Arc<Stripe>,
    rail: usize,
    epoch: u64,
    tag: u32,
    seq: u32,
    done: AtomicBool,
}

impl BatchSink for NotifyPart {
    fn on_acked(&self, _wrs: usize, _bytes: u64) {}

    fn fail(&self, err: Error) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let s = &self.stripe;
        if s.batch.is_stopped() {
            return;
        }
        if !rail_fault(&err) {
            s.batch.fail(err);
            return;
        }
        // The tag may have arrived with only its acknowledgement lost: the copy on another
        // rail carries the same sequence number, which the receiver delivers once.
        s.conn.take_out(self.rail, self.epoch, &err);
        s.conn
            .notify_on_any(Arc::clone(s), self.tag, self.seq, true);
    }

    fn complete(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.stripe.batch.succeed(Instant::now());
        }
    }
}

/// The sequence number before a striped batch's tag: its outcome is the tag's.
struct SeqSink;

impl BatchSink for SeqSink {
    fn on_acked(&self, _wrs: usize, _bytes: u64) {}
    fn fail(&self, _err: Error) {}
    fn complete(&self) {}
    fn is_user_work(&self) -> bool {
        false
    }
}

/// Notification sequence numbers a connection has delivered, among the last
/// [`SeqWindow::SPAN`] below the highest: a sender retries a notification only within
/// its batch deadline, long before that many later ones arrive.
pub(crate) struct SeqWindow {
    hi: Option<u32>,
    bits: Box<[u64]>,
}

impl SeqWindow {
    pub const SPAN: u32 = 1 << 16;

    pub fn new() -> Self {
        SeqWindow {
            hi: None,
            bits: vec![0; (Self::SPAN / 64) as usize].into_boxed_slice(),
        }
    }

    fn bit(&mut self, s: u32) -> (&mut u64, u64) {
        let i = s % Self::SPAN;
        (&mut self.bits[(i / 64) as usize], 1u64 << (i % 64))
    }

    /// Whether `s` is seen for the first time (and records it). One older than the window
    /// cannot be told from a new one and counts as new.
    pub fn first_time(&mut self, s: u32) -> bool {
        let Some(hi) = self.hi else {
            self.hi = Some(s);
            let (w, m) = self.bit(s);
            *w |= m;
            return true;
        };
        let ahead = s.wrapping_sub(hi);
        if ahead != 0 && ahead < 1 << 31 {
            // Newer than any seen: the slots of (hi, s] now stand for those numbers.
            if ahead >= Self::SPAN {
                self.bits.fill(0);
            } else {
                for k in 1..=ahead {
                    let (w, m) = self.bit(hi.wrapping_add(k));
                    *w &= !m;
                }
            }
            self.hi = Some(s);
            let (w, m) = self.bit(s);
            *w |= m;
            return true;
        }
        if hi.wrapping_sub(s) >= Self::SPAN {
            return true;
        }
        let (w, m) = self.bit(s);
        let first = *w & m == 0;
        *w |= m;
        first
    }
}

/// The receiving side of one rail of a multi-rail connection: every notification is a
/// sequence number followed by its tag on the same QP; a tag whose number the connection
/// (any rail) delivered already is dropped.
pub(crate) struct RailTags {
    inner: Arc<dyn TagSink>,
    seen: Arc<Mutex<SeqWindow>>,
    /// The sequence number received, waiting for its tag.
    seq: Mutex<Option<u32>>,
}

impl RailTags {
    /// One rail's sink over `inner`, sharing `seen` with the connection's other rails.
    pub fn sink(inner: Arc<dyn TagSink>, seen: Arc<Mutex<SeqWindow>>) -> Arc<dyn TagSink> {
        Arc::new(RailTags {
            inner,
            seen,
            seq: Mutex::new(None),
        })
    }
}

impl TagSink for RailTags {
    fn notify(&self, imm: u32, bytes: u32) -> bool {
        let mut waiting = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        let Some(seq) = waiting.take() else {
            *waiting = Some(imm);
            return true;
        };
        drop(waiting);
        let first = self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .first_time(seq);
        if !first {
            tracing::debug!(seq, tag = imm, "duplicate notification dropped");
            return true;
        }
        self.inner.notify(imm, bytes)
    }
}

impl Conn for MultiConn {
    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<(), Error> {
        let me = self.me.upgrade().ok_or(Error::Shutdown)?;
        let mut weights = self.weights();
        self.set
            .prefs
            .restrict(ops.iter().map(|o| o.lkey), &mut weights);
        let n = weights.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let pieces = stripe_rails(ops.iter().map(|o| o.len), &weights, self.set.unit, start);
        if pieces.is_empty() && !ops.is_empty() {
            return Err(self.gone());
        }
        let mut parts: SmallVec<[(usize, Pieces, u64); MAX_RAILS]> = SmallVec::new();
        for p in &pieces {
            let o = &ops[p.op];
            let piece = ResolvedOp {
                op: o.op,
                local: o.local + p.off,
                lkey: o.lkey,
                remote: o.remote + p.off,
                rkey: o.rkey,
                len: p.len,
            };
            match parts.iter_mut().find(|(r, _, _)| *r == p.rail) {
                Some((_, v, b)) => {
                    v.push(piece);
                    *b += p.len;
                }
                None => parts.push((p.rail, smallvec::smallvec![piece], p.len)),
            }
        }
        let stripe = Arc::new(Stripe {
            batch,
            gate: NotifyGate::new(parts.len() as u64 + 1),
            tag: notify,
            conn: me,
            closing: AtomicBool::new(false),
            nic: Mutex::default(),
        });
        let settle: Weak<dyn Settle> = Arc::downgrade(&stripe) as Weak<Stripe>;
        stripe.batch.settled_by(settle);
        for (rail, pieces, bytes) in parts {
            let part = Arc::new(Part {
                stripe: Arc::clone(&stripe),
                rail,
                epoch: AtomicU64::new(0),
                pieces,
                bytes,
                wrs: AtomicUsize::new(0),
                done: AtomicBool::new(false),
            });
            self.post_part(part);
            if stripe.batch.is_stopped() {
                break;
            }
        }
        // Once the batch failed (or was cancelled) the parts not posted never land; the
        // gate stays shut and the outcome is the batch's.
        stripe.land();
        Ok(())
    }

    fn set_remote_table(&self, table: &Arc<RemoteTable>) {
        *self.table.write().unwrap_or_else(|p| p.into_inner()) = Arc::clone(table);
    }

    fn is_broken(&self) -> bool {
        (0..self.conns.len()).all(|r| !self.usable(r))
    }

    fn probe(&self, deadline: Instant) -> Result<(), Error> {
        for r in 0..self.conns.len() {
            self.current(r).0.probe(deadline)?;
        }
        Ok(())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for r in 0..self.conns.len() {
            self.current(r).0.close(Error::peer_gone(
                self.peer,
                PeerFault::ClosedLocally,
                "connection closed",
            ));
        }
    }

    fn accept_rail(
        &self,
        rail: usize,
        theirs: &EndpointInfo,
    ) -> Result<(EndpointInfo, RailSwap), Error> {
        if rail >= self.conns.len() || self.closed.load(Ordering::Acquire) {
            return Err(Error::Unsupported {
                what: format!("rail {rail} of a connection with {}", self.conns.len()),
            });
        }
        let me = self.me.upgrade().ok_or(Error::Shutdown)?;
        let remote = super::verbs_endpoint(theirs)?;
        let (pending, ep) = self.set.devices[rail].prepare()?;
        let c = pending.complete(&remote, Some(self.rail_tags()), self.peer)?;
        let peer = self.peer;
        let swap: RailSwap = Box::new(move |ok| {
            if ok {
                me.install(rail, c);
            } else {
                c.close(Error::peer_gone(
                    peer,
                    PeerFault::ClosedLocally,
                    "rail reconnection abandoned",
                ));
            }
        });
        Ok((super::endpoint_info(&ep), swap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, port: u8, gid: Option<u32>) -> RailSpec {
        RailSpec {
            name: Some(name.into()),
            port,
            gid_index: gid,
        }
    }

    #[test]
    fn rail_lists_parse() {
        assert_eq!(
            parse_rails(None, 1, None).unwrap(),
            RailsWanted::List(vec![RailSpec {
                name: None,
                port: 1,
                gid_index: None
            }])
        );
        assert_eq!(parse_rails(Some("ALL"), 1, None).unwrap(), RailsWanted::All);
        assert_eq!(
            parse_rails(Some("rxe0, rxe1:2, mlx5_0:1:3"), 1, Some(0)).unwrap(),
            RailsWanted::List(vec![
                spec("rxe0", 1, Some(0)),
                spec("rxe1", 2, Some(0)),
                spec("mlx5_0", 1, Some(3)),
            ])
        );
        for bad in [
            "rxe0,,rxe1",
            "rxe0:0",
            "rxe0:x",
            "rxe0:1:g",
            "rxe0:1:2:3",
            "rxe0,rxe0",
        ] {
            let e = parse_rails(Some(bad), 1, None).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{bad}: {e}");
        }
        let nine = (0..9)
            .map(|i| format!("d{i}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(parse_rails(Some(&nine), 1, None).is_err());
    }

    #[test]
    fn rail_faults() {
        let p = PeerId(1);
        assert!(rail_fault(&Error::peer_gone(
            p,
            PeerFault::Disconnected,
            "x"
        )));
        assert!(!rail_fault(&Error::peer_gone(
            p,
            PeerFault::ClosedLocally,
            "x"
        )));
        assert!(!rail_fault(&Error::Timeout {
            after: std::time::Duration::ZERO
        }));
    }

    /// The window against a set of every number seen: within the window both agree.
    #[test]
    fn seq_window_matches_a_set() {
        use proptest::prelude::*;
        let cfg = ProptestConfig::with_cases(64);
        proptest!(cfg, |(start in any::<u32>(), steps in proptest::collection::vec((0u32..8, 0u32..70_000), 1..300))| {
            let mut w = SeqWindow::new();
            let mut seen = std::collections::HashSet::new();
            let mut hi = start;
            for (kind, d) in steps {
                let s = match kind {
                    0 => hi.wrapping_add(d % 8),
                    1..=5 => hi.wrapping_sub(d % 64),
                    6 => hi.wrapping_sub(d),
                    _ => hi.wrapping_add(d),
                };
                let first = w.first_time(s);
                let behind = hi.wrapping_sub(s);
                if behind < SeqWindow::SPAN || s.wrapping_sub(hi) < 1 << 31 {
                    prop_assert_eq!(first, seen.insert(s), "seq {} hi {}", s, hi);
                } else {
                    prop_assert!(first);
                    seen.insert(s);
                }
                if s.wrapping_sub(hi) < 1 << 31 {
                    hi = s;
                }
            }
        });
    }

    #[derive(Default)]
    struct Tags(Mutex<Vec<u32>>);

    impl TagSink for Tags {
        fn notify(&self, tag: u32, _bytes: u32) -> bool {
            self.0.lock().unwrap().push(tag);
            true
        }
    }

    /// A tag sent again on another rail with its sequence number surfaces once.
    #[test]
    fn rail_tags_deliver_a_retried_notification_once() {
        let tags = Arc::new(Tags::default());
        let seen = Arc::new(Mutex::new(SeqWindow::new()));
        let rails = [
            RailTags::sink(tags.clone(), Arc::clone(&seen)),
            RailTags::sink(tags.clone(), seen),
        ];
        assert!(rails[0].notify(0, 0) && rails[0].notify(7, 0));
        assert!(rails[1].notify(1, 0) && rails[1].notify(8, 0));
        // Sequence number 1 again, on rail 0: a duplicate.
        assert!(rails[0].notify(1, 0) && rails[0].notify(8, 0));
        assert!(rails[0].notify(2, 0) && rails[0].notify(8, 0));
        assert_eq!(*tags.0.lock().unwrap(), [7, 8, 8]);
    }
}
