//! Command-line flags of `pagewire bench`, spelled like perftest's.
//!
//! As with perftest, the same command is the server (no address) or the client (the
//! server's address); `--local` runs both ends in one process. The symmetric flags
//! (`-a -s -n -D -q -t -b`) must be given identically on both ends; the client sends its
//! copy in the hello and the server refuses a client whose parameters differ from its
//! own. Each test gets only the flags that apply to it (`write`/`read`: [`BwArgs`],
//! `lat`: [`LatArgs`]), so clap refuses the others by name.
use clap::{Args, Subcommand, ValueEnum};

/// perftest's default side-channel port.
pub const DEFAULT_PORT: u16 = 18515;
/// perftest's `-a` sweep: 2^1 .. 2^23 bytes.
pub const ALL_SIZES_LOG2: std::ops::RangeInclusive<u32> = 1..=23;
/// perftest refuses fewer iterations than this.
pub const MIN_ITERS: u64 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportArg {
    /// verbs if an RDMA device is usable, else TCP.
    Auto,
    /// RDMA verbs (RC queue pairs).
    Verbs,
    /// TCP streams.
    Tcp,
    /// In-process memcpy backend; only for a run with both ends in one process (--local).
    Loopback,
}

impl TransportArg {
    pub fn name(self) -> &'static str {
        match self {
            TransportArg::Auto => "auto",
            TransportArg::Verbs => "verbs",
            TransportArg::Tcp => "tcp",
            TransportArg::Loopback => "loopback",
        }
    }
}

/// Who reaps the verbs completions (the engine's `ProgressMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProgressArg {
    /// A completion thread reaps what the bench's waits leave.
    Auto,
    /// Only the bench's own waits reap: no completion thread.
    Manual,
}

/// Which one-sided operation the bandwidth/latency test issues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TestKind {
    Write,
    Read,
    Lat,
}

impl TestKind {
    /// perftest's title line.
    pub fn title(self, bidirectional: bool) -> String {
        match self {
            TestKind::Write if bidirectional => "RDMA_Write Bidirectional BW Test".into(),
            TestKind::Write => "RDMA_Write BW Test".into(),
            TestKind::Read if bidirectional => "RDMA_Read Bidirectional BW Test".into(),
            TestKind::Read => "RDMA_Read BW Test".into(),
            TestKind::Lat => "RDMA_Write Latency Test".into(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TestKind::Write => "write",
            TestKind::Read => "read",
            TestKind::Lat => "lat",
        }
    }
}

/// `pagewire bench`'s own help: who is server and client, with one example.
pub const BENCH_ABOUT: &str = "\
Benchmarks, run like perftest's ib_write_bw: the same command is the server when given \
no address (it waits for one client, runs the test, prints the report and exits) and the \
client when given the server's address. --local runs both ends in this process.";

const BENCH_EXAMPLES: &str = "\
Examples:
  pagewire bench write                      # server: waits for one client, then exits
  pagewire bench write 10.0.0.1             # client (host or host:port; side channel on -p 18515)
  pagewire bench write --local -a --verify  # both ends in this process";

const WRITE_EXAMPLES: &str = "\
Examples:
  pagewire bench write -d mlx5_0 -a                        # server
  pagewire bench write -d mlx5_0 -a 10.0.0.1               # client
  pagewire bench write --local -s 1M -n 1000 --verify      # both ends here, best transport
  pagewire bench write --local --transport tcp -D 10 -q 4 --json";

const READ_EXAMPLES: &str = "\
Examples:
  pagewire bench read -s 1M -n 1000 -q 2 -b --report_gbits            # server
  pagewire bench read -s 1M -n 1000 -q 2 -b --report_gbits 10.0.0.1   # client
  pagewire bench read --local -a --verify";

const LAT_EXAMPLES: &str = "\
Examples:
  pagewire bench lat -n 1000                 # server
  pagewire bench lat -n 1000 10.0.0.1        # client
  pagewire bench lat --local --poll-memory   # spin on the last byte, as ib_write_lat";

const PAGES_EXAMPLES: &str = "\
Examples:
  pagewire bench pages --model llama3-8b --verify                 # server
  pagewire bench pages --model llama3-8b --verify 10.0.0.1        # client
  pagewire bench pages --local --model deepseek-v3 --layout layer_first --pattern fragmented
  pagewire bench pages --local --model mimo-v2 --src-layout page_first --dst-layout page_head --op read";

#[derive(Debug, Args)]
#[command(after_help = BENCH_EXAMPLES)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub cmd: BenchCmd,
}

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// RDMA WRITE bandwidth, like ib_write_bw: no address = server, an address = client.
    #[command(after_help = WRITE_EXAMPLES)]
    Write(BwArgs),
    /// RDMA READ bandwidth, like ib_read_bw: no address = server, an address = client.
    #[command(after_help = READ_EXAMPLES)]
    Read(BwArgs),
    /// RDMA WRITE ping-pong latency, like ib_write_lat: no address = server, an address = client.
    #[command(after_help = LAT_EXAMPLES)]
    Lat(LatArgs),
    /// KV page transfer between two engines, using real layout plans.
    #[command(after_help = PAGES_EXAMPLES)]
    Pages(super::pages::PagesArgs),
    /// Put and get of KV page batches through the store (pagewire-store), with p50/p99.
    Store(super::store::StoreBenchArgs),
}

/// Which end(s) this process runs, from the address and `--server` / `--local`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Wait for one client on the side-channel port, run, exit.
    Server,
    /// Connect to the server at this address.
    Client(String),
    /// Both ends in this process.
    Local,
}

/// Who runs, where, over what: the flags every bench (write, read, lat, pages) shares.
#[derive(Debug, Clone, Args)]
pub struct EndArgs {
    /// The server's address (`host` or `host:port`): run as the client. Without it, run
    /// as the server: wait for one client, run, print the report, exit (as perftest).
    pub server_addr: Option<String>,

    /// Run as the server. That is already the default without an address; accepted for
    /// scripts written against earlier versions.
    #[arg(long, conflicts_with_all = ["server_addr", "local"])]
    pub server: bool,

    /// Run both ends in this process (side channel and engines on 127.0.0.1).
    #[arg(long, conflicts_with = "server_addr")]
    pub local: bool,

    /// Side-channel port the server listens on.
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// Transport backend. `auto`: verbs if an RDMA device is usable, else TCP (said on
    /// stderr); a verbs-only flag (-d, -x, -i, --progress) makes it verbs.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,

    /// Verbs: RDMA device (default: the first one with an ACTIVE port), or several to
    /// stripe over (`rxe0,rxe1`, each `name[:port[:gid_index]]`), or `all` (every device
    /// with the port ACTIVE); `--rails` is the same flag. A device that does not exist is
    /// an error.
    #[arg(short = 'd', long = "ib-dev", visible_alias = "rails")]
    pub device: Option<String>,

    /// Verbs: GID index (default: picked as perftest does).
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u32>,

    /// Verbs: device port (default 1).
    #[arg(short = 'i', long = "ib-port")]
    pub ib_port: Option<u8>,

    /// The receiving side checks every byte it received against a seeded pattern.
    #[arg(long)]
    pub verify: bool,

    /// One JSON record per result on stdout instead of the text report (no progress bar).
    #[arg(long)]
    pub json: bool,

    /// Seconds any single wait may take before the run fails.
    #[arg(long, default_value_t = 30.0, hide = true)]
    pub timeout: f64,
}

impl EndArgs {
    pub fn role(&self) -> Role {
        match (&self.server_addr, self.local) {
            (Some(a), _) => Role::Client(a.clone()),
            (None, true) => Role::Local,
            (None, false) => Role::Server,
        }
    }

    /// The verbs-only flags given on the command line, by their spelling.
    fn verbs_flags(&self, progress: bool) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.device.is_some() {
            v.push("-d/--ib-dev");
        }
        if self.gid_index.is_some() {
            v.push("-x/--gid-index");
        }
        if self.ib_port.is_some() {
            v.push("-i/--ib-port");
        }
        if progress {
            v.push("--progress");
        }
        v
    }

    /// The transport this run asks for: `--transport`, except that a verbs-only flag
    /// makes `auto` mean verbs (a named device never falls back to TCP silently). A
    /// verbs-only flag with `tcp` or `loopback` is an error that says so, as is loopback
    /// across two processes.
    pub fn transport(&self, progress: bool) -> anyhow::Result<TransportArg> {
        let flags = self.verbs_flags(progress);
        let t = match self.transport {
            TransportArg::Auto if !flags.is_empty() => TransportArg::Verbs,
            t @ (TransportArg::Tcp | TransportArg::Loopback) if !flags.is_empty() => {
                anyhow::bail!(
                    "{} applies to the verbs transport only; this run uses --transport {}",
                    flags.join(", "),
                    t.name()
                )
            }
            t => t,
        };
        if t == TransportArg::Loopback && self.role() != Role::Local {
            anyhow::bail!(
                "--transport loopback needs both ends in one process: add --local \
                 (without an address this process is the server)"
            );
        }
        Ok(t)
    }
}

/// Flags of `write`, `read` and `lat` (perftest's common flags, pagewire's own).
#[derive(Debug, Clone, Args)]
pub struct PerfCommon {
    #[command(flatten)]
    pub end: EndArgs,

    /// Sweep all sizes from 2 B to 8 MiB (2^1 .. 2^23).
    #[arg(short = 'a', long = "all", conflicts_with = "size")]
    pub all: bool,

    /// Message size in bytes (suffixes K, M, G = 2^10, 2^20, 2^30 accepted).
    /// Default 65536 for bandwidth tests, 2 for latency.
    #[arg(short = 's', long = "size", value_parser = parse_size)]
    pub size: Option<u64>,

    /// Iterations per QP. Default 5000 for write, 1000 for read and latency; at least 5.
    #[arg(short = 'n', long = "iters", value_parser = parse_iters)]
    pub iters: Option<u64>,

    /// Queue pairs (verbs) or streams (TCP).
    #[arg(short = 'q', long = "qp", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub qps: u32,

    /// Maximum outstanding operations. Default 128 for bandwidth, 1 for latency.
    #[arg(short = 't', long = "tx-depth", value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub tx_depth: Option<u32>,

    /// Verbs: who reaps completions. `manual` (default): only the bench's own waits, as
    /// perftest's loops do (no completion thread); `auto`: the engine's completion thread
    /// too. `PAGEWIRE_PROGRESS` does not apply to these tests; this flag does.
    #[arg(long, value_enum)]
    pub progress: Option<ProgressArg>,

    /// Accepted for perftest compatibility; pagewire times with a monotonic clock.
    #[arg(short = 'F', long = "CPU-freq", hide = true)]
    pub cpu_freq: bool,
}

/// `write` and `read`.
#[derive(Debug, Clone, Args)]
pub struct BwArgs {
    #[command(flatten)]
    pub common: PerfCommon,

    /// Run for this many seconds instead of a fixed iteration count (disables peak BW).
    #[arg(short = 'D', long = "duration", value_parser = parse_duration)]
    pub duration: Option<f64>,

    /// Seconds trimmed at each end of a `-D` run (perftest default 2; at most D/4).
    #[arg(short = 'f', long = "margin", default_value_t = 2.0)]
    pub margin: f64,

    /// Operations per submitted batch, each batch completing as one (perftest's CQ
    /// moderation). Default: half the TX depth, at most 100.
    #[arg(short = 'Q', long = "cq-mod", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cq_mod: Option<u32>,

    /// Both sides issue operations; the client reports the sum.
    #[arg(short = 'b', long = "bidirectional")]
    pub bidirectional: bool,

    /// Report Gb/s (10^9 bit/s) instead of MiB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub report_gbits: bool,

    /// Do not compute peak bandwidth.
    #[arg(short = 'N', long = "noPeak", alias = "no-peak")]
    pub no_peak: bool,

    /// Before each size, post one TX depth of its work requests and wait for them,
    /// unmeasured, as perftest's flag of the same name does (the first size of a run
    /// otherwise also pays for cold caches and, under emulation, translation).
    #[arg(long = "perform_warm_up", alias = "perform-warm-up")]
    pub perform_warm_up: bool,
}

/// `lat`.
#[derive(Debug, Clone, Args)]
pub struct LatArgs {
    #[command(flatten)]
    pub common: PerfCommon,

    /// Spin on the last byte of the landing buffer, as ib_write_lat does, instead of
    /// waiting for the engine's notification. Valid where the last byte of a write lands
    /// last (RC verbs; the TCP backend's in-order copy); not with the loopback backend.
    #[arg(long)]
    pub poll_memory: bool,

    /// Submit a new batch for every ping (validation, pinning and planning each time)
    /// instead of starting one prepared batch again, which is what ib_write_lat does with
    /// its work request.
    #[arg(long)]
    pub submit_each: bool,
}

/// Everything a `write`, `read` or `lat` run needs, whichever subcommand it came from.
#[derive(Debug, Clone)]
pub struct PerfArgs {
    pub end: EndArgs,
    pub all: bool,
    pub size: Option<u64>,
    pub iters: Option<u64>,
    pub duration: Option<f64>,
    pub margin: f64,
    pub qps: u32,
    pub tx_depth: Option<u32>,
    pub cq_mod: Option<u32>,
    pub bidirectional: bool,
    pub report_gbits: bool,
    pub no_peak: bool,
    pub progress: Option<ProgressArg>,
    pub poll_memory: bool,
    pub submit_each: bool,
    pub perform_warm_up: bool,
}

impl PerfArgs {
    fn from_common(c: PerfCommon) -> PerfArgs {
        PerfArgs {
            end: c.end,
            all: c.all,
            size: c.size,
            iters: c.iters,
            duration: None,
            margin: 2.0,
            qps: c.qps,
            tx_depth: c.tx_depth,
            cq_mod: None,
            bidirectional: false,
            report_gbits: false,
            no_peak: false,
            progress: c.progress,
            poll_memory: false,
            submit_each: false,
            perform_warm_up: false,
        }
    }
}

impl From<BwArgs> for PerfArgs {
    fn from(b: BwArgs) -> PerfArgs {
        PerfArgs {
            duration: b.duration,
            margin: b.margin,
            cq_mod: b.cq_mod,
            bidirectional: b.bidirectional,
            report_gbits: b.report_gbits,
            no_peak: b.no_peak,
            perform_warm_up: b.perform_warm_up,
            ..PerfArgs::from_common(b.common)
        }
    }
}

impl From<LatArgs> for PerfArgs {
    fn from(l: LatArgs) -> PerfArgs {
        PerfArgs {
            poll_memory: l.poll_memory,
            submit_each: l.submit_each,
            ..PerfArgs::from_common(l.common)
        }
    }
}

impl PerfArgs {
    /// The progress mode this run asks for: manual unless told (see the flag).
    pub fn progress(&self) -> ProgressArg {
        self.progress.unwrap_or(ProgressArg::Manual)
    }

    /// Message sizes of this run, in order.
    pub fn sizes(&self, kind: TestKind) -> Vec<u64> {
        if self.all {
            ALL_SIZES_LOG2.map(|e| 1u64 << e).collect()
        } else {
            vec![self.size.unwrap_or(match kind {
                TestKind::Lat => 2,
                _ => 65536,
            })]
        }
    }

    pub fn iters(&self, kind: TestKind) -> u64 {
        self.iters.unwrap_or(match kind {
            TestKind::Write => 5000,
            _ => 1000,
        })
    }

    /// Unmeasured operations before each size (`--perform_warm_up`: one TX depth per QP),
    /// else 0.
    pub fn warm_up_ops(&self, kind: TestKind) -> u64 {
        if self.perform_warm_up {
            u64::from(self.tx_depth(kind)) * u64::from(self.qps)
        } else {
            0
        }
    }

    /// `-t`, else 128 (bandwidth) or 1 (latency); like perftest, never more than the
    /// iteration count of a fixed-iteration run.
    pub fn tx_depth(&self, kind: TestKind) -> u32 {
        let d = self.tx_depth.unwrap_or(match kind {
            TestKind::Lat => 1,
            _ => 128,
        });
        match self.duration {
            Some(_) => d,
            None => d.min(u32::try_from(self.iters(kind)).unwrap_or(u32::MAX)),
        }
    }

    /// Operations per batch: `-Q`, else half the TX depth (so one batch is always in
    /// flight while the other completes), at most 100 like perftest's CQ moderation.
    pub fn cq_mod(&self, kind: TestKind) -> u32 {
        let depth = self.tx_depth(kind);
        self.cq_mod.unwrap_or((depth / 2).clamp(1, 100)).min(depth)
    }

    /// The margin actually applied to a `-D` run.
    pub fn effective_margin(&self) -> f64 {
        match self.duration {
            Some(d) => self.margin.clamp(0.0, d / 4.0),
            None => 0.0,
        }
    }

    /// perftest skips the O(n^2) peak search in duration mode and above 20000 iterations.
    pub fn peak_enabled(&self, kind: TestKind) -> bool {
        !self.no_peak && self.duration.is_none() && self.iters(kind) <= 20_000
    }
}

/// Parses `65536`, `0x10000`, `64K`, `64KiB`, `1M`, `8MB`, `1G` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("invalid size {s:?}: expected bytes such as 65536, 64K or 1M");
    if let Some(hex) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16)
            .map_err(|_| bad())
            .and_then(check_size);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {s:?} overflows"))
        .and_then(check_size)
}

fn check_size(n: u64) -> Result<u64, String> {
    // 1 B .. 4 GiB: one work request carries at most 2^31 bytes on most NICs, and the
    // buffer is allocated in this process.
    if n == 0 || n > (1u64 << 32) {
        return Err(format!("size {n} out of range: 1 B ..= 4 GiB"));
    }
    Ok(n)
}

fn parse_iters(s: &str) -> Result<u64, String> {
    let n: u64 = s
        .parse()
        .map_err(|_| format!("invalid iteration count {s:?}"))?;
    if n < MIN_ITERS {
        return Err(format!("iterations must be at least {MIN_ITERS}, got {n}"));
    }
    Ok(n)
}

fn parse_duration(s: &str) -> Result<f64, String> {
    let d: f64 = s.parse().map_err(|_| format!("invalid duration {s:?}"))?;
    if !(d.is_finite() && d > 0.0 && d <= 86_400.0) {
        return Err(format!("duration must be in (0, 86400] seconds, got {s}"));
    }
    Ok(d)
}
