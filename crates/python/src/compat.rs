//! The engine behind `pagewire.mooncake_compat.TransferEngine`: Mooncake's Python
//! `TransferEngine` surface (names, argument names, defaults, return codes) over one
//! pagewire engine.
//!
//! API-compatible, not wire-compatible: peers are other pagewire compat engines. Where
//! Mooncake is lax this is strict: a method before `initialize` returns -1; every local
//! and remote range of a batch is checked before anything is posted (an unregistered
//! source fails the call instead of being copied); a raw address is checked to be
//! writable memory of this process before it is registered; a stale batch id returns -1;
//! `send_probe` is bounded by the handshake deadline (4 s).
//!
//! The hot path (`batch_transfer_sync_write` and friends) is Rust from the argument
//! conversion to the return code, with the GIL released from session lookup to the end
//! of the wait.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyNotImplementedError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use pagewire_transport::{
    Access, BackendKind, Batch, BatchStatus, Engine, EngineConfig, Error, Op, PeerId, RegionId,
    TransferHandle, TransferOp,
};

use crate::compat_mail::{MAX_MESSAGE, Mailbox};
use crate::convert::u64_vec;
use crate::memcheck::check_writable;
use crate::transport::no_panic;

// Mooncake's return codes (mooncake-transfer-engine/include/error.h).
const OK: i32 = 0;
const ERR_INVALID_ARGUMENT: i32 = -1;
const ERR_ADDRESS_NOT_REGISTERED: i32 = -3;
const ERR_BATCH_BUSY: i32 = -4;
const ERR_ADDRESS_OVERLAPPED: i32 = -7;
const ERR_DNS: i32 = -101;
const ERR_SOCKET: i32 = -102;
const ERR_METADATA: i32 = -200;

/// Mooncake's default RPC port range (`MC_MIN_RPC_PORT`, `MC_MAX_RPC_PORT`).
const DEFAULT_PORTS: (u16, u16) = (15000, 17000);

/// Connect + handshake deadline of a compat engine, which also bounds `send_probe`.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(4);

/// How long `unregister_memory` waits for batches still using the region.
const UNREGISTER_WAIT: Duration = Duration::from_secs(5);

/// At most this many async batches may be outstanding (not yet collected by
/// `transfer_check_status` / `get_batch_transfer_status`); beyond it submits return 0.
const MAX_ASYNC_BATCHES: usize = 1 << 16;

// ------------------------------------------------------------------------ logging

static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Logs through Python's `logging` (logger `pagewire.mooncake_compat`).
fn log(py: Python<'_>, level: &str, msg: &str) {
    let logger = LOGGER.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py
            .import("logging")?
            .call_method1("getLogger", ("pagewire.mooncake_compat",))?
            .unbind())
    });
    if let Ok(l) = logger {
        let _ = l.bind(py).call_method1(level, (msg,));
    }
}

// ------------------------------------------------------------------------ environment

/// `MC_TRANSFER_TIMEOUT` as Mooncake reads it: whole seconds, `atoi` semantics, floor 5,
/// default 30.
pub(crate) fn transfer_timeout_from_env() -> Duration {
    match std::env::var("MC_TRANSFER_TIMEOUT") {
        Ok(v) => Duration::from_secs(atoi(&v).max(5) as u64),
        Err(_) => Duration::from_secs(30),
    }
}

/// C's `atoi`: optional spaces and sign, then digits; 0 when there are none.
fn atoi(s: &str) -> i64 {
    let t = s.trim_start();
    let (neg, rest) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let digits: String = rest
        .chars()
        .take_while(char::is_ascii_digit)
        .take(18)
        .collect();
    let v: i64 = digits.parse().unwrap_or(0);
    if neg { -v } else { v }
}

/// `MC_MIN_RPC_PORT` / `MC_MAX_RPC_PORT` validated as Mooncake does (1024..=65535, not in
/// the ephemeral range 32768..=60999, min <= max; else the default range).
fn port_range() -> (u16, u16) {
    let get = |a: &str, b: &str| std::env::var(a).or_else(|_| std::env::var(b)).ok();
    let lo = get("MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT").map_or(DEFAULT_PORTS.0 as i64, |v| atoi(&v));
    let hi = get("MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT").map_or(DEFAULT_PORTS.1 as i64, |v| atoi(&v));
    let ok = |p: i64| (1024..=65535).contains(&p) && !(32768..=60999).contains(&p);
    if ok(lo) && ok(hi) && lo <= hi {
        (lo as u16, hi as u16)
    } else {
        DEFAULT_PORTS
    }
}

/// A random number (for port picks), from std's randomly keyed hasher.
fn random_u64(salt: u64) -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(salt);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

// ------------------------------------------------------------------------ session ids

/// `host` of a `local_hostname` (`host`, `host:port`, `[v6]`, `[v6]:port`, a bare IPv6
/// literal, Ascend's `ip:port:npu_N`): what goes before `:port` in our session id.
fn host_part(local_hostname: &str) -> String {
    let s = local_hostname.trim();
    if s.parse::<IpAddr>().is_ok() {
        return s.to_string();
    }
    if let Some(rest) = s.strip_prefix('[')
        && let Some((h, _)) = rest.split_once(']')
    {
        return h.to_string();
    }
    s.split(':').next().unwrap_or(s).to_string()
}

/// `host:port` with IPv6 literals in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Why a session id could not be turned into addresses, with Mooncake's code.
struct SidError {
    code: i32,
    msg: String,
}

/// The addresses of a session id `host:port` / `[v6]:port`. No port is an error here
/// (Mooncake would try its legacy default port 12001).
fn parse_sid(sid: &str) -> Result<Vec<SocketAddr>, SidError> {
    let bad = |m: &str| SidError {
        code: ERR_METADATA,
        msg: format!("session id {sid:?}: {m}"),
    };
    let (host, port) = if let Some(rest) = sid.strip_prefix('[') {
        let (h, p) = rest
            .split_once("]:")
            .ok_or_else(|| bad("expected [ipv6]:port"))?;
        (h, p)
    } else {
        let (h, p) = sid
            .rsplit_once(':')
            .ok_or_else(|| bad("expected host:port"))?;
        if h.contains(':') {
            return Err(bad("an IPv6 host must be in brackets"));
        }
        (h, p)
    };
    let port: u16 = port
        .parse()
        .map_err(|_| bad("the port is not a number in 1..=65535"))?;
    if port == 0 || host.is_empty() {
        return Err(bad("empty host or port 0"));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| SidError {
            code: ERR_DNS,
            msg: format!("session id {sid:?}: cannot resolve {host:?}: {e}"),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(SidError {
            code: ERR_DNS,
            msg: format!("session id {sid:?}: {host:?} resolves to nothing"),
        });
    }
    Ok(addrs)
}

// ------------------------------------------------------------------------ the engine

/// The operations of one call: `lens[i]` bytes between `locals[i]` and `remotes[i]`.
#[derive(Clone, Copy)]
struct Ops<'a> {
    op: Op,
    locals: &'a [u64],
    remotes: &'a [u64],
    lens: &'a [u64],
}

/// An async batch until its status is collected.
enum AsyncBatch {
    Posted(TransferHandle),
    /// All lengths zero: nothing was posted.
    Empty,
}

/// One cached connection per session id (Mooncake's `handle_map_`).
struct Session {
    peer: Mutex<Option<PeerId>>,
}

/// A failed call: Mooncake's code and what to log.
struct Fail {
    code: i32,
    msg: String,
}

impl Fail {
    fn new(code: i32, msg: impl Into<String>) -> Self {
        Fail {
            code,
            msg: msg.into(),
        }
    }
}

type Res<T> = Result<T, Fail>;

/// Log lines (level, text) produced while the GIL was released, emitted afterwards.
type Logs = Vec<(String, String)>;

/// An initialized compat engine.
pub(crate) struct Compat {
    engine: Engine,
    session_name: String,
    port: u16,
    timeout: Duration,
    /// Caller registrations by start address: (length, region).
    regions: Mutex<BTreeMap<u64, (u64, RegionId)>>,
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    batches: Mutex<HashMap<u64, AsyncBatch>>,
    next_batch: AtomicU64,
    mail: Mailbox,
    stop: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl Compat {
    fn lock_regions(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, (u64, RegionId)>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection for `sid`, opened (handshake) on first use and re-opened when the
    /// cached one broke. Concurrent first calls for one sid share one handshake.
    fn peer_for(&self, sid: &str) -> Res<PeerId> {
        let existing = self
            .sessions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(sid)
            .cloned();
        let session = match existing {
            Some(s) => s,
            None => self
                .sessions
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .entry(sid.to_string())
                .or_insert_with(|| {
                    Arc::new(Session {
                        peer: Mutex::new(None),
                    })
                })
                .clone(),
        };
        let mut g = session.peer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = *g {
            if self.engine.peer_alive(p).unwrap_or(false) {
                return Ok(p);
            }
            // Broken (peer restarted or died): forget it and handshake again.
            let _ = self.engine.disconnect(p);
            self.mail.forget_peer(p);
            *g = None;
        }
        let r = parse_sid(sid)
            .map_err(|e| Fail::new(-1, e.msg))
            .and_then(|addrs| {
                self.engine
                    .connect(&addrs[..])
                    .map_err(|e| Fail::new(-1, format!("cannot open session {sid:?}: {e}")))
            });
        match r {
            Ok(p) => {
                *g = Some(p);
                Ok(p)
            }
            Err(f) => {
                drop(g);
                // Do not keep an entry per bad sid.
                self.sessions
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(sid);
                Err(f)
            }
        }
    }

    /// Drops the cached connection of `sid` if it is `peer` (after a failure that may
    /// have broken it), so that the next call handshakes again.
    fn drop_session_if_broken(&self, sid: &str, peer: PeerId) {
        if self.engine.peer_alive(peer).unwrap_or(false) {
            return;
        }
        if let Some(s) = self
            .sessions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(sid)
        {
            let mut g = s.peer.lock().unwrap_or_else(|p| p.into_inner());
            if *g == Some(peer) {
                *g = None;
                let _ = self.engine.disconnect(peer);
                self.mail.forget_peer(peer);
            }
        }
    }

    /// Validates and posts one batch; retries once after re-describing the peer when a
    /// remote range is unknown (the peer may have registered memory since we connected).
    fn submit(
        &self,
        peer: PeerId,
        ops: &Ops<'_>,
        tag: Option<u32>,
        timeout: Duration,
    ) -> Result<TransferHandle, Error> {
        let Ops {
            op,
            locals,
            remotes,
            lens,
        } = *ops;
        let build = || {
            let mut b = Batch::with_capacity(lens.len());
            for i in 0..lens.len() {
                if lens[i] > 0 {
                    b.push(TransferOp {
                        op,
                        local: locals[i],
                        remote: remotes[i],
                        len: lens[i],
                    });
                }
            }
            if let Some(t) = tag {
                b = b.notify(t);
            }
            b.timeout(timeout)
        };
        match self.engine.submit(peer, build()) {
            Err(Error::RemoteOutOfBounds { .. } | Error::RemotePermission { .. }) => {
                // Nothing was posted: refresh the peer's table and check again.
                self.engine.redescribe(peer)?;
                self.engine.submit(peer, build())
            }
            r => r,
        }
    }

    /// A synchronous transfer: `transfer_sync*` and `batch_transfer_sync*`.
    fn transfer_sync(
        &self,
        sid: &str,
        op: Op,
        locals: &[u64],
        remotes: &[u64],
        lens: &[u64],
        notify: Option<(&[u8], &[u8])>,
    ) -> Res<()> {
        if locals.len() != remotes.len() || locals.len() != lens.len() {
            return Err(Fail::new(
                -1,
                format!(
                    "buffers, peer_buffer_addresses and lengths differ in length ({}, {}, {})",
                    locals.len(),
                    remotes.len(),
                    lens.len()
                ),
            ));
        }
        let peer = self.peer_for(sid)?;
        let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l));
        // Mooncake's deadline: MC_TRANSFER_TIMEOUT plus 1 ns per byte.
        let timeout = self.timeout + Duration::from_nanos(total);
        let deadline = Instant::now() + timeout;
        if total == 0 && notify.is_none() {
            return Ok(());
        }
        let staged = match notify {
            Some((name, msg)) => Some(
                self.mail
                    .stage(peer, name, msg, deadline, |p| {
                        self.engine.peer_alive(p).unwrap_or(false)
                    })
                    .map_err(|m| Fail::new(-1, m))?,
            ),
            None => None,
        };
        let tag = staged.map(|s| s.tag);
        let h = match self.submit(
            peer,
            &Ops {
                op,
                locals,
                remotes,
                lens,
            },
            tag,
            timeout,
        ) {
            Ok(h) => h,
            Err(e) => {
                if let Some(s) = staged {
                    self.mail.release(s);
                }
                self.drop_session_if_broken(sid, peer);
                return Err(Fail::new(-1, format!("transfer to {sid} refused: {e}")));
            }
        };
        match h.wait(deadline) {
            Ok(_) => Ok(()),
            Err(e) => {
                // Nothing more is handed to the wire; bytes already sent may still land,
                // inside the ranges checked above.
                h.cancel();
                if let Some(s) = staged {
                    self.mail.release(s);
                }
                self.drop_session_if_broken(sid, peer);
                Err(Fail::new(-1, format!("transfer to {sid} failed: {e}")))
            }
        }
    }

    /// An async submission: a batch id (> 0) or a failure.
    fn transfer_async(
        &self,
        sid: &str,
        op: Op,
        locals: &[u64],
        remotes: &[u64],
        lens: &[u64],
    ) -> Res<u64> {
        if locals.len() != remotes.len() || locals.len() != lens.len() {
            return Err(Fail::new(
                0,
                "buffers, peer_buffer_addresses and lengths differ in length",
            ));
        }
        if self.batches.lock().unwrap_or_else(|p| p.into_inner()).len() >= MAX_ASYNC_BATCHES {
            return Err(Fail::new(
                0,
                format!(
                    "{MAX_ASYNC_BATCHES} async batches not yet collected with transfer_check_status / get_batch_transfer_status"
                ),
            ));
        }
        let peer = self.peer_for(sid).map_err(|f| Fail::new(0, f.msg))?;
        let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l));
        let timeout = self.timeout + Duration::from_nanos(total);
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let entry = if total == 0 {
            // Nothing to move (Mooncake accepts an empty batch): an id that reports done.
            AsyncBatch::Empty
        } else {
            match self.submit(
                peer,
                &Ops {
                    op,
                    locals,
                    remotes,
                    lens,
                },
                None,
                timeout,
            ) {
                Ok(h) => AsyncBatch::Posted(h),
                Err(e) => {
                    self.drop_session_if_broken(sid, peer);
                    return Err(Fail::new(0, format!("transfer to {sid} refused: {e}")));
                }
            }
        };
        self.batches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, entry);
        Ok(id)
    }

    fn check_status(&self, id: u64) -> i32 {
        let mut map = self.batches.lock().unwrap_or_else(|p| p.into_inner());
        let code = match map.get(&id) {
            None => return -1,
            Some(AsyncBatch::Empty) => 1,
            Some(AsyncBatch::Posted(h)) => match h.status() {
                BatchStatus::Pending => return 0,
                BatchStatus::Done => 1,
                BatchStatus::Failed(Error::Timeout { .. }) => -2,
                _ => -1,
            },
        };
        // Collected: the id is stale from now on (-1), never reused.
        map.remove(&id);
        code
    }

    fn wait_all(&self, ids: &[u64]) -> i32 {
        let entries: Vec<Option<AsyncBatch>> = {
            let mut map = self.batches.lock().unwrap_or_else(|p| p.into_inner());
            ids.iter().map(|id| map.remove(id)).collect()
        };
        let mut ok = entries.iter().all(Option::is_some);
        for e in entries.iter().flatten() {
            let AsyncBatch::Posted(h) = e else { continue };
            if !ok {
                h.cancel();
                continue;
            }
            if h.wait(h.deadline()).is_err() {
                h.cancel();
                ok = false;
            }
        }
        if ok { 0 } else { -1 }
    }

    /// Registers caller memory (Mooncake's codes: -1 zero length, -7 any overlap).
    fn register(&self, addr: u64, len: u64) -> Res<()> {
        if len == 0 {
            return Err(Fail::new(ERR_INVALID_ARGUMENT, "zero-length registration"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| Fail::new(ERR_INVALID_ARGUMENT, "address + capacity overflows"))?;
        let mut regions = self.lock_regions();
        if let Some((a, l)) = overlap(&regions, addr, end) {
            return Err(Fail::new(
                ERR_ADDRESS_OVERLAPPED,
                format!(
                    "[{addr:#x}, {end:#x}) overlaps the registered [{a:#x}, {:#x})",
                    a + l
                ),
            ));
        }
        check_writable(addr, len).map_err(|m| Fail::new(ERR_INVALID_ARGUMENT, m))?;
        let size = usize::try_from(len)
            .map_err(|_| Fail::new(ERR_INVALID_ARGUMENT, "capacity too large"))?;
        // SAFETY: the range was just checked to be mapped read/write memory of this process;
        // like Mooncake's `register_memory`, the caller keeps it allocated until it calls
        // `unregister_memory` (documented in the compat engine's docs).
        let id = unsafe { self.engine.register_raw(addr as *mut u8, size, Access::ALL) }.map_err(
            |e| {
                let code = match e {
                    Error::RegionOverlap { .. } => ERR_ADDRESS_OVERLAPPED,
                    _ => ERR_INVALID_ARGUMENT,
                };
                Fail::new(code, format!("registering [{addr:#x}, {end:#x}): {e}"))
            },
        )?;
        regions.insert(addr, (len, id));
        Ok(())
    }

    fn unregister(&self, addr: u64) -> Res<()> {
        let id = match self.lock_regions().get(&addr) {
            Some(&(_, id)) => id,
            None => {
                return Err(Fail::new(
                    ERR_ADDRESS_NOT_REGISTERED,
                    format!("{addr:#x} is not registered"),
                ));
            }
        };
        match self
            .engine
            .deregister_wait(id, Instant::now() + UNREGISTER_WAIT)
        {
            Ok(()) | Err(Error::UnknownRegion { .. }) => {
                self.lock_regions().remove(&addr);
                Ok(())
            }
            Err(e) => Err(Fail::new(
                ERR_BATCH_BUSY,
                format!("unregistering {addr:#x}: still used by in-flight transfers ({e})"),
            )),
        }
    }

    /// `send_probe`: 0 when the peer's engine answers a handshake (or a describe on the
    /// cached connection) within the handshake deadline.
    fn probe(&self, sid: &str) -> Res<()> {
        let addrs = parse_sid(sid).map_err(|e| Fail::new(e.code, e.msg))?;
        let cached = self
            .sessions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(sid)
            .and_then(|s| *s.peer.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(p) = cached
            && self.engine.peer_alive(p).unwrap_or(false)
        {
            return self
                .engine
                .redescribe(p)
                .map(|_| ())
                .map_err(|e| Fail::new(ERR_SOCKET, format!("probe {sid}: {e}")));
        }
        match self.engine.connect(&addrs[..]) {
            Ok(p) => {
                // Keep it as the session's connection (it is fresh), replacing a broken one.
                let session = self
                    .sessions
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(sid.to_string())
                    .or_insert_with(|| {
                        Arc::new(Session {
                            peer: Mutex::new(None),
                        })
                    })
                    .clone();
                let mut g = session.peer.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(old) = g.replace(p) {
                    let _ = self.engine.disconnect(old);
                    self.mail.forget_peer(old);
                }
                Ok(())
            }
            Err(e) => Err(Fail::new(ERR_SOCKET, format!("probe {sid}: {e}"))),
        }
    }

    /// The lowest exposed address of the peer's regions (not its notification outbox).
    fn first_buffer(&self, sid: &str) -> Res<u64> {
        let peer = self.peer_for(sid)?;
        let mut regions = self
            .engine
            .redescribe(peer)
            .map_err(|e| Fail::new(-1, e.to_string()))?;
        regions.sort_by_key(|r| r.addr);
        Ok(regions
            .iter()
            .find(|r| r.access.contains(Access::REMOTE_WRITE))
            .map_or(0, |r| r.addr))
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        // Let in-flight batches finish before the engine lets go of caller memory.
        let regions: Vec<_> = self.lock_regions().values().map(|&(_, id)| id).collect();
        for id in regions {
            let _ = self
                .engine
                .deregister_wait(id, Instant::now() + Duration::from_secs(2));
        }
        self.lock_regions().clear();
        self.engine.shutdown();
    }
}

/// A region of `regions` that overlaps `[addr, end)`.
fn overlap<V>(regions: &BTreeMap<u64, (u64, V)>, addr: u64, end: u64) -> Option<(u64, u64)> {
    if let Some((&a, &(l, _))) = regions.range(..=addr).next_back()
        && a + l > addr
    {
        return Some((a, l));
    }
    regions.range(addr..end).next().map(|(&a, &(l, _))| (a, l))
}

/// The notification worker: reads messages, answers ACKs, prunes broken connections.
fn worker(c: Arc<Compat>) {
    let mut last_prune = Instant::now();
    // MSG tags not yet read: held back while the application's queue is full, so that a
    // receiver that never calls get_notifies makes its senders run out of slots instead
    // of growing without bound.
    let mut pending: VecDeque<pagewire_transport::Notification> = VecDeque::new();
    while !c.stop.load(Ordering::Acquire) {
        while c.mail.has_room() {
            let Some(n) = pending.pop_front() else { break };
            if let Err(e) = c.mail.on_tag(&c.engine, n.peer, n.tag) {
                tracing::warn!(peer = %n.peer, error = %e, "notification dropped");
            }
        }
        if let Some(n) = c
            .engine
            .poll_notification(Instant::now() + Duration::from_millis(50))
        {
            if matches!(
                crate::compat_mail::decode(n.tag),
                crate::compat_mail::Tag::Msg { .. }
            ) {
                pending.push_back(n);
            } else if let Err(e) = c.mail.on_tag(&c.engine, n.peer, n.tag) {
                tracing::debug!(peer = %n.peer, error = %e, "tag ignored");
            }
        }
        if last_prune.elapsed() > Duration::from_secs(1) {
            last_prune = Instant::now();
            // Connections that broke and belong to no session (accepted ones, replaced
            // ones) would otherwise stay listed forever.
            let cached: Vec<PeerId> = c
                .sessions
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .filter_map(|s| *s.peer.lock().unwrap_or_else(|p| p.into_inner()))
                .collect();
            for p in c.engine.peers() {
                if !cached.contains(&p) && !c.engine.peer_alive(p).unwrap_or(true) {
                    let _ = c.engine.disconnect(p);
                    c.mail.forget_peer(p);
                }
            }
        }
    }
}

/// Which backend `initialize` asked for, and why.
fn choose_backend(protocol: &str) -> (BackendKind, String) {
    if let Ok(v) = std::env::var("PAGEWIRE_TRANSPORT")
        && let Ok(k) = v.parse::<BackendKind>()
    {
        return (k, format!("PAGEWIRE_TRANSPORT={v}"));
    }
    if std::env::var_os("MC_FORCE_TCP").is_some() {
        return (BackendKind::Tcp, "MC_FORCE_TCP is set".into());
    }
    if protocol == "rdma" {
        return (BackendKind::Verbs, "protocol \"rdma\"".into());
    }
    (BackendKind::Tcp, format!("protocol {protocol:?}"))
}

/// The address to bind: `host`'s IP when it is local, else all interfaces.
fn bind_ip(host: &str) -> (IpAddr, Option<String>) {
    let ip = match host.parse::<IpAddr>() {
        Ok(ip) => Some(ip),
        Err(_) => (host, 0u16)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| {
                a.find(|a| a.is_ipv4())
                    .or_else(|| (host, 0u16).to_socket_addrs().ok()?.next())
            })
            .map(|a| a.ip()),
    };
    match ip {
        Some(ip) if TcpListener::bind((ip, 0)).is_ok() => (ip, None),
        Some(ip) => (
            Ipv4Addr::UNSPECIFIED.into(),
            Some(format!(
                "{host} ({ip}) is not a local address; listening on all interfaces"
            )),
        ),
        None => (
            Ipv4Addr::UNSPECIFIED.into(),
            Some(format!(
                "cannot resolve {host:?}; listening on all interfaces"
            )),
        ),
    }
}

/// Opens the engine: backend per `protocol`, control port random in the RPC range.
fn open_engine(host: &str, protocol: &str, device: &str) -> Result<(Engine, Logs), String> {
    let mut logs = Vec::new();
    let (mut kind, why) = choose_backend(protocol);
    let (ip, note) = bind_ip(host);
    if let Some(n) = note {
        logs.push(("warning".into(), n));
    }
    let (lo, hi) = port_range();
    let span = u64::from(hi - lo) + 1;
    let mut last_err = String::new();
    for attempt in 0..64u64 {
        let port = lo + (random_u64(attempt) % span) as u16;
        let addr = SocketAddr::new(ip, port);
        // Cheap pre-check so that a taken port does not cost a device open.
        if TcpListener::bind(addr).is_err() {
            continue;
        }
        let mut b = EngineConfig::builder()
            .with_env()
            .map_err(|e| e.to_string())?
            .backend(kind)
            .listen(addr)
            .handshake_timeout(HANDSHAKE_TIMEOUT);
        if kind == BackendKind::Verbs
            && let Some(d) = device.split(',').map(str::trim).find(|d| !d.is_empty())
        {
            b = b.rdma_device(d);
        }
        let cfg = b.build().map_err(|e| e.to_string())?;
        match Engine::new(cfg) {
            Ok(e) => {
                let info = e.backend_info();
                let line = match (kind, info.kind) {
                    (_, BackendKind::Verbs) => format!("verbs on {} ({why})", info.device),
                    (_, k) => format!("{k} ({why})"),
                };
                logs.push(("info".into(), format!("transport: {line}")));
                return Ok((e, logs));
            }
            Err(Error::Io { .. }) => {
                last_err = format!("port {port} taken");
                continue;
            }
            Err(e) if kind == BackendKind::Verbs => {
                logs.push((
                    "warning".into(),
                    format!("protocol \"rdma\" asked for verbs, but no RDMA device opened ({e}); using TCP"),
                ));
                kind = BackendKind::Tcp;
                continue;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!("no free port in [{lo}, {hi}] ({last_err})"))
}

fn init(
    host_in: &str,
    protocol: &str,
    device: &str,
    timeout: Duration,
) -> Result<(Arc<Compat>, Logs), String> {
    let host = host_part(host_in);
    if host.is_empty() {
        return Err("local_hostname is empty".into());
    }
    let (engine, logs) = open_engine(&host, protocol, device)?;
    let mail = Mailbox::new(&engine).map_err(|e| format!("notification mailbox: {e}"))?;
    let port = engine.local_addr().port();
    let c = Arc::new(Compat {
        session_name: join_host_port(&host, port),
        port,
        timeout,
        engine,
        regions: Mutex::new(BTreeMap::new()),
        sessions: RwLock::new(HashMap::new()),
        batches: Mutex::new(HashMap::new()),
        next_batch: AtomicU64::new(1),
        mail,
        stop: AtomicBool::new(false),
        worker: Mutex::new(None),
    });
    let w = c.clone();
    let t = std::thread::Builder::new()
        .name("pagewire-compat".into())
        .spawn(move || worker(w))
        .map_err(|e| format!("spawn notification worker: {e}"))?;
    *c.worker.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
    Ok((c, logs))
}

// ------------------------------------------------------------------------ Python class

/// Converts an address list; errors are `TypeError` as pybind11 raises for bad lists.
fn addrs(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    u64_vec(obj, what).map_err(|e| PyTypeError::new_err(e.value(obj.py()).to_string()))
}

/// Converts one address or length; `TypeError` as pybind11.
fn addr(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return obj
            .extract::<bool>()
            .map(u64::from)
            .map_err(|e| PyTypeError::new_err(e.to_string()));
    }
    obj.extract::<u64>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be an int in [0, 2**64), got {}",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}

fn parse_opcode(obj: &Bound<'_, PyAny>) -> PyResult<Op> {
    let v: i64 = obj
        .call_method0("__int__")
        .and_then(|v| v.extract())
        .map_err(|_| {
            PyTypeError::new_err(
                "opcode must be TransferOpcode.Read (0) or TransferOpcode.Write (1)",
            )
        })?;
    match v {
        0 => Ok(Op::Read),
        1 => Ok(Op::Write),
        _ => Err(PyTypeError::new_err(format!(
            "opcode must be TransferOpcode.Read (0) or TransferOpcode.Write (1), got {v}"
        ))),
    }
}

/// `(name, msg)` bytes of a `TransferNotify`-like object (str or bytes fields).
fn notify_parts(obj: &Bound<'_, PyAny>) -> PyResult<(Vec<u8>, Vec<u8>)> {
    let field = |f: &str| -> PyResult<Vec<u8>> {
        let v = obj.getattr(f).map_err(|_| {
            PyTypeError::new_err(format!(
                "notify must have .name and .msg (TransferNotify), missing .{f}"
            ))
        })?;
        if let Ok(s) = v.extract::<String>() {
            return Ok(s.into_bytes());
        }
        v.extract::<Vec<u8>>()
            .map_err(|_| PyTypeError::new_err(format!("notify.{f} must be str or bytes")))
    };
    let (n, m) = (field("name")?, field("msg")?);
    if n.len() + m.len() > MAX_MESSAGE {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "notification of {} bytes exceeds the {MAX_MESSAGE}-byte limit",
            n.len() + m.len()
        )));
    }
    Ok((n, m))
}

/// The compat engine as a Python class (`pagewire.mooncake_compat.TransferEngine`
/// derives from it and adds the methods written in Python).
#[pyclass(
    module = "pagewire._native",
    name = "_MooncakeEngine",
    subclass,
    frozen
)]
pub(crate) struct MooncakeEngine {
    timeout: Duration,
    inner: RwLock<Option<Arc<Compat>>>,
}

impl MooncakeEngine {
    fn get(&self) -> Option<Arc<Compat>> {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Runs `f` on the initialized engine with the GIL released. Before `initialize`, on a
    /// failure (logged) or a panic, returns `on_fail` of Mooncake's code for the case.
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        on_fail: impl Fn(i32) -> T,
        f: impl FnOnce(&Compat) -> Res<T> + Send,
    ) -> T {
        let Some(c) = self.get() else {
            log(py, "error", &format!("{what}: called before initialize"));
            return on_fail(-1);
        };
        match py.detach(|| no_panic(|| f(&c))) {
            Ok(Ok(v)) => v,
            Ok(Err(f)) => {
                log(py, "error", &format!("{what}: {}", f.msg));
                on_fail(f.code)
            }
            Err(p) => {
                log(
                    py,
                    "error",
                    &format!("{what}: internal error (a bug in pagewire): {p}"),
                );
                on_fail(-1)
            }
        }
    }
}

/// A failed call's return value for `int` status methods: the failure's code.
fn code(c: i32) -> i32 {
    c
}

/// A failed call's return value for batch-id methods: Mooncake's sentinel 0.
fn no_batch(_: i32) -> u64 {
    0
}

#[pymethods]
impl MooncakeEngine {
    #[new]
    fn new() -> Self {
        MooncakeEngine {
            timeout: transfer_timeout_from_env(),
            inner: RwLock::new(None),
        }
    }

    /// Starts the engine. ``metadata_server`` must be ``"P2PHANDSHAKE"``.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, /))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i32 {
        if let Some(c) = self.get() {
            log(
                py,
                "warning",
                &format!(
                    "initialize: already initialized as {}; ignored",
                    c.session_name
                ),
            );
            return OK;
        }
        if metadata_server != "P2PHANDSHAKE" {
            log(
                py,
                "error",
                &format!(
                    "initialize: metadata server {metadata_server:?} is not supported (pagewire supports \"P2PHANDSHAKE\" only)"
                ),
            );
            return -1;
        }
        if protocol == "xgmi" {
            log(
                py,
                "error",
                "initialize: protocol \"xgmi\" is not supported",
            );
            return -1;
        }
        let (h, p, d, t) = (
            local_hostname.to_string(),
            protocol.to_string(),
            device_name.to_string(),
            self.timeout,
        );
        let r = py.detach(move || no_panic(|| init(&h, &p, &d, t)));
        match r {
            Ok(Ok((c, logs))) => {
                let mut w = self.inner.write().unwrap_or_else(|p| p.into_inner());
                if w.is_some() {
                    // Another thread won the race: keep its engine.
                    drop(w);
                    py.detach(|| c.stop());
                    return OK;
                }
                for (level, line) in logs {
                    log(py, &level, &format!("{}: {line}", c.session_name));
                }
                *w = Some(c);
                OK
            }
            Ok(Err(e)) => {
                log(py, "error", &format!("initialize: {e}"));
                -1
            }
            Err(p) => {
                log(
                    py,
                    "error",
                    &format!("initialize: internal error (a bug in pagewire): {p}"),
                );
                -1
            }
        }
    }

    /// ``initialize`` with the metadata type spelled out; only ``"P2PHANDSHAKE"`` works.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type, /))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i32 {
        let _ = metadata_type;
        self.initialize(py, local_hostname, metadata_server, protocol, device_name)
    }

    /// The handshake (RPC) port; the session id is ``f"{host}:{port}"``.
    fn get_rpc_port(&self, py: Python<'_>) -> i32 {
        match self.get() {
            Some(c) => i32::from(c.port),
            None => {
                log(py, "error", "get_rpc_port: called before initialize");
                -1
            }
        }
    }

    /// This engine's session id, ``"host:port"`` (``None`` before initialize).
    #[getter]
    fn session_id(&self) -> Option<String> {
        self.get().map(|c| c.session_name.clone())
    }

    /// The sync-transfer timeout from ``MC_TRANSFER_TIMEOUT``, in seconds (before the
    /// 1 ns per byte Mooncake adds).
    #[getter]
    fn _transfer_timeout(&self) -> f64 {
        self.timeout.as_secs_f64()
    }

    /// The data path in use: ``"verbs"``, ``"tcp"``, ``"loopback"`` (``None`` before
    /// initialize).
    #[getter]
    fn backend(&self) -> Option<&'static str> {
        self.get().map(|c| c.engine.backend_kind().as_str())
    }

    #[pyo3(signature = (buffer_addr, capacity, location="*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: &Bound<'_, PyAny>,
        capacity: &Bound<'_, PyAny>,
        location: &str,
    ) -> PyResult<i32> {
        let (a, n) = (
            addr(buffer_addr, "buffer_addr")?,
            addr(capacity, "capacity")?,
        );
        if location.starts_with("cuda")
            || location.starts_with("npu")
            || location.starts_with("musa")
        {
            log(
                py,
                "error",
                &format!(
                    "register_memory: location {location:?}: device memory is not supported by this build"
                ),
            );
            return Ok(ERR_INVALID_ARGUMENT);
        }
        Ok(self.call(py, "register_memory", code, move |c| {
            c.register(a, n).map(|_| OK)
        }))
    }

    #[pyo3(signature = (buffer_addr, /))]
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: &Bound<'_, PyAny>) -> PyResult<i32> {
        let a = addr(buffer_addr, "buffer_addr")?;
        Ok(self.call(py, "unregister_memory", code, move |c| {
            c.unregister(a).map(|_| OK)
        }))
    }

    #[pyo3(signature = (buffer_addresses, capacities, location="*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
        capacities: &Bound<'_, PyAny>,
        location: &str,
    ) -> PyResult<i32> {
        let (a, n) = (
            addrs(buffer_addresses, "buffer_addresses")?,
            addrs(capacities, "capacities")?,
        );
        if location.starts_with("cuda")
            || location.starts_with("npu")
            || location.starts_with("musa")
        {
            log(
                py,
                "error",
                &format!(
                    "batch_register_memory: location {location:?}: device memory is not supported by this build"
                ),
            );
            return Ok(ERR_INVALID_ARGUMENT);
        }
        Ok(self.call(py, "batch_register_memory", code, move |c| {
            if a.len() != n.len() {
                return Err(Fail::new(
                    ERR_INVALID_ARGUMENT,
                    format!("{} addresses but {} capacities", a.len(), n.len()),
                ));
            }
            // Mooncake's pre-checks over the whole batch first: zero length, then overlap
            // inside the batch.
            let mut sorted: Vec<(u64, u64)> = a.iter().copied().zip(n.iter().copied()).collect();
            sorted.sort_unstable();
            for (i, &(p, l)) in sorted.iter().enumerate() {
                if l == 0 {
                    return Err(Fail::new(ERR_INVALID_ARGUMENT, "zero-length registration"));
                }
                if i > 0 && sorted[i - 1].0.saturating_add(sorted[i - 1].1) > p {
                    return Err(Fail::new(
                        ERR_ADDRESS_OVERLAPPED,
                        format!("{p:#x} overlaps another entry of the batch"),
                    ));
                }
            }
            let mut done = Vec::new();
            for (&p, &l) in a.iter().zip(&n) {
                if let Err(f) = c.register(p, l) {
                    for d in done {
                        let _ = c.unregister(d);
                    }
                    return Err(f);
                }
                done.push(p);
            }
            Ok(OK)
        }))
    }

    #[pyo3(signature = (buffer_addresses, /))]
    fn batch_unregister_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let a = addrs(buffer_addresses, "buffer_addresses")?;
        Ok(self.call(py, "batch_unregister_memory", code, move |c| {
            // Best effort, as Mooncake: every address is tried, the first error returned.
            let mut first = None;
            for p in a {
                if let Err(f) = c.unregister(p)
                    && first.is_none()
                {
                    first = Some(f);
                }
            }
            first.map_or(Ok(OK), Err)
        }))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint=""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let (b, p, l) = (
            addr(buffer, "buffer")?,
            addr(peer_buffer_address, "peer_buffer_address")?,
            addr(length, "length")?,
        );
        Ok(self.call(py, "transfer_sync_write", code, move |c| {
            c.transfer_sync(target_hostname, Op::Write, &[b], &[p], &[l], None)
                .map(|_| OK)
        }))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint=""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let (b, p, l) = (
            addr(buffer, "buffer")?,
            addr(peer_buffer_address, "peer_buffer_address")?,
            addr(length, "length")?,
        );
        Ok(self.call(py, "transfer_sync_read", code, move |c| {
            c.transfer_sync(target_hostname, Op::Read, &[b], &[p], &[l], None)
                .map(|_| OK)
        }))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let (b, p, l) = (
            addrs(buffers, "buffers")?,
            addrs(peer_buffer_addresses, "peer_buffer_addresses")?,
            addrs(lengths, "lengths")?,
        );
        Ok(self.call(py, "batch_transfer_sync_write", code, move |c| {
            c.transfer_sync(target_hostname, Op::Write, &b, &p, &l, None)
                .map(|_| OK)
        }))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let (b, p, l) = (
            addrs(buffers, "buffers")?,
            addrs(peer_buffer_addresses, "peer_buffer_addresses")?,
            addrs(lengths, "lengths")?,
        );
        Ok(self.call(py, "batch_transfer_sync_read", code, move |c| {
            c.transfer_sync(target_hostname, Op::Read, &b, &p, &l, None)
                .map(|_| OK)
        }))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify=None, transport_hint=""))]
    #[allow(clippy::too_many_arguments)] // Mooncake's signature
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        opcode: &Bound<'_, PyAny>,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let (b, p, l) = (
            addr(buffer, "buffer")?,
            addr(peer_buffer_address, "peer_buffer_address")?,
            addr(length, "length")?,
        );
        let op = parse_opcode(opcode)?;
        let note = notify
            .filter(|n| !n.is_none())
            .map(notify_parts)
            .transpose()?;
        Ok(self.call(py, "transfer_sync", code, move |c| {
            let n = note.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
            c.transfer_sync(target_hostname, op, &[b], &[p], &[l], n)
                .map(|_| OK)
        }))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None, transport_hint=""))]
    #[allow(clippy::too_many_arguments)] // Mooncake's signature
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        opcode: &Bound<'_, PyAny>,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let (b, p, l) = (
            addrs(buffers, "buffers")?,
            addrs(peer_buffer_addresses, "peer_buffer_addresses")?,
            addrs(lengths, "lengths")?,
        );
        let op = parse_opcode(opcode)?;
        let note = notify
            .filter(|n| !n.is_none())
            .map(notify_parts)
            .transpose()?;
        Ok(self.call(py, "batch_transfer_sync", code, move |c| {
            let n = note.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice()));
            c.transfer_sync(target_hostname, op, &b, &p, &l, n)
                .map(|_| OK)
        }))
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let (b, p, l) = (
            addrs(buffers, "buffers")?,
            addrs(peer_buffer_addresses, "peer_buffer_addresses")?,
            addrs(lengths, "lengths")?,
        );
        Ok(
            self.call(py, "batch_transfer_async_write", no_batch, move |c| {
                c.transfer_async(target_hostname, Op::Write, &b, &p, &l)
            }),
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let (b, p, l) = (
            addrs(buffers, "buffers")?,
            addrs(peer_buffer_addresses, "peer_buffer_addresses")?,
            addrs(lengths, "lengths")?,
        );
        Ok(
            self.call(py, "batch_transfer_async_read", no_batch, move |c| {
                c.transfer_async(target_hostname, Op::Read, &b, &p, &l)
            }),
        )
    }

    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint=""))]
    #[allow(clippy::too_many_arguments)] // Mooncake's signature
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        opcode: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let (b, p, l) = (
            addrs(buffers, "buffers")?,
            addrs(peer_buffer_addresses, "peer_buffer_addresses")?,
            addrs(lengths, "lengths")?,
        );
        let op = parse_opcode(opcode)?;
        Ok(self.call(py, "batch_transfer_async", no_batch, move |c| {
            c.transfer_async(target_hostname, op, &b, &p, &l)
        }))
    }

    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint=""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let (b, p, l) = (
            addr(buffer, "buffer")?,
            addr(peer_buffer_address, "peer_buffer_address")?,
            addr(length, "length")?,
        );
        Ok(self.call(py, "transfer_submit_write", no_batch, move |c| {
            c.transfer_async(target_hostname, Op::Write, &[b], &[p], &[l])
        }))
    }

    #[pyo3(signature = (batch_id, /))]
    fn transfer_check_status(&self, py: Python<'_>, batch_id: &Bound<'_, PyAny>) -> PyResult<i32> {
        let id = addr(batch_id, "batch_id")?;
        Ok(self.call(py, "transfer_check_status", code, move |c| {
            Ok(c.check_status(id))
        }))
    }

    #[pyo3(signature = (batch_ids, /))]
    fn get_batch_transfer_status(
        &self,
        py: Python<'_>,
        batch_ids: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let ids = addrs(batch_ids, "batch_ids")?;
        Ok(self.call(py, "get_batch_transfer_status", code, move |c| {
            Ok(c.wait_all(&ids))
        }))
    }

    /// Drains the received notifications (each returned once), as ``(name, msg)`` pairs;
    /// the Python class wraps them in ``TransferNotify``.
    fn _get_notifies(&self) -> Vec<(String, String)> {
        match self.get() {
            Some(c) => c.mail.drain(),
            None => Vec::new(),
        }
    }

    #[pyo3(signature = (peer_server_name))]
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> i32 {
        self.call(py, "send_probe", code, move |c| {
            c.probe(peer_server_name).map(|_| OK)
        })
    }

    #[pyo3(signature = (segment_name, /))]
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> u64 {
        self.call(py, "get_first_buffer_address", no_batch, move |c| {
            c.first_buffer(segment_name)
        })
    }

    /// ``id``-like integer naming the underlying engine (0 before initialize).
    fn get_engine_ptr(&self) -> u64 {
        self.get().map_or(0, |c| Arc::as_ptr(&c) as u64)
    }

    /// JSON: the devices pagewire sees and the backend in use.
    #[pyo3(signature = (device_name=None))]
    fn get_local_topology(&self, device_name: Option<&str>) -> String {
        local_topology(
            device_name,
            self.get().map(|c| c.engine.backend_info().kind.as_str()),
        )
    }

    /// Stops the engine (pagewire extension; Mooncake's engine stops when collected).
    fn close(&self, py: Python<'_>) {
        let c = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(c) = c {
            let _ = py.detach(move || no_panic(|| c.stop()));
        }
    }

    /// Not implemented by pagewire; raises ``NotImplementedError``.
    #[pyo3(signature = (length, /))]
    fn allocate_managed_buffer(&self, length: &Bound<'_, PyAny>) -> PyResult<u64> {
        let _ = length;
        Err(not_implemented("allocate_managed_buffer"))
    }
}

fn not_implemented(what: &str) -> PyErr {
    PyNotImplementedError::new_err(format!(
        "pagewire.mooncake_compat.TransferEngine.{what} is not implemented (register your own memory with register_memory)"
    ))
}

impl Drop for MooncakeEngine {
    fn drop(&mut self) {
        let c = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(c) = c {
            let _ = Python::attach(|py| py.detach(move || no_panic(|| c.stop())));
        }
    }
}

/// A small JSON topology: devices pagewire can open (verbs builds) and the backend.
fn local_topology(device_filter: Option<&str>, backend: Option<&str>) -> String {
    #[allow(unused_mut)]
    let mut devices: Vec<String> = Vec::new();
    #[cfg(feature = "verbs")]
    if let Ok(list) = pagewire_transport::verbs::list_devices() {
        let wanted: Vec<&str> = device_filter
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        for d in list {
            if wanted.is_empty() || wanted.contains(&d.name.as_str()) {
                devices.push(d.name.clone());
            }
        }
    }
    #[cfg(not(feature = "verbs"))]
    let _ = device_filter;
    let quoted: Vec<String> = devices
        .iter()
        .map(|d| format!("\"{}\"", d.replace('"', "")))
        .collect();
    let list = quoted.join(", ");
    match backend {
        Some(b) => format!(
            "{{\"cpu:0\": {{\"preferred_hca\": [{list}], \"avail_hca\": []}}, \"pagewire_backend\": \"{b}\"}}"
        ),
        None => format!("{{\"cpu:0\": {{\"preferred_hca\": [{list}], \"avail_hca\": []}}}}"),
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MooncakeEngine>()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atoi_as_c() {
        assert_eq!(atoi("30"), 30);
        assert_eq!(atoi("  7s"), 7);
        assert_eq!(atoi("-3"), -3);
        assert_eq!(atoi("x"), 0);
        assert_eq!(atoi(""), 0);
    }

    #[test]
    fn session_ids() {
        assert_eq!(parse_sid("127.0.0.1:15001").ok().unwrap()[0].port(), 15001);
        assert!(parse_sid("[::1]:15001").ok().unwrap()[0].is_ipv6());
        assert_eq!(parse_sid("127.0.0.1").err().unwrap().code, ERR_METADATA);
        assert_eq!(parse_sid("::1:15001").err().unwrap().code, ERR_METADATA);
        assert_eq!(parse_sid("127.0.0.1:0").err().unwrap().code, ERR_METADATA);
        assert_eq!(
            parse_sid("127.0.0.1:99999").err().unwrap().code,
            ERR_METADATA
        );
        assert_eq!(host_part("10.0.0.1"), "10.0.0.1");
        assert_eq!(host_part("10.0.0.1:1234"), "10.0.0.1");
        assert_eq!(host_part("10.0.0.1:1234:npu_2"), "10.0.0.1");
        assert_eq!(host_part("::1"), "::1");
        assert_eq!(host_part("[fe80::1]:80"), "fe80::1");
        assert_eq!(join_host_port("::1", 15000), "[::1]:15000");
        assert_eq!(join_host_port("node-3", 15000), "node-3:15000");
    }

    #[test]
    fn overlaps() {
        let mut m = BTreeMap::new();
        m.insert(100u64, (50u64, ()));
        assert!(overlap(&m, 100, 150).is_some());
        assert!(overlap(&m, 120, 130).is_some());
        assert!(overlap(&m, 50, 101).is_some());
        assert!(overlap(&m, 149, 200).is_some());
        assert!(overlap(&m, 150, 200).is_none());
        assert!(overlap(&m, 0, 100).is_none());
    }
}
