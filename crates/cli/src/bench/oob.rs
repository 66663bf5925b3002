//! The benchmark's side channel (perftest's "Data ex. method : Ethernet"): a TCP socket
//! on `-p PORT` for the hello, barriers between sizes, and exchanging results.
//!
//! Frames are `b"PWB1"`, a big-endian u32 length (at most [`MAX_FRAME`]), and a JSON
//! message. Everything read is checked: a wrong magic, an oversized length, bad JSON or
//! an unexpected message is a [`OobError`], never a panic or an unbounded allocation.
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::stats::{BwResult, LatResult};

pub const MAGIC: &[u8; 4] = b"PWB1";
pub const VERSION: u32 = 1;
/// A hello or a result is a few hundred bytes; anything near this is hostile.
pub const MAX_FRAME: u32 = 64 * 1024;

#[derive(Debug)]
pub enum OobError {
    Io(io::Error),
    BadMagic([u8; 4]),
    TooLarge(u32),
    BadMessage(String),
    Unexpected { want: &'static str, got: String },
    Refused(String),
}

impl std::fmt::Display for OobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OobError::Io(e) => write!(f, "side channel: {e}"),
            OobError::BadMagic(m) => write!(
                f,
                "side channel: not a pagewire bench peer (magic {m:02x?})"
            ),
            OobError::TooLarge(n) => {
                write!(f, "side channel: frame of {n} bytes exceeds {MAX_FRAME}")
            }
            OobError::BadMessage(e) => write!(f, "side channel: malformed message: {e}"),
            OobError::Unexpected { want, got } => {
                write!(f, "side channel: expected {want}, got {got}")
            }
            OobError::Refused(r) => write!(f, "peer refused: {r}"),
        }
    }
}

impl std::error::Error for OobError {}

impl From<io::Error> for OobError {
    fn from(e: io::Error) -> Self {
        OobError::Io(e)
    }
}

/// What the server tells the client after a valid hello.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Welcome {
    /// Port of the server engine's control listener (same host as the side channel).
    pub engine_port: u16,
    /// Size of the server's exposed buffer.
    pub buf_len: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum Msg {
    /// The client's test name and its symmetric parameters; the server compares them
    /// with its own and refuses any difference.
    Hello {
        version: u32,
        test: String,
        params: serde_json::Value,
    },
    Welcome(Welcome),
    Refuse {
        reason: String,
    },
    /// Barrier: both sides send it and wait for the other's with the same step.
    Sync {
        step: u64,
    },
    /// One side's measurement of one size (bidirectional: what it initiated).
    Bw {
        result: BwResult,
    },
    Lat {
        result: LatResult,
    },
    /// The receiving side's verdict on the pattern of one size.
    Verified {
        size: u64,
        ok: bool,
        detail: String,
    },
    Bye,
}

/// A peer's bandwidth record: rejected unless every figure is finite and non-negative.
fn checked_bw(r: BwResult) -> Result<BwResult, OobError> {
    let ok = |x: f64| x.is_finite() && x >= 0.0;
    if !(ok(r.avg_bps) && ok(r.msg_rate_mpps) && r.peak_bps.is_none_or(ok)) {
        return Err(OobError::BadMessage(format!("result out of range: {r:?}")));
    }
    Ok(r)
}

/// A peer's latency record: rejected unless every figure is finite and non-negative.
fn checked_lat(r: LatResult) -> Result<LatResult, OobError> {
    let all = [
        r.t_min_us,
        r.t_max_us,
        r.t_typical_us,
        r.t_avg_us,
        r.t_stdev_us,
        r.p99_us,
        r.p999_us,
    ];
    if !all.iter().all(|x| x.is_finite() && *x >= 0.0) {
        return Err(OobError::BadMessage(format!("latency out of range: {r:?}")));
    }
    Ok(r)
}

impl Msg {
    fn name(&self) -> String {
        match self {
            Msg::Hello { .. } => "hello".into(),
            Msg::Welcome(_) => "welcome".into(),
            Msg::Refuse { reason } => format!("refuse ({reason})"),
            Msg::Sync { step } => format!("sync {step}"),
            Msg::Bw { .. } => "bw result".into(),
            Msg::Lat { .. } => "lat result".into(),
            Msg::Verified { .. } => "verified".into(),
            Msg::Bye => "bye".into(),
        }
    }
}

/// Encodes one frame.
pub fn encode(msg: &Msg) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("bench messages always serialize");
    let mut out = Vec::with_capacity(8 + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Reads one frame from any reader, checking magic, length and JSON.
pub fn read_msg(r: &mut impl Read) -> Result<Msg, OobError> {
    let mut head = [0u8; 8];
    r.read_exact(&mut head)?;
    let magic: [u8; 4] = head[..4].try_into().expect("4 bytes");
    if &magic != MAGIC {
        return Err(OobError::BadMagic(magic));
    }
    let len = u32::from_be_bytes(head[4..].try_into().expect("4 bytes"));
    if len > MAX_FRAME {
        return Err(OobError::TooLarge(len));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| OobError::BadMessage(e.to_string()))
}

/// One side-channel connection.
#[derive(Debug)]
pub struct Channel {
    stream: TcpStream,
}

impl Channel {
    pub fn new(stream: TcpStream, timeout: Duration) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Channel { stream })
    }

    pub fn set_timeout(&self, timeout: Duration) -> io::Result<()> {
        self.stream.set_read_timeout(Some(timeout))
    }

    pub fn send(&mut self, msg: &Msg) -> Result<(), OobError> {
        self.stream.write_all(&encode(msg))?;
        Ok(())
    }

    pub fn recv(&mut self) -> Result<Msg, OobError> {
        match read_msg(&mut self.stream)? {
            Msg::Refuse { reason } => Err(OobError::Refused(reason)),
            m => Ok(m),
        }
    }

    /// Both sides call this with the same step; returns when the peer reached it too.
    pub fn barrier(&mut self, step: u64) -> Result<(), OobError> {
        self.send(&Msg::Sync { step })?;
        match self.recv()? {
            Msg::Sync { step: s } if s == step => Ok(()),
            other => Err(OobError::Unexpected {
                want: "sync",
                got: other.name(),
            }),
        }
    }

    pub fn recv_bw(&mut self) -> Result<BwResult, OobError> {
        match self.recv()? {
            Msg::Bw { result } => checked_bw(result),
            other => Err(OobError::Unexpected {
                want: "bw result",
                got: other.name(),
            }),
        }
    }

    pub fn recv_lat(&mut self) -> Result<LatResult, OobError> {
        match self.recv()? {
            Msg::Lat { result } => checked_lat(result),
            other => Err(OobError::Unexpected {
                want: "lat result",
                got: other.name(),
            }),
        }
    }

    pub fn recv_verified(&mut self) -> Result<(bool, String), OobError> {
        match self.recv()? {
            Msg::Verified { ok, detail, .. } => Ok((ok, detail)),
            other => Err(OobError::Unexpected {
                want: "verified",
                got: other.name(),
            }),
        }
    }

    pub fn expect_welcome(&mut self) -> Result<Welcome, OobError> {
        match self.recv()? {
            Msg::Welcome(w) => Ok(w),
            other => Err(OobError::Unexpected {
                want: "welcome",
                got: other.name(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let m = Msg::Hello {
            version: VERSION,
            test: "write".into(),
            params: serde_json::json!({"sizes": [65536], "iters": 5000}),
        };
        let bytes = encode(&m);
        assert_eq!(&bytes[..4], MAGIC);
        assert_eq!(read_msg(&mut &bytes[..]).unwrap(), m);
    }

    #[test]
    fn hostile_frames_are_typed_errors() {
        let http = b"GET / HTTP/1.1\r\n\r\n".to_vec();
        assert!(matches!(
            read_msg(&mut &http[..]),
            Err(OobError::BadMagic(_))
        ));
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            read_msg(&mut &huge[..]),
            Err(OobError::TooLarge(_))
        ));
        let mut junk = MAGIC.to_vec();
        junk.extend_from_slice(&3u32.to_be_bytes());
        junk.extend_from_slice(b"{x}");
        assert!(matches!(
            read_msg(&mut &junk[..]),
            Err(OobError::BadMessage(_))
        ));
        let mut short = MAGIC.to_vec();
        short.extend_from_slice(&100u32.to_be_bytes());
        short.extend_from_slice(b"{}");
        assert!(matches!(read_msg(&mut &short[..]), Err(OobError::Io(_))));
        // Unknown fields are refused, not ignored.
        let body = br#"{"msg":"sync","step":1,"evil":true}"#;
        let mut extra = MAGIC.to_vec();
        extra.extend_from_slice(&(body.len() as u32).to_be_bytes());
        extra.extend_from_slice(body);
        assert!(matches!(
            read_msg(&mut &extra[..]),
            Err(OobError::BadMessage(_))
        ));
    }

    #[test]
    fn non_finite_results_are_rejected() {
        let w = BwResult {
            bytes: 1,
            iterations: 1,
            peak_bps: None,
            avg_bps: f64::NAN,
            msg_rate_mpps: 0.0,
        };
        assert!(checked_bw(w).is_err());
    }
}
