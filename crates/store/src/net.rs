//! Framed reads and writes on a TCP stream, each bounded by one deadline.
//!
//! A read waits for the first byte of a frame until `idle` (a client may be quiet between
//! requests) and must then complete the whole frame by `frame` (a peer that trickles
//! bytes cannot hold a thread longer than that). Socket timeouts are recomputed from the
//! deadline before every `read`/`write`, so the deadline holds however the bytes arrive.
//! A body's buffer grows as its bytes arrive, so a header alone costs the reader nothing.

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
        let n = read_some_by(s, buf, deadline)?;
        buf = &mut buf[n..];
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
    let (header, deadline) = read_header(s, max, idle, frame_time, hard)?;
    read_body(s, header.len, deadline, body, &mut |_| true)?;
    Ok(header)
}

/// Reads and checks a frame's header: the first byte by `idle`, the rest by `min(first
/// byte + frame_time, hard)`. Returns it with the deadline for the body.
pub(crate) fn read_header(
    s: &mut TcpStream,
    max: u32,
    idle: Instant,
    frame_time: Duration,
    hard: Instant,
) -> Result<(Header, Instant), ReadError> {
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
    Ok((header, deadline))
}

/// Smallest and largest step by which a body grows per read.
const FIRST_CHUNK: usize = 4 << 10;
const MAX_CHUNK: usize = 64 << 10;

/// Reads a body of `len` bytes into `body` (replacing its contents) by `deadline`.
///
/// The buffer grows with the bytes that arrived (one chunk ahead, at most 64 KiB), never
/// to the announced length up front: a header alone must not cost the reader its length
/// in memory. `grant(n)` is asked before the buffer takes `n` more bytes; when it says
/// no, the read stops and returns `Ok(false)` (the body is then incomplete).
pub(crate) fn read_body(
    s: &mut TcpStream,
    len: u32,
    deadline: Instant,
    body: &mut Vec<u8>,
    grant: &mut dyn FnMut(usize) -> bool,
) -> Result<bool, ReadError> {
    let len = len as usize;
    body.clear();
    let mut granted = 0;
    while body.len() < len {
        let have = body.len();
        let step = have.clamp(FIRST_CHUNK, MAX_CHUNK).min(len - have);
        let want = have + step;
        if want > granted {
            if !grant(want - granted) {
                return Ok(false);
            }
            granted = want;
        }
        if want > body.capacity() {
            // Geometric growth (few copies for a large frame), never past `len`.
            let target = want.max(body.capacity() * 2).min(len);
            body.reserve_exact(target - have);
        }
        body.resize(want, 0);
        let r = read_some_by(s, &mut body[have..], deadline);
        match r {
            Ok(n) => body.truncate(have + n),
            Err(e) => {
                body.truncate(have);
                return Err(e);
            }
        }
    }
    Ok(true)
}

/// Reads and drops `n` bytes by `deadline`, in a small buffer.
pub(crate) fn discard(s: &mut TcpStream, mut n: usize, deadline: Instant) -> Result<(), ReadError> {
    let mut sink = [0u8; 4096];
    while n > 0 {
        let k = n.min(sink.len());
        n -= read_some_by(s, &mut sink[..k], deadline)?;
    }
    Ok(())
}

/// One `read` into `buf` (not empty) by `deadline`; the bytes it got (at least one).
fn read_some_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<usize, ReadError> {
    loop {
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
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => return Err(ReadError::Timeout),
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
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

    /// A header announcing 16 MiB followed by a few bytes: the reader buffers one small
    /// chunk, not the announced length, and asks for every byte it buffers.
    #[test]
    fn a_body_grows_with_its_bytes_and_within_its_grants() {
        let (mut a, mut b) = pair();
        let far = Instant::now() + Duration::from_secs(5);
        let mut frame = Vec::new();
        proto::Request::Stats.encode(1, &mut frame);
        frame[12..16].copy_from_slice(&(16u32 << 20).to_le_bytes());
        frame.extend_from_slice(&[7; 10]);
        write_all_by(&mut a, &frame, far).unwrap();
        drop(a);
        let (h, deadline) =
            read_header(&mut b, 16 << 20, far, Duration::from_secs(1), far).unwrap();
        assert_eq!(h.len, 16 << 20);
        let (mut body, mut granted) = (Vec::new(), 0);
        let r = read_body(&mut b, h.len, deadline, &mut body, &mut |n| {
            granted += n;
            true
        });
        assert!(matches!(r, Err(ReadError::Io(_))), "{r:?}");
        // 10 bytes arrived: one chunk ahead of them is all that was granted and zeroed.
        assert!(
            granted <= 10 + FIRST_CHUNK && body.capacity() <= 2 * FIRST_CHUNK,
            "{granted} {}",
            body.capacity()
        );

        // A whole 1 MiB frame arrives intact; a budget of 100 KiB stops it early.
        let (mut a, mut b) = pair();
        let len = 1usize << 20;
        let sent: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let w = {
            let sent = sent.clone();
            std::thread::spawn(move || {
                let far = Instant::now() + Duration::from_secs(5);
                let _ = write_all_by(&mut a, &sent, far);
                let _ = write_all_by(&mut a, &sent, far);
            })
        };
        let (mut body, mut granted) = (Vec::new(), 0);
        let ok = read_body(&mut b, len as u32, far, &mut body, &mut |n| {
            granted += n;
            true
        });
        assert!(matches!(ok, Ok(true)), "{ok:?}");
        assert!(body == sent && granted == len);
        let mut granted = 0;
        let r = read_body(&mut b, len as u32, far, &mut body, &mut |n| {
            granted += n;
            granted <= 100 << 10
        });
        assert!(matches!(r, Ok(false)), "{r:?}");
        assert!(body.len() <= 100 << 10 && body[..] == sent[..body.len()]);
        drop(b);
        w.join().unwrap();
    }

    /// The pre-`Hello` frame cap fits the largest `Hello` the decoder accepts, and a
    /// longer token does not decode.
    #[test]
    fn the_largest_valid_hello_fits_the_hello_cap() {
        let mut hello = proto::Hello {
            token: vec![b't'; proto::MAX_TOKEN],
            client_id: u64::MAX,
            endpoint: "e".repeat(proto::MAX_ENDPOINT),
        };
        let mut buf = Vec::new();
        proto::Request::Hello(hello.clone()).encode(1, &mut buf);
        let (h, body) = proto::split_frame(&buf, proto::MAX_HELLO_FRAME).unwrap();
        assert_eq!(h.len, proto::MAX_HELLO_FRAME);
        assert!(matches!(
            proto::decode_request(h.kind, body),
            Ok(proto::Request::Hello(_))
        ));
        hello.token.push(b't');
        buf.clear();
        proto::Request::Hello(hello).encode(1, &mut buf);
        let r = proto::split_frame(&buf, proto::DEFAULT_MAX_FRAME)
            .and_then(|(h, body)| proto::decode_request(h.kind, body));
        assert!(r.is_err(), "{r:?}");
    }
}
