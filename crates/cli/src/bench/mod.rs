//! `pagewire bench ...`: ib_write_bw-style benchmarks and the KV page benchmark.
//!
//! * `args`: perftest's flags, parsed by clap.
//! * `stats`: perftest's bandwidth and latency arithmetic.
//! * `report`: the header block and table (or JSON records).
//! * `oob`: the TCP side channel for hello, barriers and results.
//! * `pattern`: seeded byte patterns for `--verify`.
//! * `perf`: `write`, `read`, `lat` over the engine.
//! * `pages`: KV page transfers driven by layout plans.
//! * `session`: engine setup, the meeting on the side channel, header data.
mod args;
mod oob;
mod pages;
mod pattern;
mod perf;
mod report;
mod session;
mod stats;
mod store;

pub use args::BenchArgs;
use args::{BenchCmd, TestKind};

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.cmd {
        BenchCmd::Write(a) => perf::run(TestKind::Write, a),
        BenchCmd::Read(a) => perf::run(TestKind::Read, a),
        BenchCmd::Lat(a) => perf::run(TestKind::Lat, a),
        BenchCmd::Pages(a) => pages::run(a),
        BenchCmd::Store(a) => store::run(a),
    }
}

/// The no-argument main job: an end-to-end transfer plus a benchmark table.
pub fn run_default() -> anyhow::Result<()> {
    pages::run_default()?;
    perf::run_default()
}

#[cfg(test)]
mod tests {
    use super::args::{PerfArgs, ProgressArg, TransportArg};
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: BenchCmd,
    }

    fn perf(argv: &[&str]) -> (TestKind, PerfArgs) {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        match cli.cmd {
            BenchCmd::Write(a) => (TestKind::Write, a),
            BenchCmd::Read(a) => (TestKind::Read, a),
            BenchCmd::Lat(a) => (TestKind::Lat, a),
            _ => panic!("not a perftest-style command"),
        }
    }

    fn fails(argv: &[&str]) -> String {
        Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
            .expect_err("should fail")
            .to_string()
    }

    #[test]
    fn perftest_defaults() {
        let (k, a) = perf(&["write"]);
        assert_eq!(a.sizes(k), vec![65536]);
        assert_eq!(a.iters(k), 5000);
        assert_eq!(a.tx_depth(k), 128);
        assert_eq!(a.cq_mod(k), 64);
        assert_eq!(a.qps, 1);
        assert_eq!(a.port, 18515);
        assert_eq!(a.transport, TransportArg::Auto);
        assert!(a.server_addr.is_none() && !a.server);
        let (k, a) = perf(&["read"]);
        assert_eq!(a.iters(k), 1000);
        let (k, a) = perf(&["lat"]);
        assert_eq!(a.sizes(k), vec![2]);
        assert_eq!(a.iters(k), 1000);
        assert_eq!(a.tx_depth(k), 1);
        assert_eq!(a.cq_mod(k), 1);
        // lat starts one prepared ping, as ib_write_lat re-posts one work request.
        assert!(!a.submit_each && !a.poll_memory);
        let (_, a) = perf(&["lat", "--submit-each", "--poll-memory"]);
        assert!(a.submit_each && a.poll_memory);
        // Every test reaps for itself, as perftest's loops do, unless told otherwise.
        assert_eq!(a.progress(), ProgressArg::Manual);
        let (_, a) = perf(&["write"]);
        assert_eq!(a.progress(), ProgressArg::Manual);
        let (_, a) = perf(&["lat", "--progress", "auto"]);
        assert_eq!(a.progress(), ProgressArg::Auto);
        let (_, a) = perf(&["read", "--progress", "auto"]);
        assert_eq!(a.progress(), ProgressArg::Auto);
    }

    #[test]
    fn perform_warm_up_is_a_bandwidth_flag_sent_only_when_set() {
        let (k, a) = perf(&["write"]);
        assert!(!a.perform_warm_up);
        let p = perf::sym_params(k, &a, &a.sizes(k));
        // Absent, not false: a server that predates the flag still takes this client.
        assert!(p.get("perform_warm_up").is_none(), "{p}");
        for argv in [
            &["read", "--perform_warm_up"][..],
            &["write", "--perform-warm-up"],
        ] {
            let (k, a) = perf(argv);
            assert!(a.perform_warm_up, "{argv:?}");
            let p = perf::sym_params(k, &a, &a.sizes(k));
            assert_eq!(p["perform_warm_up"], true, "{p}");
        }
    }

    #[test]
    fn perftest_spellings() {
        let (k, a) = perf(&[
            "write",
            "-a",
            "-n",
            "50",
            "-q",
            "4",
            "-t",
            "64",
            "-d",
            "rxe0",
            "-x",
            "1",
            "-p",
            "20000",
            "-b",
            "--report_gbits",
            "-F",
            "--transport",
            "verbs",
            "--verify",
            "--json",
            "10.0.0.1",
        ]);
        assert_eq!(a.sizes(k).len(), 23);
        assert_eq!(a.sizes(k)[0], 2);
        assert_eq!(*a.sizes(k).last().unwrap(), 8 << 20);
        assert_eq!(a.iters(k), 50);
        assert_eq!(a.qps, 4);
        // perftest caps the TX depth at the iteration count.
        assert_eq!(a.tx_depth(k), 50);
        assert_eq!(a.cq_mod(k), 25);
        assert_eq!(a.device.as_deref(), Some("rxe0"));
        assert_eq!(a.gid_index, Some(1));
        assert_eq!(a.port, 20000);
        assert!(a.bidirectional && a.report_gbits && a.verify && a.json);
        assert_eq!(a.transport, TransportArg::Verbs);
        assert_eq!(a.server_addr.as_deref(), Some("10.0.0.1"));
        // Long forms.
        let (k, a) = perf(&[
            "read",
            "--size=1M",
            "--iters=10",
            "--qp=2",
            "--tx-depth=8",
            "--ib-dev=rxe0",
            "--gid-index=0",
            "--port=1",
            "--bidirectional",
            "--server",
        ]);
        assert_eq!(a.sizes(k), vec![1 << 20]);
        assert_eq!(a.iters(k), 10);
        assert_eq!(a.cq_mod(k), 4);
        assert!(a.server && a.bidirectional);
        // Duration mode disables the peak, like perftest.
        let (k, a) = perf(&["write", "-D", "10"]);
        assert!(!a.peak_enabled(k));
        assert_eq!(a.effective_margin(), 2.0);
        let (k, a) = perf(&["write", "-D", "2"]);
        assert_eq!(a.effective_margin(), 0.5);
        assert!(perf(&["write"]).1.peak_enabled(k));
        assert!(!perf(&["write", "-n", "20001"]).1.peak_enabled(k));
        assert!(!perf(&["write", "-N"]).1.peak_enabled(k));
    }

    #[test]
    fn sizes_with_suffixes() {
        for (s, want) in [
            ("64K", 65536),
            ("64k", 65536),
            ("64KiB", 65536),
            ("1M", 1 << 20),
            ("8MB", 8 << 20),
            ("0x1000", 4096),
            ("2", 2),
            ("1G", 1 << 30),
        ] {
            let (k, a) = perf(&["write", "-s", s]);
            assert_eq!(a.sizes(k), vec![want], "{s}");
        }
    }

    #[test]
    fn bad_flags_are_refused() {
        assert!(fails(&["write", "-s", "0"]).contains("out of range"));
        assert!(fails(&["write", "-s", "12Q"]).contains("invalid size"));
        assert!(fails(&["write", "-s", "8G"]).contains("out of range"));
        assert!(fails(&["write", "-n", "4"]).contains("at least 5"));
        assert!(fails(&["write", "-q", "0"]).contains("-q"));
        assert!(fails(&["write", "-D", "0"]).contains("duration"));
        assert!(fails(&["write", "--transport", "carrier-pigeon"]).contains("carrier-pigeon"));
        fails(&["write", "-a", "-s", "64K"]);
        fails(&["write", "--server", "10.0.0.1"]);
        fails(&["write", "--bogus"]);
    }
}
