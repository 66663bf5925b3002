//! The receiving side's check: its whole pool against the plan, with the source bytes
//! regenerated from the seed (no copy of the source pool).
use pagewire_layout::PoolGeometry;

use super::PagesArgs;
use super::presets::{place, pool_bytes};
use super::workload::{mapping, source_seed};

/// Receiver's check, over its whole pool and without a copy of it: every transfer of the
/// plan must have put the source pattern (regenerated from the seed at the transfer's
/// source offset) at its destination, and every byte outside those ranges must still be
/// the zero it started as. `Ok(Err(..))` names the first wrong byte.
pub(super) fn verify_pool(
    a: &PagesArgs,
    g: PoolGeometry,
    received: &[u8],
) -> anyhow::Result<Result<String, String>> {
    let (bytes, _) = pool_bytes(&g);
    anyhow::ensure!(
        received.len() as u64 >= bytes,
        "pool of {} B, expected {bytes}",
        received.len()
    );
    let src = place(g, a.src_layout(), 0)?;
    let dst = place(g, a.dst_layout(), 0)?;
    let m = mapping(a)?;
    let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst)?;
    let seed = source_seed(a);
    let mut runs: Vec<(u64, u64, u64)> = plan.iter().map(|t| (t.dst, t.src, t.len)).collect();
    runs.sort_unstable();
    let zero_from = |from: u64, to: u64| {
        received[from as usize..to as usize]
            .iter()
            .position(|&b| b != 0)
            .map(|i| {
                let at = from as usize + i;
                format!(
                    "pool byte {at} is {:#04x}, expected 0x00 (outside the moved pages)",
                    received[at]
                )
            })
    };
    let mut want = vec![0u8; 1 << 16];
    let mut pos = 0u64;
    let mut moved = 0u64;
    for (d, src_off, len) in runs {
        anyhow::ensure!(
            d >= pos && d + len <= bytes,
            "plan destination {d}+{len} overlaps another or leaves the pool"
        );
        if let Some(e) = zero_from(pos, d) {
            return Ok(Err(e));
        }
        let mut off = 0u64;
        while off < len {
            let n = (len - off).min(want.len() as u64);
            let w = &mut want[..n as usize];
            crate::bench::pattern::fill_at_byte(w, seed, src_off + off);
            let at = (d + off) as usize;
            let got = &received[at..at + n as usize];
            if let Some(i) = got.iter().zip(w.iter()).position(|(x, y)| x != y) {
                return Ok(Err(format!(
                    "pool byte {} is {:#04x}, expected {:#04x}",
                    at + i,
                    got[i],
                    w[i]
                )));
            }
            off += n;
        }
        moved += len;
        pos = d + len;
    }
    if let Some(e) = zero_from(pos, bytes) {
        return Ok(Err(e));
    }
    Ok(Ok(format!(
        "the receiver checked all {bytes} B of its pool: {moved} B moved as the plan says, \
         the rest untouched"
    )))
}

#[cfg(test)]
mod tests {
    use super::super::presets::geometry;
    use super::*;
    use crate::bench::pages::parse;
    use pagewire_layout::{Component, TransferPlan};

    /// Replays `plan` with memcpy: `src_mem` starts at address `src_base`, `dst_mem` at
    /// `dst_base`: the reference `verify_pool` is tested against.
    fn replay(
        plan: &TransferPlan,
        src_mem: &[u8],
        src_base: u64,
        dst_mem: &mut [u8],
        dst_base: u64,
    ) -> anyhow::Result<()> {
        for t in plan.iter() {
            let s = t
                .src
                .checked_sub(src_base)
                .ok_or_else(|| anyhow::anyhow!("plan source {:#x} below its pool", t.src))?
                as usize;
            let d =
                t.dst.checked_sub(dst_base).ok_or_else(|| {
                    anyhow::anyhow!("plan destination {:#x} below its pool", t.dst)
                })? as usize;
            let n = t.len as usize;
            anyhow::ensure!(
                s + n <= src_mem.len() && d + n <= dst_mem.len(),
                "plan transfer {t:?} outside the pools"
            );
            dst_mem[d..d + n].copy_from_slice(&src_mem[s..s + n]);
        }
        Ok(())
    }

    #[test]
    fn replay_moves_pages_across_layouts() {
        let a = parse(&[
            "--pages",
            "3",
            "--pool-pages",
            "6",
            "--layers",
            "2",
            "--page-size",
            "2",
            "--src-layout",
            "layer_first",
            "--dst-layout",
            "page_head",
            "--model",
            "mimo-v2",
        ]);
        let g = geometry(&a).unwrap();
        let (bytes, _) = pool_bytes(&g);
        let src = place(g, a.src_layout(), 0).unwrap();
        // SGLang refuses page_head for head_dim != v_head_dim; the layout crate extends it.
        let dst = place(g, a.dst_layout(), 0).unwrap();
        let m = mapping(&a).unwrap();
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
        let mut s = vec![0u8; bytes as usize];
        crate::bench::pattern::fill(&mut s, 9);
        let mut d = vec![0u8; bytes as usize];
        replay(&plan, &s, 0, &mut d, 0).unwrap();
        // Element (K, token 0 of the page, layer 1, head 3, dim 5) moved with its page.
        let (sp, dp) = (m.src[1], m.dst[1]);
        let se = src.element_addr(Component::K, sp * 2, 1, 3, 5).unwrap() as usize;
        let de = dst.element_addr(Component::K, dp * 2, 1, 3, 5).unwrap() as usize;
        assert_eq!(s[se..se + 2], d[de..de + 2]);
    }

    /// The receiver's check agrees with a replay of the plan into a zeroed pool: it
    /// accepts exactly that pool, and names the first byte of any other.
    #[test]
    fn verify_pool_accepts_the_replay_and_names_a_wrong_byte() {
        for (model, src_l, dst_l, pattern) in [
            ("llama3-8b", "page_first", "layer_first", "random"),
            ("mimo-v2", "layer_first", "page_head", "fragmented"),
            (
                "deepseek-v3",
                "page_first_direct",
                "page_first",
                "contiguous",
            ),
        ] {
            let a = parse(&[
                "--model",
                model,
                "--layers",
                "2",
                "--page-size",
                "2",
                "--pages",
                "5",
                "--pool-pages",
                "12",
                "--src-layout",
                src_l,
                "--dst-layout",
                dst_l,
                "--pattern",
                pattern,
            ]);
            let g = geometry(&a).unwrap();
            let (bytes, _) = pool_bytes(&g);
            let src = place(g, a.src_layout(), 0).unwrap();
            let dst = place(g, a.dst_layout(), 0).unwrap();
            let m = mapping(&a).unwrap();
            let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
            let mut s = vec![0u8; bytes as usize];
            crate::bench::pattern::fill(&mut s, source_seed(&a));
            let mut d = vec![0u8; bytes as usize];
            replay(&plan, &s, 0, &mut d, 0).unwrap();
            assert!(verify_pool(&a, g, &d).unwrap().is_ok(), "{model}");
            // A moved byte, and a byte outside the moved pages, each caught by offset.
            let moved = plan.iter().next().unwrap().dst as usize + 3;
            let outside = (0..d.len())
                .rev()
                .find(|&i| d[i] == 0 && s[i] != 0)
                .unwrap();
            for at in [moved, outside] {
                let mut bad = d.clone();
                bad[at] ^= 0x5a;
                let e = verify_pool(&a, g, &bad).unwrap().unwrap_err();
                assert!(e.starts_with(&format!("pool byte {at} ")), "{model}: {e}");
            }
        }
    }
}
