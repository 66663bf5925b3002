//! Framed reads and writes on a TCP stream, each bounded by one deadline.
//!
//! A read waits for the first byte of a frame until `idle` (a client may be quiet between
//! requests) and must then complete the whole frame by `frame` (a peer that trickles
//! bytes cannot hold a thread longer than that). Socket timeouts are recomputed from the
//! deadline before every `read`/`write`, so the deadline holds however the bytes arrive.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::proto::{self, HEADER_LEN, Header, ProtoError};

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The peer closed the connection before the first byte of a frame.
    Closed,
    /// A deadline passed.
    Timeout,
    /// The socket failed (or closed inside a frame).
    Io(io::Error),
    /// The bytes are not a frame of this protocol.
    Proto(ProtoError),
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    // A zero timeout means "block forever" to the socket API: treat it as expired.
    (d >= Duration::from_millis(1)).then_some(d)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fills `buf` by `deadline`.
fn read_exact_by(
    s: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> Result<(), ReadError> {
    while !buf.is_empty() {
        let Some(t) = remaining(deadline) else {
            return Err(ReadError::Timeout);
        };
        s.set_read_timeout(Some(t)).map_err(ReadError::Io)?;
        match s.read(buf) {
            Ok(0) => {
                return Err(ReadError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed inside a frame",
                )));
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(ReadError::Timeout),
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
}

/// Reads one frame into `body` (replacing its contents): the first byte by `idle`, the
/// rest by `min(first byte + frame_time, hard)`. The header is checked against `max`
/// before the body is read.
pub(crate) fn read_frame(
    s: &mut TcpStream,
    max: u32,
    idle: Instant,
    frame_time: Duration,
    hard: Instant,
    body: &mut Vec<u8>,
) -> Result<Header, ReadError> {
    let mut h = [0u8; HEADER_LEN];
    // The first byte: quiet time is allowed up to `idle`.
    loop {
        let Some(t) = remaining(idle) else {
            return Err(ReadError::Timeout);
        };
        s.set_read_timeout(Some(t)).map_err(ReadError::Io)?;
        match s.read(&mut h[..1]) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(ReadError::Timeout),
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    let deadline = (Instant::now() + frame_time).min(hard);
    read_exact_by(s, &mut h[1..], deadline)?;
    let header = proto::decode_header(&h, max).map_err(ReadError::Proto)?;
    body.clear();
    body.resize(header.len as usize, 0);
    read_exact_by(s, body, deadline)?;
    Ok(header)
}

/// Writes all of `buf` by `deadline`.
pub(crate) fn write_all_by(s: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        let Some(t) = remaining(deadline) else {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "write deadline passed",
            ));
        };
        s.set_write_timeout(Some(t))?;
        match s.write(buf) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "connection closed",
                ));
            }
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "write deadline passed",
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Compares two secrets in time that depends only on their lengths.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn a_trickling_peer_is_cut_off_at_the_frame_deadline() {
        let (mut a, mut b) = pair();
        let t = std::thread::spawn(move || {
            // One byte every 50 ms: each read makes progress, the frame never completes.
            for _ in 0..40 {
                if a.write_all(b"P").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(60);
        let r = read_frame(
            &mut b,
            1024,
            far,
            Duration::from_millis(300),
            far,
            &mut Vec::new(),
        );
        assert!(matches!(r, Err(ReadError::Timeout)), "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        drop(b);
        t.join().unwrap();
    }

    #[test]
    fn frames_round_trip_and_bad_headers_stop_before_the_body() {
        let (mut a, mut b) = pair();
        let mut buf = Vec::new();
        proto::Request::Stats.encode(5, &mut buf);
        let far = Instant::now() + Duration::from_secs(5);
        write_all_by(&mut a, &buf, far).unwrap();
        let mut body = Vec::new();
        let h = read_frame(&mut b, 1024, far, Duration::from_secs(1), far, &mut body).unwrap();
        assert_eq!((h.kind, h.req_id, h.len), (11, 5, 0));
        write_all_by(&mut a, b"GET / HTTP/1.1\r\n\r\n", far).unwrap();
        let r = read_frame(&mut b, 1024, far, Duration::from_secs(1), far, &mut body);
        assert!(
            matches!(r, Err(ReadError::Proto(ProtoError::BadMagic(_)))),
            "{r:?}"
        );
        drop(a);
        let r = read_frame(&mut b, 1024, far, Duration::from_secs(1), far, &mut body);
        assert!(
            matches!(r, Err(ReadError::Closed | ReadError::Io(_))),
            "{r:?}"
        );
        assert!(ct_eq(b"abc", b"abc") && !ct_eq(b"abc", b"abd") && !ct_eq(b"a", b"ab"));
    }
}
