//! Socket options that std does not expose: TCP keepalive timing (the only FFI outside
//! the verbs backend; plain `setsockopt` on a descriptor the caller owns).

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

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
mod tests {
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
