//! The crate's only FFI: shared memory (sealed memfds) and Unix-socket calls the standard
//! library lacks (`SCM_RIGHTS`, `SO_PEERCRED`), for the standalone client and its dummies.
//!
//! A mapping is written by another process at any time: no Rust reference to its bytes is
//! ever formed; bytes move with raw-pointer copies after a bounds check against the mapping.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// A `MAP_SHARED` mapping of a memfd, unmapped on drop.
#[derive(Debug)]
pub(crate) struct SharedMem {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; it is only accessed through
// raw-pointer copies (never references), so sharing the pointer between threads is sound.
unsafe impl Send for SharedMem {}
// SAFETY: as above.
unsafe impl Sync for SharedMem {}

/// Why a received file descriptor was not mapped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MapRefusal {
    /// Not a sealable shared-memory file, or not sealed against shrinking.
    #[error("the descriptor is not a memfd sealed against shrinking (seals {0:#x})")]
    NotSealed(i32),
    /// The size announced differs from the file's, or is out of range.
    #[error("size {announced} announced, the file has {actual} (cap {max})")]
    Size {
        /// What the frame said.
        announced: u64,
        /// What `fstat` says.
        actual: u64,
        /// The cap.
        max: u64,
    },
    /// An OS call failed.
    #[error("{0}")]
    Os(#[from] io::Error),
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn map(fd: &OwnedFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of a file we hold; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

impl SharedMem {
    /// A new memfd of `len` bytes (zero-filled by the kernel, pages allocated when first
    /// touched), sealed so that its size never changes, and mapped.
    pub fn create(len: usize) -> io::Result<SharedMem> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "size 0"));
        }
        let name = c"pagewire-shm";
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let fd = cvt(unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        })?;
        // SAFETY: `fd` was just returned open and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscalls on our descriptor.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) })?;
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) })?;
        let ptr = map(&fd, len)?;
        Ok(SharedMem { fd, ptr, len })
    }

    /// Maps a memfd another process sent, after checking that it is sealed against
    /// shrinking (so the mapping can never lose pages under a transfer, which would kill
    /// this process with SIGBUS) and that its size is `announced`, at most `max`.
    pub fn map_received(fd: OwnedFd, announced: u64, max: u64) -> Result<SharedMem, MapRefusal> {
        // SAFETY: plain syscall on a descriptor we own; fails for files without seals.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(MapRefusal::NotSealed(seals));
        }
        // SAFETY: `st` is written by fstat before it is read.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: valid descriptor and out-pointer.
        cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
        let actual = st.st_size as u64;
        let is_file = st.st_mode & libc::S_IFMT == libc::S_IFREG;
        if !is_file || announced == 0 || announced != actual || announced > max {
            return Err(MapRefusal::Size {
                announced,
                actual,
                max,
            });
        }
        let len = usize::try_from(announced).map_err(|_| MapRefusal::Size {
            announced,
            actual,
            max,
        })?;
        let ptr = map(&fd, len)?;
        Ok(SharedMem { fd, ptr, len })
    }

    /// Start address in this process.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// The memfd (to send to the real client).
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    fn in_bounds(&self, offset: u64, len: usize) -> bool {
        offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= self.len as u64)
    }

    /// Copies `src` to `offset`; false (nothing copied) when it does not fit.
    pub fn write(&self, offset: u64, src: &[u8]) -> bool {
        if !self.in_bounds(offset, src.len()) {
            return false;
        }
        // SAFETY: `[offset, offset+len)` lies inside the live mapping (checked above);
        // a raw copy, no reference to shared bytes is formed; `src` is ordinary memory
        // that cannot overlap a mapping this value owns exclusively as a pointer.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset as usize), src.len())
        };
        true
    }

    /// Copies from `offset` into `dst`; false (nothing copied) when it does not fit.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> bool {
        if !self.in_bounds(offset, dst.len()) {
            return false;
        }
        // SAFETY: as in `write`, the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        true
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `map` with this length and is unmapped once;
        // users deregister it from their engine before the last owner drops it.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Sends `data` with one descriptor attached (`SCM_RIGHTS`).
pub(crate) fn send_with_fd(sock: &UnixStream, data: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: zeroed msghdr is a valid empty header; fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer has room for one header carrying one int (CMSG_SPACE).
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), raw);
    }
    let mut sent = 0;
    while sent < data.len() {
        // SAFETY: msg points at live buffers; the descriptor rides with the first byte.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
        if sent < data.len() {
            // The rest goes without the descriptor, which has been delivered.
            use std::io::Write;
            let mut s = sock;
            return s.write_all(&data[sent..]);
        }
    }
    Ok(())
}

/// Most descriptors accepted in one `recvmsg`; more make the kernel truncate (and close)
/// the rest, which is reported as an error.
const MAX_FDS: usize = 2;

/// Reads into `buf` (at most its length), collecting descriptors sent along into `fds`
/// (close-on-exec). Returns the bytes read (0 at end of stream).
pub(crate) fn recv_with_fds(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<libc::c_int>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: zeroed msghdr is a valid empty header; fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: msg points at live buffers of the lengths given.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break n as usize;
    };
    // SAFETY: walking the control messages the kernel wrote into `cbuf`, within
    // msg_controllen; each SCM_RIGHTS payload holds whole ints, which are new descriptors
    // owned by this process from here on.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = ((*c).cmsg_len as usize).saturating_sub(data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "too many descriptors in one message",
        ));
    }
    Ok(n)
}

/// The user id of the process at the other end of `sock` (`SO_PEERCRED`).
pub(crate) fn peer_uid(sock: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid socket, out-pointer and length.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred.uid)
}

/// This process's effective user id.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_round_trip_bounds_and_seals() {
        let m = SharedMem::create(8192).unwrap();
        assert!(m.write(4096, b"abcd"));
        assert!(!m.write(8190, b"abcd"));
        assert!(!m.write(u64::MAX, b"a"));
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fd(&a, b"hello", m.fd()).unwrap();
        let mut buf = [0u8; 16];
        let mut fds = Vec::new();
        let n = recv_with_fds(&b, &mut buf, &mut fds).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        let other = SharedMem::map_received(fds.pop().unwrap(), 8192, 1 << 20).unwrap();
        let mut out = [0u8; 4];
        assert!(other.read(4096, &mut out));
        assert_eq!(&out, b"abcd");
        // The size it announces must be the file's.
        let (c, d) = UnixStream::pair().unwrap();
        send_with_fd(&c, b"x", m.fd()).unwrap();
        let mut fds = Vec::new();
        recv_with_fds(&d, &mut buf, &mut fds).unwrap();
        assert!(SharedMem::map_received(fds.pop().unwrap(), 1 << 20, 1 << 30).is_err());
        assert_eq!(peer_uid(&a).unwrap(), own_uid());
    }

    #[test]
    fn unsealed_descriptors_are_refused() {
        // A plain memfd without seals, and a pipe.
        // SAFETY: valid C string; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscall.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        assert!(matches!(
            SharedMem::map_received(fd, 4096, 1 << 20),
            Err(MapRefusal::NotSealed(_))
        ));
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(SharedMem::map_received(OwnedFd::from(a), 4096, 1 << 20).is_err());
    }
}
