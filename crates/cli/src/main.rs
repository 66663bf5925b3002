//! `pagewire`: benchmarks, the KV page-transfer benchmark and inspection commands.
//!
//! Each subcommand lives in its own module with its own clap `Args` struct, so the
//! modules grow independently; this file only dispatches.

mod bench;
mod devices;
mod layout_cmd;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pagewire",
    version,
    about = "Zero-copy KV-cache page transfer engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Page geometry: SGLang-exact segment lists and transfer plans.
    #[command(subcommand)]
    Layout(layout_cmd::LayoutCommand),
    /// Bandwidth/latency benchmarks (ib_write_bw-style) and the KV page benchmark.
    Bench(bench::BenchArgs),
    /// RDMA devices, GPUs and the GPU path each pair would use.
    Devices(devices::DevicesArgs),
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) if !err.use_stderr() => err.exit(), // --help, --version
        Err(err) => {
            // Invalid input gets one line naming the problem (clap's first line, without
            // its usage block) and exit status 2, as clap itself would use.
            let rendered = err.to_string();
            let first = rendered.lines().next().unwrap_or("invalid arguments");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!("pagewire: error: {first} (see --help)");
            std::process::exit(2);
        }
    };
    let result = match cli.command {
        Some(Command::Layout(cmd)) => layout_cmd::run(cmd),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::Devices(args)) => devices::run(args),
        // No arguments: the end-to-end demo (both ends in one process, best transport).
        None => bench::run_default(),
    };
    if let Err(err) = result {
        // One line on stderr naming the problem; the chain is joined with ": ".
        eprintln!("pagewire: error: {err:#}");
        std::process::exit(1);
    }
}
