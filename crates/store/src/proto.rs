//! The control protocol between clients (storage nodes are clients) and the master.
//!
//! Every message is one frame: a 16-byte header `magic "PWKV" | version u16 | kind u8 |
//! flags u8 = 0 | request id u32 | body length u32` (little endian) and a body of
//! fixed-order fields. The header is checked before the body is read, against a size cap;
//! counts are checked against what the rest of the body can hold before anything is
//! allocated, so a hostile frame costs at most its own (capped) length. Decoding is pure
//! and never panics (a property test and the `store_proto_decode` fuzz target feed it
//! random and mutated bytes).
//!
//! Strings and keys are `u16` length + bytes; lists are `u32` count + elements. Per-key
//! outcomes are [`Code`]s, sent as `i32`.

use std::fmt;

use crate::error::Code;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"PWKV";
/// The protocol version this build speaks (and the only one it accepts).
pub const VERSION: u16 = 2;
/// Bytes of the frame header.
pub const HEADER_LEN: usize = 16;
/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// Longest shared-secret token.
pub const MAX_TOKEN: usize = 256;
/// Longest endpoint string (`host:port`).
pub const MAX_ENDPOINT: usize = 256;
/// Longest error message carried in an [`Response::Error`].
pub const MAX_MESSAGE: usize = 1024;
/// Most keys in one request.
pub const MAX_ITEMS: usize = 1 << 16;
/// Most replicas of one object.
pub const MAX_REPLICAS: usize = 16;
/// Most segments named in one reply.
pub const MAX_SEGMENTS: usize = 1 << 16;
/// Default cap on one frame (header excluded); both ends may set their own.
pub const DEFAULT_MAX_FRAME: u32 = 16 << 20;
/// Largest body of a valid `Hello` (token, client id, endpoint at their caps): the cap on
/// a connection's first frame, so a peer that has not authenticated buffers no more.
pub const MAX_HELLO_FRAME: u32 = (2 + MAX_TOKEN + 8 + 2 + MAX_ENDPOINT) as u32;

/// A decoding failure: the bytes are not a valid frame of this version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The first four bytes are not `PWKV` (another protocol, or garbage).
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// Another protocol version.
    #[error("protocol version {got} (this build speaks {VERSION})")]
    Version {
        /// The version the peer sent.
        got: u16,
    },
    /// A frame kind this version does not know (or not valid in this direction).
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Reserved flag bits set.
    #[error("reserved flags {0:#04x} set")]
    Flags(u8),
    /// The body is longer than the receiver's cap.
    #[error("frame of {len} bytes exceeds the cap of {max}")]
    Oversized {
        /// Body length announced.
        len: u32,
        /// The cap.
        max: u32,
    },
    /// The body ends inside a field.
    #[error("truncated at {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
    },
    /// Bytes left over after the last field.
    #[error("{extra} trailing bytes")]
    Trailing {
        /// How many.
        extra: usize,
    },
    /// A field holds a value outside its range.
    #[error("bad {field}: {value}")]
    BadField {
        /// The field.
        field: &'static str,
        /// Its value (lengths and counts as numbers).
        value: i64,
    },
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: u8,
    /// Request id, echoed by the response.
    pub req_id: u32,
    /// Body length.
    pub len: u32,
}

/// How an object is protected from eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pin {
    /// Evictable.
    #[default]
    None,
    /// Evicted only after every unpinned candidate (until the soft-pin TTL ends).
    Soft,
    /// Never evicted (removed only explicitly).
    Hard,
}

/// Client -> master: the first frame on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Shared secret, compared in constant time (empty = none).
    pub token: Vec<u8>,
    /// The id the master gave this client before (resume), or 0 for a new client.
    pub client_id: u64,
    /// The client's transport endpoint (`host:port` of its engine's control listener).
    pub endpoint: String,
}

/// Client -> master: reserve space for objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutStart {
    /// Replicas wanted per object (1..=MAX_REPLICAS; best effort above the live segments).
    pub replicas: u8,
    /// Eviction protection of the new objects.
    pub pin: Pin,
    /// Endpoint whose segment should hold the first replica, if it has room ("" = none).
    pub preferred: String,
    /// `(key, size)` per object.
    pub items: Vec<(Vec<u8>, u64)>,
}

/// Client -> master: publish the objects written, revoke the others.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PutFinish {
    /// Every replica written: make visible.
    pub done: Vec<Vec<u8>>,
    /// Failed: drop the reservation.
    pub revoked: Vec<Vec<u8>>,
    /// Segments a transfer to which failed (the master stops placing on them until their
    /// owner is heard from again).
    pub suspects: Vec<u64>,
}

/// A request frame (client -> master).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Kind 1.
    Hello(Hello),
    /// Kind 2: "still here" (any request also counts).
    Heartbeat,
    /// Kind 3: offer `[base, base+size)` of the client's registered memory.
    Mount {
        /// Address in the client's address space.
        base: u64,
        /// Bytes.
        size: u64,
        /// The remote key of the registration that starts at `base`: the node registers
        /// the memory anew before every mount after its first, so a writer or reader
        /// holding an address from an earlier session is refused by the data path.
        rkey: u32,
    },
    /// Kind 4.
    Unmount {
        /// Segment id from `Mounted`.
        segment: u64,
    },
    /// Kind 5.
    PutStart(PutStart),
    /// Kind 6.
    PutFinish(PutFinish),
    /// Kind 7: replica lists of complete objects (with a read lease when `lease`).
    Get {
        /// Grant a read lease.
        lease: bool,
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// Kind 8: whether complete objects exist.
    Exist {
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// Kind 9.
    Remove {
        /// Remove even leased objects.
        force: bool,
        /// Keys.
        keys: Vec<Vec<u8>>,
    },
    /// Kind 10: remove every complete object (not leased unless `force`).
    RemoveAll {
        /// As in `Remove`.
        force: bool,
    },
    /// Kind 11.
    Stats,
    /// Kind 12: segments a read from which failed.
    Report {
        /// Segment ids.
        suspects: Vec<u64>,
    },
    /// Kind 13: the client leaves; its segments are unmounted now.
    Bye,
    /// Kind 14: remove the complete objects whose key matches a regular expression
    /// (searched anywhere in the key; not leased unless `force`). Answered with a count.
    RemoveMatching {
        /// As in `Remove`.
        force: bool,
        /// The pattern (Rust `regex` syntax), at most `MAX_KEY_LEN` bytes.
        pattern: String,
    },
}

/// Master -> client: answer to `Hello`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    /// The client's id (the one asked for when resumed).
    pub client_id: u64,
    /// Random id of this master instance (changes on restart).
    pub epoch: u64,
    /// The client was known and keeps its segments.
    pub resumed: bool,
    /// How long a read lease lasts.
    pub lease_ttl_ms: u32,
    /// How often the client should send a heartbeat.
    pub heartbeat_ms: u32,
    /// Silence after which the master drops a client and unmounts its segments.
    pub client_ttl_ms: u32,
    /// The master's frame cap.
    pub max_frame: u32,
    /// How long a put may take from `PutStart` before the master takes it away: the
    /// client stops writing by then, so the master's hold on that space outlasts every
    /// write of the put.
    pub put_discard_ms: u32,
}

/// A segment named in a reply: its id and the endpoint that serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRef {
    /// Segment id.
    pub id: u64,
    /// Engine endpoint of the owner (`host:port`).
    pub endpoint: String,
    /// Start of the segment in the owner's address space.
    pub base: u64,
    /// The remote key the segment was mounted with: a transfer goes out only while the
    /// owner's description of `base` carries this key.
    pub rkey: u32,
}

/// One replica: where its bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replica {
    /// Segment id (named in the reply's segment table).
    pub segment: u64,
    /// Address in the owner's address space.
    pub addr: u64,
}

/// Master -> client: answer to `PutStart`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Placement {
    /// Every segment the replicas name.
    pub segments: Vec<SegmentRef>,
    /// Per requested item: where to write each replica, or why not.
    pub items: Vec<Result<Vec<Replica>, Code>>,
}

/// A complete object's size and replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Bytes.
    pub size: u64,
    /// Replicas (at least one).
    pub replicas: Vec<Replica>,
}

/// Master -> client: answer to `Get`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Found {
    /// The lease granted (0 without a lease).
    pub lease_ttl_ms: u32,
    /// Every segment the replicas name.
    pub segments: Vec<SegmentRef>,
    /// Per key.
    pub items: Vec<Result<ObjectInfo, Code>>,
}

/// Master -> client: answer to `Stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Live clients.
    pub clients: u64,
    /// Mounted segments.
    pub segments: u64,
    /// Complete objects.
    pub objects: u64,
    /// Objects being written.
    pub pending: u64,
    /// Bytes of every mounted segment.
    pub capacity: u64,
    /// Bytes allocated (objects, reservations, space waiting to be reused).
    pub used: u64,
    /// Objects evicted since the master started.
    pub evicted: u64,
    /// Unfinished puts reclaimed since the master started.
    pub reclaimed: u64,
}

/// A response frame (master -> client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// Kind 0x81.
    Welcome(Welcome),
    /// Kind 0x82: done (heartbeat, unmount, report, bye).
    Ack,
    /// Kind 0x83.
    Mounted {
        /// The new segment's id.
        segment: u64,
    },
    /// Kind 0x84.
    Placed(Placement),
    /// Kind 0x85: one code per key (PutFinish: `done` then `revoked`; Remove; Exist:
    /// `Ok` = exists, `NotFound` = not).
    Codes(Vec<Code>),
    /// Kind 0x86.
    Found(Found),
    /// Kind 0x87: a count (RemoveAll).
    Count(u64),
    /// Kind 0x88.
    Stats(Stats),
    /// Kind 0x8f: the request as a whole was refused.
    Error {
        /// Why.
        code: Code,
        /// Human-readable detail.
        message: String,
    },
}

// ---------------------------------------------------------------- encoding

/// Appends a frame to `out`: header, then the body `body` writes.
fn frame(out: &mut Vec<u8>, kind: u8, req_id: u32, body: impl FnOnce(&mut W<'_>)) {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(kind);
    out.push(0);
    out.extend_from_slice(&req_id.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    body(&mut W(out));
    let len = (out.len() - start - HEADER_LEN) as u32;
    out[start + 12..start + 16].copy_from_slice(&len.to_le_bytes());
}

pub(crate) struct W<'a>(pub(crate) &'a mut Vec<u8>);

impl W<'_> {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn i32(&mut self, v: i32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bool(&mut self, v: bool) {
        self.u8(v as u8);
    }
    /// `u16` length + bytes; callers keep lengths under the caps (encoders truncate
    /// nothing: an oversized field is a caller bug the decoder on the other side refuses).
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.u16(b.len().min(u16::MAX as usize) as u16);
        self.0
            .extend_from_slice(&b[..b.len().min(u16::MAX as usize)]);
    }
    pub(crate) fn count(&mut self, n: usize) {
        self.u32(n.min(u32::MAX as usize) as u32);
    }
    pub(crate) fn keys(&mut self, keys: &[Vec<u8>]) {
        self.count(keys.len());
        for k in keys {
            self.bytes(k);
        }
    }
    pub(crate) fn u64s(&mut self, v: &[u64]) {
        self.count(v.len());
        for &x in v {
            self.u64(x);
        }
    }
    pub(crate) fn segments(&mut self, s: &[SegmentRef]) {
        self.count(s.len());
        for seg in s {
            self.u64(seg.id);
            self.bytes(seg.endpoint.as_bytes());
            self.u64(seg.base);
            self.u32(seg.rkey);
        }
    }
    pub(crate) fn replicas(&mut self, r: &[Replica]) {
        self.u8(r.len().min(255) as u8);
        for rep in r {
            self.u64(rep.segment);
            self.u64(rep.addr);
        }
    }
}

fn pin_byte(p: Pin) -> u8 {
    match p {
        Pin::None => 0,
        Pin::Soft => 1,
        Pin::Hard => 2,
    }
}

impl Request {
    /// The frame kind.
    pub fn kind(&self) -> u8 {
        match self {
            Request::Hello(_) => 1,
            Request::Heartbeat => 2,
            Request::Mount { .. } => 3,
            Request::Unmount { .. } => 4,
            Request::PutStart(_) => 5,
            Request::PutFinish(_) => 6,
            Request::Get { .. } => 7,
            Request::Exist { .. } => 8,
            Request::Remove { .. } => 9,
            Request::RemoveAll { .. } => 10,
            Request::Stats => 11,
            Request::Report { .. } => 12,
            Request::Bye => 13,
            Request::RemoveMatching { .. } => 14,
        }
    }

    /// Appends this request as one frame.
    pub fn encode(&self, req_id: u32, out: &mut Vec<u8>) {
        frame(out, self.kind(), req_id, |w| match self {
            Request::Hello(h) => {
                w.bytes(&h.token);
                w.u64(h.client_id);
                w.bytes(h.endpoint.as_bytes());
            }
            Request::Heartbeat | Request::Stats | Request::Bye => {}
            Request::Mount { base, size, rkey } => {
                w.u64(*base);
                w.u64(*size);
                w.u32(*rkey);
            }
            Request::Unmount { segment } => w.u64(*segment),
            Request::PutStart(p) => {
                w.u8(p.replicas);
                w.u8(pin_byte(p.pin));
                w.bytes(p.preferred.as_bytes());
                w.count(p.items.len());
                for (k, size) in &p.items {
                    w.bytes(k);
                    w.u64(*size);
                }
            }
            Request::PutFinish(f) => {
                w.keys(&f.done);
                w.keys(&f.revoked);
                w.u64s(&f.suspects);
            }
            Request::Get { lease, keys } => {
                w.bool(*lease);
                w.keys(keys);
            }
            Request::Exist { keys } => w.keys(keys),
            Request::Remove { force, keys } => {
                w.bool(*force);
                w.keys(keys);
            }
            Request::RemoveAll { force } => w.bool(*force),
            Request::RemoveMatching { force, pattern } => {
                w.bool(*force);
                w.bytes(pattern.as_bytes());
            }
            Request::Report { suspects } => w.u64s(suspects),
        })
    }
}

impl Response {
    /// The frame kind.
    pub fn kind(&self) -> u8 {
        match self {
            Response::Welcome(_) => 0x81,
            Response::Ack => 0x82,
            Response::Mounted { .. } => 0x83,
            Response::Placed(_) => 0x84,
            Response::Codes(_) => 0x85,
            Response::Found(_) => 0x86,
            Response::Count(_) => 0x87,
            Response::Stats(_) => 0x88,
            Response::Error { .. } => 0x8f,
        }
    }

    /// Appends this response as one frame.
    pub fn encode(&self, req_id: u32, out: &mut Vec<u8>) {
        frame(out, self.kind(), req_id, |w| match self {
            Response::Welcome(h) => {
                w.u64(h.client_id);
                w.u64(h.epoch);
                w.bool(h.resumed);
                w.u32(h.lease_ttl_ms);
                w.u32(h.heartbeat_ms);
                w.u32(h.client_ttl_ms);
                w.u32(h.max_frame);
                w.u32(h.put_discard_ms);
            }
            Response::Ack => {}
            Response::Mounted { segment } => w.u64(*segment),
            Response::Placed(p) => {
                w.segments(&p.segments);
                w.count(p.items.len());
                for item in &p.items {
                    match item {
                        Ok(r) => {
                            w.i32(0);
                            w.replicas(r);
                        }
                        Err(c) => w.i32(c.as_i32()),
                    }
                }
            }
            Response::Codes(codes) => {
                w.count(codes.len());
                for c in codes {
                    w.i32(c.as_i32());
                }
            }
            Response::Found(f) => {
                w.u32(f.lease_ttl_ms);
                w.segments(&f.segments);
                w.count(f.items.len());
                for item in &f.items {
                    match item {
                        Ok(o) => {
                            w.i32(0);
                            w.u64(o.size);
                            w.replicas(&o.replicas);
                        }
                        Err(c) => w.i32(c.as_i32()),
                    }
                }
            }
            Response::Count(n) => w.u64(*n),
            Response::Stats(s) => {
                for v in [
                    s.clients,
                    s.segments,
                    s.objects,
                    s.pending,
                    s.capacity,
                    s.used,
                    s.evicted,
                    s.reclaimed,
                ] {
                    w.u64(v);
                }
            }
            Response::Error { code, message } => {
                w.i32(code.as_i32());
                let m = message.as_bytes();
                w.bytes(&m[..floor_char_boundary(message, MAX_MESSAGE.min(m.len()))]);
            }
        })
    }
}

/// The largest index `<= i` on a char boundary of `s`.
fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

// ---------------------------------------------------------------- decoding

/// Checks a header against `max` (the body cap) before anything else is read.
pub fn decode_header(h: &[u8; HEADER_LEN], max: u32) -> Result<Header, ProtoError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(ProtoError::Version { got: version });
    }
    let kind = h[6];
    if !(1..=14).contains(&kind) && !(0x81..=0x88).contains(&kind) && kind != 0x8f {
        return Err(ProtoError::UnknownKind(kind));
    }
    if h[7] != 0 {
        return Err(ProtoError::Flags(h[7]));
    }
    let req_id = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    let len = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
    if len > max {
        return Err(ProtoError::Oversized { len, max });
    }
    Ok(Header { kind, req_id, len })
}

/// Splits a whole frame (header + body, nothing more) into its header and body.
pub fn split_frame(buf: &[u8], max: u32) -> Result<(Header, &[u8]), ProtoError> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Err(ProtoError::Truncated { field: "header" });
    };
    let header = decode_header(h, max)?;
    let body = &buf[HEADER_LEN..];
    match body.len().cmp(&(header.len as usize)) {
        std::cmp::Ordering::Less => Err(ProtoError::Truncated { field: "body" }),
        std::cmp::Ordering::Greater => Err(ProtoError::Trailing {
            extra: body.len() - header.len as usize,
        }),
        std::cmp::Ordering::Equal => Ok((header, body)),
    }
}

pub(crate) struct R<'a> {
    pub(crate) buf: &'a [u8],
}

pub(crate) fn bad(field: &'static str, value: impl TryInto<i64>) -> ProtoError {
    ProtoError::BadField {
        field,
        value: value.try_into().unwrap_or(i64::MAX),
    }
}

impl<'a> R<'a> {
    pub(crate) fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ProtoError> {
        if self.buf.len() < n {
            return Err(ProtoError::Truncated { field });
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self, f: &'static str) -> Result<u8, ProtoError> {
        Ok(self.take(1, f)?[0])
    }
    pub(crate) fn u16(&mut self, f: &'static str) -> Result<u16, ProtoError> {
        let s = self.take(2, f)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    pub(crate) fn u32(&mut self, f: &'static str) -> Result<u32, ProtoError> {
        let s = self.take(4, f)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    pub(crate) fn u64(&mut self, f: &'static str) -> Result<u64, ProtoError> {
        let s = self.take(8, f)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn i32(&mut self, f: &'static str) -> Result<i32, ProtoError> {
        Ok(self.u32(f)? as i32)
    }
    pub(crate) fn bool(&mut self, f: &'static str) -> Result<bool, ProtoError> {
        match self.u8(f)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(bad(f, v)),
        }
    }
    pub(crate) fn bytes(&mut self, f: &'static str, max: usize) -> Result<&'a [u8], ProtoError> {
        let n = self.u16(f)? as usize;
        if n > max {
            return Err(bad(f, n));
        }
        self.take(n, f)
    }
    pub(crate) fn key(&mut self) -> Result<Vec<u8>, ProtoError> {
        let k = self.bytes("key", MAX_KEY_LEN)?;
        if k.is_empty() {
            return Err(bad("key length", 0));
        }
        Ok(k.to_vec())
    }
    pub(crate) fn string(&mut self, f: &'static str, max: usize) -> Result<String, ProtoError> {
        let b = self.bytes(f, max)?;
        String::from_utf8(b.to_vec()).map_err(|_| bad(f, -1))
    }
    /// A count of elements of at least `min_size` bytes each, checked against the cap and
    /// against what the rest of the body can hold (so allocation follows the bytes sent).
    pub(crate) fn count(
        &mut self,
        f: &'static str,
        cap: usize,
        min_size: usize,
    ) -> Result<usize, ProtoError> {
        let n = self.u32(f)? as usize;
        if n > cap || n.saturating_mul(min_size) > self.buf.len() {
            return Err(bad(f, n));
        }
        Ok(n)
    }
    pub(crate) fn keys(&mut self) -> Result<Vec<Vec<u8>>, ProtoError> {
        let n = self.count("key count", MAX_ITEMS, 3)?;
        (0..n).map(|_| self.key()).collect()
    }
    pub(crate) fn u64s(&mut self, f: &'static str) -> Result<Vec<u64>, ProtoError> {
        let n = self.count(f, MAX_SEGMENTS, 8)?;
        (0..n).map(|_| self.u64(f)).collect()
    }
    pub(crate) fn code(&mut self) -> Result<Code, ProtoError> {
        let v = self.i32("code")?;
        Code::from_i32(v).ok_or_else(|| bad("code", v))
    }
    /// A per-item status: `Ok(())` for 0, else a (non-zero) code.
    pub(crate) fn status(&mut self) -> Result<Result<(), Code>, ProtoError> {
        match self.code()? {
            Code::Ok => Ok(Ok(())),
            c => Ok(Err(c)),
        }
    }
    pub(crate) fn segments(&mut self) -> Result<Vec<SegmentRef>, ProtoError> {
        let n = self.count("segment count", MAX_SEGMENTS, 22)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.u64("segment id")?;
            let endpoint = self.string("endpoint", MAX_ENDPOINT)?;
            if endpoint.is_empty() {
                return Err(bad("endpoint length", 0));
            }
            let base = self.u64("segment base")?;
            let rkey = self.u32("segment rkey")?;
            if v.iter().any(|s: &SegmentRef| s.id == id) {
                return Err(bad("duplicate segment id", id as i64));
            }
            v.push(SegmentRef {
                id,
                endpoint,
                base,
                rkey,
            });
        }
        Ok(v)
    }
    pub(crate) fn replicas(&mut self, segments: &[SegmentRef]) -> Result<Vec<Replica>, ProtoError> {
        let n = self.u8("replica count")? as usize;
        if n == 0 || n > MAX_REPLICAS {
            return Err(bad("replica count", n));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let segment = self.u64("replica segment")?;
            let addr = self.u64("replica addr")?;
            if !segments.iter().any(|s| s.id == segment) {
                return Err(bad("replica segment", segment as i64));
            }
            if v.iter().any(|r: &Replica| r.segment == segment) {
                return Err(bad("two replicas on segment", segment as i64));
            }
            v.push(Replica { segment, addr });
        }
        Ok(v)
    }
    pub(crate) fn finish<T>(self, v: T) -> Result<T, ProtoError> {
        if self.buf.is_empty() {
            Ok(v)
        } else {
            Err(ProtoError::Trailing {
                extra: self.buf.len(),
            })
        }
    }
}

fn pin_of(b: u8) -> Result<Pin, ProtoError> {
    match b {
        0 => Ok(Pin::None),
        1 => Ok(Pin::Soft),
        2 => Ok(Pin::Hard),
        v => Err(bad("pin", v)),
    }
}

/// Decodes a request body of `kind`.
pub fn decode_request(kind: u8, body: &[u8]) -> Result<Request, ProtoError> {
    let mut r = R { buf: body };
    let req = match kind {
        1 => {
            let token = r.bytes("token", MAX_TOKEN)?.to_vec();
            let client_id = r.u64("client id")?;
            let endpoint = r.string("endpoint", MAX_ENDPOINT)?;
            if endpoint.is_empty() {
                return Err(bad("endpoint length", 0));
            }
            Request::Hello(Hello {
                token,
                client_id,
                endpoint,
            })
        }
        2 => Request::Heartbeat,
        3 => {
            let base = r.u64("base")?;
            let size = r.u64("size")?;
            if size == 0 || base.checked_add(size).is_none() {
                return Err(bad("segment size", size as i64));
            }
            Request::Mount {
                base,
                size,
                rkey: r.u32("rkey")?,
            }
        }
        4 => Request::Unmount {
            segment: r.u64("segment")?,
        },
        5 => {
            let replicas = r.u8("replicas")?;
            if replicas == 0 || replicas as usize > MAX_REPLICAS {
                return Err(bad("replicas", replicas));
            }
            let pin = pin_of(r.u8("pin")?)?;
            let preferred = r.string("preferred", MAX_ENDPOINT)?;
            let n = r.count("item count", MAX_ITEMS, 11)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                let k = r.key()?;
                let size = r.u64("size")?;
                if size == 0 {
                    return Err(bad("size", 0));
                }
                items.push((k, size));
            }
            Request::PutStart(PutStart {
                replicas,
                pin,
                preferred,
                items,
            })
        }
        6 => Request::PutFinish(PutFinish {
            done: r.keys()?,
            revoked: r.keys()?,
            suspects: r.u64s("suspect count")?,
        }),
        7 => Request::Get {
            lease: r.bool("lease")?,
            keys: r.keys()?,
        },
        8 => Request::Exist { keys: r.keys()? },
        9 => Request::Remove {
            force: r.bool("force")?,
            keys: r.keys()?,
        },
        10 => Request::RemoveAll {
            force: r.bool("force")?,
        },
        11 => Request::Stats,
        12 => Request::Report {
            suspects: r.u64s("suspect count")?,
        },
        13 => Request::Bye,
        14 => Request::RemoveMatching {
            force: r.bool("force")?,
            pattern: r.string("pattern", MAX_KEY_LEN)?,
        },
        k => return Err(ProtoError::UnknownKind(k)),
    };
    r.finish(req)
}

/// Decodes a response body of `kind`.
pub fn decode_response(kind: u8, body: &[u8]) -> Result<Response, ProtoError> {
    let mut r = R { buf: body };
    let resp = match kind {
        0x81 => {
            let client_id = r.u64("client id")?;
            if client_id == 0 {
                return Err(bad("client id", 0));
            }
            Response::Welcome(Welcome {
                client_id,
                epoch: r.u64("epoch")?,
                resumed: r.bool("resumed")?,
                lease_ttl_ms: r.u32("lease ttl")?,
                heartbeat_ms: positive(r.u32("heartbeat")?, "heartbeat")?,
                client_ttl_ms: positive(r.u32("client ttl")?, "client ttl")?,
                max_frame: r.u32("max frame")?,
                put_discard_ms: positive(r.u32("put discard")?, "put discard")?,
            })
        }
        0x82 => Response::Ack,
        0x83 => Response::Mounted {
            segment: r.u64("segment")?,
        },
        0x84 => {
            let segments = r.segments()?;
            let n = r.count("item count", MAX_ITEMS, 4)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(match r.status()? {
                    Ok(()) => Ok(r.replicas(&segments)?),
                    Err(c) => Err(c),
                });
            }
            Response::Placed(Placement { segments, items })
        }
        0x85 => {
            let n = r.count("code count", MAX_ITEMS * 2, 4)?;
            Response::Codes((0..n).map(|_| r.code()).collect::<Result<_, _>>()?)
        }
        0x86 => {
            let lease_ttl_ms = r.u32("lease ttl")?;
            let segments = r.segments()?;
            let n = r.count("item count", MAX_ITEMS, 4)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(match r.status()? {
                    Ok(()) => {
                        let size = r.u64("size")?;
                        if size == 0 {
                            return Err(bad("size", 0));
                        }
                        Ok(ObjectInfo {
                            size,
                            replicas: r.replicas(&segments)?,
                        })
                    }
                    Err(c) => Err(c),
                });
            }
            Response::Found(Found {
                lease_ttl_ms,
                segments,
                items,
            })
        }
        0x87 => Response::Count(r.u64("count")?),
        0x88 => {
            let mut v = [0u64; 8];
            for x in &mut v {
                *x = r.u64("stats")?;
            }
            Response::Stats(Stats {
                clients: v[0],
                segments: v[1],
                objects: v[2],
                pending: v[3],
                capacity: v[4],
                used: v[5],
                evicted: v[6],
                reclaimed: v[7],
            })
        }
        0x8f => {
            let code = r.code()?;
            let message = String::from_utf8_lossy(r.bytes("message", MAX_MESSAGE)?).into_owned();
            Response::Error { code, message }
        }
        k => return Err(ProtoError::UnknownKind(k)),
    };
    r.finish(resp)
}

fn positive(v: u32, f: &'static str) -> Result<u32, ProtoError> {
    if v == 0 { Err(bad(f, 0)) } else { Ok(v) }
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pin::None => "none",
            Pin::Soft => "soft",
            Pin::Hard => "hard",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip_req(r: Request) {
        let mut buf = Vec::new();
        r.encode(7, &mut buf);
        let (h, body) = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(h.req_id, 7);
        assert_eq!(h.kind, r.kind());
        assert_eq!(decode_request(h.kind, body).unwrap(), r);
    }

    fn round_trip_resp(r: Response) {
        let mut buf = Vec::new();
        r.encode(u32::MAX, &mut buf);
        let (h, body) = split_frame(&buf, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(h.req_id, u32::MAX);
        assert_eq!(decode_response(h.kind, body).unwrap(), r);
    }

    fn sample_requests() -> Vec<Request> {
        vec![
            Request::Hello(Hello {
                token: b"secret".to_vec(),
                client_id: 0,
                endpoint: "127.0.0.1:4000".into(),
            }),
            Request::Heartbeat,
            Request::Mount {
                base: 0x7f00_0000_0000,
                size: 1 << 30,
                rkey: 0x1234_5678,
            },
            Request::Unmount { segment: 3 },
            Request::PutStart(PutStart {
                replicas: 2,
                pin: Pin::Soft,
                preferred: "10.0.0.1:7".into(),
                items: vec![(b"a_0_k".to_vec(), 4096), (vec![0xff; 300], 1)],
            }),
            Request::PutFinish(PutFinish {
                done: vec![b"x".to_vec()],
                revoked: vec![b"y".to_vec(), b"z".to_vec()],
                suspects: vec![1, 2],
            }),
            Request::Get {
                lease: true,
                keys: vec![b"k".to_vec()],
            },
            Request::Exist { keys: vec![] },
            Request::Remove {
                force: true,
                keys: vec![b"k".to_vec()],
            },
            Request::RemoveAll { force: false },
            Request::RemoveMatching {
                force: true,
                pattern: "^k[0-9]+$".into(),
            },
            Request::Stats,
            Request::Report { suspects: vec![9] },
            Request::Bye,
        ]
    }

    fn sample_responses() -> Vec<Response> {
        let segments = vec![
            SegmentRef {
                id: 1,
                endpoint: "127.0.0.1:1".into(),
                base: 0x7f00_0000_0000,
                rkey: 7,
            },
            SegmentRef {
                id: 5,
                endpoint: "[::1]:2".into(),
                base: 4096,
                rkey: u32::MAX,
            },
        ];
        vec![
            Response::Welcome(Welcome {
                client_id: 42,
                epoch: 9,
                resumed: false,
                lease_ttl_ms: 10_000,
                heartbeat_ms: 1000,
                client_ttl_ms: 10_000,
                max_frame: 1 << 20,
                put_discard_ms: 30_000,
            }),
            Response::Ack,
            Response::Mounted { segment: 5 },
            Response::Placed(Placement {
                segments: segments.clone(),
                items: vec![
                    Ok(vec![
                        Replica {
                            segment: 1,
                            addr: 0x1000,
                        },
                        Replica {
                            segment: 5,
                            addr: 0x2000,
                        },
                    ]),
                    Err(Code::AlreadyExists),
                    Err(Code::NoSpace),
                ],
            }),
            Response::Codes(vec![Code::Ok, Code::NotFound, Code::HasLease]),
            Response::Found(Found {
                lease_ttl_ms: 10_000,
                segments,
                items: vec![
                    Ok(ObjectInfo {
                        size: 77,
                        replicas: vec![Replica {
                            segment: 5,
                            addr: 1,
                        }],
                    }),
                    Err(Code::NotFound),
                ],
            }),
            Response::Count(3),
            Response::Stats(Stats {
                clients: 1,
                segments: 2,
                objects: 3,
                pending: 4,
                capacity: 5,
                used: 6,
                evicted: 7,
                reclaimed: 8,
            }),
            Response::Error {
                code: Code::InvalidParams,
                message: "no".into(),
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for r in sample_requests() {
            round_trip_req(r);
        }
        for r in sample_responses() {
            round_trip_resp(r);
        }
    }

    #[test]
    fn hostile_headers_are_refused_before_the_body() {
        let mut buf = Vec::new();
        Request::Heartbeat.encode(1, &mut buf);
        let h: [u8; HEADER_LEN] = buf[..HEADER_LEN].try_into().unwrap();
        let mut bad_magic = h;
        bad_magic[..4].copy_from_slice(b"GET ");
        assert!(matches!(
            decode_header(&bad_magic, 1024),
            Err(ProtoError::BadMagic(_))
        ));
        for old in [1u16, VERSION + 1] {
            let mut v = h;
            v[4..6].copy_from_slice(&old.to_le_bytes());
            assert_eq!(
                decode_header(&v, 1024),
                Err(ProtoError::Version { got: old })
            );
        }
        let mut kind = h;
        kind[6] = 0x40;
        assert_eq!(
            decode_header(&kind, 1024),
            Err(ProtoError::UnknownKind(0x40))
        );
        let mut flags = h;
        flags[7] = 1;
        assert_eq!(decode_header(&flags, 1024), Err(ProtoError::Flags(1)));
        let mut big = h;
        big[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_header(&big, 1024),
            Err(ProtoError::Oversized { .. })
        ));
    }

    #[test]
    fn counts_are_checked_against_the_body_before_allocating() {
        // A Get claiming 2^16 keys in a 9-byte body.
        let mut body = vec![1u8];
        body.extend_from_slice(&(MAX_ITEMS as u32).to_le_bytes());
        body.extend_from_slice(&[1, 0, b'k', 0]);
        assert!(matches!(
            decode_request(7, &body),
            Err(ProtoError::BadField {
                field: "key count",
                ..
            })
        ));
        // Over the cap outright.
        let mut body = vec![0u8];
        body.extend_from_slice(&(u32::MAX).to_le_bytes());
        assert!(decode_request(7, &body).is_err());
    }

    #[test]
    fn field_rules() {
        // Empty key.
        let mut body = vec![0u8];
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(&0u16.to_le_bytes());
        assert!(decode_request(7, &body).is_err());
        // bool 2.
        assert!(decode_request(10, &[2]).is_err());
        // Trailing byte.
        assert_eq!(
            decode_request(10, &[1, 0]),
            Err(ProtoError::Trailing { extra: 1 })
        );
        // Mount of zero bytes or overflowing.
        let mount = |base: u64, size: u64| {
            let mut b = base.to_le_bytes().to_vec();
            b.extend_from_slice(&size.to_le_bytes());
            b.extend_from_slice(&7u32.to_le_bytes());
            decode_request(3, &b)
        };
        assert!(mount(0x1000, 0).is_err());
        assert!(mount(u64::MAX, 2).is_err());
        assert!(mount(0x1000, 4096).is_ok());
        // A replica naming a segment not in the table, and two replicas on one segment.
        let mut buf = Vec::new();
        Response::Placed(Placement {
            segments: vec![SegmentRef {
                id: 1,
                endpoint: "a:1".into(),
                base: 0,
                rkey: 1,
            }],
            items: vec![Ok(vec![Replica {
                segment: 2,
                addr: 0,
            }])],
        })
        .encode(0, &mut buf);
        assert!(decode_response(0x84, &buf[HEADER_LEN..]).is_err());
        let mut buf = Vec::new();
        Response::Placed(Placement {
            segments: vec![SegmentRef {
                id: 1,
                endpoint: "a:1".into(),
                base: 0,
                rkey: 1,
            }],
            items: vec![Ok(vec![
                Replica {
                    segment: 1,
                    addr: 0,
                },
                Replica {
                    segment: 1,
                    addr: 8,
                },
            ])],
        })
        .encode(0, &mut buf);
        assert!(decode_response(0x84, &buf[HEADER_LEN..]).is_err());
        // Unknown code.
        let mut b = 1u32.to_le_bytes().to_vec();
        b.extend_from_slice(&12345i32.to_le_bytes());
        assert!(decode_response(0x85, &b).is_err());
        // Requests are not responses and vice versa.
        assert!(decode_request(0x82, &[]).is_err());
        assert!(decode_response(2, &[]).is_err());
    }

    #[test]
    fn long_error_messages_are_cut_on_a_char_boundary() {
        let msg = "é".repeat(MAX_MESSAGE);
        let mut buf = Vec::new();
        Response::Error {
            code: Code::Internal,
            message: msg,
        }
        .encode(0, &mut buf);
        let Response::Error { message, .. } = decode_response(0x8f, &buf[HEADER_LEN..]).unwrap()
        else {
            panic!()
        };
        assert!(message.len() <= MAX_MESSAGE && message.chars().all(|c| c == 'é'));
    }

    fn all_frames() -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        for r in sample_requests() {
            let mut b = Vec::new();
            r.encode(3, &mut b);
            v.push(b);
        }
        for r in sample_responses() {
            let mut b = Vec::new();
            r.encode(3, &mut b);
            v.push(b);
        }
        v
    }

    /// What the fuzz target does with one input.
    fn decode_any(bytes: &[u8]) {
        if let Ok((h, body)) = split_frame(bytes, DEFAULT_MAX_FRAME) {
            let _ = decode_request(h.kind, body);
            let _ = decode_response(h.kind, body);
        }
        for kind in (1..=14).chain(0x81..=0x88).chain([0x8f]) {
            let _ = decode_request(kind, bytes);
            let _ = decode_response(kind, bytes);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            decode_any(&bytes);
        }

        #[test]
        fn mutated_frames_never_panic(
            which in 0usize..22,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
            cut in any::<usize>(),
        ) {
            let frames = all_frames();
            let mut f = frames[which % frames.len()].clone();
            for (i, b) in flips {
                let n = f.len();
                f[i % n] = b;
            }
            decode_any(&f);
            let n = f.len();
            decode_any(&f[..cut % (n + 1)]);
        }
    }
}
