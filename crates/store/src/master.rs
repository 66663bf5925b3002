//! The master server: the decision core ([`crate::core`]) behind a TCP listener.
//!
//! Threads: one accepts, one ticks the core (held space, silent clients, unfinished puts,
//! eviction), one per client connection. Connections are capped in total and before
//! their `Hello` (so half-open floods cannot starve clients); every frame has a deadline
//! once its first byte arrived, and a connection quiet for longer than the client TTL is
//! closed. The master never touches the data path: requests are metadata only.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::core::{CoreConfig, MasterCore, Millis};
use crate::error::{Code, Result, StoreError};
use crate::net::{self, ReadError};
use crate::proto::{self, Request, Response, Stats, Welcome};

/// Master settings.
#[derive(Debug, Clone)]
pub struct MasterConfig {
    /// Where to listen (`127.0.0.1:50051`; port 0 picks one).
    pub listen: SocketAddr,
    /// The decision rules' knobs.
    pub core: CoreConfig,
    /// Shared secret clients must present (none: any client is accepted).
    pub token: Option<Vec<u8>>,
    /// Cap on one request's body.
    pub max_frame: u32,
    /// Most client connections at once.
    pub max_connections: usize,
    /// Most connections that have not said `Hello` yet.
    pub max_unauthenticated: usize,
    /// Deadline for a frame once its first byte arrived, and for writing a reply.
    pub frame_timeout: Duration,
    /// Period of the core's housekeeping.
    pub tick: Duration,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            core: CoreConfig::default(),
            token: None,
            max_frame: proto::DEFAULT_MAX_FRAME,
            max_connections: 1024,
            max_unauthenticated: 64,
            frame_timeout: Duration::from_secs(5),
            tick: Duration::from_millis(100),
        }
    }
}

struct Shared {
    cfg: MasterConfig,
    core: Mutex<MasterCore>,
    origin: Instant,
    shutdown: AtomicBool,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    open: AtomicUsize,
    unauthenticated: AtomicUsize,
}

impl Shared {
    fn now(&self) -> Millis {
        self.origin.elapsed().as_millis() as Millis
    }
    fn core(&self) -> MutexGuard<'_, MasterCore> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running master. Dropping it does not stop it; call [`Master::shutdown`].
pub struct Master {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Master").field("addr", &self.addr).finish()
    }
}

/// A fresh random seed (client ids and the epoch must differ across restarts).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl Master {
    /// Binds the listener and starts serving.
    pub fn start(cfg: MasterConfig) -> Result<Master> {
        cfg.core.validate().map_err(|reason| StoreError::Config {
            key: "master".into(),
            value: String::new(),
            reason,
        })?;
        if cfg.max_frame < 4096 {
            return Err(StoreError::Config {
                key: "max_frame".into(),
                value: cfg.max_frame.to_string(),
                reason: "at least 4096".into(),
            });
        }
        let listener = TcpListener::bind(cfg.listen)
            .map_err(|e| StoreError::io(format!("bind master listener {}", cfg.listen), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| StoreError::io("master listener address", e))?;
        let shared = Arc::new(Shared {
            core: Mutex::new(MasterCore::new(cfg.core.clone(), random_seed())),
            cfg,
            origin: Instant::now(),
            shutdown: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            open: AtomicUsize::new(0),
            unauthenticated: AtomicUsize::new(0),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("pagewire-store-accept".into())
            .spawn(move || accept_loop(listener, s))
            .map_err(|e| StoreError::io("spawn master accept thread", e))?;
        let s = shared.clone();
        let tick = std::thread::Builder::new()
            .name("pagewire-store-tick".into())
            .spawn(move || {
                while !s.shutdown.load(Ordering::Acquire) {
                    std::thread::sleep(s.cfg.tick);
                    let now = s.now();
                    s.core().tick(now);
                }
            })
            .map_err(|e| StoreError::io("spawn master tick thread", e))?;
        tracing::info!(%addr, "pagewire store master listening");
        Ok(Master {
            shared,
            addr,
            threads: Mutex::new(vec![accept, tick]),
        })
    }

    /// The listener's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This instance's random id (changes on restart).
    pub fn epoch(&self) -> u64 {
        self.shared.core().epoch()
    }

    /// Current counts.
    pub fn stats(&self) -> Stats {
        self.shared.core().stats()
    }

    /// Stops accepting, closes every connection and waits for the master's threads.
    /// Idempotent.
    pub fn shutdown(&self) {
        if self.shared.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for (_, s) in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = t.join();
        }
    }

    /// Blocks until [`Master::shutdown`] is called from another thread.
    pub fn wait(&self) {
        while !self.shared.shutdown.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Gives back a connection slot (and a pre-`Hello` slot while held) when dropped.
struct Slot {
    shared: Arc<Shared>,
    id: u64,
    unauthenticated: bool,
}

impl Slot {
    fn authenticated(&mut self) {
        if std::mem::take(&mut self.unauthenticated) {
            self.shared.unauthenticated.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.authenticated();
        self.shared.open.fetch_sub(1, Ordering::AcqRel);
        self.shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if shared.shutdown.load(Ordering::Acquire) {
                    return;
                }
                tracing::warn!("store master accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let cfg = &shared.cfg;
        if shared.open.load(Ordering::Acquire) >= cfg.max_connections
            || shared.unauthenticated.load(Ordering::Acquire) >= cfg.max_unauthenticated
        {
            tracing::warn!(
                peer = ?stream.peer_addr().ok(),
                "store master: connection refused (connection caps reached)"
            );
            continue;
        }
        shared.open.fetch_add(1, Ordering::AcqRel);
        shared.unauthenticated.fetch_add(1, Ordering::AcqRel);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            shared: shared.clone(),
            id,
            unauthenticated: true,
        };
        if let Ok(c) = stream.try_clone() {
            shared
                .conns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, c);
        }
        let r = std::thread::Builder::new()
            .name("pagewire-store-conn".into())
            .spawn(move || serve(stream, slot));
        if let Err(e) = r {
            tracing::warn!("store master: cannot spawn a connection thread: {e}");
        }
    }
}

fn send(s: &mut TcpStream, shared: &Shared, req_id: u32, resp: &Response) -> bool {
    let mut buf = Vec::new();
    resp.encode(req_id, &mut buf);
    net::write_all_by(s, &buf, Instant::now() + shared.cfg.frame_timeout).is_ok()
}

/// Tells the client its frame was refused (`InvalidParams` and why); the caller then closes.
fn refuse(s: &mut TcpStream, shared: &Shared, req_id: u32, message: String) {
    let _ = send(
        s,
        shared,
        req_id,
        &Response::Error {
            code: Code::InvalidParams,
            message,
        },
    );
}

fn serve(mut s: TcpStream, mut slot: Slot) {
    let shared = slot.shared.clone();
    let peer = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
    let _ = s.set_nodelay(true);
    let cfg = &shared.cfg;
    let mut body = Vec::new();
    let far = || Instant::now() + Duration::from_secs(3600);

    // Hello first, within one frame timeout.
    let hello_by = Instant::now() + cfg.frame_timeout;
    let client = match net::read_frame(
        &mut s,
        cfg.max_frame,
        hello_by,
        cfg.frame_timeout,
        hello_by,
        &mut body,
    ) {
        Ok(h) => match proto::decode_request(h.kind, &body) {
            Ok(Request::Hello(hello)) => {
                let token_ok = match &cfg.token {
                    Some(t) => net::ct_eq(t, &hello.token),
                    None => true,
                };
                if !token_ok {
                    tracing::warn!(%peer, "store master: token mismatch");
                    let _ = send(
                        &mut s,
                        &shared,
                        h.req_id,
                        &Response::Error {
                            code: Code::Unauthorized,
                            message: "token mismatch".into(),
                        },
                    );
                    return;
                }
                let now = shared.now();
                let r = shared.core().hello(now, hello.client_id, &hello.endpoint);
                match r {
                    Ok((id, resumed)) => {
                        let c = &cfg.core;
                        let w = Welcome {
                            client_id: id,
                            epoch: shared.core().epoch(),
                            resumed,
                            lease_ttl_ms: c.lease_ttl_ms as u32,
                            heartbeat_ms: c.heartbeat_ms as u32,
                            client_ttl_ms: c.client_ttl_ms as u32,
                            max_frame: cfg.max_frame,
                        };
                        if !send(&mut s, &shared, h.req_id, &Response::Welcome(w)) {
                            return;
                        }
                        tracing::debug!(%peer, endpoint = %hello.endpoint, client = format_args!("{id:#x}"), resumed, "store client connected");
                        id
                    }
                    Err(code) => {
                        let _ = send(
                            &mut s,
                            &shared,
                            h.req_id,
                            &Response::Error {
                                code,
                                message: "too many clients".into(),
                            },
                        );
                        return;
                    }
                }
            }
            Ok(_) => {
                refuse(
                    &mut s,
                    &shared,
                    h.req_id,
                    "the first frame must be Hello".into(),
                );
                return;
            }
            Err(e) => {
                tracing::warn!(%peer, "store master: bad hello: {e}");
                refuse(&mut s, &shared, h.req_id, e.to_string());
                return;
            }
        },
        Err(ReadError::Proto(e)) => {
            tracing::warn!(%peer, "store master: bad hello: {e}");
            return;
        }
        Err(_) => return,
    };
    slot.authenticated();

    // Requests until the client leaves, goes quiet for longer than its TTL, or misbehaves.
    let quiet = Duration::from_millis(cfg.core.client_ttl_ms) * 2;
    loop {
        let idle = Instant::now() + quiet;
        let h = match net::read_frame(
            &mut s,
            cfg.max_frame,
            idle,
            cfg.frame_timeout,
            far(),
            &mut body,
        ) {
            Ok(h) => h,
            Err(ReadError::Proto(e)) => {
                tracing::warn!(%peer, "store master: bad frame: {e}");
                refuse(&mut s, &shared, 0, e.to_string());
                break;
            }
            Err(ReadError::Closed) => break,
            Err(e) => {
                tracing::debug!(%peer, "store master: connection ends: {e:?}");
                break;
            }
        };
        let req = match proto::decode_request(h.kind, &body) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%peer, "store master: bad request: {e}");
                refuse(&mut s, &shared, h.req_id, e.to_string());
                break;
            }
        };
        let bye = matches!(req, Request::Bye);
        let resp = handle(&shared, client, req);
        if !send(&mut s, &shared, h.req_id, &resp) || bye {
            if bye {
                return;
            }
            break;
        }
    }
    shared.core().disconnected(client);
}

fn err(code: Code) -> Response {
    Response::Error {
        code,
        message: code.to_string(),
    }
}

/// One request, under the core's lock.
fn handle(shared: &Shared, client: u64, req: Request) -> Response {
    let now = shared.now();
    let mut core = shared.core();
    if let Err(c) = core.touch(now, client) {
        return err(c);
    }
    match req {
        Request::Hello(_) => Response::Error {
            code: Code::InvalidParams,
            message: "Hello twice on one connection".into(),
        },
        Request::Heartbeat => Response::Ack,
        Request::Mount {
            base,
            size,
            remount,
        } => match core.mount(now, client, base, size, remount) {
            Ok(segment) => Response::Mounted { segment },
            Err(c) => err(c),
        },
        Request::Unmount { segment } => match core.unmount(now, client, segment) {
            Ok(()) => Response::Ack,
            Err(c) => err(c),
        },
        Request::PutStart(p) => match core.put_start(now, client, &p) {
            Ok(pl) => Response::Placed(pl),
            Err(c) => err(c),
        },
        Request::PutFinish(f) => match core.put_finish(now, client, &f) {
            Ok(codes) => Response::Codes(codes),
            Err(c) => err(c),
        },
        Request::Get { lease, keys } => Response::Found(core.get(now, &keys, lease)),
        Request::Exist { keys } => Response::Codes(core.exist(now, &keys)),
        Request::Remove { force, keys } => Response::Codes(core.remove(now, &keys, force)),
        Request::RemoveAll { force } => Response::Count(core.remove_all(now, force)),
        Request::Stats => Response::Stats(core.stats()),
        Request::Report { suspects } => match core.report(now, client, &suspects) {
            Ok(()) => Response::Ack,
            Err(c) => err(c),
        },
        Request::Bye => {
            core.bye(now, client);
            Response::Ack
        }
    }
}
