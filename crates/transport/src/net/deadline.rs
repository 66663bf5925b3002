//! Socket I/O bounded by one deadline for a whole exchange, not by a timeout per read.
//!
//! A socket timeout bounds each `read`/`write` call only: a peer that sends one byte just
//! before every timeout keeps a `read_exact` going forever. [`Deadlined`] sets the socket
//! timeout to what is left until the deadline before every call, and fails with
//! `ErrorKind::TimedOut` once it has passed, so a handshake (or a stream hello) made of
//! any number of reads and writes ends by its deadline.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// A borrowed stream whose reads and writes all end by `deadline`.
#[derive(Debug)]
pub(crate) struct Deadlined<'a> {
    s: &'a TcpStream,
    deadline: Instant,
}

impl<'a> Deadlined<'a> {
    pub(crate) fn new(s: &'a TcpStream, deadline: Instant) -> Self {
        Deadlined { s, deadline }
    }

    /// The stream itself (for `shutdown`, addresses).
    pub(crate) fn stream(&self) -> &'a TcpStream {
        self.s
    }

    /// Time left, or `TimedOut` once the deadline has passed (a socket timeout of zero
    /// would mean "none").
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            return Err(timed_out());
        }
        Ok(left)
    }
}

fn timed_out() -> io::Error {
    io::Error::new(ErrorKind::TimedOut, "deadline passed")
}

/// A socket timeout shows up as `WouldBlock` (EAGAIN) on Linux: report it as the deadline.
fn map_timeout(e: io::Error) -> io::Error {
    if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
        timed_out()
    } else {
        e
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.s.set_read_timeout(Some(self.left()?))?;
        let mut s = self.s;
        s.read(buf).map_err(map_timeout)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.s.set_write_timeout(Some(self.left()?))?;
        let mut s = self.s;
        s.write(buf).map_err(map_timeout)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `TcpStream::connect_timeout` with what is left until `deadline`.
pub(crate) fn connect_by(addr: &SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(1) {
        return Err(timed_out());
    }
    TcpStream::connect_timeout(addr, left).map_err(map_timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A peer that trickles one byte every 50 ms never trips a 200 ms socket timeout,
    /// but a 300 ms deadline ends the read.
    #[test]
    fn trickle_ends_at_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..40 {
                if s.write_all(&[1]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let t0 = Instant::now();
        let mut buf = [0u8; 100];
        let e = Deadlined::new(&s, t0 + Duration::from_millis(300))
            .read_exact(&mut buf)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        assert!(
            t0.elapsed() < Duration::from_millis(600),
            "{:?}",
            t0.elapsed()
        );
        drop(s);
        t.join().unwrap();
    }

    #[test]
    fn passed_deadline_fails_at_once() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let past = Instant::now() - Duration::from_millis(1);
        let mut d = Deadlined::new(&s, past);
        assert_eq!(d.write(b"x").unwrap_err().kind(), ErrorKind::TimedOut);
        assert_eq!(d.read(&mut [0]).unwrap_err().kind(), ErrorKind::TimedOut);
        let addr = l.local_addr().unwrap();
        assert_eq!(
            connect_by(&addr, past).unwrap_err().kind(),
            ErrorKind::TimedOut
        );
    }
}
