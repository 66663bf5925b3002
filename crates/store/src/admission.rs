//! Slots for master connections that have not said `Hello` yet.
//!
//! Honest clients and attackers often share a source address (a host behind NAT, or
//! 127.0.0.1), so a newcomer is never turned away because of its address. It always gets
//! a slot; room is made by closing an older connection that is still silent: the oldest
//! one of the newcomer's own address when that address holds `per_addr` slots, else the
//! oldest one of the busiest address when all `total` slots are taken. An honest client
//! says `Hello` within a round trip of connecting and then gives its slot back, so a flood
//! can only starve it by opening connections faster than that.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};

/// The pre-`Hello` slots of one listener.
#[derive(Debug)]
pub(crate) struct Admission {
    total: usize,
    per_addr: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    held: usize,
    /// Per source address, its slot holders oldest first, each with a clone of its socket
    /// (shutting the clone down wakes the thread reading the original).
    by_addr: HashMap<IpAddr, VecDeque<(u64, Arc<TcpStream>)>>,
}

/// Whose connection was closed to admit a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Evicted {
    /// The oldest of the newcomer's own address (it held its cap).
    SameAddress,
    /// The oldest of the address holding the most slots (all slots were taken).
    Busiest(IpAddr),
}

/// A connection's pre-`Hello` slot; dropping it gives the slot back (nothing happens if
/// the connection was evicted: its slot went to the newcomer already).
#[derive(Debug)]
pub(crate) struct Pending {
    adm: Arc<Admission>,
    addr: IpAddr,
    id: u64,
}

impl Admission {
    /// `total` slots, at most `per_addr` of them for one address (both at least 1).
    pub(crate) fn new(total: usize, per_addr: usize) -> Arc<Admission> {
        let total = total.max(1);
        Arc::new(Admission {
            total,
            per_addr: per_addr.clamp(1, total),
            state: Mutex::new(State::default()),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives a slot to the connection from `addr` whose socket `closer` is a clone of,
    /// closing an older silent connection first when needed (see the module notes).
    pub(crate) fn admit(
        self: &Arc<Self>,
        addr: IpAddr,
        closer: Arc<TcpStream>,
    ) -> (Pending, Option<Evicted>) {
        let mut st = self.state();
        let mine = st.by_addr.get(&addr).map_or(0, VecDeque::len);
        let victim = if mine >= self.per_addr {
            Some((addr, Evicted::SameAddress))
        } else if st.held >= self.total {
            // Ties go to the address whose oldest holder is oldest, so the flood that
            // started first pays first.
            st.by_addr
                .iter()
                .max_by_key(|(_, q)| (q.len(), std::cmp::Reverse(q.front().map_or(0, |e| e.0))))
                .map(|(a, _)| (*a, Evicted::Busiest(*a)))
        } else {
            None
        };
        let mut closed = None;
        let evicted = victim.and_then(|(from, why)| {
            let q = st.by_addr.get_mut(&from)?;
            let (_, s) = q.pop_front()?;
            if q.is_empty() {
                st.by_addr.remove(&from);
            }
            st.held -= 1;
            closed = Some(s);
            Some(why)
        });
        st.next += 1;
        let id = st.next;
        st.by_addr.entry(addr).or_default().push_back((id, closer));
        st.held += 1;
        drop(st);
        if let Some(s) = closed {
            // Both directions: the victim's blocked read returns at once and its thread ends.
            let _ = s.shutdown(Shutdown::Both);
        }
        (
            Pending {
                adm: self.clone(),
                addr,
                id,
            },
            evicted,
        )
    }

    /// Slots held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.state().held
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut st = self.adm.state();
        let Some(q) = st.by_addr.get_mut(&self.addr) else {
            return;
        };
        let Some(i) = q.iter().position(|e| e.0 == self.id) else {
            return;
        };
        q.remove(i);
        if q.is_empty() {
            st.by_addr.remove(&self.addr);
        }
        st.held -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connected pair on loopback: (client end, server end).
    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        (c, s)
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    /// True when the server closed the connection (the client end reads EOF or a reset).
    fn closed(c: &mut TcpStream) -> bool {
        matches!(c.read(&mut [0u8; 1]), Ok(0) | Err(_))
    }

    /// True when the connection is still open (nothing to read before a short timeout).
    fn open(c: &mut TcpStream) -> bool {
        c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let r = c.read(&mut [0u8; 1]);
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        matches!(r, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }

    #[test]
    fn a_full_address_gives_up_its_oldest_slot_to_a_newcomer() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let adm = Admission::new(8, 2);
        let mut c: Vec<_> = (0..3).map(|_| pair(&l)).collect();
        let p0 = adm.admit(ip(1), c[0].1.try_clone().unwrap().into());
        let p1 = adm.admit(ip(1), c[1].1.try_clone().unwrap().into());
        assert_eq!((p0.1, p1.1, adm.held()), (None, None, 2));
        // The third from the same address is admitted; the address's oldest is closed.
        let p2 = adm.admit(ip(1), c[2].1.try_clone().unwrap().into());
        assert_eq!(p2.1, Some(Evicted::SameAddress));
        assert_eq!(adm.held(), 2);
        assert!(closed(&mut c[0].0));
        assert!(open(&mut c[1].0) && open(&mut c[2].0));
        // The evicted connection's slot is gone already: dropping it frees nothing more.
        drop(p0);
        assert_eq!(adm.held(), 2);
        drop((p1, p2));
        assert_eq!(adm.held(), 0);
    }

    #[test]
    fn when_every_slot_is_taken_the_busiest_address_pays() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let adm = Admission::new(4, 3);
        let mut c: Vec<_> = (0..6).map(|_| pair(&l)).collect();
        let addrs = [ip(1), ip(1), ip(1), ip(2)];
        let mut held: Vec<_> = (0..4)
            .map(|i| {
                let (p, e) = adm.admit(addrs[i], c[i].1.try_clone().unwrap().into());
                assert_eq!(e, None);
                p
            })
            .collect();
        // A new address takes the slot of 10.0.0.1's oldest (three slots against one).
        let (p4, e) = adm.admit(ip(3), c[4].1.try_clone().unwrap().into());
        assert_eq!(e, Some(Evicted::Busiest(ip(1))));
        assert_eq!(adm.held(), 4);
        assert!(closed(&mut c[0].0));
        assert!((1..5).all(|i| open(&mut c[i].0)));
        // 10.0.0.1 still holds the most (two against one each), so it pays again, also
        // for a newcomer from 10.0.0.2.
        let (p5, e) = adm.admit(ip(2), c[5].1.try_clone().unwrap().into());
        assert_eq!(e, Some(Evicted::Busiest(ip(1))));
        assert!(closed(&mut c[1].0));
        assert!((2..6).all(|i| open(&mut c[i].0)));
        held.push(p4);
        held.push(p5);
        drop(held);
        assert_eq!(adm.held(), 0);
    }

    #[test]
    fn saying_hello_gives_the_slot_back() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let adm = Admission::new(2, 2);
        let mut c: Vec<_> = (0..3).map(|_| pair(&l)).collect();
        let (p0, _) = adm.admit(ip(1), c[0].1.try_clone().unwrap().into());
        let (_p1, _) = adm.admit(ip(1), c[1].1.try_clone().unwrap().into());
        // c[0] authenticates: its slot is free, so the next newcomer evicts nobody and the
        // authenticated connection stays open.
        drop(p0);
        assert_eq!(adm.held(), 1);
        let (_p2, e) = adm.admit(ip(1), c[2].1.try_clone().unwrap().into());
        assert_eq!(e, None);
        assert_eq!(adm.held(), 2);
        assert!((0..3).all(|i| open(&mut c[i].0)));
    }
}
