//! The master's decisions, without I/O: clients, segments, objects, leases, eviction.
//!
//! Every method takes the current time (`now`, milliseconds on a monotonic clock of the
//! caller's choice), so the rules are unit- and property-tested with a fake clock. The
//! server in [`crate::master`] owns one `MasterCore` behind a mutex, feeds it requests and
//! calls [`MasterCore::tick`] periodically.
//!
//! Rules, in brief (docs/store.md has the full statement):
//! * A put reserves replicas on distinct segments (distinct endpoints first), writes
//!   happen elsewhere, then `put_finish` publishes or revokes. Only complete objects are
//!   visible; the first put of a key wins until the key is removed.
//! * A read lease (`get` with `lease`) keeps an object from removal and eviction for
//!   `lease_ttl_ms`. A forced removal of a leased object frees its space only when the
//!   lease ends.
//! * Space that a writer might still be writing is not reused at once: revoked puts wait
//!   `revoke_grace_ms`, reservations taken away from their writer (timeout, writer or
//!   segment lost) wait until `put_release_ms` after the put started.
//! * At `high_watermark` usage the least recently used evictable objects (complete, not
//!   leased, not hard-pinned; soft-pinned ones last) are dropped until `evict_ratio` of the
//!   capacity is free again; a put that finds no room evicts until it fits, then gives up.
//! * Segments of a client silent for `client_ttl_ms` are unmounted; their objects lose
//!   those replicas (and vanish with the last one). A segment whose owner's connection
//!   closed takes no new replicas until its owner is heard from again.
//! * A client's report of a failed transfer is evidence, not a verdict: it counts only for
//!   a segment the master named to that client recently (so it could have failed against
//!   it), and the segment takes no new replicas only once the master confirms it: reports
//!   from clients at two addresses within `client_ttl_ms`, or its owner silent for two
//!   heartbeats since the report. A client whose reports nobody confirms, [`STRIKES`] in a row, is the one
//!   held back: its reports are ignored and its puts refused (`TransferFailed`) for a
//!   period that doubles with each further strike, up to [`PENALTY_MAX_MS`].
//! * Every mount names the remote key of the segment's registration, and every reply that
//!   names a segment carries it. A node registers its memory anew before each mount after
//!   its first, so transfers of an earlier session (an earlier master, or before the
//!   master dropped the node) fail at the data path instead of landing in space this
//!   session hands out: a remounted segment takes replicas at once.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;

use crate::alloc::{Allocator, aligned};
use crate::error::Code;
use crate::oplog::Record;
use crate::proto::{self, Found, ObjectInfo, Pin, Placement, Replica, SegmentRef, Stats};

/// Milliseconds on the caller's monotonic clock.
pub type Millis = u64;

/// Reporters at distinct addresses whose reports confirm one another (see the module
/// doc).
pub const CONFIRMING_REPORTERS: usize = 2;
/// Unconfirmed reports in a row after which a client is held back.
pub const STRIKES: u32 = 4;
/// The first period a client is held back for; each further strike doubles it.
pub const PENALTY_FIRST_MS: Millis = 250;
/// The longest period a client is held back for.
pub const PENALTY_MAX_MS: Millis = 10_000;
/// Reports kept per segment (the newest; distinct reporters).
const MAX_REPORTS: usize = 8;

/// The master's knobs (defaults as in Mooncake Store where it has the same knob).
#[derive(Debug, Clone, PartialEq)]
pub struct CoreConfig {
    /// Read lease length (`--lease-ttl`, default 10 s).
    pub lease_ttl_ms: u64,
    /// Silence after which a client is dropped and its segments unmounted (10 s).
    pub client_ttl_ms: u64,
    /// Heartbeat period the master asks of clients (1 s).
    pub heartbeat_ms: u64,
    /// Usage fraction that starts eviction (0.90).
    pub high_watermark: f64,
    /// Fraction of the capacity one eviction round frees (0.05).
    pub evict_ratio: f64,
    /// How long a soft pin protects an object (30 min).
    pub soft_pin_ttl_ms: u64,
    /// A put unfinished after this long is taken away from its writer (30 s).
    pub put_discard_ms: u64,
    /// Space of a put taken away from its writer is reused this long after the put
    /// started (10 min), when no write of it can still be in flight.
    pub put_release_ms: u64,
    /// Space of a revoked put is reused after this long (5 s): the writer broke its
    /// connections before revoking, and this covers bytes already on their way.
    pub revoke_grace_ms: u64,
    /// Most clients at once.
    pub max_clients: usize,
    /// Most segments at once (all clients).
    pub max_segments: usize,
    /// Most segments one client may mount.
    pub max_segments_per_client: usize,
    /// Most objects (complete and pending).
    pub max_objects: usize,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            lease_ttl_ms: 10_000,
            client_ttl_ms: 10_000,
            heartbeat_ms: 1_000,
            high_watermark: 0.90,
            evict_ratio: 0.05,
            soft_pin_ttl_ms: 30 * 60_000,
            put_discard_ms: 30_000,
            put_release_ms: 600_000,
            revoke_grace_ms: 5_000,
            max_clients: 4096,
            max_segments: 4096,
            max_segments_per_client: 64,
            max_objects: 1 << 24,
        }
    }
}

impl CoreConfig {
    /// Checks the knobs; the error names the bad one.
    pub fn validate(&self) -> Result<(), String> {
        let ms = |name: &str, v: u64, lo: u64| {
            if v < lo || v > u32::MAX as u64 {
                Err(format!("{name} = {v} ms is outside {lo}..={}", u32::MAX))
            } else {
                Ok(())
            }
        };
        ms("lease_ttl_ms", self.lease_ttl_ms, 1)?;
        ms("client_ttl_ms", self.client_ttl_ms, 100)?;
        ms("heartbeat_ms", self.heartbeat_ms, 10)?;
        if self.heartbeat_ms * 2 > self.client_ttl_ms {
            return Err(format!(
                "heartbeat_ms = {} must be at most half of client_ttl_ms = {}",
                self.heartbeat_ms, self.client_ttl_ms
            ));
        }
        ms("put_discard_ms", self.put_discard_ms, 1)?;
        if self.put_release_ms < self.put_discard_ms {
            return Err("put_release_ms must be at least put_discard_ms".into());
        }
        if !(self.high_watermark > 0.0 && self.high_watermark <= 1.0) {
            return Err(format!(
                "high_watermark = {} is outside (0, 1]",
                self.high_watermark
            ));
        }
        if !(self.evict_ratio > 0.0 && self.evict_ratio <= 1.0) {
            return Err(format!(
                "evict_ratio = {} is outside (0, 1]",
                self.evict_ratio
            ));
        }
        if self.max_clients == 0 || self.max_segments == 0 || self.max_segments_per_client == 0 {
            return Err("the max_* limits must be positive".into());
        }
        Ok(())
    }
}

type Key = Arc<[u8]>;

#[derive(Debug)]
struct ClientState {
    endpoint: Arc<str>,
    last_seen: Millis,
    segments: Vec<u64>,
    /// Segments named to this client in a reply, and when last: its reports count only
    /// for these (it cannot have failed a transfer to a segment it was never told of).
    named: HashMap<u64, Millis>,
    /// Reports in a row that nothing confirmed.
    strikes: u32,
    /// When the latest strike was counted (strikes older than `client_ttl_ms` lapse).
    struck_at: Millis,
    /// Reports are ignored and puts refused until then.
    held_until: Millis,
    /// Where its connection comes from (see [`MasterCore::hello_from`]).
    origin: u128,
}

impl ClientState {
    fn new(endpoint: &str, now: Millis, origin: u128) -> Self {
        ClientState {
            endpoint: endpoint.into(),
            last_seen: now,
            segments: Vec::new(),
            named: HashMap::new(),
            strikes: 0,
            struck_at: 0,
            held_until: 0,
            origin,
        }
    }
}

#[derive(Debug)]
struct Segment {
    endpoint: Arc<str>,
    base: u64,
    alloc: Allocator,
    /// The remote key of the registration the owner mounted (see the module doc).
    rkey: u32,
    /// The client that mounted it.
    owner: u64,
    /// The owner's connection closed, and the owner has not spoken since: the master's
    /// own view, enough to place nothing new here.
    closed: bool,
    /// `(reporter's origin, when)` of counted reports of failed transfers, distinct
    /// origins, at most [`MAX_REPORTS`] (the newest).
    reports: Vec<(u128, Millis)>,
    /// Known from the op-log, not mounted by a client of this master yet: until when its
    /// owner may remount it (`Millis::MAX` on a standby). Its replicas are not named and
    /// it takes none meanwhile.
    awaiting: Option<Millis>,
}

impl Segment {
    /// The op-log's record of this segment, mounted as `id`.
    fn record(&self, id: u64) -> Record {
        Record::Mount {
            segment: id,
            endpoint: self.endpoint.to_string(),
            base: self.base,
            size: self.alloc.size(),
            rkey: self.rkey,
            owner: self.owner,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Being written by `client`; `seq` orders the pending index.
    Pending {
        client: u64,
        started: Millis,
        seq: u64,
    },
    Complete,
}

#[derive(Debug)]
struct Object {
    size: u64,
    /// `(segment, offset in the segment)`.
    replicas: Vec<(u64, u64)>,
    state: State,
    lease_until: Millis,
    /// Position in the order of uses (a logical clock: exact LRU, no ties).
    last_access: u64,
    pin: Pin,
    soft_until: Millis,
}

impl Object {
    /// The op-log's record of this object's publication under `key`.
    fn record(&self, key: &[u8]) -> Record {
        Record::Publish {
            key: key.to_vec(),
            size: self.size,
            pin: self.pin,
            replicas: self.replicas.clone(),
        }
    }
}

/// What the periodic [`MasterCore::tick`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TickReport {
    /// Clients dropped for silence.
    pub clients_expired: usize,
    /// Unfinished puts taken away from their writers.
    pub puts_reclaimed: usize,
    /// Objects evicted.
    pub evicted: usize,
    /// Held blocks returned to their segments.
    pub released: usize,
}

/// The master's state.
#[derive(Debug)]
pub struct MasterCore {
    cfg: CoreConfig,
    epoch: u64,
    rng: u64,
    clients: HashMap<u64, ClientState>,
    segments: BTreeMap<u64, Segment>,
    next_segment: u64,
    objects: HashMap<Key, Object>,
    /// Pending puts by `(started, seq)`, for reclaiming the oldest first.
    pending: BTreeMap<(Millis, u64), Key>,
    next_seq: u64,
    /// Blocks to return to their segment at the given time: `(at, segment, off, len)`.
    held: BinaryHeap<Reverse<(Millis, u64, u64, u64)>>,
    cursor: u64,
    uses: Uses,
    capacity: u64,
    used: u64,
    evicted: u64,
    reclaimed: u64,
    /// When [`MasterCore::prune_evidence`] last ran.
    pruned_at: Millis,
    /// The op-log outbox (`None`: not logging).
    log: Option<Vec<Record>>,
}

/// How often the tick forgets evidence that can no longer count.
const PRUNE_EVERY_MS: Millis = 1_000;

/// A counter of object uses (puts published, gets, existence checks).
#[derive(Debug)]
struct Uses(u64);

impl Uses {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl MasterCore {
    /// A master with no clients. `seed` makes client ids and the epoch (draw it at random
    /// in a server: ids must not repeat across restarts).
    pub fn new(cfg: CoreConfig, seed: u64) -> Self {
        let mut rng = seed;
        let epoch = splitmix(&mut rng);
        // Segment ids start at a random point, so that an id a client kept from another
        // master instance names nothing here (ids stay far from wrapping).
        let first_segment = (splitmix(&mut rng) >> 20).max(1);
        MasterCore {
            cfg,
            epoch,
            rng,
            clients: HashMap::new(),
            segments: BTreeMap::new(),
            next_segment: first_segment,
            objects: HashMap::new(),
            pending: BTreeMap::new(),
            next_seq: 0,
            held: BinaryHeap::new(),
            cursor: first_segment - 1,
            uses: Uses(0),
            capacity: 0,
            used: 0,
            evicted: 0,
            reclaimed: 0,
            pruned_at: 0,
            log: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// This master instance's random id.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Sets the epoch announced to clients (a leader's term given by its election).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    // ---------------------------------------------------------------- clients

    /// A client says hello: resumes `requested` if it is known under the same endpoint,
    /// else registers a new client. Returns `(id, resumed)`. Its reports count as those
    /// of a host of their own (see [`MasterCore::hello_from`]).
    ///
    /// After a failover, a `requested` id that the op-log names as the owner of segments
    /// awaiting their owner at that endpoint is registered under that id, not resumed
    /// (`resumed` is false: the client mounts again, and only it can take those segments
    /// back; see [`MasterCore::mount`]).
    pub fn hello(
        &mut self,
        now: Millis,
        requested: u64,
        endpoint: &str,
    ) -> Result<(u64, bool), Code> {
        self.hello_from(now, requested, endpoint, None)
    }

    /// [`MasterCore::hello`] from the source address `origin` (the server passes the
    /// connection's IP address). Reports confirm one another only from distinct origins:
    /// anyone can open a second connection, not a second address.
    pub fn hello_from(
        &mut self,
        now: Millis,
        requested: u64,
        endpoint: &str,
        origin: Option<u128>,
    ) -> Result<(u64, bool), Code> {
        if let Some(c) = self.clients.get_mut(&requested)
            && &*c.endpoint == endpoint
        {
            c.last_seen = now;
            if let Some(o) = origin {
                c.origin = o;
            }
            let segs = c.segments.clone();
            for s in segs {
                if let Some(seg) = self.segments.get_mut(&s) {
                    seg.closed = false;
                }
            }
            return Ok((requested, true));
        }
        if self.clients.len() >= self.cfg.max_clients {
            return Err(Code::NoSpace);
        }
        // Ids are known only to their client (and the op-log): a restarted process asks
        // for none, so it cannot claim the memory of the process it replaced.
        let id = if requested != 0
            && !self.clients.contains_key(&requested)
            && self.awaits_owner(requested, Some(endpoint))
        {
            requested
        } else {
            loop {
                let id = splitmix(&mut self.rng);
                if id != 0 && !self.clients.contains_key(&id) && !self.awaits_owner(id, None) {
                    break id;
                }
            }
        };
        // Without an address, each client is an origin of its own (ids are random u64s,
        // addresses are marked apart by the top bit).
        let origin = origin.map_or(u128::from(id) | (1 << 127), |o| o & !(1 << 127));
        self.clients
            .insert(id, ClientState::new(endpoint, now, origin));
        Ok((id, false))
    }

    /// Whether a segment awaiting its owner after a failover names `owner` (at `endpoint`,
    /// if given).
    fn awaits_owner(&self, owner: u64, endpoint: Option<&str>) -> bool {
        self.segments.values().any(|s| {
            s.awaiting.is_some() && s.owner == owner && endpoint.is_none_or(|e| &*s.endpoint == e)
        })
    }

    /// Any frame from a client: it is alive, and so are its segments.
    pub fn touch(&mut self, now: Millis, client: u64) -> Result<(), Code> {
        let c = self.clients.get_mut(&client).ok_or(Code::UnknownClient)?;
        c.last_seen = now;
        for s in &c.segments {
            if let Some(seg) = self.segments.get_mut(s) {
                seg.closed = false;
            }
        }
        Ok(())
    }

    /// The client's connection closed: place nothing new on its segments until it is heard
    /// from again (its objects stay readable until its TTL runs out).
    pub fn disconnected(&mut self, client: u64) {
        if let Some(c) = self.clients.get(&client) {
            for s in &c.segments {
                if let Some(seg) = self.segments.get_mut(s) {
                    seg.closed = true;
                }
            }
        }
    }

    /// The client leaves: its segments are unmounted and its puts taken away now.
    pub fn bye(&mut self, now: Millis, client: u64) {
        self.drop_client(now, client);
    }

    fn drop_client(&mut self, now: Millis, client: u64) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        for s in c.segments {
            self.unmount_segment(now, s);
        }
        let theirs: Vec<Key> = self
            .pending
            .values()
            .filter(|k| {
                matches!(self.objects.get(&***k).map(|o| o.state),
                    Some(State::Pending { client: c, .. }) if c == client)
            })
            .cloned()
            .collect();
        for k in theirs {
            self.take_away(now, &k);
        }
    }

    // ---------------------------------------------------------------- segments

    /// Mounts `[base, base+size)` of the client's memory, registered under `rkey`, as a
    /// segment.
    pub fn mount(
        &mut self,
        now: Millis,
        client: u64,
        base: u64,
        size: u64,
        rkey: u32,
    ) -> Result<u64, Code> {
        self.touch(now, client)?;
        let end = base.checked_add(size).ok_or(Code::InvalidParams)?;
        let alloc = Allocator::new(size);
        if alloc.size() == 0 {
            return Err(Code::InvalidParams);
        }
        let endpoint = self.clients[&client].endpoint.clone();
        if let Some(id) = self.remount(now, client, &endpoint, base, alloc.size(), rkey) {
            return Ok(id);
        }
        let c = &self.clients[&client];
        if c.segments.len() >= self.cfg.max_segments_per_client
            || self.segments.len() >= self.cfg.max_segments
        {
            return Err(Code::NoSpace);
        }
        // One endpoint is one address space: its segments must not overlap.
        if self
            .segments
            .values()
            .any(|s| s.endpoint == endpoint && base < s.base + s.alloc.size() && s.base < end)
        {
            return Err(Code::InvalidParams);
        }
        let id = self.next_segment;
        self.next_segment += 1;
        self.capacity += alloc.size();
        self.segments.insert(
            id,
            Segment {
                endpoint,
                base,
                alloc,
                rkey,
                owner: client,
                closed: false,
                reports: Vec::new(),
                awaiting: None,
            },
        );
        self.clients
            .get_mut(&client)
            .expect("touched")
            .segments
            .push(id);
        if let Some(log) = &mut self.log {
            log.push(self.segments[&id].record(id));
        }
        Ok(id)
    }

    /// A mount of a segment known from the op-log and awaiting its owner, by that owner
    /// (the client id the log names, resumed in [`MasterCore::hello_from`]) with the same
    /// endpoint, base and size: the owner takes it back with its id and contents, under
    /// its new registration. Bounds alone prove nothing about the contents: a process
    /// restarted on the same port may map fresh memory at the same address, and it has a
    /// new client id. An awaiting segment of that endpoint overlapping the mount otherwise
    /// (other bounds, or another client) is unmounted: that memory was registered anew.
    fn remount(
        &mut self,
        now: Millis,
        client: u64,
        endpoint: &Arc<str>,
        base: u64,
        size: u64,
        rkey: u32,
    ) -> Option<u64> {
        let end = base.saturating_add(size);
        let mut same = None;
        let mut stale = Vec::new();
        for (&id, s) in &self.segments {
            if s.awaiting.is_none() || s.endpoint != *endpoint {
                continue;
            }
            if s.owner == client && s.base == base && s.alloc.size() == size {
                same = Some(id);
            } else if base < s.base + s.alloc.size() && s.base < end {
                stale.push(id);
            }
        }
        for id in stale {
            self.unmount_segment(now, id);
        }
        let id = same?;
        let s = self.segments.get_mut(&id).expect("found above");
        s.awaiting = None;
        s.rkey = rkey;
        s.closed = false;
        self.clients
            .get_mut(&client)
            .expect("touched")
            .segments
            .push(id);
        self.emit(|| Record::Remount { segment: id, rkey });
        Some(id)
    }

    /// Unmounts one of the client's segments.
    pub fn unmount(&mut self, now: Millis, client: u64, segment: u64) -> Result<(), Code> {
        self.touch(now, client)?;
        let c = self.clients.get_mut(&client).expect("touched");
        let Some(i) = c.segments.iter().position(|&s| s == segment) else {
            return Err(Code::SegmentNotFound);
        };
        c.segments.swap_remove(i);
        self.unmount_segment(now, segment);
        Ok(())
    }

    fn unmount_segment(&mut self, now: Millis, segment: u64) {
        let Some(seg) = self.segments.remove(&segment) else {
            return;
        };
        self.emit(|| Record::Unmount { segment });
        self.capacity -= seg.alloc.size();
        self.used -= seg.alloc.used();
        // Objects with a replica there lose it (an O(objects) scan: unmounts are rare).
        let mut lost = Vec::new();
        let mut broken = Vec::new();
        for (k, o) in self.objects.iter_mut() {
            let before = o.replicas.len();
            match o.state {
                State::Pending { .. } => {
                    if o.replicas.iter().any(|r| r.0 == segment) {
                        broken.push(k.clone());
                    }
                }
                State::Complete => {
                    o.replicas.retain(|r| r.0 != segment);
                    if o.replicas.is_empty() && before > 0 {
                        lost.push(k.clone());
                    }
                }
            }
        }
        for k in lost {
            self.objects.remove(&*k);
        }
        for k in broken {
            // The put cannot complete; its other replicas may still be being written.
            self.take_away(now, &k);
        }
    }

    // ---------------------------------------------------------------- puts

    /// Reserves replicas for each `(key, size)`: per item the replica addresses, or
    /// `AlreadyExists` / `NoSpace` / `InvalidParams`.
    pub fn put_start(
        &mut self,
        now: Millis,
        client: u64,
        req: &proto::PutStart,
    ) -> Result<Placement, Code> {
        self.touch(now, client)?;
        let mut out = Placement {
            segments: Vec::new(),
            items: Vec::with_capacity(req.items.len()),
        };
        if self.clients[&client].held_until > now {
            // Its transfers keep failing where nobody else's do: reserve nothing for it
            // (a reservation it cannot fill holds space from everyone for a while).
            out.items = vec![Err(Code::TransferFailed); req.items.len()];
            return Ok(out);
        }
        let wanted = (req.replicas as usize).clamp(1, proto::MAX_REPLICAS);
        for (key, size) in &req.items {
            let item = self.start_one(now, client, key, *size, wanted, req);
            out.items.push(item.map(|reps| {
                reps.iter()
                    .map(|&(s, off)| Replica {
                        segment: s,
                        addr: self.segments[&s].base + off,
                    })
                    .collect()
            }));
        }
        self.name_segments(&mut out.segments, out.items.iter().flatten().flatten());
        self.named(now, client, &out.segments);
        self.watermark(now);
        Ok(out)
    }

    fn start_one(
        &mut self,
        now: Millis,
        client: u64,
        key: &[u8],
        size: u64,
        wanted: usize,
        req: &proto::PutStart,
    ) -> Result<Vec<(u64, u64)>, Code> {
        if key.is_empty() || key.len() > proto::MAX_KEY_LEN {
            return Err(Code::InvalidKey);
        }
        if size == 0 || aligned(size).is_none() {
            return Err(Code::InvalidParams);
        }
        if self.objects.contains_key(key) {
            return Err(Code::AlreadyExists);
        }
        if self.objects.len() >= self.cfg.max_objects {
            return Err(Code::NoSpace);
        }
        let mut reps = self.place(now, size, wanted, &req.preferred);
        if reps.is_empty() {
            self.evict_until_fits(now, size, wanted);
            reps = self.place(now, size, wanted, &req.preferred);
        }
        if reps.is_empty() {
            return Err(Code::NoSpace);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let key: Key = key.into();
        self.pending.insert((now, seq), key.clone());
        self.objects.insert(
            key,
            Object {
                size,
                replicas: reps.clone(),
                state: State::Pending {
                    client,
                    started: now,
                    seq,
                },
                lease_until: 0,
                last_access: self.uses.next(),
                pin: req.pin,
                soft_until: if req.pin == Pin::Soft {
                    now.saturating_add(self.cfg.soft_pin_ttl_ms)
                } else {
                    0
                },
            },
        );
        Ok(reps)
    }

    fn placeable(&self, now: Millis, s: &Segment, need: u64) -> bool {
        s.awaiting.is_none() && !self.suspect(now, s) && s.alloc.largest_free() >= need
    }

    /// Whether the master confirms that `s` is failing: its owner's connection closed,
    /// clients agree, or the owner went silent after a report (see the module doc).
    fn suspect(&self, now: Millis, s: &Segment) -> bool {
        if s.closed {
            return true;
        }
        let since = now.saturating_sub(self.cfg.client_ttl_ms);
        let recent = || s.reports.iter().filter(move |r| r.1 >= since);
        if recent().count() >= CONFIRMING_REPORTERS {
            return true;
        }
        // One report, and the owner has said nothing since it for two heartbeats.
        let last_seen = self.clients.get(&s.owner).map_or(0, |c| c.last_seen);
        now >= last_seen.saturating_add(2 * self.cfg.heartbeat_ms)
            && recent().any(|r| r.1 >= last_seen)
    }

    /// How long a segment named to a client stays one it may report: its transfers to it
    /// (a put's writes, a leased read) end within this.
    fn named_window(&self) -> Millis {
        self.cfg.put_discard_ms.max(self.cfg.lease_ttl_ms)
    }

    /// Records that `segments` were named to `client` at `now`.
    fn named(&mut self, now: Millis, client: u64, segments: &[SegmentRef]) {
        if let Some(c) = self.clients.get_mut(&client) {
            for s in segments {
                c.named.insert(s.id, now);
            }
        }
    }

    /// Allocates up to `wanted` replicas of `size` on distinct segments, on distinct
    /// endpoints first; the preferred endpoint's segments are tried first, then the others
    /// round-robin. Returns what it got (maybe fewer than wanted: best effort).
    fn place(&mut self, now: Millis, size: u64, wanted: usize, preferred: &str) -> Vec<(u64, u64)> {
        let need = aligned(size).expect("checked");
        let mut picked: Vec<u64> = Vec::with_capacity(wanted);
        if !preferred.is_empty() {
            for (&id, s) in &self.segments {
                if picked.is_empty() && &*s.endpoint == preferred && self.placeable(now, s, need) {
                    picked.push(id);
                }
            }
        }
        self.cursor = self.cursor.wrapping_add(1);
        let start = self.cursor;
        for distinct_endpoints in [true, false] {
            if picked.len() >= wanted {
                break;
            }
            let order = self
                .segments
                .range(start..)
                .chain(self.segments.range(..start));
            for (&id, s) in order {
                if picked.len() >= wanted {
                    break;
                }
                if picked.contains(&id) || !self.placeable(now, s, need) {
                    continue;
                }
                if distinct_endpoints
                    && picked
                        .iter()
                        .any(|p| self.segments[p].endpoint == s.endpoint)
                {
                    continue;
                }
                picked.push(id);
            }
        }
        // The cursor walks segment ids; wrap it to the id space in use.
        if let (Some((&first, _)), Some((&last, _))) = (
            self.segments.first_key_value(),
            self.segments.last_key_value(),
        ) && (self.cursor > last || self.cursor < first)
        {
            self.cursor = first - 1;
        }
        let mut out = Vec::with_capacity(picked.len());
        for id in picked {
            let s = self.segments.get_mut(&id).expect("picked");
            let off = s.alloc.alloc(size).expect("largest_free checked");
            self.used += need;
            out.push((id, off));
        }
        out
    }

    /// Publishes `done` (every replica written) and revokes `revoked`; marks `suspects`.
    /// Returns one code per key, `done` first.
    pub fn put_finish(
        &mut self,
        now: Millis,
        client: u64,
        f: &proto::PutFinish,
    ) -> Result<Vec<Code>, Code> {
        self.touch(now, client)?;
        if f.suspects.is_empty() {
            if !f.done.is_empty() {
                // Its transfers work: whatever it reported before was not its own fault.
                let c = self.clients.get_mut(&client).expect("touched");
                c.strikes = 0;
            }
        } else {
            self.weigh_report(now, client, &f.suspects);
        }
        let mut codes = Vec::with_capacity(f.done.len() + f.revoked.len());
        for k in &f.done {
            codes.push(match self.objects.get_mut(&**k) {
                Some(o) => match o.state {
                    State::Pending {
                        client: c,
                        started,
                        seq,
                    } if c == client => {
                        o.state = State::Complete;
                        o.last_access = self.uses.next();
                        self.pending.remove(&(started, seq));
                        if let Some(log) = &mut self.log {
                            log.push(o.record(k));
                        }
                        Code::Ok
                    }
                    _ => Code::NotFound,
                },
                None => Code::NotFound,
            });
        }
        for k in &f.revoked {
            codes.push(match self.objects.get(&**k).map(|o| o.state) {
                Some(State::Pending { client: c, .. }) if c == client => {
                    let o = self.remove_object(k).expect("present");
                    let at = now.saturating_add(self.cfg.revoke_grace_ms);
                    self.hold(now, &o, at);
                    Code::Ok
                }
                _ => Code::NotFound,
            });
        }
        Ok(codes)
    }

    /// A client failed transfers to `suspects`: evidence against them, weighed as the
    /// module doc says.
    pub fn report(&mut self, now: Millis, client: u64, suspects: &[u64]) -> Result<(), Code> {
        self.touch(now, client)?;
        self.weigh_report(now, client, suspects);
        Ok(())
    }

    /// Counts `client`'s report against each segment named to it recently (not its own),
    /// then strikes the client if no segment it named is confirmed failing.
    fn weigh_report(&mut self, now: Millis, client: u64, suspects: &[u64]) {
        let window = self.named_window();
        let c = &self.clients[&client];
        if c.held_until > now {
            return;
        }
        let origin = c.origin;
        // Segments named to it recently, that still exist and are not its own.
        let counted: Vec<u64> = suspects
            .iter()
            .copied()
            .filter(|id| {
                c.named
                    .get(id)
                    .is_some_and(|&at| now.saturating_sub(at) <= window)
                    && self.segments.get(id).is_some_and(|s| s.owner != client)
            })
            .collect();
        for id in &counted {
            let seg = self.segments.get_mut(id).expect("filtered above");
            seg.reports.retain(|r| r.0 != origin);
            if seg.reports.len() >= MAX_REPORTS {
                seg.reports.remove(0);
            }
            seg.reports.push((origin, now));
        }
        let confirmed = counted
            .iter()
            .any(|id| self.suspect(now, &self.segments[id]));
        let ttl = self.cfg.client_ttl_ms;
        let c = self.clients.get_mut(&client).expect("touched");
        if confirmed {
            c.strikes = 0;
            return;
        }
        if now.saturating_sub(c.struck_at) > ttl {
            c.strikes = 0;
        }
        c.strikes += 1;
        c.struck_at = now;
        if c.strikes >= STRIKES {
            let doublings = (c.strikes - STRIKES).min(16);
            let period = (PENALTY_FIRST_MS << doublings).min(PENALTY_MAX_MS);
            c.held_until = now.saturating_add(period);
            // Its earlier reports are discredited too: they must not confirm anyone's.
            for s in self.segments.values_mut() {
                s.reports.retain(|r| r.0 != origin);
            }
            let c = &self.clients[&client];
            tracing::warn!(
                client = format_args!("{client:#x}"),
                endpoint = %c.endpoint,
                strikes = c.strikes,
                "store client reports failures that nobody confirms: its reports are ignored and its puts refused for {period} ms"
            );
        }
    }

    // ---------------------------------------------------------------- reads

    /// Replica lists of complete objects; with `lease`, each found object is leased for
    /// `lease_ttl_ms` from `now`. Replicas on segments under suspicion are listed last.
    /// `client` is the asker (the segments named go into its record; 0: nobody).
    pub fn get(&mut self, now: Millis, client: u64, keys: &[Vec<u8>], lease: bool) -> Found {
        let ttl = self.cfg.lease_ttl_ms;
        let mut items = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(o) = self.objects.get_mut(&**k) else {
                items.push(Err(Code::NotFound));
                continue;
            };
            if o.state != State::Complete {
                items.push(Err(Code::NotReady));
                continue;
            }
            let segments = &self.segments;
            let live = |s: &u64| segments[s].awaiting.is_none();
            if !o.replicas.iter().any(|(s, _)| live(s)) {
                // Its segments are awaiting their owners after a failover.
                items.push(Err(Code::NotReady));
                continue;
            }
            o.last_access = self.uses.next();
            if lease {
                o.lease_until = o.lease_until.max(now.saturating_add(ttl));
            }
            let replicas: Vec<Replica> = o
                .replicas
                .iter()
                .filter(|(s, _)| live(s))
                .map(|&(s, off)| Replica {
                    segment: s,
                    addr: self.segments[&s].base + off,
                })
                .collect();
            items.push(Ok(ObjectInfo {
                size: o.size,
                replicas,
            }));
        }
        for o in items.iter_mut().flatten() {
            o.replicas
                .sort_by_key(|r| self.suspect(now, &self.segments[&r.segment]));
        }
        let mut found = Found {
            lease_ttl_ms: if lease { ttl as u32 } else { 0 },
            segments: Vec::new(),
            items,
        };
        let names: Vec<Replica> = found
            .items
            .iter()
            .flatten()
            .flat_map(|o| o.replicas.iter().copied())
            .collect();
        self.name_segments(&mut found.segments, names.iter());
        self.named(now, client, &found.segments);
        found
    }

    /// Whether complete objects exist (`Ok` / `NotFound`). Like Mooncake's `ExistKey`,
    /// this leases every object found (a caller that checks, then reads, keeps what it
    /// saw) and counts as a use for eviction.
    pub fn exist(&mut self, now: Millis, keys: &[Vec<u8>]) -> Vec<Code> {
        let until = now.saturating_add(self.cfg.lease_ttl_ms);
        keys.iter()
            .map(|k| match self.objects.get_mut(&**k) {
                Some(o) if o.state == State::Complete => {
                    o.lease_until = o.lease_until.max(until);
                    o.last_access = self.uses.next();
                    Code::Ok
                }
                _ => Code::NotFound,
            })
            .collect()
    }

    fn name_segments<'a>(
        &self,
        out: &mut Vec<SegmentRef>,
        reps: impl Iterator<Item = &'a Replica>,
    ) {
        for r in reps {
            if !out.iter().any(|s| s.id == r.segment) {
                let s = &self.segments[&r.segment];
                out.push(SegmentRef {
                    id: r.segment,
                    endpoint: s.endpoint.to_string(),
                    base: s.base,
                    rkey: s.rkey,
                });
            }
        }
    }

    // ---------------------------------------------------------------- removal

    /// Removes complete objects: `NotFound`, `NotReady` (being written), `HasLease`
    /// (leased and not `force`), else `Ok`.
    pub fn remove(&mut self, now: Millis, keys: &[Vec<u8>], force: bool) -> Vec<Code> {
        keys.iter()
            .map(|k| self.remove_one(now, k, force))
            .collect()
    }

    fn remove_one(&mut self, now: Millis, k: &[u8], force: bool) -> Code {
        match self.objects.get(k) {
            None => Code::NotFound,
            Some(o) if o.state != State::Complete => Code::NotReady,
            Some(o) if o.lease_until > now && !force => Code::HasLease,
            Some(_) => {
                let o = self.remove_object(k).expect("present");
                self.emit(|| Record::Remove { key: k.to_vec() });
                // A forced removal must not hand out bytes a lease holder may be reading.
                self.hold(now, &o, o.lease_until);
                Code::Ok
            }
        }
    }

    /// Removes every complete object not leased (or every one with `force`); returns how
    /// many.
    pub fn remove_all(&mut self, now: Millis, force: bool) -> u64 {
        self.remove_matching(now, force, |_| true)
    }

    /// As `remove_all`, for the keys `matches` accepts.
    pub fn remove_matching(
        &mut self,
        now: Millis,
        force: bool,
        matches: impl Fn(&[u8]) -> bool,
    ) -> u64 {
        let keys: Vec<Key> = self
            .objects
            .iter()
            .filter(|(k, o)| {
                o.state == State::Complete && (force || o.lease_until <= now) && matches(k)
            })
            .map(|(k, _)| k.clone())
            .collect();
        let n = keys.len() as u64;
        for k in keys {
            self.remove_one(now, &k, true);
        }
        n
    }

    fn remove_object(&mut self, k: &[u8]) -> Option<Object> {
        let o = self.objects.remove(k)?;
        if let State::Pending { started, seq, .. } = o.state {
            self.pending.remove(&(started, seq));
        }
        Some(o)
    }

    /// Takes a pending put away from its writer: the key is free again, the space is held
    /// until no write of the put can still land.
    fn take_away(&mut self, now: Millis, k: &[u8]) {
        if let Some(o) = self.remove_object(k) {
            let State::Pending { started, .. } = o.state else {
                unreachable!("take_away of a complete object")
            };
            self.reclaimed += 1;
            let at = started.saturating_add(self.cfg.put_release_ms);
            self.hold(now, &o, at);
        }
    }

    /// Frees an object's replicas at `at` (at once if that is not in the future).
    fn hold(&mut self, now: Millis, o: &Object, at: Millis) {
        for &(s, off) in &o.replicas {
            if at <= now {
                self.free_block(s, off, o.size);
            } else {
                self.held.push(Reverse((at, s, off, o.size)));
            }
        }
    }

    fn free_block(&mut self, segment: u64, off: u64, len: u64) {
        // A block of a segment unmounted meanwhile went with it.
        if let Some(s) = self.segments.get_mut(&segment) {
            s.alloc.free(off, len);
            self.used -= aligned(len).expect("allocated");
        }
    }

    // ---------------------------------------------------------------- time

    /// Periodic work: returns held space whose time came, drops silent clients, takes
    /// away puts unfinished after `put_discard_ms`, evicts at the high watermark.
    pub fn tick(&mut self, now: Millis) -> TickReport {
        let mut rep = TickReport::default();
        while let Some(&Reverse((at, s, off, len))) = self.held.peek() {
            if at > now {
                break;
            }
            self.held.pop();
            self.free_block(s, off, len);
            rep.released += 1;
        }
        let ttl = self.cfg.client_ttl_ms;
        let silent: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| now.saturating_sub(c.last_seen) > ttl)
            .map(|(&id, _)| id)
            .collect();
        rep.clients_expired = silent.len();
        let before = self.reclaimed;
        for id in silent {
            tracing::warn!(
                client = format_args!("{id:#x}"),
                "store client silent for {ttl} ms: dropped, segments unmounted"
            );
            self.drop_client(now, id);
        }
        let cutoff = now.saturating_sub(self.cfg.put_discard_ms);
        while let Some((&(started, _), _)) = self.pending.first_key_value() {
            if started >= cutoff || now < self.cfg.put_discard_ms {
                break;
            }
            let (_, k) = self.pending.pop_first().expect("peeked");
            tracing::warn!(key = %String::from_utf8_lossy(&k), "put unfinished after {} ms: reclaimed", self.cfg.put_discard_ms);
            self.take_away(now, &k);
        }
        rep.puts_reclaimed = (self.reclaimed - before) as usize;
        let lapsed: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| s.awaiting.is_some_and(|until| until <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in lapsed {
            tracing::warn!(
                segment = id,
                "store segment not remounted within the client TTL after a failover: unmounted"
            );
            self.unmount_segment(now, id);
        }
        if now.saturating_sub(self.pruned_at) >= PRUNE_EVERY_MS {
            self.prune_evidence(now);
        }
        rep.evicted = self.watermark(now);
        rep
    }

    /// Forgets segments named to clients, and reports, that can no longer count.
    fn prune_evidence(&mut self, now: Millis) {
        self.pruned_at = now;
        let window = self.named_window();
        let ttl = self.cfg.client_ttl_ms;
        let segments = &self.segments;
        for c in self.clients.values_mut() {
            c.named
                .retain(|id, at| segments.contains_key(id) && now.saturating_sub(*at) <= window);
        }
        for s in self.segments.values_mut() {
            s.reports.retain(|r| now.saturating_sub(r.1) <= ttl);
        }
    }

    /// Evicts when usage is at the high watermark; returns how many objects went.
    fn watermark(&mut self, now: Millis) -> usize {
        if self.capacity == 0 || (self.used as f64) < self.cfg.high_watermark * self.capacity as f64
        {
            return 0;
        }
        let target = (self.cfg.evict_ratio * self.capacity as f64) as u64;
        let over = self
            .used
            .saturating_sub((self.cfg.high_watermark * self.capacity as f64) as u64);
        self.evict(now, target.max(over), |_| true)
    }

    /// Frees space for one object of `size` (`wanted` replicas): evicts least recently
    /// used objects until a placement would succeed, at least `evict_ratio` of capacity.
    fn evict_until_fits(&mut self, now: Millis, size: u64, wanted: usize) {
        let need = aligned(size).expect("checked");
        if self.segments.values().all(|s| s.awaiting.is_some()) {
            // Only segments awaiting their owners after a failover: no eviction can make
            // room that a put may use.
            return;
        }
        let target = ((self.cfg.evict_ratio * self.capacity as f64) as u64)
            .max(need.saturating_mul(wanted as u64));
        self.evict(now, target, |core| {
            core.segments.values().any(|s| core.placeable(now, s, need))
        });
    }

    /// Evicts in LRU order (unpinned first, then soft-pinned; never leased, pending or
    /// hard-pinned) until `target` bytes are freed or `enough` says so. Returns the count.
    fn evict(&mut self, now: Millis, target: u64, enough: impl Fn(&Self) -> bool) -> usize {
        let mut cands: Vec<(bool, Millis, Key)> = self
            .objects
            .iter()
            .filter(|(_, o)| {
                o.state == State::Complete && o.lease_until <= now && o.pin != Pin::Hard
            })
            .map(|(k, o)| {
                let soft = o.pin == Pin::Soft && o.soft_until > now;
                (soft, o.last_access, k.clone())
            })
            .collect();
        cands.sort_unstable_by_key(|a| (a.0, a.1));
        let mut freed = 0u64;
        let mut n = 0;
        for (_, _, k) in cands {
            if freed >= target && enough(self) {
                break;
            }
            let o = self.remove_object(&k).expect("candidate");
            self.emit(|| Record::Remove { key: k.to_vec() });
            for &(s, off) in &o.replicas {
                self.free_block(s, off, o.size);
                freed += aligned(o.size).expect("allocated");
            }
            n += 1;
        }
        self.evicted += n as u64;
        if n > 0 {
            tracing::debug!(evicted = n, freed, "store eviction");
        }
        n
    }

    // ---------------------------------------------------------------- op-log

    /// Starts or stops recording changes in the op-log outbox ([`MasterCore::take_log`]).
    pub fn set_logging(&mut self, on: bool) {
        self.log = on.then(Vec::new);
    }

    /// The records of the changes since the last call (none when not logging).
    pub fn take_log(&mut self) -> Vec<Record> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn emit(&mut self, r: impl FnOnce() -> Record) {
        if let Some(log) = &mut self.log {
            log.push(r());
        }
    }

    /// The whole metadata others must know, as records: a `Mount` per segment, then a
    /// `Publish` per complete object. Applied to an empty core, it rebuilds this one.
    pub fn snapshot(&self) -> Vec<Record> {
        let mut out = Vec::with_capacity(self.segments.len() + self.objects.len());
        for (&id, s) in &self.segments {
            out.push(s.record(id));
        }
        for (k, o) in &self.objects {
            if o.state == State::Complete {
                out.push(o.record(k));
            }
        }
        out
    }

    /// A standby applies the leader's records, in order. Segments it learns of await
    /// their owners ([`MasterCore::promote`]); each published replica takes exactly its
    /// block of its segment. Returns how many records did not fit the state (a replica
    /// on an unknown segment or on space taken, a mount of a known id): skipped, and
    /// counted so that the caller can say so.
    pub fn apply(&mut self, now: Millis, records: &[Record]) -> usize {
        let mut misfits = 0;
        for r in records {
            if !self.apply_one(now, r) {
                misfits += 1;
            }
        }
        misfits
    }

    fn apply_one(&mut self, now: Millis, r: &Record) -> bool {
        match r {
            Record::Mount {
                segment,
                endpoint,
                base,
                size,
                rkey,
                owner,
            } => {
                let alloc = Allocator::new(*size);
                let capacity = self.capacity.checked_add(alloc.size());
                if self.segments.contains_key(segment)
                    || *segment == 0
                    || alloc.size() == 0
                    || base.checked_add(alloc.size()).is_none()
                    || capacity.is_none()
                {
                    return false;
                }
                self.capacity = capacity.expect("checked");
                self.next_segment = self.next_segment.max(segment.saturating_add(1));
                self.segments.insert(
                    *segment,
                    Segment {
                        endpoint: endpoint.as_str().into(),
                        base: *base,
                        alloc,
                        rkey: *rkey,
                        owner: *owner,
                        closed: false,
                        reports: Vec::new(),
                        awaiting: Some(Millis::MAX),
                    },
                );
                true
            }
            Record::Remount { segment, rkey } => match self.segments.get_mut(segment) {
                Some(s) => {
                    s.rkey = *rkey;
                    true
                }
                None => false,
            },
            Record::Unmount { segment } => {
                let known = self.segments.contains_key(segment);
                self.unmount_segment(now, *segment);
                known
            }
            Record::Publish {
                key,
                size,
                pin,
                replicas,
            } => {
                if key.is_empty() || *size == 0 || aligned(*size).is_none() {
                    return false;
                }
                let mut fits = true;
                if self.objects.contains_key(&**key) {
                    fits = false;
                    self.drop_now(key);
                }
                let mut placed = Vec::with_capacity(replicas.len());
                for &(s, off) in replicas {
                    let taken = !placed.iter().any(|&(p, _)| p == s)
                        && self
                            .segments
                            .get_mut(&s)
                            .is_some_and(|seg| seg.alloc.take(off, *size));
                    if taken {
                        self.used += aligned(*size).expect("checked");
                        placed.push((s, off));
                    } else {
                        fits = false;
                    }
                }
                if placed.is_empty() {
                    return false;
                }
                self.objects.insert(
                    key.as_slice().into(),
                    Object {
                        size: *size,
                        replicas: placed,
                        state: State::Complete,
                        lease_until: 0,
                        last_access: self.uses.next(),
                        pin: *pin,
                        soft_until: if *pin == Pin::Soft {
                            now.saturating_add(self.cfg.soft_pin_ttl_ms)
                        } else {
                            0
                        },
                    },
                );
                fits
            }
            Record::Remove { key } => self.drop_now(key),
        }
    }

    /// Removes an object and frees its blocks at once (a standby: nobody reads through
    /// it, and after a failover the old leader's readers are fenced by the new rkeys).
    fn drop_now(&mut self, key: &[u8]) -> bool {
        match self.remove_object(key) {
            Some(o) => {
                for &(s, off) in &o.replicas {
                    self.free_block(s, off, o.size);
                }
                true
            }
            None => false,
        }
    }

    /// A standby becomes the leader: segments known from the op-log await their owners
    /// for one client TTL from `now` (then they are unmounted, and objects without a
    /// replica elsewhere go), and changes are logged from now on.
    pub fn promote(&mut self, now: Millis) {
        let until = now.saturating_add(self.cfg.client_ttl_ms);
        for s in self.segments.values_mut() {
            if s.awaiting.is_some() {
                s.awaiting = Some(until);
            }
        }
        self.set_logging(true);
    }

    // ---------------------------------------------------------------- stats

    /// Counts for `pagewire store` and tests.
    pub fn stats(&self) -> Stats {
        let pending = self.pending.len() as u64;
        Stats {
            clients: self.clients.len() as u64,
            segments: self.segments.len() as u64,
            objects: self.objects.len() as u64 - pending,
            pending,
            capacity: self.capacity,
            used: self.used,
            evicted: self.evicted,
            reclaimed: self.reclaimed,
        }
    }

    /// Checks the bookkeeping against a recount (tests).
    #[cfg(test)]
    fn check(&self) {
        let cap: u64 = self.segments.values().map(|s| s.alloc.size()).sum();
        let used: u64 = self.segments.values().map(|s| s.alloc.used()).sum();
        assert_eq!(cap, self.capacity);
        assert_eq!(used, self.used);
        let live: u64 = self
            .objects
            .values()
            .flat_map(|o| o.replicas.iter().map(|_| aligned(o.size).unwrap()))
            .sum();
        let held: u64 = self
            .held
            .iter()
            .filter(|Reverse((_, s, ..))| self.segments.contains_key(s))
            .map(|Reverse((_, _, _, len))| aligned(*len).unwrap())
            .sum();
        assert_eq!(live + held, used, "objects + held space = allocated");
        for o in self.objects.values() {
            let mut segs: Vec<u64> = o.replicas.iter().map(|r| r.0).collect();
            segs.sort();
            segs.dedup();
            assert_eq!(
                segs.len(),
                o.replicas.len(),
                "replicas on distinct segments"
            );
        }
        assert_eq!(
            self.pending.len(),
            self.objects
                .values()
                .filter(|o| o.state != State::Complete)
                .count()
        );
    }
}

#[cfg(test)]
mod tests;
