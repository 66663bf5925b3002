//! Caps on connections that have not authenticated yet: control handshakes and TCP
//! data-stream hellos.
//!
//! At most `total` such connections are served at a time, and at most `per_ip` from one
//! source address; a connection over the per-address cap is closed at once. When every
//! slot is taken, a newcomer from an address that holds at least two slots fewer than
//! the busiest address takes that address's oldest slot (that connection is closed at
//! once); otherwise the newcomer is closed. So a few addresses holding every slot with
//! slow or silent connections cannot lock other hosts out; only a flood from at least
//! `total / per_ip` addresses with an even share each can, and then only until the
//! handshake deadline cuts its connections.

use std::collections::HashMap;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::{Arc, Mutex};

use crate::util::lock;

/// Most handshakes served at the same time from one source IP, so a single host holding
/// half-open connections cannot starve the others.
pub(crate) const MAX_HANDSHAKES_PER_IP: usize = 16;

/// Most handshakes served at the same time; further connections are dropped at once,
/// unless they take over a slot of a busier address.
pub(crate) const MAX_CONCURRENT_HANDSHAKES: usize = 64;

/// The caps of one listener.
#[derive(Debug)]
pub(crate) struct Admission {
    total: usize,
    per_ip: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    used: usize,
    /// Per source address, its admitted connections oldest first (clones, to close an
    /// evicted one).
    by_ip: HashMap<IpAddr, Vec<(u64, TcpStream)>>,
}

/// One admitted connection's slot, released on drop.
#[derive(Debug)]
pub(crate) struct Ticket {
    adm: Arc<Admission>,
    ip: IpAddr,
    id: u64,
}

impl Admission {
    pub(crate) fn new(total: usize, per_ip: usize) -> Arc<Admission> {
        Arc::new(Admission {
            total,
            per_ip,
            state: Mutex::new(State::default()),
        })
    }

    /// A slot for `s`, or `None`: the caller closes `s` at once.
    pub(crate) fn admit(self: &Arc<Self>, s: &TcpStream) -> Option<Ticket> {
        let ip = s.peer_addr().ok()?.ip();
        let clone = s.try_clone().ok()?;
        let mut st = lock(&self.state);
        let mine = st.by_ip.get(&ip).map_or(0, Vec::len);
        if mine >= self.per_ip {
            return None;
        }
        if st.used >= self.total {
            let (vip, held) = st
                .by_ip
                .iter()
                .map(|(ip, v)| (*ip, v.len()))
                .max_by_key(|&(_, n)| n)?;
            if held < mine + 2 {
                return None;
            }
            let list = st.by_ip.get_mut(&vip).expect("found above");
            let (_, victim) = list.remove(0);
            if list.is_empty() {
                st.by_ip.remove(&vip);
            }
            st.used -= 1;
            tracing::debug!(from = %vip, to = %ip, "connection slot taken over from the busiest address");
            let _ = victim.shutdown(Shutdown::Both);
        }
        st.next += 1;
        let id = st.next;
        st.by_ip.entry(ip).or_default().push((id, clone));
        st.used += 1;
        Some(Ticket {
            adm: self.clone(),
            ip,
            id,
        })
    }

    /// Connections holding a slot now.
    #[cfg(test)]
    fn used(&self) -> usize {
        lock(&self.state).used
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = lock(&self.adm.state);
        let Some(list) = st.by_ip.get_mut(&self.ip) else {
            return; // evicted: its slot was handed over already
        };
        let Some(i) = list.iter().position(|(id, _)| *id == self.id) else {
            return;
        };
        list.remove(i);
        if list.is_empty() {
            st.by_ip.remove(&self.ip);
        }
        st.used -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn caps_per_address_and_in_total() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let adm = Admission::new(3, 2);
        let conns: Vec<_> = (0..3).map(|_| pair(&l)).collect();
        let t1 = adm.admit(&conns[0].1).unwrap();
        let t2 = adm.admit(&conns[1].1).unwrap();
        // One address: the third is over its cap, and evicts nobody.
        assert!(adm.admit(&conns[2].1).is_none());
        assert_eq!(adm.used(), 2);
        drop(t1);
        let t3 = adm.admit(&conns[2].1).unwrap();
        assert_eq!(adm.used(), 2);
        drop((t2, t3));
        assert_eq!(adm.used(), 0);
    }

    /// A connection to `l` from source address `src` (any 127/8 address on loopback).
    fn from(src: [u8; 4], l: &TcpListener) -> (TcpStream, TcpStream) {
        use std::os::fd::FromRawFd;
        let sa = |ip: [u8; 4], port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(ip),
            },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0);
        // SAFETY: `fd` is owned by nobody else; the stream closes it.
        let c = unsafe { TcpStream::from_raw_fd(fd) };
        let (local, remote) = (
            sa(src, 0),
            sa([127, 0, 0, 1], l.local_addr().unwrap().port()),
        );
        // SAFETY: both are valid sockaddr_in of `len` bytes for the calls.
        unsafe {
            assert_eq!(libc::bind(fd, (&raw const local).cast(), len), 0);
            assert_eq!(libc::connect(fd, (&raw const remote).cast(), len), 0);
        }
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn a_newcomer_takes_the_oldest_slot_of_the_busiest_address() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let adm = Admission::new(3, 3);
        let (mut c0, s0) = from([127, 0, 0, 2], &l);
        let (_c1, s1) = from([127, 0, 0, 2], &l);
        let (_c2, s2) = from([127, 0, 0, 3], &l);
        let t0 = adm.admit(&s0).unwrap();
        let _t1 = adm.admit(&s1).unwrap();
        let _t2 = adm.admit(&s2).unwrap();
        // 127.0.0.3 holds 1, the busiest 2: not two more than it would hold.
        let (_c3, s3) = from([127, 0, 0, 3], &l);
        assert!(adm.admit(&s3).is_none());
        // A new address takes 127.0.0.2's oldest slot, which is closed.
        let (_c4, s4) = from([127, 0, 0, 4], &l);
        let t4 = adm.admit(&s4).expect("takes over a slot");
        assert_eq!(adm.used(), 3);
        c0.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        assert!(matches!(c0.read(&mut [0u8; 4]), Ok(0) | Err(_)));
        drop(t0); // evicted: releases nothing more
        assert_eq!(adm.used(), 3);
        // Now every address holds one: a fifth is refused.
        let (_c5, s5) = from([127, 0, 0, 5], &l);
        assert!(adm.admit(&s5).is_none());
        drop(t4);
        assert_eq!(adm.used(), 2);
    }
}
