//! A standalone store client and its dummy clients, in the manner of Mooncake's
//! `mooncake_client` ("real client") and `setup_dummy`.
//!
//! * [`RealClient`]: a [`StoreClient`] (its segment, its engine, its master link) that
//!   also listens on a local Unix socket for dummy clients of the same host.
//! * [`DummyClient`]: a process without segment or engine. Its buffers are shared memory
//!   ([`SharedBuf`]: sealed memfds) that the real client maps and registers with its own
//!   engine, so a put reads straight from the dummy's pages and a get lands straight in
//!   them; the socket carries keys and `(region, offset, length)` triples only
//!   ([`crate::ipc`]).
//!
//! The socket is hostile input: a peer of another user id is refused (`SO_PEERCRED`), the
//! first frame must present the store's token within [`HELLO_TIMEOUT`], connections and
//! mapped regions are bounded, every frame has a deadline and a size cap, and every span
//! is checked against its mapping before the engine touches it. A received memfd must be
//! sealed against shrinking (else a dummy could truncate it under a transfer and kill the
//! real client with SIGBUS).
//!
//! Addresses ([`IpcAddr`]): Mooncake's `server_address` form `host:port` names the abstract
//! socket `@pagewire_client_<port>.sock` (the host is not used: shared memory needs the
//! same host); `@name` an abstract socket; `unix:/path` or `/path` a socket file (created
//! with mode 0600).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::client::{PutOptions, StoreClient};
use crate::error::{Code, Result, StoreError};
use crate::ipc::{self, IpcItem, IpcRequest, IpcResponse, ShmSpan};
use crate::local::Span;
use crate::proto::ProtoError;
use crate::shm::{self, SharedMem};

/// Deadline for a new connection's `Hello`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Deadline for the rest of a frame once its first byte arrived, and for writing a reply.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(5);
/// A dummy silent this long is disconnected (dummies ping every [`KEEPALIVE`]).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often an idle dummy pings its real client.
pub const KEEPALIVE: Duration = Duration::from_secs(15);
/// Prefix of the abstract socket name a `host:port` address stands for.
pub const ABSTRACT_PREFIX: &str = "pagewire_client_";

// ---------------------------------------------------------------- addresses

/// Where a real client listens for dummies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcAddr {
    /// A Linux abstract socket name (no file; guarded by the peer's user id and the token).
    Abstract(String),
    /// A socket file.
    Path(PathBuf),
}

impl FromStr for IpcAddr {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<IpcAddr> {
        let s = s.trim();
        if let Some(p) = s.strip_prefix("unix:") {
            return Ok(IpcAddr::Path(PathBuf::from(p)));
        }
        if s.starts_with('/') || s.starts_with("./") {
            return Ok(IpcAddr::Path(PathBuf::from(s)));
        }
        if let Some(name) = s.strip_prefix('@') {
            if name.is_empty() || name.len() > 100 {
                return Err(StoreError::invalid(format!(
                    "abstract socket name {s:?} is empty or longer than 100 bytes"
                )));
            }
            return Ok(IpcAddr::Abstract(name.to_string()));
        }
        let port = s
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .filter(|&p| p != 0)
            .ok_or_else(|| {
                StoreError::invalid(format!(
                    "dummy endpoint {s:?}: expected host:port (Mooncake's server_address), \
                     @abstract-name, unix:/path or /path"
                ))
            })?;
        Ok(IpcAddr::Abstract(format!("{ABSTRACT_PREFIX}{port}.sock")))
    }
}

impl fmt::Display for IpcAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpcAddr::Abstract(n) => write!(f, "@{n}"),
            IpcAddr::Path(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl IpcAddr {
    fn socket_addr(&self) -> io::Result<UnixAddr> {
        match self {
            IpcAddr::Abstract(n) => UnixAddr::from_abstract_name(n.as_bytes()),
            IpcAddr::Path(p) => UnixAddr::from_pathname(p),
        }
    }

    fn connect(&self) -> io::Result<UnixStream> {
        UnixStream::connect_addr(&self.socket_addr()?)
    }

    fn bind(&self) -> io::Result<UnixListener> {
        if let IpcAddr::Path(p) = self {
            // A socket file nobody listens on is a leftover: replace it. Anything else
            // (a live socket, a regular file) is left alone.
            use std::os::unix::fs::FileTypeExt;
            if let Ok(m) = std::fs::symlink_metadata(p)
                && m.file_type().is_socket()
                && UnixStream::connect(p).is_err()
            {
                let _ = std::fs::remove_file(p);
            }
            let l = UnixListener::bind(p)?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))?;
            return Ok(l);
        }
        UnixListener::bind_addr(&self.socket_addr()?)
    }
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    // Constant time in the contents (the length of a token is not secret enough to hide).
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------- framing

fn set_deadline(s: &UnixStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))
}

/// Fills `buf` by `deadline`, collecting descriptors sent along.
fn read_full(
    s: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        set_deadline(s, deadline)?;
        match shm::recv_with_fds(s, &mut buf[at..], fds) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::ErrorKind::TimedOut.into());
            }
            Err(e) => return Err(e),
        }
        if fds.len() > 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more than one descriptor in a frame",
            ));
        }
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
enum FrameError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Proto(#[from] ProtoError),
}

/// Reads one frame: the header by `first` (the idle or hello deadline), the body within
/// [`FRAME_TIMEOUT`] of the header, both capped by `max`.
fn read_frame(
    s: &UnixStream,
    max: u32,
    first: Instant,
    fds: &mut Vec<OwnedFd>,
) -> std::result::Result<(u8, Vec<u8>), FrameError> {
    let mut h = [0u8; ipc::HEADER_LEN];
    read_full(s, &mut h, fds, first)?;
    let header = ipc::decode_header(&h, max)?;
    let mut body = vec![0u8; header.len as usize];
    read_full(s, &mut body, fds, Instant::now() + FRAME_TIMEOUT)?;
    Ok((header.kind, body))
}

fn write_frame(s: &UnixStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    set_deadline(s, deadline)?;
    let mut w = s;
    w.write_all(bytes).map_err(|e| {
        if e.kind() == io::ErrorKind::WouldBlock {
            io::ErrorKind::TimedOut.into()
        } else {
            e
        }
    })
}

// ---------------------------------------------------------------- the real client

/// Settings of the dummy endpoint of a [`RealClient`].
#[derive(Debug, Clone)]
pub struct RealClientConfig {
    /// Where to listen.
    pub address: IpcAddr,
    /// The token a dummy must present. `None`: the store client's own (the one that
    /// guards its master link and segment), so one secret guards the dummy endpoint too;
    /// a store client without a token takes any, still only from processes of this user
    /// id. A token here that differs from the store client's is refused at start.
    pub token: Option<String>,
    /// Most dummies connected at once (more are closed at once).
    pub max_dummies: usize,
    /// Most shared regions one dummy may have mapped.
    pub max_regions: usize,
    /// Largest shared region mapped (bytes).
    pub max_region_size: u64,
}

impl RealClientConfig {
    /// Defaults around an address: 64 dummies, 256 regions of up to 1 TiB each.
    pub fn new(address: IpcAddr) -> Self {
        RealClientConfig {
            address,
            token: None,
            max_dummies: 64,
            max_regions: 256,
            max_region_size: 1 << 40,
        }
    }
}

struct Shared {
    store: StoreClient,
    cfg: RealClientConfig,
    uid: u32,
    live: AtomicUsize,
    stop: AtomicBool,
    /// The live connections (a clone of each socket), so that shutdown can end them.
    conns: Mutex<BTreeMap<u64, UnixStream>>,
    next_conn: std::sync::atomic::AtomicU64,
}

/// A store client serving dummy clients of this host (see the module docs). Dropping it
/// (or [`RealClient::shutdown`]) stops the listener; connected dummies are served until
/// they leave.
pub struct RealClient {
    shared: Arc<Shared>,
    accept: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl fmt::Debug for RealClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RealClient")
            .field("address", &self.shared.cfg.address.to_string())
            .field("store", &self.shared.store)
            .finish()
    }
}

impl RealClient {
    /// Listens at `cfg.address` for dummies of `store`.
    pub fn start(store: StoreClient, mut cfg: RealClientConfig) -> Result<RealClient> {
        match (cfg.token.as_deref(), store.token()) {
            (Some(a), Some(b)) if a != b => {
                return Err(StoreError::Config {
                    key: "token".into(),
                    value: "(not shown)".into(),
                    reason: "the dummy endpoint's token differs from the store client's: \
                             one token guards the master, the segment and the dummies"
                        .into(),
                });
            }
            (None, Some(b)) => cfg.token = Some(b.to_string()),
            _ => {}
        }
        let listener = cfg
            .address
            .bind()
            .map_err(|e| StoreError::io(format!("listen on {}", cfg.address), e))?;
        let shared = Arc::new(Shared {
            store,
            cfg,
            uid: shm::own_uid(),
            live: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            conns: Mutex::new(BTreeMap::new()),
            next_conn: std::sync::atomic::AtomicU64::new(0),
        });
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name("pagewire-dummy-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| StoreError::io("spawn accept thread", e))?;
        Ok(RealClient {
            shared,
            accept: Mutex::new(Some(h)),
        })
    }

    /// The store client (its endpoint, segment, engine).
    pub fn store(&self) -> &StoreClient {
        &self.shared.store
    }

    /// The address dummies connect to.
    pub fn address(&self) -> &IpcAddr {
        &self.shared.cfg.address
    }

    /// Dummies connected now.
    pub fn dummies(&self) -> usize {
        self.shared.live.load(Ordering::Acquire)
    }

    /// Stops accepting dummies, disconnects the connected ones (their mappings are
    /// deregistered and unmapped as their threads end) and removes a socket file.
    /// Idempotent.
    pub fn shutdown(&self) {
        if self.shared.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the blocked accept.
        let _ = self.shared.cfg.address.connect();
        if let Some(h) = self.accept.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
        for c in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let IpcAddr::Path(p) = &self.shared.cfg.address {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for RealClient {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A connection's place: counted in `live` and listed in `conns` until its thread ends.
struct Slot(Arc<Shared>, u64);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.1);
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: UnixListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(conn) = conn else {
            // EMFILE and the like: back off instead of spinning.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if shared.live.fetch_add(1, Ordering::AcqRel) >= shared.cfg.max_dummies {
            shared.live.fetch_sub(1, Ordering::AcqRel);
            refuse(&conn, Code::Internal, "too many dummy clients");
            continue;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let slot = Slot(shared.clone(), id);
        if let Ok(c) = conn.try_clone() {
            shared
                .conns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, c);
        }
        let spawned = std::thread::Builder::new()
            .name("pagewire-dummy".into())
            .spawn(move || {
                let s = slot;
                if let Err(e) = serve(&conn, &s.0) {
                    tracing::debug!("dummy connection ended: {e}");
                }
            });
        if spawned.is_err() {
            tracing::warn!("could not spawn a thread for a dummy client");
        }
    }
}

fn refuse(conn: &UnixStream, code: Code, message: &str) {
    let mut b = Vec::new();
    IpcResponse::Error {
        code,
        message: message.into(),
    }
    .encode(&mut b);
    let _ = write_frame(conn, &b, Instant::now() + Duration::from_millis(100));
}

/// One dummy's mapped regions: id -> mapping (registered with the store client).
struct Regions<'a> {
    store: &'a StoreClient,
    map: BTreeMap<u32, SharedMem>,
    next: u32,
}

impl Regions<'_> {
    /// The span in this process for a dummy span, if it lies inside one of its mappings.
    fn span(&self, s: &ShmSpan) -> Option<Span> {
        let m = self.map.get(&s.region)?;
        let end = s.offset.checked_add(s.len)?;
        if s.len == 0 || end > m.len() {
            return None;
        }
        Some(Span::new(m.addr() + s.offset, s.len))
    }

    /// Translates every item; `None` for one with a span outside its regions.
    fn items(&self, items: &[IpcItem]) -> Vec<Option<Vec<Span>>> {
        items
            .iter()
            .map(|it| it.parts.iter().map(|p| self.span(p)).collect())
            .collect()
    }
}

impl Drop for Regions<'_> {
    fn drop(&mut self) {
        for (_, m) in std::mem::take(&mut self.map) {
            // Waits for transfers that use it; only then may the mapping go. If that does
            // not finish, the mapping is leaked rather than unmapped under the engine.
            if let Err(e) = self.store.unregister_buffer(m.addr() as *mut u8) {
                tracing::warn!("a dummy's region stays mapped: deregistering it failed: {e}");
                std::mem::forget(m);
            }
        }
    }
}

/// Runs the call on the translated items only; the others get `InvalidParams`.
fn on_valid<T>(
    keys: Vec<Vec<u8>>,
    spans: Vec<Option<Vec<Span>>>,
    ok: impl Fn(T) -> i64,
    call: impl FnOnce(&[Vec<u8>], &[Vec<Span>]) -> Result<Vec<std::result::Result<T, Code>>>,
) -> Result<Vec<i64>> {
    let mut out = vec![Code::InvalidParams.as_i32() as i64; keys.len()];
    let mut idx = Vec::new();
    let (mut k, mut p) = (Vec::new(), Vec::new());
    for (i, (key, s)) in keys.into_iter().zip(spans).enumerate() {
        if let Some(s) = s {
            idx.push(i);
            k.push(key);
            p.push(s);
        }
    }
    if !idx.is_empty() {
        for (i, r) in idx.into_iter().zip(call(&k, &p)?) {
            out[i] = r.map_or_else(|c| c.as_i32() as i64, &ok);
        }
    }
    Ok(out)
}

fn handle(
    req: IpcRequest,
    fd: Option<OwnedFd>,
    regions: &mut Regions<'_>,
    shared: &Shared,
) -> Result<IpcResponse> {
    let store = &shared.store;
    let codes = |v: Vec<Code>| v.into_iter().map(|c| c.as_i32() as i64).collect();
    if fd.is_some() && !matches!(req, IpcRequest::Map { .. }) {
        return Err(StoreError::invalid(
            "a descriptor came with a frame that takes none",
        ));
    }
    Ok(IpcResponse::Codes(match req {
        IpcRequest::Hello { .. } => return Err(StoreError::invalid("hello twice")),
        IpcRequest::Map { size } => {
            let fd = fd.ok_or_else(|| StoreError::invalid("map without a descriptor"))?;
            if regions.map.len() >= shared.cfg.max_regions {
                return Err(StoreError::invalid("too many shared regions"));
            }
            let m = SharedMem::map_received(fd, size, shared.cfg.max_region_size)
                .map_err(|e| StoreError::invalid(format!("shared region refused: {e}")))?;
            // SAFETY: the mapping is owned by `regions` and is deregistered (waiting for
            // transfers) before it is unmapped: in `Unmap` and in `Regions::drop`. Its
            // size cannot shrink (sealed, checked by map_received).
            unsafe { store.register_buffer(m.addr() as *mut u8, m.len() as usize) }?;
            let id = regions.next;
            regions.next = regions.next.wrapping_add(1).max(1);
            regions.map.insert(id, m);
            vec![id as i64]
        }
        IpcRequest::Unmap { region } => {
            let Some(m) = regions.map.get(&region) else {
                return Err(StoreError::invalid(format!("no region {region}")));
            };
            store.unregister_buffer(m.addr() as *mut u8)?;
            regions.map.remove(&region);
            vec![0]
        }
        IpcRequest::Put {
            replicas,
            pin,
            preferred,
            items,
        } => {
            let spans = regions.items(&items);
            let keys = items.into_iter().map(|i| i.key).collect();
            let opts = PutOptions {
                replicas,
                pin,
                preferred: Some(preferred).filter(|p| !p.is_empty()),
            };
            on_valid(keys, spans, |()| 0, |k, p| store.put(k, p, &opts))?
        }
        IpcRequest::Get { items } => {
            let spans = regions.items(&items);
            let keys = items.into_iter().map(|i| i.key).collect();
            on_valid(keys, spans, |n: u64| n as i64, |k, p| store.get(k, p))?
        }
        IpcRequest::Exist { keys } => store
            .exist(&keys)?
            .into_iter()
            .map(|r| r.map_or_else(|c| c.as_i32() as i64, |b| b as i64))
            .collect(),
        IpcRequest::Size { keys } => store
            .query(&keys, false)?
            .into_iter()
            .map(|r| r.map_or_else(|c| c.as_i32() as i64, |l| l.size as i64))
            .collect(),
        IpcRequest::Remove { force, keys } => codes(store.remove(&keys, force)?),
        IpcRequest::RemoveAll { force } => vec![store.remove_all(force)? as i64],
        IpcRequest::RemoveMatching { force, pattern } => {
            vec![store.remove_matching(&pattern, force)? as i64]
        }
        IpcRequest::Ping => {
            store.ping(Duration::from_secs(2))?;
            vec![0]
        }
        IpcRequest::Endpoint => return Ok(IpcResponse::Text(store.endpoint().to_string())),
    }))
}

fn serve(conn: &UnixStream, shared: &Shared) -> std::result::Result<(), FrameError> {
    let uid = shm::peer_uid(conn)?;
    if uid != shared.uid {
        refuse(
            conn,
            Code::Unauthorized,
            "the real client serves its own user id only",
        );
        return Ok(());
    }
    let mut fds = Vec::new();
    let (kind, body) = read_frame(
        conn,
        ipc::MAX_HELLO_FRAME,
        Instant::now() + HELLO_TIMEOUT,
        &mut fds,
    )?;
    let token = match ipc::decode_request(kind, &body) {
        Ok(IpcRequest::Hello { token }) if fds.is_empty() => token,
        _ => {
            refuse(conn, Code::Unauthorized, "the first frame must be a hello");
            return Ok(());
        }
    };
    let want = shared.cfg.token.as_deref().unwrap_or("").as_bytes();
    if !ct_eq(&token, want) {
        refuse(conn, Code::Unauthorized, "bad token");
        return Ok(());
    }
    let mut out = Vec::new();
    IpcResponse::Codes(Vec::new()).encode(&mut out);
    write_frame(conn, &out, Instant::now() + FRAME_TIMEOUT)?;
    let mut regions = Regions {
        store: &shared.store,
        map: BTreeMap::new(),
        next: 1,
    };
    loop {
        let mut fds = Vec::new();
        let (kind, body) = read_frame(
            conn,
            ipc::MAX_FRAME,
            Instant::now() + IDLE_TIMEOUT,
            &mut fds,
        )?;
        let resp = match ipc::decode_request(kind, &body) {
            Ok(req) => handle(req, fds.pop(), &mut regions, shared).unwrap_or_else(|e| {
                IpcResponse::Error {
                    code: e.code(),
                    message: e.to_string(),
                }
            }),
            Err(e) => {
                // A frame that does not decode ends the connection: the stream may be out
                // of step.
                refuse(conn, Code::InvalidParams, &e.to_string());
                return Err(e.into());
            }
        };
        out.clear();
        resp.encode(&mut out);
        write_frame(conn, &out, Instant::now() + FRAME_TIMEOUT)?;
    }
}

// ---------------------------------------------------------------- shared buffers

/// Live shared buffers of this process, by start address (what [`DummyClient`] looks
/// buffers up in).
fn registry() -> &'static Mutex<BTreeMap<u64, Weak<SharedMem>>> {
    static R: std::sync::OnceLock<Mutex<BTreeMap<u64, Weak<SharedMem>>>> =
        std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

fn lookup(addr: u64, len: u64) -> Option<Arc<SharedMem>> {
    let end = addr.checked_add(len)?;
    let r = registry().lock().unwrap_or_else(|p| p.into_inner());
    let (_, w) = r.range(..=addr).next_back()?;
    let m = w.upgrade()?;
    (end <= m.addr() + m.len()).then_some(m)
}

/// Memory a dummy client can hand to its real client: a sealed memfd mapped in this
/// process (Mooncake's `MooncakeHostMemAllocator` / `alloc_from_mem_pool`). The real
/// client maps the same pages, so puts and gets move no byte through the socket. Another
/// process writes these pages: their contents are read and written by copies only.
#[derive(Debug, Clone)]
pub struct SharedBuf {
    mem: Arc<SharedMem>,
}

impl SharedBuf {
    /// `len` bytes of zeroed shared memory (pages are allocated as they are touched).
    pub fn new(len: usize) -> Result<SharedBuf> {
        let mem = Arc::new(
            SharedMem::create(len)
                .map_err(|e| StoreError::io(format!("memfd of {len} bytes"), e))?,
        );
        let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
        // Entries of mappings gone (and maybe reused by this one) would shadow it.
        r.retain(|_, w| w.strong_count() > 0);
        r.insert(mem.addr(), Arc::downgrade(&mem));
        drop(r);
        Ok(SharedBuf { mem })
    }

    /// Start address in this process.
    pub fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.mem.len()
    }

    /// Whether the length is 0 (never: [`SharedBuf::new`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.mem.len() == 0
    }

    /// Copies `src` to `offset`; `InvalidArgument` if it does not fit.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.mem
            .write(offset, src)
            .then_some(())
            .ok_or_else(|| StoreError::invalid("write outside the shared buffer"))
    }

    /// Copies from `offset` into `dst`; `InvalidArgument` if it does not fit.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.mem
            .read(offset, dst)
            .then_some(())
            .ok_or_else(|| StoreError::invalid("read outside the shared buffer"))
    }
}

impl Drop for SharedBuf {
    fn drop(&mut self) {
        // The last handle of this mapping forgets it (a dummy's registration keeps its own
        // strong reference until unregistered).
        if Arc::strong_count(&self.mem) == 1 {
            let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
            if r.get(&self.mem.addr())
                .is_some_and(|w| w.ptr_eq(&Arc::downgrade(&self.mem)))
            {
                r.remove(&self.mem.addr());
            }
        }
    }
}

// ---------------------------------------------------------------- dummy clients

/// Settings of a [`DummyClient`].
#[derive(Debug, Clone)]
pub struct DummyConfig {
    /// The real client's address.
    pub address: IpcAddr,
    /// The store's token (none: send none).
    pub token: Option<String>,
    /// Deadline of each call (default 40 s: longer than the real client's own 30 s per
    /// store call, so a slow store call comes back as the store's error, not as a lost
    /// connection).
    pub timeout: Duration,
}

impl DummyConfig {
    /// Defaults around an address.
    pub fn new(address: IpcAddr) -> Self {
        DummyConfig {
            address,
            token: None,
            timeout: Duration::from_secs(40),
        }
    }
}

struct DummyInner {
    cfg: DummyConfig,
    /// The connection; `None` after a failure (the next call connects again) or `close`.
    conn: Mutex<Option<UnixStream>>,
    /// Registered buffers: start -> (region id, the mapping kept alive while registered).
    /// Locked before `conn` wherever both are held.
    regions: Mutex<BTreeMap<u64, (u32, Arc<SharedMem>)>>,
    closed: AtomicBool,
}

/// A store client without segment or engine that works through a [`RealClient`] of the
/// same host (Mooncake's `setup_dummy`). Cheap to clone.
///
/// When the connection fails (the real client restarted, a reply timed out), the call
/// that saw it fails and the next one connects again, presents the token and maps every
/// registered buffer anew.
#[derive(Clone)]
pub struct DummyClient {
    inner: Arc<DummyInner>,
}

impl fmt::Debug for DummyClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DummyClient")
            .field("address", &self.inner.cfg.address.to_string())
            .finish()
    }
}

fn gone(what: impl fmt::Display) -> StoreError {
    StoreError::MasterGone {
        addr: "the standalone client".into(),
        reason: what.to_string(),
    }
}

/// One request and its reply on `conn`, by `deadline`.
fn exchange(
    conn: &UnixStream,
    req: &IpcRequest,
    fd: Option<&SharedMem>,
    deadline: Instant,
) -> std::result::Result<IpcResponse, FrameError> {
    let mut out = Vec::new();
    req.encode(&mut out);
    match fd {
        Some(m) => {
            set_deadline(conn, deadline)?;
            shm::send_with_fd(conn, &out, m.fd())?;
        }
        None => write_frame(conn, &out, deadline)?,
    }
    let mut fds = Vec::new();
    let (kind, body) = read_frame(conn, ipc::MAX_FRAME, deadline, &mut fds)?;
    if !fds.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "unexpected descriptor").into());
    }
    Ok(ipc::decode_response(kind, &body)?)
}

impl DummyInner {
    /// The error a failed exchange stands for.
    fn failed(&self, e: FrameError) -> StoreError {
        match e {
            FrameError::Io(e) if e.kind() == io::ErrorKind::TimedOut => StoreError::Timeout {
                what: "the standalone client's reply",
                after: self.cfg.timeout,
            },
            FrameError::Proto(e) => StoreError::Protocol {
                from: self.cfg.address.to_string(),
                source: e,
            },
            FrameError::Io(e) => gone(e),
        }
    }

    /// One exchange; a reply that is an error becomes `Rejected`.
    fn checked(
        &self,
        conn: &UnixStream,
        req: &IpcRequest,
        fd: Option<&SharedMem>,
        deadline: Instant,
    ) -> Result<IpcResponse> {
        match exchange(conn, req, fd, deadline).map_err(|e| self.failed(e))? {
            IpcResponse::Error { code, message } => Err(StoreError::Rejected { code, message }),
            r => Ok(r),
        }
    }

    /// A new connection: the server's user id checked, the token presented.
    fn open(&self, deadline: Instant) -> Result<UnixStream> {
        let addr = &self.cfg.address;
        let conn = addr.connect().map_err(|e| StoreError::MasterUnreachable {
            addr: addr.to_string(),
            source: Arc::new(e),
        })?;
        // Whoever holds the name must be of our user id: the token is not handed to a
        // squatter of another user.
        let uid = shm::peer_uid(&conn).map_err(|e| StoreError::io("SO_PEERCRED", e))?;
        if uid != shm::own_uid() {
            return Err(StoreError::Rejected {
                code: Code::Unauthorized,
                message: format!("{addr} is served by user id {uid}, not ours"),
            });
        }
        let token = self.cfg.token.clone().unwrap_or_default().into_bytes();
        self.checked(&conn, &IpcRequest::Hello { token }, None, deadline)?;
        Ok(conn)
    }

    /// Connects again if the connection was lost, mapping every registered buffer anew.
    fn ensure(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Shutdown);
        }
        let mut regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if conn.is_some() {
            return Ok(());
        }
        let deadline = Instant::now() + self.cfg.timeout;
        let c = self.open(deadline)?;
        for (id, m) in regions.values_mut() {
            *id = region_of(self.checked(
                &c,
                &IpcRequest::Map { size: m.len() },
                Some(m),
                deadline,
            )?)?;
        }
        *conn = Some(c);
        Ok(())
    }

    /// One exchange on the connection; a broken one is dropped (the next call connects
    /// again): the stream may be out of step.
    fn call(&self, req: IpcRequest, fd: Option<&SharedMem>) -> Result<IpcResponse> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(conn) = guard.as_ref() else {
            return Err(if self.closed.load(Ordering::Acquire) {
                StoreError::Shutdown
            } else {
                gone("the connection was lost")
            });
        };
        let deadline = Instant::now() + self.cfg.timeout;
        match exchange(conn, &req, fd, deadline) {
            Ok(IpcResponse::Error { code, message }) => Err(StoreError::Rejected { code, message }),
            Ok(resp) => Ok(resp),
            Err(e) => {
                *guard = None;
                Err(self.failed(e))
            }
        }
    }
}

fn region_of(r: IpcResponse) -> Result<u32> {
    match r {
        IpcResponse::Codes(v) if v.len() == 1 && v[0] > 0 && v[0] <= u32::MAX as i64 => {
            Ok(v[0] as u32)
        }
        other => Err(gone(format!("unexpected reply {other:?}"))),
    }
}

impl DummyClient {
    /// Connects to the real client and presents the token.
    pub fn connect(cfg: DummyConfig) -> Result<DummyClient> {
        let inner = DummyInner {
            cfg,
            conn: Mutex::new(None),
            regions: Mutex::new(BTreeMap::new()),
            closed: AtomicBool::new(false),
        };
        let conn = inner.open(Instant::now() + inner.cfg.timeout)?;
        *inner.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
        let c = DummyClient {
            inner: Arc::new(inner),
        };
        let weak = Arc::downgrade(&c.inner);
        std::thread::Builder::new()
            .name("pagewire-dummy-ping".into())
            .spawn(move || keepalive(weak))
            .map_err(|e| StoreError::io("spawn keepalive thread", e))?;
        Ok(c)
    }

    fn call(&self, req: IpcRequest, fd: Option<&SharedMem>) -> Result<IpcResponse> {
        self.inner.ensure()?;
        self.inner.call(req, fd)
    }

    fn codes(&self, req: IpcRequest, n: usize) -> Result<Vec<i64>> {
        match self.call(req, None)? {
            IpcResponse::Codes(v) if v.len() == n => Ok(v),
            other => Err(gone(format!("unexpected reply {other:?}"))),
        }
    }

    /// Makes the shared buffer that holds `[ptr, ptr+len)` usable by puts and gets: the
    /// real client maps it (once per buffer). Memory that is not a [`SharedBuf`] of this
    /// process is refused (`InvalidArgument`).
    pub fn register_buffer(&self, ptr: u64, len: u64) -> Result<()> {
        let mem = lookup(ptr, len).filter(|_| len > 0).ok_or_else(|| {
            StoreError::invalid(format!(
                "{ptr:#x}+{len} is not inside shared memory of this process \
                 (allocate it with the dummy's allocator)"
            ))
        })?;
        self.inner.ensure()?;
        let mut regions = self.inner.regions.lock().unwrap_or_else(|p| p.into_inner());
        if regions.contains_key(&mem.addr()) {
            return Ok(());
        }
        let id = region_of(
            self.inner
                .call(IpcRequest::Map { size: mem.len() }, Some(&mem))?,
        )?;
        regions.insert(mem.addr(), (id, mem));
        Ok(())
    }

    /// Unregisters the shared buffer that holds `ptr` (the real client unmaps it).
    pub fn unregister_buffer(&self, ptr: u64) -> Result<()> {
        self.inner.ensure()?;
        let mut regions = self.inner.regions.lock().unwrap_or_else(|p| p.into_inner());
        let Some((&base, &(id, _))) = regions
            .range(..=ptr)
            .next_back()
            .filter(|(_, (_, m))| ptr < m.addr() + m.len())
        else {
            return Err(StoreError::invalid(format!("{ptr:#x} is not registered")));
        };
        match self.inner.call(IpcRequest::Unmap { region: id }, None)? {
            IpcResponse::Codes(v) if v.len() == 1 => {}
            other => return Err(gone(format!("unexpected reply {other:?}"))),
        }
        regions.remove(&base);
        Ok(())
    }

    /// Shared spans for local ones; `None` for an object with a span not registered.
    fn spans<P: AsRef<[Span]>>(&self, parts: &[P]) -> Vec<Option<Vec<ShmSpan>>> {
        let regions = self.inner.regions.lock().unwrap_or_else(|p| p.into_inner());
        parts
            .iter()
            .map(|p| {
                p.as_ref()
                    .iter()
                    .map(|s| {
                        let (_, (id, m)) = regions.range(..=s.addr).next_back()?;
                        let end = s.addr.checked_add(s.len)?;
                        (s.len > 0 && end <= m.addr() + m.len()).then(|| ShmSpan {
                            region: *id,
                            offset: s.addr - m.addr(),
                            len: s.len,
                        })
                    })
                    .collect()
            })
            .collect()
    }

    fn items<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        keys: &[K],
        parts: &[P],
    ) -> Result<(Vec<usize>, Vec<IpcItem>)> {
        if keys.len() != parts.len() {
            return Err(StoreError::invalid(format!(
                "{} keys but {} part lists",
                keys.len(),
                parts.len()
            )));
        }
        let mut idx = Vec::new();
        let mut items = Vec::new();
        for (i, (k, s)) in keys.iter().zip(self.spans(parts)).enumerate() {
            let k = k.as_ref();
            if let Some(s) = s.filter(|s| !s.is_empty() && s.len() <= ipc::MAX_PARTS)
                && !k.is_empty()
                && k.len() <= crate::proto::MAX_KEY_LEN
            {
                idx.push(i);
                items.push(IpcItem {
                    key: k.to_vec(),
                    parts: s,
                });
            }
        }
        Ok((idx, items))
    }

    /// Stores each `keys[i]` as the concatenation of `parts[i]` (registered shared memory):
    /// per key `Ok`, or a code as [`StoreClient::put`]'s (`InvalidParams` for a span
    /// outside registered shared memory).
    pub fn put<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        keys: &[K],
        parts: &[P],
        opts: &PutOptions,
    ) -> Result<Vec<std::result::Result<(), Code>>> {
        let (idx, items) = self.items(keys, parts)?;
        let mut out = vec![Err(Code::InvalidParams); keys.len()];
        if items.is_empty() {
            return Ok(out);
        }
        let n = items.len();
        let req = IpcRequest::Put {
            replicas: opts.replicas.clamp(1, crate::proto::MAX_REPLICAS as u8),
            pin: opts.pin,
            preferred: opts.preferred.clone().unwrap_or_default(),
            items,
        };
        for (i, c) in idx.into_iter().zip(self.codes(req, n)?) {
            out[i] = code_of(c).map(|_| ());
        }
        Ok(out)
    }

    /// Reads each `keys[i]` into `parts[i]` (registered shared memory): per key the size,
    /// or a code as [`StoreClient::get`]'s.
    pub fn get<K: AsRef<[u8]>, P: AsRef<[Span]>>(
        &self,
        keys: &[K],
        parts: &[P],
    ) -> Result<Vec<std::result::Result<u64, Code>>> {
        let (idx, items) = self.items(keys, parts)?;
        let mut out = vec![Err(Code::InvalidParams); keys.len()];
        if items.is_empty() {
            return Ok(out);
        }
        let n = items.len();
        for (i, c) in idx
            .into_iter()
            .zip(self.codes(IpcRequest::Get { items }, n)?)
        {
            out[i] = code_of(c);
        }
        Ok(out)
    }

    fn keys<K: AsRef<[u8]>>(keys: &[K]) -> Vec<Vec<u8>> {
        keys.iter().map(|k| k.as_ref().to_vec()).collect()
    }

    /// Per key whether a complete object exists.
    pub fn exist<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<std::result::Result<bool, Code>>> {
        let v = self.codes(
            IpcRequest::Exist {
                keys: Self::keys(keys),
            },
            keys.len(),
        )?;
        Ok(v.into_iter().map(|c| code_of(c).map(|n| n != 0)).collect())
    }

    /// Per key the object's size.
    pub fn size<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<std::result::Result<u64, Code>>> {
        let v = self.codes(
            IpcRequest::Size {
                keys: Self::keys(keys),
            },
            keys.len(),
        )?;
        Ok(v.into_iter().map(code_of).collect())
    }

    /// Per key a code, as [`StoreClient::remove`]'s.
    pub fn remove<K: AsRef<[u8]>>(&self, keys: &[K], force: bool) -> Result<Vec<Code>> {
        let req = IpcRequest::Remove {
            force,
            keys: Self::keys(keys),
        };
        let v = self.codes(req, keys.len())?;
        Ok(v.into_iter()
            .map(|c| code_of(c).err().unwrap_or(Code::Ok))
            .collect())
    }

    /// Removes every complete object (not leased unless `force`); how many.
    pub fn remove_all(&self, force: bool) -> Result<u64> {
        Ok(self.codes(IpcRequest::RemoveAll { force }, 1)?[0].max(0) as u64)
    }

    /// Removes the complete objects whose key matches `pattern` (the master's syntax; not
    /// leased unless `force`); how many.
    pub fn remove_matching(&self, pattern: &str, force: bool) -> Result<u64> {
        let req = IpcRequest::RemoveMatching {
            force,
            pattern: pattern.to_owned(),
        };
        Ok(self.codes(req, 1)?[0].max(0) as u64)
    }

    /// Whether the real client and its master answer.
    pub fn ping(&self) -> Result<()> {
        self.codes(IpcRequest::Ping, 1).map(|_| ())
    }

    /// The real client's transport endpoint.
    pub fn real_endpoint(&self) -> Result<String> {
        match self.call(IpcRequest::Endpoint, None)? {
            IpcResponse::Text(s) => Ok(s),
            other => Err(gone(format!("unexpected reply {other:?}"))),
        }
    }

    /// Leaves the real client (which unmaps this dummy's buffers). Idempotent.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        let conn = self
            .inner
            .conn
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = conn {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.inner
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

fn code_of(c: i64) -> std::result::Result<u64, Code> {
    if c >= 0 {
        Ok(c as u64)
    } else {
        Err(i32::try_from(c)
            .ok()
            .and_then(Code::from_i32)
            .unwrap_or(Code::Internal))
    }
}

fn keepalive(weak: Weak<DummyInner>) {
    loop {
        std::thread::sleep(KEEPALIVE);
        let Some(inner) = weak.upgrade() else { return };
        if inner.closed.load(Ordering::Acquire) {
            return;
        }
        // Only pings a live connection: a lost one is reopened by the next call.
        let _ = inner.call(IpcRequest::Ping, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        let a: IpcAddr = "127.0.0.1:50052".parse().unwrap();
        assert_eq!(a.to_string(), "@pagewire_client_50052.sock");
        let a: IpcAddr = "localhost:7".parse().unwrap();
        assert_eq!(a, IpcAddr::Abstract("pagewire_client_7.sock".into()));
        assert_eq!(
            "unix:/tmp/x.sock".parse::<IpcAddr>().unwrap(),
            IpcAddr::Path("/tmp/x.sock".into())
        );
        assert_eq!(
            "/tmp/x.sock".parse::<IpcAddr>().unwrap(),
            IpcAddr::Path("/tmp/x.sock".into())
        );
        assert_eq!(
            "@n".parse::<IpcAddr>().unwrap(),
            IpcAddr::Abstract("n".into())
        );
        for bad in ["", "@", "host", "host:0", "host:99999"] {
            assert!(bad.parse::<IpcAddr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn shared_buffers_are_found_by_any_inner_range() {
        let b = SharedBuf::new(8192).unwrap();
        assert!(lookup(b.addr() + 100, 100).is_some());
        assert!(lookup(b.addr() + 8000, 193).is_none());
        assert!(lookup(b.addr().wrapping_sub(1), 2).is_none());
        let a = b.addr();
        drop(b);
        assert!(lookup(a, 1).is_none());
        assert!(ct_eq(b"abc", b"abc") && !ct_eq(b"abc", b"abd") && !ct_eq(b"ab", b"abc"));
    }
}
