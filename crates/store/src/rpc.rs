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
    state: Mutex<State>,
}

impl MasterLink {
    pub fn new(addr: &str, token: Vec<u8>, segment: Option<SegmentSpec>) -> Arc<Self> {
        Arc::new(MasterLink {
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

    /// Sets the endpoint announced in `Hello` (before the first call).
    pub fn set_endpoint(&self, ep: String) {
        *self.endpoint.lock().unwrap_or_else(|p| p.into_inner()) = ep;
    }

    /// Opens a TCP connection to the master by `deadline` (without saying Hello).
    pub fn dial(&self, deadline: Instant) -> Result<TcpStream> {
        let unreachable = |e: std::io::Error| StoreError::MasterUnreachable {
            addr: self.addr.clone(),
            source: Arc::new(e),
        };
        let addrs: Vec<SocketAddr> = self.addr.to_socket_addrs().map_err(unreachable)?.collect();
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

    fn ensure(&self, st: &mut State, deadline: Instant) -> Result<()> {
        if st.stream.is_some() {
            return Ok(());
        }
        let mut s = self.dial(deadline)?;
        let hello = Request::Hello(Hello {
            token: self.token.clone(),
            client_id: st.client_id,
            endpoint: self
                .endpoint
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        });
        let w = match self.exchange(&mut s, st, &hello, deadline)? {
            Response::Welcome(w) => w,
            Response::Error { code, message } => {
                return Err(StoreError::Rejected { code, message });
            }
            other => return Err(self.unexpected(&other)),
        };
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
        for attempt in 0..2 {
            self.ensure(&mut st, deadline)?;
            let mut s = st.stream.take().expect("ensured");
            match self.exchange(&mut s, &mut st, req, deadline) {
                Ok(Response::Error {
                    code: Code::UnknownClient,
                    ..
                }) if attempt == 0 => {
                    // Not executed: start a new session and send it once more.
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    st.client_id = 0;
                    st.segment_id = None;
                }
                Ok(r) => {
                    st.stream = Some(s);
                    return Ok(r);
                }
                Err(e) => {
                    // The stream's state is unknown after a failure: drop it.
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    return Err(e);
                }
            }
        }
        Err(StoreError::Rejected {
            code: Code::UnknownClient,
            message: "the master forgot this client twice in a row".into(),
        })
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
