//! Transfer plans: (src, dst, len) triples between two pools.

use crate::error::{
    LayoutError, MAX_ENTRIES, MAX_PLAN_BLOCKS, Result, add, bounded, mul, plan_blocks,
};
use crate::geometry::{Layout, PoolKind};
use crate::pool::{Pool, Walk};

/// One copy: `len` bytes from `src` to `dst` (plain addresses, local and remote).
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct Transfer {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// An ordered list of [`Transfer`]s, stored as the three parallel lists of Mooncake's
/// `batch_transfer_sync_write(session, srcs, dsts, lens)`.
#[derive(Clone, Debug, Default, Eq, PartialEq)]
pub struct TransferPlan {
    srcs: Vec<u64>,
    dsts: Vec<u64>,
    lens: Vec<u64>,
}

impl TransferPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty plan with room for `n` transfers.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            srcs: Vec::with_capacity(n),
            dsts: Vec::with_capacity(n),
            lens: Vec::with_capacity(n),
        }
    }

    /// Append a transfer as is.
    #[inline]
    pub fn push(&mut self, t: Transfer) {
        self.srcs.push(t.src);
        self.dsts.push(t.dst);
        self.lens.push(t.len);
    }

    /// Append a transfer, extending the last one instead when both its source and its
    /// destination continue exactly where the last one ends. Zero-length transfers are dropped.
    #[inline]
    pub fn push_coalesced(&mut self, t: Transfer) {
        if t.len == 0 {
            return;
        }
        if let Some(last) = self.lens.last_mut() {
            let i = self.srcs.len() - 1;
            if self.srcs[i].checked_add(*last) == Some(t.src)
                && self.dsts[i].checked_add(*last) == Some(t.dst)
            {
                *last += t.len;
                return;
            }
        }
        self.push(t);
    }

    /// Remove all transfers, keeping the allocations.
    pub fn clear(&mut self) {
        self.srcs.clear();
        self.dsts.clear();
        self.lens.clear();
    }

    /// Number of transfers.
    pub fn len(&self) -> usize {
        self.srcs.len()
    }

    /// Whether the plan is empty.
    pub fn is_empty(&self) -> bool {
        self.srcs.is_empty()
    }

    /// The transfers, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = Transfer> + '_ {
        self.srcs
            .iter()
            .zip(&self.dsts)
            .zip(&self.lens)
            .map(|((&src, &dst), &len)| Transfer { src, dst, len })
    }

    /// Source addresses.
    pub fn srcs(&self) -> &[u64] {
        &self.srcs
    }
    /// Destination addresses.
    pub fn dsts(&self) -> &[u64] {
        &self.dsts
    }
    /// Lengths.
    pub fn lens(&self) -> &[u64] {
        &self.lens
    }

    /// Sum of the lengths.
    pub fn total_bytes(&self) -> u64 {
        self.lens.iter().sum()
    }

    /// `(srcs, dsts, lens)`.
    pub fn into_parts(self) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
        (self.srcs, self.dsts, self.lens)
    }
}

impl FromIterator<Transfer> for TransferPlan {
    fn from_iter<I: IntoIterator<Item = Transfer>>(iter: I) -> Self {
        let mut out = Self::new();
        out.extend(iter);
        out
    }
}

impl Extend<Transfer> for TransferPlan {
    fn extend<I: IntoIterator<Item = Transfer>>(&mut self, iter: I) {
        for t in iter {
            self.push(t);
        }
    }
}

impl<'a> IntoIterator for &'a TransferPlan {
    type Item = Transfer;
    type IntoIter = Transfers<'a>;

    fn into_iter(self) -> Self::IntoIter {
        Transfers {
            plan: self,
            next: 0,
        }
    }
}

/// Iterator over the [`Transfer`]s of a [`TransferPlan`] (from `&plan`).
#[derive(Clone, Debug)]
pub struct Transfers<'a> {
    plan: &'a TransferPlan,
    next: usize,
}

impl Iterator for Transfers<'_> {
    type Item = Transfer;

    #[inline]
    fn next(&mut self) -> Option<Transfer> {
        let i = self.next;
        let p = self.plan;
        if i >= p.lens.len() {
            return None;
        }
        self.next = i + 1;
        Some(Transfer {
            src: p.srcs[i],
            dst: p.dsts[i],
            len: p.lens[i],
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.plan.lens.len() - self.next;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Transfers<'_> {}

/// Merges a stream of blocks into maximal runs (both sides contiguous) before appending
/// them to a plan. Dropping it without [`Merger::finish`] loses the pending run.
///
/// The plan is held to [`MAX_ENTRIES`] transfers: runs beyond it are counted, not stored,
/// so that the error can give the plan's true length.
struct Merger<'a> {
    out: &'a mut TransferPlan,
    cur: Transfer,
    dropped: &'a mut u64,
    /// [`MAX_ENTRIES`] (smaller in tests).
    limit: usize,
}

impl<'a> Merger<'a> {
    fn new(out: &'a mut TransferPlan, dropped: &'a mut u64) -> Self {
        Self {
            out,
            cur: Transfer::default(),
            dropped,
            limit: MAX_ENTRIES,
        }
    }

    #[inline(always)]
    fn store(&mut self, t: Transfer) {
        if self.out.len() < self.limit {
            self.out.push(t);
        } else {
            *self.dropped += 1;
        }
    }

    #[inline(always)]
    fn add(&mut self, src: u64, dst: u64, len: u64) {
        let c = &mut self.cur;
        // `cur.len == 0` only before the first block; blocks are never empty.
        if c.len != 0 && c.src.wrapping_add(c.len) == src && c.dst.wrapping_add(c.len) == dst {
            c.len += len;
            return;
        }
        if c.len != 0 {
            let done = *c;
            self.store(done);
        }
        self.cur = Transfer { src, dst, len };
    }

    fn finish(mut self) {
        if self.cur.len != 0 {
            let done = self.cur;
            self.store(done);
        }
    }
}

/// The error for a plan that had `dropped` transfers beyond [`MAX_ENTRIES`] (none: `Ok`);
/// `out` is emptied then.
fn check_dropped(what: &'static str, dropped: u64, out: &mut TransferPlan) -> Result<()> {
    if dropped == 0 {
        return Ok(());
    }
    out.clear();
    Err(LayoutError::TooManyEntries {
        what,
        count: MAX_ENTRIES as u128 + u128::from(dropped),
        unit: "transfers",
        limit: MAX_ENTRIES as u64,
    })
}

/// A run of pages consecutive on both sides: `count` pages from `src` and `dst` on.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct PageRun {
    /// First source page.
    pub src: u64,
    /// First destination page.
    pub dst: u64,
    /// Number of pages.
    pub count: u64,
}

/// SGLang's `group_concurrent_contiguous`: split paired page lists into runs; a run goes on
/// while both the next source and the next destination page are one more than the last.
///
/// # Errors
/// [`LayoutError::LengthMismatch`] when the lists differ in length.
pub fn page_runs(src_pages: &[u64], dst_pages: &[u64]) -> Result<Vec<PageRun>> {
    if src_pages.len() != dst_pages.len() {
        return Err(LayoutError::LengthMismatch {
            what: "source and destination page lists",
            left: src_pages.len(),
            right: dst_pages.len(),
        });
    }
    let mut runs: Vec<PageRun> = Vec::new();
    for (&s, &d) in src_pages.iter().zip(dst_pages) {
        if let Some(r) = runs.last_mut()
            && r.src.checked_add(r.count) == Some(s)
            && r.dst.checked_add(r.count) == Some(d)
        {
            r.count += 1;
            continue;
        }
        runs.push(PageRun {
            src: s,
            dst: d,
            count: 1,
        });
    }
    Ok(runs)
}

/// One group of per-layer buffers of SGLang's PD Mooncake connector: the source and
/// destination base address of every layer, and the bytes of one page of one layer
/// (`item_len`: `H*D*b*P` for K, `H*Dv*b*P` for V, `C*b*P` for MLA).
#[derive(Clone, Copy, Debug)]
pub struct PdBuffers<'a> {
    /// Source (prefill) per-layer base addresses.
    pub src: &'a [u64],
    /// Destination (decode) per-layer base addresses.
    pub dst: &'a [u64],
    /// Bytes per page per layer.
    pub item_len: u64,
}

/// SGLang's PD Mooncake connector plan (`_send_kvcache_generic`), exactly: for each group
/// (K, then V; or one MLA group), for each layer, for each run of pages consecutive on both
/// sides, the block `(src[l] + run.src*item_len, dst[l] + run.dst*item_len,
/// item_len*run.count)`.
///
/// # Errors
/// [`LayoutError::LengthMismatch`] (page lists or per-layer base lists of different
/// lengths), [`LayoutError::InvalidGeometry`] for a zero `item_len`,
/// [`LayoutError::Overflow`], [`LayoutError::TooManyEntries`] (more than
/// [`MAX_PLAN_BLOCKS`] blocks before merging, or [`MAX_ENTRIES`] transfers after).
pub fn pd_connector_plan(
    groups: &[PdBuffers<'_>],
    src_pages: &[u64],
    dst_pages: &[u64],
) -> Result<TransferPlan> {
    let mut out = TransferPlan::new();
    pd_connector_plan_into(groups, src_pages, dst_pages, &mut out)?;
    Ok(out)
}

/// [`pd_connector_plan`] into a caller's plan (cleared first; its capacity is reused).
///
/// # Errors
/// As [`pd_connector_plan`]; `out` is left empty on error.
pub fn pd_connector_plan_into(
    groups: &[PdBuffers<'_>],
    src_pages: &[u64],
    dst_pages: &[u64],
    out: &mut TransferPlan,
) -> Result<()> {
    out.clear();
    if src_pages.len() != dst_pages.len() {
        return Err(LayoutError::LengthMismatch {
            what: "source and destination page lists",
            left: src_pages.len(),
            right: dst_pages.len(),
        });
    }
    // The blocks before merging, one per layer and page, bound the work up
    // front (before the per-layer checks, which are as long).
    let layers = groups
        .iter()
        .fold(0u64, |n, g| n.saturating_add(g.src.len() as u64));
    plan_blocks(
        "pd_connector_plan of layers x pages",
        &[layers, src_pages.len() as u64],
    )?;
    let (max_src, max_dst) = (
        src_pages.iter().copied().max().unwrap_or(0),
        dst_pages.iter().copied().max().unwrap_or(0),
    );
    for g in groups {
        if g.src.len() != g.dst.len() {
            return Err(LayoutError::LengthMismatch {
                what: "source and destination per-layer base lists",
                left: g.src.len(),
                right: g.dst.len(),
            });
        }
        if g.item_len == 0 {
            return Err(LayoutError::InvalidGeometry {
                field: "item_len",
                value: 0,
                reason: "must be at least 1",
            });
        }
        // Check the farthest byte once; then no address below can overflow.
        let (src_top, dst_top) = (
            g.src.iter().copied().max().unwrap_or(0),
            g.dst.iter().copied().max().unwrap_or(0),
        );
        let reach = |base, page| -> Result<u64> {
            let end = mul(add(page, 1, "page end")?, g.item_len, "page offset")?;
            add(base, end, "end address")
        };
        if !src_pages.is_empty() {
            reach(src_top, max_src)?;
            reach(dst_top, max_dst)?;
        }
    }
    // SGLang merges pages into runs once (`group_concurrent_contiguous`) and sends one block
    // per run and layer; merging the per-page blocks of one layer gives the same blocks,
    // because with a fixed item_len both sides are contiguous exactly when both page
    // numbers go up by one.
    let mut dropped = 0;
    for g in groups {
        for (&sb, &db) in g.src.iter().zip(g.dst) {
            let mut m = Merger::new(out, &mut dropped);
            for (&ps, &pd) in src_pages.iter().zip(dst_pages) {
                m.add(sb + ps * g.item_len, db + pd * g.item_len, g.item_len);
            }
            m.finish();
        }
    }
    check_dropped("pd_connector_plan", dropped, out)
}

/// Which heads of the model each pool holds, for plans between different TP degrees.
///
/// A pool with `H` heads at TP rank `r` holds global heads `[r*H, (r+1)*H)`; the plan moves
/// the heads both pools hold. MLA pools are replicated on every rank and ignore this.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct HeadShards {
    /// Global index of the source pool's head 0.
    pub src_first_head: u64,
    /// Global index of the destination pool's head 0.
    pub dst_first_head: u64,
}

impl HeadShards {
    /// Shards from TP ranks: `first_head = rank * heads` on each side.
    ///
    /// # Errors
    /// [`LayoutError::Overflow`].
    pub fn from_tp_ranks(src: &Pool, src_rank: u64, dst: &Pool, dst_rank: u64) -> Result<Self> {
        Ok(Self {
            src_first_head: mul(src_rank, src.geometry().heads(), "source first head")?,
            dst_first_head: mul(dst_rank, dst.geometry().heads(), "destination first head")?,
        })
    }
}

/// A plan that copies pages of `src` into pages of `dst` (same model geometry, any layouts,
/// any capacities and addresses): `src_pages[i]` goes to `dst_pages[i]`.
///
/// Both pools must have the same heads; see [`plan_with_heads`] for different TP degrees.
/// Order: per buffer (K, then V; or latent); inside it, for a `layer_first` source, layer by
/// layer and then page by page, otherwise page by page. Each run is maximal: neighbouring
/// blocks are merged whenever both sides are contiguous (never across K and V).
///
/// # Errors
/// [`LayoutError::KindMismatch`], [`LayoutError::GeometryMismatch`],
/// [`LayoutError::LengthMismatch`], [`LayoutError::PageOutOfRange`],
/// [`LayoutError::DuplicatePage`] (a destination page listed twice),
/// [`LayoutError::TooManyEntries`] (more than [`MAX_PLAN_BLOCKS`] blocks before
/// merging, checked first, or more than [`MAX_ENTRIES`] transfers after).
pub fn plan(src: &Pool, dst: &Pool, src_pages: &[u64], dst_pages: &[u64]) -> Result<TransferPlan> {
    let (hs, hd) = (src.geometry().heads(), dst.geometry().heads());
    // (MLA against MHA is reported as a kind mismatch by `plan_into`.)
    let same_family =
        (src.geometry().kind() == PoolKind::Mla) == (dst.geometry().kind() == PoolKind::Mla);
    if hs != hd && same_family {
        return Err(LayoutError::GeometryMismatch {
            what: "heads",
            src: hs,
            dst: hd,
        });
    }
    plan_with_heads(src, dst, src_pages, dst_pages, HeadShards::default())
}

/// [`plan`] between pools holding different head shards (different TP degrees): only the
/// heads both hold move, each to its place in the destination.
///
/// # Errors
/// As [`plan`], plus [`LayoutError::HeadShard`] when the shards share no head.
pub fn plan_with_heads(
    src: &Pool,
    dst: &Pool,
    src_pages: &[u64],
    dst_pages: &[u64],
    shards: HeadShards,
) -> Result<TransferPlan> {
    let mut out = TransferPlan::new();
    plan_into(src, dst, src_pages, dst_pages, shards, &mut out)?;
    Ok(out)
}

/// [`plan_with_heads`] into a caller's plan (cleared first; its capacity is reused).
///
/// # Errors
/// As [`plan_with_heads`]; `out` is left empty on error.
pub fn plan_into(
    src: &Pool,
    dst: &Pool,
    src_pages: &[u64],
    dst_pages: &[u64],
    shards: HeadShards,
    out: &mut TransferPlan,
) -> Result<()> {
    let layers = src.geometry().layers();
    plan_layers_into(src, dst, src_pages, dst_pages, shards, 0..layers, out)
}

/// [`plan_into`] restricted to the layers `layers` (for layer-by-layer sends that overlap
/// with compute). The plans of disjoint layer ranges together move exactly the bytes of the
/// whole plan.
///
/// # Errors
/// As [`plan_with_heads`], plus [`LayoutError::IndexOutOfRange`] for a layer range that is
/// empty or beyond the pools' layers.
pub fn plan_layers_into(
    src: &Pool,
    dst: &Pool,
    src_pages: &[u64],
    dst_pages: &[u64],
    shards: HeadShards,
    layers: std::ops::Range<u64>,
    out: &mut TransferPlan,
) -> Result<()> {
    out.clear();
    let n_layers = src.geometry().layers();
    if layers.start >= layers.end || layers.end > n_layers {
        return Err(LayoutError::IndexOutOfRange {
            axis: "layer range end",
            index: layers.end,
            size: n_layers,
        });
    }
    let (gs, gd) = (src.geometry(), dst.geometry());
    let mla = gs.kind() == PoolKind::Mla;
    if mla != (gd.kind() == PoolKind::Mla) {
        return Err(LayoutError::KindMismatch {
            src: gs.kind(),
            dst: gd.kind(),
        });
    }
    let same = |what, a: u64, b: u64| {
        if a == b {
            Ok(())
        } else {
            Err(LayoutError::GeometryMismatch {
                what,
                src: a,
                dst: b,
            })
        }
    };
    same("layers", gs.layers(), gd.layers())?;
    same("page_size", gs.page_size(), gd.page_size())?;
    same("head_dim", gs.head_dim(), gd.head_dim())?;
    same("v_head_dim", gs.v_head_dim(), gd.v_head_dim())?;
    same("dtype_bytes", gs.dtype_bytes(), gd.dtype_bytes())?;
    if src_pages.len() != dst_pages.len() {
        return Err(LayoutError::LengthMismatch {
            what: "source and destination page lists",
            left: src_pages.len(),
            right: dst_pages.len(),
        });
    }
    for (pages, pool) in [(src_pages, src), (dst_pages, dst)] {
        let n = pool.geometry().pages();
        if let Some(&page) = pages.iter().find(|&&p| p >= n) {
            return Err(LayoutError::PageOutOfRange { page, pages: n });
        }
    }
    check_distinct(dst_pages)?;
    // The heads both pools hold, as local head indices on each side.
    let (h_src, h_dst, heads) = if mla {
        (0, 0, 1)
    } else {
        let s_end = add(shards.src_first_head, gs.heads(), "source last head")?;
        let d_end = add(shards.dst_first_head, gd.heads(), "destination last head")?;
        let lo = shards.src_first_head.max(shards.dst_first_head);
        let hi = s_end.min(d_end);
        if lo >= hi {
            return Err(LayoutError::HeadShard {
                reason: "the source and destination shards share no head",
            });
        }
        (
            lo - shards.src_first_head,
            lo - shards.dst_first_head,
            hi - lo,
        )
    };
    let layer_major = src.layout() == Layout::LayerFirst;
    let (l0, nl) = (layers.start, layers.end - layers.start);
    // Blocks before merging: per buffer, pages x (layers x blocks of one layer, or blocks
    // of all the layers), counted before anything is emitted.
    let blocks = src.components().iter().fold(0u128, |n, &c| {
        let (ss, ds) = (src.strides(c), dst.strides(c));
        let per_page = if layer_major {
            let w = Walk::new(src.axes(1, heads, &ss, &ds), ss.row);
            u128::from(nl) * u128::from(w.blocks())
        } else {
            u128::from(Walk::new(src.axes(nl, heads, &ss, &ds), ss.row).blocks())
        };
        n + per_page * src_pages.len() as u128
    });
    bounded(
        "plan of pages x layers x blocks per page and layer",
        "blocks",
        blocks,
        MAX_PLAN_BLOCKS,
    )?;
    let mut dropped = 0;
    for &c in src.components() {
        let (ss, ds) = (src.strides(c), dst.strides(c));
        let (sb, db) = (
            src.base(c) + h_src * ss.head + l0 * ss.layer,
            dst.base(c) + h_dst * ds.head + l0 * ds.layer,
        );
        // One merger per buffer: never merge K into V.
        let mut m = Merger::new(out, &mut dropped);
        let mut emit = |s: u64, d: u64, len: u64| m.add(s, d, len);
        // Every address below lies inside a buffer whose end was checked by `Pool::new`.
        if layer_major {
            let w = Walk::new(src.axes(1, heads, &ss, &ds), ss.row);
            for l in 0..nl {
                for (&ps, &pd) in src_pages.iter().zip(dst_pages) {
                    let s0 = sb + ps * ss.page + l * ss.layer;
                    let d0 = db + pd * ds.page + l * ds.layer;
                    w.run(s0, d0, &mut emit);
                }
            }
        } else {
            let w = Walk::new(src.axes(nl, heads, &ss, &ds), ss.row);
            if w.is_single() {
                // Same byte order on both sides: one block per page (the common case).
                for (&ps, &pd) in src_pages.iter().zip(dst_pages) {
                    emit(sb + ps * ss.page, db + pd * ds.page, w.len());
                }
            } else {
                for (&ps, &pd) in src_pages.iter().zip(dst_pages) {
                    w.run(sb + ps * ss.page, db + pd * ds.page, &mut emit);
                }
            }
        }
        m.finish();
    }
    check_dropped("plan", dropped, out)
}

/// A source page may go to several destinations, but two sources must not write one page.
/// Increasing lists (the common case) pass in one scan; others are sorted in a copy.
fn check_distinct(pages: &[u64]) -> Result<()> {
    if pages.windows(2).all(|w| w[0] < w[1]) {
        return Ok(());
    }
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(LayoutError::DuplicatePage { page: w[0] }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_follow_group_concurrent_contiguous() {
        let runs = page_runs(&[2, 3, 5, 6, 7, 9], &[10, 11, 20, 22, 23, 24]).unwrap();
        assert_eq!(
            runs,
            vec![
                PageRun {
                    src: 2,
                    dst: 10,
                    count: 2
                },
                PageRun {
                    src: 5,
                    dst: 20,
                    count: 1
                },
                PageRun {
                    src: 6,
                    dst: 22,
                    count: 2
                },
                PageRun {
                    src: 9,
                    dst: 24,
                    count: 1
                },
            ]
        );
        assert!(page_runs(&[], &[]).unwrap().is_empty());
        assert!(matches!(
            page_runs(&[1], &[]),
            Err(LayoutError::LengthMismatch {
                left: 1,
                right: 0,
                ..
            })
        ));
    }

    #[test]
    fn merger_stores_up_to_its_limit_and_counts_the_rest() {
        let mut out = TransferPlan::new();
        let mut dropped = 0;
        let mut m = Merger::new(&mut out, &mut dropped);
        m.limit = 2;
        // Five runs: 0..8 merges with 8..16; the others are apart on the destination side.
        for (s, d) in [
            (0, 100),
            (8, 108),
            (16, 200),
            (24, 300),
            (32, 400),
            (40, 500),
        ] {
            m.add(s, d, 8);
        }
        m.finish();
        assert_eq!(out.lens(), &[16, 8]);
        assert_eq!(dropped, 3);
        let e = check_dropped("plan", dropped, &mut out).unwrap_err();
        assert!(out.is_empty());
        assert_eq!(
            e,
            LayoutError::TooManyEntries {
                what: "plan",
                count: MAX_ENTRIES as u128 + 3,
                unit: "transfers",
                limit: MAX_ENTRIES as u64,
            }
        );
    }

    #[test]
    fn push_coalesced_needs_both_sides_contiguous() {
        let mut p = TransferPlan::new();
        p.push_coalesced(Transfer {
            src: 0,
            dst: 100,
            len: 8,
        });
        p.push_coalesced(Transfer {
            src: 8,
            dst: 108,
            len: 8,
        });
        p.push_coalesced(Transfer {
            src: 16,
            dst: 200,
            len: 8,
        });
        p.push_coalesced(Transfer {
            src: 16,
            dst: 208,
            len: 0,
        });
        assert_eq!(p.lens(), &[16, 8]);
        assert_eq!(p.total_bytes(), 24);
    }
}
