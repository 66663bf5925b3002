//! Size bounds: geometries, base addresses and requests beyond the documented limits are
//! refused with a typed error before anything is allocated.
//!
//! The references compute every size in `u128` from the raw fields (no crate code), so the
//! crate's checked arithmetic is compared against plain multiplication that cannot wrap.

use pagewire_layout::{
    Component, HeadShards, Layout, LayoutError, MAX_ENTRIES, MAX_PLAN_BLOCKS, MAX_POOL_BYTES,
    PdBuffers, Pool, PoolGeometry, PoolKind, Segments, pd_connector_plan, plan_with_heads,
};
use proptest::prelude::*;

/// A field value spread over all magnitudes: `2^e + m` for `e` in 0..64, small `m`.
fn wide() -> impl Strategy<Value = u64> {
    (0..64u32, 0..4u64).prop_map(|(e, m)| (1u64 << e).saturating_add(m))
}

/// The raw fields of a geometry (`kind`, L, P, H, D, Dv, b, pages).
#[derive(Clone, Copy, Debug)]
struct Raw {
    kind: PoolKind,
    layers: u64,
    page_size: u64,
    heads: u64,
    head_dim: u64,
    v_head_dim: u64,
    dtype_bytes: u64,
    pages: u64,
}

impl Raw {
    fn capacity(&self) -> Option<u64> {
        self.pages.checked_mul(self.page_size)
    }

    fn build(&self) -> Result<PoolGeometry, LayoutError> {
        let b = PoolGeometry::builder(self.kind)
            .layers(self.layers)
            .page_size(self.page_size)
            .dtype_bytes(self.dtype_bytes)
            .capacity(self.capacity().unwrap());
        match self.kind {
            PoolKind::Mha => b.heads(self.heads).head_dim(self.head_dim),
            PoolKind::MhaSplit => b
                .heads(self.heads)
                .head_dim(self.head_dim)
                .v_head_dim(self.v_head_dim),
            _ => b.kv_dim(self.head_dim),
        }
        .build()
    }

    /// Bytes per token and layer of the K (or latent) and V buffers, in u128 (`None` past
    /// 2^128).
    fn rows(&self) -> Option<(u128, u128)> {
        let (h, b) = (self.heads as u128, self.dtype_bytes as u128);
        let row = |d: u64| h.checked_mul(d as u128)?.checked_mul(b);
        Some(match self.kind {
            PoolKind::Mha | PoolKind::MhaSplit => (row(self.head_dim)?, row(self.v_head_dim)?),
            _ => ((self.head_dim as u128).checked_mul(b)?, 0),
        })
    }

    /// Bytes of all buffers, in u128 (`None` past 2^128).
    fn total(&self) -> Option<u128> {
        let (k, v) = self.rows()?;
        (self.layers as u128)
            .checked_mul(self.capacity()? as u128)?
            .checked_mul(k.checked_add(v)?)
    }
}

fn raw_strategy() -> impl Strategy<Value = Raw> {
    (
        prop_oneof![
            Just(PoolKind::Mha),
            Just(PoolKind::MhaSplit),
            Just(PoolKind::Mla)
        ],
        (wide(), wide(), wide(), wide(), wide(), 1..=8u64, wide()),
    )
        .prop_filter_map(
            "capacity must fit in a u64",
            |(kind, (layers, page_size, heads, head_dim, v, dtype_bytes, pages))| {
                let raw = Raw {
                    kind,
                    layers,
                    page_size,
                    heads,
                    head_dim,
                    v_head_dim: if kind == PoolKind::Mha { head_dim } else { v },
                    dtype_bytes,
                    pages,
                };
                raw.capacity().map(|_| raw)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// A geometry is accepted exactly when its buffers together fit in MAX_POOL_BYTES, and
    /// then every derived size equals the u128 reference.
    #[test]
    fn geometry_accepted_iff_it_fits(raw in raw_strategy()) {
        let fits = raw.total().is_some_and(|t| t <= u128::from(MAX_POOL_BYTES));
        match raw.build() {
            Ok(g) => {
                prop_assert!(fits, "accepted {raw:?}");
                let (k, v) = raw.rows().unwrap();
                let (l, p, s) = (raw.layers as u128, raw.page_size as u128, raw.capacity().unwrap() as u128);
                let c0 = g.kind().components()[0];
                prop_assert_eq!(u128::from(g.row_bytes(c0)), k);
                prop_assert_eq!(u128::from(g.buffer_bytes(c0)), l * s * k);
                prop_assert_eq!(u128::from(g.page_bytes(c0)), l * p * k);
                prop_assert_eq!(u128::from(g.layer_page_bytes(c0)), p * k);
                prop_assert_eq!(u128::from(g.bytes_per_token()), l * (k + v));
                if raw.kind != PoolKind::Mla {
                    prop_assert_eq!(u128::from(g.buffer_bytes(Component::V)), l * s * v);
                }
            }
            Err(e) => {
                prop_assert!(!fits, "refused {raw:?}: {e}");
                let too_large = matches!(e, LayoutError::TooLarge { limit, .. } if limit == MAX_POOL_BYTES);
                prop_assert!(too_large, "{e:?}");
            }
        }
    }

    /// A pool is accepted exactly when each buffer ends at most at 2^64 - 1 (u128 ends).
    #[test]
    fn pool_accepted_iff_its_buffers_end_in_u64(
        kind in prop_oneof![Just(PoolKind::Mha), Just(PoolKind::MhaSplit), Just(PoolKind::Mla)],
        e in 40..57u32,
        base in prop_oneof![any::<u64>(), (0..=u64::MAX >> 6), (u64::MAX - (1 << 58))..=u64::MAX],
        v_base in prop_oneof![any::<u64>(), (u64::MAX - (1 << 58))..=u64::MAX],
        sep_v in any::<bool>(),
    ) {
        // Buffers of 2^e bytes (K and V each) at most MAX_POOL_BYTES together.
        let b = PoolGeometry::builder(kind).layers(1).page_size(1).dtype_bytes(1).capacity(1 << (e - 1));
        let g = match kind {
            PoolKind::Mla => b.kv_dim(2),
            _ => b.heads(1).head_dim(2).v_head_dim(2),
        }.build().unwrap();
        let v = match kind {
            PoolKind::Mla => None,
            PoolKind::MhaSplit => Some(v_base),
            _ => sep_v.then_some(v_base),
        };
        let size = 1u128 << e;
        let k_end = base as u128 + size;
        let v_start = match (kind, v) {
            (PoolKind::Mla, _) => None,
            (_, Some(v)) => Some(v as u128),
            (_, None) => Some(k_end),
        };
        let ends_fit = k_end <= u64::MAX as u128 && v_start.is_none_or(|v| v + size <= u64::MAX as u128);
        let overlap = v_start.is_some_and(|v| v < k_end && (base as u128) < v + size);
        match Pool::new(g, Layout::PageFirst, base, v) {
            Ok(_) => prop_assert!(ends_fit && !overlap),
            Err(LayoutError::Overflow { .. }) => prop_assert!(!ends_fit),
            Err(LayoutError::Base { .. }) => prop_assert!(ends_fit && overlap),
            Err(other) => prop_assert!(false, "unexpected {other:?}"),
        }
    }

    /// page_meta's entry count is checked up front against MAX_ENTRIES, exactly.
    #[test]
    fn meta_entries_accepted_iff_within_bound(
        layers in wide(),
        layout in prop::sample::select(Layout::ALL.to_vec()),
        pages in prop_oneof![0..4usize, wide().prop_map(|w| w as usize)],
        factor_e in 0..40u32,
    ) {
        let Ok(g) = PoolGeometry::builder(PoolKind::Mha)
            .layers(layers).page_size(1).heads(1 << factor_e).head_dim(1).dtype_bytes(1).capacity(1)
            .build() else { return Ok(()) };
        let pool = Pool::new(g, layout, 0x1000, None).unwrap();
        let want = match layout {
            Layout::LayerFirst => pages as u128 * layers as u128 * 2,
            _ => pages as u128 * 2,
        };
        let got = pool.meta_entries(pages);
        if want <= MAX_ENTRIES as u128 {
            prop_assert_eq!(got, Ok(want as usize));
        } else {
            let refused = matches!(got, Err(LayoutError::TooManyEntries { count, .. }) if count == want);
            prop_assert!(refused, "{:?}", got);
        }
        let factor = 1u64 << factor_e;
        let want = pages as u128 * factor as u128 * 2;
        let got = pool.split_heads_entries(pages, factor);
        if want <= MAX_ENTRIES as u128 {
            prop_assert_eq!(got, Ok(want as usize));
        } else {
            let refused = matches!(got, Err(LayoutError::TooManyEntries { count, .. }) if count == want);
            prop_assert!(refused, "{:?}", got);
        }
    }
}

/// The reported case: 2^40 layers of one 1-byte slot (a 2 TiB pool, K and V) in
/// `layer_first`, where one page has 2^41 entries.
fn absurd(layout: Layout) -> Pool {
    let g = PoolGeometry::builder(PoolKind::Mha)
        .layers(1 << 40)
        .page_size(1)
        .heads(1)
        .head_dim(1)
        .dtype_bytes(1)
        .capacity(1)
        .build()
        .unwrap();
    Pool::new(g, layout, 0x1000, None).unwrap()
}

fn too_many(r: Result<impl std::fmt::Debug, LayoutError>) -> LayoutError {
    match r {
        Err(e @ LayoutError::TooManyEntries { .. }) => e,
        other => panic!("expected TooManyEntries, got {other:?}"),
    }
}

#[test]
fn absurd_layer_count_is_refused_before_any_entry() {
    let pool = absurd(Layout::LayerFirst);
    let e = too_many(pool.page_meta(&[0]));
    assert_eq!(
        e.to_string(),
        "page_meta of pages x layers x buffers: 2199023255552 entries, more than the limit \
         of 268435456; split the request"
    );
    let mut out = Segments::default();
    too_many(pool.page_meta_into(&[0], &mut out));
    assert_eq!(out.ptrs.capacity(), 0, "nothing reserved");
    too_many(pool.page_meta_for_pages(&[0]));
    too_many(pool.page_meta_from_starts_into(&[0], &mut out));
    let mut calls = 0;
    too_many(pool.for_each_segment(&[0], |_, _| calls += 1));
    too_many(pool.for_each_page_segment(&[0], |_, _| calls += 1));
    assert_eq!(calls, 0);
    too_many(pool.coalesced_meta(&[0]));
    too_many(pool.layer_views(&[0]));
    // An empty request is still answered.
    assert!(pool.page_meta(&[]).unwrap().is_empty());
    // One layer of one page is small; plans over all layers are not.
    assert_eq!(pool.layer_view(&[0], 7).unwrap().components.len(), 2);
    for dst in [Layout::LayerFirst, Layout::PageFirst] {
        let e = too_many(plan_with_heads(
            &pool,
            &absurd(dst),
            &[0],
            &[0],
            HeadShards::default(),
        ));
        assert!(matches!(e, LayoutError::TooManyEntries { limit, .. } if limit == MAX_PLAN_BLOCKS));
    }
}

#[test]
fn absurd_requests_are_refused() {
    // page_head with 2^20 heads and 2^20 tokens per page: one layer of one page is 2^40
    // (head, token) runs.
    let g = PoolGeometry::builder(PoolKind::Mha)
        .layers(2)
        .page_size(1 << 20)
        .heads(1 << 20)
        .head_dim(1)
        .dtype_bytes(1)
        .capacity(1 << 20)
        .build()
        .unwrap();
    let pool = Pool::new(g, Layout::PageHead, 0x1000, None).unwrap();
    let page: Vec<u64> = (0..1 << 20).collect();
    too_many(pool.layer_view(&page, 0));
    // page_meta of that page is 2 entries.
    assert_eq!(pool.page_meta(&page).unwrap().len(), 2);
    // A split of 2^28 heads into 2^28 groups: 2^29 entries for one page.
    let g = PoolGeometry::builder(PoolKind::Mha)
        .layers(1)
        .page_size(1)
        .heads(1 << 28)
        .head_dim(1)
        .dtype_bytes(1)
        .capacity(1)
        .build()
        .unwrap();
    let pool = Pool::new(g, Layout::PageHead, 0x1000, None).unwrap();
    too_many(pool.split_heads_meta(&[0], 1 << 28));
    assert_eq!(pool.split_heads_meta(&[0], 1 << 20).unwrap().len(), 1 << 21);

    // PD plan: 2^33 layers' worth of blocks (per-layer bases repeated) for one page is
    // refused up front without walking them.
    let bases = vec![0x1000u64; 1 << 17];
    let groups = vec![
        PdBuffers {
            src: &bases,
            dst: &bases,
            item_len: 8,
        };
        1 << 16
    ];
    let e = too_many(pd_connector_plan(&groups, &[0], &[0]));
    assert!(matches!(e, LayoutError::TooManyEntries { count, .. } if count == 1 << 33));
}

#[test]
fn too_large_geometry_names_the_product() {
    let e = PoolGeometry::builder(PoolKind::Mha)
        .layers(1 << 40)
        .page_size(1)
        .heads(1 << 10)
        .head_dim(128)
        .dtype_bytes(2)
        .capacity(1)
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "pool too large: layers x capacity x heads x (head_dim + v_head_dim) x dtype_bytes \
         = 576460752303423488 bytes, more than the limit of 144115188075855872 bytes (2^57)"
    );
    let e = PoolGeometry::builder(PoolKind::Mla)
        .layers(u64::MAX)
        .page_size(u64::MAX)
        .kv_dim(u64::MAX)
        .dtype_bytes(u64::MAX)
        .capacity(u64::MAX)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("at least 2^128 bytes"), "{e}");
}
