//! The store client: puts and gets of objects straight between the caller's registered
//! memory and the segments of storage nodes, with the master consulted once per batch.
//!
//! * **Put** = `PutStart` on the master (it reserves every replica), then every replica of
//!   every object written with one pagewire batch per storage node, all in flight at once
//!   (a replica in a segment of this process is copied with `memcpy` instead), then one
//!   `PutFinish` that publishes what was written and revokes the rest. After a failed
//!   transfer the connection to that node is closed before the revoke goes out, so no byte
//!   of the failed put can land later; the master reuses revoked space only after a grace
//!   period on top.
//! * **Get** = `Get` with a read lease on the master, then one READ batch per storage node
//!   straight into the caller's memory. A replica that fails is retried on the next one.
//!   A read that ends after its lease is reported as `LeaseExpired`: the space might have
//!   been reused.
//! * Every call has one deadline (`ClientConfig::timeout`). A put's writes also end by the
//!   time the master would take the put away (`put_discard_ms` in its `Welcome`), which
//!   is long before it reuses the space.
//! * Sessions are fenced by the data path: the master names each segment with the remote
//!   key it was mounted under, and a transfer goes to a node only while the node's
//!   description carries that key (a stale description is fetched again, once). A node
//!   registers its segment anew before it mounts it in a new session, so a put or get of
//!   an earlier session fails at the NIC or the engine's key check instead of landing in
//!   space handed out again.
//! * A storage node is a client that contributes a segment (`segment_size > 0`).

use std::collections::HashMap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use pagewire_transport::{
    Batch, Engine, EngineConfig, Error as TError, Fault, Op, PeerId, RemoteRegion, TransferHandle,
    TransferOp,
};

use crate::error::{Code, Result, StoreError};
use crate::local::{self, Buffers, SegmentMem, Span};
use crate::proto::{self, Found, Pin, Placement, Request, Response, SegmentRef, Stats};
use crate::rpc::{MasterLink, SegmentSpec};

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The master's `host:port`; with [`ClientConfig::locator`], what the locator reads
    /// (`etcd://h:p;h:p`), for messages.
    pub master: String,
    /// Finds the leader among elected masters (`pagewire_ha::EtcdLocator` for
    /// `etcd://` addresses); none: `master` is the one master.
    pub locator: Option<Arc<dyn crate::rpc::MasterLocator>>,
    /// A sharded cluster (`pagewire_ha::client_config` fills it from etcd): one locator
    /// per shard's leader group, in shard order. With two or more, the client holds one
    /// master link per shard and routes every key to its shard ([`crate::shard`]);
    /// `locator` is then unused. Empty (or one): one master, as `locator` says.
    pub shards: Vec<Arc<dyn crate::rpc::MasterLocator>>,
    /// The transport engine's settings (backend, listen address, device). Its listen
    /// address is what storage nodes and other clients connect to; with an unspecified IP
    /// (`0.0.0.0`) the client announces the IP it reaches the master from.
    pub engine: EngineConfig,
    /// Bytes of this client's memory offered to the store (0: a pure client).
    pub segment_size: u64,
    /// Shared secret (none: no token). One token guards everything the client opens: the
    /// master link, the transport engine, and so the segment registered on it. It may be
    /// set here, in `engine.token` (`PAGEWIRE_TOKEN` through [`EngineConfig`]'s
    /// environment overrides), or in both alike: [`StoreClient::connect`] gives the one
    /// that is set to the other, and refuses two different ones (`StoreError::Config`).
    /// [`StoreClient::with_engine`] refuses an engine whose token is not this one, a
    /// missing one included (`StoreError::InvalidArgument`): its segment would be open to
    /// peers without the token. A peer engine whose token differs is refused by the
    /// transport (`HandshakeError::TokenMismatch` on its side).
    pub token: Option<String>,
    /// Deadline of each call (put, get, ...), set-up included (default 30 s).
    pub timeout: Duration,
    /// Deadline for reaching the master at set-up (default 10 s).
    pub connect_timeout: Duration,
    /// Copy replicas held in this process with `memcpy` (default true).
    pub local_copy: bool,
}

impl ClientConfig {
    /// The client's one token, from `token` and `engine_token`, whichever is set; two
    /// different ones are refused, naming neither (they are secrets).
    fn one_token(&self, engine_token: Option<&str>) -> Result<Option<String>> {
        match (self.token.as_deref(), engine_token) {
            (Some(s), Some(e)) if s != e => Err(StoreError::Config {
                key: "token".into(),
                value: "(not shown)".into(),
                reason: "the store's token and the engine's (PAGEWIRE_TOKEN) differ: \
                         one token guards the master, the engine and the segment"
                    .into(),
            }),
            (s, e) => Ok(s.or(e).map(str::to_string)),
        }
    }

    /// Defaults around a master address: engine from [`EngineConfig::default`], no
    /// segment, 30 s per call.
    pub fn new(master: impl Into<String>) -> Self {
        ClientConfig {
            master: master.into(),
            locator: None,
            shards: Vec::new(),
            engine: EngineConfig::default(),
            segment_size: 0,
            token: None,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            local_copy: true,
        }
    }
}

/// How a put places its objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Replicas per object (on distinct segments; fewer when fewer segments have room).
    pub replicas: u8,
    /// Eviction protection.
    pub pin: Pin,
    /// Endpoint whose segment should take the first replica.
    pub preferred: Option<String>,
}

impl Default for PutOptions {
    fn default() -> Self {
        PutOptions {
            replicas: 1,
            pin: Pin::None,
            preferred: None,
        }
    }
}

/// Where one replica of an object lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Segment id.
    pub segment: u64,
    /// The storage node's endpoint.
    pub endpoint: Arc<str>,
    /// Address in the node's memory.
    pub addr: u64,
    /// Start of the segment in the node's memory.
    pub base: u64,
    /// The remote key the segment was mounted under (its session).
    pub rkey: u32,
}

/// A complete object as the master describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// Bytes.
    pub size: u64,
    /// Replicas, the ones to try first first.
    pub replicas: Vec<Target>,
}

struct Inner {
    cfg: ClientConfig,
    engine: Engine,
    owns_engine: bool,
    /// One master link per shard (one for an unsharded store).
    links: Vec<Arc<MasterLink>>,
    endpoint: String,
    /// The client's segment, carved into one part per shard (empty: no segment).
    segments: Vec<Arc<SegmentMem>>,
    buffers: Buffers,
    peers: Mutex<HashMap<Arc<str>, PeerId>>,
    /// Read-held from checking a node's description against the segment keys until the
    /// batch is submitted; write-held to fetch a description again. So a batch never goes
    /// out under keys newer than the ones it was checked against.
    describing: RwLock<()>,
    /// One per heartbeat thread (a thread per shard); dropped to stop them.
    stop: Mutex<Vec<mpsc::Sender<()>>>,
}

/// A client of the store (cheap to clone). Dropping the last clone leaves the store
/// (as [`StoreClient::close`]).
#[derive(Clone)]
pub struct StoreClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("master", &self.inner.cfg.master)
            .field("endpoint", &self.inner.endpoint)
            .field("shards", &self.inner.links.len())
            .field(
                "segment",
                &self.inner.segments.iter().map(|s| s.size()).sum::<u64>(),
            )
            .finish()
    }
}

fn deadline_of(d: Duration) -> Instant {
    Instant::now() + d
}

/// Groups of indices whose keys fit one request frame comfortably.
fn chunks(lens: impl Iterator<Item = usize>) -> Vec<std::ops::Range<usize>> {
    const BYTES: usize = 4 << 20;
    const ITEMS: usize = 8192;
    let mut out = Vec::new();
    let (mut start, mut i, mut bytes) = (0, 0, 0);
    for len in lens {
        if i > start && (bytes + len + 16 > BYTES || i - start >= ITEMS) {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += len + 16;
        i += 1;
    }
    if i > start {
        out.push(start..i);
    }
    out
}

/// Copies of the keys at `idx` (one shard's share of a batch, sent from another thread).
fn pick_keys<K: AsRef<[u8]>>(keys: &[K], idx: &[usize]) -> Vec<Vec<u8>> {
    idx.iter().map(|&i| keys[i].as_ref().to_vec()).collect()
}

/// Copies of the part lists at `idx`.
fn pick_parts<P: AsRef<[Span]>>(parts: &[P], idx: &[usize]) -> Vec<Vec<Span>> {
    idx.iter().map(|&i| parts[i].as_ref().to_vec()).collect()
}

fn valid_key(k: &[u8]) -> bool {
    !k.is_empty() && k.len() <= proto::MAX_KEY_LEN
}

fn total(parts: &[Span]) -> Option<u64> {
    parts.iter().try_fold(0u64, |a, s| a.checked_add(s.len))
}

/// One storage node's share of a transfer: its ops and the items they serve.
struct Work {
    endpoint: Arc<str>,
    ops: Vec<TransferOp>,
    /// `(item index, segment)` per replica served.
    items: Vec<(usize, u64)>,
    /// `(base, rkey)` of each segment the ops reach: the sessions they belong to.
    fences: Vec<(u64, u32)>,
}

impl Work {
    fn new(endpoint: &Arc<str>) -> Work {
        Work {
            endpoint: endpoint.clone(),
            ops: Vec::new(),
            items: Vec::new(),
            fences: Vec::new(),
        }
    }

    /// Records that item `i` is served from `t`.
    fn serve(&mut self, i: usize, t: &Target) {
        self.items.push((i, t.segment));
        if !self.fences.contains(&(t.base, t.rkey)) {
            self.fences.push((t.base, t.rkey));
        }
    }
}

/// Why a node's share of a transfer did not go out.
enum Refused {
    /// The transfer belongs to an earlier session of a segment (the node registered it
    /// anew since): not the node's fault, and it must not be retried.
    Stale,
    /// Connecting, describing or submitting failed.
    Failed(StoreError),
}

impl<E: Into<StoreError>> From<E> for Refused {
    fn from(e: E) -> Self {
        Refused::Failed(e.into())
    }
}

impl StoreClient {
    /// Opens a transport engine from `cfg.engine` and joins the store. The engine and
    /// the master link get the one token of `cfg` (see [`ClientConfig::token`]).
    pub fn connect(mut cfg: ClientConfig) -> Result<StoreClient> {
        let token = cfg.one_token(cfg.engine.token.as_deref())?;
        cfg.engine.token.clone_from(&token);
        cfg.token = token;
        let engine = Engine::new(cfg.engine.clone())?;
        Self::build(engine, true, cfg)
    }

    /// Joins the store with an engine the caller already has (shared with other uses).
    /// With `cfg.token` set the engine must have been opened with that token; without
    /// it, the engine's token (if any) is the master's too.
    pub fn with_engine(engine: Engine, mut cfg: ClientConfig) -> Result<StoreClient> {
        let theirs = engine.config().token.as_deref();
        if cfg.token.is_some() && cfg.token.as_deref() != theirs {
            // Refused before anything is registered: the segment would otherwise be open
            // to peers that lack the store's token.
            return Err(StoreError::invalid(
                "the engine was opened without the store's token (or with another one): \
                 open it with the same token (EngineConfig::token, PAGEWIRE_TOKEN)",
            ));
        }
        cfg.token = theirs.map(str::to_string);
        Self::build(engine, false, cfg)
    }

    fn build(engine: Engine, owns_engine: bool, cfg: ClientConfig) -> Result<StoreClient> {
        let fail = |e: StoreError| {
            if owns_engine {
                engine.shutdown();
            }
            e
        };
        // One locator per master link: a shard's leader group each, or the one master.
        let locators: Vec<Option<Arc<dyn crate::rpc::MasterLocator>>> = if cfg.shards.len() > 1 {
            cfg.shards.iter().cloned().map(Some).collect()
        } else {
            vec![cfg.shards.first().cloned().or_else(|| cfg.locator.clone())]
        };
        if locators.len() > crate::shard::MAX_SHARDS {
            return Err(fail(StoreError::invalid(format!(
                "{} shards: at most {}",
                locators.len(),
                crate::shard::MAX_SHARDS
            ))));
        }
        if locators[0].is_none() && cfg.master.starts_with("etcd://") {
            return Err(fail(StoreError::Config {
                key: "master".into(),
                value: cfg.master.clone(),
                reason: "an etcd:// address needs a locator (pagewire_ha::EtcdLocator)".into(),
            }));
        }
        let set_up_by = deadline_of(cfg.connect_timeout.min(cfg.timeout));
        let mut endpoint_addr = engine.local_addr();
        let probe = MasterLink::new(&cfg.master, locators[0].clone(), Vec::new(), None);
        if endpoint_addr.ip().is_unspecified() {
            // Announce the address this host reaches the master from.
            let s = probe.dial(set_up_by).map_err(fail)?;
            let ip = s
                .local_addr()
                .map_err(|e| fail(StoreError::io("local address", e)))?
                .ip();
            endpoint_addr.set_ip(ip);
        }
        let endpoint = endpoint_addr.to_string();
        let deregister = |segments: &[Arc<SegmentMem>]| {
            for r in segments.iter().filter_map(|s| s.region()) {
                let _ = engine.deregister(r);
            }
        };
        // A segment is carved into one part per shard, each registered on its own so
        // that a remount on one shard renews only its part's key.
        let mut segments = Vec::new();
        if cfg.segment_size > 0 {
            let sizes = crate::shard::carve(cfg.segment_size, locators.len()).map_err(fail)?;
            for size in sizes {
                match SegmentMem::new(&engine, size, &endpoint) {
                    Ok(s) => segments.push(s),
                    Err(e) => {
                        deregister(&segments);
                        return Err(fail(e));
                    }
                }
            }
        }
        let token = cfg.token.clone().unwrap_or_default().into_bytes();
        let mut links = Vec::with_capacity(locators.len());
        for (i, loc) in locators.into_iter().enumerate() {
            let spec = segments.get(i).map(|s| SegmentSpec {
                mem: s.clone(),
                engine: engine.clone(),
            });
            let link = MasterLink::new(&cfg.master, loc, token.clone(), spec);
            link.set_endpoint(endpoint.clone());
            link.watch().map_err(fail)?;
            links.push(link);
        }
        // Every shard's leader is needed at set-up (a node mounts a part on each).
        let sessions = crate::shard::concurrently(
            links.iter().map(|l| move || l.session(set_up_by)).collect(),
        );
        if let Some(Err(e)) = sessions.into_iter().find(Result::is_err) {
            // Shards that mounted a part unmount it now rather than after the client TTL.
            crate::shard::concurrently(links.iter().map(|l| move || l.bye()).collect());
            deregister(&segments);
            return Err(fail(e));
        }
        let inner = Arc::new(Inner {
            cfg,
            engine,
            owns_engine,
            links,
            endpoint,
            segments,
            buffers: Buffers::default(),
            peers: Mutex::new(HashMap::new()),
            describing: RwLock::new(()),
            stop: Mutex::new(Vec::new()),
        });
        for shard in 0..inner.links.len() {
            let (tx, rx) = mpsc::channel();
            let weak = Arc::downgrade(&inner);
            let period = inner.links[shard]
                .welcome()
                .map_or(1000, |w| w.heartbeat_ms as u64);
            // Held before the spawn: a failure drops `inner`, which then leaves the store.
            inner
                .stop
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(tx);
            std::thread::Builder::new()
                .name("pagewire-store-hb".into())
                .spawn(move || heartbeat(weak, shard, rx, Duration::from_millis(period)))
                .map_err(|e| StoreError::io("spawn heartbeat thread", e))?;
        }
        Ok(StoreClient { inner })
    }

    /// Shards of the store (1 unless the cluster is sharded).
    pub fn shards(&self) -> usize {
        self.inner.links.len()
    }

    /// The shard that owns `key` ([`crate::shard::shard_of`]).
    pub fn shard_of(&self, key: &[u8]) -> usize {
        crate::shard::shard_of(key, self.inner.links.len())
    }

    fn link(&self, shard: usize) -> &MasterLink {
        &self.inner.links[shard]
    }

    /// The transport engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The endpoint announced to the master (`host:port`).
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// The master's address.
    pub fn master(&self) -> &str {
        &self.inner.cfg.master
    }

    /// The one token of this client (master link, engine, segment), if any.
    pub(crate) fn token(&self) -> Option<&str> {
        self.inner.cfg.token.as_deref()
    }

    /// `(base, size)` of this client's segment, if it contributes one (in a sharded
    /// store, the part mounted on shard 0; [`StoreClient::segments`] lists them all).
    pub fn segment(&self) -> Option<(u64, u64)> {
        self.inner.segments.first().map(|s| (s.base(), s.size()))
    }

    /// `(base, size)` of each part of this client's segment, part `i` mounted on shard `i`.
    pub fn segments(&self) -> Vec<(u64, u64)> {
        self.inner
            .segments
            .iter()
            .map(|s| (s.base(), s.size()))
            .collect()
    }

    /// The segment id the master gave this client's segment (connecting if needed); in a
    /// sharded store, shard 0's id of part 0.
    pub fn segment_id(&self) -> Result<Option<u64>> {
        Ok(self
            .link(0)
            .session(deadline_of(self.inner.cfg.timeout))?
            .segment)
    }

    /// The read-lease length the master grants (shard 0's, in a sharded store).
    pub fn lease_ttl(&self) -> Option<Duration> {
        self.link(0)
            .welcome()
            .map(|w| Duration::from_millis(w.lease_ttl_ms as u64))
    }

    // ---------------------------------------------------------------- buffers

    /// Registers `[ptr, ptr+len)` as memory puts read from and gets write to.
    ///
    /// # Safety
    /// The range must be valid memory that stays allocated until
    /// [`unregister_buffer`](Self::unregister_buffer) returned for it (or the client is
    /// closed), and must not be freed or remapped meanwhile.
    pub unsafe fn register_buffer(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            self.inner
                .buffers
                .insert(&self.inner.engine, ptr as u64, len as u64)
        }
    }

    /// Deregisters the buffer starting at `ptr`, waiting for transfers that use it.
    pub fn unregister_buffer(&self, ptr: *mut u8) -> Result<()> {
        self.inner.buffers.remove(
            &self.inner.engine,
            ptr as u64,
            deadline_of(self.inner.cfg.timeout),
        )
    }

    // ---------------------------------------------------------------- puts

    /// Stores each `keys[i]` as the concatenation of `parts[i]` (registered memory).
    /// Per key: `Ok`, or `AlreadyExists` (the first write stays), `NoSpace`,
    /// `InvalidParams` (empty, unregistered), `InvalidKey`, `TransferFailed`, ...
    pub fn put<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        keys: &[K],
        parts: &[P],
        opts: &PutOptions,
    ) -> Result<Vec<Result<(), Code>>> {
        if keys.len() != parts.len() {
            return Err(StoreError::invalid(format!(
                "{} keys but {} part lists",
                keys.len(),
                parts.len()
            )));
        }
        let deadline = deadline_of(self.inner.cfg.timeout);
        if self.shards() == 1 {
            return self.put_on(0, keys, parts, opts, deadline);
        }
        self.routed(
            keys,
            |shard, idx| {
                let (k, p) = (pick_keys(keys, idx), pick_parts(parts, idx));
                move || self.put_on(shard, &k, &p, opts, deadline)
            },
            Err,
        )
    }

    /// [`StoreClient::put`] of keys of one shard.
    fn put_on<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        shard: usize,
        keys: &[K],
        parts: &[P],
        opts: &PutOptions,
        deadline: Instant,
    ) -> Result<Vec<Result<(), Code>>> {
        let sizes: Vec<u64> = parts
            .iter()
            .map(|p| match total(p.as_ref()) {
                Some(t) if t > 0 && self.inner.buffers.covers(p.as_ref()) => t,
                _ => 0, // refused per key below
            })
            .collect();
        let res = self.reserve_on(shard, keys, &sizes, opts, deadline)?;
        res.write(parts)
    }

    /// Runs a per-shard batch call on each shard's share of `keys`, all shards at once
    /// under the caller's one deadline, and puts the answers back in the caller's order.
    /// `job(shard, indices)` prepares a share on this thread (copying its keys) and
    /// returns the call to run. A shard whose call fails gives each of its keys
    /// `failed(code)` (the error's code: `Timeout`, `MasterUnavailable`, ...), and the
    /// other shards' keys keep their answers; the call itself fails only when every
    /// shard it involved failed (with the first one's error).
    fn routed<K, T, J>(
        &self,
        keys: &[K],
        mut job: impl FnMut(usize, &[usize]) -> J,
        failed: impl Fn(Code) -> T,
    ) -> Result<Vec<T>>
    where
        K: AsRef<[u8]>,
        T: Send,
        J: FnOnce() -> Result<Vec<T>> + Send,
    {
        let groups = crate::shard::split(keys, self.shards());
        let jobs: Vec<J> = groups.iter().map(|(s, idx)| job(*s, idx)).collect();
        let results = crate::shard::concurrently(jobs);
        crate::shard::merge_results(keys.len(), &groups, results, failed)
    }

    /// Runs `job(shard)` on every shard at once; the answers in shard order, or the
    /// first shard's error.
    fn on_all<T: Send>(&self, job: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
        let job = &job;
        let jobs: Vec<_> = (0..self.shards()).map(|s| move || job(s)).collect();
        crate::shard::concurrently(jobs).into_iter().collect()
    }

    /// First half of a put: reserves space for `keys[i]` of `sizes[i]` bytes. Size 0 is
    /// refused per key (`InvalidParams`). Finish with [`Reservation::write`]; dropping the
    /// reservation revokes it. In a sharded store the keys must belong to one shard
    /// ([`StoreClient::shard_of`]); others are `InvalidArgument`.
    pub fn reserve<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        sizes: &[u64],
        opts: &PutOptions,
    ) -> Result<Reservation<'_>> {
        if keys.len() != sizes.len() {
            return Err(StoreError::invalid(format!(
                "{} keys but {} sizes",
                keys.len(),
                sizes.len()
            )));
        }
        let mut owners = keys
            .iter()
            .filter(|k| valid_key(k.as_ref()))
            .map(|k| self.shard_of(k.as_ref()));
        let shard = owners.next().unwrap_or(0);
        if owners.any(|s| s != shard) {
            return Err(StoreError::invalid(
                "a reservation holds keys of one shard (StoreClient::shard_of); \
                 put splits a batch by shard itself",
            ));
        }
        self.reserve_on(
            shard,
            keys,
            sizes,
            opts,
            deadline_of(self.inner.cfg.timeout),
        )
    }

    /// [`StoreClient::reserve`] of keys of one shard.
    fn reserve_on<K: AsRef<[u8]>>(
        &self,
        shard: usize,
        keys: &[K],
        sizes: &[u64],
        opts: &PutOptions,
        deadline: Instant,
    ) -> Result<Reservation<'_>> {
        // No later than the master's own start of the put (it answers after this).
        let started = Instant::now();
        let mut session = None;
        let mut items: Vec<Result<Vec<Target>, Code>> = keys
            .iter()
            .zip(sizes)
            .map(|(k, &s)| {
                if !valid_key(k.as_ref()) {
                    Err(Code::InvalidKey)
                } else if s == 0 {
                    Err(Code::InvalidParams)
                } else {
                    // Until the master answers for it (never revoked unless reserved).
                    Err(Code::MasterUnavailable)
                }
            })
            .collect();
        let todo: Vec<usize> = (0..keys.len())
            .filter(|&i| items[i] == Err(Code::MasterUnavailable))
            .collect();
        for range in chunks(todo.iter().map(|&i| keys[i].as_ref().len())) {
            let idx = &todo[range];
            let req = Request::PutStart(proto::PutStart {
                replicas: opts.replicas.clamp(1, proto::MAX_REPLICAS as u8),
                pin: opts.pin,
                preferred: opts.preferred.clone().unwrap_or_default(),
                items: idx
                    .iter()
                    .map(|&i| (keys[i].as_ref().to_vec(), sizes[i]))
                    .collect(),
            });
            let placement = match self.link(shard).call(&req, deadline) {
                Ok(Response::Placed(p)) if p.items.len() == idx.len() => p,
                Ok(other) => {
                    // Revoke what earlier chunks reserved, then fail the call.
                    let r = Reservation::new(
                        self, shard, keys, sizes, items, session, started, deadline,
                    );
                    drop(r);
                    return Err(self.bad_reply(other));
                }
                Err(e) => {
                    drop(Reservation::new(
                        self, shard, keys, sizes, items, session, started, deadline,
                    ));
                    return Err(e);
                }
            };
            let now = self.link(shard).current();
            if session.is_some_and(|s| s != now) {
                // The master changed between chunks: what earlier ones reserved is gone.
                for it in items.iter_mut().filter(|it| it.is_ok()) {
                    *it = Err(Code::TransferFailed);
                }
            }
            session = Some(now);
            let Placement {
                segments,
                items: placed,
            } = placement;
            for (&i, item) in idx.iter().zip(placed) {
                items[i] = item.map(|reps| {
                    reps.into_iter()
                        .map(|r| target(&segments, r.segment, r.addr))
                        .collect()
                });
            }
        }
        Ok(Reservation::new(
            self, shard, keys, sizes, items, session, started, deadline,
        ))
    }

    fn bad_reply(&self, r: Response) -> StoreError {
        match r {
            Response::Error { code, message } => StoreError::Rejected { code, message },
            other => StoreError::Protocol {
                from: self.link(0).addr().to_string(),
                source: proto::ProtoError::UnknownKind(other.kind()),
            },
        }
    }

    /// The peer for a storage node's endpoint (connecting, or reconnecting a broken one).
    fn peer(&self, ep: &Arc<str>) -> Result<PeerId> {
        let engine = &self.inner.engine;
        {
            let mut peers = self.inner.peers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(&p) = peers.get(ep) {
                if engine.peer_alive(p).unwrap_or(false) {
                    return Ok(p);
                }
                peers.remove(ep);
                let _ = engine.disconnect(p);
            }
        }
        let p = engine.connect(&**ep)?;
        let mut peers = self.inner.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&other) = peers.get(ep) {
            let _ = engine.disconnect(p);
            return Ok(other);
        }
        peers.insert(ep.clone(), p);
        Ok(p)
    }

    /// Drops the connection to a node after a failure (stopping whatever is in flight).
    fn forget_peer(&self, ep: &str) {
        let p = self
            .inner
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(ep);
        if let Some(p) = p {
            let _ = self.inner.engine.disconnect(p);
        }
    }

    /// Runs every node's work as one batch each, all in flight together; returns the
    /// items that failed and the segments involved in failures.
    fn run(&self, op: Op, work: Vec<Work>, deadline: Instant) -> (Vec<usize>, Vec<u64>) {
        let mut failed = Vec::new();
        let mut suspects = Vec::new();
        let mut handles = Vec::with_capacity(work.len());
        for w in work {
            match self.submit_fenced(&w, deadline) {
                Ok(h) => handles.push((h, w)),
                Err(Refused::Stale) => {
                    tracing::warn!(
                        endpoint = %w.endpoint,
                        "store: {op:?} not sent: it was placed in an earlier session of the node's segment (the node registered it anew since)"
                    );
                    failed.extend(w.items.iter().map(|x| x.0));
                }
                Err(Refused::Failed(e)) => {
                    tracing::warn!(endpoint = %w.endpoint, "store: {op:?} to storage node failed: {e}");
                    self.forget_peer(&w.endpoint);
                    failed.extend(w.items.iter().map(|x| x.0));
                    if implicates_node(&e) {
                        suspects.extend(w.items.iter().map(|x| x.1));
                    }
                }
            }
        }
        for (h, w) in handles {
            if let Err(e) = h.wait(deadline) {
                tracing::warn!(endpoint = %w.endpoint, "store: {op:?} batch to storage node failed: {e}");
                h.cancel();
                self.forget_peer(&w.endpoint);
                failed.extend(w.items.iter().map(|x| x.0));
                if implicates_node(&StoreError::Transport(e)) {
                    suspects.extend(w.items.iter().map(|x| x.1));
                }
            }
        }
        suspects.sort_unstable();
        suspects.dedup();
        (failed, suspects)
    }

    /// Submits one node's share, after checking that the node's description carries the
    /// key of every segment session the ops belong to (fetching it again once if not).
    fn submit_fenced(&self, w: &Work, deadline: Instant) -> Result<TransferHandle, Refused> {
        let engine = &self.inner.engine;
        let peer = self.peer(&w.endpoint)?;
        let batch = || {
            let mut b = Batch::with_capacity(w.ops.len()).deadline(deadline);
            b.extend(w.ops.iter().copied());
            b
        };
        // Whether a description of the node carries every segment session of the ops.
        let current = |regions: &[RemoteRegion]| {
            w.fences
                .iter()
                .all(|&(base, rkey)| regions.iter().any(|r| r.addr == base && r.rkey == rkey))
        };
        {
            let _held = self
                .inner
                .describing
                .read()
                .unwrap_or_else(|p| p.into_inner());
            if current(&engine.peer_regions(peer)?) {
                match engine.submit(peer, batch()) {
                    Err(TError::RemoteOutOfBounds { .. }) => {}
                    r => return Ok(r?),
                }
            }
        }
        // The description predates the session the master named (the node registered its
        // segment after we connected, or anew for a new session): fetch it again. If the
        // keys still differ, this transfer belongs to an older session than the node's.
        let _held = self
            .inner
            .describing
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if !current(&engine.redescribe(peer)?) {
            return Err(Refused::Stale);
        }
        Ok(engine.submit(peer, batch())?)
    }

    fn local_segment(&self, t: &Target, len: u64) -> Option<Arc<SegmentMem>> {
        if !self.inner.cfg.local_copy {
            return None;
        }
        local::find(&t.endpoint, t.addr, len)
    }

    // ---------------------------------------------------------------- gets

    /// Reads each `keys[i]` into `parts[i]` (registered memory, filled in order; their
    /// total must be at least the object's size). Per key: the object's size, or
    /// `NotFound`, `InvalidParams` (too small, unregistered), `TransferFailed`,
    /// `LeaseExpired`, ...
    pub fn get<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        keys: &[K],
        parts: &[P],
    ) -> Result<Vec<Result<u64, Code>>> {
        if keys.len() != parts.len() {
            return Err(StoreError::invalid(format!(
                "{} keys but {} part lists",
                keys.len(),
                parts.len()
            )));
        }
        let deadline = deadline_of(self.inner.cfg.timeout);
        if self.shards() == 1 {
            return self.get_on(0, keys, parts, deadline);
        }
        self.routed(
            keys,
            |shard, idx| {
                let (k, p) = (pick_keys(keys, idx), pick_parts(parts, idx));
                move || self.get_on(shard, &k, &p, deadline)
            },
            Err,
        )
    }

    /// [`StoreClient::get`] of keys of one shard.
    fn get_on<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        shard: usize,
        keys: &[K],
        parts: &[P],
        deadline: Instant,
    ) -> Result<Vec<Result<u64, Code>>> {
        let mut out: Vec<Result<u64, Code>> = vec![Err(Code::NotFound); keys.len()];
        let mut located: Vec<Option<(Located, Instant)>> = vec![None; keys.len()];
        let mut session = None;
        let todo: Vec<usize> = (0..keys.len())
            .filter(|&i| {
                let p = parts[i].as_ref();
                if !valid_key(keys[i].as_ref()) {
                    out[i] = Err(Code::InvalidKey);
                    false
                } else if total(p).is_none_or(|t| t == 0) || !self.inner.buffers.covers(p) {
                    out[i] = Err(Code::InvalidParams);
                    false
                } else {
                    true
                }
            })
            .collect();
        for range in chunks(todo.iter().map(|&i| keys[i].as_ref().len())) {
            let idx = &todo[range];
            let sent = Instant::now();
            let found = self.find(shard, idx.iter().map(|&i| keys[i].as_ref()), true, deadline)?;
            session = Some(self.link(shard).current());
            let lease_end = sent + Duration::from_millis(found.lease_ttl_ms as u64);
            for (&i, item) in idx.iter().zip(self.locate(found)) {
                match item {
                    Ok(l) if total(parts[i].as_ref()).is_some_and(|t| t >= l.size) => {
                        located[i] = Some((l, lease_end));
                    }
                    Ok(_) => out[i] = Err(Code::InvalidParams),
                    Err(c) => out[i] = Err(c),
                }
            }
        }
        // Each round reads every outstanding object from its next replica.
        let mut next: Vec<usize> = vec![0; keys.len()];
        let mut reported = Vec::new();
        for _ in 0..proto::MAX_REPLICAS {
            let mut work: HashMap<Arc<str>, Work> = HashMap::new();
            let mut round: Vec<usize> = Vec::new();
            for i in 0..keys.len() {
                let Some((l, lease_end)) = &located[i] else {
                    continue;
                };
                let Some(t) = l.replicas.get(next[i]) else {
                    out[i] = Err(Code::TransferFailed);
                    located[i] = None;
                    continue;
                };
                let p = parts[i].as_ref();
                if let Some(seg) = self.local_segment(t, l.size) {
                    out[i] = if seg.rkey() != t.rkey {
                        // Leased in an earlier session of this segment.
                        Err(Code::TransferFailed)
                    } else if !local::copy_out(&self.inner.buffers, &seg, t.rkey, t.addr, l.size, p)
                    {
                        Err(Code::InvalidParams)
                    } else if Instant::now() > *lease_end {
                        Err(Code::LeaseExpired)
                    } else {
                        Ok(l.size)
                    };
                    located[i] = None;
                    continue;
                }
                let w = work
                    .entry(t.endpoint.clone())
                    .or_insert_with(|| Work::new(&t.endpoint));
                let mut off = 0;
                for s in p {
                    if off == l.size {
                        break;
                    }
                    let n = s.len.min(l.size - off);
                    w.ops.push(TransferOp {
                        op: Op::Read,
                        local: s.addr,
                        remote: t.addr + off,
                        len: n,
                    });
                    off += n;
                }
                w.serve(i, t);
                round.push(i);
            }
            if round.is_empty() {
                break;
            }
            let latest = round
                .iter()
                .filter_map(|&i| located[i].as_ref().map(|x| x.1))
                .max()
                .unwrap_or(deadline);
            let (failed, suspects) =
                self.run(Op::Read, work.into_values().collect(), deadline.min(latest));
            reported.extend(suspects);
            let now = Instant::now();
            for i in round {
                if failed.contains(&i) {
                    next[i] += 1;
                    continue;
                }
                let (l, lease_end) = located[i].take().expect("in round");
                out[i] = if now > lease_end {
                    Err(Code::LeaseExpired)
                } else {
                    Ok(l.size)
                };
            }
        }
        // Segment ids are the session's: report only to the master that named them.
        if !reported.is_empty() && session == Some(self.link(shard).current()) {
            reported.sort_unstable();
            reported.dedup();
            let _ = self
                .link(shard)
                .call(&Request::Report { suspects: reported }, deadline);
        }
        Ok(out)
    }

    fn find<'k>(
        &self,
        shard: usize,
        keys: impl Iterator<Item = &'k [u8]>,
        lease: bool,
        deadline: Instant,
    ) -> Result<Found> {
        let keys: Vec<Vec<u8>> = keys.map(<[u8]>::to_vec).collect();
        let n = keys.len();
        match self
            .link(shard)
            .call(&Request::Get { lease, keys }, deadline)?
        {
            Response::Found(f) if f.items.len() == n => Ok(f),
            other => Err(self.bad_reply(other)),
        }
    }

    /// Replica lists with endpoints; replicas in this process first.
    fn locate(&self, f: Found) -> Vec<Result<Located, Code>> {
        let Found {
            segments, items, ..
        } = f;
        items
            .into_iter()
            .map(|it| {
                it.map(|o| {
                    let mut replicas: Vec<Target> = o
                        .replicas
                        .iter()
                        .map(|r| target(&segments, r.segment, r.addr))
                        .collect();
                    replicas.sort_by_key(|t| self.local_segment(t, o.size).is_none());
                    Located {
                        size: o.size,
                        replicas,
                    }
                })
            })
            .collect()
    }

    /// Sizes and replicas of complete objects (with a read lease when `lease`).
    pub fn query<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        lease: bool,
    ) -> Result<Vec<Result<Located, Code>>> {
        let deadline = deadline_of(self.inner.cfg.timeout);
        if self.shards() == 1 {
            return self.query_on(0, keys, lease, deadline);
        }
        self.routed(
            keys,
            |shard, idx| {
                let k = pick_keys(keys, idx);
                move || self.query_on(shard, &k, lease, deadline)
            },
            Err,
        )
    }

    /// [`StoreClient::query`] of keys of one shard.
    fn query_on<K: AsRef<[u8]>>(
        &self,
        shard: usize,
        keys: &[K],
        lease: bool,
        deadline: Instant,
    ) -> Result<Vec<Result<Located, Code>>> {
        let mut out: Vec<Result<Located, Code>> = vec![Err(Code::InvalidKey); keys.len()];
        let todo: Vec<usize> = (0..keys.len())
            .filter(|&i| valid_key(keys[i].as_ref()))
            .collect();
        for range in chunks(todo.iter().map(|&i| keys[i].as_ref().len())) {
            let idx = &todo[range];
            let f = self.find(
                shard,
                idx.iter().map(|&i| keys[i].as_ref()),
                lease,
                deadline,
            )?;
            for (&i, item) in idx.iter().zip(self.locate(f)) {
                out[i] = item;
            }
        }
        Ok(out)
    }

    /// Whether complete objects exist. Each object found is leased, as Mooncake's
    /// `is_exist` does.
    pub fn exist<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Result<bool, Code>>> {
        let codes = self.per_key(keys, |keys| Request::Exist { keys })?;
        Ok(codes
            .into_iter()
            .map(|c| match c {
                Code::Ok => Ok(true),
                Code::NotFound => Ok(false),
                c => Err(c),
            })
            .collect())
    }

    /// Removes objects: per key `Ok`, `NotFound`, `HasLease` (leased, not `force`),
    /// `NotReady` (being written).
    pub fn remove<K: AsRef<[u8]>>(&self, keys: &[K], force: bool) -> Result<Vec<Code>> {
        self.per_key(keys, |keys| Request::Remove { force, keys })
    }

    /// A per-key request to each shard that owns some of `keys`; one code per key back.
    fn per_key<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        request: impl Fn(Vec<Vec<u8>>) -> Request + Sync,
    ) -> Result<Vec<Code>> {
        let deadline = deadline_of(self.inner.cfg.timeout);
        if self.shards() == 1 {
            return self.per_key_on(0, keys, &request, deadline);
        }
        let request = &request;
        self.routed(
            keys,
            |shard, idx| {
                let k = pick_keys(keys, idx);
                move || self.per_key_on(shard, &k, request, deadline)
            },
            |code| code,
        )
    }

    /// One master request to `shard` per size-capped chunk of `keys`, carrying the valid
    /// ones; one code per key back, `InvalidKey` for a key that was not sent.
    fn per_key_on<K: AsRef<[u8]>>(
        &self,
        shard: usize,
        keys: &[K],
        request: &impl Fn(Vec<Vec<u8>>) -> Request,
        deadline: Instant,
    ) -> Result<Vec<Code>> {
        let mut out = Vec::with_capacity(keys.len());
        for range in chunks(keys.iter().map(|k| k.as_ref().len())) {
            let ks = &keys[range];
            let valid: Vec<Vec<u8>> = ks
                .iter()
                .filter(|k| valid_key(k.as_ref()))
                .map(|k| k.as_ref().to_vec())
                .collect();
            let n = valid.len();
            let codes = match self.link(shard).call(&request(valid), deadline)? {
                Response::Codes(c) if c.len() == n => c,
                other => return Err(self.bad_reply(other)),
            };
            let mut codes = codes.into_iter();
            for k in ks {
                out.push(if valid_key(k.as_ref()) {
                    codes.next().expect("counted")
                } else {
                    Code::InvalidKey
                });
            }
        }
        Ok(out)
    }

    /// Sends `req` to every shard at once; the counts they answer, summed. Fails when a
    /// shard fails (the other shards have done their part).
    fn count_all(&self, req: &Request) -> Result<u64> {
        let deadline = deadline_of(self.inner.cfg.timeout);
        let counts = self.on_all(|shard| match self.link(shard).call(req, deadline)? {
            Response::Count(n) => Ok(n),
            other => Err(self.bad_reply(other)),
        })?;
        Ok(counts.into_iter().sum())
    }

    /// Removes every complete object (not leased unless `force`); returns how many. In a
    /// sharded store every shard removes its own, at once; if one fails, the call fails
    /// and the others' removals stand.
    pub fn remove_all(&self, force: bool) -> Result<u64> {
        self.count_all(&Request::RemoveAll { force })
    }

    /// Removes the complete objects whose key matches `pattern` (a regular expression,
    /// searched anywhere in the key; not leased unless `force`); returns how many. A
    /// pattern that does not compile is `InvalidParams`. Sharded: as
    /// [`StoreClient::remove_all`].
    pub fn remove_matching(&self, pattern: &str, force: bool) -> Result<u64> {
        self.count_all(&Request::RemoveMatching {
            force,
            pattern: pattern.to_owned(),
        })
    }

    /// The master's counts; in a sharded store, the sums over all shards (a client is
    /// counted once per shard).
    pub fn stats(&self) -> Result<Stats> {
        let deadline = deadline_of(self.inner.cfg.timeout);
        let all =
            self.on_all(
                |shard| match self.link(shard).call(&Request::Stats, deadline)? {
                    Response::Stats(s) => Ok(s),
                    other => Err(self.bad_reply(other)),
                },
            )?;
        Ok(crate::shard::sum_stats(all))
    }

    /// Asks the master (every shard's) whether it is there (one round trip each, at
    /// once); `Ok` when all answered.
    pub fn ping(&self, timeout: Duration) -> Result<()> {
        let deadline = deadline_of(timeout);
        self.on_all(
            |shard| match self.link(shard).call(&Request::Heartbeat, deadline)? {
                Response::Ack => Ok(()),
                other => Err(self.bad_reply(other)),
            },
        )?;
        Ok(())
    }

    /// Leaves the store: the master unmounts this client's segment, the heartbeat stops,
    /// registrations are dropped and an engine the client opened shuts down. Idempotent;
    /// later calls fail.
    pub fn close(&self) {
        let stop = std::mem::take(&mut *self.inner.stop.lock().unwrap_or_else(|p| p.into_inner()));
        if stop.is_empty() {
            return;
        }
        drop(stop);
        self.inner.bye();
        self.inner.close_transport();
    }
}

impl Inner {
    /// Says goodbye to every shard's master at once.
    fn bye(&self) {
        crate::shard::concurrently(self.links.iter().map(|l| move || l.bye()).collect());
    }

    fn close_transport(&self) {
        let peers: Vec<PeerId> = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in peers {
            let _ = self.engine.disconnect(p);
        }
        self.buffers.clear(&self.engine);
        if self.owns_engine {
            self.engine.shutdown();
        } else {
            let by = Instant::now() + Duration::from_secs(5);
            for r in self.segments.iter().filter_map(|s| s.region()) {
                let _ = self.engine.deregister_wait(r, by);
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let stop = std::mem::take(self.stop.get_mut().unwrap_or_else(|p| p.into_inner()));
        if !stop.is_empty() {
            drop(stop);
            self.bye();
            self.close_transport();
        }
    }
}

/// Whether a failed transfer says something about the node (unreachable, refusing, silent)
/// and is worth reporting to the master, rather than about this client (its memory, its
/// configuration, its own shutdown). The master weighs reports anyway (docs/store.md).
fn implicates_node(e: &StoreError) -> bool {
    match e {
        StoreError::Transport(t) => matches!(t.fault(), Fault::Peer | Fault::Io | Fault::Timeout),
        StoreError::Io { .. } | StoreError::Timeout { .. } => true,
        _ => false,
    }
}

fn target(segments: &[SegmentRef], id: u64, addr: u64) -> Target {
    // The decoder checked that every replica names a listed segment.
    let s = segments.iter().find(|s| s.id == id);
    Target {
        segment: id,
        endpoint: s.map_or_else(|| Arc::from(""), |s| Arc::from(s.endpoint.as_str())),
        addr,
        base: s.map_or(0, |s| s.base),
        rkey: s.map_or(0, |s| s.rkey),
    }
}

/// The heartbeat thread of one shard's master link: one `Heartbeat` per period while the
/// client lives. It also brings the session back after a master restart (the link
/// reconnects and remounts the shard's part of the segment).
fn heartbeat(client: Weak<Inner>, shard: usize, stop: mpsc::Receiver<()>, period: Duration) {
    let mut failing = false;
    loop {
        match stop.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let Some(c) = client.upgrade() else { return };
        let r = c.links[shard].call(
            &Request::Heartbeat,
            Instant::now() + period.max(Duration::from_millis(500)) * 2,
        );
        match r {
            Ok(_) if failing => {
                tracing::info!(master = %c.cfg.master, shard, "store: master reachable again");
                failing = false;
            }
            Ok(_) => {}
            Err(e) if !failing => {
                tracing::warn!(master = %c.cfg.master, shard, "store: heartbeat failed: {e}");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

/// The second half of a put: the master's reservation, to be written.
pub struct Reservation<'c> {
    client: &'c StoreClient,
    /// The shard whose master reserved.
    shard: usize,
    keys: Vec<Vec<u8>>,
    sizes: Vec<u64>,
    items: Vec<Result<Vec<Target>, Code>>,
    /// The master session that reserved (`None`: nothing reserved).
    session: Option<(u64, u64)>,
    /// When `PutStart` was sent.
    started: Instant,
    deadline: Instant,
    open: bool,
}

impl std::fmt::Debug for Reservation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("keys", &self.keys.len())
            .field("items", &self.items)
            .finish()
    }
}

impl<'c> Reservation<'c> {
    #[allow(clippy::too_many_arguments)]
    fn new<K: AsRef<[u8]>>(
        client: &'c StoreClient,
        shard: usize,
        keys: &[K],
        sizes: &[u64],
        items: Vec<Result<Vec<Target>, Code>>,
        session: Option<(u64, u64)>,
        started: Instant,
        deadline: Instant,
    ) -> Self {
        Reservation {
            client,
            shard,
            keys: keys.iter().map(|k| k.as_ref().to_vec()).collect(),
            sizes: sizes.to_vec(),
            items,
            session,
            started,
            deadline,
            open: true,
        }
    }

    /// Per key: the replicas reserved, or why none.
    pub fn items(&self) -> &[Result<Vec<Target>, Code>] {
        &self.items
    }

    /// Writes `parts[i]` (registered memory, concatenated; exactly the reserved size) to
    /// every replica of key `i`, then publishes the keys written and revokes the others.
    /// Returns the per-key outcome.
    pub fn write<P: AsRef<[Span]>>(mut self, parts: &[P]) -> Result<Vec<Result<(), Code>>> {
        let c = self.client;
        let n = self.keys.len();
        if parts.len() != n {
            return Err(StoreError::invalid(format!(
                "{n} keys but {} part lists",
                parts.len()
            )));
        }
        // Leave time to publish or revoke inside the call's deadline.
        let left = self.deadline.saturating_duration_since(Instant::now());
        let mut data_deadline = self.deadline - (left / 10).min(Duration::from_secs(1));
        // The master takes a put away `put_discard_ms` after it started and reuses the
        // space only much later (`put_release_ms`): writing past the first is pointless,
        // and stopping there keeps every write of the put inside the master's hold.
        let link = c.link(self.shard);
        if let Some(w) = link.welcome() {
            let by = self.started + Duration::from_millis(w.put_discard_ms as u64);
            data_deadline = data_deadline.min(by);
        }
        let mut out: Vec<Result<(), Code>> = Vec::with_capacity(n);
        let mut failed = vec![false; n];
        let mut work: HashMap<Arc<str>, Work> = HashMap::new();
        for i in 0..n {
            let reps = match &self.items[i] {
                Ok(r) => r,
                Err(code) => {
                    out.push(Err(*code));
                    continue;
                }
            };
            let p = parts[i].as_ref();
            if total(p) != Some(self.sizes[i]) || !c.inner.buffers.covers(p) {
                out.push(Err(Code::InvalidParams));
                failed[i] = true;
                continue;
            }
            out.push(Ok(()));
            for t in reps {
                if let Some(seg) = c.local_segment(t, self.sizes[i]) {
                    if !local::copy_in(&c.inner.buffers, &seg, t.rkey, t.addr, p) {
                        failed[i] = true;
                        out[i] = Err(Code::TransferFailed);
                    }
                    continue;
                }
                let w = work
                    .entry(t.endpoint.clone())
                    .or_insert_with(|| Work::new(&t.endpoint));
                let mut off = 0;
                for s in p {
                    w.ops.push(TransferOp {
                        op: Op::Write,
                        local: s.addr,
                        remote: t.addr + off,
                        len: s.len,
                    });
                    off += s.len;
                }
                w.serve(i, t);
            }
        }
        let (bad, suspects) = c.run(Op::Write, work.into_values().collect(), data_deadline);
        for i in bad {
            failed[i] = true;
            if out[i].is_ok() {
                out[i] = Err(Code::TransferFailed);
            }
        }
        let mut done = Vec::new();
        let mut done_idx = Vec::new();
        let mut revoked = Vec::new();
        for (i, (item, key)) in self.items.iter().zip(&self.keys).enumerate() {
            if item.is_ok() {
                if failed[i] {
                    revoked.push(key.clone());
                } else {
                    done.push(key.clone());
                    done_idx.push(i);
                }
            }
        }
        self.open = false;
        if self.session != Some(link.current()) {
            // The master that reserved is gone (or dropped us): the new one knows none of
            // these keys or segment ids. Nothing was published, and the data path kept
            // every byte out of the new session's space.
            tracing::warn!(
                "store: put reserved in an earlier master session; {} key(s) not published",
                done_idx.len()
            );
            for &i in &done_idx {
                out[i] = Err(Code::TransferFailed);
            }
            return Ok(out);
        }
        let codes = c.finish(self.shard, done, revoked, suspects, self.deadline);
        match codes {
            Ok(codes) => {
                for (j, &i) in done_idx.iter().enumerate() {
                    match codes[j] {
                        Code::Ok => {}
                        // Taken away meanwhile (too slow) or a replica's node was lost.
                        _ => out[i] = Err(Code::TransferFailed),
                    }
                }
                Ok(out)
            }
            Err(e) => Err(e),
        }
    }
}

impl StoreClient {
    /// `PutFinish` in chunks; codes for `done` (in order) only.
    fn finish(
        &self,
        shard: usize,
        done: Vec<Vec<u8>>,
        revoked: Vec<Vec<u8>>,
        suspects: Vec<u64>,
        deadline: Instant,
    ) -> Result<Vec<Code>> {
        let mut codes = Vec::with_capacity(done.len());
        let mut suspects = Some(suspects);
        let done_ranges = chunks(done.iter().map(Vec::len));
        let rev_ranges = chunks(revoked.iter().map(Vec::len));
        let rounds = done_ranges.len().max(rev_ranges.len()).max(1);
        for r in 0..rounds {
            let d = done_ranges.get(r).map_or(&[][..], |x| &done[x.clone()]);
            let v = rev_ranges.get(r).map_or(&[][..], |x| &revoked[x.clone()]);
            let s = suspects.take().unwrap_or_default();
            if d.is_empty() && v.is_empty() && s.is_empty() {
                continue;
            }
            let req = Request::PutFinish(proto::PutFinish {
                done: d.to_vec(),
                revoked: v.to_vec(),
                suspects: s,
            });
            match self.link(shard).call(&req, deadline)? {
                Response::Codes(c) if c.len() == d.len() + v.len() => {
                    codes.extend_from_slice(&c[..d.len()]);
                }
                other => return Err(self.bad_reply(other)),
            }
        }
        Ok(codes)
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.open || self.session != Some(self.client.link(self.shard).current()) {
            return;
        }
        let revoked: Vec<Vec<u8>> = self
            .items
            .iter()
            .zip(&self.keys)
            .filter(|(it, _)| it.is_ok())
            .map(|(_, k)| k.clone())
            .collect();
        if !revoked.is_empty() {
            let deadline = self.deadline.max(Instant::now() + Duration::from_secs(1));
            let _ = self
                .client
                .finish(self.shard, Vec::new(), revoked, Vec::new(), deadline);
        }
    }
}
