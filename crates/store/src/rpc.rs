//! The client's connection to the master: one TCP stream, one request at a time, each
//! call bounded by the caller's deadline.
//!
//! The link reconnects by itself: a call that finds no stream connects and says `Hello`
//! (resuming the client's id when the master still knows it). When the master answers
//! with a new id (it restarted, or dropped us for silence), the link registers the client's
//! segment anew (a new remote key, so transfers of the old session fail at the data path)
//! and mounts it under that key before the call goes on. A request that reached
//! the master is never sent twice; one refused as `UnknownClient` (so not executed) is
//! sent once more on a fresh session.
//!
//! With a [`MasterLocator`] (masters elected through etcd) the link asks it for the
//! leader before every connection, refuses a `Welcome` whose epoch is not the leader's,
//! and when a call finds its master gone it looks again until the call's deadline: a
//! request is sent again only to a new leader (another epoch), which never saw it.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagewire_transport::Engine;

use crate::error::{Code, Result, StoreError};
use crate::local::SegmentMem;
use crate::net::{self, ReadError};
use crate::proto::{self, Hello, Request, Response, Welcome};

/// The client's segment and the engine it is registered with (to register it anew).
#[derive(Clone)]
pub(crate) struct SegmentSpec {
    pub mem: Arc<SegmentMem>,
    pub engine: Engine,
}

impl std::fmt::Debug for SegmentSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentSpec")
            .field("base", &format_args!("{:#x}", self.mem.base()))
            .field("size", &self.mem.size())
            .finish()
    }
}

/// Finds the master to talk to when masters are elected (`pagewire-ha` implements it on
/// etcd). Asked before every connection and again when a call finds its master gone.
pub trait MasterLocator: Send + Sync + std::fmt::Debug {
    /// The leader's `host:port` and its epoch, looked up by `deadline`; waits within the
    /// deadline while there is no leader.
    fn locate(&self, deadline: Instant) -> Result<(String, u64)>;

    /// Waits until `deadline` for this locator to learn that the leader is no longer the
    /// one of `epoch` (`0`: none): the epoch it knows now (`0`: no leader), or `None` when
    /// the deadline came first. A locator that is told of changes (a watch) answers as
    /// they happen; the default knows nothing between looks: it waits out the deadline
    /// and answers `None`, so that callers look again by themselves.
    fn wait_change(&self, epoch: u64, deadline: Instant) -> Option<u64> {
        let _ = epoch;
        std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
        None
    }
}

/// How long one attempt to say `Hello` to a located leader may take before the link
/// looks again: a leader that was stopped accepts connections in its kernel but never
/// answers.
const HELLO_ATTEMPT: Duration = Duration::from_secs(1);
/// How often the watcher looks at a call in flight, and how long a call must have waited
/// before it asks the locator whether the leader changed meanwhile.
const WATCH_PERIOD: Duration = Duration::from_millis(250);
/// Leader changes one call follows before it gives up.
const MAX_LEADER_CHANGES: u32 = 3;
/// Longest pause between looks at the leader while none answers (shorter when the
/// locator learns of a change).
const LOCATE_PAUSE: Duration = Duration::from_millis(50);
/// First pause after a located leader did not welcome the client.
const FIRST_HELLO_PAUSE: Duration = Duration::from_millis(2);

#[derive(Debug, Default)]
struct State {
    stream: Option<TcpStream>,
    client_id: u64,
    welcome: Option<Welcome>,
    segment_id: Option<u64>,
    /// The segment was mounted with some master before (a later mount is a remount).
    mounted_once: bool,
    next_req: u32,
}

/// What a session change means for callers (the segment id in the master's tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Session {
    pub client_id: u64,
    pub epoch: u64,
    pub segment: Option<u64>,
}

#[derive(Debug)]
pub(crate) struct MasterLink {
    addr: String,
    token: Vec<u8>,
    endpoint: Mutex<String>,
    segment: Option<SegmentSpec>,
    max_frame: u32,
    frame_timeout: Duration,
    locator: Option<Arc<dyn MasterLocator>>,
    /// The call waiting for the master now: a clone of its stream, the session's epoch
    /// and when it was sent (for the watcher).
    inflight: Mutex<Option<(TcpStream, u64, Instant)>>,
    state: Mutex<State>,
}

impl MasterLink {
    pub fn new(
        addr: &str,
        locator: Option<Arc<dyn MasterLocator>>,
        token: Vec<u8>,
        segment: Option<SegmentSpec>,
    ) -> Arc<Self> {
        Arc::new(MasterLink {
            locator,
            inflight: Mutex::new(None),
            addr: addr.to_string(),
            token,
            endpoint: Mutex::new(String::new()),
            segment,
            max_frame: proto::DEFAULT_MAX_FRAME,
            frame_timeout: Duration::from_secs(5),
            state: Mutex::new(State::default()),
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// With a locator: starts the thread that ends a call waiting on a master that is no
    /// longer the leader (a stopped one never answers), so that the call goes on with the
    /// new leader within its deadline. It ends a call at once when the locator tells of a
    /// newer leader ([`MasterLocator::wait_change`]); otherwise it asks the locator only
    /// while a call has been waiting for a while. It ends with the link.
    pub fn watch(self: &Arc<Self>) -> Result<()> {
        let Some(loc) = self.locator.clone() else {
            return Ok(());
        };
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("pagewire-store-watch".into())
            .spawn(move || {
                // The leader's epoch as the locator last told it (0: none).
                let mut seen = 0;
                loop {
                    let changed = loc.wait_change(seen, Instant::now() + WATCH_PERIOD);
                    let Some(link) = weak.upgrade() else { return };
                    match changed {
                        Some(epoch) => {
                            seen = epoch;
                            link.end_deposed(epoch);
                        }
                        None => link.check_inflight(),
                    }
                }
            })
            .map_err(|e| StoreError::io("spawn the leader watch thread", e))?;
        Ok(())
    }

    /// Closes the stream of the call in flight if its session's master is older than
    /// the leader of `leader` (an epoch; 0: none known).
    fn end_deposed(&self, leader: u64) {
        let g = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((s, e, _)) = &*g
            && *e < leader
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Closes the stream of a call that has waited for longer than [`WATCH_PERIOD`] when
    /// the locator names a leader of another epoch.
    fn check_inflight(&self) {
        let Some(loc) = &self.locator else { return };
        let waiting = {
            let g = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            match &*g {
                Some((_, epoch, since)) if since.elapsed() >= WATCH_PERIOD => Some(*epoch),
                _ => None,
            }
        };
        let Some(epoch) = waiting else { return };
        let Ok((_, leader)) = loc.locate(Instant::now() + WATCH_PERIOD * 2) else {
            return;
        };
        if leader == epoch {
            return;
        }
        let g = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        // Still the same call's session: its reply cannot come from the leader.
        if let Some((s, e, _)) = &*g
            && *e == epoch
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Sets the endpoint announced in `Hello` (before the first call).
    pub fn set_endpoint(&self, ep: String) {
        *self.endpoint.lock().unwrap_or_else(|p| p.into_inner()) = ep;
    }

    /// Opens a TCP connection to the master by `deadline` (without saying Hello); with a
    /// locator, to the leader it names, looking again while none accepts.
    pub fn dial(&self, deadline: Instant) -> Result<TcpStream> {
        Ok(self.dial_leader(deadline)?.0)
    }

    /// [`MasterLink::dial`], and the epoch the locator gave (none without a locator).
    fn dial_leader(&self, deadline: Instant) -> Result<(TcpStream, Option<u64>)> {
        let Some(loc) = &self.locator else {
            return Ok((dial_addr(&self.addr, deadline)?, None));
        };
        loop {
            let (addr, epoch) = loc.locate(deadline)?;
            match dial_addr(&addr, deadline) {
                Ok(s) => return Ok((s, Some(epoch))),
                // The leader key names a master that is gone until its lease expires.
                Err(e) if Instant::now() + LOCATE_PAUSE >= deadline => return Err(e),
                Err(_) => {
                    loc.wait_change(epoch, Instant::now() + LOCATE_PAUSE);
                }
            }
        }
    }

    /// The session the link has now (connecting first if it has none).
    pub fn session(&self, deadline: Instant) -> Result<Session> {
        let mut st = self.state();
        self.ensure(&mut st, deadline)?;
        Ok(Session {
            client_id: st.client_id,
            epoch: st.welcome.map_or(0, |w| w.epoch),
            segment: st.segment_id,
        })
    }

    /// `(client id, master epoch)` of the session the link has now, without connecting:
    /// replies of one session name segments that mean nothing to another.
    pub fn current(&self) -> (u64, u64) {
        let st = self.state();
        (st.client_id, st.welcome.map_or(0, |w| w.epoch))
    }

    /// What the master said in its last `Welcome`.
    pub fn welcome(&self) -> Option<Welcome> {
        self.state().welcome
    }

    /// Connects and says `Hello`. With a locator, to a leader that answers with the
    /// epoch the locator gave, looking again until `deadline` while none does.
    fn greet(&self, st: &mut State, deadline: Instant) -> Result<(TcpStream, Welcome)> {
        // A leader just elected closes connections until it has read the op-log: the
        // first looks again soon, later ones back off.
        let mut pause = FIRST_HELLO_PAUSE;
        loop {
            let (mut s, expect) = self.dial_leader(deadline)?;
            let by = match expect {
                Some(_) => deadline.min(Instant::now() + HELLO_ATTEMPT),
                None => deadline,
            };
            let r = self.hello(&mut s, st, by);
            let Some(epoch) = expect else {
                return r.map(|w| (s, w));
            };
            let err = match r {
                Ok(w) if w.epoch == epoch => return Ok((s, w)),
                // A refusal is the master's word (token, capacity), not a leader change.
                Err(e @ StoreError::Rejected { .. }) => return Err(e),
                Ok(w) => StoreError::MasterGone {
                    addr: self.addr.clone(),
                    reason: format!(
                        "a master answered with epoch {} where the leader's is {epoch} \
                         (deposed, or not yet serving)",
                        w.epoch
                    ),
                },
                Err(e) => e,
            };
            let _ = s.shutdown(std::net::Shutdown::Both);
            if Instant::now() + pause >= deadline {
                return Err(err);
            }
            if let Some(loc) = &self.locator {
                loc.wait_change(epoch, Instant::now() + pause);
            }
            pause = (pause * 2).min(LOCATE_PAUSE);
        }
    }

    /// `Hello` on a fresh stream; the master's `Welcome`.
    fn hello(&self, s: &mut TcpStream, st: &mut State, deadline: Instant) -> Result<Welcome> {
        let hello = Request::Hello(Hello {
            token: self.token.clone(),
            client_id: st.client_id,
            endpoint: self
                .endpoint
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        });
        match self.exchange(s, st, &hello, deadline)? {
            Response::Welcome(w) => Ok(w),
            Response::Error { code, message } => Err(StoreError::Rejected { code, message }),
            other => Err(self.unexpected(&other)),
        }
    }

    fn ensure(&self, st: &mut State, deadline: Instant) -> Result<()> {
        if st.stream.is_some() {
            return Ok(());
        }
        let (mut s, w) = self.greet(st, deadline)?;
        if w.client_id != st.client_id && st.client_id != 0 {
            tracing::info!(
                master = %self.addr,
                old = format_args!("{:#x}", st.client_id),
                new = format_args!("{:#x}", w.client_id),
                "store: new session with the master (it restarted or dropped this client)"
            );
        }
        if !w.resumed {
            st.segment_id = None;
        }
        st.client_id = w.client_id;
        st.welcome = Some(w);
        // Mount unless the master still has this client's segment: a session whose mount
        // failed (say, the old registration was still busy) resumes without one.
        if st.segment_id.is_none()
            && let Some(seg) = &self.segment
        {
            // A session after the first: whatever the old one placed or leased on this
            // memory must not reach it any more.
            let rkey = if st.mounted_once {
                seg.mem.renew(&seg.engine, deadline)?
            } else {
                seg.mem.rkey()
            };
            let req = Request::Mount {
                base: seg.mem.base(),
                size: seg.mem.size(),
                rkey,
            };
            match self.exchange(&mut s, st, &req, deadline)? {
                Response::Mounted { segment } => {
                    st.segment_id = Some(segment);
                    st.mounted_once = true;
                }
                Response::Error { code, message } => {
                    return Err(StoreError::Rejected { code, message });
                }
                other => return Err(self.unexpected(&other)),
            }
        }
        st.stream = Some(s);
        Ok(())
    }

    fn unexpected(&self, r: &Response) -> StoreError {
        StoreError::Protocol {
            from: self.addr.clone(),
            source: proto::ProtoError::UnknownKind(r.kind()),
        }
    }

    /// One request and its response on `s`.
    fn exchange(
        &self,
        s: &mut TcpStream,
        st: &mut State,
        req: &Request,
        deadline: Instant,
    ) -> Result<Response> {
        st.next_req = st.next_req.wrapping_add(1);
        let id = st.next_req;
        let mut buf = Vec::new();
        req.encode(id, &mut buf);
        let gone = |reason: String| StoreError::MasterGone {
            addr: self.addr.clone(),
            reason,
        };
        let start = Instant::now();
        net::write_all_by(s, &buf, deadline).map_err(|e| {
            if e.kind() == std::io::ErrorKind::TimedOut {
                StoreError::Timeout {
                    what: "master request",
                    after: start.elapsed(),
                }
            } else {
                gone(e.to_string())
            }
        })?;
        let h = net::read_frame(
            s,
            self.max_frame,
            deadline,
            self.frame_timeout,
            deadline,
            &mut buf,
        )
        .map_err(|e| match e {
            ReadError::Timeout => StoreError::Timeout {
                what: "master reply",
                after: start.elapsed(),
            },
            ReadError::Closed => gone("connection closed".into()),
            ReadError::Io(e) => gone(e.to_string()),
            ReadError::Proto(p) => StoreError::Protocol {
                from: self.addr.clone(),
                source: p,
            },
        })?;
        if h.req_id != id {
            return Err(gone(format!(
                "reply to request {} for request {id}",
                h.req_id
            )));
        }
        proto::decode_response(h.kind, &buf).map_err(|p| StoreError::Protocol {
            from: self.addr.clone(),
            source: p,
        })
    }

    /// Sends `req` and returns the response; `Response::Error`s other than
    /// `UnknownClient` come back as they are, for the caller to map.
    pub fn call(&self, req: &Request, deadline: Instant) -> Result<Response> {
        let mut st = self.state();
        let mut forgotten = false;
        let mut leader_changes = 0;
        loop {
            self.ensure(&mut st, deadline)?;
            let mut s = st.stream.take().expect("ensured");
            if self.locator.is_some() {
                let epoch = st.welcome.map_or(0, |w| w.epoch);
                *self.inflight.lock().unwrap_or_else(|p| p.into_inner()) =
                    s.try_clone().ok().map(|c| (c, epoch, Instant::now()));
            }
            let r = self.exchange(&mut s, &mut st, req, deadline);
            if self.locator.is_some() {
                *self.inflight.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }
            match r {
                Ok(Response::Error {
                    code: Code::UnknownClient,
                    ..
                }) if !forgotten => {
                    // Not executed: start a new session and send it once more. The
                    // master dropped this client for silence, so its segments are gone
                    // or lapse with it: a new id loses nothing. (The id is what takes a
                    // segment back after a failover; only the process that mounted the
                    // segment ever holds it, so forgetting it can only give up a claim.)
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    st.client_id = 0;
                    st.segment_id = None;
                    forgotten = true;
                }
                Ok(r) => {
                    st.stream = Some(s);
                    return Ok(r);
                }
                Err(e) => {
                    // The stream's state is unknown after a failure: drop it.
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    let gone = matches!(
                        e,
                        StoreError::MasterGone { .. } | StoreError::MasterUnreachable { .. }
                    );
                    if self.locator.is_none() || !gone || leader_changes >= MAX_LEADER_CHANGES {
                        return Err(e);
                    }
                    // The master that failed may have executed the request: it goes
                    // again only to a new leader, which never saw it.
                    let before = st.welcome.map(|w| w.epoch);
                    self.ensure(&mut st, deadline)?;
                    let after = st.welcome.map(|w| w.epoch);
                    if after == before {
                        return Err(e);
                    }
                    tracing::info!(
                        master = %self.addr,
                        old = ?before,
                        new = ?after,
                        "store: the master leader changed; the request goes to the new one"
                    );
                    leader_changes += 1;
                }
            }
        }
    }

    /// Says goodbye (best effort, short deadline) and closes the connection.
    pub fn bye(&self) {
        let mut st = self.state();
        if let Some(mut s) = st.stream.take() {
            let deadline = Instant::now() + Duration::from_secs(2);
            let _ = self.exchange(&mut s, &mut st, &Request::Bye, deadline);
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Opens a TCP connection to `addr` (`host:port`) by `deadline`.
fn dial_addr(addr: &str, deadline: Instant) -> Result<TcpStream> {
    let unreachable = |e: std::io::Error| StoreError::MasterUnreachable {
        addr: addr.to_string(),
        source: Arc::new(e),
    };
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(unreachable)?.collect();
    let mut last = None;
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            break;
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(unreachable(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::TimedOut, "no address reached in time")
    })))
}
