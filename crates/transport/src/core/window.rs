//! The per-QP in-flight window of the verbs backend, as data: wr_id encoding, selective
//! signalling groups, and the window's reserve/retire/lend accounting. No FFI, no clock.

use std::collections::VecDeque;

/// What a completion belongs to, encoded in the 64-bit wr_id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrKind {
    /// A data WRITE/READ of a batch.
    Data = 0,
    /// The final WRITE_WITH_IMM of a batch with remote notification.
    Notify = 1,
    /// A pre-posted RECV that absorbs a peer's WRITE_WITH_IMM.
    Recv = 2,
    /// A run of a prepared batch's lane; the sequence field holds the lane's index.
    Lane = 3,
}

const KIND_SHIFT: u32 = 62;
const QP_SHIFT: u32 = 54;
/// Per-QP sequence numbers wrap at 2^54 (never, in practice).
pub(crate) const SEQ_MASK: u64 = (1 << QP_SHIFT) - 1;
/// At most this many QPs per connection (8 bits of wr_id).
pub(crate) const MAX_QPS: usize = 256;

/// `[63:62] kind | [61:54] QP index in the connection | [53:0] per-QP WR sequence number`.
pub(crate) fn encode_wr_id(kind: WrKind, qp: usize, seq: u64) -> u64 {
    debug_assert!(qp < MAX_QPS);
    ((kind as u64) << KIND_SHIFT) | (((qp as u64) & 0xff) << QP_SHIFT) | (seq & SEQ_MASK)
}

/// Inverse of [`encode_wr_id`] (the two kind bits have no spare value).
pub(crate) fn decode_wr_id(id: u64) -> (WrKind, usize, u64) {
    let kind = match id >> KIND_SHIFT {
        0 => WrKind::Data,
        1 => WrKind::Notify,
        2 => WrKind::Recv,
        _ => WrKind::Lane,
    };
    (kind, ((id >> QP_SHIFT) & 0xff) as usize, id & SEQ_MASK)
}

/// Selective signalling: WR `i` of a chain of `len` is signalled every `every` WRs and always
/// at the end of the chain (so every chain's last WR produces a completion that retires it).
pub(crate) fn is_signaled(i: usize, len: usize, every: usize) -> bool {
    i + 1 == len || (i + 1).is_multiple_of(every.max(1))
}

/// One signalled group on a QP's send queue: the WRs up to and including a signalled WR.
/// RC completes a send queue in order, so the signalled WR's completion retires the group.
#[derive(Debug)]
pub(crate) struct Group<T> {
    /// Sequence number of the signalled WR that ends the group.
    pub last_seq: u64,
    /// WRs in the group (the window space it holds).
    pub wrs: u32,
    /// Payload bytes in the group.
    pub bytes: u64,
    pub owner: T,
}

/// The in-flight window of one QP: WRs posted but not yet retired, in send-queue order.
/// Part of it may be lent out for good to prepared lanes (see [`InFlight::lend`]).
#[derive(Debug)]
pub(crate) struct InFlight<T> {
    /// The window less what is lent out.
    cap: u32,
    /// The window as configured.
    full: u32,
    outstanding: u32,
    next_seq: u64,
    groups: VecDeque<Group<T>>,
}

impl<T> InFlight<T> {
    pub fn new(cap: u32) -> Self {
        Self {
            cap: cap.max(1),
            full: cap.max(1),
            outstanding: 0,
            next_seq: 0,
            groups: VecDeque::new(),
        }
    }

    /// The window: most WRs in flight.
    #[cfg(test)]
    pub fn cap(&self) -> u32 {
        self.cap
    }

    /// Free window space in WRs.
    pub fn available(&self) -> u32 {
        self.cap - self.outstanding
    }

    pub fn outstanding(&self) -> u32 {
        self.outstanding
    }

    /// Lends `n` WRs of window space to a prepared lane until [`Self::give_back`]: the
    /// lane's runs then never wait for room or touch this window. At most half the full
    /// window is ever lent, so ordinary batches keep the other half; `false` if `n` does
    /// not fit that or the room free right now.
    pub fn lend(&mut self, n: u32) -> bool {
        let lent = self.full - self.cap;
        if n == 0 || n > self.available() || lent + n > self.full / 2 {
            return false;
        }
        self.cap -= n;
        true
    }

    /// Takes back `n` WRs of space lent by [`Self::lend`].
    pub fn give_back(&mut self, n: u32) {
        self.cap = (self.cap + n).min(self.full);
    }

    /// Reserves `n` sequence numbers (and window space); returns the first.
    /// The caller must then push groups covering exactly those `n` WRs.
    pub fn reserve(&mut self, n: u32) -> u64 {
        assert!(
            n <= self.available(),
            "window overrun: {n} > {}",
            self.available()
        );
        let first = self.next_seq;
        self.next_seq = (self.next_seq + u64::from(n)) & SEQ_MASK;
        self.outstanding += n;
        first
    }

    pub fn push(&mut self, g: Group<T>) {
        self.groups.push_back(g);
    }

    /// A successful completion of WR `seq`: retires every group up to the one it ends.
    /// Stale or unknown sequence numbers retire nothing. The retired groups are appended
    /// to `out` (a buffer the reaper reuses, so retiring allocates nothing); returns how
    /// many there were.
    pub fn retire_through(&mut self, seq: u64, out: &mut Vec<Group<T>>) -> usize {
        // Nearly always the oldest group: one completion per signalled group, in order.
        if self.groups.front().is_some_and(|g| g.last_seq == seq) {
            let g = self.groups.pop_front().expect("checked non-empty");
            self.outstanding -= g.wrs.min(self.outstanding);
            out.push(g);
            return 1;
        }
        let Some(pos) = self.groups.iter().position(|g| g.last_seq == seq) else {
            return 0;
        };
        let before = out.len();
        out.extend(self.groups.drain(..=pos));
        let wrs: u32 = out[before..].iter().map(|g| g.wrs).sum();
        self.outstanding -= wrs.min(self.outstanding);
        out.len() - before
    }

    /// The groups in flight, oldest first.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] // verbs only
    pub fn groups(&self) -> impl Iterator<Item = &Group<T>> {
        self.groups.iter()
    }

    /// The QP failed: everything in flight is lost. Returns all groups.
    pub fn drain_all(&mut self) -> Vec<Group<T>> {
        self.outstanding = 0;
        self.groups.drain(..).collect()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_id_round_trips() {
        for kind in [WrKind::Data, WrKind::Notify, WrKind::Recv, WrKind::Lane] {
            for qp in [0, 1, 255] {
                for seq in [0, 1, SEQ_MASK] {
                    assert_eq!(decode_wr_id(encode_wr_id(kind, qp, seq)), (kind, qp, seq));
                }
            }
        }
    }

    #[test]
    fn lending_keeps_half_the_window_for_batches() {
        let mut t: InFlight<()> = InFlight::new(16);
        assert!(!t.lend(0));
        assert!(!t.lend(9), "more than half");
        assert!(t.lend(5));
        assert_eq!((t.cap(), t.available()), (11, 11));
        t.reserve(10);
        assert!(!t.lend(2), "only 1 free right now");
        assert!(t.lend(1));
        assert_eq!(t.available(), 0);
        assert!(!t.lend(1));
        t.give_back(6);
        assert_eq!((t.cap(), t.available()), (16, 6));
        t.give_back(1);
        assert_eq!(t.cap(), 16, "never above the full window");
    }

    #[test]
    fn signalling_every_n_and_last() {
        let s: Vec<bool> = (0..7).map(|i| is_signaled(i, 7, 3)).collect();
        assert_eq!(s, vec![false, false, true, false, false, true, true]);
        assert!(is_signaled(0, 1, 16));
    }

    #[test]
    fn window_reserve_retire() {
        let mut f: InFlight<u8> = InFlight::new(4);
        let first = f.reserve(3);
        assert_eq!(first, 0);
        f.push(Group {
            last_seq: 1,
            wrs: 2,
            bytes: 20,
            owner: 1,
        });
        f.push(Group {
            last_seq: 2,
            wrs: 1,
            bytes: 10,
            owner: 2,
        });
        assert_eq!(f.available(), 1);
        let mut done = Vec::new();
        assert_eq!(
            f.retire_through(7, &mut done),
            0,
            "unknown seq retires nothing"
        );
        assert_eq!(f.retire_through(2, &mut done), 2);
        assert_eq!(done.len(), 2);
        assert_eq!(f.available(), 4);
        assert!(f.is_empty());
        assert_eq!(f.reserve(4), 3);
        f.push(Group {
            last_seq: 6,
            wrs: 4,
            bytes: 0,
            owner: 3,
        });
        assert_eq!(f.drain_all().len(), 1);
        assert_eq!(f.outstanding(), 0);
    }
}
