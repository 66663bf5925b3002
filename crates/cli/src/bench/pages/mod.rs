//! `pagewire bench pages`: KV page transfers between two engines, driven by real
//! `pagewire_layout` plans.
//!
//! The initiator (client) owns one pool, the server the other. One page mapping is
//! drawn per run (from `--pattern` and `--seed`), turned into a coalesced transfer plan
//! once, and that plan is submitted `-n` times as one batch each, with up to `-t`
//! batches in flight. With `--verify` the receiving side regenerates the source pool
//! from the seed, replays the plan with memcpy into a copy of its own pool, and
//! compares every byte of the pool: right bytes in the right pages, and nothing
//! outside them touched.
//!
//! * `presets`: model presets and element types, the pool geometry they give, and how a
//!   pool is laid out in its buffer.
//! * `workload`: which pages move (the seeded draw), the plan's figures, and the bytes the
//!   source pool starts with.
//! * `verify`: the receiving side's check of its whole pool.
//! * `report`: the run's figures as a text block or one JSON record.
//! * `run`: the roles (server, client, both in this process) and the timed loop.
//!
//! This file holds the flags, which every part reads.
use clap::Args;
use pagewire_layout::{Layout, PoolKind};

use super::args::EndArgs;

mod presets;
mod report;
mod run;
mod verify;
mod workload;

pub use presets::{Dtype, Preset, pool_bytes};
pub use run::{run, run_default};
use workload::{PageOp, Pattern};

fn parse_layout(s: &str) -> Result<Layout, String> {
    s.parse::<Layout>().map_err(|e| e.to_string())
}

#[derive(Debug, Clone, Args)]
pub struct PagesArgs {
    #[command(flatten)]
    pub end: EndArgs,

    /// Model preset (KV geometry).
    #[arg(long, value_enum, default_value_t = Preset::Llama3_8b)]
    pub model: Preset,

    /// Element type of the pool.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    pub dtype: Dtype,

    /// Override the preset's layer count (smaller pools for slow machines).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub layers: Option<u64>,

    /// Host-pool layout of both pools (SGLang names: layer_first, page_first,
    /// page_first_direct, page_head).
    #[arg(long, value_parser = parse_layout, default_value = "page_first")]
    pub layout: Layout,

    /// Layout of the source pool (overrides --layout).
    #[arg(long, value_parser = parse_layout)]
    pub src_layout: Option<Layout>,

    /// Layout of the destination pool (overrides --layout).
    #[arg(long, value_parser = parse_layout)]
    pub dst_layout: Option<Layout>,

    /// Tokens per page.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub page_size: u64,

    /// Pages moved per batch.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub pages: u64,

    /// Pages in each pool. Default: 4 x --pages, but no more than fit in 64 MiB (and at
    /// least --pages), so that the default run fits a small machine.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub pool_pages: Option<u64>,

    /// Which pages move.
    #[arg(long, value_enum, default_value_t = Pattern::Random)]
    pub pattern: Pattern,

    /// Seed of the page draw and of the --verify pattern.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Direction: the client writes to, or reads from, the server's pool.
    #[arg(long, value_enum, default_value_t = PageOp::Write)]
    pub op: PageOp,

    /// Batches (each one moves --pages pages).
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub iters: u64,

    /// Batches in flight.
    #[arg(short = 't', long = "tx-depth", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub depth: u32,

    /// Queue pairs (verbs) or streams (TCP).
    #[arg(short = 'q', long = "qp", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub qps: u32,
}

/// The most bytes a default pool takes (`--pool-pages` not given).
pub const DEFAULT_POOL_CAP: u64 = 64 << 20;

impl PagesArgs {
    /// `--pool-pages`, else 4 x `--pages` capped at [`DEFAULT_POOL_CAP`] bytes (never
    /// below `--pages`). Both ends compute the same figure from the same flags.
    pub fn pool_pages(&self) -> u64 {
        self.pool_pages.unwrap_or_else(|| {
            let four = self.pages.saturating_mul(4);
            match self.page_bytes() {
                Some(b) if b > 0 => four.min(DEFAULT_POOL_CAP / b).max(self.pages),
                _ => four,
            }
        })
    }

    /// Whether the pool size is the capped default (said in the report).
    pub fn pool_capped(&self) -> bool {
        self.pool_pages.is_none() && self.pool_pages() < self.pages.saturating_mul(4)
    }

    /// Bytes of one page (all layers and buffers) of the geometry these flags describe.
    fn page_bytes(&self) -> Option<u64> {
        let (kind, layers, heads, d, dv) = self.model.shape();
        let layers = self.layers.unwrap_or(layers);
        let per_token = match kind {
            PoolKind::Mla => layers * d,
            _ => layers * heads * (d + dv),
        };
        per_token
            .checked_mul(self.dtype.bytes())?
            .checked_mul(self.page_size)
    }
    pub fn src_layout(&self) -> Layout {
        self.src_layout.unwrap_or(self.layout)
    }
    pub fn dst_layout(&self) -> Layout {
        self.dst_layout.unwrap_or(self.layout)
    }
}

#[cfg(test)]
fn parse(argv: &[&str]) -> PagesArgs {
    use clap::Parser;
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        a: PagesArgs,
    }
    Cli::try_parse_from(std::iter::once("pages").chain(argv.iter().copied()))
        .unwrap()
        .a
}

#[cfg(test)]
mod tests {
    use super::*;
    use presets::geometry;

    #[test]
    fn default_pool_is_capped_and_both_ends_agree() {
        // Llama-3-8B, 16-token pages: 2 MiB a page; 4 x 16 pages would be 128 MiB.
        let a = parse(&[]);
        assert_eq!(a.pages, 16);
        assert_eq!(a.pool_pages(), 32);
        assert!(a.pool_capped());
        let (bytes, _) = pool_bytes(&geometry(&a).unwrap());
        assert_eq!(bytes, DEFAULT_POOL_CAP);
        // Never below --pages; an explicit --pool-pages is taken as given.
        let a = parse(&["--model", "llama3-70b", "--pages", "16"]);
        assert_eq!(a.pool_pages(), 16);
        let a = parse(&["--pool-pages", "100"]);
        assert_eq!(a.pool_pages(), 100);
        assert!(!a.pool_capped());
        // Small pages: the plain 4 x --pages.
        let a = parse(&["--layers", "1", "--page-size", "1"]);
        assert_eq!(a.pool_pages(), 64);
        assert!(!a.pool_capped());
    }
}
