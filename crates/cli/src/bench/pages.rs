//! `pagewire bench pages`: KV page transfers between two engines using layout plans.
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct PagesArgs {}

pub fn run(_args: PagesArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench pages: not implemented yet")
}

pub fn run_default() -> anyhow::Result<()> {
    Ok(())
}
