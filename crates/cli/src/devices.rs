//! `pagewire devices`: RDMA devices, GPUs, and the GPU path per pair.
use clap::Args;

#[derive(Debug, Args)]
pub struct DevicesArgs {}

pub fn run(_args: DevicesArgs) -> anyhow::Result<()> {
    anyhow::bail!("devices: not implemented yet")
}
