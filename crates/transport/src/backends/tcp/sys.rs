//! The TCP backend's system calls: socket I/O through raw pointers, for registered
//! memory, and the socket options std does not expose (TCP keepalive timing).
//!
//! A peer, a NIC or another engine's thread may write registered memory at any moment,
//! so the engine never forms a `&[u8]` or `&mut [u8]` over it: such a reference tells the
//! compiler that nobody else writes the bytes while it lives, which would be a promise the
//! engine cannot keep. The TCP backend moves payload with these functions instead, which
//! hand the kernel `(pointer, length)` pairs (`read(2)`, `recv(2)`, `sendmsg(2)`). Besides
//! the verbs backend, this is the crate's only module that calls into libc.
//! `setsockopt` is plain: it borrows a descriptor the caller owns.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// One `(pointer, length)` entry of a gather list. Building one reads nothing; the
/// pointer must be valid for reads when the list is passed to [`write_all`].
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct IoVec(libc::iovec);

impl IoVec {
    /// A gather entry over our own bytes (headers, acks).
    pub(crate) fn from_slice(b: &[u8]) -> IoVec {
        IoVec::raw(b.as_ptr(), b.len())
    }

    /// A gather entry over `len` bytes at `ptr` (registered memory).
    pub(crate) fn raw(ptr: *const u8, len: usize) -> IoVec {
        IoVec(libc::iovec {
            iov_base: ptr.cast_mut().cast(),
            iov_len: len,
        })
    }
}

/// One `read(2)` of at most `len` bytes into `ptr`; `Ok(0)` is end of stream. Retries on
/// `EINTR`; a socket read timeout surfaces as `WouldBlock`.
///
/// # Safety
/// `[ptr, ptr+len)` must be valid for writes, and stay so for the duration of the call.
pub(crate) unsafe fn read(fd: &impl AsRawFd, ptr: *mut u8, len: usize) -> io::Result<usize> {
    loop {
        // SAFETY: the caller guarantees `[ptr, ptr+len)` is writable for this call; the
        // kernel writes at most `len` bytes there.
        let n = unsafe { libc::read(fd.as_raw_fd(), ptr.cast(), len) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One `recv(2)` of at most `len` bytes into `ptr` that does not wait (`MSG_DONTWAIT`):
/// `Err(WouldBlock)` when nothing is queued, `Ok(0)` at end of stream.
///
/// # Safety
/// As for [`read`].
pub(crate) unsafe fn recv_now(fd: &impl AsRawFd, ptr: *mut u8, len: usize) -> io::Result<usize> {
    loop {
        // SAFETY: as in `read`: the kernel writes at most `len` bytes at `ptr`.
        let n = unsafe { libc::recv(fd.as_raw_fd(), ptr.cast(), len, libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Waits until `fd` has bytes to read (or end of stream, or an error), at most `timeout`;
/// `Ok(false)` when the time ran out.
pub(crate) fn wait_readable(fd: &impl AsRawFd, timeout: Duration) -> io::Result<bool> {
    wait_for(fd, libc::POLLIN, timeout)
}

/// Whether `fd` turns readable within `spin`, asking without sleeping: a short busy wait
/// before a blocking one, for a reply due in microseconds (see the callers).
///
/// Each round yields the CPU to any thread waiting for it: the thread that will write the
/// reply (the peer's responder, or our caller after our reply) may be queued on this same
/// CPU, and spinning past it would serialize both sides' spins. On a host with one free
/// CPU a 4 KiB `transfer_sync_write` took 124.5 us (2 x 50 us of spinning plus the call)
/// with a plain spin, 21 us with the yield; with two free CPUs both read 16-20 us.
pub(crate) fn spin_readable(fd: &impl AsRawFd, spin: Duration) -> io::Result<bool> {
    let until = std::time::Instant::now() + spin;
    loop {
        if wait_for(fd, libc::POLLIN, Duration::ZERO)? {
            return Ok(true);
        }
        if std::time::Instant::now() >= until {
            return Ok(false);
        }
        std::thread::yield_now();
    }
}

/// Waits until `fd`'s send buffer has room (or an error), at most `timeout`; `Ok(false)`
/// when the time ran out.
fn wait_writable(fd: &impl AsRawFd, timeout: Duration) -> io::Result<bool> {
    wait_for(fd, libc::POLLOUT, timeout)
}

fn wait_for(fd: &impl AsRawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    // Round up, so a wait never ends early and spins.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    loop {
        // SAFETY: `p` is one valid `pollfd` that lives across the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One `sendmsg(2)` of the gather list `iov` (at most `UIO_MAXIOV` entries of it); how many
/// bytes the kernel took. `MSG_NOSIGNAL`: a peer that reset the stream is `EPIPE`, not a
/// `SIGPIPE` that kills a host application which never ignored it (a C program using the
/// C ABI). `now`: `MSG_DONTWAIT`, so a full send buffer is `Err(WouldBlock)` at once
/// instead of a wait. Retries on `EINTR`.
///
/// # Safety
/// Every entry must point at bytes valid for reads for the duration of the call.
unsafe fn send_iov(fd: &impl AsRawFd, iov: &[IoVec], now: bool) -> io::Result<usize> {
    let cnt = iov.len().min(libc::UIO_MAXIOV as usize);
    // SAFETY: an all-zero `msghdr` is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr().cast_mut().cast();
    msg.msg_iovlen = cnt as _;
    let flags = libc::MSG_NOSIGNAL | if now { libc::MSG_DONTWAIT } else { 0 };
    loop {
        // SAFETY: `IoVec` is `repr(transparent)` over `libc::iovec`, `msg` names `cnt`
        // entries that exist, and the caller guarantees each one is readable; the kernel
        // only reads them.
        let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Drops the first `n` bytes of `iov`: the entries written in full, then the front of the
/// first one left. Returns what is left.
pub(crate) fn advance(mut iov: &mut [IoVec], mut n: usize) -> &mut [IoVec] {
    while let Some(first) = iov.first_mut() {
        if n < first.0.iov_len {
            // SAFETY: `n < iov_len`, so the advanced pointer stays inside the entry.
            first.0.iov_base = unsafe { first.0.iov_base.cast::<u8>().add(n) }.cast();
            first.0.iov_len -= n;
            break;
        }
        n -= first.0.iov_len;
        iov = &mut iov[1..];
    }
    iov
}

/// Bytes in `iov`.
pub(crate) fn iov_len(iov: &[IoVec]) -> usize {
    iov.iter().map(|v| v.0.iov_len).sum()
}

/// Writes every byte of `iov` (`sendmsg(2)`, see [`send_iov`]), advancing over partial
/// writes. A socket write timeout surfaces as `WouldBlock`.
///
/// # Safety
/// Every entry must point at bytes valid for reads for the duration of the call.
pub(crate) unsafe fn write_all(fd: &impl AsRawFd, mut iov: &mut [IoVec]) -> io::Result<()> {
    while !iov.is_empty() {
        // SAFETY: forwarded from the caller.
        let n = unsafe { send_iov(fd, iov, false) }?;
        if n == 0 && iov_len(iov) > 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        iov = advance(iov, n);
    }
    Ok(())
}

/// Writes every byte of `iov` by `until`: non-blocking `sendmsg(2)`s, and between them
/// waits for room in the send buffer of at most `idle` and never past `until`. Stops
/// with `TimedOut` once `until` passed with bytes left (the caller's deadline), or with
/// `WouldBlock` when the peer took no byte for `idle` (the I/O timeout). Either way part
/// of `iov` may have been sent.
///
/// # Safety
/// As for [`write_all`].
pub(crate) unsafe fn write_all_by(
    fd: &impl AsRawFd,
    mut iov: &mut [IoVec],
    until: Instant,
    idle: Duration,
) -> io::Result<()> {
    while !iov.is_empty() {
        // SAFETY: forwarded from the caller.
        match unsafe { send_iov(fd, iov, true) } {
            Ok(0) if iov_len(iov) > 0 => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => iov = advance(iov, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= until {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                if !wait_writable(fd, idle.min(until - now))? {
                    return Err(if Instant::now() >= until {
                        io::ErrorKind::TimedOut
                    } else {
                        io::ErrorKind::WouldBlock
                    }
                    .into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// As much of `iov` as the socket's send buffer takes now, without waiting: the bytes
/// sent (possibly fewer than all, or `Err(WouldBlock)` for none).
///
/// # Safety
/// As for [`write_all`].
pub(crate) unsafe fn write_now(fd: &impl AsRawFd, iov: &[IoVec]) -> io::Result<usize> {
    // SAFETY: forwarded from the caller.
    unsafe { send_iov(fd, iov, true) }
}

/// An epoll instance watching at most one socket for input: a stream's receiver thread
/// waits in it, and a thread that reads the stream itself meanwhile takes the socket out
/// ([`Epoll::remove`]) so the receiver is not woken by what it reads, then puts it back
/// (level-triggered: bytes left unread wake the receiver at once).
#[derive(Debug)]
pub(crate) struct Epoll(std::os::fd::OwnedFd);

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: no pointers; a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(Epoll(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    fn ctl(&self, op: libc::c_int, fd: &impl AsRawFd) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 0,
        };
        // SAFETY: both descriptors are open (borrowed from live owners); `ev` is a valid
        // event that outlives the call (the kernel copies it, and ignores it for DEL).
        let r = unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd.as_raw_fd(), &mut ev) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Watches `fd` for input.
    pub(crate) fn add(&self, fd: &impl AsRawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd)
    }

    /// Stops watching `fd`.
    pub(crate) fn remove(&self, fd: &impl AsRawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd)
    }

    /// Waits until a watched socket is readable (or at its end, or failed), at most
    /// `timeout`; `Ok(false)` when the time ran out or a signal interrupted the wait.
    pub(crate) fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // Round up, so a wait never ends early and spins.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: room for one event at `ev`, which lives across the call.
        let n = unsafe { libc::epoll_wait(self.0.as_raw_fd(), &mut ev, 1, ms) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn gather_write_and_raw_reads() {
        let (a, mut b) = pair();
        let big: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let mut iov = [
            IoVec::from_slice(b"head"),
            IoVec::raw(big.as_ptr(), big.len()),
            IoVec::from_slice(b""),
            IoVec::from_slice(b"tail"),
        ];
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            b.read_to_end(&mut all).unwrap();
            all
        });
        // SAFETY: every entry points at live bytes owned by this test.
        unsafe { write_all(&a, &mut iov) }.unwrap();
        drop(a);
        let all = reader.join().unwrap();
        assert_eq!(&all[..4], b"head");
        assert_eq!(&all[4..4 + big.len()], &big[..]);
        assert_eq!(&all[4 + big.len()..], b"tail");

        let (mut c, d) = pair();
        assert!(!wait_readable(&d, Duration::from_millis(1)).unwrap());
        let mut buf = [0u8; 8];
        // SAFETY: `buf` is ours and writable.
        let e = unsafe { recv_now(&d, buf.as_mut_ptr(), 8) }.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        c.write_all(b"abc").unwrap();
        assert!(wait_readable(&d, Duration::from_secs(5)).unwrap());
        // SAFETY: as above.
        assert_eq!(unsafe { read(&d, buf.as_mut_ptr(), 8) }.unwrap(), 3);
        assert_eq!(&buf[..3], b"abc");
        drop(c);
        // SAFETY: as above.
        assert_eq!(unsafe { recv_now(&d, buf.as_mut_ptr(), 8) }.unwrap(), 0);
    }

    /// A peer that reads nothing: the write ends at `until` (`TimedOut`) when that comes
    /// first, at `idle` without progress (`WouldBlock`) otherwise, never later.
    #[test]
    fn write_all_by_stops_at_the_deadline_or_the_idle_timeout() {
        let (a, _b) = pair();
        let big = vec![7u8; 64 << 20];
        for (until, idle, kind) in [
            (200, 5_000, io::ErrorKind::TimedOut),
            (5_000, 200, io::ErrorKind::WouldBlock),
        ] {
            let mut iov = [IoVec::raw(big.as_ptr(), big.len())];
            let t0 = Instant::now();
            let until = t0 + Duration::from_millis(until);
            // SAFETY: the entry points at live bytes owned by this test.
            let e = unsafe { write_all_by(&a, &mut iov, until, Duration::from_millis(idle)) }
                .unwrap_err();
            assert_eq!(e.kind(), kind);
            let took = t0.elapsed();
            assert!(
                took >= Duration::from_millis(200) && took < Duration::from_millis(1500),
                "{took:?}"
            );
        }
    }

    #[test]
    fn write_now_takes_what_fits_and_advance_resumes() {
        let (a, mut b) = pair();
        // More than any socket buffer takes at once: the first call is short.
        let big: Vec<u8> = (0..16_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut iov = [
            IoVec::from_slice(b"hdr"),
            IoVec::raw(big.as_ptr(), big.len()),
            IoVec::from_slice(b"end"),
        ];
        let total = iov_len(&iov);
        // SAFETY: every entry points at live bytes owned by this test.
        let first = unsafe { write_now(&a, &iov) }.unwrap();
        assert!(0 < first && first < total, "{first} of {total}");
        // Nobody reads: a second try returns at once, with little or nothing taken.
        let mut left = advance(&mut iov, first);
        assert_eq!(iov_len(left), total - first);
        // SAFETY: as above.
        match unsafe { write_now(&a, left) } {
            Ok(n) => {
                assert!(n < iov_len(left));
                left = advance(left, n);
            }
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
        }
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            b.read_to_end(&mut all).unwrap();
            all
        });
        // SAFETY: as above.
        unsafe { write_all(&a, left) }.unwrap();
        drop(a);
        let all = reader.join().unwrap();
        assert_eq!(all.len(), total);
        assert_eq!(&all[..3], b"hdr");
        assert!(all[3..3 + big.len()] == big[..]);
        assert_eq!(&all[3 + big.len()..], b"end");
    }

    #[test]
    fn epoll_wakes_on_input_only_while_watching() {
        let (mut a, b) = pair();
        let ep = Epoll::new().unwrap();
        ep.add(&b).unwrap();
        assert!(!ep.wait(Duration::from_millis(1)).unwrap());
        a.write_all(b"x").unwrap();
        assert!(ep.wait(Duration::from_secs(5)).unwrap());
        // Taken out: the unread byte wakes nobody; put back, it does at once.
        ep.remove(&b).unwrap();
        assert!(!ep.wait(Duration::from_millis(20)).unwrap());
        ep.add(&b).unwrap();
        assert!(ep.wait(Duration::from_millis(0)).unwrap());
        drop(b);
    }

    #[test]
    fn a_reset_stream_is_an_error_not_a_signal() {
        let (a, b) = pair();
        drop(b);
        let buf = [7u8; 1 << 16];
        let iov = [IoVec::from_slice(&buf)];
        // The first send may still be taken; a later one sees the reset. (Rust's runtime
        // ignores SIGPIPE in this process, so only the error is checked here, not that
        // MSG_NOSIGNAL spares a host application that left SIGPIPE at its default.)
        let mut failed = None;
        for _ in 0..100 {
            // SAFETY: `buf` is ours.
            if let Err(e) = unsafe { write_all(&a, &mut iov.clone()) } {
                failed = Some(e);
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let e = failed.expect("writes to a closed peer fail");
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
            ),
            "{e}"
        );
    }
}

// ------------------------------------------------------------------ socket options

/// Turns TCP keepalive on for `s`: the first probe after `idle` without traffic, then
/// two more `idle / 3` apart (at least 1 s each). A peer whose host died or whose network
/// went away without a FIN or RST then fails the socket after about twice `idle`, and a
/// read waiting on it returns an error instead of blocking forever.
pub(crate) fn set_keepalive(s: &TcpStream, idle: Duration) -> io::Result<()> {
    let idle = i32::try_from(idle.as_secs()).unwrap_or(i32::MAX).max(1);
    let fd = s.as_raw_fd();
    set(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle)?;
    set(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        (idle / 3).max(1),
    )?;
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)
}

fn set(fd: i32, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `fd` is an open socket borrowed from a live `TcpStream`; `value` is a
    // c_int that outlives the call, and the length passed is its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const value).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod keepalive_tests {
    use super::*;
    use std::net::TcpListener;

    fn get(s: &TcpStream, level: i32, name: i32) -> i32 {
        let mut v: i32 = 0;
        let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
        // SAFETY: an open socket, and an int-sized buffer with its length.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                level,
                name,
                (&raw mut v).cast(),
                &raw mut len,
            )
        };
        assert_eq!(r, 0);
        v
    }

    #[test]
    fn keepalive_timing_is_set() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        set_keepalive(&s, Duration::from_secs(10)).unwrap();
        assert_eq!(get(&s, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 10);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 3);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
        set_keepalive(&s, Duration::from_millis(200)).unwrap();
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 1);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 1);
    }
}
