//! What a run moves: the direction, the seeded draw of pages on each side, the
//! figures of the plan built from them, and the bytes the source pool starts with.
use clap::ValueEnum;
use pagewire_layout::{Pool, TransferPlan};

use super::PagesArgs;

/// Which pages of the pools a run moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Pages 0..N on both sides: the plan coalesces into a few large runs.
    Contiguous,
    /// N distinct pages drawn uniformly on each side: nothing coalesces.
    Random,
    /// Runs of 1..=8 consecutive pages separated by gaps of 1..=8: partial coalescing.
    Fragmented,
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Contiguous => "contiguous",
            Pattern::Random => "random",
            Pattern::Fragmented => "fragmented",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PageOp {
    /// The client writes its pages into the server's pool.
    Write,
    /// The client reads the server's pages into its pool.
    Read,
}

/// A small deterministic generator (splitmix64) so both ends draw the same pages.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0); the modulo bias is irrelevant at these sizes.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `n` distinct pages of a pool of `pool` pages, following `pattern`.
pub fn draw_pages(pattern: Pattern, n: u64, pool: u64, rng: &mut Rng) -> anyhow::Result<Vec<u64>> {
    anyhow::ensure!(n <= pool, "cannot pick {n} pages from a pool of {pool}");
    Ok(match pattern {
        Pattern::Contiguous => (0..n).collect(),
        Pattern::Random => {
            // Partial Fisher-Yates over the page ids.
            let mut ids: Vec<u64> = (0..pool).collect();
            for i in 0..n as usize {
                let j = i + rng.below(pool - i as u64) as usize;
                ids.swap(i, j);
            }
            ids.truncate(n as usize);
            ids
        }
        Pattern::Fragmented => {
            let mut out = Vec::with_capacity(n as usize);
            let mut p = rng.below(8);
            while (out.len() as u64) < n {
                let run = 1 + rng.below(8);
                for _ in 0..run {
                    if (out.len() as u64) == n {
                        break;
                    }
                    if p >= pool {
                        // Wrapped: fall back to the lowest unused pages, in order.
                        break;
                    }
                    out.push(p);
                    p += 1;
                }
                p += 1 + rng.below(8);
                if p >= pool && (out.len() as u64) < n {
                    let used: std::collections::HashSet<u64> = out.iter().copied().collect();
                    out.extend(
                        (0..pool)
                            .filter(|q| !used.contains(q))
                            .take(n as usize - out.len()),
                    );
                }
            }
            out
        }
    })
}

/// The page mapping of a run: `src[i]` moves to `dst[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub src: Vec<u64>,
    pub dst: Vec<u64>,
}

pub fn mapping(a: &PagesArgs) -> anyhow::Result<Mapping> {
    let mut rng = Rng::new(a.seed);
    let pool = a.pool_pages();
    let src = draw_pages(a.pattern, a.pages, pool, &mut rng)?;
    let dst = draw_pages(a.pattern, a.pages, pool, &mut rng)?;
    Ok(Mapping { src, dst })
}

/// Figures about a plan for the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PlanStats {
    /// Per-page segments of the source (SGLang's `get_page_buffer_meta` entries).
    pub segments_raw: u64,
    /// Transfers in the coalesced plan.
    pub segments_plan: u64,
    /// Work requests after slicing at the engine's largest WR.
    pub work_requests: u64,
    pub bytes: u64,
}

pub fn plan_stats(src: &Pool, plan: &TransferPlan, pages: u64, max_wr: u64) -> PlanStats {
    let max_wr = max_wr.max(1);
    PlanStats {
        segments_raw: pages * src.entries_per_page() as u64,
        segments_plan: plan.len() as u64,
        work_requests: plan.lens().iter().map(|l| l.div_ceil(max_wr)).sum(),
        bytes: plan.total_bytes(),
    }
}

/// The pool content the source side starts with; the receiver regenerates it.
pub(super) fn source_seed(a: &PagesArgs) -> u64 {
    crate::bench::pattern::seed_for("pages", a.seed, 0)
}

#[cfg(test)]
mod tests {
    use super::super::presets::{geometry, place, pool_bytes};
    use super::*;
    use crate::bench::pages::parse;
    use pagewire_layout::Component;

    #[test]
    fn draws_are_distinct_in_range_and_deterministic() {
        for pattern in [Pattern::Contiguous, Pattern::Random, Pattern::Fragmented] {
            for (n, pool) in [(1, 1), (5, 5), (32, 128), (100, 101), (64, 64)] {
                let a = draw_pages(pattern, n, pool, &mut Rng::new(7)).unwrap();
                let b = draw_pages(pattern, n, pool, &mut Rng::new(7)).unwrap();
                assert_eq!(a, b);
                assert_eq!(a.len() as u64, n, "{pattern:?} {n}/{pool}");
                let set: std::collections::HashSet<_> = a.iter().collect();
                assert_eq!(set.len() as u64, n, "{pattern:?} duplicates");
                assert!(a.iter().all(|&p| p < pool));
            }
        }
        assert!(draw_pages(Pattern::Random, 3, 2, &mut Rng::new(1)).is_err());
    }

    #[test]
    fn contiguous_coalesces_and_random_does_not() {
        let a = parse(&[
            "--pages",
            "16",
            "--pool-pages",
            "64",
            "--layers",
            "2",
            "--pattern",
            "contiguous",
        ]);
        let g = geometry(&a).unwrap();
        let (bytes, _) = pool_bytes(&g);
        let src = place(g, a.src_layout(), 0x10_0000).unwrap();
        let dst = place(g, a.dst_layout(), 0x10_0000 + bytes).unwrap();
        let m = mapping(&a).unwrap();
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
        let st = plan_stats(&src, &plan, 16, 1 << 20);
        assert_eq!(st.segments_raw, 32);
        assert_eq!(st.segments_plan, 2, "K run and V run");
        assert_eq!(st.bytes, 16 * g.page_bytes(Component::K) * 2);
        let a = parse(&[
            "--pages",
            "16",
            "--pool-pages",
            "4096",
            "--layers",
            "2",
            "--pattern",
            "random",
        ]);
        let g = geometry(&a).unwrap();
        let src = place(g, a.src_layout(), 0).unwrap();
        let dst = place(g, a.dst_layout(), 1 << 40).unwrap();
        let m = mapping(&a).unwrap();
        let plan = pagewire_layout::plan(&src, &dst, &m.src, &m.dst).unwrap();
        assert!(plan_stats(&src, &plan, 16, 1 << 20).segments_plan >= 30);
    }
}
