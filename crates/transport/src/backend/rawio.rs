//! Socket I/O through raw pointers, for registered memory.
//!
//! A peer, a NIC or another engine's thread may write registered memory at any moment,
//! so the engine never forms a `&[u8]` or `&mut [u8]` over it: such a reference tells the
//! compiler that nobody else writes the bytes while it lives, which would be a promise the
//! engine cannot keep. The TCP backend moves payload with these functions instead, which
//! hand the kernel `(pointer, length)` pairs (`read(2)`, `recv(2)`, `writev(2)`). Besides
//! the verbs backend, this is the crate's only module that calls into libc.

use std::io;
use std::os::fd::AsRawFd;

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
    use std::io::Read;
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
    }
}
