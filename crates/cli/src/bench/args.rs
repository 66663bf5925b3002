//! Command-line flags of `pagewire bench`, spelled like perftest's.
//!
//! The symmetric flags (`-a -s -n -D -q -t -b`) must be given identically on both
//! ends, as with perftest; the client sends its copy in the hello and the server
//! refuses a client whose parameters differ from its own.
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
    /// In-process memcpy backend; only for a run with both ends in one process.
    Loopback,
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

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub cmd: BenchCmd,
}

#[derive(Debug, Subcommand)]
pub enum BenchCmd {
    /// RDMA WRITE bandwidth, like ib_write_bw (server: no address; client: the server's address).
    Write(PerfArgs),
    /// RDMA READ bandwidth, like ib_read_bw.
    Read(PerfArgs),
    /// RDMA WRITE ping-pong latency, like ib_write_lat.
    Lat(PerfArgs),
    /// KV page transfer between two engines, using real layout plans.
    Pages(super::pages::PagesArgs),
    /// Put and get of KV page batches through the store (pagewire-store), with p50/p99.
    Store(super::store::StoreBenchArgs),
}

/// perftest's common flags plus pagewire's own (`--transport`, `--verify`, `--json`).
#[derive(Debug, Clone, Args)]
pub struct PerfArgs {
    /// Server address (`host` or `host:port`). Without it, and without `--server`, both
    /// ends run in this process.
    pub server_addr: Option<String>,

    /// Run as the server (wait for a client), as perftest does when given no address.
    #[arg(long, conflicts_with = "server_addr")]
    pub server: bool,

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

    /// Run for this many seconds instead of a fixed iteration count (disables peak BW).
    #[arg(short = 'D', long = "duration", value_parser = parse_duration)]
    pub duration: Option<f64>,

    /// Seconds trimmed at each end of a `-D` run (perftest default 2; at most D/4).
    #[arg(short = 'f', long = "margin", default_value_t = 2.0)]
    pub margin: f64,

    /// Queue pairs (verbs) or streams (TCP).
    #[arg(short = 'q', long = "qp", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub qps: u32,

    /// Maximum outstanding operations. Default 128 for bandwidth, 1 for latency.
    #[arg(short = 't', long = "tx-depth", value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub tx_depth: Option<u32>,

    /// Operations per submitted batch, each batch completing as one (perftest's CQ
    /// moderation). Default: half the TX depth, at most 100.
    #[arg(short = 'Q', long = "cq-mod", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub cq_mod: Option<u32>,

    /// RDMA device (default: the first one found).
    #[arg(short = 'd', long = "ib-dev")]
    pub device: Option<String>,

    /// GID index (default: picked by the verbs backend).
    #[arg(short = 'x', long = "gid-index")]
    pub gid_index: Option<u32>,

    /// Device port.
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    pub ib_port: u8,

    /// Side-channel port the server listens on.
    #[arg(short = 'p', long = "port", default_value_t = DEFAULT_PORT)]
    pub port: u16,

    /// Both sides issue operations; the client reports the sum.
    #[arg(short = 'b', long = "bidirectional")]
    pub bidirectional: bool,

    /// Report Gb/s (10^9 bit/s) instead of MiB/s.
    #[arg(long = "report_gbits", alias = "report-gbits")]
    pub report_gbits: bool,

    /// Do not compute peak bandwidth.
    #[arg(short = 'N', long = "noPeak", alias = "no-peak")]
    pub no_peak: bool,

    /// Accepted for perftest compatibility; pagewire times with a monotonic clock.
    #[arg(short = 'F', long = "CPU-freq", hide = true)]
    pub cpu_freq: bool,

    /// Transport backend.
    #[arg(long, value_enum, default_value_t = TransportArg::Auto)]
    pub transport: TransportArg,

    /// Verbs: who reaps completions. `manual` (default): only the bench's own waits, as
    /// perftest's loops do (no completion thread); `auto`: the engine's completion thread
    /// too. Every loop here waits for what it posted, so manual loses nothing, and in a
    /// guest with few vCPUs it keeps a thread's wake-ups off the spinning loops.
    /// `PAGEWIRE_PROGRESS` does not apply to these tests; this flag does.
    #[arg(long, value_enum)]
    pub progress: Option<ProgressArg>,

    /// The receiving side checks every size against a seeded byte pattern.
    #[arg(long)]
    pub verify: bool,

    /// lat only: spin on the last byte of the landing buffer, as ib_write_lat does, instead
    /// of waiting for the engine's notification. Valid where the last byte of a write lands
    /// last (RC verbs; the TCP backend's in-order copy); not with the loopback backend.
    #[arg(long)]
    pub poll_memory: bool,

    /// lat only: submit a new batch for every ping (validation, pinning and planning each
    /// time) instead of starting one prepared batch again, which is what ib_write_lat does
    /// with its work request.
    #[arg(long)]
    pub submit_each: bool,

    /// write/read only: before each size, post one TX depth of its work requests and wait
    /// for them, unmeasured, as perftest's flag of the same name does (the first size of
    /// a run otherwise also pays for cold caches and, under emulation, translation).
    #[arg(long = "perform_warm_up", alias = "perform-warm-up")]
    pub perform_warm_up: bool,

    /// One JSON record per result row on stdout instead of the perftest table.
    #[arg(long)]
    pub json: bool,

    /// Seconds any single wait may take before the run fails.
    #[arg(long, default_value_t = 30.0, hide = true)]
    pub timeout: f64,
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
