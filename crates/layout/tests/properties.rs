//! Property tests: every layout and pool kind against a brute-force row-major model.
//!
//! The reference below never uses the crate's strides. It builds each buffer's dims from the
//! layout tables of docs/layout.md (SGLang's buffer shapes) and indexes them row-major, then
//! compares byte sets: what the crate's segments and plans cover against what the elements
//! of the requested pages occupy.

use std::collections::{BTreeMap, BTreeSet};

use pagewire_layout::{
    Checks, Component, HeadShards, Layout, LayoutError, PdBuffers, Pool, PoolGeometry, PoolKind,
    Segment, coalesce, page_runs, pd_connector_plan, plan, plan_with_heads,
};
use proptest::prelude::*;

/// Row-major offset of `idx` in an array of `dims`.
fn row_major(dims: &[u64], idx: &[u64]) -> u64 {
    dims.iter().zip(idx).fold(0, |acc, (&n, &i)| {
        assert!(i < n);
        acc * n + i
    })
}

/// Reference address of element (c, t, l, h, d).
fn ref_addr(pool: &Pool, base: u64, c: Component, t: u64, l: u64, h: u64, d: u64) -> u64 {
    let g = pool.geometry();
    let (nl, p, s) = (g.layers(), g.page_size(), g.capacity());
    let n = s / p;
    let hc = g.component_heads(c);
    let dc = g.component_dim(c);
    let (pg, o) = (t / p, t % p);
    let elem = match pool.layout() {
        Layout::LayerFirst => row_major(&[nl, s, hc, dc], &[l, t, h, d]),
        Layout::PageFirst => row_major(&[s, nl, hc, dc], &[t, l, h, d]),
        Layout::PageFirstDirect => row_major(&[n, nl, p, hc, dc], &[pg, l, o, h, d]),
        Layout::PageHead => row_major(&[n, hc, p, nl, dc], &[pg, h, o, l, d]),
        _ => unreachable!(),
    };
    base + elem * g.dtype_bytes()
}

/// Reference base of a buffer: SGLang's `V_OFF` for `mha` without an explicit V base.
fn ref_base(pool: &Pool, base: u64, v_base: Option<u64>, c: Component) -> u64 {
    let g = pool.geometry();
    match c {
        Component::V => v_base.unwrap_or_else(|| {
            base + g.layers() * g.capacity() * g.heads() * g.head_dim() * g.dtype_bytes()
        }),
        _ => base,
    }
}

#[derive(Clone, Debug)]
struct Case {
    pool: Pool,
    base: u64,
    v_base: Option<u64>,
    /// Distinct pages, in request order.
    pages: Vec<u64>,
}

impl Case {
    fn bytes_of(&self, filter: impl Fn(Component, u64, u64) -> bool) -> BTreeSet<u64> {
        let g = self.pool.geometry();
        let mut out = BTreeSet::new();
        for &c in self.pool.components() {
            let base = ref_base(&self.pool, self.base, self.v_base, c);
            for &page in &self.pages {
                for o in 0..g.page_size() {
                    let t = page * g.page_size() + o;
                    for l in 0..g.layers() {
                        for h in 0..g.component_heads(c) {
                            if !filter(c, l, h) {
                                continue;
                            }
                            for d in 0..g.component_dim(c) {
                                let a = ref_addr(&self.pool, base, c, t, l, h, d);
                                out.extend(a..a + g.dtype_bytes());
                            }
                        }
                    }
                }
            }
        }
        out
    }

    fn tokens(&self) -> Vec<u64> {
        let p = self.pool.geometry().page_size();
        self.pages
            .iter()
            .flat_map(|&pg| pg * p..(pg + 1) * p)
            .collect()
    }
}

/// Bytes covered by segments; panics if two segments share a byte.
fn cover(segs: impl IntoIterator<Item = Segment>) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for s in segs {
        for a in s.addr..s.end() {
            assert!(out.insert(a), "byte {a:#x} covered twice");
        }
    }
    out
}

fn geometry(kind: PoolKind, dims: (u64, u64, u64, u64, u64, u64, u64)) -> PoolGeometry {
    let (l, p, h, d, dv, b, n) = dims;
    let g = PoolGeometry::builder(kind)
        .layers(l)
        .page_size(p)
        .dtype_bytes(b)
        .capacity(n * p);
    match kind {
        PoolKind::Mha => g.heads(h).head_dim(d),
        PoolKind::MhaSplit => g.heads(h).head_dim(d).v_head_dim(dv),
        _ => g.kv_dim(d + dv),
    }
    .build()
    .unwrap()
}

fn kind_strategy() -> impl Strategy<Value = PoolKind> {
    prop_oneof![
        Just(PoolKind::Mha),
        Just(PoolKind::MhaSplit),
        Just(PoolKind::Mla)
    ]
}

fn layout_strategy() -> impl Strategy<Value = Layout> {
    prop::sample::select(Layout::ALL.to_vec())
}

fn dims_strategy() -> impl Strategy<Value = (u64, u64, u64, u64, u64, u64, u64)> {
    (
        1..=3u64,
        1..=4u64,
        1..=4u64,
        1..=4u64,
        1..=4u64,
        1..=2u64,
        1..=5u64,
    )
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        kind_strategy(),
        layout_strategy(),
        dims_strategy(),
        0..4u64,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_filter_map(
            "MLA has no page_head",
            |(kind, layout, dims, base_k, sep_v, seed)| {
                if kind == PoolKind::Mla && layout == Layout::PageHead {
                    return None;
                }
                let g = geometry(kind, dims);
                let base = 0x1000 * (base_k + 1);
                let v_base = match kind {
                    PoolKind::MhaSplit => Some(0x100_0000),
                    PoolKind::Mha if sep_v => Some(0x200_0000),
                    _ => None,
                };
                let pool = Pool::new(g, layout, base, v_base).unwrap();
                // A seeded subset of distinct pages in a seeded order, sometimes with runs.
                let n = g.pages();
                let mut pages: Vec<u64> = (0..n).filter(|p| (seed >> p) & 1 == 1).collect();
                if (seed >> 40) & 1 == 1 {
                    pages.reverse();
                }
                if (seed >> 41) & 1 == 1 && pages.len() > 2 {
                    pages.swap(0, 1);
                }
                Some(Case {
                    pool,
                    base,
                    v_base,
                    pages,
                })
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The crate's element address function is the row-major model, for every element.
    #[test]
    fn element_addresses_match_row_major(case in case_strategy()) {
        let pool = &case.pool;
        let g = pool.geometry();
        for &c in pool.components() {
            let base = ref_base(pool, case.base, case.v_base, c);
            for t in 0..g.capacity() {
                for l in 0..g.layers() {
                    for h in 0..g.component_heads(c) {
                        for d in 0..g.component_dim(c) {
                            prop_assert_eq!(
                                pool.element_addr(c, t, l, h, d).unwrap(),
                                ref_addr(pool, base, c, t, l, h, d)
                            );
                        }
                    }
                }
            }
        }
    }

    /// Segments stay in their buffer, K and V never overlap, the coverage is exactly the
    /// pages' bytes, and coalescing does not change it.
    #[test]
    fn page_meta_covers_exactly_the_pages(case in case_strategy()) {
        let pool = &case.pool;
        let tokens = case.tokens();
        let mut by_comp: BTreeMap<&str, Vec<Segment>> = BTreeMap::new();
        let n = pool.for_each_segment(&tokens, |c, s| {
            by_comp.entry(c.as_str()).or_default().push(s);
        }).unwrap();
        prop_assert_eq!(n, case.pages.len());
        let mut all = BTreeSet::new();
        for &c in pool.components() {
            let segs = by_comp.remove(c.as_str()).unwrap_or_default();
            let buf = pool.buffer(c);
            for s in &segs {
                prop_assert!(s.addr >= buf.addr && s.end() <= buf.end(), "{s:?} outside {buf:?}");
            }
            let cov = cover(segs.iter().copied());
            prop_assert_eq!(&cov, &cover(coalesce(segs.iter().copied())));
            for a in &cov {
                prop_assert!(all.insert(*a), "K and V share byte {a:#x}");
            }
        }
        prop_assert_eq!(&all, &case.bytes_of(|_, _, _| true));
        let meta = pool.page_meta(&tokens).unwrap();
        prop_assert_eq!(meta.len(), case.pages.len() * pool.entries_per_page());
        prop_assert_eq!(meta.total_bytes(), all.len() as u64);
        prop_assert_eq!(&pool.page_meta_for_pages(&case.pages).unwrap(), &meta);
        // Aligned, consecutive input: SGLang's own checks give the same answer.
        prop_assert_eq!(&pool.with_checks(Checks::Sglang).page_meta(&tokens).unwrap(), &meta);
        // The coalesced form covers the same bytes per buffer.
        let co = pool.coalesced_meta(&tokens).unwrap();
        let co_cov = cover(co.iter().flat_map(|c| c.segments.iter().copied()));
        prop_assert_eq!(&co_cov, &all);
        // Page-major: one run per page and buffer, in page order.
        if pool.layout().is_page_major() {
            let g = pool.geometry();
            for (i, (ptr, len)) in meta.ptrs.iter().zip(&meta.lens).enumerate() {
                let comps = pool.components();
                let c = comps[i % comps.len()];
                let page = case.pages[i / comps.len()];
                prop_assert_eq!(*len, g.page_bytes(c));
                prop_assert_eq!(*ptr, pool.base(c) + page * g.page_bytes(c));
            }
        }
    }

    /// Split heads: group g of a page covers exactly heads [g*H/F, (g+1)*H/F) of it.
    #[test]
    fn split_heads_cover_their_heads(
        kind in prop_oneof![Just(PoolKind::Mha), Just(PoolKind::MhaSplit)],
        dims in dims_strategy(),
        factor_pick in 0..4usize,
        seed in any::<u64>(),
    ) {
        let g = geometry(kind, dims);
        let v_base = (kind == PoolKind::MhaSplit).then_some(0x100_0000);
        let pool = Pool::new(g, Layout::PageHead, 0x1000, v_base).unwrap();
        let divisors: Vec<u64> = (1..=g.heads()).filter(|f| g.heads().is_multiple_of(*f)).collect();
        let factor = divisors[factor_pick % divisors.len()];
        let pages: Vec<u64> = (0..g.pages()).filter(|p| (seed >> p) & 1 == 1).collect();
        let case = Case { pool, base: 0x1000, v_base, pages };
        let tokens = case.tokens();
        let mut segs = Vec::new();
        pool.for_each_split_heads_segment(&tokens, factor, |c, s| segs.push((c, s))).unwrap();
        let comps = pool.components().len();
        prop_assert_eq!(segs.len(), case.pages.len() * factor as usize * comps);
        let hg = g.heads() / factor;
        for (i, (c, s)) in segs.iter().enumerate() {
            let group = (i / comps) as u64 % factor;
            let page = case.pages[i / comps / factor as usize];
            let one = Case { pages: vec![page], ..case.clone() };
            let want = one.bytes_of(|cc, _, h| cc == *c && h / hg == group);
            prop_assert_eq!(cover([*s]), want);
        }
        if factor == 1 {
            prop_assert_eq!(pool.split_heads_meta(&tokens, 1).unwrap(), pool.page_meta(&tokens).unwrap());
        }
        // A factor that does not divide the heads is refused.
        let refused = matches!(
            pool.split_heads_meta(&tokens, g.heads() + 1),
            Err(LayoutError::SplitFactor { .. })
        );
        prop_assert!(refused, "factor {} accepted", g.heads() + 1);
    }

    /// Per-layer segments cover exactly that layer of the pages.
    #[test]
    fn layer_segments_cover_the_layer(case in case_strategy(), pick in 0..3u64) {
        let pool = &case.pool;
        let layer = pick % pool.geometry().layers();
        let tokens = case.tokens();
        let mut segs = Vec::new();
        pool.for_each_layer_segment(&tokens, layer, |_, s| segs.push(s)).unwrap();
        let want = case.bytes_of(|_, l, _| l == layer);
        prop_assert_eq!(&cover(segs.iter().copied()), &want);
        let view = pool.layer_view(&tokens, layer).unwrap();
        let v = cover(view.components.iter().flat_map(|c| c.segments.iter().copied()));
        prop_assert_eq!(&v, &want);
    }

    /// A plan between any two layouts moves every byte of every element to the same element
    /// of the destination page, once; runs are maximal and never mix K and V.
    #[test]
    fn plans_move_each_element_to_its_place(
        src in case_strategy(),
        dst_layout in layout_strategy(),
        dst_extra_pages in 0..3u64,
        seed in any::<u64>(),
    ) {
        let gs = *src.pool.geometry();
        prop_assume!(!(gs.kind() == PoolKind::Mla && dst_layout == Layout::PageHead));
        // Same model geometry, different layout, capacity and addresses.
        let kind = if gs.kind() == PoolKind::Mha && seed & 1 == 1 { PoolKind::MhaSplit } else { gs.kind() };
        let dims = (gs.layers(), gs.page_size(), gs.heads(), gs.head_dim(), gs.v_head_dim(), gs.dtype_bytes(), gs.pages() + dst_extra_pages);
        let gd = match kind {
            PoolKind::Mla => geometry(kind, (dims.0, dims.1, 1, gs.head_dim(), 0, dims.5, dims.6)),
            _ => geometry(kind, dims),
        };
        let dst_v = (kind != PoolKind::Mla).then_some(0x900_0000);
        let dst = Pool::new(gd, dst_layout, 0x800_0000, dst_v).unwrap();
        let n = gd.pages();
        // A destination page per source page, distinct, seeded.
        let mut free: Vec<u64> = (0..n).collect();
        let mut dst_pages = Vec::new();
        for i in 0..src.pages.len() {
            let pick = ((seed >> (i * 3 + 1)) as usize) % free.len();
            // Favour runs: often take the next free page after the previous one.
            let pick = if (seed >> (i + 30)) & 1 == 1 && i > 0 {
                free.iter().position(|&p| p == dst_pages[i - 1] + 1).unwrap_or(pick)
            } else { pick };
            dst_pages.push(free.remove(pick));
        }
        let p = plan(&src.pool, &dst, &src.pages, &dst_pages).unwrap();
        check_plan(&src, &dst, dst_v, &dst_pages, 0, 0, gs.heads(), &p)?;
    }

    /// Different TP degrees: the shared heads move, each to its local index on the other side.
    #[test]
    fn head_split_plans(
        kind in prop_oneof![Just(PoolKind::Mha), Just(PoolKind::MhaSplit)],
        src_layout in layout_strategy(),
        dst_layout in layout_strategy(),
        dims in dims_strategy(),
        tp in prop::sample::select(vec![(1u64, 2u64), (2, 1), (1, 4), (4, 2), (2, 2)]),
        ranks in (0..4u64, 0..4u64),
        seed in any::<u64>(),
    ) {
        // The model has `total` heads; each side holds total/tp of them.
        let total = 4;
        let (hs, hd) = (total / tp.0, total / tp.1);
        let (rs, rd) = (ranks.0 % tp.0, ranks.1 % tp.1);
        let (l, ps, _, d, dv, b, n) = dims;
        let gs = geometry(kind, (l, ps, hs, d, dv, b, n));
        let gd = geometry(kind, (l, ps, hd, d, dv, b, n));
        let v = |x| (kind == PoolKind::MhaSplit).then_some(x);
        let src_pool = Pool::new(gs, src_layout, 0x1000, v(0x100_0000)).unwrap();
        let dst = Pool::new(gd, dst_layout, 0x800_0000, v(0x900_0000)).unwrap();
        let shards = HeadShards::from_tp_ranks(&src_pool, rs, &dst, rd).unwrap();
        let (lo, hi) = ((rs * hs).max(rd * hd), ((rs + 1) * hs).min((rd + 1) * hd));
        let pages: Vec<u64> = (0..n).filter(|p| (seed >> p) & 1 == 1).collect();
        let dst_pages: Vec<u64> = pages.iter().map(|p| (p + (seed >> 50) % n) % n).collect();
        let src = Case { pool: src_pool, base: 0x1000, v_base: v(0x100_0000), pages };
        let r = plan_with_heads(&src.pool, &dst, &src.pages, &dst_pages, shards);
        if lo >= hi {
            let refused = matches!(r, Err(LayoutError::HeadShard { .. }));
            prop_assert!(refused, "disjoint shards accepted: {:?}", r);
        } else {
            check_plan(&src, &dst, v(0x900_0000), &dst_pages, lo - rs * hs, lo - rd * hd, hi - lo, &r.unwrap())?;
        }
    }

    /// The generic plan between two layer_first pools moves the same bytes as SGLang's PD
    /// connector plan over their per-layer bases, and never has more entries.
    #[test]
    fn pd_plan_agrees_with_layer_first_plan(
        kind in kind_strategy(),
        dims in dims_strategy(),
        seed in any::<u64>(),
    ) {
        let g = geometry(kind, dims);
        let v = |x| (kind != PoolKind::Mla).then_some(x);
        let src = Pool::new(g, Layout::LayerFirst, 0x1000, v(0x100_0000)).unwrap();
        let dst = Pool::new(g, Layout::LayerFirst, 0x800_0000, v(0x900_0000)).unwrap();
        let n = g.pages();
        let src_pages: Vec<u64> = (0..n).filter(|p| (seed >> p) & 1 == 1).collect();
        let dst_pages: Vec<u64> = src_pages.iter().map(|p| (p + (seed >> 50) % n) % n).collect();
        let layer_bases = |pool: &Pool, c| -> Vec<u64> {
            (0..g.layers()).map(|l| pool.base(c) + l * g.capacity() * g.row_bytes(c)).collect()
        };
        let comps = src.components();
        let lists: Vec<(Vec<u64>, Vec<u64>, u64)> = comps
            .iter()
            .map(|&c| (layer_bases(&src, c), layer_bases(&dst, c), g.layer_page_bytes(c)))
            .collect();
        let groups: Vec<PdBuffers<'_>> = lists
            .iter()
            .map(|(s, d, item_len)| PdBuffers { src: s, dst: d, item_len: *item_len })
            .collect();
        let pd = pd_connector_plan(&groups, &src_pages, &dst_pages).unwrap();
        let ours = plan(&src, &dst, &src_pages, &dst_pages).unwrap();
        prop_assert_eq!(byte_map(&pd), byte_map(&ours));
        prop_assert!(ours.len() <= pd.len());
    }
}

fn byte_map(p: &pagewire_layout::TransferPlan) -> BTreeMap<u64, u64> {
    let mut m = BTreeMap::new();
    for t in p.iter() {
        for i in 0..t.len {
            assert!(
                m.insert(t.src + i, t.dst + i).is_none(),
                "source byte twice"
            );
        }
    }
    m
}

/// Check that `p` maps, byte for byte, heads `[hs0, hs0+nh)` of the source pages onto heads
/// `[hd0, hd0+nh)` of the destination pages, nothing else; and that runs are maximal.
#[allow(clippy::too_many_arguments)]
fn check_plan(
    src: &Case,
    dst: &Pool,
    dst_v: Option<u64>,
    dst_pages: &[u64],
    hs0: u64,
    hd0: u64,
    nh: u64,
    p: &pagewire_layout::TransferPlan,
) -> Result<(), TestCaseError> {
    let g = src.pool.geometry();
    let mut want = BTreeMap::new();
    for &c in src.pool.components() {
        let sb = ref_base(&src.pool, src.base, src.v_base, c);
        let db = ref_base(dst, 0x800_0000, dst_v, c);
        let heads = if c == Component::Latent { 1 } else { nh };
        for (&ps, &pd) in src.pages.iter().zip(dst_pages) {
            for o in 0..g.page_size() {
                for l in 0..g.layers() {
                    for h in 0..heads {
                        for d in 0..g.component_dim(c) {
                            let s =
                                ref_addr(&src.pool, sb, c, ps * g.page_size() + o, l, hs0 + h, d);
                            let t = ref_addr(dst, db, c, pd * g.page_size() + o, l, hd0 + h, d);
                            for i in 0..g.dtype_bytes() {
                                want.insert(s + i, t + i);
                            }
                        }
                    }
                }
            }
        }
    }
    prop_assert_eq!(byte_map(p), want);
    // Maximal within a buffer: no two consecutive entries could be merged, unless they belong
    // to different buffers.
    let buf_of = |a: u64| {
        src.pool
            .components()
            .iter()
            .position(|&c| {
                let b = src.pool.buffer(c);
                a >= b.addr && a < b.end()
            })
            .unwrap()
    };
    let ts: Vec<_> = p.iter().collect();
    for w in ts.windows(2) {
        let mergeable = w[0].src + w[0].len == w[1].src && w[0].dst + w[0].len == w[1].dst;
        prop_assert!(
            !mergeable || buf_of(w[0].src) != buf_of(w[1].src),
            "unmerged neighbours {:?}",
            w
        );
    }
    Ok(())
}

proptest! {
    /// The PD connector plan is SGLang's loop, literally: runs from
    /// `group_concurrent_contiguous`, then for each group, layer and run one block.
    #[test]
    fn pd_plan_is_sglangs_loop(
        pairs in prop::collection::vec((0..12u64, 0..12u64), 0..24),
        layers in 1..4usize,
        k_item in 1..100u64,
        v_item in 1..100u64,
        with_v in any::<bool>(),
    ) {
        let (src_pages, dst_pages): (Vec<u64>, Vec<u64>) = pairs.into_iter().unzip();
        let bases = |b: u64| -> Vec<u64> { (0..layers as u64).map(|l| b + l * 0x10000).collect() };
        let (sk, dk, sv, dv) = (bases(0x100000), bases(0x800000), bases(0x200000), bases(0x900000));
        let mut groups = vec![PdBuffers { src: &sk, dst: &dk, item_len: k_item }];
        if with_v {
            groups.push(PdBuffers { src: &sv, dst: &dv, item_len: v_item });
        }
        let runs = page_runs(&src_pages, &dst_pages).unwrap();
        let mut want = Vec::new();
        for g in &groups {
            for l in 0..layers {
                for r in &runs {
                    want.push((g.src[l] + r.src * g.item_len, g.dst[l] + r.dst * g.item_len, g.item_len * r.count));
                }
            }
        }
        let got: Vec<_> = pd_connector_plan(&groups, &src_pages, &dst_pages)
            .unwrap()
            .iter()
            .map(|t| (t.src, t.dst, t.len))
            .collect();
        prop_assert_eq!(got, want);
    }
}

proptest! {
    /// With SGLang's own checks, any first slot that leaves the page inside the pool gives
    /// SGLang's formula (§4 of the reference), the other slots are ignored, and the visitor
    /// and the lists agree.
    #[test]
    fn sglang_checks_follow_sglangs_formula(
        case in case_strategy(),
        firsts in prop::collection::vec(any::<u64>(), 0..6),
        junk in any::<u64>(),
    ) {
        let pool = case.pool.with_checks(Checks::Sglang);
        prop_assume!(pool.sglang_has_meta());
        let g = *pool.geometry();
        let (p, s) = (g.page_size(), g.capacity());
        let firsts: Vec<u64> = firsts.iter().map(|f| f % (s - p + 1)).collect();
        let mut tokens = Vec::new();
        for &t0 in &firsts {
            tokens.push(t0);
            tokens.extend((1..p).map(|i| junk.wrapping_mul(i)));
        }
        let mut want = Vec::new();
        for &t0 in &firsts {
            match pool.layout() {
                Layout::LayerFirst => {
                    for l in 0..g.layers() {
                        for &c in pool.components() {
                            let row = g.row_bytes(c);
                            want.push((pool.base(c) + t0 * row + l * s * row, p * row));
                        }
                    }
                }
                layout => {
                    let floor = g.kind() == PoolKind::MhaSplit && layout == Layout::PageFirstDirect;
                    let unit = if floor { t0 / p * p } else { t0 };
                    for &c in pool.components() {
                        let row = g.row_bytes(c);
                        want.push((pool.base(c) + unit * g.layers() * row, g.layers() * p * row));
                    }
                }
            }
        }
        let meta = pool.page_meta(&tokens).unwrap();
        let got: Vec<_> = meta.iter().map(|s| (s.addr, s.len)).collect();
        prop_assert_eq!(&got, &want);
        let mut visited = Vec::new();
        pool.for_each_segment(&tokens, |_, s| visited.push((s.addr, s.len))).unwrap();
        prop_assert_eq!(&visited, &want);
    }
}

proptest! {
    /// Per-layer plans over a partition of the layers move, together, exactly the bytes of
    /// the whole plan.
    #[test]
    fn layer_range_plans_partition_the_plan(
        src in case_strategy(),
        dst_layout in layout_strategy(),
        cut in 0..3u64,
    ) {
        let g = *src.pool.geometry();
        prop_assume!(!(g.kind() == PoolKind::Mla && dst_layout == Layout::PageHead));
        let v = (g.kind() != PoolKind::Mla).then_some(0x900_0000);
        let dst = Pool::new(g, dst_layout, 0x800_0000, v).unwrap();
        let whole = plan(&src.pool, &dst, &src.pages, &src.pages).unwrap();
        let cut = 1 + cut % g.layers();
        let mut parts = BTreeMap::new();
        for range in [0..cut, cut..g.layers()] {
            let mut p = pagewire_layout::TransferPlan::new();
            let r = pagewire_layout::plan_layers_into(
                &src.pool, &dst, &src.pages, &src.pages, HeadShards::default(), range.clone(), &mut p,
            );
            if range.is_empty() {
                prop_assert!(r.is_err());
                continue;
            }
            r.unwrap();
            for (s, d) in byte_map(&p) {
                prop_assert!(parts.insert(s, d).is_none());
            }
        }
        prop_assert_eq!(parts, byte_map(&whole));
    }
}

proptest! {
    /// `page_meta_from_starts_into` is `page_meta_into` over the runs `t0..t0+P` of its
    /// first slots, under both checks: the same lists, or the same error (first slots
    /// anywhere: aligned or not, inside the pool, at its end, past it, near `u64::MAX`).
    #[test]
    fn from_starts_is_page_meta_of_the_runs(
        case in case_strategy(),
        strict in any::<bool>(),
        firsts in prop::collection::vec((0..4u8, any::<u64>()), 0..6),
    ) {
        let checks = if strict { Checks::Strict } else { Checks::Sglang };
        let pool = case.pool.with_checks(checks);
        let g = *pool.geometry();
        let (p, s) = (g.page_size(), g.capacity());
        let starts: Vec<u64> = firsts
            .iter()
            .map(|&(how, x)| match how {
                0 => x % g.pages() * p,     // a page start
                1 => x % s,                 // any slot inside
                2 => s - p + x % (2 * p),   // around the end
                _ => x,                     // anything
            })
            .collect();
        // Runs that wrap past u64::MAX are not slots of any index array.
        prop_assume!(starts.iter().all(|&t| t.checked_add(p).is_some()));
        let tokens: Vec<u64> = starts.iter().flat_map(|&t| t..t + p).collect();
        let mut want = pagewire_layout::Segments::default();
        let want = pool.page_meta_into(&tokens, &mut want).map(|()| want);
        let mut got = pagewire_layout::Segments::default();
        let got = pool.page_meta_from_starts_into(&starts, &mut got).map(|()| got);
        prop_assert_eq!(got, want);
    }
}
