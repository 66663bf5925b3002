//! `pagewire bench ...`: ib_write_bw-style benchmarks and the KV page benchmark.
//!
//! * `args`: perftest's flags, parsed by clap.
//! * `stats`: perftest's bandwidth and latency arithmetic.
//! * `report`: the header block and table (or JSON records).
//! * `oob`: the TCP side channel for hello, barriers and results.
//! * `pattern`: seeded byte patterns for `--verify`.
//! * `perf`: `write`, `read`, `lat` over the engine: one driver, two measurements.
//! * `pages`: KV page transfers driven by layout plans.
//! * `session`: engine setup, the meeting on the side channel, header data.
//! * `progress`: the progress bar of runs longer than two seconds.
//!
//! Like perftest, each test is the server without an address (waits for one client,
//! then exits) and the client with one; `--local` runs both ends in this process.
mod args;
mod oob;
mod pages;
mod pattern;
mod perf;
mod progress;
mod report;
mod session;
mod stats;
mod store;

pub use args::{BENCH_ABOUT, BenchArgs};
use args::{BenchCmd, TestKind};
pub use pages::Preset;

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.cmd {
        BenchCmd::Write(a) => perf::run(TestKind::Write, a.into()),
        BenchCmd::Read(a) => perf::run(TestKind::Read, a.into()),
        BenchCmd::Lat(a) => perf::run(TestKind::Lat, a.into()),
        BenchCmd::Pages(a) => pages::run(a),
        BenchCmd::Store(a) => store::run(a),
    }
}

/// The no-argument main job: an end-to-end transfer plus a benchmark table, then the
/// process's peak resident memory (the job is sized to fit a 1 GiB machine).
pub fn run_default() -> anyhow::Result<()> {
    pages::run_default()?;
    perf::run_default()?;
    if let Some(kib) = peak_rss_kib() {
        eprintln!(
            " pagewire: peak resident memory {:.1} MB (VmHWM)",
            kib as f64 * 1024.0 / 1e6
        );
    }
    Ok(())
}

/// This process's peak resident set size (`VmHWM` of /proc/self/status), in KiB.
fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::args::{PerfArgs, ProgressArg, Role, TransportArg};
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
            BenchCmd::Write(a) => (TestKind::Write, a.into()),
            BenchCmd::Read(a) => (TestKind::Read, a.into()),
            BenchCmd::Lat(a) => (TestKind::Lat, a.into()),
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
        assert_eq!(a.end.port, 18515);
        assert_eq!(a.end.transport, TransportArg::Auto);
        // No address: the server, as perftest.
        assert!(a.end.server_addr.is_none() && !a.end.server);
        assert_eq!(a.end.role(), Role::Server);
        assert_eq!(perf(&["write", "--server"]).1.end.role(), Role::Server);
        assert_eq!(perf(&["write", "--local"]).1.end.role(), Role::Local);
        assert_eq!(
            perf(&["write", "10.0.0.1"]).1.end.role(),
            Role::Client("10.0.0.1".into())
        );
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
        let p = perf::sym_params(k, &a, &a.sizes(k), "tcp");
        // Absent, not false: a server that predates the flag still takes this client.
        assert!(p.get("perform_warm_up").is_none(), "{p}");
        for argv in [
            &["read", "--perform_warm_up"][..],
            &["write", "--perform-warm-up"],
        ] {
            let (k, a) = perf(argv);
            assert!(a.perform_warm_up, "{argv:?}");
            let p = perf::sym_params(k, &a, &a.sizes(k), "tcp");
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
        assert_eq!(a.end.device.as_deref(), Some("rxe0"));
        assert_eq!(a.end.gid_index, Some(1));
        assert_eq!(a.end.port, 20000);
        assert!(a.bidirectional && a.report_gbits && a.end.verify && a.end.json);
        assert_eq!(a.end.transport, TransportArg::Verbs);
        assert_eq!(a.end.server_addr.as_deref(), Some("10.0.0.1"));
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
        assert!(a.end.server && a.bidirectional);
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
        fails(&["write", "--local", "10.0.0.1"]);
        fails(&["write", "--local", "--server"]);
        fails(&["write", "--bogus"]);
        // Each test takes only its own flags.
        assert!(fails(&["write", "--poll-memory"]).contains("--poll-memory"));
        assert!(fails(&["read", "--submit-each"]).contains("--submit-each"));
        assert!(fails(&["lat", "-b"]).contains("-b"));
        assert!(fails(&["lat", "-D", "5"]).contains("-D"));
        assert!(fails(&["lat", "--perform_warm_up"]).contains("--perform_warm_up"));
    }

    #[test]
    fn verbs_only_flags_need_verbs() {
        let t = |argv: &[&str]| perf(argv).1.end.transport(false);
        // A named device makes auto mean verbs: never a silent TCP fallback.
        assert_eq!(t(&["write", "-d", "mlx5_0"]).unwrap(), TransportArg::Verbs);
        assert_eq!(t(&["write", "-x", "3"]).unwrap(), TransportArg::Verbs);
        assert_eq!(t(&["write"]).unwrap(), TransportArg::Auto);
        for argv in [
            &["write", "--transport", "tcp", "-d", "mlx5_0"][..],
            &["read", "--transport", "tcp", "-i", "2"],
            &["lat", "--local", "--transport", "loopback", "-x", "1"],
        ] {
            let e = t(argv).unwrap_err().to_string();
            assert!(e.contains("applies to the verbs transport only"), "{e}");
        }
        let (_, a) = perf(&["write", "--transport", "tcp", "--progress", "auto"]);
        let e = a
            .end
            .transport(a.progress.is_some())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--progress applies to the verbs transport"),
            "{e}"
        );
        // loopback needs both ends here.
        let e = t(&["write", "--transport", "loopback"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--local"), "{e}");
        assert_eq!(
            t(&["write", "--local", "--transport", "loopback"]).unwrap(),
            TransportArg::Loopback
        );
    }
}
