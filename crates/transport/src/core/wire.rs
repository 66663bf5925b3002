//! The control-plane handshake codec.
//!
//! Every frame is a 12-byte header followed by a body:
//!
//! ```text
//! magic  u32 LE  "PGWR" (0x52574750 read as LE)
//! version u16 LE  2
//! kind   u8      1 Hello, 2 Welcome, 3 Ready, 4 Reject, 5 Describe, 6 Regions
//! flags  u8      0 (anything else is refused)
//! len    u32 LE  body length, at most the configured cap
//! ```
//!
//! Bodies are fixed-order little-endian fields; variable parts carry a count that is
//! capped before anything is allocated. The decoder validates every field (counts, MTU,
//! QPN/PSN ranges, ports, region overlap and overflow) and never panics: every byte from
//! the network is treated as hostile.
//!
//! The exchange (initiator `C`, listener `S`):
//! `C -> S Hello{token, engine, listen_port, session, backend, endpoint, regions}`,
//! `S -> C Welcome{engine, session, endpoint, regions}` or `Reject{reason}`,
//! `C -> S Ready{}`, `S -> C Ready{}`. `S` publishes the peer only after the first
//! `Ready`, so neither side posts before the other's QPs are ready; `C` publishes (and
//! `connect` returns) only after the second, so by then `S` knows the peer too: its first
//! notification, `peer_regions` or `Describe` from `C` finds it. `Describe{token, session}`
//! -> `Regions{...}` re-fetches a peer's exposed regions on a fresh connection.

use crate::error::HandshakeError;
use crate::types::{Access, MAX_RAILS, RailKeys, RemoteRegion};

/// `b"PGWR"` as a little-endian u32.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"PGWR");
/// Protocol version. 2: the listener answers `Ready` with `Ready` once it has published
/// the peer. 3: several verbs rails: the verbs endpoint lists every rail's addressing and
/// QPs, and each region its rkeys on rails 1.. (a version-2 peer is refused at the header,
/// with both versions named).
pub(crate) const VERSION: u16 = 3;
/// Header size.
pub(crate) const HEADER_LEN: usize = 12;
/// Most regions one peer may expose in a frame.
pub(crate) const MAX_REGIONS: usize = 1 << 16;
/// Most QPs per peer.
pub(crate) const MAX_QPS: usize = 64;
/// Most TCP streams per peer.
pub(crate) const MAX_STREAMS: u16 = 64;
/// Longest token.
pub(crate) const MAX_TOKEN: usize = 256;
/// Longest reject reason.
pub(crate) const MAX_REASON: usize = 1024;

const REGION_BYTES: usize = 8 + 8 + 4 + 1 + 1;

/// One QP's addressing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpInfo {
    /// QP number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
}

/// One further verbs rail's addressing (see [`EndpointInfo::Verbs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailEndpoint {
    /// Port GID.
    pub gid: [u8; 16],
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active path MTU in bytes.
    pub mtu: u32,
    /// The rail's QPs, in order.
    pub qps: Vec<QpInfo>,
}

/// The backend part of the handshake.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointInfo {
    /// Verbs RC endpoint.
    Verbs {
        /// Port GID.
        gid: [u8; 16],
        /// Port LID (0 on RoCE).
        lid: u16,
        /// Active path MTU in bytes.
        mtu: u32,
        /// The connection's QPs, in order.
        qps: Vec<QpInfo>,
        /// Rails 1.. (further devices of a multi-rail engine), each with its own QPs; the
        /// fields above are rail 0's. Empty for one device.
        rails: Vec<RailEndpoint>,
    },
    /// TCP data path.
    Tcp {
        /// Port of the data listener (same IP as the control connection).
        data_port: u16,
        /// Streams the peer should open to us.
        streams: u16,
        /// Secret naming this connection on our data listener.
        session: u64,
    },
    /// In-process.
    Loopback {
        /// The engine's id in the process-global table.
        engine_id: u64,
        /// The connection's id in that engine.
        conn: u64,
    },
}

impl EndpointInfo {
    fn tag(&self) -> u8 {
        match self {
            EndpointInfo::Verbs { .. } => 1,
            EndpointInfo::Tcp { .. } => 2,
            EndpointInfo::Loopback { .. } => 3,
        }
    }

    /// Backend name.
    pub fn backend_name(&self) -> &'static str {
        match self {
            EndpointInfo::Verbs { .. } => "verbs",
            EndpointInfo::Tcp { .. } => "tcp",
            EndpointInfo::Loopback { .. } => "loopback",
        }
    }
}

/// Initiator's opening frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub token: Vec<u8>,
    pub engine_id: u64,
    /// Initiator's control listener port (so the listener can `Describe` it later).
    pub listen_port: u16,
    /// Initiator's session id for this peer (for `Describe`).
    pub session: u64,
    pub endpoint: EndpointInfo,
    pub regions: Vec<RemoteRegion>,
}

/// Listener's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Welcome {
    pub engine_id: u64,
    pub session: u64,
    pub endpoint: EndpointInfo,
    pub regions: Vec<RemoteRegion>,
}

/// Every frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    Hello(Hello),
    Welcome(Welcome),
    Ready,
    Reject {
        reason: String,
    },
    Describe {
        token: Vec<u8>,
        session: u64,
    },
    Regions(Vec<RemoteRegion>),
    /// The initiator of the connection `session` names asks to reconnect one rail with
    /// these new QPs (a one-rail verbs endpoint); answered by `RailAccepted`, then `Ready`.
    Rail {
        token: Vec<u8>,
        session: u64,
        rail: u8,
        endpoint: EndpointInfo,
    },
    /// The acceptor's new QPs for that rail.
    RailAccepted(EndpointInfo),
}

impl Frame {
    /// The frame's type byte on the wire.
    pub(crate) fn kind(&self) -> u8 {
        match self {
            Frame::Hello(_) => 1,
            Frame::Welcome(_) => 2,
            Frame::Ready => 3,
            Frame::Reject { .. } => 4,
            Frame::Describe { .. } => 5,
            Frame::Regions(_) => 6,
            Frame::Rail { .. } => 7,
            Frame::RailAccepted(_) => 8,
        }
    }

    /// Serialises header + body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64);
        match self {
            Frame::Hello(h) => {
                put_bytes(&mut b, &h.token);
                b.extend_from_slice(&h.engine_id.to_le_bytes());
                b.extend_from_slice(&h.listen_port.to_le_bytes());
                b.extend_from_slice(&h.session.to_le_bytes());
                put_endpoint(&mut b, &h.endpoint);
                put_regions(&mut b, &h.regions);
            }
            Frame::Welcome(w) => {
                b.extend_from_slice(&w.engine_id.to_le_bytes());
                b.extend_from_slice(&w.session.to_le_bytes());
                put_endpoint(&mut b, &w.endpoint);
                put_regions(&mut b, &w.regions);
            }
            Frame::Ready => {}
            Frame::Reject { reason } => {
                let r = reason.as_bytes();
                put_bytes(&mut b, &r[..r.len().min(MAX_REASON)]);
            }
            Frame::Describe { token, session } => {
                put_bytes(&mut b, token);
                b.extend_from_slice(&session.to_le_bytes());
            }
            Frame::Regions(r) => put_regions(&mut b, r),
            Frame::Rail {
                token,
                session,
                rail,
                endpoint,
            } => {
                put_bytes(&mut b, token);
                b.extend_from_slice(&session.to_le_bytes());
                b.push(*rail);
                put_endpoint(&mut b, endpoint);
            }
            Frame::RailAccepted(e) => put_endpoint(&mut b, e),
        }
        let mut out = Vec::with_capacity(HEADER_LEN + b.len());
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(self.kind());
        out.push(0);
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(&b);
        out
    }
}

fn put_bytes(b: &mut Vec<u8>, s: &[u8]) {
    b.extend_from_slice(&(s.len() as u16).to_le_bytes());
    b.extend_from_slice(s);
}

fn put_endpoint(b: &mut Vec<u8>, e: &EndpointInfo) {
    b.push(e.tag());
    match e {
        EndpointInfo::Verbs {
            gid,
            lid,
            mtu,
            qps,
            rails,
        } => {
            put_rail(b, gid, *lid, *mtu, qps);
            b.push(rails.len() as u8);
            for r in rails {
                put_rail(b, &r.gid, r.lid, r.mtu, &r.qps);
            }
        }
        EndpointInfo::Tcp {
            data_port,
            streams,
            session,
        } => {
            b.extend_from_slice(&data_port.to_le_bytes());
            b.extend_from_slice(&streams.to_le_bytes());
            b.extend_from_slice(&session.to_le_bytes());
        }
        EndpointInfo::Loopback { engine_id, conn } => {
            b.extend_from_slice(&engine_id.to_le_bytes());
            b.extend_from_slice(&conn.to_le_bytes());
        }
    }
}

fn put_rail(b: &mut Vec<u8>, gid: &[u8; 16], lid: u16, mtu: u32, qps: &[QpInfo]) {
    b.extend_from_slice(gid);
    b.extend_from_slice(&lid.to_le_bytes());
    b.extend_from_slice(&mtu.to_le_bytes());
    b.extend_from_slice(&(qps.len() as u16).to_le_bytes());
    for q in qps {
        b.extend_from_slice(&q.qpn.to_le_bytes());
        b.extend_from_slice(&q.psn.to_le_bytes());
    }
}

fn put_regions(b: &mut Vec<u8>, regions: &[RemoteRegion]) {
    b.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        b.extend_from_slice(&r.addr.to_le_bytes());
        b.extend_from_slice(&r.len.to_le_bytes());
        b.extend_from_slice(&r.rkey.to_le_bytes());
        b.push(r.access.bits());
        let rails = r.rails.as_slice();
        b.push(rails.len() as u8);
        for k in rails {
            b.extend_from_slice(&k.to_le_bytes());
        }
    }
}

/// A validated header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub len: u32,
}

/// Validates a header before any body byte is read or allocated.
pub(crate) fn decode_header(h: &[u8; HEADER_LEN], max: u32) -> Result<Header, HandshakeError> {
    let magic = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if magic != MAGIC {
        return Err(HandshakeError::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(HandshakeError::Version {
            ours: VERSION,
            theirs: version,
        });
    }
    let kind = h[6];
    if !(1..=8).contains(&kind) {
        return Err(HandshakeError::BadField {
            field: "frame kind",
            value: kind.to_string(),
        });
    }
    if h[7] != 0 {
        return Err(HandshakeError::BadField {
            field: "flags",
            value: h[7].to_string(),
        });
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len > max {
        return Err(HandshakeError::Oversized {
            len: len.into(),
            max: max.into(),
        });
    }
    Ok(Header { kind, len })
}

/// Decodes one whole frame from `buf` (header + exactly the body).
pub(crate) fn decode_frame(buf: &[u8], max: u32) -> Result<Frame, HandshakeError> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Err(HandshakeError::Truncated { field: "header" });
    };
    let header = decode_header(h, max)?;
    let body = &buf[HEADER_LEN..];
    if body.len() < header.len as usize {
        return Err(HandshakeError::Truncated { field: "body" });
    }
    if body.len() > header.len as usize {
        return Err(HandshakeError::Trailing {
            extra: body.len() - header.len as usize,
        });
    }
    decode_body(header.kind, body)
}

/// Decodes a body of the given kind; every byte must be consumed.
pub(crate) fn decode_body(kind: u8, body: &[u8]) -> Result<Frame, HandshakeError> {
    let mut r = Reader { buf: body };
    let frame = match kind {
        1 => {
            let token = r.bytes("token", MAX_TOKEN)?;
            let engine_id = r.u64("engine id")?;
            let listen_port = r.u16("listen port")?;
            if listen_port == 0 {
                return Err(bad("listen port", 0));
            }
            let session = r.u64("session")?;
            let endpoint = r.endpoint()?;
            let regions = r.regions()?;
            Frame::Hello(Hello {
                token,
                engine_id,
                listen_port,
                session,
                endpoint,
                regions,
            })
        }
        2 => {
            let engine_id = r.u64("engine id")?;
            let session = r.u64("session")?;
            let endpoint = r.endpoint()?;
            let regions = r.regions()?;
            Frame::Welcome(Welcome {
                engine_id,
                session,
                endpoint,
                regions,
            })
        }
        3 => Frame::Ready,
        4 => {
            let raw = r.bytes("reason", MAX_REASON)?;
            Frame::Reject {
                reason: String::from_utf8_lossy(&raw).into_owned(),
            }
        }
        5 => {
            let token = r.bytes("token", MAX_TOKEN)?;
            let session = r.u64("session")?;
            Frame::Describe { token, session }
        }
        6 => Frame::Regions(r.regions()?),
        7 => {
            let token = r.bytes("token", MAX_TOKEN)?;
            let session = r.u64("session")?;
            let rail = r.u8("rail")?;
            let endpoint = r.endpoint()?;
            Frame::Rail {
                token,
                session,
                rail,
                endpoint,
            }
        }
        8 => Frame::RailAccepted(r.endpoint()?),
        other => {
            return Err(HandshakeError::BadField {
                field: "frame kind",
                value: other.to_string(),
            });
        }
    };
    if !r.buf.is_empty() {
        return Err(HandshakeError::Trailing { extra: r.buf.len() });
    }
    Ok(frame)
}

fn bad(field: &'static str, value: impl ToString) -> HandshakeError {
    HandshakeError::BadField {
        field,
        value: value.to_string(),
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&[u8], HandshakeError> {
        if self.buf.len() < n {
            return Err(HandshakeError::Truncated { field });
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self, f: &'static str) -> Result<u8, HandshakeError> {
        Ok(self.take(1, f)?[0])
    }
    fn u16(&mut self, f: &'static str) -> Result<u16, HandshakeError> {
        let s = self.take(2, f)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self, f: &'static str) -> Result<u32, HandshakeError> {
        let s = self.take(4, f)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, f: &'static str) -> Result<u64, HandshakeError> {
        let s = self.take(8, f)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self, f: &'static str, max: usize) -> Result<Vec<u8>, HandshakeError> {
        let n = self.u16(f)? as usize;
        if n > max {
            return Err(bad(f, format!("length {n} > {max}")));
        }
        Ok(self.take(n, f)?.to_vec())
    }

    fn endpoint(&mut self) -> Result<EndpointInfo, HandshakeError> {
        match self.u8("endpoint kind")? {
            1 => {
                let first = self.rail()?;
                let n = usize::from(self.u8("rail count")?);
                if n >= MAX_RAILS {
                    return Err(bad("rail count", n + 1));
                }
                let mut rails = Vec::with_capacity(n);
                for _ in 0..n {
                    rails.push(self.rail()?);
                }
                Ok(EndpointInfo::Verbs {
                    gid: first.gid,
                    lid: first.lid,
                    mtu: first.mtu,
                    qps: first.qps,
                    rails,
                })
            }
            2 => {
                let data_port = self.u16("data port")?;
                if data_port == 0 {
                    return Err(bad("data port", 0));
                }
                let streams = self.u16("streams")?;
                if streams == 0 || streams > MAX_STREAMS {
                    return Err(bad("streams", streams));
                }
                let session = self.u64("session")?;
                Ok(EndpointInfo::Tcp {
                    data_port,
                    streams,
                    session,
                })
            }
            3 => {
                let engine_id = self.u64("engine id")?;
                let conn = self.u64("conn id")?;
                Ok(EndpointInfo::Loopback { engine_id, conn })
            }
            other => Err(bad("endpoint kind", other)),
        }
    }

    fn rail(&mut self) -> Result<RailEndpoint, HandshakeError> {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(self.take(16, "gid")?);
        let lid = self.u16("lid")?;
        let mtu = self.u32("mtu")?;
        if ![256, 512, 1024, 2048, 4096].contains(&mtu) {
            return Err(bad("mtu", mtu));
        }
        let n = self.u16("qp count")? as usize;
        if n == 0 || n > MAX_QPS {
            return Err(bad("qp count", n));
        }
        let mut qps = Vec::with_capacity(n);
        for _ in 0..n {
            let qpn = self.u32("qpn")?;
            let psn = self.u32("psn")?;
            // QPN 0 and 1 are the special SMI/GSI QPs; both fields are 24 bits.
            if !(2..=0x00ff_ffff).contains(&qpn) {
                return Err(bad("qpn", format!("{qpn:#x}")));
            }
            if psn > 0x00ff_ffff {
                return Err(bad("psn", format!("{psn:#x}")));
            }
            qps.push(QpInfo { qpn, psn });
        }
        Ok(RailEndpoint { gid, lid, mtu, qps })
    }

    fn regions(&mut self) -> Result<Vec<RemoteRegion>, HandshakeError> {
        let n = self.u32("region count")? as usize;
        if n > MAX_REGIONS {
            return Err(bad("region count", n));
        }
        // Refuse counts the remaining bytes cannot hold before allocating for them.
        if n.saturating_mul(REGION_BYTES) > self.buf.len() {
            return Err(HandshakeError::Truncated { field: "regions" });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let addr = self.u64("region addr")?;
            let len = self.u64("region len")?;
            let rkey = self.u32("region rkey")?;
            let bits = self.u8("region access")?;
            let nr = usize::from(self.u8("region rail count")?);
            if nr >= MAX_RAILS {
                return Err(bad("region rail count", nr));
            }
            let mut keys = [0u32; MAX_RAILS];
            for k in &mut keys[..nr] {
                *k = self.u32("region rail rkey")?;
            }
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(bad("region range", format!("{addr:#x}+{len}")));
            }
            let access = Access::from_bits(bits)
                .filter(|a| a.is_remote() && !a.contains(Access::LOCAL_WRITE))
                .ok_or_else(|| bad("region access", bits))?;
            let mut region = RemoteRegion::new(addr, len, rkey, access);
            region.rails = RailKeys::from_slice(&keys[..nr]).expect("count checked");
            out.push(region);
        }
        let mut sorted = out.clone();
        sorted.sort_by_key(|r| r.addr);
        for w in sorted.windows(2) {
            if w[0].addr + w[0].len > w[1].addr {
                return Err(bad("region overlap", format!("{:#x}", w[1].addr)));
            }
        }
        Ok(out)
    }
}

/// One valid frame of every kind, with every endpoint variant (verbs with a second rail,
/// TCP, loopback) and regions with rail keys: the unit tests' round trips and the fuzz
/// corpus's seeds (`crate::fuzzing::sample_frames`).
pub(crate) fn sample_frames() -> Vec<Frame> {
    let mut railed = RemoteRegion::new(
        0x9000,
        1 << 20,
        8,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    railed.rails = RailKeys::from_slice(&[0x81, 0x82]).unwrap();
    let regions = vec![
        RemoteRegion::new(0x1000, 4096, 7, Access::REMOTE_WRITE),
        railed,
    ];
    vec![
        Frame::Hello(Hello {
            token: b"secret".to_vec(),
            engine_id: 42,
            listen_port: 7000,
            session: 99,
            endpoint: EndpointInfo::Verbs {
                gid: [3; 16],
                lid: 0,
                mtu: 1024,
                qps: vec![QpInfo { qpn: 17, psn: 5 }, QpInfo { qpn: 18, psn: 6 }],
                rails: vec![RailEndpoint {
                    gid: [4; 16],
                    lid: 0,
                    mtu: 4096,
                    qps: vec![QpInfo { qpn: 19, psn: 7 }],
                }],
            },
            regions: regions.clone(),
        }),
        Frame::Welcome(Welcome {
            engine_id: 43,
            session: 1,
            endpoint: EndpointInfo::Tcp {
                data_port: 9000,
                streams: 4,
                session: 77,
            },
            regions,
        }),
        Frame::Welcome(Welcome {
            engine_id: 43,
            session: 1,
            endpoint: EndpointInfo::Loopback {
                engine_id: 1,
                conn: 2,
            },
            regions: vec![],
        }),
        Frame::Ready,
        Frame::Reject {
            reason: "token mismatch".into(),
        },
        Frame::Describe {
            token: vec![],
            session: 5,
        },
        Frame::Regions(vec![]),
        Frame::Rail {
            token: vec![7; 3],
            session: 9,
            rail: 1,
            endpoint: EndpointInfo::Verbs {
                gid: [3; 16],
                lid: 0,
                mtu: 4096,
                qps: vec![QpInfo { qpn: 17, psn: 5 }],
                rails: vec![],
            },
        },
        Frame::RailAccepted(EndpointInfo::Verbs {
            gid: [4; 16],
            lid: 1,
            mtu: 1024,
            qps: vec![QpInfo { qpn: 18, psn: 6 }],
            rails: vec![],
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip() {
        for f in sample_frames() {
            let bytes = f.encode();
            assert_eq!(decode_frame(&bytes, 1 << 20).unwrap(), f);
        }
    }

    #[test]
    fn rejects_foreign_and_oversized() {
        let http = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert!(matches!(
            decode_frame(http, 1 << 20),
            Err(HandshakeError::BadMagic { .. })
        ));
        let mut f = Frame::Ready.encode();
        f[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_frame(&f, 1 << 20),
            Err(HandshakeError::Oversized { .. })
        ));
        let mut f = Frame::Ready.encode();
        f[4] = 9;
        assert!(matches!(
            decode_frame(&f, 1 << 20),
            Err(HandshakeError::Version { theirs: 9, .. })
        ));
        // A version-2 peer (one rail, no rail fields) is refused at the header, naming
        // both versions, rather than misreading its endpoint.
        let mut f = Frame::Ready.encode();
        f[4] = 2;
        let e = decode_frame(&f, 1 << 20).unwrap_err();
        assert!(matches!(e, HandshakeError::Version { ours: 3, theirs: 2 }));
        let t = e.to_string();
        assert!(t.contains('2') && t.contains('3'), "{t}");
    }

    #[test]
    fn rail_counts_are_capped() {
        let mut f = Frame::Hello(Hello {
            token: vec![],
            engine_id: 1,
            listen_port: 1,
            session: 1,
            endpoint: EndpointInfo::Verbs {
                gid: [0; 16],
                lid: 0,
                mtu: 1024,
                qps: vec![QpInfo { qpn: 5, psn: 0 }],
                rails: vec![],
            },
            regions: vec![],
        })
        .encode();
        // The rail count sits after token(2) engine(8) port(2) session(8) kind(1)
        // gid(16) lid(2) mtu(4) nqps(2) qp(8).
        let at = HEADER_LEN + 2 + 8 + 2 + 8 + 1 + 16 + 2 + 4 + 2 + 8;
        f[at] = MAX_RAILS as u8;
        assert!(matches!(
            decode_frame(&f, 1 << 20),
            Err(HandshakeError::BadField {
                field: "rail count",
                ..
            })
        ));
    }

    #[test]
    fn rejects_bad_fields() {
        let bad_regions = [
            RemoteRegion::new(u64::MAX - 10, 100, 1, Access::REMOTE_READ),
            RemoteRegion::new(0x1000, 0, 1, Access::REMOTE_READ),
            RemoteRegion::new(0x1000, 10, 1, Access::LOCAL_WRITE),
        ];
        for r in bad_regions {
            let f = Frame::Regions(vec![r]).encode();
            assert!(
                matches!(
                    decode_frame(&f, 1 << 20),
                    Err(HandshakeError::BadField { .. })
                ),
                "{r:?}"
            );
        }
        let overlap = Frame::Regions(vec![
            RemoteRegion::new(0x1000, 0x1000, 1, Access::REMOTE_READ),
            RemoteRegion::new(0x1800, 0x1000, 1, Access::REMOTE_READ),
        ])
        .encode();
        assert!(decode_frame(&overlap, 1 << 20).is_err());
        // A region count that the body cannot hold is refused before allocation.
        let mut f = Frame::Regions(vec![]).encode();
        f[12..16].copy_from_slice(&60_000u32.to_le_bytes());
        assert!(matches!(
            decode_frame(&f, 1 << 20),
            Err(HandshakeError::Truncated { .. })
        ));
        let bad_mtu = Frame::Welcome(Welcome {
            engine_id: 1,
            session: 1,
            endpoint: EndpointInfo::Verbs {
                gid: [0; 16],
                lid: 0,
                mtu: 1500,
                qps: vec![QpInfo { qpn: 5, psn: 0 }],
                rails: vec![],
            },
            regions: vec![],
        })
        .encode();
        assert!(decode_frame(&bad_mtu, 1 << 20).is_err());
        let mut trailing = Frame::Ready.encode();
        trailing[8] = 1;
        trailing.push(0);
        assert!(matches!(
            decode_frame(&trailing, 1 << 20),
            Err(HandshakeError::Trailing { .. })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn decoder_never_panics_on_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_frame(&bytes, 1 << 20);
            for kind in 1..=8u8 {
                let _ = decode_body(kind, &bytes);
            }
        }

        #[test]
        fn decoder_never_panics_on_mutated_frames(
            which in 0usize..9,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            let frames = sample_frames();
            let mut bytes = frames[which % frames.len()].encode();
            for (pos, val) in flips {
                let i = pos % bytes.len();
                bytes[i] = val;
            }
            let cut = cut % (bytes.len() + 1);
            let _ = decode_frame(&bytes[..cut], 1 << 20);
            let _ = decode_frame(&bytes, 1 << 20);
        }
    }
}
