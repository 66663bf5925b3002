//! `pagewire layout ...`: parity interface for SGLang's page metadata and the PD plan.
use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum LayoutCommand {}

pub fn run(cmd: LayoutCommand) -> anyhow::Result<()> {
    match cmd {}
}
