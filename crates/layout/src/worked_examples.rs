//! Worked examples E1-E5: SGLang's host-pool formulas (`get_page_buffer_meta`,
//! https://github.com/sgl-project/sglang, `python/sglang/srt/mem_cache/pool_host/`)
//! evaluated by hand on small pools.
//!
//! Parameters: L=2, P=4, H=2, D=3, Dv=2, b=2, S=32 (N=8); indices 8..16 (pages 2 and 3).

use crate::*;

fn mha() -> PoolGeometry {
    PoolGeometry::builder(PoolKind::Mha)
        .layers(2)
        .page_size(4)
        .heads(2)
        .head_dim(3)
        .dtype_bytes(2)
        .capacity(32)
        .build()
        .unwrap()
}

fn split() -> PoolGeometry {
    PoolGeometry::builder(PoolKind::MhaSplit)
        .layers(2)
        .page_size(4)
        .heads(2)
        .head_dim(3)
        .v_head_dim(2)
        .dtype_bytes(2)
        .capacity(32)
        .build()
        .unwrap()
}

fn mla() -> PoolGeometry {
    PoolGeometry::builder(PoolKind::Mla)
        .layers(2)
        .page_size(4)
        .kv_dim(5)
        .dtype_bytes(2)
        .capacity(32)
        .build()
        .unwrap()
}

fn indices() -> Vec<u64> {
    (8..16).collect()
}

fn seg(addr: u64, len: u64) -> Segment {
    Segment { addr, len }
}

#[test]
fn e1_symmetric_page_major() {
    for layout in [Layout::PageFirst, Layout::PageFirstDirect, Layout::PageHead] {
        let pool = Pool::new(mha(), layout, 0x1000, None).unwrap();
        let m = pool.page_meta(&indices()).unwrap();
        assert_eq!(m.ptrs, [0x10C0, 0x13C0, 0x1120, 0x1420], "{layout}");
        assert_eq!(m.lens, [96; 4], "{layout}");
        // The same pool modelled as two buffers.
        let pool = Pool::new(mha(), layout, 0x1000, Some(0x9000)).unwrap();
        let m = pool.page_meta(&indices()).unwrap();
        assert_eq!(m.ptrs, [0x10C0, 0x90C0, 0x1120, 0x9120], "{layout}");
    }
    // Byte-order check: element (V, t=13, l=1, h=0, d=2).
    for (layout, want) in [
        (Layout::PageFirst, 0x1448),
        (Layout::PageFirstDirect, 0x1460),
        (Layout::PageHead, 0x1436),
        (Layout::LayerFirst, 0x1520),
    ] {
        let pool = Pool::new(mha(), layout, 0x1000, None).unwrap();
        assert_eq!(
            pool.element_addr(Component::V, 13, 1, 0, 2).unwrap(),
            want,
            "{layout}"
        );
    }
}

#[test]
fn e2_symmetric_layer_first() {
    let pool = Pool::new(mha(), Layout::LayerFirst, 0x1000, None).unwrap();
    let m = pool.page_meta(&indices()).unwrap();
    assert_eq!(
        m.ptrs,
        [
            0x1060, 0x1360, 0x11E0, 0x14E0, 0x1090, 0x1390, 0x1210, 0x1510
        ]
    );
    assert_eq!(m.lens, [48; 8]);
    let views = pool.layer_views(&indices()).unwrap();
    let table: Vec<_> = views
        .iter()
        .map(|v| {
            (
                v.layer,
                v.components[0].segments.clone(),
                v.components[1].segments.clone(),
            )
        })
        .collect();
    assert_eq!(
        table,
        [
            (0, vec![seg(0x1060, 96)], vec![seg(0x1360, 96)]),
            (1, vec![seg(0x11E0, 96)], vec![seg(0x14E0, 96)]),
        ]
    );
}

#[test]
fn e3_asymmetric() {
    for layout in [Layout::PageFirst, Layout::PageFirstDirect] {
        let pool = Pool::new(split(), layout, 0x1000, Some(0x9000)).unwrap();
        assert!(pool.sglang_has_meta());
        let m = pool.page_meta(&indices()).unwrap();
        assert_eq!(m.ptrs, [0x10C0, 0x9080, 0x1120, 0x90C0], "{layout}");
        assert_eq!(m.lens, [96, 64, 96, 64], "{layout}");
    }
    let pf = Pool::new(split(), Layout::PageFirst, 0x1000, Some(0x9000)).unwrap();
    let pfd = Pool::new(split(), Layout::PageFirstDirect, 0x1000, Some(0x9000)).unwrap();
    assert_eq!(pf.element_addr(Component::V, 13, 1, 0, 1).unwrap(), 0x90DA);
    assert_eq!(pfd.element_addr(Component::V, 13, 1, 0, 1).unwrap(), 0x90EA);
    assert_eq!(pf.element_addr(Component::K, 13, 1, 1, 2).unwrap(), 0x114E);
    assert_eq!(pfd.element_addr(Component::K, 13, 1, 1, 2).unwrap(), 0x1166);

    // Extension: layer_first, which SGLang refuses.
    let lf = Pool::new(split(), Layout::LayerFirst, 0x1000, Some(0x9000)).unwrap();
    assert!(!lf.sglang_has_meta());
    let m = lf.page_meta(&indices()).unwrap();
    assert_eq!(
        m.ptrs,
        [
            0x1060, 0x9040, 0x11E0, 0x9140, 0x1090, 0x9060, 0x1210, 0x9160
        ]
    );
    assert_eq!(m.lens, [48, 32, 48, 32, 48, 32, 48, 32]);
    let views = lf.layer_views(&indices()).unwrap();
    assert_eq!(views[0].components[0].segments, [seg(0x1060, 96)]);
    assert_eq!(views[0].components[1].segments, [seg(0x9040, 64)]);
    assert_eq!(views[1].components[0].segments, [seg(0x11E0, 96)]);
    assert_eq!(views[1].components[1].segments, [seg(0x9140, 64)]);
    // The coalesced meta lists the same runs layer by layer.
    let c = lf.coalesced_meta(&indices()).unwrap();
    assert_eq!(c[0].segments, [seg(0x1060, 96), seg(0x11E0, 96)]);
    assert_eq!(c[1].segments, [seg(0x9040, 64), seg(0x9140, 64)]);
}

#[test]
fn e4_split_heads() {
    let pool = Pool::new(mha(), Layout::PageHead, 0x1000, None).unwrap();
    let m = pool.split_heads_meta(&indices(), 2).unwrap();
    assert_eq!(
        m.ptrs,
        [
            0x10C0, 0x13C0, 0x10F0, 0x13F0, 0x1120, 0x1420, 0x1150, 0x1450
        ]
    );
    assert_eq!(m.lens, [48; 8]);

    let asym = Pool::new(split(), Layout::PageHead, 0x1000, Some(0x9000)).unwrap();
    let m = asym.split_heads_meta(&indices(), 2).unwrap();
    assert_eq!(
        m.ptrs,
        [
            0x10C0, 0x9080, 0x10F0, 0x90A0, 0x1120, 0x90C0, 0x1150, 0x90E0
        ]
    );
    assert_eq!(m.lens, [48, 32, 48, 32, 48, 32, 48, 32]);
    // Unsplit it gives E3's pointers; split factor 1 is the unsplit list.
    let m = asym.page_meta(&indices()).unwrap();
    assert_eq!(m.ptrs, [0x10C0, 0x9080, 0x1120, 0x90C0]);
    assert_eq!(asym.split_heads_meta(&indices(), 1).unwrap(), m);

    assert_eq!(
        pool.split_heads_meta(&indices(), 3),
        Err(LayoutError::SplitFactor {
            factor: 3,
            heads: 2
        })
    );
    let pf = Pool::new(mha(), Layout::PageFirst, 0x1000, None).unwrap();
    assert_eq!(
        pf.split_heads_meta(&indices(), 2),
        Err(LayoutError::SplitHeadsLayout {
            kind: PoolKind::Mha,
            layout: Layout::PageFirst
        })
    );
}

#[test]
fn e5_mla_and_pd_plan() {
    for layout in [Layout::PageFirst, Layout::PageFirstDirect] {
        let pool = Pool::new(mla(), layout, 0x1000, None).unwrap();
        let m = pool.page_meta(&indices()).unwrap();
        assert_eq!(m.ptrs, [0x10A0, 0x10F0], "{layout}");
        assert_eq!(m.lens, [80, 80], "{layout}");
    }
    let lf = Pool::new(mla(), Layout::LayerFirst, 0x1000, None).unwrap();
    let m = lf.page_meta(&indices()).unwrap();
    assert_eq!(m.ptrs, [0x1050, 0x1190, 0x1078, 0x11B8]);
    assert_eq!(m.lens, [40; 4]);
    assert_eq!(
        Pool::new(mla(), Layout::PageHead, 0x1000, None),
        Err(LayoutError::UnsupportedLayout {
            kind: PoolKind::Mla,
            layout: Layout::PageHead
        })
    );

    // PD plan for the asymmetric device pool.
    let src_tokens: Vec<u64> = (8..16).chain([20, 21, 22]).collect();
    // kv_to_page_indices: every P-th token, divided by P.
    let src_pages: Vec<u64> = src_tokens.iter().step_by(4).map(|t| t / 4).collect();
    assert_eq!(src_pages, [2, 3, 5]);
    let plan = pd_connector_plan(
        &[
            PdBuffers {
                src: &[0x100000, 0x110000],
                dst: &[0x800000, 0x810000],
                item_len: 48,
            },
            PdBuffers {
                src: &[0x120000, 0x130000],
                dst: &[0x820000, 0x830000],
                item_len: 32,
            },
        ],
        &src_pages,
        &[10, 11, 20],
    )
    .unwrap();
    let want = [
        (0x100060, 0x8001E0, 96),
        (0x1000F0, 0x8003C0, 48),
        (0x110060, 0x8101E0, 96),
        (0x1100F0, 0x8103C0, 48),
        (0x120040, 0x820140, 64),
        (0x1200A0, 0x820280, 32),
        (0x130040, 0x830140, 64),
        (0x1300A0, 0x830280, 32),
    ];
    let got: Vec<_> = plan.iter().map(|t| (t.src, t.dst, t.len)).collect();
    assert_eq!(got, want);
}

#[test]
fn index_validation() {
    let pool = Pool::new(mha(), Layout::PageFirstDirect, 0x1000, None).unwrap();
    assert_eq!(
        pool.page_meta(&[8, 9, 10]),
        Err(LayoutError::IndexCount {
            count: 3,
            page_size: 4
        })
    );
    assert_eq!(
        pool.page_meta(&[8, 9, 10, 11, 12, 13, 15, 14]),
        Err(LayoutError::NonConsecutive {
            position: 1,
            offset: 2,
            found: 15,
            expected: 14
        })
    );
    assert_eq!(
        pool.page_meta(&[9, 10, 11, 12]),
        Err(LayoutError::Misaligned {
            position: 0,
            slot: 9,
            page_size: 4
        })
    );
    assert_eq!(
        pool.page_meta(&[32, 33, 34, 35]),
        Err(LayoutError::SlotOutOfRange {
            slot: 32,
            capacity: 32
        })
    );
    assert_eq!(
        pool.page_meta_for_pages(&[8]),
        Err(LayoutError::PageOutOfRange { page: 8, pages: 8 })
    );
    // SGLang's own checks: only the first slot of each page is read, never floored.
    let lenient = pool.with_checks(Checks::Sglang);
    let m = lenient.page_meta(&[9, 0, 0, 0]).unwrap();
    assert_eq!(m.ptrs, [0x1000 + 9 * 24, 0x1300 + 9 * 24]);
    assert_eq!(
        lenient.page_meta(&[29, 0, 0, 0]),
        Err(LayoutError::SlotOutOfRange {
            slot: 32,
            capacity: 32
        })
    );
    // The asymmetric page_first_direct floors slot 9 to page 2.
    let asym = Pool::new(split(), Layout::PageFirstDirect, 0x1000, Some(0x9000))
        .unwrap()
        .with_checks(Checks::Sglang);
    assert_eq!(
        asym.page_meta(&[9, 0, 0, 0]).unwrap().ptrs,
        [0x10C0, 0x9080]
    );
    // Extensions have no SGLang answer to mimic: alignment is still required.
    let ext = Pool::new(split(), Layout::PageHead, 0x1000, Some(0x9000))
        .unwrap()
        .with_checks(Checks::Sglang);
    assert!(matches!(
        ext.page_meta(&[9, 10, 11, 12]),
        Err(LayoutError::Misaligned { slot: 9, .. })
    ));
}

#[test]
fn base_validation() {
    assert!(matches!(
        Pool::new(split(), Layout::PageFirst, 0x1000, None),
        Err(LayoutError::Base { .. })
    ));
    assert!(matches!(
        Pool::new(mla(), Layout::PageFirst, 0x1000, Some(0x9000)),
        Err(LayoutError::Base { .. })
    ));
    // K is 0x300 bytes: a V buffer at 0x12FF overlaps it.
    assert!(matches!(
        Pool::new(mha(), Layout::PageFirst, 0x1000, Some(0x12FF)),
        Err(LayoutError::Base { .. })
    ));
    assert!(Pool::new(mha(), Layout::PageFirst, 0x1000, Some(0x1300)).is_ok());
    assert_eq!(
        Pool::new(mha(), Layout::PageFirst, u64::MAX - 0x100, None),
        Err(LayoutError::Overflow {
            what: "end of the K buffer"
        })
    );
}

#[test]
fn plans_refuse_bad_page_lists() {
    let a = Pool::new(mha(), Layout::PageFirst, 0x1000, None).unwrap();
    let b = Pool::new(mha(), Layout::PageHead, 0x10000, None).unwrap();
    assert_eq!(
        plan(&a, &b, &[1, 2, 3], &[4, 5, 4]),
        Err(LayoutError::DuplicatePage { page: 4 })
    );
    // One source to two destinations is a broadcast, not a race.
    assert!(plan(&a, &b, &[1, 1], &[6, 2]).is_ok());
    assert_eq!(
        plan(&a, &b, &[1, 8], &[2, 3]),
        Err(LayoutError::PageOutOfRange { page: 8, pages: 8 })
    );
    assert!(matches!(
        plan(&a, &b, &[1, 2], &[3]),
        Err(LayoutError::LengthMismatch {
            left: 2,
            right: 1,
            ..
        })
    ));
    let m = Pool::new(mla(), Layout::PageFirst, 0x100000, None).unwrap();
    assert!(matches!(
        plan(&a, &m, &[1], &[1]),
        Err(LayoutError::KindMismatch { .. })
    ));
    let wide = PoolGeometry::builder(PoolKind::Mha)
        .layers(2)
        .page_size(4)
        .heads(4)
        .head_dim(3)
        .dtype_bytes(2)
        .capacity(32)
        .build()
        .unwrap();
    let w = Pool::new(wide, Layout::PageFirst, 0x100000, None).unwrap();
    assert_eq!(
        plan(&a, &w, &[1], &[1]),
        Err(LayoutError::GeometryMismatch {
            what: "heads",
            src: 2,
            dst: 4
        })
    );
    // Different TP: source rank 0 of TP 2 (heads 0..2) into a TP-1 pool of 4 heads.
    let p = plan_with_heads(&a, &w, &[1], &[1], HeadShards::default()).unwrap();
    assert_eq!(p.total_bytes(), 2 * 96);
    // Shards with no common head.
    let shards = HeadShards {
        src_first_head: 0,
        dst_first_head: 2,
    };
    assert!(matches!(
        plan_with_heads(&a, &a, &[1], &[1], shards),
        Err(LayoutError::HeadShard { .. })
    ));
}
