//! `pagewire bench write|read|lat` over the transport engine.
use super::args::{PerfArgs, TestKind};

pub fn run(_kind: TestKind, _args: PerfArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench: waiting for the transport engine")
}

pub fn run_default() -> anyhow::Result<()> {
    anyhow::bail!("the default end-to-end run is not implemented yet")
}
