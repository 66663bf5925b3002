//! Slicing, one rule for every backend: an op longer than the backend's `max_wr_bytes`
//! is cut into pieces of that size ([`pieces`]); TCP sends each piece as one request,
//! loopback copies it as one slice, verbs plans work requests from them ([`plan_wrs`]:
//! scatter-gather merging under the rxe equal-length rule, then round-robin striping over
//! the QPs with [`stripe`]). Several RDMA devices (rails) take a batch's pieces by bytes,
//! weighted by link speed ([`stripe_rails`]). Pure data, unit- and property-tested on the
//! host.

use std::borrow::Borrow;
use std::ops::{Deref, DerefMut};

use smallvec::SmallVec;

/// Direction of a one-sided op, seen from the local side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    /// RDMA WRITE: local -> remote.
    Write,
    /// RDMA READ: remote -> local.
    Read,
}

/// One validated, key-resolved op (local and remote ranges each inside one MR chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlanOp {
    pub dir: Dir,
    pub local: u64,
    pub lkey: u32,
    pub remote: u64,
    pub rkey: u32,
    pub len: u64,
}

/// A local scatter-gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// One work request: a contiguous remote range and one or more local pieces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PlannedWr {
    pub dir: Dir,
    pub remote: u64,
    pub rkey: u32,
    pub sges: SgeList,
}

/// A WR's local SGEs. Nearly every WR has exactly one, kept inline so that planning a
/// WR allocates nothing; a zero-length WRITE has none; only merged equal-length pieces
/// make a list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SgeList {
    Empty,
    One(Sge),
    Many(Vec<Sge>),
}

impl SgeList {
    pub fn push(&mut self, s: Sge) {
        *self = match std::mem::replace(self, SgeList::Empty) {
            SgeList::Empty => SgeList::One(s),
            SgeList::One(a) => SgeList::Many(vec![a, s]),
            SgeList::Many(mut v) => {
                v.push(s);
                SgeList::Many(v)
            }
        };
    }
}

impl Deref for SgeList {
    type Target = [Sge];
    fn deref(&self) -> &[Sge] {
        match self {
            SgeList::Empty => &[],
            SgeList::One(s) => std::slice::from_ref(s),
            SgeList::Many(v) => v,
        }
    }
}

impl DerefMut for SgeList {
    fn deref_mut(&mut self) -> &mut [Sge] {
        match self {
            SgeList::Empty => &mut [],
            SgeList::One(s) => std::slice::from_mut(s),
            SgeList::Many(v) => v,
        }
    }
}

impl PlannedWr {
    /// A WRITE of no bytes: no local SGE, no remote memory touched (so no rkey is
    /// checked). Carries a notification's immediate, or probes a path.
    pub fn zero_length_write() -> Self {
        PlannedWr {
            dir: Dir::Write,
            remote: 0,
            rkey: 0,
            sges: SgeList::Empty,
        }
    }

    pub fn len(&self) -> u64 {
        self.sges.iter().map(|s| u64::from(s.len)).sum()
    }
}

/// The pieces `(offset, len)` of an op of `len` bytes cut at `max` bytes (at least 1):
/// in order, each `max` long but the last. Every backend slices with this.
pub(crate) fn pieces(len: u64, max: u64) -> impl Iterator<Item = (u64, u64)> + Clone {
    let max = max.max(1);
    (0..len.div_ceil(max)).map(move |k| {
        let off = k * max;
        (off, (len - off).min(max))
    })
}

/// How many pieces [`pieces`] cuts `len` bytes into.
pub(crate) fn piece_count(len: u64, max: u64) -> u64 {
    len.div_ceil(max.max(1))
}

/// Largest message we ever put in one WR (RC allows 2^31; stay well below).
pub(crate) const MAX_WR_BYTES_CAP: u64 = 1 << 30;

/// Turns ops into WRs.
///
/// * Ops longer than `max_wr_bytes` are sliced.
/// * A piece whose remote range continues the current WR (same direction and rkey) is merged
///   into it: by growing the last SGE when the local side is contiguous too and the WR still
///   has a single SGE, or by appending an SGE (remote contiguous, local not).
/// * SGE lists only ever hold entries of **equal length**: rdma-core 44's rxe provider computes
///   the total of an SGE list as `n * sge[0].length` (hazard 2 in docs/transport.md), so a list
///   with unequal entries would be truncated or fail. Unequal pieces go into separate WRs.
pub(crate) fn plan_wrs<I>(ops: I, max_wr_bytes: u64, max_sge: usize) -> Wrs
where
    I: IntoIterator,
    I::Item: Borrow<PlanOp>,
{
    let max_wr = max_wr_bytes.clamp(1, MAX_WR_BYTES_CAP);
    let max_sge = max_sge.max(1);
    let ops = ops.into_iter();
    let mut out = Wrs::with_capacity(ops.size_hint().0);
    for op in ops {
        let op = op.borrow();
        for (off, n) in pieces(op.len, max_wr) {
            let piece = Sge {
                addr: op.local + off,
                len: n as u32,
                lkey: op.lkey,
            };
            let remote = op.remote + off;
            if let Some(cur) = out.last_mut()
                && try_merge(cur, op.dir, remote, op.rkey, piece, max_wr, max_sge)
            {
                continue;
            }
            out.push(PlannedWr {
                dir: op.dir,
                remote,
                rkey: op.rkey,
                sges: SgeList::One(piece),
            });
        }
    }
    out
}

fn try_merge(
    cur: &mut PlannedWr,
    dir: Dir,
    remote: u64,
    rkey: u32,
    piece: Sge,
    max_wr: u64,
    max_sge: usize,
) -> bool {
    if cur.dir != dir || cur.rkey != rkey || cur.remote + cur.len() != remote {
        return false;
    }
    if cur.len() + u64::from(piece.len) > max_wr {
        return false;
    }
    let last = *cur.sges.last().expect("a planned WR has at least one SGE");
    if cur.sges.len() == 1
        && last.lkey == piece.lkey
        && last.addr + u64::from(last.len) == piece.addr
    {
        cur.sges[0].len += piece.len;
        return true;
    }
    if cur.sges.len() < max_sge && cur.sges.iter().all(|s| s.len == piece.len) {
        cur.sges.push(piece);
        return true;
    }
    false
}

/// A batch's planned WRs; two inline, so a small batch allocates no list.
pub(crate) type Wrs = SmallVec<[PlannedWr; 2]>;

/// One QP's share of a batch, in posting order, with a cursor past the WRs already
/// posted (posted WRs are only read, so they stay until the batch's post returns).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct WrQueue<T> {
    items: SmallVec<[T; 2]>,
    head: usize,
}

impl<T> WrQueue<T> {
    pub fn new(items: SmallVec<[T; 2]>) -> Self {
        WrQueue { items, head: 0 }
    }

    fn empty() -> Self {
        Self::new(SmallVec::new())
    }

    /// The WRs not posted yet.
    pub fn pending(&self) -> &[T] {
        &self.items[self.head..]
    }

    pub fn len(&self) -> usize {
        self.items.len() - self.head
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Marks the next `n` WRs posted.
    pub fn advance(&mut self, n: usize) {
        self.head = (self.head + n).min(self.items.len());
    }
}

/// Round-robin striping: WR `i` goes to QP `i % nqps`. Returns one queue per QP, each in
/// order. With one QP, or at most one WR, the list itself becomes QP 0's queue.
pub(crate) fn stripe<T>(wrs: SmallVec<[T; 2]>, nqps: usize) -> SmallVec<[WrQueue<T>; 4]> {
    let nqps = nqps.max(1);
    let mut per: SmallVec<[WrQueue<T>; 4]> = SmallVec::with_capacity(nqps);
    if nqps == 1 || wrs.len() <= 1 {
        per.push(WrQueue::new(wrs));
        per.resize_with(nqps, WrQueue::empty);
        return per;
    }
    per.resize_with(nqps, WrQueue::empty);
    for (i, w) in wrs.into_iter().enumerate() {
        per[i % nqps].items.push(w);
    }
    per
}
/// A batch's bytes on one rail: `len` bytes at offset `off` of op `op`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RailPiece {
    pub rail: usize,
    pub op: usize,
    pub off: u64,
    pub len: u64,
}

/// Stripes ops of lengths `lens` over rails by bytes, weighted (`weights[r]`: a rail's link
/// speed; 0 leaves the rail out). Each op is cut with [`pieces`] at `unit`; each piece goes
/// to the rail that, with it, carries the least bytes per unit of weight (ties: the first
/// from `start`, so callers rotating `start` spread small batches over the rails too); a
/// rail's consecutive pieces of one op merge. Every byte lands on exactly one rail, each
/// rail's pieces in batch order. Empty when every weight is 0.
pub(crate) fn stripe_rails<I>(lens: I, weights: &[u64], unit: u64, start: usize) -> Vec<RailPiece>
where
    I: IntoIterator<Item = u64>,
{
    let n = weights.len();
    let mut out: Vec<RailPiece> = Vec::new();
    if weights.iter().all(|&w| w == 0) {
        return out;
    }
    let mut load = vec![0u64; n];
    // Index in `out` of each rail's last piece, for merging.
    let mut last: Vec<Option<usize>> = vec![None; n];
    for (op, len) in lens.into_iter().enumerate() {
        for (off, plen) in pieces(len, unit) {
            let mut best: Option<usize> = None;
            for k in 0..n {
                let r = (start + k) % n;
                if weights[r] == 0 {
                    continue;
                }
                // (load + plen) / weight, compared without division.
                let better = best.is_none_or(|b| {
                    u128::from(load[r] + plen) * u128::from(weights[b])
                        < u128::from(load[b] + plen) * u128::from(weights[r])
                });
                if better {
                    best = Some(r);
                }
            }
            let r = best.expect("a rail with weight");
            load[r] += plen;
            match last[r].map(|i| &mut out[i]) {
                Some(p) if p.op == op && p.off + p.len == off => p.len += plen,
                _ => {
                    last[r] = Some(out.len());
                    out.push(RailPiece {
                        rail: r,
                        op,
                        off,
                        len: plen,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rail_bytes(p: &[RailPiece], n: usize) -> Vec<u64> {
        let mut b = vec![0; n];
        for x in p {
            b[x.rail] += x.len;
        }
        b
    }

    #[test]
    fn rails_share_by_weight() {
        let p = stripe_rails([8 << 20], &[1, 1], 1 << 20, 0);
        assert_eq!(rail_bytes(&p, 2), [4 << 20, 4 << 20]);
        let p = stripe_rails([8 << 20], &[3, 1], 1 << 20, 0);
        assert_eq!(rail_bytes(&p, 2), [6 << 20, 2 << 20]);
        // A rail taken out (weight 0) carries nothing.
        let p = stripe_rails([8 << 20, 4096], &[1, 0, 1], 1 << 20, 0);
        assert_eq!(rail_bytes(&p, 3), [(4 << 20) + 4096, 0, 4 << 20]);
        assert!(stripe_rails([100], &[0, 0], 10, 0).is_empty());
    }

    #[test]
    fn small_batches_rotate_and_pieces_merge() {
        assert_eq!(stripe_rails([64], &[1, 1], 1 << 20, 0)[0].rail, 0);
        assert_eq!(stripe_rails([64], &[1, 1], 1 << 20, 1)[0].rail, 1);
        // Contiguous pieces of one op on one rail become one piece.
        let p = stripe_rails([40], &[1], 10, 0);
        assert_eq!(
            p,
            [RailPiece {
                rail: 0,
                op: 0,
                off: 0,
                len: 40
            }]
        );
    }

    proptest! {
        /// Every byte of every op lands on exactly one rail, in order per rail, and no
        /// rail with weight carries more than its share plus one piece.
        #[test]
        fn rails_cover_every_byte_once(
            lens in prop::collection::vec(0u64..5000, 0..12),
            weights in prop::collection::vec(0u64..5, 1..5),
            unit in 1u64..700,
            start in 0usize..8,
        ) {
            let p = stripe_rails(lens.iter().copied(), &weights, unit, start);
            if weights.iter().all(|&w| w == 0) {
                prop_assert!(p.is_empty());
                return Ok(());
            }
            let mut cover: Vec<Vec<u8>> = lens.iter().map(|&l| vec![0u8; l as usize]).collect();
            for x in &p {
                prop_assert!(weights[x.rail] > 0);
                for b in x.off..x.off + x.len { cover[x.op][b as usize] += 1; }
            }
            prop_assert!(cover.iter().all(|c| c.iter().all(|&k| k == 1)));
            let total: u64 = lens.iter().sum();
            let wsum: u64 = weights.iter().sum();
            let got = rail_bytes(&p, weights.len());
            for (r, &w) in weights.iter().enumerate() {
                prop_assert!(got[r] as u128 * wsum as u128 <= (total as u128 + unit as u128) * w as u128 + unit as u128 * wsum as u128);
            }
        }
    }

    fn w(local: u64, remote: u64, len: u64) -> PlanOp {
        PlanOp {
            dir: Dir::Write,
            local,
            lkey: 1,
            remote,
            rkey: 2,
            len,
        }
    }

    #[test]
    fn pieces_cover_the_op_in_order() {
        let p: Vec<_> = pieces(10, 4).collect();
        assert_eq!(p, [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(piece_count(10, 4), 3);
        assert_eq!(pieces(8, 4).count(), 2);
        assert_eq!(pieces(0, 4).count(), 0);
        assert_eq!(pieces(3, 0).count(), 3, "a zero cap slices byte by byte");
    }

    #[test]
    fn slices_large_ops() {
        let wrs = plan_wrs([w(0, 1000, 10)], 4, 4);
        let lens: Vec<u64> = wrs.iter().map(PlannedWr::len).collect();
        assert_eq!(lens, vec![4, 4, 2]);
        assert_eq!(wrs[1].remote, 1004);
        assert_eq!(wrs[2].sges[0].addr, 8);
    }

    #[test]
    fn merges_scattered_local_into_sge_list_when_remote_contiguous() {
        let ops = [w(0, 100, 8), w(64, 108, 8), w(32, 116, 8)];
        let wrs = plan_wrs(ops, 1 << 20, 4);
        assert_eq!(wrs.len(), 1);
        assert_eq!(wrs[0].sges.len(), 3);
        assert_eq!(wrs[0].remote, 100);
        assert_eq!(wrs[0].len(), 24);
    }

    #[test]
    fn never_builds_unequal_sge_lists() {
        let ops = [w(0, 100, 8), w(64, 108, 4)];
        let wrs = plan_wrs(ops, 1 << 20, 4);
        assert_eq!(wrs.len(), 2);
    }

    #[test]
    fn respects_max_sge() {
        let ops: Vec<PlanOp> = (0..5).map(|i| w(i * 100, 1000 + i * 8, 8)).collect();
        let wrs = plan_wrs(ops, 1 << 20, 2);
        let n: Vec<usize> = wrs.iter().map(|w| w.sges.len()).collect();
        assert_eq!(n, vec![2, 2, 1]);
    }

    #[test]
    fn coalesces_fully_contiguous() {
        let ops = [w(0, 100, 8), w(8, 108, 8)];
        let wrs = plan_wrs(ops, 1 << 20, 1);
        assert_eq!(wrs.len(), 1);
        assert_eq!(
            wrs[0].sges[..],
            [Sge {
                addr: 0,
                len: 16,
                lkey: 1
            }]
        );
    }

    #[test]
    fn does_not_merge_across_keys_or_directions() {
        let mut b = w(8, 108, 8);
        b.rkey = 3;
        assert_eq!(plan_wrs([w(0, 100, 8), b], 1 << 20, 4).len(), 2);
        let mut r = w(8, 108, 8);
        r.dir = Dir::Read;
        assert_eq!(plan_wrs([w(0, 100, 8), r], 1 << 20, 4).len(), 2);
    }

    #[test]
    fn stripes_round_robin() {
        let per = stripe((0..7).collect(), 3);
        assert_eq!(per[0].pending(), [0, 3, 6]);
        assert_eq!(per[1].pending(), [1, 4]);
        assert_eq!(per[2].pending(), [2, 5]);
        // One QP, or at most one WR: all on QP 0, the others empty.
        let per = stripe(SmallVec::from_vec(vec![1, 2, 3]), 1);
        assert_eq!(per.len(), 1);
        assert_eq!(per[0].pending(), [1, 2, 3]);
        let per = stripe(SmallVec::from_elem(9, 1), 3);
        assert_eq!(per.len(), 3);
        assert_eq!(per[0].pending(), [9]);
        assert!(per[1].is_empty() && per[2].is_empty());
        assert!(
            stripe(SmallVec::<[u8; 2]>::new(), 2)
                .iter()
                .all(WrQueue::is_empty)
        );
    }

    #[test]
    fn wr_queue_cursor() {
        let mut q = WrQueue::new(SmallVec::from_vec(vec![1, 2, 3]));
        assert_eq!(q.len(), 3);
        q.advance(2);
        assert_eq!(q.pending(), [3]);
        q.advance(5);
        assert!(q.is_empty());
        assert_eq!(q.pending(), [] as [i32; 0]);
    }

    #[test]
    fn sge_list_grows_from_none_to_inline_to_list() {
        let s = |addr| Sge {
            addr,
            len: 8,
            lkey: 1,
        };
        let mut l = SgeList::Empty;
        assert!(l.is_empty());
        l.push(s(0));
        assert_eq!(l, SgeList::One(s(0)));
        l.push(s(8));
        l.push(s(16));
        assert_eq!(l[..], [s(0), s(8), s(16)]);
        l[0].len = 4;
        assert_eq!(l[0].len, 4);
    }

    proptest! {
        /// Planning preserves every byte mapping (local byte -> remote byte), keeps each WR
        /// within limits and never emits an SGE list with unequal lengths.
        #[test]
        fn plan_preserves_byte_mapping(
            pieces in prop::collection::vec((0u64..4, 1u64..40, any::<bool>()), 1..20),
            max_wr in 1u64..64,
            max_sge in 1usize..5,
        ) {
            // Remote is laid out contiguously; local gets random gaps.
            let mut ops = Vec::new();
            let (mut local, mut remote) = (0u64, 10_000u64);
            for (gap, len, remote_gap) in pieces {
                local += gap * 16;
                if remote_gap { remote += 3; }
                ops.push(w(local, remote, len));
                local += len;
                remote += len;
            }
            let wrs = plan_wrs(&ops, max_wr, max_sge);
            let mut want = Vec::new();
            for op in &ops { for b in 0..op.len { want.push((op.local + b, op.remote + b)); } }
            let mut got = Vec::new();
            for wr in &wrs {
                prop_assert!(wr.len() <= max_wr);
                prop_assert!(wr.sges.len() <= max_sge);
                if wr.sges.len() > 1 {
                    prop_assert!(wr.sges.iter().all(|s| s.len == wr.sges[0].len));
                }
                let mut r = wr.remote;
                for s in wr.sges.iter() { for b in 0..u64::from(s.len) { got.push((s.addr + b, r)); r += 1; } }
            }
            prop_assert_eq!(got, want);
        }
    }
}
