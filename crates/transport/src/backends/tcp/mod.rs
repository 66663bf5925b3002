//! TCP backend: the same one-sided semantics over several TCP streams per peer.
//!
//! Each engine runs a data listener. After the control handshake each side opens
//! `min(tcp_streams, peer's streams)` streams to the other's data listener; a stream
//! starts with a hello naming the acceptor's session (a 64-bit secret exchanged in the
//! handshake) and the token. The opener sends requests on its streams, the acceptor
//! serves them, so every stream has one requester and one responder.
//!
//! Request (40 bytes): `kind u8 (1 WRITE, 2 READ, 3 NOTIFY), more u8, flags u8, 0 u8,
//! rkey u32, seq u64, addr u64, len u64, tag u32, 0 u32`, followed by `len` payload bytes
//! for WRITE. `more`: more requests of the same burst follow (the responder holds its
//! acks until the burst ends). `flags`: `F_IN_BURST` on a NOTIFY that ends its batch's
//! burst. Response (16 bytes): `seq u64, status u32, len u32`, followed by `len` bytes
//! for a successful READ.
//!
//! The responder checks every request against its own registry (range inside one
//! registered chunk with the right remote access and matching key) before touching
//! memory, then reads WRITE payload straight into the destination region (no staging
//! buffer) and acks only once it is all there. Payload moves between sockets and
//! registered memory through raw pointers only ([`super::sys`]): never a slice over
//! memory that a peer may write. A refused WRITE's payload is drained into
//! a scratch buffer so the stream stays usable; a malformed header drops the stream.
//!
//! Large batches are cut into `max_wr_bytes` chunks striped round-robin over the
//! streams, whose sender threads write them in gathers; their NOTIFY goes out only after
//! every WRITE of the batch was acked. A small batch goes out as one burst on one free
//! stream from the submitting thread (`ConnShared::send_direct`), its NOTIFY last in the
//! burst: served after the data on the same stream, and skipped if any of it was
//! refused. Either way the peer surfaces the tag only when all bytes are in its memory.
//! Each stream's receiver thread waits in an epoll instance and reads the responses,
//! unless a caller waiting for its own small batch reads them (`StreamRx::read_until`).
//! A stream error (reset, EOF, `io_timeout` with a request outstanding) breaks the whole
//! connection and fails every pending batch with `PeerGone`.
//!
//! Deadlines: a response must come within `io_timeout` of the last byte received and no
//! later than `io_timeout` after its batch's deadline; a connection that misses either
//! breaks. A sender thread's write ends by the latest deadline of the batches it carries
//! (and after `io_timeout` without progress): past it they fail with `Timeout`, and the
//! connection, whose stream may stop mid-request, breaks. A READ lands its payload only while its batch is pending (under
//! [`BatchState::landing`]): once the batch failed or was cancelled, the rest of the
//! payload is read into a scratch buffer, so nothing lands after the failure is reported.
//!
//! Every thread that moves payload is joined before memory is handed back: closing a
//! connection joins its sender and receiver threads, and shutdown joins every responder
//! thread. A submitting thread's direct send has returned before `submit` does, and a
//! caller reading responses never lands READ payload (it leaves those to the receiver).
//! Between two reads into registered memory a thread checks whether its connection or
//! session was closed, so a peer that keeps sending cannot keep it writing.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::config::EngineConfig;
use crate::contract::{
    Backend, BackendInfo, BackendInit, BatchState, Conn, ConnCtx, EndpointInfo, NotifySink,
    PendingConn, ResolvedOp, ResolvedOps,
};
use crate::core::batch::{NotifyGate, Reader};
use crate::core::registry::Registry;
use crate::core::slice::{piece_count, pieces};
use crate::core::wire::{MAX_STREAMS, MAX_TOKEN};
use crate::error::{Error, HandshakeError, PeerFault, Result};
use crate::net::admission::{Admission, MAX_CONCURRENT_HANDSHAKES, MAX_HANDSHAKES_PER_IP, Ticket};
use crate::net::deadline::{self, Deadlined};
use crate::types::{Access, BackendKind, MrHandle, Op, PeerId};
use crate::util::{ct_eq, lock, random_u64};
use sys::IoVec;

mod sys;
use smallvec::SmallVec;

/// How long a thread that expects bytes within microseconds polls before it blocks
/// ([`spin_for_request`], and a caller reading its own small batch's response).
const SPIN: Duration = Duration::from_micros(50);
const STREAM_MAGIC: u32 = u32::from_le_bytes(*b"PGWS");
/// 2: a NOTIFY may ride in its batch's burst (request flag byte 2, status `S_SKIPPED`).
const STREAM_VERSION: u16 = 2;
const REQ_LEN: usize = 40;
const RESP_LEN: usize = 16;
/// Largest chunk a responder accepts (the requester's `max_wr_bytes` is capped at 2 GiB).
const MAX_CHUNK: u64 = 1 << 31;
/// Most requests sent with one `sendmsg` (and responses read with one `read`).
const GATHER: usize = 64;
/// Stop gathering once this much WRITE payload is queued in one `sendmsg`.
const GATHER_BYTES: u64 = 4 << 20;
/// A batch of at most this many bytes and chunks is sent as one burst on one stream, by
/// the submitting thread itself when a stream is free (`ConnShared::send_direct`);
/// larger ones are striped over the streams by their sender threads.
const DIRECT_BYTES: u64 = 64 << 10;
const DIRECT_JOBS: usize = 16;

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
/// A NOTIFY sent in its batch's burst (flag `F_IN_BURST`) after a request of that burst
/// was refused: the tag was not surfaced.
const S_SKIPPED: u32 = 5;

/// Request flag (byte 2), NOTIFY only: it ends a burst that carries its batch's data
/// (`more` set on every request before it), and the responder surfaces the tag only if
/// no request of that burst was refused. It is served after them, so their bytes are in
/// memory by then.
const F_IN_BURST: u8 = 1;

/// Incoming data streams served before their hello is complete (each has a thread), in
/// all and from one source address; the excess is closed at once (`admission`). A
/// legitimate peer has at most one stream in its hello per handshake in progress.
const MAX_UNAUTHENTICATED: usize = MAX_CONCURRENT_HANDSHAKES;
const MAX_UNAUTHENTICATED_PER_IP: usize = MAX_HANDSHAKES_PER_IP;

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

/// A serving thread: the stream it serves (for shutdown; `None` once it ended) and its handle.
type ServeThread = (Option<Arc<TcpStream>>, Option<JoinHandle<()>>);

/// Responder threads, each with its stream (shared, to shut it down) until it ends.
/// Never detached: the ones that ended are joined at the next accept, the rest at
/// shutdown.
#[derive(Default)]
struct Serving {
    next: u64,
    threads: HashMap<u64, ServeThread>,
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
    incoming: Mutex<Vec<(u64, Arc<TcpStream>)>>,
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
    fn break_conn(&self, reason: Broken) {
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
            qps_or_streams: self.shared.streams,
            tx_depth: GATHER as u32,
            signal_every: 1,
            max_wr_bytes: self.shared.chunk,
            max_mr_bytes: 0,
            ..BackendInfo::default()
        }
    }

    fn register(&self, _addr: usize, _len: usize, _access: Access) -> Result<MrHandle> {
        // Keys only guard against stale addresses (a peer's view from before a
        // re-registration); start at a random value so another process's keys differ.
        let k = self.shared.next_key.fetch_add(2, Ordering::Relaxed);
        Ok(MrHandle::keyed(k))
    }

    fn deregister(&self, _mr: MrHandle) {}

    fn prepare_conn(&self) -> Result<(Box<dyn PendingConn>, EndpointInfo)> {
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
            conn.break_all(broken(
                PeerFault::Disconnected,
                "the peer closed its data streams during the handshake",
            ));
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
    /// Sent once every data chunk of the batch was acknowledged.
    Notify(u32),
    /// Sent right after the batch's data, in the same burst on the same stream
    /// (`F_IN_BURST`).
    NotifyInBurst(u32),
}

struct Tracker {
    /// Opens when every data chunk is acknowledged.
    gate: NotifyGate,
    notify: Option<u32>,
    /// The notification went out in the data's burst: its response ends the batch.
    in_burst: AtomicBool,
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
    /// When its request was handed to the kernel (set by the writer): the receiver's
    /// no-progress clock for its response starts then.
    sent: Instant,
}

impl Job {
    /// A request that moves no bytes (a notification).
    fn bare(
        batch: &Arc<BatchState>,
        tracker: &Arc<Tracker>,
        kind: Kind,
        seq: u64,
        sent: Instant,
    ) -> Job {
        Job {
            batch: batch.clone(),
            tracker: tracker.clone(),
            kind,
            local: 0,
            remote: 0,
            rkey: 0,
            len: 0,
            seq,
            sent,
        }
    }

    /// Payload bytes that follow the request header (a WRITE's).
    fn payload(&self) -> usize {
        if self.kind == Kind::Data(Op::Write) {
            self.len as usize
        } else {
            0
        }
    }
}

/// The jobs of one small batch, sent together.
type Jobs = SmallVec<[Job; 2]>;

/// A message to a stream's sender thread.
enum TxMsg {
    Job(Job),
    /// A direct send left bytes over (`TxState::rest`): write them.
    Rest,
}

/// One request as it goes on the wire: its header, then `len` payload bytes at `payload`
/// (registered memory; a WRITE's) or none.
struct Frame {
    hdr: [u8; REQ_LEN],
    payload: u64,
    len: usize,
}

impl Frame {
    /// The frames of `jobs`, all but the last flagged "more follows".
    fn of<'a>(jobs: impl ExactSizeIterator<Item = &'a Job>, out: &mut impl Extend<Frame>) {
        let n = jobs.len();
        out.extend(jobs.enumerate().map(|(i, j)| Frame {
            hdr: encode_request(j, i + 1 < n),
            payload: j.local,
            len: j.payload(),
        }));
    }

    /// The gather list of `frames`: each header, then its payload, as raw entries. The
    /// entries point into `frames` and into the payloads' memory.
    fn iov(frames: &[Frame], out: &mut impl Extend<IoVec>) {
        for f in frames {
            out.extend(std::iter::once(IoVec::from_slice(&f.hdr)));
            if f.len > 0 {
                // Payload straight from registered memory, as a raw pointer.
                out.extend(std::iter::once(IoVec::raw(f.payload as *const u8, f.len)));
            }
        }
    }
}

/// What the kernel did not take of a direct send at once.
struct Rest {
    frames: SmallVec<[Frame; 2]>,
    /// Bytes of `frames` already sent.
    sent: usize,
    /// The batch whose payload `frames` points into: its pins keep that memory registered,
    /// hence allocated, until the rest is written.
    keep: Arc<BatchState>,
}

impl Rest {
    /// Writes the rest by its batch's deadline (and `idle` without progress): see
    /// [`sys::write_all_by`].
    fn write_all(self, sock: &TcpStream, idle: Duration) -> std::io::Result<()> {
        let mut iov: SmallVec<[IoVec; 4]> = SmallVec::new();
        Frame::iov(&self.frames, &mut iov);
        let left = sys::advance(&mut iov, self.sent);
        // SAFETY: header entries point into `self.frames`, alive for the call; payload
        // entries are ranges the engine validated against registered local regions,
        // which `self.keep` keeps pinned (registered, hence allocated) until we return.
        unsafe { sys::write_all_by(sock, left, self.keep.deadline(), idle) }
    }
}

struct Live {
    sock: Arc<TcpStream>,
    /// The receiver thread's queue. A request is queued there before its first byte is
    /// written, so a response always finds its request.
    inflight: Sender<Job>,
}

/// One outgoing stream's writing side, shared by its sender thread and by threads that
/// send a small batch themselves (`ConnShared::send_direct`). Whoever writes holds
/// `state`, so requests never interleave and the receiver's queue stays in wire order.
struct StreamTx {
    state: Mutex<TxState>,
    /// Requests queued for the receiver whose responses it has not handled yet.
    outstanding: AtomicUsize,
}

struct TxState {
    /// `None` once the connection broke: the socket is closed, and the receiver fails
    /// what is queued for it and ends.
    live: Option<Live>,
    /// Left over from a direct send: the sender thread writes it before anything else,
    /// and no direct send uses the stream meanwhile.
    rest: Option<Rest>,
}

/// One outgoing stream's reading side. Its receiver thread reads it, except while a
/// caller waiting for a batch it sent directly on the stream reads the responses itself
/// (the batch's [`Reader`]); whoever reads holds `state`.
struct StreamRx {
    conn: Weak<ConnShared>,
    /// The stream's index in its connection.
    i: usize,
    /// Requests in wire order (queued by the writers before their first byte is written).
    inflight: Receiver<Job>,
    state: Mutex<RxState>,
}

struct RxState {
    /// The stream's reading end; `None` once the receiver thread ended.
    sock: Option<Arc<TcpStream>>,
    /// Where the receiver thread waits for the stream to be readable; a caller reading
    /// the stream takes it out meanwhile. `None` once the receiver thread ended.
    epoll: Option<Arc<sys::Epoll>>,
    /// Requests whose responses are being read, in order: their headers are read into
    /// `buf[..have]` (never past a READ's header: its payload follows it), and the first
    /// `done` are handled.
    group: Vec<Job>,
    buf: Vec<u8>,
    have: usize,
    done: usize,
    /// When the last response byte arrived.
    last: Instant,
    scratch: Vec<u8>,
}

/// What [`ConnShared::pump`] left the stream in.
enum Pumped {
    /// Nothing outstanding.
    Idle,
    /// A response is due: wait for the stream until at most this instant, past which
    /// the connection breaks (no progress, or the response's batch deadline missed).
    Waiting(Instant),
    /// A caller's read ended: its condition holds, or the next response carries READ
    /// payload (left to the receiver thread, which lands it).
    Stopped,
}

impl Reader for StreamRx {
    /// Reads the stream for a caller waiting for a batch it sent directly on it: the
    /// stream is taken out of the receiver thread's epoll instance meanwhile, so the
    /// responses read here wake only this caller. Returns at once when the receiver
    /// thread is reading (it holds the state); stops at `until`, when `done()` holds,
    /// or before a READ's response, and leaves the rest (even half a header) to the
    /// receiver thread, whose epoll instance gets the stream back (level-triggered:
    /// unread bytes wake it at once).
    fn read_until(&self, done: &dyn Fn() -> bool, until: Instant) {
        let Some(conn) = self.conn.upgrade() else {
            return;
        };
        let mut st = match self.state.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        // The receiver thread closes these only under `state`, which we hold.
        let (Some(epoll), Some(fd)) = (
            st.epoll.clone(),
            st.sock.as_ref().map(std::os::fd::AsRawFd::as_raw_fd),
        ) else {
            return;
        };
        if done() || epoll.remove(&fd).is_err() {
            return;
        }
        loop {
            match conn.pump(self.i, &mut st, Some(done)) {
                Ok(Pumped::Waiting(limit)) => {
                    let now = Instant::now();
                    if now >= until {
                        break;
                    }
                    let wait = limit.min(until).saturating_duration_since(now);
                    // The response of a small batch is due in microseconds: poll
                    // before sleeping (see `spin_for_request`, the peer's half of it).
                    let ready = match sys::spin_readable(&fd, SPIN.min(wait)) {
                        Ok(true) => Ok(true),
                        Ok(false) => sys::wait_readable(&fd, wait),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = ready {
                        conn.break_all(io_broken("receive failed", &e));
                        conn.fail_group(self.i, &mut st, &conn.gone());
                        break;
                    }
                }
                Ok(Pumped::Idle | Pumped::Stopped) => break,
                Err(e) => {
                    conn.break_all(e);
                    conn.fail_group(self.i, &mut st, &conn.gone());
                    break;
                }
            }
        }
        if let Err(e) = epoll.add(&fd) {
            // The receiver thread still wakes every I/O timeout and reads then.
            tracing::warn!(error = %e, "cannot hand a TCP stream back to its receiver");
        }
    }
}

struct ConnShared {
    peer: PeerId,
    chunk: u64,
    io_timeout: Duration,
    /// Job queues of the sender threads; taken on close so they drain and exit.
    queues: Mutex<Vec<Sender<TxMsg>>>,
    streams: Vec<StreamTx>,
    rx: Vec<Arc<StreamRx>>,
    /// The outgoing streams, to shut them down; released when the connection breaks (the
    /// sender and receiver hold the same sockets, one descriptor each, and exit then).
    socks: Mutex<Vec<Arc<TcpStream>>>,
    /// The session of the peer's streams to us: closed when this connection breaks, so
    /// a peer we consider gone can no longer write or notify through it.
    session: Arc<Session>,
    backend: Weak<TcpShared>,
    next: AtomicUsize,
    seq: AtomicU64,
    broken: AtomicBool,
    reason: Mutex<Option<Broken>>,
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
        // One descriptor per stream, shared by its sender and receiver (`&TcpStream` reads
        // and writes): no `dup` per thread, so a peer costs 2 descriptors per stream (the
        // socket and its epoll instance), not 4.
        let socks: Vec<Arc<TcpStream>> = socks.into_iter().map(Arc::new).collect();
        let mut queues = Vec::new();
        let mut jobs = Vec::new();
        let mut streams = Vec::new();
        let mut readers = Vec::new();
        for s in &socks {
            let (tx, rx) = crossbeam_channel::unbounded::<TxMsg>();
            queues.push(tx);
            jobs.push(rx);
            // Unbounded: the socket's own buffers are the back-pressure; a bounded queue
            // could block a writer between queueing a request and writing it.
            let (in_tx, in_rx) = crossbeam_channel::unbounded::<Job>();
            streams.push(StreamTx {
                state: Mutex::new(TxState {
                    live: Some(Live {
                        sock: Arc::clone(s),
                        inflight: in_tx,
                    }),
                    rest: None,
                }),
                outstanding: AtomicUsize::new(0),
            });
            // The descriptor in the epoll instance is the one `read_until` names.
            let rsock = Arc::clone(s);
            let epoll = sys::Epoll::new()
                .and_then(|e| e.add(&rsock).map(|()| e))
                .map_err(|e| Error::io("epoll for a data stream", e))?;
            readers.push((in_rx, rsock, Arc::new(epoll)));
        }
        let conn = Arc::new_cyclic(|me: &Weak<ConnShared>| ConnShared {
            peer,
            chunk,
            io_timeout,
            queues: Mutex::new(queues),
            streams,
            rx: readers
                .into_iter()
                .enumerate()
                .map(|(i, (inflight, sock, epoll))| {
                    Arc::new(StreamRx {
                        conn: me.clone(),
                        i,
                        inflight,
                        state: Mutex::new(RxState {
                            sock: Some(sock),
                            epoll: Some(epoll),
                            group: Vec::with_capacity(GATHER),
                            buf: vec![0u8; GATHER * RESP_LEN],
                            have: 0,
                            done: 0,
                            last: Instant::now(),
                            scratch: Vec::new(),
                        }),
                    })
                })
                .collect(),
            socks: Mutex::new(socks),
            session,
            backend,
            next: AtomicUsize::new(0),
            seq: AtomicU64::new(1),
            broken: AtomicBool::new(false),
            reason: Mutex::new(None),
            threads: Mutex::new(Vec::new()),
        });
        for (i, jobs) in jobs.into_iter().enumerate() {
            let c = conn.clone();
            let tx = std::thread::Builder::new()
                .name(format!("pagewire-tcp-tx{i}"))
                .spawn(move || c.send_loop(i, jobs));
            let c = conn.clone();
            let rx = std::thread::Builder::new()
                .name(format!("pagewire-tcp-rx{i}"))
                .spawn(move || c.recv_loop(i));
            match (tx, rx) {
                (Ok(t), Ok(r)) => lock(&conn.threads).extend([t, r]),
                (t, r) => {
                    let err = t.as_ref().err().or(r.as_ref().err()).map(|e| e.kind());
                    lock(&conn.threads).extend(t.ok().into_iter().chain(r.ok()));
                    conn.close_and_join(broken(
                        PeerFault::ClosedLocally,
                        "cannot spawn a stream thread",
                    ));
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
    fn close_and_join(&self, reason: Broken) {
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
        let b = lock(&self.reason)
            .clone()
            .unwrap_or_else(|| broken(PeerFault::ClosedLocally, "connection closed"));
        Error::peer_gone(self.peer, b.fault, b.reason)
    }

    /// Marks the connection broken and shuts every stream down, both ways, so each
    /// thread wakes, fails what it holds and exits, and its descriptors are released.
    /// The peer's session is closed first: once `broken` is visible (`peer_alive` false),
    /// no request of the peer's starts to be served, on an old stream or a new one.
    /// Never called with a stream's `state` held (it takes each).
    fn break_all(&self, reason: Broken) {
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
        // A writer blocked in a write holds its stream's state: the shutdown above ended
        // that write. Nothing more is queued for the receivers, so each ends once it has
        // failed what is queued; a left-over rest is dropped unwritten.
        for s in &self.streams {
            let mut st = lock(&s.state);
            st.live = None;
            st.rest = None;
        }
    }

    fn enqueue(&self, job: Job) -> Result<()> {
        let q = lock(&self.queues);
        if self.broken.load(Ordering::Acquire) || q.is_empty() {
            return Err(self.gone());
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % q.len();
        q[i].send(TxMsg::Job(job)).map_err(|_| self.gone())
    }

    /// Sends `jobs` (the requests of one batch) directly if a stream is free, else queues
    /// them for the sender threads.
    fn send(&self, mut jobs: Jobs) -> Result<()> {
        if self.send_direct(&mut jobs) {
            return Ok(());
        }
        jobs.into_iter().try_for_each(|j| self.enqueue(j))
    }

    /// Sends `jobs` (the requests of one small batch) on one stream from the calling
    /// thread, without a hand-off to a sender thread: on a stream whose lock is free and
    /// that owes nothing (no rest, no queued job), preferring one with no response
    /// outstanding, lowest index first (a lone caller keeps the same threads warm). The
    /// requests are queued for the receiver, then sent with one non-blocking `sendmsg`;
    /// what the kernel does not take at once is left to the stream's sender thread,
    /// which writes it before anything else. Never blocks. `false` (and `jobs` left as
    /// they were) when no stream is free or the connection broke: the caller then
    /// queues them.
    fn send_direct(&self, jobs: &mut Jobs) -> bool {
        if jobs.is_empty() || self.broken.load(Ordering::Acquire) {
            return false;
        }
        for quiet in [true, false] {
            for (i, s) in self.streams.iter().enumerate() {
                if quiet && s.outstanding.load(Ordering::Acquire) != 0 {
                    continue;
                }
                let st = match s.state.try_lock() {
                    Ok(g) => g,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => continue,
                };
                if st.rest.is_some()
                    || st.live.is_none()
                    || !lock(&self.queues).get(i).is_some_and(Sender::is_empty)
                {
                    continue;
                }
                self.write_direct(i, s, st, std::mem::take(jobs), quiet);
                return true;
            }
        }
        false
    }

    /// The send of [`Self::send_direct`] on stream `i`, whose state `st` is held.
    /// `quiet`: no response was outstanding on the stream, so this batch's responses
    /// come first, and a caller waiting for the batch may read them itself (unless one
    /// carries READ payload, which only the receiver thread lands).
    fn write_direct(
        &self,
        i: usize,
        s: &StreamTx,
        mut st: std::sync::MutexGuard<'_, TxState>,
        jobs: Jobs,
        quiet: bool,
    ) {
        debug_assert!(jobs.iter().all(|j| Arc::ptr_eq(&j.batch, &jobs[0].batch)));
        let keep = jobs[0].batch.clone();
        if quiet && jobs.iter().all(|j| j.kind != Kind::Data(Op::Read)) {
            let reader: Weak<dyn Reader> = Arc::downgrade(&self.rx[i]) as Weak<StreamRx>;
            keep.set_reader(reader);
        }
        let mut frames: SmallVec<[Frame; 2]> = SmallVec::new();
        Frame::of(jobs.iter(), &mut frames);
        let Some(live) = st.live.as_ref() else {
            unreachable!("checked by the caller under the same lock")
        };
        s.outstanding.fetch_add(jobs.len(), Ordering::AcqRel);
        let now = Instant::now();
        for mut j in jobs {
            j.sent = now;
            // The receiver holds its end until every sender is gone (`live` above).
            if let Err(crossbeam_channel::SendError(j)) = live.inflight.send(j) {
                s.outstanding.fetch_sub(1, Ordering::AcqRel);
                j.batch.fail(self.gone());
            }
        }
        let mut iov: SmallVec<[IoVec; 4]> = SmallVec::new();
        Frame::iov(&frames, &mut iov);
        let total = sys::iov_len(&iov);
        // SAFETY: header entries point into `frames`, alive for the call; payload entries
        // are ranges the engine validated against registered local regions, which `keep`
        // (the batch) keeps pinned, hence registered and allocated, until we return.
        let sent = match unsafe { sys::write_now(&live.sock, &iov) } {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
            Err(e) => {
                drop(st);
                // The receiver fails the queued requests.
                self.break_all(io_broken("send failed", &e));
                return;
            }
        };
        if sent < total {
            st.rest = Some(Rest { frames, sent, keep });
            // Lock order: a stream's state, then the queues (break_all never holds both).
            if let Some(q) = lock(&self.queues).get(i) {
                let _ = q.send(TxMsg::Rest);
            }
        }
    }

    /// Sends queued jobs in gathers: up to `GATHER` requests (headers and WRITE payloads
    /// straight from registered memory) per `sendmsg`. All but the last request of a
    /// gather carry the "more follows" flag, so the responder batches its acks too.
    /// Writes a direct send's rest first.
    fn send_loop(self: Arc<Self>, i: usize, jobs: Receiver<TxMsg>) {
        let stream = &self.streams[i];
        let mut gather: Vec<Job> = Vec::with_capacity(GATHER);
        let mut frames: Vec<Frame> = Vec::with_capacity(GATHER);
        let mut iov: Vec<IoVec> = Vec::with_capacity(2 * GATHER);
        let mut keep: Vec<Arc<BatchState>> = Vec::with_capacity(GATHER);
        while let Ok(first) = jobs.recv() {
            let mut bytes = 0u64;
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                if let TxMsg::Job(job) = msg {
                    if self.broken.load(Ordering::Acquire) {
                        job.batch.fail(self.gone());
                    } else if !(matches!(job.kind, Kind::Data(_))
                        && job.batch.should_stop(Instant::now()))
                    {
                        bytes += job.payload() as u64;
                        gather.push(job);
                    }
                }
                if gather.len() < GATHER && bytes < GATHER_BYTES {
                    next = jobs.try_recv().ok();
                }
            }
            let mut st = lock(&stream.state);
            let rest = st.rest.take();
            if rest.is_none() && gather.is_empty() {
                continue;
            }
            if let Some(r) = &rest {
                keep.push(r.keep.clone());
            }
            let mut res = match (rest, &st.live) {
                (Some(r), Some(live)) => r.write_all(&live.sock, self.io_timeout),
                _ => Ok(()),
            };
            if res.is_ok() && !gather.is_empty() {
                frames.clear();
                Frame::of(gather.iter(), &mut frames);
                iov.clear();
                Frame::iov(&frames, &mut iov);
                // Queue before sending so the receiver always knows what a response
                // answers; `keep` holds every batch of the gather until the write returned.
                keep.extend(gather.iter().map(|j| j.batch.clone()));
                // One write for several batches: it may go on while any of them may, so
                // until the last deadline among them. Past it, every batch it carries
                // failed (`Timeout`), and the stream, maybe cut mid-request, is closed.
                let until = gather
                    .iter()
                    .map(|j| j.batch.deadline())
                    .max()
                    .unwrap_or_else(Instant::now);
                match st.live.as_ref() {
                    Some(live) => {
                        stream.outstanding.fetch_add(gather.len(), Ordering::AcqRel);
                        let now = Instant::now();
                        for mut job in gather.drain(..) {
                            job.sent = now;
                            if let Err(crossbeam_channel::SendError(job)) = live.inflight.send(job)
                            {
                                stream.outstanding.fetch_sub(1, Ordering::AcqRel);
                                job.batch.fail(self.gone());
                            }
                        }
                        // SAFETY: the header entries point into `frames`, untouched until
                        // the next gather; each payload entry is a range the engine
                        // validated against a registered local region, which its batch
                        // keeps pinned (so registered and allocated), and `keep` holds
                        // every batch of the gather until `write_all_by` returned.
                        res = unsafe {
                            sys::write_all_by(&live.sock, &mut iov, until, self.io_timeout)
                        };
                    }
                    None => res = Err(ErrorKind::BrokenPipe.into()),
                }
            }
            drop(st);
            iov.clear();
            if let Err(e) = res {
                if e.kind() == ErrorKind::TimedOut {
                    // The deadline of what was being written passed: those batches fail
                    // with `Timeout` (the rest of the connection's with `PeerGone` below).
                    let now = Instant::now();
                    for b in &keep {
                        b.expire_if_due(now);
                    }
                }
                // The stream may end mid-request: it cannot carry another one, so the
                // connection breaks.
                self.break_all(match e.kind() {
                    ErrorKind::TimedOut => broken(
                        PeerFault::Unresponsive,
                        "send failed: the peer did not take a batch's bytes by its deadline",
                    ),
                    ErrorKind::WouldBlock => broken(
                        PeerFault::Unresponsive,
                        "send failed: the peer took no bytes within the I/O timeout",
                    ),
                    _ => io_broken("send failed", &e),
                });
                let err = self.gone();
                for b in keep.iter().chain(gather.iter().map(|j| &j.batch)) {
                    b.fail(err.clone());
                }
                gather.clear();
            }
            keep.clear();
        }
    }

    /// The receiver thread of stream `i`: waits until the stream is readable (in its
    /// epoll instance, not on a queue: requests are queued without waking it), then
    /// handles what arrived ([`Self::pump`]). While a caller reads the stream itself
    /// (`StreamRx::read_until`) the stream is out of the epoll instance, so the
    /// responses the caller reads do not wake this thread. It also wakes every
    /// `io_timeout` (and when a response is due) to apply the deadlines.
    fn recv_loop(self: Arc<Self>, i: usize) {
        let rx = &self.rx[i];
        let Some(epoll) = lock(&rx.state).epoll.clone() else {
            return;
        };
        let err = loop {
            let mut st = lock(&rx.state);
            let wait = match self.pump(i, &mut st, None) {
                Ok(Pumped::Waiting(limit)) => limit.saturating_duration_since(Instant::now()),
                Ok(_) => self.io_timeout,
                Err(e) => {
                    self.break_all(e);
                    let err = self.gone();
                    self.fail_group(i, &mut st, &err);
                    break err;
                }
            };
            drop(st);
            if let Err(e) = epoll.wait(wait) {
                self.break_all(io_broken("receive failed", &e));
                let err = self.gone();
                self.fail_group(i, &mut lock(&rx.state), &err);
                break err;
            }
        };
        // Broken: fail what is queued until no sender is left, then close the stream.
        while let Ok(j) = rx.inflight.recv() {
            self.streams[i].outstanding.fetch_sub(1, Ordering::AcqRel);
            j.batch.fail(err.clone());
        }
        let mut st = lock(&rx.state);
        self.fail_group(i, &mut st, &err);
        st.sock = None;
        st.epoll = None;
    }

    /// Fails the requests of `st`'s group not handled yet and empties it.
    fn fail_group(&self, i: usize, st: &mut RxState, err: &Error) {
        let left = st.group.len() - st.done;
        for j in st.group.drain(..).skip(st.done) {
            j.batch.fail(err.clone());
        }
        (st.have, st.done) = (0, 0);
        self.streams[i]
            .outstanding
            .fetch_sub(left, Ordering::AcqRel);
    }

    /// Reads and handles what stream `i` holds for its reader (`st` held), without
    /// waiting for bytes, except for a READ's payload, which the receiver thread lands
    /// as it comes ([`Self::land_read`]). Responses come in request order; runs of
    /// responses without payload are read with one `recv`. With `done` (a caller
    /// reading for its own batch) it stops once `done()` holds, and before a READ's
    /// response. An `Err` means the stream is unusable.
    fn pump(
        &self,
        i: usize,
        st: &mut RxState,
        done: Option<&dyn Fn() -> bool>,
    ) -> Result<Pumped, Broken> {
        let io = self.io_timeout;
        let RxState {
            sock,
            group,
            buf,
            have,
            done: handled,
            last,
            scratch,
            ..
        } = st;
        let Some(sock) = sock.as_ref() else {
            return Err(broken(PeerFault::ClosedLocally, "connection closed"));
        };
        let inflight = &self.rx[i].inflight;
        let fill = |group: &mut Vec<Job>| {
            while group.len() < GATHER {
                match inflight.try_recv() {
                    Ok(j) => {
                        let read = j.kind == Kind::Data(Op::Read);
                        group.push(j);
                        if read {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        };
        loop {
            if done.is_some_and(|d| d()) {
                return Ok(Pumped::Stopped);
            }
            if group.is_empty() {
                fill(group);
                if group.is_empty() {
                    // Nothing outstanding; but see whether the stream ended (the peer
                    // left, or we shut it down): bytes now answer no request.
                    // SAFETY: `buf` is ours and holds at least RESP_LEN bytes.
                    match unsafe { sys::recv_now(sock, buf.as_mut_ptr(), RESP_LEN) } {
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Pumped::Idle),
                        Err(e) => return Err(io_broken("receive failed", &e)),
                        Ok(0) => {
                            return Err(broken(
                                PeerFault::Disconnected,
                                "receive failed: end of stream",
                            ));
                        }
                        Ok(n) => {
                            *have = n;
                            *last = Instant::now();
                        }
                    }
                    // A request is queued before it is written: its job is there now.
                    fill(group);
                    if group.is_empty() {
                        return Err(broken(PeerFault::Protocol, "a response to no request"));
                    }
                }
            }
            let job = &group[*handled];
            if done.is_some() && job.kind == Kind::Data(Op::Read) {
                return Ok(Pumped::Stopped);
            }
            let end = (*handled + 1) * RESP_LEN;
            if *have < end {
                let want = group.len() * RESP_LEN;
                // SAFETY: `buf` is ours and holds `want` bytes (`have < want`).
                match unsafe { sys::recv_now(sock, buf.as_mut_ptr().add(*have), want - *have) } {
                    Ok(0) => {
                        return Err(broken(
                            PeerFault::Disconnected,
                            "receive failed: end of stream",
                        ));
                    }
                    Ok(n) => {
                        *have += n;
                        *last = Instant::now();
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        let now = Instant::now();
                        let since = job.sent.max(*last);
                        let deadline = job.batch.deadline();
                        let limit = (since + io).min(deadline + io);
                        if now >= limit {
                            return Err(missed(now, since, deadline, io));
                        }
                        return Ok(Pumped::Waiting(limit));
                    }
                    Err(e) => return Err(io_broken("receive failed", &e)),
                }
            }
            self.recv_one(sock, job, &buf[end - RESP_LEN..end], io, scratch)?;
            *handled += 1;
            self.streams[i].outstanding.fetch_sub(1, Ordering::AcqRel);
            if *handled == group.len() {
                group.clear();
                (*have, *handled) = (0, 0);
            }
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
    ) -> Result<(), Broken> {
        let seq = u64::from_le_bytes(h[0..8].try_into().expect("8 bytes"));
        let status = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
        if seq != job.seq {
            return Err(broken(
                PeerFault::Protocol,
                format!("response seq {seq} for request {}", job.seq),
            ));
        }
        if status != S_OK {
            if len != 0 {
                return Err(broken(PeerFault::Protocol, "error response with payload"));
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
                S_SKIPPED => "notification not surfaced: a request of its batch was refused".into(),
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
                    return Err(broken(
                        PeerFault::Protocol,
                        format!("READ response of {len} bytes for {}", job.len),
                    ));
                }
                if !self.land_read(sock, job, io_timeout, scratch)? {
                    // The batch failed or was cancelled meanwhile; the stream is in sync.
                    return Ok(());
                }
            }
            _ if len != 0 => return Err(broken(PeerFault::Protocol, "unexpected payload")),
            _ => {}
        }
        match job.kind {
            Kind::Data(_) => {
                job.batch.add_progress(1, job.len);
                if job.tracker.gate.landed(1) {
                    self.last_data_done(job);
                }
            }
            Kind::Notify(_) | Kind::NotifyInBurst(_) => job.batch.succeed(Instant::now()),
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
    ) -> Result<bool, Broken> {
        let (len, deadline) = (job.len as usize, job.batch.deadline());
        let mut land = true;
        let mut got = 0;
        let mut last = Instant::now();
        while got < len {
            if self.broken.load(Ordering::Acquire) {
                return Err(broken(PeerFault::ClosedLocally, "connection closed"));
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
                // allocated) while it is pending, and a guard is only given to a pending
                // batch (a batch of READs loses its pins when it fails, under this same
                // guard: `BatchState::guarded_by_landing`); `got < len`. Only this thread
                // writes there, and only while the batch is pending (the guard).
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
                Ok(0) => {
                    return Err(broken(
                        PeerFault::Disconnected,
                        "receive failed: end of stream",
                    ));
                }
                Ok(n) => {
                    got += n;
                    last = now;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Wake at the batch deadline too, to fail it on time.
                    let wake = if land { limit.min(deadline) } else { limit };
                    sys::wait_readable(sock, wake.saturating_duration_since(now))
                        .map_err(|e| io_broken("receive failed", &e))?;
                }
                Err(e) => return Err(io_broken("receive failed", &e)),
            }
        }
        Ok(land)
    }

    /// Every chunk of the batch is acknowledged: send the notification or finish.
    fn last_data_done(&self, job: &Job) {
        if job.tracker.in_burst.load(Ordering::Acquire) {
            // Its response, which follows, ends the batch.
            return;
        }
        let Some(tag) = job.tracker.notify else {
            job.batch.succeed(Instant::now());
            return;
        };
        if job.batch.should_stop(Instant::now()) {
            return;
        }
        let n = Job::bare(
            &job.batch,
            &job.tracker,
            Kind::Notify(tag),
            self.seq.fetch_add(1, Ordering::Relaxed),
            Instant::now(),
        );
        // On this (receiving) thread a direct send never blocks: at worst it queues.
        if let Err(e) = self.send(smallvec::smallvec![n]) {
            job.batch.fail(e);
        }
    }
}

struct TcpConn {
    conn: Arc<ConnShared>,
}

impl Conn for TcpConn {
    fn post(&self, batch: BatchState, ops: ResolvedOps, notify: Option<u32>) -> Result<()> {
        // A READ's request carries no local bytes, and its payload lands under the
        // batch's landing guard: a batch of READs is done with its memory once it fails.
        // (A WRITE's payload is sent from the caller's memory by a sender thread.)
        if ops.iter().all(|o| o.op == Op::Read) {
            batch.guarded_by_landing();
        }
        let batch = Arc::new(batch);
        let c = &self.conn;
        if c.broken.load(Ordering::Acquire) {
            return Err(c.gone());
        }
        let chunks: usize = ops
            .iter()
            .map(|o| piece_count(o.len, c.chunk) as usize)
            .sum();
        let tracker = Arc::new(Tracker {
            gate: NotifyGate::new(chunks as u64),
            notify,
            in_burst: AtomicBool::new(false),
        });
        let seq = || c.seq.fetch_add(1, Ordering::Relaxed);
        // Overwritten by the writer; a clock read per batch, not per chunk.
        let now = Instant::now();
        if chunks == 0 {
            // A notification alone (the core refuses an empty batch without one): no data
            // to wait for, so the notify request goes out at once.
            let Some(tag) = notify else {
                batch.succeed(Instant::now());
                return Ok(());
            };
            return c.send(smallvec::smallvec![Job::bare(
                &batch,
                &tracker,
                Kind::Notify(tag),
                seq(),
                now
            )]);
        }
        let chunks_of = |o: ResolvedOp| {
            let (batch, tracker) = (batch.clone(), tracker.clone());
            pieces(o.len, c.chunk).map(move |(off, len)| Job {
                batch: batch.clone(),
                tracker: tracker.clone(),
                kind: Kind::Data(o.op),
                local: o.local + off,
                remote: o.remote + off,
                rkey: o.rkey,
                len,
                seq: seq(),
                sent: now,
            })
        };
        let bytes = ops.iter().fold(0u64, |a, o| a.saturating_add(o.len));
        if bytes <= DIRECT_BYTES && chunks <= DIRECT_JOBS {
            if batch.should_stop(Instant::now()) {
                // Expired (now failed) or cancelled before anything went out: as the
                // sender threads do, send none of it.
                return Ok(());
            }
            // Small: one burst on one stream, from this thread if a stream is free, the
            // notification last in it (served after the data, so no wait for the acks).
            let mut jobs: Jobs = ops.iter().copied().flat_map(chunks_of).collect();
            if let Some(tag) = notify {
                tracker.in_burst.store(true, Ordering::Release);
                jobs.push(Job::bare(
                    &batch,
                    &tracker,
                    Kind::NotifyInBurst(tag),
                    seq(),
                    now,
                ));
            }
            if c.send_direct(&mut jobs) {
                return Ok(());
            }
            // Queued, the chunks are striped: the notification waits for their acks.
            if notify.is_some() {
                jobs.pop();
                tracker.in_burst.store(false, Ordering::Release);
            }
            return jobs.into_iter().try_for_each(|j| c.enqueue(j));
        }
        for &o in &ops {
            for job in chunks_of(o) {
                c.enqueue(job)?;
            }
        }
        Ok(())
    }

    fn is_broken(&self) -> bool {
        self.conn.broken.load(Ordering::Acquire)
    }

    fn close(&self) {
        // Breaking closes the peer's session too (break_all); then join our threads.
        self.conn.close_and_join(broken(
            PeerFault::ClosedLocally,
            "connection closed locally",
        ));
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
        // One descriptor, shared with the serving thread (it reads and writes through
        // `&TcpStream`): shutdown and the session's close reach it without a `dup`.
        let s = Arc::new(s);
        let clone = Arc::clone(&s);
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
                // Let go of the shared stream too; the handle stays, to be joined.
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
    s: Arc<TcpStream>,
    ticket: Ticket,
    deadline: Instant,
) -> Result<(), Broken> {
    let _ = s.set_nodelay(true);
    let mut h = [0u8; 16];
    Deadlined::new(&s, deadline)
        .read_exact(&mut h)
        .map_err(|e| io_broken("stream hello", &e))?;
    let magic = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    let version = u16::from_le_bytes(h[4..6].try_into().expect("2 bytes"));
    let tlen = u16::from_le_bytes(h[6..8].try_into().expect("2 bytes")) as usize;
    let sid = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    if magic != STREAM_MAGIC || version != STREAM_VERSION || tlen > MAX_TOKEN {
        return Err(broken(
            PeerFault::Protocol,
            format!("bad stream hello (magic {magic:#x}, version {version})"),
        ));
    }
    let mut token = vec![0u8; tlen];
    Deadlined::new(&s, deadline)
        .read_exact(&mut token)
        .map_err(|e| io_broken("stream hello", &e))?;
    // Constant time, as on the control plane: the token is a secret.
    if !ct_eq(&token, &b.token) {
        return Err(broken(PeerFault::Protocol, "stream token mismatch"));
    }
    let session = lock(&b.sessions)
        .get(&sid)
        .cloned()
        .ok_or_else(|| broken(PeerFault::Protocol, "unknown session"))?;
    let sid = session.next_stream.fetch_add(1, Ordering::Relaxed);
    {
        let mut inc = lock(&session.incoming);
        if session.closed.load(Ordering::Acquire) || inc.len() >= usize::from(MAX_STREAMS) {
            return Err(broken(
                PeerFault::Protocol,
                "session closed or stream limit reached",
            ));
        }
        inc.push((sid, Arc::clone(&s)));
    }
    // Authenticated: the stream now counts against its session's limit.
    drop(ticket);
    // A peer that vanishes without a FIN (host down, network gone) fails the idle read.
    sys::set_keepalive(&s, b.io_timeout).map_err(|e| io_broken("stream options", &e))?;
    // The `OK` is the hello's last step: bounded by the same deadline.
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| io_broken("stream options", &e))?;
    let r = serve_requests(b, &session, &mut &*s);
    // Close for real (`incoming` shares the socket and would keep it open) and forget it.
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
            Ok(()) => broken(PeerFault::Disconnected, "the peer closed its data streams"),
            Err(e) => broken(
                e.fault,
                format!("the peer's data stream failed: {}", e.reason),
            ),
        });
    }
    r
}

/// Acknowledges the stream hello, then serves requests until the stream closes.
fn serve_requests(b: &TcpShared, session: &Session, s: &mut &TcpStream) -> Result<(), Broken> {
    s.write_all(b"OK\0\0")
        .map_err(|e| io_broken("stream hello", &e))?;
    s.set_read_timeout(Some(b.io_timeout))
        .and_then(|()| s.set_write_timeout(Some(b.io_timeout)))
        .map_err(|e| io_broken("stream options", &e))?;
    let mut scratch = Vec::new();
    let mut acks: Vec<u8> = Vec::with_capacity(GATHER * RESP_LEN);
    // A request of the current burst was refused.
    let mut refused = false;
    // Payload bytes of the current burst, and whether the last burst was a small call's
    // (what a caller waits for with the next one likely soon): only then poll a while
    // for the next request before blocking.
    let (mut burst_bytes, mut small) = (0u64, false);
    loop {
        let mut req = [0u8; REQ_LEN];
        match read_idle(s, &mut req, b.io_timeout, &session.closed, small) {
            Ok(true) => {}
            Ok(false) => return Ok(()), // clean close between requests
            Err(e) => return Err(io_broken("request", &e)),
        }
        if session.is_closed() {
            // The connection broke while this request arrived: serve nothing more.
            return Ok(());
        }
        serve_request(b, session, s, &req, &mut scratch, &mut acks, &mut refused)?;
        // Acks wait while the requester said more requests follow in the same burst.
        let more = req[1] == 1;
        burst_bytes =
            burst_bytes.saturating_add(u64::from_le_bytes(req[24..32].try_into().expect("8")));
        if !more {
            refused = false;
            small = burst_bytes <= DIRECT_BYTES;
            burst_bytes = 0;
        }
        if !acks.is_empty() && (!more || acks.len() >= GATHER * RESP_LEN) {
            s.write_all(&acks).map_err(|e| io_broken("respond", &e))?;
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
/// response is written at once, after the pending acks. `refused`: a request of the
/// current burst was refused (set here; an `F_IN_BURST` NOTIFY is then skipped).
fn serve_request(
    b: &TcpShared,
    session: &Session,
    s: &mut &TcpStream,
    req: &[u8; REQ_LEN],
    scratch: &mut Vec<u8>,
    acks: &mut Vec<u8>,
    refused: &mut bool,
) -> Result<(), Broken> {
    let kind = req[0];
    let rkey = u32::from_le_bytes(req[4..8].try_into().expect("4 bytes"));
    let seq = u64::from_le_bytes(req[8..16].try_into().expect("8 bytes"));
    let addr = u64::from_le_bytes(req[16..24].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(req[24..32].try_into().expect("8 bytes"));
    let tag = u32::from_le_bytes(req[32..36].try_into().expect("4 bytes"));
    let in_burst = req[2] == F_IN_BURST;
    if req[1] > 1
        || req[2] > F_IN_BURST
        || (in_burst && kind != K_NOTIFY)
        || req[3] != 0
        || req[36..40] != [0; 4]
    {
        return Err(broken(PeerFault::Protocol, "reserved request bytes set"));
    }
    match kind {
        K_NOTIFY => {
            if addr != 0 || len != 0 || rkey != 0 {
                return Err(broken(PeerFault::Protocol, "malformed NOTIFY"));
            }
            // Every WRITE before this NOTIFY was acked, i.e. its bytes are in memory; or,
            // in its burst, was served before it on this stream (so the same holds), and
            // none of them was refused.
            let status = match session.sink.get().filter(|_| !session.is_closed()) {
                _ if in_burst && *refused => S_SKIPPED,
                Some(sink) if sink.notify(tag) => S_OK,
                Some(_) => S_QUEUE_FULL,
                None => S_NO_SESSION,
            };
            acks.extend_from_slice(&response(seq, status, 0));
            if status == S_QUEUE_FULL {
                // Tell the peer why, then stop serving it: it outran the application.
                let _ = s.write_all(acks);
                acks.clear();
                session.break_conn(broken(PeerFault::Overran, "our notification queue is full"));
                return Err(broken(PeerFault::Overran, "notification queue full"));
            }
            Ok(())
        }
        K_WRITE | K_READ => {
            if len == 0 || len > MAX_CHUNK || addr.checked_add(len).is_none() || tag != 0 {
                return Err(broken(
                    PeerFault::Protocol,
                    format!("malformed request: addr {addr:#x} len {len}"),
                ));
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
            *refused |= status.is_err();
            match (kind, status) {
                (K_WRITE, Ok(_pin)) => {
                    // SAFETY: `[addr, addr+len)` lies in a registered region with
                    // REMOTE_WRITE (checked above) that `_pin` keeps registered, hence
                    // allocated, until the payload is in place.
                    unsafe { read_full_raw(s, addr as *mut u8, n, b.io_timeout, &session.closed) }
                        .map_err(|e| io_broken("payload", &e))?;
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
                            .map_err(|e| io_broken("payload", &e))?;
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
                    unsafe { sys::write_all(&**s, &mut iov) }
                        .map_err(|e| io_broken("payload", &e))?;
                    acks.clear();
                    Ok(())
                }
                (_, Err(st)) => {
                    acks.extend_from_slice(&response(seq, st, 0));
                    Ok(())
                }
            }
        }
        k => Err(broken(
            PeerFault::Protocol,
            format!("unknown request kind {k}"),
        )),
    }
}

/// Why a connection broke: the kind, as every backend reports it, and what was seen.
#[derive(Debug, Clone)]
struct Broken {
    fault: PeerFault,
    reason: String,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.reason, self.fault)
    }
}

fn broken(fault: PeerFault, reason: impl Into<String>) -> Broken {
    Broken {
        fault,
        reason: reason.into(),
    }
}

/// A socket error while talking to the peer: a timeout is the peer not responding,
/// anything else the connection ending under us.
fn io_broken(what: &str, e: &std::io::Error) -> Broken {
    let fault = match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => PeerFault::Unresponsive,
        _ => PeerFault::Disconnected,
    };
    broken(fault, format!("{what}: {e}"))
}

fn encode_request(job: &Job, more: bool) -> [u8; REQ_LEN] {
    let mut hdr = [0u8; REQ_LEN];
    let (kind, tag) = match job.kind {
        Kind::Data(Op::Write) => (K_WRITE, 0),
        Kind::Data(Op::Read) => (K_READ, 0),
        Kind::Notify(t) | Kind::NotifyInBurst(t) => (K_NOTIFY, t),
    };
    hdr[0] = kind;
    hdr[1] = u8::from(more);
    if matches!(job.kind, Kind::NotifyInBurst(_)) {
        hdr[2] = F_IN_BURST;
    }
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
fn missed(now: Instant, last: Instant, deadline: Instant, io: Duration) -> Broken {
    let reason = if now >= last + io {
        format!("receive failed: no progress for {io:?}")
    } else {
        format!(
            "the peer's response missed its batch deadline by {:?}",
            now.saturating_duration_since(deadline)
        )
    };
    broken(PeerFault::Unresponsive, reason)
}

/// `read_exact` into our own buffer with a deadline of `timeout` of no progress.
fn read_full(s: &mut &TcpStream, buf: &mut [u8], timeout: Duration) -> std::io::Result<()> {
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
///
/// The first read asks for one byte only. Asking for the whole header at once saves a
/// system call per request, but measured 7-10 % more responder CPU time per byte (and
/// about 6 % less bandwidth) for 1-8 MiB WRITEs over 4 streams on loopback
/// (`bench write --local -q 4`, A/B in alternating runs); the cause is not known.
/// After a small call's burst, before a responder blocks for its stream's next request,
/// it asks without sleeping for up to [`SPIN`], when no other responder of this process
/// is doing so already. A thread
/// woken from a blocking read costs tens of microseconds more than one that was polling
/// (a whole small call's worth on a VM, whose idle vCPU must be woken), and a caller's
/// next small call often follows within that time. One spinner at a time bounds what it
/// costs when many streams go idle together (a striped batch ending on 2 cores).
fn spin_for_request(s: &TcpStream) {
    static SPINNING: AtomicBool = AtomicBool::new(false);
    if SPINNING
        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
    {
        let _ = sys::spin_readable(s, SPIN);
        SPINNING.store(false, Ordering::Release);
    }
}

fn read_idle(
    s: &mut &TcpStream,
    buf: &mut [u8],
    timeout: Duration,
    closed: &AtomicBool,
    spin: bool,
) -> std::io::Result<bool> {
    if spin {
        spin_for_request(s);
    }
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
