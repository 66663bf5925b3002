//! `scripts/bench-vs-perftest.sh --pool`: the paired tables re-tabulated over the raw
//! outputs of several invocations, checked on synthetic outputs whose ratios are known.
//! The same table code prints each invocation's `paired.md`. Needs bash and python3 (the
//! README's test command installs both).
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench-vs-perftest.sh")
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pagewire-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

/// A perftest-style bandwidth report: BW peak, BW average (MiB/s) and MsgRate (Mpps).
fn bw_report(bytes: u64, avg: f64, mpps: f64) -> String {
    format!(
        " #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]\n \
         {bytes}      16             0.00                {avg:.2}                {mpps:.6}\n"
    )
}

/// A perftest-style latency report with the given `t_typical` and 99th percentile.
fn lat_report(typical: f64, p99: f64) -> String {
    format!(
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
         t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
         2       1000          10.00          900.00       {typical:.2}            40.00          \
         5.00            {p99:.2}                 800.00\n"
    )
}

/// One round `r` of the paired section in `raw`: WRITE 64 KiB at `write` MiB/s against
/// perftest's 100, 2 B WRITE at `mpps` against 0.02, and the --poll-memory ping at
/// `poll` us against ib_write_lat's 30.
fn round(raw: &Path, r: u32, write: f64, mpps: f64, poll: f64) {
    let put = |name: String, text: String| fs::write(raw.join(name), text).unwrap();
    put(
        format!("pair_perftest_write_65536_{r}.txt"),
        bw_report(65536, 100.0, 0.0016),
    );
    put(
        format!("pair_pagewire_write_65536_{r}.txt"),
        bw_report(65536, write, 0.0016),
    );
    put(
        format!("pair_perftest_write_2_{r}.txt"),
        bw_report(2, 0.04, 0.02),
    );
    put(
        format!("pair_pagewire_write_2_{r}.txt"),
        bw_report(2, 0.04, mpps),
    );
    put(
        format!("pair_perftest_lat_{r}.txt"),
        lat_report(30.0, 100.0),
    );
    put(
        format!("pair_pagewirepoll_lat_{r}.txt"),
        lat_report(poll, 150.0),
    );
    // The server's output and stderr sit beside each pair's file; they are not rounds.
    put(format!("pair_perftest_lat_{r}.txt.server"), String::new());
}

#[test]
fn pool_tabulates_every_round_of_every_invocation() {
    let base = scratch("pool");
    // Invocation a: an --out directory (raw/ inside); b: its raw/ directory given directly.
    let a = base.join("20261130-000000-1");
    let b = base.join("20261130-010000-2").join("raw");
    fs::create_dir_all(a.join("raw")).unwrap();
    fs::create_dir_all(&b).unwrap();
    round(&a.join("raw"), 1, 90.0, 0.0186, 33.0);
    round(&a.join("raw"), 2, 110.0, 0.020, 36.0);
    round(&b, 1, 120.0, 0.024, 27.0);

    let out = Command::new("bash")
        .arg(script())
        .arg("--pool")
        .args([&a, &b])
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "--pool failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |start: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no row starting {start:?} in:\n{stdout}"))
            .to_string()
    };
    assert!(
        stdout.contains("Pooled over 2 invocations, 3 rounds in all"),
        "{stdout}"
    );
    // Ratios 0.90, 1.10, 1.20: median 1.10, two of three pairs at or above 1.00; the
    // bootstrap interval of a median lies within the ratios' range.
    let w =
        line("| 65536 | 100.00 [100.00, 100.00] | 110.00 [90.00, 120.00] | 1.10 [0.90, 1.20] | ");
    assert!(w.ends_with("| 2/3 | 1.00 |"), "{w}");
    let ci = w.split(" | ").nth(4).unwrap();
    let (lo, hi) = ci.split_once('-').unwrap();
    let (lo, hi): (f64, f64) = (lo.parse().unwrap(), hi.parse().unwrap());
    assert!(
        (0.90..=1.10).contains(&lo) && (1.10..=1.20).contains(&hi),
        "{w}"
    );
    // Message rate: 0.93, 1.00, 1.20 of perftest's, all three at or above 0.90.
    let m = line("| 2 | 0.0200 [0.0200, 0.0200] | 0.0200 [0.0186, 0.0240] | 1.00 [0.93, 1.20] | ");
    assert!(m.contains("| 3/3 |"), "{m}");
    // Latency: 1.10, 1.20, 0.90 of ib_write_lat's; two rounds within 1.10.
    let l = line(
        "| pagewire, prepared, poll, manual | ib_write_lat | 33.00 [27.00, 36.00] | 1.10 [0.90, 1.20] | ",
    );
    assert!(
        l.contains("| 2/3 | 150.00 [150.00, 150.00] | 1.50 [1.50, 1.50] |"),
        "{l}"
    );
    // A size nobody measured is shown as such, not as zero.
    assert!(
        stdout.contains("| 131072 | n/a | n/a | n/a | n/a | 0/0 | n/a |"),
        "{stdout}"
    );

    let missing = Command::new("bash")
        .arg(script())
        .arg("--pool")
        .arg(base.join("nothing-here"))
        .output()
        .expect("run bash");
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no paired outputs"));
    fs::remove_dir_all(&base).unwrap();
}
