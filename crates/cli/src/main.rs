//! `pagewire`: benchmarks, the KV page-transfer benchmark and inspection commands.
//!
//! Each subcommand lives in its own module with its own clap `Args` struct, so the
//! modules grow independently; this file only dispatches.

mod bench;
mod devices;
mod devices_topo;
mod layout_cmd;
mod store_cmd;

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use tracing_subscriber::filter::LevelFilter;

/// What the binary's `--help` says after the usage: the no-argument run and the
/// perftest-style roles, with one example each.
const ABOUT: &str = "\
Zero-copy KV-cache page transfer engine.

With no arguments, pagewire runs its main job: two engines in this process, on the best \
transport this host has (RDMA verbs if a device is usable, else TCP, said on stderr), move \
KV pages of a Llama-3-8B pool and verify every byte, then print a short RDMA WRITE \
bandwidth table. It needs about 150 MB of memory.

The benchmarks run like perftest's: `pagewire bench write` with no address is the server \
(it waits for one client, then exits), with the server's address it is the client, and \
with --local both ends run in this process.";

const EXAMPLES: &str = "\
Examples:
  pagewire                                   # the main job (both ends here, verified)
  pagewire bench write                       # server: waits for one client, then exits
  pagewire bench write 10.0.0.1              # client of that server
  pagewire bench write --local -a --verify   # both ends in this process
  pagewire layout meta --model llama3-8b --layout page_first --capacity 64 --base 0x1000 --indices 0..32
  pagewire devices                           # RDMA devices and GPUs, or why there are none";

#[derive(Debug, Parser)]
#[command(
    name = "pagewire",
    version,
    about = "Zero-copy KV-cache page transfer engine",
    long_about = ABOUT,
    after_help = EXAMPLES
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
    /// Benchmarks like ib_write_bw (no address = server, an address = client, --local = both)
    /// and the KV page benchmark.
    #[command(long_about = bench::BENCH_ABOUT)]
    Bench(bench::BenchArgs),
    /// RDMA devices, GPUs and the GPU path each pair would use.
    Devices(devices::DevicesArgs),
    /// The KV page store: its master and storage nodes (benchmark: `bench store`).
    #[command(subcommand)]
    Store(store_cmd::StoreCommand),
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
    init_logging();
    let result = match cli.command {
        Some(Command::Layout(cmd)) => layout_cmd::run(cmd),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::Devices(args)) => devices::run(args),
        Some(Command::Store(cmd)) => store_cmd::run(cmd),
        // No arguments: the end-to-end demo (both ends in one process, best transport).
        None => bench::run_default(),
    };
    if let Err(err) = result {
        // One line on stderr naming the problem; the chain is joined with ": ".
        eprintln!("pagewire: error: {err:#}");
        std::process::exit(1);
    }
}

/// The libraries report through `tracing` (a broken connection, a deregistration that
/// failed, the device opened): print those events on stderr at the level
/// `PAGEWIRE_LOG` names (`off`, `error`, `warn`, `info`, `debug`, `trace`; `warn` when
/// unset). An unknown value is said once and the default kept.
fn init_logging() {
    let var = std::env::var("PAGEWIRE_LOG").ok();
    let (level, bad) = log_level(var.as_deref());
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
    if let Some(v) = bad {
        eprintln!(
            "pagewire: PAGEWIRE_LOG={v:?} is not a level (off|error|warn|info|debug|trace); using warn"
        );
    }
}

/// The level `PAGEWIRE_LOG` asks for, and the value itself when it names none.
fn log_level(v: Option<&str>) -> (LevelFilter, Option<&str>) {
    match v.map(str::trim) {
        None | Some("") => (LevelFilter::WARN, None),
        Some(s) => match s.parse::<LevelFilter>() {
            Ok(l) => (l, None),
            Err(_) => (LevelFilter::WARN, Some(s)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_level_parses_names_and_keeps_warn_otherwise() {
        assert_eq!(log_level(None), (LevelFilter::WARN, None));
        assert_eq!(log_level(Some("")), (LevelFilter::WARN, None));
        assert_eq!(log_level(Some("debug")), (LevelFilter::DEBUG, None));
        assert_eq!(log_level(Some(" OFF ")), (LevelFilter::OFF, None));
        assert_eq!(log_level(Some("loud")), (LevelFilter::WARN, Some("loud")));
    }
}
