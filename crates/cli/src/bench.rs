//! `pagewire bench ...`: ib_write_bw-style benchmarks and the KV page benchmark.
use clap::Args;

#[derive(Debug, Args)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench: not implemented yet")
}

/// The no-argument main job: an end-to-end transfer plus a benchmark table.
pub fn run_default() -> anyhow::Result<()> {
    anyhow::bail!("the default end-to-end run is not implemented yet")
}
