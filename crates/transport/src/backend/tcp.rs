//! TCP backend: the same one-sided semantics over several TCP streams per peer.
//!
//! Each engine runs a data listener. After the control handshake each side opens
//! `min(tcp_streams, peer's streams)` streams to the other's data listener; a stream
//! starts with a hello naming the acceptor's session (a 64-bit secret exchanged in the
//! handshake) and the token. The opener sends requests on its streams, the acceptor
//! serves them, so every stream has one requester and one responder.
//!
//! Request (40 bytes): `kind u8 (1 WRITE, 2 READ, 3 NOTIFY), 0 u8 x3, rkey u32, seq u64,
//! addr u64, len u64, tag u32, 0 u32`, followed by `len` payload bytes for WRITE.
//! Response (16 bytes): `seq u64, status u32, len u32`, followed by `len` bytes for a
//! successful READ.
//!
//! The responder checks every request against its own registry (range inside one
//! registered chunk with the right remote access and matching key) before touching
//! memory, then reads WRITE payload straight into the destination region (no staging
//! buffer) and acks only once it is all there. Payload moves between sockets and
//! registered memory through raw pointers only ([`super::sys`]): never a slice over
//! memory that a peer may write. A refused WRITE's payload is drained into
//! a scratch buffer so the stream stays usable; a malformed header drops the stream.
//!
//! Ops are cut into `max_wr_bytes` chunks striped round-robin over the streams. A
//! batch's NOTIFY goes out only after every WRITE of the batch was acked, so the peer
//! surfaces the tag only when all bytes are in its memory. A stream error (reset, EOF,
//! `io_timeout` with a request outstanding) breaks the whole connection and fails every
//! pending batch with `PeerGone`.
//!
//! Deadlines: a response must come within `io_timeout` of the last byte received and no
//! later than `io_timeout` after its batch's deadline; a connection that misses either
//! breaks. A READ lands its payload only while its batch is pending (under
//! [`BatchState::landing`]): once the batch failed or was cancelled, the rest of the
//! payload is read into a scratch buffer, so nothing lands after the failure is reported.
//!
//! Every thread that moves payload is joined before memory is handed back: closing a
//! connection joins its sender and receiver threads, and shutdown joins every responder
//! thread. Between two reads into registered memory a thread checks whether its
//! connection or session was closed, so a peer that keeps sending cannot keep it writing.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::sys::{self, IoVec};
use super::{
    Backend, BackendInfo, BackendInit, BackendMr, BatchState, Conn, ConnCtx, EndpointInfo,
    NotifySink, PendingConn, ResolvedOps, lock,
};
use crate::admission::{Admission, Ticket};
use crate::batch::Op;
use crate::config::{BackendKind, EngineConfig};
use crate::deadline::{self, Deadlined};
use crate::engine::{PeerId, ct_eq, random_u64};
use crate::error::{Error, HandshakeError, Result};
use crate::memory::{Access, Registry};
use crate::wire::MAX_STREAMS;

const STREAM_MAGIC: u32 = u32::from_le_bytes(*b"PGWS");
const STREAM_VERSION: u16 = 1;
const REQ_LEN: usize = 40;
const RESP_LEN: usize = 16;
/// Largest chunk a responder accepts (the requester's `max_wr_bytes` is capped at 2 GiB).
const MAX_CHUNK: u64 = 1 << 31;
/// Most requests sent with one `writev` (and responses read with one `read`).
const GATHER: usize = 64;
/// Stop gathering once this much WRITE payload is queued in one `writev`.
const GATHER_BYTES: u64 = 4 << 20;

const K_WRITE: u8 = 1;
const K_READ: u8 = 2;
const K_NOTIFY: u8 = 3;

const S_OK: u32 = 0;
const S_REFUSED: u32 = 1;
const S_BAD_KEY: u32 = 2;
const S_NO_SESSION: u32 = 3;
/// The responder's notification queue was full: the tag was dropped, and the responder
/// breaks the connection after this response.
const S_QUEUE_FULL: u32 = 4;

/// Incoming data streams served before their hello is complete (each has a thread), in
/// all and from one source address; the excess is closed at once (`admission`). A
/// legitimate peer has at most one stream in its hello per handshake in progress.
const MAX_UNAUTHENTICATED: usize = crate::engine::MAX_CONCURRENT_HANDSHAKES;
const MAX_UNAUTHENTICATED_PER_IP: usize = crate::engine::MAX_HANDSHAKES_PER_IP;

/// The ports a data listener can be given (it binds port 0): the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, Linux's default 32768-60999 if unreadable). A
/// tokenless peer may only name a data port in it (see `Inner::accept_hello`).
pub(crate) fn ephemeral_ports() -> std::ops::RangeInclusive<u16> {
    static RANGE: OnceLock<(u16, u16)> = OnceLock::new();
    let &(lo, hi) = RANGE.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| {
                let mut it = s.split_whitespace().map(str::parse::<u16>);
                Some((it.next()?.ok()?, it.next()?.ok()?))
            })
            .filter(|(lo, hi)| 0 < *lo && lo <= hi)
            .unwrap_or((32768, 60999))
    });
    lo..=hi
}

pub(crate) fn open(config: &EngineConfig, init: &BackendInit) -> Result<Arc<dyn Backend>> {
    let listener = TcpListener::bind(SocketAddr::new(config.listen.ip(), 0))
        .map_err(|e| Error::io("bind TCP data listener", e))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("TCP data listener address", e))?;
    let shared = Arc::new(TcpShared {
        registry: init.registry.clone(),
        token: config.token.clone().unwrap_or_default().into_bytes(),
        streams: config.tcp_streams.min(MAX_STREAMS),
        chunk: config.max_wr_bytes.clamp(1, MAX_CHUNK),
        io_timeout: config.io_timeout,
        handshake_timeout: config.handshake_timeout,
        local,
        sessions: Mutex::new(HashMap::new()),
        next_key: AtomicU32::new((random_u64() as u32) | 1),
        shutdown: AtomicBool::new(false),
        listener: Mutex::new(None),
        unauthenticated: Admission::new(MAX_UNAUTHENTICATED, MAX_UNAUTHENTICATED_PER_IP),
        serving: Mutex::new(Serving::default()),
    });
    let weak = Arc::downgrade(&shared);
    let t = std::thread::Builder::new()
        .name("pagewire-tcp-accept".into())
        .spawn(move || accept_loop(listener, weak))
        .map_err(|e| Error::io("spawn TCP data listener", e))?;
    *lock(&shared.listener) = Some(t);
    Ok(Arc::new(TcpBackend { shared }))
}

struct TcpShared {
    registry: Arc<Registry>,
    token: Vec<u8>,
    streams: u16,
    chunk: u64,
    io_timeout: Duration,
    handshake_timeout: Duration,
    local: SocketAddr,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    next_key: AtomicU32,
    shutdown: AtomicBool,
    listener: Mutex<Option<JoinHandle<()>>>,
    /// Slots of incoming streams that have not completed their hello.
    unauthenticated: Arc<Admission>,
    /// Responder threads, joined at shutdown.
    serving: Mutex<Serving>,
}

/// Responder threads, each with a clone of its stream (to shut it down) until it ends.
/// Never detached: the ones that ended are joined at the next accept, the rest at
/// shutdown.
#[derive(Default)]
struct Serving {
    next: u64,
    threads: HashMap<u64, (Option<TcpStream>, Option<JoinHandle<()>>)>,
}

impl Serving {
    /// Joins the threads that have ended (at once: they have).
    fn reap(&mut self) {
        let done: Vec<u64> = self
            .threads
            .iter()
            .filter(|(_, (_, t))| t.as_ref().is_some_and(JoinHandle::is_finished))
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            if let Some((_, Some(t))) = self.threads.remove(&id) {
                let _ = t.join();
            }
        }
    }
}

/// Our side of one connection as the data listener sees it.
struct Session {
    id: u64,
    /// Set when the connection completes; NOTIFY before that is a protocol error.
    sink: OnceLock<NotifySink>,
    /// Accepted streams (clones, to shut them down on close), by a local stream id.
    incoming: Mutex<Vec<(u64, TcpStream)>>,
    next_stream: AtomicU64,
    closed: AtomicBool,
    /// Our connection to the same peer, once complete: the peer closing all its streams
    /// to us (it departed) breaks it, and breaking it closes this session.
    conn: OnceLock<Weak<ConnShared>>,
}

impl Session {
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for (_, s) in lock(&self.incoming).drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Breaks our connection to this session's peer; before the connection is complete,
    /// closes the session, which `complete` then finds.
    fn break_conn(&self, reason: String) {
        match self.conn.get() {
            Some(c) => {
                if let Some(c) = c.upgrade() {
                    c.break_all(reason);
                }
            }
            None => self.close(),
        }
    }
}

struct TcpBackend {
    shared: Arc<TcpShared>,
}

impl Backend for TcpBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Tcp
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            kind: BackendKind::Tcp,
            device: format!("tcp {}", self.shared.local),
            link: "TCP".into(),
            lanes_per_peer: self.shared.streams,
            tx_depth: GATHER as u32,
            signal_every: 1,
            max_wr_bytes: self.shared.chunk,
            max_mr_bytes: 0,
            ..BackendInfo::default()
        }
    }

    fn register(&self, _addr: usize, _len: usize, _access: Access) -> Result<BackendMr> {
        // Keys only guard against stale addresses (a peer's view from before a
        // re-registration); start at a random value so another process's keys differ.
        let k = self.shared.next_key.fetch_add(2, Ordering::Relaxed);
        Ok(BackendMr::keyed(k))
    }

    fn deregister(&self, _mr: BackendMr) {}

    fn prepare(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo)> {
        let session = Arc::new(Session {
            id: random_u64(),
            sink: OnceLock::new(),
            incoming: Mutex::new(Vec::new()),
            next_stream: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            conn: OnceLock::new(),
        });
        lock(&self.shared.sessions).insert(session.id, session.clone());
        let ep = EndpointInfo::Tcp {
            data_port: self.shared.local.port(),
            streams: self.shared.streams,
            session: session.id,
        };
        Ok((
            Box::new(Pending {
                shared: self.shared.clone(),
                session: Some(session),
            }),
            ep,
        ))
    }

    fn shutdown(&self) {
        let s = &self.shared;
        if s.shutdown.swap(true, Ordering::AcqRel) {
            return;
        }
        for (_, sess) in lock(&s.sessions).drain() {
            sess.close();
        }
        let mut wake = s.local;
        if wake.ip().is_unspecified() {
            wake.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        if let Some(t) = lock(&s.listener).take() {
            let _ = t.join();
        }
        // No responder starts now; stop and join the ones left (their sessions are closed,
        // so each stops before its next read into memory).
        let serving = std::mem::take(&mut lock(&s.serving).threads);
        for stream in serving.values().filter_map(|(s, _)| s.as_ref()) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for t in serving.into_values().filter_map(|(_, t)| t) {
            let _ = t.join();
        }
    }
}

struct Pending {
    shared: Arc<TcpShared>,
    session: Option<Arc<Session>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Handshake abandoned before completion: forget the session.
        if let Some(s) = self.session.take() {
            lock(&self.shared.sessions).remove(&s.id);
            s.close();
        }
    }
}

impl PendingConn for Pending {
    fn complete(mut self: Box<Self>, remote: &EndpointInfo, ctx: ConnCtx) -> Result<Arc<dyn Conn>> {
        let EndpointInfo::Tcp {
            data_port,
            streams,
            session: remote_session,
        } = *remote
        else {
            return Err(HandshakeError::BackendMismatch {
                ours: "tcp".into(),
                theirs: remote.backend_name().into(),
            }
            .into());
        };
        let shared = self.shared.clone();
        let session = self.session.clone().expect("set in prepare");
        let _ = session.sink.set(ctx.notify.clone());
        let n = shared.streams.min(streams).max(1);
        let addr = SocketAddr::new(ctx.remote_ip, data_port);
        let mut socks = Vec::with_capacity(n.into());
        for _ in 0..n {
            socks.push(open_stream(&shared, addr, remote_session, ctx.deadline)?);
        }
        let conn = ConnShared::start(
            ctx.peer,
            shared.chunk,
            shared.io_timeout,
            socks,
            session.clone(),
            Arc::downgrade(&shared),
        )?;
        let _ = session.conn.set(Arc::downgrade(&conn));
        // Completed: the session now lives until the connection closes.
        self.session = None;
        if session.is_closed() {
            // The peer's streams came and went before we were linked to them.
            conn.break_all("the peer closed its data streams during the handshake".into());
        }
        Ok(Arc::new(TcpConn { conn }))
    }
}

/// Opens one data stream to the peer and authenticates it, by the handshake's `deadline`
/// (the time left of the connection attempt, not a timeout per step).
fn open_stream(
    shared: &TcpShared,
    addr: SocketAddr,
    session: u64,
    deadline: Instant,
) -> Result<TcpStream> {
    let s = deadline::connect_by(&addr, deadline).map_err(|e| Error::Connect {
        addr: addr.to_string(),
        source: Arc::new(e),
    })?;
    let _ = s.set_nodelay(true);
    let mut io = Deadlined::new(&s, deadline);
    let mut hello = Vec::with_capacity(18 + shared.token.len());
    hello.extend_from_slice(&STREAM_MAGIC.to_le_bytes());
    hello.extend_from_slice(&STREAM_VERSION.to_le_bytes());
    hello.extend_from_slice(&(shared.token.len() as u16).to_le_bytes());
    hello.extend_from_slice(&session.to_le_bytes());
    hello.extend_from_slice(&shared.token);
    io.write_all(&hello).map_err(HandshakeError::from)?;
    let mut ack = [0u8; 4];
    io.read_exact(&mut ack).map_err(HandshakeError::from)?;
    if &ack != b"OK\0\0" {
        return Err(HandshakeError::Rejected {
            reason: "data stream refused".into(),
        }
        .into());
    }
    s.set_read_timeout(Some(shared.io_timeout))
        .and_then(|()| s.set_write_timeout(Some(shared.io_timeout)))
        .and_then(|()| sys::set_keepalive(&s, shared.io_timeout))
        .map_err(|e| Error::io("data stream options", e))?;
    Ok(s)
}

// ------------------------------------------------------------------ requester side

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Data(Op),
    Notify(u32),
}

struct Tracker {
    /// Data chunks not yet acknowledged.
    remaining: AtomicUsize,
    notify: Option<u32>,
}

struct Job {
    batch: Arc<BatchState>,
    tracker: Arc<Tracker>,
    kind: Kind,
    local: u64,
    remote: u64,
    rkey: u32,
    len: u64,
    seq: u64,
}

struct ConnShared {
    peer: PeerId,
    chunk: u64,
    /// Job queues of the sender threads; taken on close so they drain and exit.
    queues: Mutex<Vec<Sender<Job>>>,
    /// Clones of the outgoing streams, to shut them down; released when the connection
    /// breaks (the threads hold the other clones and exit then).
    socks: Mutex<Vec<TcpStream>>,
    /// The session of the peer's streams to us: closed when this connection breaks, so
    /// a peer we consider gone can no longer write or notify through it.
    session: Arc<Session>,
    backend: Weak<TcpShared>,
    next: AtomicUsize,
    seq: AtomicU64,
    broken: AtomicBool,
    reason: Mutex<Option<String>>,
    /// Sender and receiver threads, joined on close.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl ConnShared {
    fn start(
        peer: PeerId,
        chunk: u64,
        io_timeout: Duration,
        socks: Vec<TcpStream>,
        session: Arc<Session>,
        backend: Weak<TcpShared>,
    ) -> Result<Arc<ConnShared>> {
        let mut queues = Vec::new();
        let mut rxs = Vec::new();
        for _ in &socks {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            queues.push(tx);
            rxs.push(rx);
        }
        let conn = Arc::new(ConnShared {
            peer,
            chunk,
            queues: Mutex::new(queues),
            socks: Mutex::new(
                socks
                    .iter()
                    .map(|s| s.try_clone())
                    .collect::<std::io::Result<_>>()
                    .map_err(|e| Error::io("clone data stream", e))?,
            ),
            session,
            backend,
            next: AtomicUsize::new(0),
            seq: AtomicU64::new(1),
            broken: AtomicBool::new(false),
            reason: Mutex::new(None),
            threads: Mutex::new(Vec::new()),
        });
        for (i, (sock, rx)) in socks.into_iter().zip(rxs).enumerate() {
            // Unbounded: the socket's own buffers are the back-pressure; a bounded queue
            // could block the sender between queueing a gather and writing it.
            let (in_tx, in_rx) = crossbeam_channel::unbounded::<Job>();
            let rsock = match sock.try_clone() {
                Ok(r) => r,
                Err(e) => {
                    conn.close_and_join("cannot clone a data stream".into());
                    return Err(Error::io("clone data stream", e));
                }
            };
            let c = conn.clone();
            let tx = std::thread::Builder::new()
                .name(format!("pagewire-tcp-tx{i}"))
                .spawn(move || c.send_loop(sock, rx, in_tx));
            let c = conn.clone();
            let rx = std::thread::Builder::new()
                .name(format!("pagewire-tcp-rx{i}"))
                .spawn(move || c.recv_loop(rsock, in_rx, io_timeout));
            match (tx, rx) {
                (Ok(t), Ok(r)) => lock(&conn.threads).extend([t, r]),
                (t, r) => {
                    let err = t.as_ref().err().or(r.as_ref().err()).map(|e| e.kind());
                    lock(&conn.threads).extend(t.ok().into_iter().chain(r.ok()));
                    conn.close_and_join("cannot spawn a stream thread".into());
                    return Err(Error::io(
                        "spawn TCP stream threads",
                        err.unwrap_or(ErrorKind::Other).into(),
                    ));
                }
            }
        }
        Ok(conn)
    }

    /// Breaks the connection and waits for its threads: when this returns, nothing of
    /// the connection touches local memory again.
    fn close_and_join(&self, reason: String) {
        self.break_all(reason);
        let threads = std::mem::take(&mut *lock(&self.threads));
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }

    fn gone(&self) -> Error {
        let reason = lock(&self.reason)
            .clone()
            .unwrap_or_else(|| "connection closed".into());
        Error::PeerGone {
            peer: self.peer,
            reason,
        }
    }

    /// Marks the connection broken and shuts every stream down, both ways, so each
    /// thread wakes, fails what it holds and exits, and its descriptors are released.
    /// The peer's session is closed first: once `broken` is visible (`peer_alive` false),
    /// no request of the peer's starts to be served, on an old stream or a new one.
    fn break_all(&self, reason: String) {
        {
            let mut r = lock(&self.reason);
            if r.is_none() {
                tracing::debug!(peer = %self.peer, %reason, "TCP connection broken");
                *r = Some(reason);
            }
        }
        self.session.close();
        if let Some(b) = self.backend.upgrade() {
            lock(&b.sessions).remove(&self.session.id);
        }
        self.broken.store(true, Ordering::Release);
        lock(&self.queues).clear();
        for s in lock(&self.socks).drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn enqueue(&self, job: Job) -> Result<()> {
        let q = lock(&self.queues);
        if self.broken.load(Ordering::Acquire) || q.is_empty() {
            return Err(self.gone());
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % q.len();
        q[i].send(job).map_err(|_| self.gone())
    }

    /// Sends queued jobs in gathers: up to `GATHER` requests (headers and WRITE payloads
    /// straight from registered memory) per `writev`. All but the last request of a
    /// gather carry the "more follows" flag, so the responder batches its acks too.
    fn send_loop(self: Arc<Self>, sock: TcpStream, jobs: Receiver<Job>, inflight: Sender<Job>) {
        let mut gather: Vec<Job> = Vec::with_capacity(GATHER);
        let mut hdrs: Vec<[u8; REQ_LEN]> = Vec::with_capacity(GATHER);
        let mut iov: Vec<IoVec> = Vec::with_capacity(2 * GATHER);
        while let Ok(first) = jobs.recv() {
            let mut bytes = 0u64;
            let mut next = Some(first);
            while let Some(job) = next.take() {
                if self.broken.load(Ordering::Acquire) {
                    job.batch.fail(self.gone());
                } else if !(matches!(job.kind, Kind::Data(_)) && job.batch.should_stop()) {
                    bytes += if job.kind == Kind::Data(Op::Write) {
                        job.len
                    } else {
                        0
                    };
                    gather.push(job);
                }
                if gather.len() < GATHER && bytes < GATHER_BYTES {
                    next = jobs.try_recv().ok();
                }
            }
            if gather.is_empty() {
                continue;
            }
            hdrs.clear();
            let n = gather.len();
            for (i, job) in gather.iter().enumerate() {
                hdrs.push(encode_request(job, i + 1 < n));
            }
            iov.clear();
            for (job, h) in gather.iter().zip(&hdrs) {
                iov.push(IoVec::from_slice(h));
                if job.kind == Kind::Data(Op::Write) {
                    // Payload straight from registered memory, as a raw pointer.
                    iov.push(IoVec::raw(job.local as *const u8, job.len as usize));
                }
            }
            // Queue before sending so the receiver always knows what a response answers.
            let batches: Vec<Arc<BatchState>> = gather.iter().map(|j| j.batch.clone()).collect();
            let mut queued = true;
            for job in gather.drain(..) {
                if let Err(crossbeam_channel::SendError(job)) = inflight.send(job) {
                    job.batch.fail(self.gone());
                    queued = false;
                }
            }
            let res = if queued {
                // SAFETY: the header entries point into `hdrs`, untouched until the next
                // gather; each payload entry is a range the engine validated against a
                // registered local region, which its batch keeps pinned (so registered and
                // allocated), and `batches` holds every batch of the gather until `write_all`
                // returned.
                unsafe { sys::write_all(&sock, &mut iov) }
            } else {
                Err(ErrorKind::BrokenPipe.into())
            };
            iov.clear();
            if let Err(e) = res {
                // A write timeout is the peer taking no bytes for `io_timeout`.
                self.break_all(match e.kind() {
                    ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                        "send failed: the peer took no bytes within the I/O timeout".into()
                    }
                    _ => format!("send failed: {e}"),
                });
                for b in batches {
                    b.fail(self.gone());
                }
            }
        }
    }

    /// Reads responses in order. Consecutive responses without payload are read with
    /// one `read_exact`; a READ's payload goes straight into local memory.
    fn recv_loop(
        self: Arc<Self>,
        mut sock: TcpStream,
        inflight: Receiver<Job>,
        io_timeout: Duration,
    ) {
        let mut failed: Option<Error> = None;
        let mut group: Vec<Job> = Vec::with_capacity(GATHER);
        let mut buf = vec![0u8; GATHER * RESP_LEN];
        let mut scratch = Vec::new();
        while let Ok(first) = inflight.recv() {
            let mut last_is_read = first.kind == Kind::Data(Op::Read);
            group.push(first);
            while !last_is_read && group.len() < GATHER {
                match inflight.try_recv() {
                    Ok(j) => {
                        last_is_read = j.kind == Kind::Data(Op::Read);
                        group.push(j);
                    }
                    Err(_) => break,
                }
            }
            if let Some(e) = &failed {
                for j in group.drain(..) {
                    j.batch.fail(e.clone());
                }
                continue;
            }
            let hdrs = &mut buf[..group.len() * RESP_LEN];
            let res = read_headers(&mut sock, hdrs, &group, io_timeout).and_then(|()| {
                for (j, h) in group.iter().zip(hdrs.chunks_exact(RESP_LEN)) {
                    self.recv_one(&sock, j, h, io_timeout, &mut scratch)?;
                }
                Ok(())
            });
            if let Err(e) = res {
                self.break_all(e);
                let err = self.gone();
                for j in &group {
                    j.batch.fail(err.clone());
                }
                failed = Some(err);
            }
            group.clear();
        }
    }

    /// Handles the response header `h` to `job` (and a READ's payload). An `Err` means
    /// the stream is unusable.
    fn recv_one(
        &self,
        sock: &TcpStream,
        job: &Job,
        h: &[u8],
        io_timeout: Duration,
        scratch: &mut Vec<u8>,
    ) -> Result<(), String> {
        let seq = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
        let status = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
        if seq != job.seq {
            return Err(format!("response seq {seq} for request {}", job.seq));
        }
        if status != S_OK {
            if len != 0 {
                return Err("error response with payload".into());
            }
            let reason = match status {
                S_REFUSED => format!(
                    "range {:#x}+{} outside its registered memory or lacks access",
                    job.remote, job.len
                ),
                S_BAD_KEY => format!("rkey {:#x} does not match at {:#x}", job.rkey, job.remote),
                S_NO_SESSION => "notification before the connection completed".into(),
                S_QUEUE_FULL => {
                    "the peer's notification queue is full (notification dropped)".into()
                }
                s => format!("status {s}"),
            };
            job.batch.fail(Error::Remote {
                peer: self.peer,
                reason,
            });
            return Ok(());
        }
        match job.kind {
            Kind::Data(Op::Read) => {
                if u64::from(len) != job.len {
                    return Err(format!("READ response of {len} bytes for {}", job.len));
                }
                if !self.land_read(sock, job, io_timeout, scratch)? {
                    // The batch failed or was cancelled meanwhile; the stream is in sync.
                    return Ok(());
                }
            }
            _ if len != 0 => return Err("unexpected payload".into()),
            _ => {}
        }
        match job.kind {
            Kind::Data(_) => {
                job.batch.add_progress(1, job.len);
                if job.tracker.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.last_data_done(job);
                }
            }
            Kind::Notify(_) => job.batch.succeed(),
        }
        Ok(())
    }

    /// Reads a READ response's payload (`job.len` bytes) into `job.local`, only while the
    /// batch is pending, each copy under its landing guard; the rest goes to `scratch`.
    /// At the batch deadline it fails the batch itself (with `Timeout`). `Ok(true)` when
    /// all of it landed; an `Err` (no progress for `io_timeout`, the payload not in by
    /// `io_timeout` after the batch deadline, closed) breaks the connection.
    fn land_read(
        &self,
        sock: &TcpStream,
        job: &Job,
        io_timeout: Duration,
        scratch: &mut Vec<u8>,
    ) -> Result<bool, String> {
        let (len, deadline) = (job.len as usize, job.batch.deadline());
        let mut land = true;
        let mut got = 0;
        let mut last = Instant::now();
        while got < len {
            if self.broken.load(Ordering::Acquire) {
                return Err("connection closed".into());
            }
            let now = Instant::now();
            let limit = (last + io_timeout).min(deadline + io_timeout);
            if now >= limit {
                return Err(missed(now, last, deadline, io_timeout));
            }
            if land && now >= deadline {
                job.batch.expire_if_due(now);
            }
            let read = match land.then(|| job.batch.landing()).flatten() {
                // SAFETY: the engine validated `[local, local+len)` against a registered
                // region with LOCAL_WRITE that `job.batch` keeps pinned (registered, hence
                // allocated); `got < len`. Only this thread writes there, and only while
                // the batch is pending (the guard).
                Some(_g) => unsafe {
                    sys::recv_now(sock, (job.local as *mut u8).add(got), len - got)
                },
                None => {
                    land = false;
                    if scratch.is_empty() {
                        scratch.resize(64 << 10, 0);
                    }
                    let n = (len - got).min(scratch.len());
                    // SAFETY: `scratch` is ours and holds at least `n` bytes.
                    unsafe { sys::recv_now(sock, scratch.as_mut_ptr(), n) }
                }
            };
            match read {
                Ok(0) => return Err("receive failed: end of stream".into()),
                Ok(n) => {
                    got += n;
                    last = now;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Wake at the batch deadline too, to fail it on time.
                    let wake = if land { limit.min(deadline) } else { limit };
                    sys::wait_readable(sock, wake.saturating_duration_since(now))
                        .map_err(|e| format!("receive failed: {e}"))?;
                }
                Err(e) => return Err(format!("receive failed: {e}")),
            }
        }
        Ok(land)
    }

    /// Every chunk of the batch is acknowledged: send the notification or finish.
    fn last_data_done(&self, job: &Job) {
        let Some(tag) = job.tracker.notify else {
            job.batch.succeed();
            return;
        };
        if job.batch.should_stop() {
            return;
        }
        let n = Job {
            batch: job.batch.clone(),
            tracker: job.tracker.clone(),
            kind: Kind::Notify(tag),
            local: 0,
            remote: 0,
            rkey: 0,
            len: 0,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
        };
        if let Err(e) = self.enqueue(n) {
            job.batch.fail(e);
        }
    }
}

struct TcpConn {
    conn: Arc<ConnShared>,
}

impl Conn for TcpConn {
    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<()> {
        let batch = Arc::new(batch);
        let c = &self.conn;
        if c.broken.load(Ordering::Acquire) {
            return Err(c.gone());
        }
        let chunks: usize = ops.iter().map(|o| o.len.div_ceil(c.chunk) as usize).sum();
        let tracker = Arc::new(Tracker {
            remaining: AtomicUsize::new(chunks),
            notify,
        });
        if chunks == 0 {
            // A notification alone (the core refuses an empty batch without one): no data
            // to wait for, so the notify request goes out at once.
            let Some(tag) = notify else {
                batch.succeed();
                return Ok(());
            };
            return c.enqueue(Job {
                batch,
                tracker,
                kind: Kind::Notify(tag),
                local: 0,
                remote: 0,
                rkey: 0,
                len: 0,
                seq: c.seq.fetch_add(1, Ordering::Relaxed),
            });
        }
        for o in &ops {
            let mut off = 0;
            while off < o.len {
                let n = (o.len - off).min(c.chunk);
                c.enqueue(Job {
                    batch: batch.clone(),
                    tracker: tracker.clone(),
                    kind: Kind::Data(o.op),
                    local: o.local + off,
                    remote: o.remote + off,
                    rkey: o.rkey,
                    len: n,
                    seq: c.seq.fetch_add(1, Ordering::Relaxed),
                })?;
                off += n;
            }
        }
        Ok(())
    }

    fn is_broken(&self) -> bool {
        self.conn.broken.load(Ordering::Acquire)
    }

    fn close(&self) {
        // Breaking closes the peer's session too (break_all); then join our threads.
        self.conn.close_and_join("connection closed locally".into());
    }
}

impl Drop for TcpConn {
    fn drop(&mut self) {
        self.close();
    }
}

// ------------------------------------------------------------------ responder side

fn accept_loop(listener: TcpListener, shared: Weak<TcpShared>) {
    for s in listener.incoming() {
        let Some(b) = shared.upgrade() else { return };
        if b.shutdown.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = s else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let Some(ticket) = b.unauthenticated.admit(&s) else {
            tracing::debug!(from = ?s.peer_addr().ok(), "too many unauthenticated data streams; dropping");
            let _ = s.shutdown(Shutdown::Both);
            continue;
        };
        let deadline = Instant::now() + b.handshake_timeout;
        // Tracked before it starts, so shutdown can stop and join it.
        let Ok(clone) = s.try_clone() else { continue };
        let id = {
            let mut serving = lock(&b.serving);
            serving.reap();
            serving.next += 1;
            let id = serving.next;
            serving.threads.insert(id, (Some(clone), None));
            id
        };
        let b2 = b.clone();
        let spawned = std::thread::Builder::new()
            .name("pagewire-tcp-serve".into())
            .spawn(move || {
                let from = s.peer_addr().ok();
                if let Err(e) = serve_stream(&b2, s, ticket, deadline)
                    && !b2.shutdown.load(Ordering::Acquire)
                {
                    tracing::warn!(?from, error = %e, "TCP data stream dropped");
                }
                // Close the clone too; the handle stays, to be joined.
                if let Some(e) = lock(&b2.serving).threads.get_mut(&id) {
                    e.0 = None;
                }
            });
        match spawned {
            // Unless shutdown took the entry meanwhile (it joins what it found).
            Ok(t) => match lock(&b.serving).threads.get_mut(&id) {
                Some(e) => e.1 = Some(t),
                None => {
                    let _ = t.join();
                }
            },
            Err(e) => {
                lock(&b.serving).threads.remove(&id);
                tracing::warn!(error = %e, "cannot spawn TCP stream thread");
            }
        }
    }
}

/// Authenticates an incoming stream, then serves its requests until it closes. The
/// hello must be complete by `deadline` (the accept plus the handshake timeout), however
/// the client paces its bytes.
fn serve_stream(
    b: &TcpShared,
    mut s: TcpStream,
    ticket: Ticket,
    deadline: Instant,
) -> Result<(), String> {
    let _ = s.set_nodelay(true);
    let mut h = [0u8; 16];
    Deadlined::new(&s, deadline)
        .read_exact(&mut h)
        .map_err(|e| format!("stream hello: {e}"))?;
    let magic = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    let version = u16::from_le_bytes(h[4..6].try_into().expect("2 bytes"));
    let tlen = u16::from_le_bytes(h[6..8].try_into().expect("2 bytes")) as usize;
    let sid = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    if magic != STREAM_MAGIC || version != STREAM_VERSION || tlen > crate::wire::MAX_TOKEN {
        return Err(format!(
            "bad stream hello (magic {magic:#x}, version {version})"
        ));
    }
    let mut token = vec![0u8; tlen];
    Deadlined::new(&s, deadline)
        .read_exact(&mut token)
        .map_err(|e| format!("stream hello: {e}"))?;
    // Constant time, as on the control plane: the token is a secret.
    if !ct_eq(&token, &b.token) {
        return Err("stream token mismatch".into());
    }
    let session = lock(&b.sessions)
        .get(&sid)
        .cloned()
        .ok_or_else(|| "unknown session".to_string())?;
    let sid = session.next_stream.fetch_add(1, Ordering::Relaxed);
    {
        let mut inc = lock(&session.incoming);
        if session.closed.load(Ordering::Acquire) || inc.len() >= usize::from(MAX_STREAMS) {
            return Err("session closed or stream limit reached".into());
        }
        inc.push((sid, s.try_clone().map_err(|e| e.to_string())?));
    }
    // Authenticated: the stream now counts against its session's limit.
    drop(ticket);
    // A peer that vanishes without a FIN (host down, network gone) fails the idle read.
    sys::set_keepalive(&s, b.io_timeout).map_err(|e| e.to_string())?;
    // The `OK` is the hello's last step: bounded by the same deadline.
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    let r = serve_requests(b, &session, &mut s);
    // Close for real (the clone in `incoming` would keep the socket open) and forget it.
    let _ = s.shutdown(Shutdown::Both);
    let last = {
        let mut inc = lock(&session.incoming);
        inc.retain(|(id, _)| *id != sid);
        inc.is_empty()
    };
    // The peer's streams end only when its connection does (close, break, exit): once
    // the last one is gone, the peer is, and our connection to it is released too.
    if last && !session.is_closed() {
        session.break_conn(match &r {
            Ok(()) => "the peer closed its data streams".into(),
            Err(e) => format!("the peer's data stream failed: {e}"),
        });
    }
    r
}

/// Acknowledges the stream hello, then serves requests until the stream closes.
fn serve_requests(b: &TcpShared, session: &Session, s: &mut TcpStream) -> Result<(), String> {
    s.write_all(b"OK\0\0").map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(b.io_timeout))
        .and_then(|()| s.set_write_timeout(Some(b.io_timeout)))
        .map_err(|e| e.to_string())?;
    let mut scratch = Vec::new();
    let mut acks: Vec<u8> = Vec::with_capacity(GATHER * RESP_LEN);
    loop {
        let mut req = [0u8; REQ_LEN];
        match read_idle(s, &mut req, b.io_timeout, &session.closed) {
            Ok(true) => {}
            Ok(false) => return Ok(()), // clean close between requests
            Err(e) => return Err(format!("request: {e}")),
        }
        if session.is_closed() {
            // The connection broke while this request arrived: serve nothing more.
            return Ok(());
        }
        serve_request(b, session, s, &req, &mut scratch, &mut acks)?;
        // Acks wait while the requester said more requests follow in the same burst.
        let more = req[1] == 1;
        if !acks.is_empty() && (!more || acks.len() >= GATHER * RESP_LEN) {
            s.write_all(&acks).map_err(|e| format!("respond: {e}"))?;
            acks.clear();
        }
    }
}

fn response(seq: u64, status: u32, len: u32) -> [u8; RESP_LEN] {
    let mut r = [0u8; RESP_LEN];
    r[0..8].copy_from_slice(&seq.to_le_bytes());
    r[8..12].copy_from_slice(&status.to_le_bytes());
    r[12..16].copy_from_slice(&len.to_le_bytes());
    r
}

/// Serves one request. Responses without payload are appended to `acks`; a READ's
/// response is written at once, after the pending acks.
fn serve_request(
    b: &TcpShared,
    session: &Session,
    s: &mut TcpStream,
    req: &[u8; REQ_LEN],
    scratch: &mut Vec<u8>,
    acks: &mut Vec<u8>,
) -> Result<(), String> {
    let kind = req[0];
    let rkey = u32::from_le_bytes(req[4..8].try_into().expect("4 bytes"));
    let seq = u64::from_le_bytes(req[8..16].try_into().expect("8 bytes"));
    let addr = u64::from_le_bytes(req[16..24].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(req[24..32].try_into().expect("8 bytes"));
    let tag = u32::from_le_bytes(req[32..36].try_into().expect("4 bytes"));
    if req[1] > 1 || req[2..4] != [0; 2] || req[36..40] != [0; 4] {
        return Err("reserved request bytes set".into());
    }
    match kind {
        K_NOTIFY => {
            if addr != 0 || len != 0 || rkey != 0 {
                return Err("malformed NOTIFY".into());
            }
            // Every WRITE before this NOTIFY was acked, i.e. its bytes are in memory.
            let status = match session.sink.get().filter(|_| !session.is_closed()) {
                Some(sink) if sink.notify(tag) => S_OK,
                Some(_) => S_QUEUE_FULL,
                None => S_NO_SESSION,
            };
            acks.extend_from_slice(&response(seq, status, 0));
            if status == S_QUEUE_FULL {
                // Tell the peer why, then stop serving it: it outran the application.
                let _ = s.write_all(acks);
                acks.clear();
                session.break_conn("our notification queue is full".into());
                return Err("notification queue full".into());
            }
            Ok(())
        }
        K_WRITE | K_READ => {
            if len == 0 || len > MAX_CHUNK || addr.checked_add(len).is_none() || tag != 0 {
                return Err(format!("malformed request: addr {addr:#x} len {len}"));
            }
            let needed = if kind == K_WRITE {
                Access::REMOTE_WRITE
            } else {
                Access::REMOTE_READ
            };
            let status = match b.registry.pin(addr, len, needed) {
                Err(_) => Err(S_REFUSED),
                Ok(pin) => {
                    let key_ok = pin
                        .region()
                        .chunk_at(addr)
                        .is_some_and(|c| c.rkey == rkey && addr + len <= c.addr + c.len);
                    if key_ok { Ok(pin) } else { Err(S_BAD_KEY) }
                }
            };
            let n = len as usize;
            match (kind, status) {
                (K_WRITE, Ok(_pin)) => {
                    // SAFETY: `[addr, addr+len)` lies in a registered region with
                    // REMOTE_WRITE (checked above) that `_pin` keeps registered, hence
                    // allocated, until the payload is in place.
                    unsafe { read_full_raw(s, addr as *mut u8, n, b.io_timeout, &session.closed) }
                        .map_err(|e| format!("payload: {e}"))?;
                    acks.extend_from_slice(&response(seq, S_OK, 0));
                    Ok(())
                }
                (K_WRITE, Err(st)) => {
                    // Keep the stream in sync: drain the refused payload.
                    scratch.resize(n.min(1 << 20), 0);
                    let mut left = n;
                    while left > 0 {
                        let k = left.min(scratch.len());
                        read_full(s, &mut scratch[..k], b.io_timeout)
                            .map_err(|e| format!("payload: {e}"))?;
                        left -= k;
                    }
                    acks.extend_from_slice(&response(seq, st, 0));
                    Ok(())
                }
                (_, Ok(_pin)) => {
                    let h = response(seq, S_OK, len as u32);
                    let mut iov = [
                        IoVec::from_slice(acks),
                        IoVec::from_slice(&h),
                        IoVec::raw(addr as *const u8, n),
                    ];
                    // SAFETY: `acks` and `h` are ours; `[addr, addr+len)` lies in a
                    // registered region with REMOTE_READ that `_pin` keeps registered,
                    // hence allocated, until the write returned.
                    unsafe { sys::write_all(&*s, &mut iov) }
                        .map_err(|e| format!("payload: {e}"))?;
                    acks.clear();
                    Ok(())
                }
                (_, Err(st)) => {
                    acks.extend_from_slice(&response(seq, st, 0));
                    Ok(())
                }
            }
        }
        k => Err(format!("unknown request kind {k}")),
    }
}

fn encode_request(job: &Job, more: bool) -> [u8; REQ_LEN] {
    let mut hdr = [0u8; REQ_LEN];
    let (kind, tag) = match job.kind {
        Kind::Data(Op::Write) => (K_WRITE, 0),
        Kind::Data(Op::Read) => (K_READ, 0),
        Kind::Notify(t) => (K_NOTIFY, t),
    };
    hdr[0] = kind;
    hdr[1] = u8::from(more);
    hdr[4..8].copy_from_slice(&job.rkey.to_le_bytes());
    hdr[8..16].copy_from_slice(&job.seq.to_le_bytes());
    hdr[16..24].copy_from_slice(&job.remote.to_le_bytes());
    hdr[24..32].copy_from_slice(&job.len.to_le_bytes());
    hdr[32..36].copy_from_slice(&tag.to_le_bytes());
    hdr
}

/// `read_full` into `len` bytes at `ptr` (registered memory), through raw pointers. It
/// stops with `ConnectionAborted` before any read once `stop` is set (the connection or
/// session closed): bytes still queued in the socket must not land after a close.
///
/// # Safety
/// `[ptr, ptr+len)` must be valid for writes until the call returns.
unsafe fn read_full_raw(
    s: &TcpStream,
    ptr: *mut u8,
    len: usize,
    timeout: Duration,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let mut got = 0;
    let mut last = Instant::now();
    while got < len {
        if stop.load(Ordering::Acquire) {
            return Err(ErrorKind::ConnectionAborted.into());
        }
        // SAFETY: `got < len`, so `[ptr+got, ptr+len)` is inside the caller's range.
        match unsafe { sys::read(s, ptr.add(got), len - got) } {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                last = Instant::now();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if last.elapsed() >= timeout {
                    return Err(ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a response broke the connection: no progress, or too late for its batch.
fn missed(now: Instant, last: Instant, deadline: Instant, io: Duration) -> String {
    if now >= last + io {
        format!("receive failed: no progress for {io:?}")
    } else {
        format!(
            "the peer's response missed its batch deadline by {:?}",
            now.saturating_duration_since(deadline)
        )
    }
}

/// Reads the response headers of `group` (in order, `RESP_LEN` bytes each): each within
/// `io` of the last byte received and of its batch's deadline. The socket's read timeout
/// (`io`) bounds each wait.
fn read_headers(
    s: &mut TcpStream,
    buf: &mut [u8],
    group: &[Job],
    io: Duration,
) -> Result<(), String> {
    let mut got = 0;
    let mut last = Instant::now();
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err("receive failed: end of stream".into()),
            Ok(n) => {
                got += n;
                last = Instant::now();
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(format!("receive failed: {e}")),
        }
        if let Some(job) = group.get(got / RESP_LEN) {
            let now = Instant::now();
            let deadline = job.batch.deadline();
            if now >= (last + io).min(deadline + io) {
                return Err(missed(now, last, deadline, io));
            }
        }
    }
    Ok(())
}

/// `read_exact` into our own buffer with a deadline of `timeout` of no progress.
fn read_full(s: &mut TcpStream, buf: &mut [u8], timeout: Duration) -> std::io::Result<()> {
    let mut got = 0;
    let mut last = Instant::now();
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                last = Instant::now();
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if last.elapsed() >= timeout {
                    return Err(ErrorKind::TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads a request header; waiting idle before its first byte is fine. `Ok(false)` on a
/// clean close (EOF before any byte, or the session closed while idle).
fn read_idle(
    s: &mut TcpStream,
    buf: &mut [u8],
    timeout: Duration,
    closed: &AtomicBool,
) -> std::io::Result<bool> {
    loop {
        match s.read(&mut buf[..1]) {
            Ok(0) => return Ok(false),
            Ok(_) => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if closed.load(Ordering::Acquire) {
                    return Ok(false);
                }
            }
            Err(e) => return Err(e),
        }
    }
    read_full(s, &mut buf[1..], timeout)?;
    Ok(true)
}
