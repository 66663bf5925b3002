//! The protocol between a standalone store client (`pagewire store client`, the
//! [`crate::standalone::RealClient`]) and the dummy clients of the same host
//! ([`crate::standalone::DummyClient`]), over a Unix stream socket.
//!
//! Every message is one frame: a 12-byte header `magic "PWDC" | version u16 | kind u8 |
//! flags u8 = 0 | body length u32` (little endian) and a body of fixed-order fields,
//! encoded as in [`crate::proto`] (strings `u16` length + bytes, lists `u32` count +
//! elements). One request is outstanding per connection, so frames carry no request id.
//!
//! Payloads never cross the socket: a dummy shares memory it allocated (a sealed memfd,
//! passed once with `SCM_RIGHTS` alongside a [`IpcRequest::Map`] frame) and names bytes as
//! `(region, offset, length)` inside it; the real client checks each against the mapping
//! before its engine touches it. Decoding is pure, capped and never panics (the
//! `store_ipc_decode` fuzz target and the corpus test feed it hostile bytes).

use crate::error::Code;
use crate::proto::Pin;
use crate::proto::{
    MAX_ENDPOINT, MAX_ITEMS, MAX_KEY_LEN, MAX_MESSAGE, MAX_TOKEN, ProtoError, R, W, bad,
};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"PWDC";
/// The only version this build speaks.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER_LEN: usize = 12;
/// Cap on one frame's body (keys and spans only: payloads stay in shared memory).
pub const MAX_FRAME: u32 = 8 << 20;
/// Most spans one object is gathered from or scattered to.
pub const MAX_PARTS: usize = 1024;
/// Cap on a connection's first frame ([`IpcRequest::Hello`]): a peer that has not
/// authenticated buffers no more than this.
pub const MAX_HELLO_FRAME: u32 = (2 + MAX_TOKEN) as u32;

/// A span of a dummy's shared region: `len` bytes at `offset` of region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmSpan {
    /// The region id the real client gave the mapping.
    pub region: u32,
    /// Offset inside the region.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

/// One object of a put or get: its key and the spans it is gathered from / scattered to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcItem {
    /// The key.
    pub key: Vec<u8>,
    /// The spans, in order.
    pub parts: Vec<ShmSpan>,
}

/// Dummy -> real client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcRequest {
    /// The first frame: the store's token (empty without one).
    Hello {
        /// The token.
        token: Vec<u8>,
    },
    /// Map the memfd sent with this frame (`SCM_RIGHTS`), of `size` bytes; answered with
    /// `Codes([region id])`.
    Map {
        /// Its size (must equal the file's, which must be sealed against shrinking).
        size: u64,
    },
    /// Unmap a region of this connection.
    Unmap {
        /// The region.
        region: u32,
    },
    /// Store objects from shared memory; answered with one code per item.
    Put {
        /// Replicas per object.
        replicas: u8,
        /// Eviction protection.
        pin: Pin,
        /// Preferred segment (endpoint), empty for none.
        preferred: String,
        /// The objects.
        items: Vec<IpcItem>,
    },
    /// Read objects into shared memory; answered with the size or a code per item.
    Get {
        /// The objects.
        items: Vec<IpcItem>,
    },
    /// Per key 1 / 0 / code.
    Exist {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// Per key the size or a code.
    Size {
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// Per key a code.
    Remove {
        /// Remove leased objects too.
        force: bool,
        /// The keys.
        keys: Vec<Vec<u8>>,
    },
    /// Remove every object; answered with the count.
    RemoveAll {
        /// Remove leased objects too.
        force: bool,
    },
    /// Remove the complete objects whose key matches a pattern; answered with the count.
    RemoveMatching {
        /// Remove leased objects too.
        force: bool,
        /// The pattern (the master's syntax), at most `MAX_KEY_LEN` bytes.
        pattern: String,
    },
    /// Whether the real client and its master answer.
    Ping,
    /// The real client's transport endpoint, as text.
    Endpoint,
}

/// Real client -> dummy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpcResponse {
    /// Per-item results: `>= 0` success (a size, a count, 1/0), negative a [`Code`].
    Codes(Vec<i64>),
    /// A string (the endpoint).
    Text(String),
    /// The request failed as a whole.
    Error {
        /// Why.
        code: Code,
        /// Detail.
        message: String,
    },
}

fn frame(out: &mut Vec<u8>, kind: u8, body: impl FnOnce(&mut W<'_>)) {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(kind);
    out.push(0);
    out.extend_from_slice(&[0; 4]);
    body(&mut W(out));
    let len = (out.len() - start - HEADER_LEN) as u32;
    out[start + 8..start + 12].copy_from_slice(&len.to_le_bytes());
}

fn pin_byte(p: Pin) -> u8 {
    match p {
        Pin::None => 0,
        Pin::Soft => 1,
        Pin::Hard => 2,
    }
}

fn items(w: &mut W<'_>, items: &[IpcItem]) {
    w.count(items.len());
    for it in items {
        w.bytes(&it.key);
        w.count(it.parts.len());
        for p in &it.parts {
            w.u32(p.region);
            w.u64(p.offset);
            w.u64(p.len);
        }
    }
}

impl IpcRequest {
    /// The frame kind.
    pub fn kind(&self) -> u8 {
        match self {
            IpcRequest::Hello { .. } => 1,
            IpcRequest::Map { .. } => 2,
            IpcRequest::Unmap { .. } => 3,
            IpcRequest::Put { .. } => 4,
            IpcRequest::Get { .. } => 5,
            IpcRequest::Exist { .. } => 6,
            IpcRequest::Size { .. } => 7,
            IpcRequest::Remove { .. } => 8,
            IpcRequest::RemoveAll { .. } => 9,
            IpcRequest::Ping => 10,
            IpcRequest::Endpoint => 11,
            IpcRequest::RemoveMatching { .. } => 12,
        }
    }

    /// Appends the frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        frame(out, self.kind(), |w| match self {
            IpcRequest::Hello { token } => w.bytes(token),
            IpcRequest::Map { size } => w.u64(*size),
            IpcRequest::Unmap { region } => w.u32(*region),
            IpcRequest::Put {
                replicas,
                pin,
                preferred,
                items: it,
            } => {
                w.u8(*replicas);
                w.u8(pin_byte(*pin));
                w.bytes(preferred.as_bytes());
                items(w, it);
            }
            IpcRequest::Get { items: it } => items(w, it),
            IpcRequest::Exist { keys } | IpcRequest::Size { keys } => w.keys(keys),
            IpcRequest::Remove { force, keys } => {
                w.bool(*force);
                w.keys(keys);
            }
            IpcRequest::RemoveAll { force } => w.bool(*force),
            IpcRequest::RemoveMatching { force, pattern } => {
                w.bool(*force);
                w.bytes(pattern.as_bytes());
            }
            IpcRequest::Ping | IpcRequest::Endpoint => {}
        });
    }
}

impl IpcResponse {
    /// The frame kind.
    pub fn kind(&self) -> u8 {
        match self {
            IpcResponse::Codes(_) => 0x81,
            IpcResponse::Text(_) => 0x82,
            IpcResponse::Error { .. } => 0x8f,
        }
    }

    /// Appends the frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        frame(out, self.kind(), |w| match self {
            IpcResponse::Codes(v) => {
                w.count(v.len());
                for &c in v {
                    w.u64(c as u64);
                }
            }
            IpcResponse::Text(s) => w.bytes(s.as_bytes()),
            IpcResponse::Error { code, message } => {
                w.i32(code.as_i32());
                let mut end = message.len().min(MAX_MESSAGE);
                while !message.is_char_boundary(end) {
                    end -= 1;
                }
                w.bytes(&message.as_bytes()[..end]);
            }
        });
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHeader {
    /// Frame kind.
    pub kind: u8,
    /// Body length.
    pub len: u32,
}

fn known_kind(kind: u8) -> bool {
    (1..=12).contains(&kind) || matches!(kind, 0x81 | 0x82 | 0x8f)
}

/// Checks a header against `max` (the body cap) before the body is read.
pub fn decode_header(h: &[u8; HEADER_LEN], max: u32) -> Result<IpcHeader, ProtoError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(ProtoError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(ProtoError::Version { got: version });
    }
    if !known_kind(h[6]) {
        return Err(ProtoError::UnknownKind(h[6]));
    }
    if h[7] != 0 {
        return Err(ProtoError::Flags(h[7]));
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len > max {
        return Err(ProtoError::Oversized { len, max });
    }
    Ok(IpcHeader { kind: h[6], len })
}

fn decode_items(r: &mut R<'_>) -> Result<Vec<IpcItem>, ProtoError> {
    // Smallest item: a 1-byte key (2 + 1) and a part count (4) of one part (20).
    let n = r.count("item count", MAX_ITEMS, 27)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let key = r.key()?;
        let np = r.count("part count", MAX_PARTS, 20)?;
        if np == 0 {
            return Err(bad("part count", 0));
        }
        let mut parts = Vec::with_capacity(np);
        for _ in 0..np {
            let region = r.u32("region")?;
            let offset = r.u64("offset")?;
            let len = r.u64("length")?;
            if offset.checked_add(len).is_none() {
                return Err(bad("span end", -1));
            }
            parts.push(ShmSpan {
                region,
                offset,
                len,
            });
        }
        v.push(IpcItem { key, parts });
    }
    Ok(v)
}

/// Decodes a request body of `kind`.
pub fn decode_request(kind: u8, body: &[u8]) -> Result<IpcRequest, ProtoError> {
    let mut r = R { buf: body };
    let req = match kind {
        1 => IpcRequest::Hello {
            token: r.bytes("token", MAX_TOKEN)?.to_vec(),
        },
        2 => IpcRequest::Map {
            size: r.u64("size")?,
        },
        3 => IpcRequest::Unmap {
            region: r.u32("region")?,
        },
        4 => {
            let replicas = r.u8("replicas")?;
            if replicas == 0 || replicas as usize > crate::proto::MAX_REPLICAS {
                return Err(bad("replicas", replicas));
            }
            let pin = match r.u8("pin")? {
                0 => Pin::None,
                1 => Pin::Soft,
                2 => Pin::Hard,
                v => return Err(bad("pin", v)),
            };
            let preferred = r.string("preferred", MAX_ENDPOINT)?;
            IpcRequest::Put {
                replicas,
                pin,
                preferred,
                items: decode_items(&mut r)?,
            }
        }
        5 => IpcRequest::Get {
            items: decode_items(&mut r)?,
        },
        6 => IpcRequest::Exist { keys: r.keys()? },
        7 => IpcRequest::Size { keys: r.keys()? },
        8 => IpcRequest::Remove {
            force: r.bool("force")?,
            keys: r.keys()?,
        },
        9 => IpcRequest::RemoveAll {
            force: r.bool("force")?,
        },
        10 => IpcRequest::Ping,
        11 => IpcRequest::Endpoint,
        12 => IpcRequest::RemoveMatching {
            force: r.bool("force")?,
            pattern: r.string("pattern", MAX_KEY_LEN)?,
        },
        k => return Err(ProtoError::UnknownKind(k)),
    };
    r.finish(req)
}

/// Decodes a response body of `kind`.
pub fn decode_response(kind: u8, body: &[u8]) -> Result<IpcResponse, ProtoError> {
    let mut r = R { buf: body };
    let resp = match kind {
        0x81 => {
            let n = r.count("code count", MAX_ITEMS, 8)?;
            let v = (0..n)
                .map(|_| r.u64("code").map(|c| c as i64))
                .collect::<Result<Vec<_>, _>>()?;
            IpcResponse::Codes(v)
        }
        0x82 => IpcResponse::Text(r.string("text", MAX_ENDPOINT)?),
        0x8f => {
            let v = r.i32("code")?;
            let code = Code::from_i32(v).ok_or_else(|| bad("code", v))?;
            IpcResponse::Error {
                code,
                message: r.string("message", MAX_MESSAGE)?,
            }
        }
        k => return Err(ProtoError::UnknownKind(k)),
    };
    r.finish(resp)
}

/// Splits a whole frame (header + body, nothing more).
pub fn split_frame(buf: &[u8], max: u32) -> Result<(IpcHeader, &[u8]), ProtoError> {
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

/// One valid frame of every kind (tests, fuzzing seeds).
pub fn sample_frames() -> Vec<Vec<u8>> {
    let item = IpcItem {
        key: b"h_0_k".to_vec(),
        parts: vec![ShmSpan {
            region: 1,
            offset: 4096,
            len: 4096,
        }],
    };
    let reqs = [
        IpcRequest::Hello {
            token: b"t".to_vec(),
        },
        IpcRequest::Map { size: 1 << 20 },
        IpcRequest::Unmap { region: 1 },
        IpcRequest::Put {
            replicas: 1,
            pin: Pin::Soft,
            preferred: String::new(),
            items: vec![item.clone()],
        },
        IpcRequest::Get { items: vec![item] },
        IpcRequest::Exist {
            keys: vec![b"a".to_vec()],
        },
        IpcRequest::Size {
            keys: vec![b"a".to_vec()],
        },
        IpcRequest::Remove {
            force: true,
            keys: vec![b"a".to_vec()],
        },
        IpcRequest::RemoveAll { force: false },
        IpcRequest::RemoveMatching {
            force: true,
            pattern: "^a.*".into(),
        },
        IpcRequest::Ping,
        IpcRequest::Endpoint,
    ];
    let resps = [
        IpcResponse::Codes(vec![0, 4096, -704]),
        IpcResponse::Text("127.0.0.1:7000".into()),
        IpcResponse::Error {
            code: Code::Unauthorized,
            message: "no".into(),
        },
    ];
    let mut out = Vec::new();
    for r in &reqs {
        let mut b = Vec::new();
        r.encode(&mut b);
        out.push(b);
    }
    for r in &resps {
        let mut b = Vec::new();
        r.encode(&mut b);
        out.push(b);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_round_trips() {
        for f in sample_frames() {
            let (h, body) = split_frame(&f, MAX_FRAME).expect("frame");
            let again = match decode_request(h.kind, body) {
                Ok(r) => {
                    let mut b = Vec::new();
                    r.encode(&mut b);
                    b
                }
                Err(_) => {
                    let r = decode_response(h.kind, body).expect("response");
                    let mut b = Vec::new();
                    r.encode(&mut b);
                    b
                }
            };
            assert_eq!(again, f);
        }
    }

    #[test]
    fn hostile_counts_and_spans_are_refused_before_allocation() {
        // A put announcing 65536 items in a 10-byte body.
        let mut body = vec![1u8, 0, 0, 0];
        body.extend_from_slice(&(1u32 << 16).to_le_bytes());
        assert!(decode_request(4, &body).is_err());
        // A span whose end wraps.
        let mut f = Vec::new();
        IpcRequest::Get {
            items: vec![IpcItem {
                key: b"k".to_vec(),
                parts: vec![ShmSpan {
                    region: 0,
                    offset: u64::MAX,
                    len: 2,
                }],
            }],
        }
        .encode(&mut f);
        let (h, body) = split_frame(&f, MAX_FRAME).unwrap();
        assert!(decode_request(h.kind, body).is_err());
        // Oversized header, unknown kind, flags.
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6] = 4;
        h[8..12].copy_from_slice(&(MAX_HELLO_FRAME + 1).to_le_bytes());
        assert!(matches!(
            decode_header(&h, MAX_HELLO_FRAME),
            Err(ProtoError::Oversized { .. })
        ));
        h[6] = 0x40;
        assert!(decode_header(&h, MAX_FRAME).is_err());
        h[6] = 4;
        h[7] = 1;
        assert!(decode_header(&h, MAX_FRAME).is_err());
    }
}
