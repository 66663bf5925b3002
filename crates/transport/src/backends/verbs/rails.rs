//! Several RDMA devices (rails) per engine.
//!
//! Every registration is registered on every rail (rail 0's keys are the registry's
//! `lkey`/`rkey`, the others ride along as [`RailKeys`]); a connection to a peer is one
//! [`VerbsConn`] per rail, rail `i` to the peer's rail `i`; a batch is cut by the core's
//! slicer and striped over the rails by bytes, weighted by link speed
//! ([`stripe_rails`]); each rail posts its part within its own windows. The notification
//! waits, in one [`NotifyGate`], for every part on every rail, and then goes out as a
//! zero-length WRITE_WITH_IMM on one rail. A rail whose part fails (QP in error, port
//! down) is taken out of the connection's stripe and the part is posted again on another
//! rail, within the batch deadline; the batch fails only when no rail is left.
//!
//! An engine with one rail never reaches this module: it keeps the one-connection path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Instant;

use smallvec::SmallVec;

use super::conn::VerbsConn;
use super::poller::VerbsDevice;
use super::prefer::RailPrefs;
use crate::contract::{BatchSink, BatchState, Conn, ResolvedOp, ResolvedOps};
use crate::core::batch::NotifyGate;
use crate::core::registry::RemoteTable;
use crate::core::slice::{Dir, PlanOp, stripe_rails};
use crate::error::{Error, PeerFault};
use crate::types::{MAX_RAILS, Op, PeerId, RailKeys, RailStats};

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
    /// One per paired rail (rail `i` to the peer's rail `i`).
    conns: Vec<Arc<VerbsConn>>,
    /// Rails taken out of this connection's stripe.
    out: Vec<AtomicBool>,
    /// The peer's regions, with their rkeys on every rail.
    table: RwLock<Arc<RemoteTable>>,
    /// Rotates the tie-break of small batches over the rails.
    next: AtomicUsize,
    peer: PeerId,
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
    pub fn new(set: Arc<RailSet>, conns: Vec<Arc<VerbsConn>>, peer: PeerId) -> Arc<Self> {
        let out = conns.iter().map(|_| AtomicBool::new(false)).collect();
        Arc::new_cyclic(|me| MultiConn {
            me: me.clone(),
            set,
            conns,
            out,
            table: RwLock::new(Arc::new(RemoteTable::new(Vec::new()))),
            next: AtomicUsize::new(0),
            peer,
        })
    }

    fn usable(&self, r: usize) -> bool {
        !self.out[r].load(Ordering::Acquire) && !self.conns[r].is_broken()
    }

    /// The stripe's weights now: 0 for a rail taken out.
    fn weights(&self) -> SmallVec<[u64; MAX_RAILS]> {
        (0..self.conns.len())
            .map(|r| {
                if self.usable(r) {
                    self.set.weights[r]
                } else {
                    0
                }
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

    /// Takes rail `r` out of this connection's stripe (counted once).
    fn take_out(&self, r: usize, why: &Error) {
        if !self.out[r].swap(true, Ordering::AcqRel) {
            self.set.counters[r].errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                peer = %self.peer, rail = r, device = %self.set.devices[r].dev.name, error = %why,
                "rail taken out of the stripe"
            );
        }
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
        let plan = match self.plan_for(&part.pieces, part.rail) {
            Ok(p) => p,
            Err(e) => {
                part.fail(e);
                return;
            }
        };
        let deadline = part.stripe.batch.deadline();
        let conn = &self.conns[part.rail];
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
        let Some(r) = self.pick() else {
            stripe.batch.fail(self.gone());
            return;
        };
        let deadline = stripe.batch.deadline();
        let sink = Arc::new(NotifyPart {
            stripe: Arc::clone(&stripe),
            done: AtomicBool::new(false),
        });
        if let Err(e) = self.conns[r].post(
            Arc::clone(&sink),
            std::iter::empty::<PlanOp>(),
            Some(tag),
            deadline,
        ) {
            sink.fail(e);
        }
    }
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
}

impl Stripe {
    fn land(self: &Arc<Self>) {
        if self.gate.landed(1) {
            self.conn.finish(Arc::clone(self));
        }
    }
}

/// One rail's part of a striped batch: what the rail's connection reports into.
struct Part {
    stripe: Arc<Stripe>,
    rail: usize,
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
        if s.batch.is_stopped() {
            return;
        }
        let conn = &s.conn;
        if !rail_fault(&err) {
            s.batch.fail(err);
            return;
        }
        conn.take_out(self.rail, &err);
        let Some(r) = conn.pick() else {
            s.batch.fail(err);
            return;
        };
        conn.set.counters[r].retries.fetch_add(1, Ordering::Relaxed);
        let again = Arc::new(Part {
            stripe: Arc::clone(s),
            rail: r,
            pieces: self.pieces.clone(),
            bytes: self.bytes,
            wrs: AtomicUsize::new(0),
            done: AtomicBool::new(false),
        });
        // Reported from a completion thread or a poster holding another rail's windows:
        // post again on a thread of its own, which may wait for window room.
        let c = Arc::clone(conn);
        let spawned = std::thread::Builder::new()
            .name("pagewire-rail-retry".into())
            .spawn(move || c.post_part(again));
        if let Err(e) = spawned {
            s.batch.fail(Error::io("spawning a rail retry thread", e));
        }
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
        self.stripe.batch.should_stop(Instant::now())
    }

    fn is_stopped(&self) -> bool {
        self.stripe.batch.is_stopped()
    }
}

/// The notification of a striped batch, posted once every part landed.
struct NotifyPart {
    stripe: Arc<Stripe>,
    done: AtomicBool,
}

impl BatchSink for NotifyPart {
    fn on_acked(&self, _wrs: usize, _bytes: u64) {}

    fn fail(&self, err: Error) {
        // Not retried on another rail: the peer may have surfaced the tag already.
        if !self.done.swap(true, Ordering::AcqRel) {
            self.stripe.batch.fail(err);
        }
    }

    fn complete(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.stripe.batch.succeed(Instant::now());
        }
    }

    fn should_stop(&self) -> bool {
        self.stripe.batch.should_stop(Instant::now())
    }

    fn is_stopped(&self) -> bool {
        self.stripe.batch.is_stopped()
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
        });
        for (rail, pieces, bytes) in parts {
            let part = Arc::new(Part {
                stripe: Arc::clone(&stripe),
                rail,
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
        for c in &self.conns {
            c.probe(deadline)?;
        }
        Ok(())
    }

    fn close(&self) {
        for c in &self.conns {
            c.close(Error::peer_gone(
                self.peer,
                PeerFault::ClosedLocally,
                "connection closed",
            ));
        }
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
}
