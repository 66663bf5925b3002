//! The TCP backend's system calls: socket I/O through raw pointers, for registered
//! memory, and the socket options std does not expose (TCP keepalive timing).
//!
//! A peer, a NIC or another engine's thread may write registered memory at any moment,
//! so the engine never forms a `&[u8]` or `&mut [u8]` over it: such a reference tells the
//! compiler that nobody else writes the bytes while it lives, which would be a promise the
//! engine cannot keep. The TCP backend moves payload with these functions instead, which
//! hand the kernel `(pointer, length)` pairs (`read(2)`, `recv(2)`, `writev(2)`). Besides
//! the verbs backend, this is the crate's only module that calls into libc.
//! `setsockopt` is plain: it borrows a descriptor the caller owns.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

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
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
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

/// Writes every byte of `iov` with `writev(2)`, advancing over partial writes. A socket
/// write timeout surfaces as `WouldBlock`.
///
/// # Safety
/// Every entry must point at bytes valid for reads for the duration of the call.
pub(crate) unsafe fn write_all(fd: &impl AsRawFd, mut iov: &mut [IoVec]) -> io::Result<()> {
    while !iov.is_empty() {
        let cnt = iov.len().min(libc::UIO_MAXIOV as usize);
        // SAFETY: `IoVec` is `repr(transparent)` over `libc::iovec`, `cnt` entries exist,
        // and the caller guarantees each one is readable; the kernel only reads them.
        let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr().cast(), cnt as libc::c_int) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let mut n = n as usize;
        // Drop the entries written in full, then shorten the first one left.
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
    }
    Ok(())
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
